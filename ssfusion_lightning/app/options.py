"""The strategy options as ``ssfusion-train`` sees them, derived from SSFusionStrategy's signature.

The signature of ``SSFusionStrategy.__init__`` is the one list of the options and their defaults,
its docstring's ``Args`` the one description of each, and ssfusion_lightning/presets.py the one
definition of each preset. Everything else is derived from them:

- ``conf/ssfusion_strategy.yaml``: the base of every strategy preset: ``_target_`` and every option
  with its default and the first sentence of its description (generated here);
- ``conf/strategy/<preset>.yaml``: each preset's groups and the options where it differs from the
  base (generated here);
- the preset tables of README.md and docs/cli.md (generated here);
- the keys that the command line accepts under ``strategy.`` (app/validation.py reads them from
  the base yaml, so that it need not load torch);
- ``SSFusionStrategy.engine_config()``, the cross-rank check and the config saved in checkpoints
  (every option but ``NOT_IN_ENGINE_CONFIG``, in strategy.py).

After changing the signature, the docstring or a preset, run::

    python -m ssfusion_lightning.app.options          # rewrites the generated files
    python -m ssfusion_lightning.app.options --check  # exit status 1 if one is out of date

tests/test_options.py fails, naming the command, until the files match.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml

from ssfusion_lightning.app.config import STRATEGY_BASE, packaged_config_dir
from ssfusion_lightning.presets import PRESETS, SYSTEM_PRESETS, Preset
from ssfusion_lightning.strategy import DEFAULT_DENSITY, SSFusionStrategy

COMMAND = "python -m ssfusion_lightning.app.options"
#: keys of the strategy config that are not constructor options
CONFIG_KEYS = ("_target_", "name", "kind")
#: the groups that choose the sparsifier, the fusion policy and the communicator
GROUPS = ("sparsifier", "fusion", "comm")

#: SSFusionStrategy options that the strategy config leaves out, and where each comes from instead
NOT_IN_CONFIG: dict[str, str] = {
    "sparsifier": "the sparsifier group (its name, or an instance when the group sets constructor options)",
    "fusion": "the fusion group's name",
    "comm": "the comm group's name",
    "fusion_options": "the fusion group's other keys",
    "comm_options": "the comm group's other keys",
    "accelerator": "Lightning's Trainer (trainer.accelerator)",
    "parallel_devices": "Lightning's Trainer (trainer.devices, trainer.num_nodes)",
    "cluster_environment": "Lightning's Trainer (the cluster it detects)",
    "checkpoint_io": "Lightning's Trainer (Python only: trainer plugins)",
    "precision_plugin": "Lightning's Trainer (trainer.precision)",
    "process_group_backend": "Lightning's choice for the accelerator (Python only: gloo on CPU, nccl on CUDA)",
    "timeline": "Python only: the recording is read from strategy.timeline, which a config cannot reach",
}

#: options whose value in the config is not the Python default: name -> (value, what it means there)
CONFIG_VALUES: dict[str, tuple[Any, str]] = {
    # None means DEFAULT_DENSITY for a sparsifier given by name; the config always has a number, since
    # it is also the density of a sparsifier built from the group's options
    "density": (DEFAULT_DENSITY, ""),
    "timeout": (None, "In seconds here (null: torch's default)."),
    "start_method": ("auto", "auto (here): popen, or spawn under a Hydra multirun (docs/cli.md, Sweeps)."),
    "memory_options": ({}, "Added key by key: strategy.memory=adam +strategy.memory_options.feedback=0.9"),
    "dense_params": ([], "On the command line: 'strategy.dense_params=[\"*embed*\",\"*norm*\"]'"),
}

_WIDTH = 110
_PLAIN = (type(None), bool, int, float, str)


# ---------------------------------------------------------------- derived from the signature
def signature_defaults(cls: type = SSFusionStrategy) -> dict[str, Any]:
    """Every constructor option and its Python default, in the signature's order (``strategy.OPTIONS``
    for SSFusionStrategy: its keyword arguments)."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD}


def config_options(cls: type = SSFusionStrategy) -> dict[str, Any]:
    """The options of the strategy config and their defaults there, in the signature's order."""
    options = {}
    for name, default in signature_defaults(cls).items():
        if name in NOT_IN_CONFIG:
            continue
        value = CONFIG_VALUES[name][0] if name in CONFIG_VALUES else default
        if not isinstance(value, _PLAIN) and value not in ({}, []):
            raise TypeError(
                f"SSFusionStrategy's option {name}={value!r} has no value a config can hold: give it one in "
                f"CONFIG_VALUES, or name it in NOT_IN_CONFIG (ssfusion_lightning/app/options.py)"
            )
        options[name] = value
    return options


def docstring_entries(cls: type = SSFusionStrategy) -> dict[str, str]:
    """Option -> its description in the docstring's ``Args`` (an entry may describe several options)."""
    doc = inspect.getdoc(cls) or ""
    lines = doc.split("Args:\n", 1)[-1].splitlines()
    entries: list[str] = []
    for line in lines:
        if not line.strip():
            break
        if line.startswith("    ") and not line.startswith("     "):
            entries.append(line.strip())
        elif entries:
            entries[-1] += " " + line.strip()
    described = {}
    for entry in entries:
        match = re.match(r"((?:\w+, *)*\w+): (.*)", entry)
        if match:
            for name in re.split(r", *", match.group(1)):
                described[name] = match.group(2)
    return described


def first_sentence(text: str) -> str:
    return re.split(r'(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Z"`])', text, maxsplit=1)[0]


# ---------------------------------------------------------------- rendering
def _yaml_value(value: Any) -> str:
    return yaml.safe_dump({"k": value}, default_flow_style=True, width=1_000)[len("{k: ") : -2]


def _comment(text: str, indent: str = "") -> list[str]:
    text = text.replace("``", "`")
    return textwrap.wrap(text, _WIDTH - len(indent), initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ")


def render_base(cls: type = SSFusionStrategy) -> str:
    """conf/ssfusion_strategy.yaml."""
    described = docstring_entries(cls)
    lines = [
        f"# GENERATED by `{COMMAND}` from the signature and docstring of SSFusionStrategy",
        "# (ssfusion_lightning/strategy.py): edit those, then run it again.",
        "#",
        "# The base of every ssfusion strategy preset: conf/strategy/<preset>.yaml inherits it and lists only",
        "# what differs. The job's strategy is hydra.utils.instantiate of this node (name and kind aside) with",
        "# sparsifier=<sparsifier group>, fusion=<fusion group>, comm=<comm group> (app/builders.py); a preset",
        "# picks those groups, and sparsifier=/fusion=/comm= on the command line win.",
        f"_target_: {cls.__module__}.{cls.__qualname__}",
        "# the preset's name (in results.json and the sweep summary)",
        "name: ???",
        "# ssfusion: SSFusionStrategy; ddp (conf/strategy/ddp.yaml): Lightning's DDP",
        "kind: ssfusion",
    ]
    previous = None
    for name, value in config_options(cls).items():
        description = described.get(name, "")
        if description != previous:
            note = CONFIG_VALUES.get(name, (None, ""))[1]
            lines += _comment(" ".join(filter(None, [first_sentence(description), note])))
        previous = description
        lines.append(f"{name}: {_yaml_value(value)}")
    return "\n".join(lines) + "\n"


def preset_differences(preset: Preset) -> dict[str, Any]:
    """The preset's strategy options that differ from the base config."""
    base = config_options()
    options = {"offload": preset.offload, **preset.options}
    unknown = sorted(set(options) - set(base))
    if unknown:
        raise ValueError(f"preset options {unknown} are not options of the strategy config")
    return {key: value for key, value in options.items() if value != base[key]}


def render_preset(name: str) -> str:
    """conf/strategy/<name>.yaml."""
    preset = PRESETS[name]
    lines = [
        "# @package _global_",
        f"# GENERATED from ssfusion_lightning/presets.py by `{COMMAND}`: edit there.",
        *_comment(preset.description),
        "defaults:",
        f"  - /{STRATEGY_BASE}@strategy",
        *(f"  - override /{group}: {getattr(preset, group)}" for group in GROUPS),
        "  - _self_",
        "",
        "strategy:",
        f"  name: {name}",
        *(f"  {key}: {_yaml_value(value)}" for key, value in preset_differences(preset).items()),
    ]
    if preset.comm_options:
        lines += ["comm:", "  options:", *(f"    {key}: {_yaml_value(value)}" for key, value in preset.comm_options.items())]
    return "\n".join(lines) + "\n"


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def presets_table() -> str:
    """docs/cli.md's table: every ``strategy=`` choice."""
    base = config_options()
    rows = [
        _row(["`strategy=`", "sparsifier", "fusion", "comm", "offload", "groups", "what it is"]),
        _row(["---"] * 7).replace(" ", ""),
        _row(["`ddp`", "–", "–", "dense all-reduce", "–", "–", "Lightning's DDP (dense baseline)"]),
    ]
    for name, preset in PRESETS.items():
        groups = preset.options.get("process_groups", base["process_groups"])
        rows.append(_row([f"`{name}`", preset.sparsifier, preset.fusion, preset.comm_label, preset.offload, groups, preset.description]))
    return "\n".join(rows)


def systems_table() -> str:
    """README.md's table: the Lightning strategy names."""
    rows = [_row(["strategy name", "sparsifier", "fusion", "comm", "offload", "what it is"]), _row(["---"] * 6).replace(" ", "")]
    for name, (description, kwargs) in SYSTEM_PRESETS.items():
        preset = PRESETS[name.removesuffix("_spawn")]
        rows.append(_row([f"`{name}`", kwargs["sparsifier"], kwargs["fusion"], preset.comm_label, kwargs["offload"], description]))
    return "\n".join(rows)


BEGIN = f"<!-- generated from ssfusion_lightning/presets.py by {COMMAND}: edit there -->"
END = "<!-- end of the generated table -->"


def _with_table(text: str, table: str, path: Path) -> str:
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"{path} has no generated table (between {BEGIN!r} and {END!r})")
    return text[: begin + len(BEGIN)] + "\n" + table + "\n" + text[end:]


# ---------------------------------------------------------------- the files
def generated_files(repo: Path | None = None) -> dict[Path, str]:
    """Path -> the content it must have. The Markdown tables only where the repository's docs are
    there (not in an installed package)."""
    conf = packaged_config_dir()
    files = {conf / f"{STRATEGY_BASE}.yaml": render_base()}
    files.update({conf / "strategy" / f"{name}.yaml": render_preset(name) for name in PRESETS})
    repo = repo or Path(__file__).resolve().parents[2]
    for relative, table in (("README.md", systems_table()), ("docs/cli.md", presets_table())):
        path = repo / relative
        if path.exists():
            files[path] = _with_table(path.read_text(), table, path)
    return files


def stale_files(repo: Path | None = None) -> list[Path]:
    """The generated files whose content is not what it must be, and generated preset yamls of presets that are gone."""
    stale = [path for path, text in generated_files(repo).items() if not path.exists() or path.read_text() != text]
    return stale + orphans()


def orphans() -> list[Path]:
    """Generated preset yamls whose preset is no longer in presets.py."""
    return [
        path
        for path in sorted((packaged_config_dir() / "strategy").glob("*.yaml"))
        if path.stem not in PRESETS and "GENERATED from ssfusion_lightning/presets.py" in path.read_text()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit status 1 if a file is out of date")
    args = parser.parse_args(argv)
    stale = stale_files()
    if args.check:
        for path in stale:
            print(f"out of date: {path}")
        return 1 if stale else 0
    expected = generated_files()
    for path in stale:
        if path in expected:
            path.write_text(expected[path])
            print(f"wrote {path}")
        else:
            path.unlink()
            print(f"removed {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

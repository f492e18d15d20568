"""One source of truth for the strategy options and the presets.

``SSFusionStrategy.__init__``'s signature is the list of the options and their defaults, its
docstring the description of each, and ssfusion_lightning/presets.py the presets. Adding an option
takes two edits, the signature and its docstring entry, then ``python -m ssfusion_lightning.app.options``
to regenerate what is derived (test_generated_files_are_up_to_date fails, naming that command, until then):

- the base strategy config conf/ssfusion_strategy.yaml gets the option, its default and its description
  (test_every_option_is_in_the_base_config_or_python_only, test_a_new_option_reaches_the_base_config);
- ``strategy.<option>=...`` on the command line then works, and app/validation.py accepts the key: it
  reads the keys from that yaml (test_validation_knows_the_options_of_the_base_config);
- app/builders.py passes every key of the strategy config to the constructor through
  ``hydra.utils.instantiate``, without a list of its own (test_the_builder_passes_every_option);
- ``engine_config()`` (the cross-rank check and the config saved in checkpoints) holds every option
  but the explicit exclusions (test_engine_config_holds_every_option_but_the_exclusions).

What stays a decision, not a copy: an option that a config cannot hold is named in
``app/options.py`` ``NOT_IN_CONFIG`` (or given a config value in ``CONFIG_VALUES``); an option that
ranks may differ in goes into ``NOT_IN_ENGINE_CONFIG``; every other one needs its resume rule in
``engine/state.py`` ``RESUME_RULES`` (what a resumed run does when it changed; tests/test_resume_config.py
asks for it); a torch-free early check with a friendlier message is optional
(``app/validation.py`` ``_SSFUSION_RULES``; without one, the constructor's own check still stops
the job before launch).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf

from ssfusion_lightning import strategy as strategy_module
from ssfusion_lightning.app import options as opts
from ssfusion_lightning.app import validation
from ssfusion_lightning.app.builders import build_strategy
from ssfusion_lightning.app.config import STRATEGY_BASE, compose_config, packaged_config_dir
from ssfusion_lightning.presets import PRESETS, SYSTEM_PRESETS, SYSTEMS
from ssfusion_lightning.strategy import NOT_IN_ENGINE_CONFIG, OPTIONS, SSFusionStrategy

CONF = packaged_config_dir()


def compose(*overrides: str):
    return compose_config([*overrides, "paths.output_dir=unused"])


def base_config() -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / f"{STRATEGY_BASE}.yaml"))


# ---------------------------------------------------------------- the options
def test_generated_files_are_up_to_date():
    stale = opts.stale_files()
    assert not stale, f"out of date: {', '.join(map(str, stale))}; run `{opts.COMMAND}`"


def test_every_option_is_in_the_base_config_or_python_only():
    """The signature enumerated against the configs: each option is a key of the base strategy
    config, with the default of the signature (or the config's own value, ``CONFIG_VALUES``), or
    named as Python-only in ``NOT_IN_CONFIG``; and each is described in the docstring."""
    base = base_config()
    defaults = inspect.signature(SSFusionStrategy.__init__).parameters
    assert OPTIONS == tuple(name for name in defaults if name not in ("self", "unknown"))
    assert set(opts.NOT_IN_CONFIG) <= set(OPTIONS) and set(opts.CONFIG_VALUES) <= set(OPTIONS)
    assert list(base) == [*opts.CONFIG_KEYS, *(name for name in OPTIONS if name not in opts.NOT_IN_CONFIG)]
    for name in OPTIONS:
        if name in opts.NOT_IN_CONFIG:
            assert name not in base
            continue
        expected = opts.CONFIG_VALUES[name][0] if name in opts.CONFIG_VALUES else defaults[name].default
        assert base[name] == expected, name
    assert base["_target_"] == "ssfusion_lightning.strategy.SSFusionStrategy"
    undocumented = set(OPTIONS) - set(opts.docstring_entries())
    assert not undocumented, f"SSFusionStrategy's docstring does not describe {sorted(undocumented)}"


def test_a_new_option_reaches_the_base_config():
    """What the second edit buys: a new keyword argument and its docstring entry are all the base
    config needs (shown on a subclass, since the real signature is the one under test above)."""
    signature = inspect.signature(SSFusionStrategy.__init__)
    knob = inspect.Parameter("example_knob", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=7)
    parameters = list(signature.parameters.values())

    class WithKnob(SSFusionStrategy):
        def __init__(self, *args, example_knob: int = 7, **kwargs):
            super().__init__(*args, **kwargs)
            self.example_knob = example_knob

    WithKnob.__init__.__signature__ = signature.replace(parameters=[*parameters[:-1], knob, parameters[-1]])
    WithKnob.__doc__ = inspect.getdoc(SSFusionStrategy) + "\n    example_knob: how far to turn it. More than a config needs."
    text = opts.render_base(WithKnob).replace(f"{__name__}.{WithKnob.__qualname__}", "ssfusion_lightning.strategy.SSFusionStrategy")
    assert text.endswith("\n# how far to turn it.\nexample_knob: 7\n")
    assert text.removesuffix("# how far to turn it.\nexample_knob: 7\n") == opts.render_base()


def test_validation_knows_the_options_of_the_base_config():
    """The command line checks keys before torch loads: from the base yaml, so it follows the signature."""
    assert validation.SSFUSION_OPTIONS == tuple(name for name in base_config() if name not in opts.CONFIG_KEYS)
    assert set(validation._SSFUSION_RULES) <= {"name", *validation.SSFUSION_OPTIONS}  # no check of a gone option


def test_every_option_can_be_overridden_on_the_command_line():
    """No option needs a leading ``+``: the base config holds them all."""
    overrides = [f"strategy.{name}={OmegaConf.to_yaml({'v': value})[3:].strip()}" for name, value in opts.config_options().items()]
    assert OmegaConf.to_container(compose("strategy=safusion", *overrides).strategy) == {
        **base_config(), "name": "safusion"
    }


class Recording(SSFusionStrategy):
    """Records the keyword arguments it was built with."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.received = kwargs


def test_the_builder_passes_every_option():
    """build_strategy instantiates the config's ``_target_`` with every key of the strategy config
    (name and kind aside) plus the groups: it keeps no list of options of its own."""
    cfg = compose("strategy=zen", "strategy.timeout=90", f"strategy._target_={__name__}.Recording")
    built = build_strategy(cfg)
    assert isinstance(built, Recording)
    assert set(built.received) == {*opts.config_options(), "sparsifier", "fusion", "comm", "comm_options"}


def test_engine_config_holds_every_option_but_the_exclusions():
    """The fingerprint covers every option by construction; the exclusions are explicit and pinned here,
    so that changing them is a decision (resume and the cross-rank check rely on them)."""
    assert NOT_IN_ENGINE_CONFIG == {
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "checkpoint_io",
        "precision_plugin",
        "process_group_backend",
        "timeout",
        "start_method",
        "broadcast_buffers",
        "timeline",
    }
    config = SSFusionStrategy().engine_config()
    assert list(config) == [name for name in OPTIONS if name not in NOT_IN_ENGINE_CONFIG]
    assert strategy_module.OPTIONS is OPTIONS


# ---------------------------------------------------------------- the presets
def test_every_preset_yaml_is_a_preset():
    names = {path.stem for path in (CONF / "strategy").glob("*.yaml")}
    assert names == {"ddp", *PRESETS}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_yaml_composes_to_the_preset(name):
    """Every preset yaml against presets.py, exactly: the groups it picks, and the base config with
    its own name and the options where it differs."""
    cfg = compose(f"strategy={name}")
    preset = PRESETS[name]
    assert (cfg.sparsifier.name, cfg.fusion.name, cfg.comm.name) == (preset.sparsifier, preset.fusion, preset.comm)
    expected = {**base_config(), "name": name, "offload": preset.offload, **preset.options}
    assert OmegaConf.to_container(cfg.strategy) == expected
    group_options = OmegaConf.to_container(compose(f"comm={preset.comm}").comm.options)
    assert OmegaConf.to_container(cfg.comm.options) == {**group_options, **preset.comm_options}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_what_its_kwargs_build(name):
    """The command line's preset and ``SSFusionStrategy(**preset.kwargs)`` agree, but for what the
    group configs add (the sparsifier's and communicators' constructor options)."""
    from_groups = {"sparsifier", "fusion_options", "comm_options"}
    built = build_strategy(compose(f"strategy={name}")).engine_config()
    direct = SSFusionStrategy(**PRESETS[name].kwargs).engine_config()
    assert {k: v for k, v in built.items() if k not in from_groups} == {k: v for k, v in direct.items() if k not in from_groups}
    assert PRESETS[name].comm_options.items() <= built["comm_options"].items()


def test_the_systems_are_registered_with_lightning():
    assert set(SYSTEM_PRESETS) == {*SYSTEMS, "ssfusion_spawn"}
    for name, (description, kwargs) in SYSTEM_PRESETS.items():
        entry = StrategyRegistry[name]
        assert entry["strategy"] is SSFusionStrategy and entry["init_params"] == kwargs
        assert entry["description"] == description
        preset = PRESETS[name.removesuffix("_spawn")]
        assert kwargs == {**preset.kwargs, "start_method": "spawn" if name.endswith("_spawn") else "popen"}


def test_readme_table_lists_the_registered_names():
    """Generated (test_generated_files_are_up_to_date); read back here as a reader sees it."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = text.split(opts.BEGIN, 1)[1].split(opts.END, 1)[0].strip().splitlines()[2:]
    rows = {cells[0].strip("`"): cells[1:5] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in table)}
    trial = {name: kwargs.get("comm_options", {}).get("dense_trial_steps") for name, (_, kwargs) in SYSTEM_PRESETS.items()}
    assert rows == {
        name: [kwargs["sparsifier"], kwargs["fusion"], kwargs["comm"] + (" + dense trial" if trial[name] else ""), kwargs["offload"]]
        for name, (_, kwargs) in SYSTEM_PRESETS.items()
    }
    assert {name for name, steps in trial.items() if steps} == {"safusion", "adtopk", "zen", "oktopk"}

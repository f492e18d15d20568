"""Checks of a job's config that run before torch and Lightning load, so a bad value is answered at once.

Every failure is a :class:`ConfigError` whose message names the key, the bad value and what is
valid. ``ssfusion-train`` checks each job's config with :func:`check_config` before torch or
Lightning load. The builders run the same checks, so a config composed in Python gets the same
messages. Whatever these checks let through is still checked by the
objects built from the config (SSFusionStrategy, Lightning's Trainer, the datamodule), and
ssfusion_lightning.train reports their errors as config errors too.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omegaconf import OmegaConf

from ssfusion_lightning.app.config import STRATEGY_BASE, packaged_config_dir

STRATEGY_KINDS = ("ssfusion", "ddp")
START_METHODS = ("auto", "popen", "spawn", "fork", "forkserver")
#: keys of the strategy group that are not SSFusionStrategy arguments (besides Hydra's ``_target_``)
STRATEGY_KEYS = ("name", "kind")


def _strategy_options() -> tuple[str, ...]:
    # The base config is generated from SSFusionStrategy's signature (app/options.py, which
    # tests/test_options.py keeps in step): its keys are the options, read here without loading torch.
    base = OmegaConf.load(packaged_config_dir() / f"{STRATEGY_BASE}.yaml")
    return tuple(key for key in base if key not in ("_target_", *STRATEGY_KEYS))


#: the SSFusionStrategy options of the ``strategy`` group, in the signature's order
SSFUSION_OPTIONS = _strategy_options()

# The choices below are defined next to torch code (the memory registry, SSFusionStrategy's
# OFFLOAD_CHOICES, the engine's NONFINITE_POLICIES); they are repeated here so that checking them
# loads no torch, and tests/test_cli.py keeps the copies equal to the originals.
MEMORY_CHOICES = ("adam", "auto", "dgc", "none", "residual")
OFFLOAD_CHOICES = ("none", "thread", "stream", "auto")
NONFINITE_CHOICES = ("raise", "skip")
GPU_ACCELERATORS = ("gpu", "cuda")
#: device nodes of the drivers through which torch.cuda can see a GPU
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
#: Lightning's loggers that need a package outside the project's dependencies
OPTIONAL_LOGGER_PACKAGES = {"TensorBoardLogger": ("tensorboard", "tensorboardX")}


class ConfigError(ValueError):
    """A config value the job cannot run with; the message names the key, the value and what is valid."""


def show(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    return str(value)


def invalid(key: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"invalid value {key}={show(value)}; valid: {valid}")


def check_choice(key: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise invalid(key, value, f"one of {', '.join(choices)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rule(accepts: Callable[[Any], bool], valid: str) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        if not accepts(value):
            raise invalid(key, value, valid)

    return check


def _choice_rule(choices: Sequence[str]) -> Callable[[str, Any], None]:
    return lambda key, value: check_choice(key, value, choices)


#: the checks of the strategy options that can be made here, without torch; an option without one
#: is checked by SSFusionStrategy itself when the job is built (still before any rank is launched)
_SSFUSION_RULES: dict[str, Callable[[str, Any], None]] = {
    "name": _rule(lambda v: isinstance(v, str), "a string"),
    "start_method": _choice_rule(START_METHODS),
    "density": _rule(lambda v: _is_number(v) and 0 < v <= 1, "a number with 0 < density <= 1"),
    "memory": _choice_rule(MEMORY_CHOICES),
    "buffer_mb": _rule(lambda v: v == "auto" or (_is_number(v) and v > 0), "auto, or a number of MiB > 0"),
    "first_buffer_mb": _rule(lambda v: v is None or (_is_number(v) and v > 0), "a number of MiB > 0, or null (= buffer_mb)"),
    "process_groups": _rule(lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "ranks_per_node": _rule(lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1, or null (Lightning's devices per node)"),
    "offload": _choice_rule(OFFLOAD_CHOICES),
    "warmup_steps": _rule(lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "density_warmup_steps": _rule(lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0: no density warm-up)"),
    "density_warmup_epochs": _rule(lambda v: _is_number(v) and v >= 0, "a number of epochs >= 0 (0: no density warm-up)"),
    "density_warmup_stages": _rule(lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "dense_params": _rule(
        lambda v: isinstance(v, (list, tuple)) and all(isinstance(p, str) and p for p in v),
        "a list of parameter-name patterns (fnmatch), e.g. ['*embed*', '*norm*']",
    ),
    "find_unused_parameters": _rule(lambda v: isinstance(v, bool), "true or false"),
    "broadcast_buffers": _rule(lambda v: isinstance(v, bool), "true or false"),
    "nonfinite": _choice_rule(NONFINITE_CHOICES),
    "timeout": _rule(lambda v: v is None or (_is_number(v) and v > 0), "a number of seconds > 0, or null (torch's default)"),
    "memory_options": _rule(lambda v: isinstance(v, Mapping), "a mapping of the memory's constructor options"),
}


def plain(node: Any) -> Any:
    """A DictConfig/ListConfig as plain Python containers (resolved); anything else unchanged."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return node


def check_strategy(strategy: Mapping[str, Any]) -> None:
    """The ``strategy`` group: its kind, and for ``ssfusion`` every key and value."""
    options = dict(plain(strategy))
    kind = options.get("kind")
    check_choice("strategy.kind", kind, STRATEGY_KINDS)
    if "start_method" in options:
        check_choice("strategy.start_method", options["start_method"], START_METHODS)
    if kind != "ssfusion":
        return
    valid_keys = STRATEGY_KEYS + SSFUSION_OPTIONS
    for key, value in options.items():
        if key in ("kind", "_target_"):
            continue
        if key not in valid_keys:
            raise ConfigError(f"unknown key strategy.{key}; valid keys of strategy: {', '.join(valid_keys)}")
        rule = _SSFUSION_RULES.get(key)
        if rule is not None:
            rule(f"strategy.{key}", value)


def _parse_devices(devices: Any) -> int | list[int] | str | None:
    """``trainer.devices`` as a count (-1: every device), a list of device indices or ``auto``; None if malformed."""
    if devices == "auto" or _is_int(devices):
        return devices
    if isinstance(devices, str):
        text = devices.strip()
        if text.lstrip("-").isdigit():
            return int(text)
        devices = text.split(",")  # "0,1": GPU indices
        if not all(part.strip().isdigit() for part in devices):
            return None
        devices = [int(part) for part in devices]
    if isinstance(devices, (list, tuple)) and devices and all(_is_int(d) and d >= 0 for d in devices):
        return list(devices)
    return None


def _cuda_device_count() -> int:
    # Without a GPU driver's device node (NVIDIA, WSL's GPU bridge, ROCm) torch can see no GPU:
    # answer at once instead of loading torch (seconds) to say so. Where one exists, torch decides.
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_trainer(trainer: Mapping[str, Any]) -> None:
    """What Lightning would reject only after loading: the devices and the node count, and for a GPU
    accelerator whether torch sees the GPUs here, before any rank is launched."""
    options = dict(plain(trainer))
    accelerator = options.get("accelerator", "auto")
    gpu = accelerator in GPU_ACCELERATORS
    devices = options.get("devices", "auto")
    parsed = _parse_devices(devices)
    if gpu and (parsed is None or (isinstance(parsed, int) and parsed < 1 and parsed != -1)):
        raise invalid("trainer.devices", devices, "a number of GPUs >= 1, -1 (every GPU), auto, or a list of GPU indices")
    # Lightning's CPU accelerator takes a process count only.
    if not gpu and not (parsed == "auto" or (isinstance(parsed, int) and parsed >= 1)):
        raise invalid("trainer.devices", devices, "a number of processes >= 1, or auto")
    num_nodes = options.get("num_nodes", 1)
    if not (_is_int(num_nodes) and num_nodes >= 1):
        raise invalid("trainer.num_nodes", num_nodes, "an integer >= 1")
    if not gpu:
        return
    available = _cuda_device_count()
    if available == 0:
        raise invalid(
            "trainer.accelerator",
            accelerator,
            "cpu on this machine, where torch sees no CUDA GPU (torch.cuda.is_available() is False): "
            "trainer=ddp_cpu or trainer=cpu",
        )
    needed = max(parsed) + 1 if isinstance(parsed, list) else parsed if isinstance(parsed, int) else 0
    if needed > available:
        raise invalid("trainer.devices", devices, f"at most {available} GPU(s) here (indices 0..{available - 1}), -1 or auto")


def check_loggers(loggers: Any) -> None:
    """Each configured logger whose package is optional must have it installed."""
    # Only _target_ is read: save_dir (${paths.output_dir}) need not resolve, which it only does inside a Hydra job.
    if OmegaConf.is_config(loggers):
        loggers = OmegaConf.to_container(loggers, resolve=False)
    for key, node in (loggers or {}).items():
        target = str((node or {}).get("_target_", ""))
        packages = OPTIONAL_LOGGER_PACKAGES.get(target.rsplit(".", 1)[-1], ())
        if packages and not any(importlib.util.find_spec(p) for p in packages):
            raise ConfigError(
                f"invalid value logger.{key} ({target}): it needs the {packages[0]} package, which is not installed "
                f"(pip install {packages[0]}); valid without it: logger=csv or logger=none"
            )


def check_adam_memory(cfg: Mapping[str, Any]) -> None:
    """``strategy.memory=adam`` computes the task's AdamW step and sends the update: an SGD task or
    the Trainer's clipping (which would clip the averaged update) is refused before any rank starts."""
    strategy = cfg["strategy"]
    if strategy.get("kind") != "ssfusion" or strategy.get("memory") != "adam":
        return
    optimizer = (cfg.get("model") or {}).get("optimizer")
    if optimizer not in (None, "adamw"):
        raise ConfigError(
            f"strategy.memory=adam computes AdamW's step, but model.optimizer={show(optimizer)}; "
            "use model.optimizer=adamw, or strategy.memory=dgc (SGD with momentum) or residual"
        )
    clip = cfg["trainer"].get("gradient_clip_val")
    if clip:
        raise ConfigError(
            f"strategy.memory=adam sends Adam updates, so trainer.gradient_clip_val={show(clip)} would clip the averaged "
            f"update; set trainer.gradient_clip_val=null and +strategy.memory_options.clip_norm={show(clip)} (each rank's "
            "gradient, before its moments)"
        )


def check_config(cfg: Mapping[str, Any]) -> None:
    """Everything checkable before the job's objects are built (without torch, except for a GPU job)."""
    check_strategy(cfg["strategy"])
    check_trainer(cfg["trainer"])
    check_loggers(cfg.get("logger"))
    check_adam_memory(cfg)


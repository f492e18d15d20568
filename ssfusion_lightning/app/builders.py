"""Build the job's objects from the composed config: datamodule, task, strategy, loggers, callbacks."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from ssfusion_lightning.app.validation import START_METHODS, check_choice, check_strategy, invalid, plain

if TYPE_CHECKING:  # the command line imports this module before it may load Lightning
    from lightning.pytorch import Callback, LightningDataModule, LightningModule
    from lightning.pytorch.loggers import Logger

log = logging.getLogger(__name__)

def _split_name(node: Any, group: str) -> tuple[str, dict[str, Any]]:
    options = dict(plain(node) or {})
    name = options.pop("name", None)
    if not isinstance(name, str):
        raise ValueError(f"the {group} config needs a string 'name' (got {name!r}); pick one with {group}=<name>")
    return name, options


# ---------------------------------------------------------------- data and model
def build_datamodule(data_cfg: Any) -> LightningDataModule:
    from ssfusion_lightning.data import build_datamodule as build

    name, options = _split_name(data_cfg, "data")
    return build(name, **options)


def _model_kind(parameters: Mapping[str, inspect.Parameter]) -> str | None:
    if "num_classes" in parameters:
        return "image"
    if "vocab_size" in parameters:
        return "token"
    return None


def wire_model_kwargs(model_name: str, size: str, kwargs: dict[str, Any], datamodule: Any) -> dict[str, Any]:
    """Fill the model's data-dependent arguments from the datamodule, unless the config sets them.

    Images: ``num_classes``, ``in_channels`` and (ViT) ``image_size``. Tokens: ``vocab_size``, and
    ``max_positions`` grown to the sequence length when the size's default is shorter.
    """
    from ssfusion_lightning.data import ImageDataModule, TokenDataModule
    from ssfusion_lightning.models.factory import MODELS

    spec = MODELS.get(model_name)
    parameters = inspect.signature(spec.constructor).parameters
    defaults = {**{k: p.default for k, p in parameters.items()}, **spec.sizes.get(size, {})}
    kind = _model_kind(parameters)
    wired = dict(kwargs)

    def fill(key: str, value: Any) -> None:
        if key in parameters and key not in wired:
            wired[key] = value

    if isinstance(datamodule, ImageDataModule):
        if kind != "image":
            raise ValueError(f"model {model_name!r} does not classify images, but the data yields images")
        fill("num_classes", datamodule.num_classes)
        fill("in_channels", datamodule.image_shape[0])
        fill("image_size", datamodule.image_shape[-1])
    elif isinstance(datamodule, TokenDataModule):
        if kind != "token":
            raise ValueError(f"model {model_name!r} is not a language model, but data yields token sequences")
        fill("vocab_size", datamodule.vocab_size)
        current = defaults.get("max_positions")
        if "max_positions" in parameters and isinstance(current, int) and current < datamodule.seq_len:
            fill("max_positions", datamodule.seq_len)
    return wired


def build_task(model_cfg: Any, datamodule: Any) -> LightningModule:
    """The LightningModule: ImageClassifier for image data, LanguageModel for token data."""
    from ssfusion_lightning.data import ImageDataModule, TokenDataModule
    from ssfusion_lightning.models import ImageClassifier, LanguageModel, build_model

    options = dict(plain(model_cfg))
    name = options.pop("name")
    size = options.pop("size", "tiny")
    kwargs = dict(options.pop("kwargs", None) or {})
    kwargs = wire_model_kwargs(name, size, kwargs, datamodule)
    model = build_model(name, size, **kwargs)
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    if isinstance(datamodule, ImageDataModule):
        return ImageClassifier(model, num_classes=datamodule.num_classes, **options)
    if isinstance(datamodule, TokenDataModule):
        return LanguageModel(model, **options)
    raise TypeError(f"no task for datamodule {type(datamodule).__name__}")


# ---------------------------------------------------------------- strategy
def _single_process(trainer_cfg: Mapping[str, Any] | None) -> bool:
    """Whether the trainer runs one process in all (nothing to launch)."""
    if not trainer_cfg:
        return False
    devices = trainer_cfg.get("devices")
    one_device = devices in (1, "1") or (isinstance(devices, (list, tuple)) and len(devices) == 1)
    return one_device and trainer_cfg.get("num_nodes", 1) in (1, "1")


def resolve_start_method(value: str, multirun: bool, single_process: bool = False) -> str:
    """``auto``: spawn under a Hydra multirun, else popen (see docs/cli.md, "Sweeps").

    Lightning's popen launcher starts ranks 1.. by re-running the command line; under a multirun
    that command line is the whole sweep, so every job's rank 1 would start a sweep of its own.
    Spawned ranks get the job's objects instead. A single process launches nothing: popen then.
    """
    check_choice("strategy.start_method", value, START_METHODS)
    if value == "auto":
        return "spawn" if multirun and not single_process else "popen"
    if value == "popen" and multirun and not single_process:
        log.warning(
            "strategy.start_method=popen under a multirun: unless the ranks are launched externally (SLURM, "
            "torchrun), Lightning re-runs the sweep's command line for rank 1, which starts a second sweep; "
            "use strategy.start_method=auto"
        )
    return value


def build_sparsifier_spec(sparsifier_cfg: Any, density: float) -> Any:
    """The ``sparsifier=`` argument: the name, or an instance when the group sets constructor options.

    ``density`` is a strategy-level option (``strategy.density``); a ``density`` key in the sparsifier
    config is ignored (with a warning when it differs).
    """
    import ssfusion_lightning as ssf

    name, options = _split_name(sparsifier_cfg, "sparsifier")
    own_density = options.pop("density", None)
    if own_density is not None and own_density != density:
        log.warning(
            "sparsifier.density=%s is ignored: the strategy's density (strategy.density=%s) applies",
            own_density,
            density,
        )
    if not options:
        return name
    return ssf.build_sparsifier(name, density=density, **options)


def _named_options(node: Any, group: str) -> tuple[str, dict[str, Any]]:
    """``name`` plus the constructor options of a fusion/comm config (flat keys, or nested under ``options``)."""
    name, options = _split_name(node, group)
    nested = options.pop("options", None) or {}
    return name, {**options, **nested}


def _component_kwargs(node: Any, group: str) -> dict[str, Any]:
    """``{group: name}``, plus ``{group}_options`` (the constructor options) when the config has any."""
    name, options = _named_options(node, group)
    return {group: name, f"{group}_options": options} if options else {group: name}


def build_strategy(cfg: DictConfig | Mapping[str, Any], multirun: bool = False) -> Any:
    """The strategy: ``hydra.utils.instantiate`` of the strategy config (its ``_target_``, SSFusionStrategy
    in conf/ssfusion_strategy.yaml) with the sparsifier/fusion/comm groups, or the dense baseline as
    Lightning's ``"ddp"`` (``"ddp_spawn"`` when its ranks are spawned)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from ssfusion_lightning.strategy import DEFAULT_DENSITY, SSFusionStrategy

    options = dict(plain(cfg["strategy"]))
    check_strategy(options)
    kind = options.pop("kind")
    options.pop("name", None)
    start_method = resolve_start_method(
        options.pop("start_method", "auto"), multirun, _single_process(plain(cfg.get("trainer")))
    )
    if kind == "ddp":
        unused = bool(options.get("find_unused_parameters", False))
        if start_method == "forkserver":  # no registered name for it
            from lightning.pytorch.strategies import DDPStrategy

            return DDPStrategy(start_method="forkserver", find_unused_parameters=unused)
        name = "ddp" if start_method == "popen" else f"ddp_{start_method}"
        return f"{name}_find_unused_parameters_true" if unused else name
    options.setdefault("_target_", f"{SSFusionStrategy.__module__}.{SSFusionStrategy.__qualname__}")
    # what the config cannot hold: the sparsifier instance, the time-out as a timedelta
    built: dict[str, Any] = {"start_method": start_method}
    seconds = options.pop("timeout", None)  # null: torch's default
    if seconds is not None:
        built["timeout"] = timedelta(seconds=seconds)
    built["sparsifier"] = build_sparsifier_spec(cfg["sparsifier"], options.get("density", DEFAULT_DENSITY))
    if not isinstance(built["sparsifier"], str):  # an instance carries the density (the strategy refuses both)
        options.pop("density", None)
    # a partial, called here: the strategy's own errors (a bad value) reach the caller as they are
    try:
        strategy = instantiate(options, _partial_=True, _convert_="all")
    except InstantiationException as error:  # a _target_ that does not import
        message = str(error).split(", set env var")[0]
        raise invalid("strategy._target_", options["_target_"], f"an importable class ({message})") from error
    return strategy(**built, **_component_kwargs(cfg["fusion"], "fusion"), **_component_kwargs(cfg["comm"], "comm"))


# ---------------------------------------------------------------- loggers and callbacks
def _instantiate_all(node: Any) -> list[Any]:
    from hydra.utils import instantiate

    if node is None:
        return []
    items = node.values() if isinstance(node, Mapping) or OmegaConf.is_dict(node) else node
    built = []
    for item in items:
        if item is not None and "_target_" in item:
            built.append(instantiate(item))
    return built


def build_loggers(logger_cfg: Any) -> list[Logger]:
    return _instantiate_all(logger_cfg)


def build_callbacks(callbacks_cfg: Any, has_logger: bool) -> list[Callback]:
    from lightning.pytorch.callbacks import LearningRateMonitor

    callbacks = _instantiate_all(callbacks_cfg)
    if not has_logger:
        # LearningRateMonitor refuses to run without a logger; drop it rather than fail the job.
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    return callbacks

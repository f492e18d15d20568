"""SSFusionStrategy: Lightning glue around the fusion engine (lifecycle, groups, checkpoints).

Subclasses DDPStrategy so Lightning's DistributedSampler and sync_dist keep working, but never
wraps the model in DistributedDataParallel: gradients are exchanged by the engine instead.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import pickle
import sys
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator, Iterable, Literal, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ssfusion_lightning.comm import COMMUNICATORS, ChannelSet
from ssfusion_lightning.comm.topology import Hierarchy, create_hierarchy
from ssfusion_lightning.engine.engine import NONFINITE_POLICIES, EngineConfig, FusionEngine
from ssfusion_lightning.engine.errors import CommunicationError
from ssfusion_lightning.engine.metrics import StepMetrics
from ssfusion_lightning.engine.state import CHECKPOINT_KEY, ResumeChanges, gather_to_rank0, plain, resume_changes
from ssfusion_lightning.engine.state import FORMAT as ENGINE_STATE_FORMAT
from ssfusion_lightning.fusion import FUSION_POLICIES
from ssfusion_lightning.presets import SYSTEM_PRESETS
from ssfusion_lightning.sparsifiers import MEMORIES, SPARSIFIERS, Sparsifier, validate_density
from ssfusion_lightning.sparsifiers.adam_memory import SCALED_GRADIENTS_REFUSED, AdamMemory
from ssfusion_lightning.sparsifiers.memory import DGCMemory
from ssfusion_lightning.sparsifiers.memory_choice import AUTO, check_auto_options, choose_memory
from ssfusion_lightning.sparsifiers.schedule import DensityWarmup
from ssfusion_lightning.timeline import Timeline

log = logging.getLogger(__name__)

OFFLOAD_CHOICES = ("none", "thread", "stream", "auto")
#: density of a sparsifier given by name when ``density`` is not passed
DEFAULT_DENSITY = 0.01
_TORCH_DISTRIBUTED_DIR = os.path.dirname(dist.__file__) + os.sep


def _choice(kind: str, value: Any, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; valid choices: {', '.join(sorted(choices))}")
    return value


def _positive_mib(name: str, value: Any, none_means: str = "") -> float:
    # NaN slips through "<= 0" and inf through every comparison; both would fail only at setup
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number{none_means}, got {value!r} (a finite size in MiB)")
    return float(value)


def _patterns(name: str, value: Any) -> tuple[str, ...]:
    """A list of fnmatch patterns (one pattern may be given as a plain string)."""
    patterns = (value,) if isinstance(value, str) else value
    if not isinstance(patterns, Iterable) or isinstance(patterns, (bytes, dict)):
        raise ValueError(f"{name} must be a list of parameter-name patterns, got {value!r}")
    patterns = tuple(patterns)
    bad = [p for p in patterns if not isinstance(p, str) or not p]
    if bad:
        raise ValueError(f"{name} must be a list of non-empty parameter-name patterns (fnmatch), got {bad[0]!r} in {value!r}")
    return patterns


def _raised_by_a_collective(exception: BaseException) -> bool:
    """Whether ``exception`` (or an exception it was raised from) left a torch.distributed call:
    gloo reports a dead peer or a time-out as a plain RuntimeError, so the type alone cannot tell."""
    seen: set[int] = set()
    error: BaseException | None = exception
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, dist.DistError):
            return True
        traceback = error.__traceback__
        while traceback is not None:
            if traceback.tb_frame.f_code.co_filename.startswith(_TORCH_DISTRIBUTED_DIR):
                return True
            traceback = traceback.tb_next
        error = error.__cause__ or error.__context__
    return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: constructor options that engine_config() (the cross-rank check, the config saved in checkpoints)
#: leaves out: ranks may differ in them and a resumed run may change them without a word. Lightning's
#: own plumbing (the Trainer passes it), how the ranks are launched, how long a collective may take,
#: and the timeline (recording never changes what is sent). broadcast_buffers is left out as it has
#: always been (RESUME_RULES has no rule for it), although ranks that disagree on it would not issue
#: the same broadcasts.
NOT_IN_ENGINE_CONFIG = frozenset(
    {
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
)
#: the attribute that holds an option's value, where it is not the option's name
_OPTION_ATTRIBUTES = {
    "sparsifier": "sparsifier_spec",
    "memory": "memory_name",
    "fusion": "fusion_name",
    "comm": "comm_name",
}


def _norm_clipping(trainer: Any) -> float | None:
    """The Trainer's gradient clipping where memory='adam' can make it its own: by norm (the
    default algorithm); None where the Trainer does not clip, or clips by value."""
    if not trainer.gradient_clip_val:
        return None
    algorithm = trainer.gradient_clip_algorithm
    return float(trainer.gradient_clip_val) if algorithm is None or algorithm == "norm" else None


class SSFusionStrategy(DDPStrategy):
    """Data-parallel training with sparsified, fused gradient communication.

    Args:
        sparsifier: a name from ``available_sparsifiers()`` or a Sparsifier instance.
        density: fraction of elements sent, 0 < density <= 1 (default 0.01) for a sparsifier given by
            name. A Sparsifier instance carries its own density: passing ``density`` with one is an error.
        memory: error feedback, "residual" | "dgc" | "adam" | "none" | "auto". "adam" selects from each
            rank's Adam update instead of its gradient, and replaces the Adam/AdamW optimizer by the step
            that applies the averaged update (``sparsifiers/adam_memory.py``). Every memory takes
            ``memory_options={"feedback": f}``: keep f of the unsent part (default 1); with "adam",
            0.9 let a language model leave its early plateau with dense training (README). "auto"
            picks by the optimizer once it exists: "dgc" for SGD with momentum and "adam" for
            Adam/AdamW, each keeping 0.9 of the unsent part, else "residual"
            (``sparsifiers/memory_choice.py``; it takes only ``feedback``). With "adam" the
            Trainer's gradient_clip_val (by norm) becomes the memory's ``clip_norm``, and the
            Trainer's own clipping is off while the engine runs the rounds. The "ssfusion" presets
            ship "auto"; the other systems' presets their papers' "residual".
        fusion: buffer/selection policy (see ``available_fusion_policies()``).
        comm: collective (see ``available_communicators()``).
        buffer_mb: "auto" (default) or the cap of a fusion buffer in MiB (a finite number > 0).
            "auto" profiles the first rounds (backward time per tensor, compression cost, the
            links' alpha-beta) and then cuts the buffers so that the modelled communication of the
            round ends earliest: early buffers launch while the backward goes on. Until then, and
            for a dense sparsifier, it is DDP's layout (1 MiB first, then 25 MiB).
        first_buffer_mb: cap in MiB of the buffer that closes first in backward order (default:
            ``buffer_mb``; under "auto", 1 MiB until costs are measured, then the cost cut's).
            A small first buffer (DDP uses 1 MiB) starts communication while the rest of the
            backward runs; with one big buffer nothing overlaps.
        process_groups: number of strategy-owned process groups buffers rotate over (>= 1).
        offload: where sparsification runs: "none" | "thread" | "stream" | "auto" ("stream" needs CUDA
            devices; checked as soon as the Trainer has chosen the accelerator, before launching ranks).
        warmup_steps: dense steps before sparsification starts.
        density_warmup_steps, density_warmup_epochs, density_warmup_stages: Deep Gradient Compression's
            density warm-up, over this many optimizer steps or epochs (at most one of them > 0; epochs
            count optimizer steps per epoch, known once training starts): the density rises from
            dense to ``density`` along a geometric path in ``density_warmup_stages`` stages (default
            4: DGC's 25%, 6.3%, 1.6%, 0.4% before 0.1%; see ``sparsifiers/schedule.py``). The plan
            follows each stage on every rank.
        dense_params: fnmatch patterns of parameter names (as ``named_parameters`` gives them) whose
            tensors are sent whole at every step, whatever the fusion policy plans (a language
            model's tied embedding loses accuracy when sparsified: see the README). A pattern that
            matches no name is an error.
        start_method: as DDP's: how Lightning launches the ranks, "popen" | "spawn" | "fork" | "forkserver".
        find_unused_parameters: as DDP's: a parameter that no rank used keeps ``.grad`` untouched.
        broadcast_buffers: as DDP's: module buffers (BatchNorm statistics) are broadcast from rank 0
            before each synchronized forward.
        nonfinite: a NaN/Inf gradient on any rank makes every rank "raise" (default) or "skip" the
            step; error feedback and sparsifier thresholds never absorb it. Under fp16 mixed precision
            with a GradScaler the step is the scaler's instead: every rank writes inf into the
            gradients, so the scaler skips the step and lowers its scale, as under DDP.
        ddp_handoff: once every tensor is sent dense for good (sparsifier "none", or a link fast enough that
            the plan or the plan trial keeps no tensor sparse), DDP's C++ reducer synchronizes the gradients
            from the next step on (default True, under automatic optimization): the engine's dense rounds
            cost a rank 2-4% more CPU than it. False keeps the engine's rounds, whose dense path is DDP's
            to the bit. Memories that keep optimizer state move it to the optimizer meanwhile: with "dgc"
            the SGD gets its momentum back, its buffers the ranks' averaged momentum correction (weight
            decay then inside the momentum, as torch's SGD has it); with "adam" the replaced AdamW steps
            from the ranks' averaged moments. A memory clipping each rank's gradient by its own
            ``clip_norm`` keeps the engine's rounds (with "auto" the Trainer's clipping returns instead).
        ranks_per_node: ranks that share a node (its fast link), for ``comm="hierarchical"`` and
            the hierarchical candidates of ``comm="auto"`` (default: Lightning's devices per node).
            Global ranks are node-major. A smaller value than the real one emulates several nodes
            on one machine (e.g. 4 ranks as 2 x 2).
        comm_options, fusion_options, memory_options: constructor options of the named communicator,
            fusion policy and memory (e.g. ``comm_options={"choice": "sparcml"}`` for ``comm="zen"``).
            Every communicator takes ``dense_trial_steps``: the measured plan trial, which sends
            the model dense (DDP's buckets) where that measured faster than the plan's selections
            (16 for ``auto``; 0, off, for a fixed scheme unless its preset turns it on), and
            ``min_sparse_speedup``: how many times faster a step the sparse plan must measure than
            dense to stay (1.0: the faster step wins).
        timeout: as DDP's; also bounds every collective of the strategy's own process groups, so a
            dead rank or a cut link fails the step with an error instead of hanging.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend: as DDP's; the Trainer passes them.
        timeline: record this rank's engine phases per buffer (compression, launch, collectives,
            waits) in ``strategy.timeline`` from the start (``strategy.timeline.enable()`` does it
            at any time); see ``ssfusion_lightning/timeline.py``. Recording never changes
            what is sent, so ranks may differ here.
    """

    strategy_name = "ssfusion"

    def __init__(
        self,
        sparsifier: str | Sparsifier = "dgc",
        density: Optional[float] = None,
        memory: str = "residual",
        fusion: str = "selective",
        comm: str = "hybrid",
        ranks_per_node: Optional[int] = None,
        buffer_mb: float | str = "auto",
        first_buffer_mb: Optional[float] = None,
        process_groups: int = 2,
        offload: str = "auto",
        warmup_steps: int = 0,
        density_warmup_steps: int = 0,
        density_warmup_epochs: float = 0,
        density_warmup_stages: int = 4,
        dense_params: Sequence[str] | str = (),
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        nonfinite: str = "raise",
        ddp_handoff: bool = True,
        comm_options: Optional[dict[str, Any]] = None,
        fusion_options: Optional[dict[str, Any]] = None,
        memory_options: Optional[dict[str, Any]] = None,
        timeline: bool = False,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise TypeError(
                f"SSFusionStrategy got unexpected keyword arguments {sorted(unknown)}; it does not wrap the model in "
                "DistributedDataParallel, so DDP-only options are not accepted"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        if isinstance(sparsifier, Sparsifier):
            if density is not None:
                # Silently overriding (or ignoring) either density would train at a density nobody asked for.
                raise ValueError(
                    f"density={density!r} was passed together with a Sparsifier instance ({type(sparsifier).__name__} "
                    f"with density {sparsifier.density}); the instance's own density applies: set it when building "
                    "the sparsifier, or pass the sparsifier by name"
                )
            self.sparsifier_spec: str | Sparsifier = sparsifier
            self.density = sparsifier.density
        else:
            self.sparsifier_spec = _choice("sparsifier", sparsifier, SPARSIFIERS.names())
            self.density = validate_density(DEFAULT_DENSITY if density is None else density)
        self.memory_name = _choice("memory", memory, [*MEMORIES.names(), AUTO])
        self.fusion_name = _choice("fusion policy", fusion, FUSION_POLICIES.names())
        self.comm_name = _choice("comm", comm, COMMUNICATORS.names())
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
        ):
            raise ValueError(
                f"ranks_per_node must be an integer >= 1 or None (Lightning's devices per node), got {ranks_per_node!r}"
            )
        self.ranks_per_node = ranks_per_node
        self.offload = _choice("offload", offload, OFFLOAD_CHOICES)
        self.buffer_mb = "auto" if buffer_mb == "auto" else _positive_mib("buffer_mb", buffer_mb, ' or "auto"')
        self.first_buffer_mb = (
            None if first_buffer_mb is None else _positive_mib("first_buffer_mb", first_buffer_mb, " or None (= buffer_mb)")
        )
        if isinstance(process_groups, bool) or not isinstance(process_groups, int) or process_groups < 1:
            raise ValueError(f"process_groups must be an integer >= 1, got {process_groups!r}")
        self.process_groups = process_groups
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.density_warmup_steps = DensityWarmup(density_warmup_steps, density_warmup_stages).steps
        self.density_warmup_stages = density_warmup_stages
        epochs_ok = not isinstance(density_warmup_epochs, bool) and isinstance(density_warmup_epochs, (int, float))
        if not (epochs_ok and math.isfinite(density_warmup_epochs) and density_warmup_epochs >= 0):
            raise ValueError(f"density_warmup_epochs must be a number >= 0, got {density_warmup_epochs!r}")
        if density_warmup_epochs and density_warmup_steps:
            raise ValueError(
                f"density_warmup_steps={density_warmup_steps!r} and density_warmup_epochs={density_warmup_epochs!r} "
                "were both given; set the warm-up's length in one of them (the other 0)"
            )
        self.density_warmup_epochs = float(density_warmup_epochs)
        self.dense_params = _patterns("dense_params", dense_params)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.nonfinite = _choice("nonfinite policy", nonfinite, NONFINITE_POLICIES)
        if not isinstance(ddp_handoff, bool):
            raise ValueError(f"ddp_handoff must be True or False, got {ddp_handoff!r}")
        self.ddp_handoff = ddp_handoff
        self.comm_options = dict(comm_options or {})
        self.fusion_options = dict(fusion_options or {})
        self.memory_options = dict(memory_options or {})
        # Build each component once now, so a misspelled option fails here and not at setup.
        COMMUNICATORS.build(self.comm_name, **self.comm_options)
        FUSION_POLICIES.build(self.fusion_name, **self.fusion_options)
        if self.memory_name == AUTO:
            check_auto_options(self.memory_options)
        MEMORIES.build(self._memory_until_optimizers, **self.memory_options)
        # the strategy's, not the engine's: it can be enabled before setup and read after teardown
        self.timeline = Timeline(enabled=bool(timeline))
        self.engine: FusionEngine | None = None
        self.last_metrics: StepMetrics = StepMetrics()
        self._groups: list[dist.ProcessGroup] = []
        self._buffers_due = True
        self._module_buffers: list[torch.Tensor] = []
        self._restored_state: dict[str, Any] | None = None
        self._final_engine_state: dict[str, Any] | None = None
        #: (the Trainer, its gradient_clip_val) where memory='auto' made that clipping the memory's
        self._taken_clipping: tuple[Any, Any] | None = None

    # ------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for name, (description, kwargs) in SYSTEM_PRESETS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)

    # ------------------------------------------------------------ lifecycle
    @override
    def _configure_launcher(self) -> None:
        # The Trainer calls this once it has chosen the accelerator and devices and before it
        # launches any rank: the earliest point where the offload mode can be checked against them.
        not_cuda = sorted({str(device) for device in self.parallel_devices or [] if device.type != "cuda"})
        if self.offload == "stream" and not_cuda:
            raise ValueError(
                f"offload='stream' compresses on a CUDA side stream, but the devices are {', '.join(not_cuda)} "
                f"(accelerator {type(self.accelerator).__name__}); use offload='thread', 'auto' or 'none'"
            )
        super()._configure_launcher()

    @override
    def configure_ddp(self) -> None:
        """Replace DDP's wrapper by the fusion engine: same starting point on all ranks, own groups, hooks."""
        assert self.model is not None
        self._check_same_config_on_all_ranks()
        _sync_module_states(self.model)
        # listed once, as DDP does: walking the module tree before every forward cost more than the
        # broadcast of a small CNN's statistics
        self._module_buffers = [b for b in self.model.buffers() if b.numel() > 0]
        self.engine = self._build_engine()
        if self.memory_name != AUTO:  # "auto" has its memory once the optimizers exist: restored then
            self._restore_pending_engine_state()
        self.engine.attach()

    def _restore_pending_engine_state(self) -> None:
        if self._restored_state is not None:
            self._restore_engine(self._restored_state)
            self._restored_state = None

    def config_fingerprint(self) -> dict[str, Any]:
        """Everything that must be identical on all ranks for them to issue the same collectives."""
        return {
            **self.engine_config(),
            "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in self.model.named_parameters() if p.requires_grad],
        }

    def engine_config(self) -> dict[str, Any]:
        """Every option of the constructor but those in ``NOT_IN_ENGINE_CONFIG``, as plain values (in
        the signature's order): checked across ranks at setup, and saved in checkpoints so that a resumed
        run knows what changed (``RESUME_RULES`` decides per field). An option's value is the
        attribute of its name (``_OPTION_ATTRIBUTES`` names the exceptions)."""
        names = [name for name in OPTIONS if name not in NOT_IN_ENGINE_CONFIG]
        values = {name: getattr(self, _OPTION_ATTRIBUTES.get(name, name)) for name in names}
        sparsifier = values["sparsifier"]
        if not isinstance(sparsifier, str):
            values["sparsifier"] = f"{type(sparsifier).__name__}({sparsifier.density})"
        return plain(values, "strategy configuration")

    def _check_same_config_on_all_ranks(self) -> None:
        """A mismatch (e.g. another density on one rank) is an error at setup, not a hang later."""
        if not _distributed_is_initialized() or self.world_size == 1:
            return
        mine = self.config_fingerprint()
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        for rank, theirs in enumerate(everyone):
            differing = sorted(key for key in mine if theirs.get(key) != mine.get(key))
            if differing:
                detail = "; ".join(
                    f"{key}: rank {self.global_rank} has {_short(mine.get(key))}, rank {rank} has {_short(theirs.get(key))}"
                    for key in differing
                )
                raise ValueError(f"ssfusion: ranks disagree on their configuration ({detail})")

    def _build_engine(self) -> FusionEngine:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        sparsifier = (
            self.sparsifier_spec
            if isinstance(self.sparsifier_spec, Sparsifier)
            else SPARSIFIERS.build(self.sparsifier_spec, density=self.density)
        )
        communicator = COMMUNICATORS.build(self.comm_name, **self.comm_options)
        flat = self._create_groups()
        hierarchies = None
        if communicator.needs_hierarchy or communicator.may_use_hierarchy:
            hierarchies = self._create_hierarchies(len(flat), required=communicator.needs_hierarchy)
        self._groups = flat + [g for h in hierarchies or () for g in (h.local, h.cross) if g is not None]
        channels = ChannelSet(flat if flat else [None], self.root_device, hierarchies)
        sparse_ids = {
            id(module.weight)
            for module in self.model.modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
        }
        return FusionEngine(
            named,
            sparsifier,
            MEMORIES.build(self._memory_until_optimizers, **self.memory_options),
            FUSION_POLICIES.build(self.fusion_name, **self.fusion_options),
            communicator,
            channels,
            EngineConfig(
                buffer_bytes=None if self.buffer_mb == "auto" else self.buffer_mb * 1024 * 1024,
                first_buffer_bytes=None if self.first_buffer_mb is None else self.first_buffer_mb * 1024 * 1024,
                warmup_steps=self.warmup_steps,
                # the length in epochs becomes steps in on_train_start; until then, the first stage
                density_warmup=DensityWarmup(
                    sys.maxsize if self.density_warmup_epochs else self.density_warmup_steps, self.density_warmup_stages
                ),
                find_unused_parameters=self.find_unused_parameters,
                offload=self.offload,
                nonfinite=self.nonfinite,
                dense_params=self.dense_params,
                # a little above the groups' own timeout, so gloo's error (if any) is the one reported
                timeout_seconds=self._timeout.total_seconds() + 10 if self._timeout is not None else None,
            ),
            sparse_gradients=[name for name, param in named if id(param) in sparse_ids],
            # fp16 mixed precision: the scaler's scale is in the gradients, and it skips non-finite steps
            grad_scaler=getattr(self.precision_plugin, "scaler", None),
            timeline=self.timeline,
        )

    def _create_groups(self) -> list[dist.ProcessGroup]:
        if not _distributed_is_initialized():
            return []
        # Every rank creates the same groups in the same order (new_group is collective).
        return [
            dist.new_group(backend=self._get_process_group_backend(), timeout=self._timeout)
            for _ in range(self.process_groups)
        ]

    @property
    def _memory_until_optimizers(self) -> str:
        """The memory the engine is built with: ``memory="auto"`` picks its own once the optimizers
        exist (``setup_optimizers``), so until then the one it falls back to."""
        return "residual" if self.memory_name == AUTO else self.memory_name

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.engine is not None and self.memory_name == AUTO:
            clip_norm = _norm_clipping(trainer)
            refused = self._adam_refused(trainer, clipping_taken=clip_norm is not None)
            choice = choose_memory(self.optimizers, self.memory_options, refused, clip_norm)
            memory = MEMORIES.build(choice.name, **choice.options)
            if "clip_norm" in choice.options:  # see _clipping_follows_the_memory
                self._taken_clipping = (trainer, trainer.gradient_clip_val)
                trainer.gradient_clip_val = None
                memory.clipping_returns_to_trainer = True
            self.engine.set_memory(memory)
            log.info("ssfusion: memory='auto' picked %r with %s (%s)", choice.name, choice.options or "its defaults", choice.reason)
            self._restore_pending_engine_state()
        memory = self.engine.memory if self.engine is not None else None
        if isinstance(memory, DGCMemory):
            taken = memory.take_momentum_from(self.optimizers, self.engine.params)
            if taken is not None:
                log.info("ssfusion: memory='dgc' applies the optimizer's momentum %s (momentum correction); the optimizer's is now 0", taken)
            elif (note := memory.untaken_momentum(self.optimizers)) is not None:
                rank_zero_warn(note)
        elif isinstance(memory, AdamMemory):
            self._hand_adam_to(memory, trainer)

    def _adam_refused(self, trainer: Any, clipping_taken: bool = False) -> str | None:
        """Why this run cannot take memory='adam' whatever its optimizer (None where it can): what
        would act on the averaged update instead of the gradient, the Trainer's clipping (unless
        ``clipping_taken``: memory='auto' makes it the memory's), a GradScaler, sparse embedding
        gradients."""
        if trainer.gradient_clip_val and not clipping_taken:
            return (
                f"memory='adam' sends Adam updates, so the Trainer's gradient_clip_val={trainer.gradient_clip_val!r} would "
                "clip the averaged update instead of the gradient; set gradient_clip_val=None and clip each rank's "
                f"gradient before its moments with memory_options={{'clip_norm': {trainer.gradient_clip_val!r}}}"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            return SCALED_GRADIENTS_REFUSED
        if self.engine.sparse_gradient_names:
            return (
                f"memory='adam' computes dense Adam updates, but {', '.join(self.engine.sparse_gradient_names)} "
                "have sparse gradients (nn.Embedding(sparse=True)); use sparse=False, or memory='residual'"
            )
        return None

    def _hand_adam_to(self, memory: AdamMemory, trainer: Any) -> None:
        """memory='adam' computes each rank's Adam step: the user's Adam or AdamW is replaced by the
        step that applies the ranks' averaged update, over the same parameter groups, and its LR
        schedulers move to the replacement. What would act on the averaged update instead of the
        gradient is refused (``_adam_refused``)."""
        refused = self._adam_refused(trainer)
        if refused is not None:
            raise ValueError(refused)
        replaced = self.optimizers
        replacements = memory.take_over(replaced, self.engine.params)
        for config in self.lr_scheduler_configs:
            for old, new in zip(replaced, replacements):
                if config.scheduler.optimizer is old:
                    config.scheduler.optimizer = new
        self.optimizers = replacements
        log.info(
            "ssfusion: memory='adam' computes %s's step on each rank (betas %s, eps %s) and sends it; the optimizer "
            "is now AveragedUpdate, which applies the averaged update with the same learning rate and weight decay",
            ", ".join(sorted({opt.replaced_name for opt in replacements})), memory.betas, memory.eps,
        )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # the checkpoint is loaded by now: a run saved while DDP's reducer ran the rounds goes on under it
        # from the first step, with the optimizer holding what the memory handed it. Elsewhere what the
        # loaded optimizer holds of the memory's (momentum correction's momentum after plain DDP too) is
        # the memory's again.
        if self.engine is not None and self.density_warmup_epochs:
            steps = self._steps_per_epoch() * self.density_warmup_epochs
            self.engine.set_density_warmup(DensityWarmup(max(1, round(steps)), self.density_warmup_stages))
        if self.engine is not None and self.ddp_handoff and self.engine.ddp_can_run and self._may_hand_off():
            self._hand_off_to_ddp()
        elif self.engine is not None and self.engine.take_memory_from_optimizer():
            log.info("ssfusion: the momentum or moments the checkpoint's optimizer holds are the memory's again")
        self._clipping_follows_the_memory()

    def _steps_per_epoch(self) -> int:
        trainer = self.lightning_module.trainer
        batches = trainer.num_training_batches
        if not math.isfinite(batches):
            raise ValueError(
                f"density_warmup_epochs={self.density_warmup_epochs!r} needs the number of batches per epoch, but the "
                "training dataloader has no length; set density_warmup_steps instead"
            )
        return max(1, math.ceil(batches / trainer.accumulate_grad_batches))

    def _create_hierarchies(self, channels: int, required: bool) -> list[Hierarchy] | None:
        """One node-local and one cross-node group per channel (a channel's collectives never share
        a group with another's), created on every rank in the same order; a single process is one
        node of one rank. Unless ``required``, only where several nodes hold several ranks each
        (elsewhere a hierarchy changes nothing, and 1 + P groups per channel cost a start-up)."""
        if not _distributed_is_initialized():
            return [Hierarchy(None, None, 0, 1, 1)] if required else None
        per_node = self.ranks_per_node or self.num_processes
        if not required and not 1 < per_node < self.world_size:
            return None
        backend = self._get_process_group_backend()
        return [create_hierarchy(self.global_rank, self.world_size, per_node, backend, self._timeout) for _ in range(channels)]

    @override
    def teardown(self) -> None:
        if self._taken_clipping is not None:  # the Trainer's own again, for a later fit or test
            trainer, value = self._taken_clipping
            trainer.gradient_clip_val = value
            self._taken_clipping = None
        if self.engine is not None:
            # trainer.save_checkpoint() after fit() must still carry every rank's engine state
            self._final_engine_state = self.engine.state_dict()
            in_use = self.engine.close()
            self.engine = None
        else:
            in_use = []
        if self.handed_off:  # DDP's reducer goes before the process group it runs on
            self.model = self.lightning_module
        for group in self._groups:
            if any(group is busy for busy in in_use):
                # after a failed step a channel thread can still be blocked in a collective on it:
                # destroying the group would free it under that thread
                log.warning("ssfusion: a process group of the strategy is left undestroyed: a collective on it has not returned")
                continue
            dist.destroy_process_group(group)
        self._groups = []
        super().teardown()

    # ------------------------------------------------------------ training step
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no communication on the non-final micro-batches."""
        if self.engine is None:
            yield None
            return
        self.engine.sync_enabled = False
        try:
            with self.model.no_sync() if self.handed_off else nullcontext():
                yield None
        finally:
            self.engine.sync_enabled = True

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        self._sync_buffers_before_forward()
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        self._sync_buffers_before_forward()
        return super().validation_step(*args, **kwargs)

    def _sync_buffers_before_forward(self) -> None:
        """DDP's rule: broadcast buffers from rank 0 before a forward that follows a synchronized one."""
        if self.engine is None or self.handed_off:  # DDP's forward broadcasts them
            return
        if self.broadcast_buffers and self._buffers_due and _distributed_is_initialized() and self._module_buffers:
            dist._broadcast_coalesced(dist.group.WORLD, self._module_buffers, 250 * 1024 * 1024, 0)
        self._buffers_due = torch.is_grad_enabled() and self.engine.sync_enabled

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.handed_off:
            super().pre_backward(closure_loss)
        if self.engine is not None:  # handed off too: a checkpoint between micro-batches keeps their sums
            self.engine.begin_backward()
            self._clipping_follows_the_memory()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.engine is None or not self.engine.sync_enabled:
            return
        if self.handed_off:
            self.last_metrics = self.engine.handed_off_step()
            self._clipping_follows_the_memory()
            if not self.engine.ddp_can_run:  # the plan trial's dense window ended on another plan
                self._take_back_from_ddp()
        else:
            self.last_metrics = self.engine.finish()
            if self.ddp_handoff and self.engine.ddp_can_run and self._may_hand_off():
                self._hand_off_to_ddp()
        self._log_metrics(self.last_metrics)

    def _clipping_follows_the_memory(self) -> None:
        """memory="auto" made the Trainer's clipping the memory's (each rank's gradient, before its
        moments): while the optimizer holds the memory's state (DDP's reducer runs the rounds), the
        Trainer clips the averaged gradient again, as it was asked to."""
        if self._taken_clipping is not None and self.engine is not None:
            trainer, value = self._taken_clipping
            trainer.gradient_clip_val = value if self.engine.memory.in_optimizer else None

    @property
    def handed_off(self) -> bool:
        """Whether DDP's reducer synchronizes the gradients (see ``_hand_off_to_ddp``)."""
        return isinstance(self.model, DistributedDataParallel)

    def _may_hand_off(self) -> bool:
        """DDP's reducer can take the run over from here: several ranks, automatic optimization (a
        manual step may run several backwards in one training step, with parameters toggled off that
        a DDP built in between would leave out for good), and the parameters that require a gradient
        are still the engine's."""
        module = self.lightning_module
        if not (_distributed_is_initialized() and self.world_size > 1 and module.automatic_optimization):
            return False
        trained = [p for p in module.parameters() if p.requires_grad]
        return len(trained) == len(self.engine.params) and all(a is b for a, b in zip(trained, self.engine.params))

    def _hand_off_to_ddp(self) -> None:
        """The next rounds are plain all-reduces of the gradients (``FusionEngine.ddp_can_run``: on a
        link fast enough that the plan, or the plan trial, sends every tensor dense, or in the trial's
        dense window): from the next forward on, DDP's C++ reducer does them, on the strategy's first
        process group, with the options it shares with DDP. Its buckets are DDP's layout, which the
        engine's dense rounds used too, and the gradients are views of them (``gradient_as_bucket_view``:
        the summed bucket is not copied back, and the engine's decoded gradients were views of its
        own storage already). The engine stays for the step count, the non-finite check, the plan
        trial and checkpoints."""
        assert self.engine is not None
        self.engine.hand_off()
        self.model = DistributedDataParallel(
            self.lightning_module,
            device_ids=self.determine_ddp_device_ids(),
            process_group=self._groups[0] if self._groups else None,
            find_unused_parameters=self.find_unused_parameters,
            broadcast_buffers=self.broadcast_buffers,
            gradient_as_bucket_view=True,
        )
        if self.is_global_zero:
            log.info("ssfusion: every tensor is sent dense from step %d on; DDP's reducer takes over", self.engine.step)

    def _take_back_from_ddp(self) -> None:
        """The plan trial's dense window ended on a plan DDP cannot run (sparse again, or dense with
        the error feedback's owed mass to send first): the engine's hooks synchronize again."""
        assert self.engine is not None
        self.model = self.lightning_module
        self.engine.take_back()
        self._buffers_due = True
        if self.is_global_zero:
            log.info("ssfusion: from step %d on the engine synchronizes the gradients again", self.engine.step)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name the step in a communication failure raised by a collective outside the engine (e.g.
        ``self.log(..., sync_dist=True)`` on the default group when a peer is gone). The engine's own
        CommunicationError names it already; any other error (the user's own, a non-finite gradient)
        is not about communication and keeps its message as it is."""
        super().on_exception(exception)
        engine = self.engine
        if engine is not None and not isinstance(exception, CommunicationError) and _raised_by_a_collective(exception):
            exception.add_note(
                f"ssfusion: step {engine.step} (communication round of this rank) failed; if this is a time-out "
                "or a closed connection, a rank may have died or a link gone down"
            )

    def _log_metrics(self, metrics: StepMetrics) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not self.is_global_zero or not trainer.loggers:
            return
        if trainer.global_step % max(1, trainer.log_every_n_steps) != 0:
            return
        values = {f"ssfusion/{key}": value for key, value in metrics.as_dict().items()}
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)

    # ------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Runs on every rank: gather each rank's engine state into rank 0's checkpoint, as tensors
        and plain values only (see ``engine/state.py``), so the file loads with torch's safe default."""
        state = self.engine.state_dict() if self.engine is not None else self._final_engine_state
        # A weights-only checkpoint (ModelCheckpoint(save_weights_only=True)) cannot resume
        # training, so like DDP's it holds no training state: no engine state either.
        if state is not None and "optimizer_states" in checkpoint:
            if _distributed_is_initialized():
                device = self.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
                gathered = gather_to_rank0(state, device)
            else:
                gathered = [state]
            if self.is_global_zero:
                checkpoint[CHECKPOINT_KEY] = {"world_size": self.world_size, "config": self.engine_config(), "ranks": gathered}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except pickle.UnpicklingError as error:
            if "ssfusion_lightning" not in str(error):
                raise
            raise pickle.UnpicklingError(
                f"{checkpoint_path} holds engine state in the pickled format of ssfusion-lightning before format "
                f"{ENGINE_STATE_FORMAT}, which torch.load(weights_only=True) refuses. If you trust the file, resume with "
                "trainer.fit(..., weights_only=False): the old state is migrated on load and the next checkpoint is written "
                "in the new format; or drop the engine state with ssfusion_lightning.strip_engine_state(path_in, path_out, "
                "weights_only=False)"
            ) from error
        self._restored_state = checkpoint.get(CHECKPOINT_KEY)
        if self.engine is not None:
            self._restore_pending_engine_state()
        return checkpoint

    def _restore_engine(self, saved: Any) -> None:
        assert self.engine is not None
        if (
            not isinstance(saved, dict)
            or not isinstance(saved.get("ranks"), list)
            or saved.get("world_size") != len(saved["ranks"])
            or not all(isinstance(state, dict) for state in saved["ranks"])
        ):
            raise ValueError(f"the checkpoint's {CHECKPOINT_KEY!r} entry is corrupted: expected one engine state per rank")
        # every rank checks every slice, so all of them fail alike
        ranks = [self.engine.check_state(state) for state in saved["ranks"]]
        if isinstance(saved.get("config"), dict):
            changes = resume_changes(saved["config"], self.engine_config())
            if changes.changed:
                rank_zero_warn(changes.message())
        else:
            changes = ResumeChanges()
            rank_zero_warn(
                "ssfusion: this checkpoint predates saved configurations, so a changed configuration cannot be detected: "
                "the saved plan is kept"
            )
        if saved["world_size"] != self.world_size:
            rank_zero_warn(
                f"checkpoint was written with world size {saved['world_size']}, now {self.world_size}: per-rank "
                "error-feedback residuals and sparsifier state are reset; the step counter and plan are kept"
            )
            self.engine.load_state_dict(ranks[0], per_rank=False, replan=changes.replan)
            return
        self.engine.load_state_dict(ranks[self.global_rank], replan=changes.replan, fresh=changes.fresh)

    # ------------------------------------------------------------ spawn launcher
    @override
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["engine"] = None
        state["_groups"] = []
        state["_final_engine_state"] = None
        return state


#: the constructor's options, in the signature's order: its keyword arguments (not ``**unknown``)
OPTIONS: tuple[str, ...] = tuple(
    name
    for name, parameter in inspect.signature(SSFusionStrategy.__init__).parameters.items()
    if name != "self" and parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
)

# `import ssfusion_lightning` imports this module once Lightning is loaded, so that import registers the names.
SSFusionStrategy.register_strategies(StrategyRegistry)

"""Engine state in checkpoints: only what ``torch.load(weights_only=True)`` accepts.

A model trained with the strategy must load like one trained with DDP: with torch's safe default
and where ssfusion_lightning is not installed. The safe unpickler refuses every class it does not
know, so plans, costs and component states are written as tensors, dicts, lists, str, int, float,
bool and None (with a format version) and rebuilt on load.

Per-rank states reach rank 0 without ``torch.save``: pickling a tensor calls ``torch.save`` on its
storage, so ``gather_object`` would add calls that DDP never makes (and that Lightning's
``test_model_checkpoint_no_extraneous_invocations`` counts). Tensors travel as raw bytes instead.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ssfusion_lightning.costmodel import CostProfile, Link
from ssfusion_lightning.vocabulary import Buffer, Plan, Slot

#: the checkpoint entry that holds every rank's engine state
CHECKPOINT_KEY = "ssfusion_engine"
#: engine state layout; 0 was the pickled ``Plan``/``CostProfile`` objects of the first releases
FORMAT = 1
STATE_KEYS = ("step", "plan", "order", "costs", "sparsifier", "memory", "communicator")

_SCALARS = (str, int, float, bool, type(None))


def plain(value: Any, where: str = "engine state") -> Any:
    """A copy of ``value`` made of tensors, dicts, lists and scalars (tuples become lists); any
    other type is a TypeError naming where it sits, raised when the checkpoint is written rather
    than when someone fails to load it."""
    if type(value) in _SCALARS:  # exact types: a numpy float or an IntEnum is a subclass the safe loader refuses
        return value
    if isinstance(value, Tensor):
        tensor = value.detach()
        if type(tensor) is not Tensor:
            raise TypeError(f"{where} holds a {type(value).__name__}; only plain torch.Tensor values can be checkpointed")
        return tensor
    if isinstance(value, Mapping):  # also an OmegaConf DictConfig from a Hydra config
        out = {}
        for key, item in value.items():
            if type(key) not in _SCALARS:
                raise TypeError(f"{where} has a key of type {type(key).__name__} ({key!r}); keys must be str, int, float or bool")
            out[key] = plain(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__}; a checkpoint's engine state may hold only "
        "tensors, dicts, lists, str, int, float, bool and None (what torch.load(weights_only=True) accepts)"
    )


# ---------------------------------------------------------------- plan and costs
def encode_plan(plan: Plan) -> dict[str, Any]:
    return {
        "buffers": [
            {
                "index": buffer.index,
                "channel": buffer.channel,
                "comm": buffer.comm,
                "slots": [
                    {
                        "name": s.name,
                        "param": s.param,
                        "shape": list(s.shape),
                        "offset": s.offset,
                        "numel": s.numel,
                        "sparse": s.sparse,
                        "k": s.k,
                    }
                    for s in buffer.slots
                ],
            }
            for buffer in plan.buffers
        ],
        "notes": plain(plan.notes, "plan notes"),
    }


def decode_plan(data: Any) -> Plan:
    try:
        buffers = tuple(
            Buffer(
                index=int(buffer["index"]),
                slots=tuple(
                    Slot(
                        name=str(s["name"]),
                        param=int(s["param"]),
                        shape=tuple(int(d) for d in s["shape"]),
                        offset=int(s["offset"]),
                        numel=int(s["numel"]),
                        sparse=bool(s["sparse"]),
                        k=int(s["k"]),
                    )
                    for s in buffer["slots"]
                ),
                channel=int(buffer["channel"]),
                comm=str(buffer.get("comm", "")),  # absent in checkpoints written before ``auto``
            )
            for buffer in data["buffers"]
        )
        return Plan(buffers, dict(data.get("notes") or {}))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"corrupted engine state: the saved plan cannot be read ({type(error).__name__}: {error})") from None


def encode_costs(costs: CostProfile | None) -> dict[str, Any] | None:
    return None if costs is None else plain(dataclasses.asdict(costs), "cost profile")


def decode_costs(data: Any) -> CostProfile | None:
    if data is None:
        return None
    try:
        fields = dict(data)
        fields["backward"] = {str(k): float(v) for k, v in fields["backward"].items()}
        fields["allreduce"] = Link(**fields["allreduce"])
        fields["allgather"] = Link(**fields["allgather"])
        for name in ("node_link", "cross_link"):  # absent in checkpoints written before hierarchical layouts
            if name in fields:
                fields[name] = Link(**fields[name])
        return CostProfile(**fields)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"corrupted engine state: the saved cost profile cannot be read ({type(error).__name__}: {error})") from None


def upgrade(state: Any) -> dict[str, Any]:
    """The state in the current format. Format 0 (pickled ``Plan`` and ``CostProfile`` objects,
    readable only with ``weights_only=False``) is migrated; a newer format is refused."""
    if not isinstance(state, dict) or set(STATE_KEYS) - set(state):
        found = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"corrupted engine state: expected entries {sorted(STATE_KEYS)}, found {found}")
    version = state.get("format", 0)
    if version == FORMAT:
        return state
    if version != 0:
        raise ValueError(
            f"engine state format {version!r} was written by another ssfusion-lightning (this one reads formats 0 and "
            f"{FORMAT}): resume with the version that wrote it, or strip the engine state (ssfusion_lightning.strip_engine_state)"
        )
    if not isinstance(state["plan"], Plan) or not (state["costs"] is None or isinstance(state["costs"], CostProfile)):
        raise ValueError("corrupted engine state: a format-0 state must hold a Plan and a CostProfile (or None)")
    migrated = {key: plain(value, f"engine state[{key!r}]") for key, value in state.items() if key not in ("plan", "costs")}
    migrated.update(format=FORMAT, plan=encode_plan(state["plan"]), costs=encode_costs(state["costs"]))
    return migrated


def check(state: Any, planned: Sequence[tuple[str, int]], num_params: int) -> dict[str, Any]:
    """Refuse a state that is corrupted or belongs to another model, with a clear error; return it
    in the current format (an older format is migrated). ``planned``: (name, numel) of every
    parameter the model's plan holds; ``num_params``: how many parameters the engine has."""
    state = upgrade(state)
    if not isinstance(state["step"], int) or not isinstance(state["order"], list):
        raise ValueError("corrupted engine state: 'step' must be an int and 'order' a list")
    plan = decode_plan(state["plan"])
    saved = sorted((s.name, s.numel) for b in plan.buffers for s in b.slots)
    ours = sorted(planned)
    if saved != ours:
        differing = sorted({n for n, _ in ours} ^ {n for n, _ in saved})[:5]
        raise ValueError(
            f"the checkpoint's engine state belongs to a different model (parameters differ, e.g. {differing})"
        )
    if sorted(state["order"]) != list(range(num_params)):
        raise ValueError(f"corrupted engine state: 'order' is not a permutation of the {num_params} parameters")
    decode_costs(state["costs"])
    return state


class AccumulatedGradients:
    """Gradient accumulation across a checkpoint. Lightning saves no ``.grad``: a checkpoint taken
    between the micro-batches of one round keeps this rank's local sums so far, and a restored
    one puts them back right before the next backward (Lightning clears ``.grad`` as it restarts)."""

    def __init__(self) -> None:
        #: local gradients pile up: a backward ran since the last synchronized round
        self.pending = False
        self._restored: dict[str, Tensor] | None = None

    def saved(self, names: Sequence[str], params: Sequence[Tensor]) -> dict[str, Tensor] | None:
        """What a checkpoint taken now keeps: the local sums by parameter name; None between rounds."""
        if not self.pending:
            return None
        return {n: p.grad.detach().cpu().clone() for n, p in zip(names, params) if p.grad is not None}

    def restore(self, saved: dict[str, Tensor] | None) -> None:
        """Put ``saved`` (what ``saved`` returned) back right before the next backward."""
        self._restored = saved or None

    def put_back(self, names: Sequence[str], params: Sequence[Tensor]) -> list[bool] | None:
        """Right before a backward: the restored sums into ``.grad``. Returns, per parameter, whether
        it holds one (a backward reached it since the last synchronized round); None when nothing
        was restored."""
        if self._restored is None:
            return None
        held = []
        for name, param in zip(names, params):
            grad = self._restored.get(name)
            param.grad = None if grad is None else grad.to(param.device)
            held.append(grad is not None)
        self._restored = None
        self.pending = True
        return held


# ---------------------------------------------------------------- transport to rank 0
def _split(value: Any, tensors: list[Tensor]) -> Any:
    """``value`` with every tensor replaced by a tuple naming its bytes in ``tensors`` (plain
    states hold no tuples, so the marker is unambiguous)."""
    if isinstance(value, Tensor):
        if value.layout == torch.sparse_coo:  # a sparse embedding's gradient saved mid-accumulation
            value = value.detach().coalesce()
            return ("sparse_coo", _split(value.indices(), tensors), _split(value.values(), tensors), list(value.shape))
        if value.layout != torch.strided:
            raise TypeError(f"engine state holds a tensor with layout {value.layout}, which cannot be checkpointed")
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        tensors.append(flat.view(torch.uint8))
        return ("tensor", str(value.dtype).removeprefix("torch."), list(value.shape), flat.numel() * flat.element_size())
    if isinstance(value, dict):
        return {key: _split(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_split(item, tensors) for item in value]
    return value


class _Rebuild:
    """Walks a skeleton, cutting the tensors it names out of one byte blob in order."""

    def __init__(self, blob: Tensor) -> None:
        self.blob, self.offset = blob, 0

    def __call__(self, value: Any) -> Any:
        if isinstance(value, tuple) and value[0] == "sparse_coo":
            _, indices, values, shape = value
            return torch.sparse_coo_tensor(self(indices), self(values), shape).coalesce()
        if isinstance(value, tuple):
            _, name, shape, nbytes = value
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"engine state names an unknown dtype {name!r}")
            chunk = self.blob[self.offset : self.offset + nbytes].clone()  # own storage: aligned for the view
            self.offset += nbytes
            return chunk.view(dtype).reshape(shape)
        if isinstance(value, dict):
            return {key: self(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self(item) for item in value]
        return value


class _NoGlobals(pickle.Unpickler):
    """A peer's skeleton holds builtins only: refuse anything that would import or run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"engine state from a peer rank names {module}.{name}; only plain values are exchanged")


def gather_to_rank0(state: dict[str, Any], device: torch.device, group: dist.ProcessGroup | None = None) -> list[dict[str, Any]] | None:
    """Every rank's plain ``state`` on the group's rank 0 (None elsewhere), in rank order. Two
    collectives (sizes, then the padded payloads), as ``gather_object``, but without pickling a
    tensor: each rank's payload is its pickled skeleton followed by its tensors' raw bytes."""
    tensors: list[Tensor] = []
    head = pickle.dumps(_split(state, tensors), protocol=pickle.HIGHEST_PROTOCOL)
    payload = torch.cat([torch.frombuffer(bytearray(head), dtype=torch.uint8), *tensors])
    world = dist.get_world_size(group)
    sizes = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(head), payload.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [tuple(int(v) for v in size.tolist()) for size in sizes]
    longest = max(total for _, total in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)  # gloo gathers equal sizes only
    padded[: payload.numel()] = payload.to(device)
    root = dist.get_rank(group) == 0
    received = [torch.empty_like(padded) for _ in range(world)] if root else None
    dist.gather(padded, received, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if not root:
        return None
    states = []
    for blob, (head_bytes, total) in zip(received, lengths):
        blob = blob[:total].cpu()
        skeleton = _NoGlobals(io.BytesIO(blob[:head_bytes].numpy().tobytes())).load()
        states.append(_Rebuild(blob[head_bytes:])(skeleton))
    return states


# ---------------------------------------------------------------- a changed configuration on resume
#: What a configuration field that differs between the checkpoint and the resumed run does:
#:   "replan"       the saved plan does not reflect it: plan anew from the saved gradient order and
#:                  costs; error-feedback residuals are kept (keyed by parameter name, they stay
#:                  meaningful), the communicator's per-buffer state starts afresh (buffers change)
#:   "sparsifier"   as "replan", and the saved sparsifier state (another sparsifier's) starts afresh
#:   "communicator" the saved communicator state (another collective's) starts afresh; plan kept
#:   "apply"        the new value takes effect at the next step; no saved state depends on it
#:   "refuse"       the saved state cannot serve the new value: resuming is an error
RESUME_RULES: dict[str, str] = {
    "sparsifier": "sparsifier",
    "density": "replan",
    "fusion": "replan",
    "fusion_options": "replan",
    "buffer_mb": "replan",
    "first_buffer_mb": "replan",
    "process_groups": "replan",
    "comm": "communicator",
    "comm_options": "communicator",
    "ranks_per_node": "communicator",
    # residual (one tensor per parameter) and dgc (momenta and velocities) state differ in layout
    # and meaning: converting one into the other, or dropping it, would silently change the math
    "memory": "refuse",
    # e.g. dgc's momentum: the saved momenta and velocities keep their meaning
    "memory_options": "apply",
    # offload decisions are re-derived from the plan and the agreed costs at every re-plan
    "offload": "apply",
    "warmup_steps": "apply",
    # the schedule is a function of the step: the next step's density follows the new one
    "density_warmup_steps": "replan",
    "density_warmup_epochs": "replan",
    "density_warmup_stages": "replan",
    "dense_params": "replan",
    "find_unused_parameters": "apply",
    "nonfinite": "apply",
    # a run handed to DDP's reducer resumes on the engine's rounds and hands off again where it may
    "ddp_handoff": "apply",
}

_DOING = {
    "replan": "re-planned, error-feedback residuals kept",
    "sparsifier": "re-planned with the new sparsifier's state started afresh, error-feedback residuals kept",
    "communicator": "the collective's saved state started afresh",
    "apply": "applies from the next step",
}


@dataclasses.dataclass(frozen=True)
class ResumeChanges:
    """How to restore a checkpoint into a run whose configuration differs from the saved one."""

    changed: tuple[tuple[str, Any, Any], ...] = ()
    replan: bool = False
    #: components whose saved state belongs to another configuration: "sparsifier", "communicator"
    fresh: frozenset[str] = frozenset()

    def message(self) -> str:
        parts = [f"{field} {old!r} -> {new!r} ({_DOING[RESUME_RULES[field]]})" for field, old, new in self.changed]
        tail = "; buffers changed, so the collective's per-buffer state started afresh" if self.replan else ""
        return "ssfusion: resuming with a changed configuration: " + "; ".join(parts) + tail


def resume_changes(saved: dict[str, Any], current: dict[str, Any]) -> ResumeChanges:
    """Compare the configuration saved in a checkpoint with this run's (both plain values, as
    written by ``plain``) and decide, per ``RESUME_RULES``; a refused change is a ValueError
    naming the field and both values. Fields only one side knows are skipped (another version)."""
    changed = tuple((field, saved[field], current[field]) for field in current if field in saved and saved[field] != current[field])
    refused = [(field, old, new) for field, old, new in changed if RESUME_RULES[field] == "refuse"]
    if refused:
        detail = "; ".join(f"{field}={old!r} in the checkpoint, {field}={new!r} now" for field, old, new in refused)
        raise ValueError(
            f"ssfusion: cannot resume with a changed {', '.join(f for f, _, _ in refused)} ({detail}): the saved error-feedback "
            "state has another layout and meaning, and dropping it would lose the gradient it still owes. Resume with the "
            "saved value, or strip the engine state (ssfusion_lightning.strip_engine_state) to start error feedback afresh "
            "from the weights"
        )
    rules = {RESUME_RULES[field] for field, _, _ in changed}
    replan = bool(rules & {"replan", "sparsifier"})
    fresh = {"sparsifier"} if "sparsifier" in rules else set()
    if replan or "communicator" in rules:
        fresh.add("communicator")
    return ResumeChanges(changed, replan, frozenset(fresh))


# ---------------------------------------------------------------- export
def strip_engine_state(path_in: str | os.PathLike, path_out: str | os.PathLike, weights_only: bool = True) -> bool:
    """Write ``path_in`` to ``path_out`` without the per-rank engine state (error-feedback
    residuals, sparsifier thresholds, the plan), e.g. to publish the weights: what is left is what
    Lightning's ``ddp`` would have written. Loads onto the CPU (so it runs on a machine without the
    training GPUs) with torch's safe loader; ``weights_only=False`` reads a checkpoint written
    before format 1 (pickled engine state): only for a file you trust. Returns whether there was
    engine state."""
    checkpoint = torch.load(path_in, map_location="cpu", weights_only=weights_only)
    found = checkpoint.pop(CHECKPOINT_KEY, None) is not None
    torch.save(checkpoint, path_out)
    return found

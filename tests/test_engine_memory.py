"""What the engine keeps in memory: its persistent tensors against the formula, and no copy the size
of a gradient alive between the hooks and the commit (issue 19).

Persistent, per rank: the error-feedback state (one residual per sparse tensor; DGC's momentum
correction keeps two), the dense parts' reusable send buffers (dense numel of every buffer, plus
the non-finite vote that may ride in the last one) and, for ZEN, its hash partition (one index
per element of a buffer's sparse part: the sets every bitmap is decoded by). Everything else is
a few control tensors. Between the hooks and the commit the engine holds the selections (k
values and positions per tensor) and references to the gradients, nothing the size of a gradient.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.comm import zen
from ssfusion_lightning.engine.agreement import IN_DENSE
from ssfusion_lightning.presets import SYSTEM_PRESETS
from ssfusion_lightning.sparsifiers import selection
from ssfusion_lightning.sparsifiers.memory import DGCMemory
from tests.workloads import make_trainer, regression_data

#: control tensors (thresholds, counts, a scale) the engine may keep beside the formula's state
CONTROL_BYTES = 4096

CONFIGS = {
    **{name: dict(SYSTEM_PRESETS[name][1], offload="none") for name in ("ssfusion", "safusion", "adtopk", "zen", "oktopk")},
    "topk-residual": dict(sparsifier="topk", fusion="ahead", comm="allgather", density=0.05, offload="none"),
    "dgc-memory": dict(sparsifier="topk", fusion="ahead", comm="allgather", density=0.05, memory="dgc", offload="none"),
    "dense": dict(sparsifier="none", offload="none"),
}
# the engine's own memory: a plan dense for good would hand its rounds (and free its buffers) to DDP's reducer
CONFIGS = {name: dict(kwargs, ddp_handoff=False) for name, kwargs in CONFIGS.items()}


class Wide(L.LightningModule):
    """About 70k parameters in six tensors: any copy the size of a gradient is far above the slack."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def storages(root, excluded: set[int]) -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage reachable from ``root`` through the package's own
    objects, containers and finished futures (parameters and gradients in ``excluded``)."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors = [obj.coalesce().indices(), obj.coalesce().values()] if obj.is_sparse else [obj]
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in excluded and storage.nbytes():
                    found[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, Future):
            assert obj.done(), "offload is off in these runs: every job has finished"
            stack.append(obj.result())
        elif type(obj).__module__.startswith("ssfusion_lightning"):
            if dataclasses.is_dataclass(obj):
                stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
            stack.extend(getattr(obj, "__dict__", {}).values())
    return found


def params_and_grads(engine) -> set[int]:
    ptrs = set()
    for param in engine.params:
        ptrs.add(param.untyped_storage().data_ptr())
        if param.grad is not None and not param.grad.is_sparse:
            ptrs.add(param.grad.untyped_storage().data_ptr())
    return ptrs


def formula_bytes(engine) -> dict[str, int]:
    """The persistent state the engine is allowed, from the plan (fp32 parameters)."""
    plan, element = engine.plan, 4
    copies = 2 if isinstance(engine.memory, DGCMemory) else 1
    vote = engine.world_size if engine._round.vote.route == IN_DENSE else 0  # uint8 votes ride in fp32 entries
    # momentum correction computes a flat group's round into two flats of its own, and keeps the
    # two its commit replaced for the next round (fresh host tensors come as fresh pages)
    grouped = 0
    if isinstance(engine.memory, DGCMemory):
        grouped = sum(group.flats[0].numel() for (tag, _), group in engine.memory._flat._groups.items() if tag == "sparse")
    return {
        "error feedback": copies * plan.sparse_numel * element,
        "round scratch": 2 * grouped * element,
        "dense send buffers": (sum(b.dense_numel for b in plan.buffers) + vote) * element,
    }


#: bytes per selected element held until the commit: a piece's scaled value (fp32) and shifted
#: position (int64), its update's positions (int64), then the packed message's value and position
BYTES_PER_SELECTED = 4 + 8 + 8 + 4 + 8


def selection_bytes(engine) -> int:
    """What the round's selections hold when every sparse tensor sends its planned k."""
    return sum(slot.k * BYTES_PER_SELECTED for buffer in engine.plan.buffers for slot in buffer.sparse_slots)


class Probe(L.Callback):
    """After a backward (hooks fired, buffers launched, nothing committed yet): the bytes the
    round's pieces and launched messages hold; after a step: every byte the engine holds. Neither
    counts parameters, gradients (pending updates refer to them) or the dense send buffers."""

    def __init__(self) -> None:
        self.in_flight: list[int] = []
        self.persistent: list[int] = []
        self.facts: dict = {}  # the engine's plan-derived numbers (it is gone after the fit)

    def on_after_backward(self, trainer, pl_module) -> None:
        engine = trainer.strategy.engine
        excluded = params_and_grads(engine) | {t.untyped_storage().data_ptr() for t in engine._dense_storage.values()}
        messages = [item[2] for item in engine._round.launched if isinstance(item, tuple)]
        self.in_flight.append(sum(storages((engine._round.pieces, messages), excluded).values()))

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = trainer.strategy.engine
        self.persistent.append(sum(storages(engine, params_and_grads(engine)).values()))
        self.facts = {
            "formula": formula_bytes(engine),
            "selection": selection_bytes(engine),
            # ZEN keeps one partition per distinct buffer size (buffers of one size share it)
            "zen_blocks": sum(-(-n // zen.ZEN_BLOCK) for n in {b.sparse_numel for b in engine.plan.buffers}),
            "largest": max(p.numel() for p in engine.params),
        }


def memory_run(config: dict, steps: int = 7):
    L.seed_everything(0, verbose=False)
    zen._PARTITIONS.clear()
    probe = Probe()
    strategy = ssf.SSFusionStrategy(**config)
    trainer = make_trainer(strategy, steps, callbacks=[probe])
    trainer.fit(Wide(), DataLoader(regression_data(), batch_size=16))
    zen_bytes = sum(sum(b.untyped_storage().nbytes() for b in p.blocks) for p in zen._PARTITIONS.values())
    scratch = getattr(selection._SCRATCH, "buffers", {})
    return {
        **probe.facts,
        "persistent": probe.persistent[-1],
        "in_flight": probe.in_flight[-1],
        "zen": (zen_bytes, probe.facts["zen_blocks"] * 4 if config.get("comm") == "zen" else 0),
        "scratch": sum(t.untyped_storage().nbytes() for pair in scratch.values() for t in pair),
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_persistent_tensors_match_the_formula(pool2, name):
    for result in pool2.run(memory_run, CONFIGS[name], timeout=300):
        expected = sum(result["formula"].values())
        assert expected <= result["persistent"] <= expected + CONTROL_BYTES, (name, result)
        # no copy of a gradient lives from the hooks to the commit: selections (a threshold
        # sparsifier may send up to 4/3 k) and control tensors
        assert result["in_flight"] <= 4 / 3 * result["selection"] + CONTROL_BYTES, (name, result)
        zen_bytes, zen_formula = result["zen"]
        assert zen_bytes == zen_formula, (name, result["zen"])
        # selection temporaries: 1.5x min(CHUNK, largest tensor) elements per dtype used (fp32
        # gradients, int32 positions), whatever the size of the model
        assert result["scratch"] <= 2 * 1.5 * (min(selection.CHUNK, result["largest"]) + 64) * 4, (name, result)


class DecodeProbe(L.Callback):
    """Records, every time a buffer's sparse sum is decoded, whether any of the round's local
    sparse gradients is still held: by its parameter or by anything the engine reaches."""

    def __init__(self) -> None:
        self.engine = None
        self.local: dict[int, int] = {}  # parameter position -> its local gradient's storage
        self.held_at_decode: list[list[int]] = []
        self.shared_storages: list[bool] = []
        self.kept_by_engine: list[bool] = []  # per step and buffer: the engine holds its gradients' storage

    def on_after_backward(self, trainer, pl_module) -> None:
        self.engine = engine = trainer.strategy.engine
        sparse = {slot.param for buffer in engine.plan.buffers for slot in buffer.sparse_slots}
        self.local = {p: engine.params[p].grad.untyped_storage().data_ptr() for p in sparse if engine.params[p].grad is not None}

    def decoding(self, target) -> None:
        # the storage decoded into (kept by the engine on the host) may take a released gradient's memory
        excluded = set() if target is None else {target.untyped_storage().data_ptr()}
        reachable = storages(self.engine, excluded)
        held = [p for p, ptr in self.local.items() if ptr in reachable or self.engine.params[p].grad is not None]
        self.held_at_decode.append(held)

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = trainer.strategy.engine
        for buffer in engine.plan.buffers:
            grads = [engine.params[slot.param].grad for slot in buffer.sparse_slots]
            ptrs = {g.untyped_storage().data_ptr() for g in grads}
            self.shared_storages.append(len(ptrs) == 1)
            self.kept_by_engine.append(min(ptrs) in storages(engine, set()))


def decode_run(config: dict, steps: int = 5):
    from unittest import mock

    from ssfusion_lightning.comm.schemes import SparseSum

    L.seed_everything(0, verbose=False)
    probe = DecodeProbe()
    dense = SparseSum.dense

    def observed(self, storage=None):
        probe.decoding(storage)
        return dense(self, storage)

    with mock.patch.object(SparseSum, "dense", observed):
        trainer = make_trainer(ssf.SSFusionStrategy(**config), steps, callbacks=[probe])
        trainer.fit(Wide(), DataLoader(regression_data(), batch_size=16))
    return {"held": probe.held_at_decode, "shared": probe.shared_storages, "kept": probe.kept_by_engine}


@pytest.mark.parametrize(
    "comm, options",
    [("allgather", {}), ("zen", {"choice": "zen"}), ("zen", {"choice": "sparcml"}), ("sparcml", {}), ("oktopk", {})],
)
def test_the_decoded_sum_takes_the_local_gradients_memory(pool2, comm, options):
    """A sum left as pairs is decoded only once the buffer's local sparse gradients are in the
    error feedback and no longer held, so the decoded total replaces them instead of sitting beside
    them; the gradients written are views of it (one storage per buffer, no copy). On the host that
    storage is the engine's, kept from round to round."""
    config = dict(sparsifier="topk", fusion="ahead", comm=comm, comm_options=options, density=0.05, offload="none", buffer_mb=0.5)
    for result in pool2.run(decode_run, config, timeout=300):
        assert result["held"], "the sums were decoded at the write"
        assert all(held == [] for held in result["held"]), result["held"]
        assert result["shared"] and all(result["shared"]), result["shared"]
        # from step 1 on: the first round's plan (registration order) is replaced after it, storage and all
        assert len(result["kept"]) == 5 and all(result["kept"][1:]), result["kept"]

"""Checkpoints that load anywhere: weights_only-safe engine state and Lightning's checkpoint contract."""

from __future__ import annotations

import copy
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from unittest.mock import Mock

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

import ssfusion_lightning as ssf
from ssfusion_lightning.costmodel import CostProfile, Link
from ssfusion_lightning.data import ResumableDataLoader
from ssfusion_lightning.engine import state as engine_state
from ssfusion_lightning.fusion import FUSION_POLICIES, PlanContext
from ssfusion_lightning.sparsifiers import build_sparsifier
from ssfusion_lightning.vocabulary import ParamSpec
from tests.workloads import Regressor, make_trainer, regression_data

SPARSE = dict(sparsifier="topk", density=0.05, fusion="ahead", comm="hybrid", offload="none", process_groups=2)


class PortableNet(L.LightningModule):
    """Imports nothing from ssfusion_lightning: its source also runs in a process that blocks the package."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


# ---------------------------------------------------------------- encoding (no ranks needed)
def a_plan(policy: str = "selective"):
    specs = [(i, ParamSpec(f"layer{i}.weight", (64, 8 * (i + 1)), torch.float32)) for i in range(4)]
    specs.append((4, ParamSpec("bias", (3,), torch.float32)))
    costs = CostProfile(backward={s.name: 1e-4 * i for i, s in specs}, measured=True)
    ctx = PlanContext(build_sparsifier("topk", density=0.05), 4096.0, 2, 2, costs, 1024.0)
    return FUSION_POLICIES.build(policy).plan(specs, ctx), costs


@pytest.mark.parametrize("policy", ["selective", "adaptive", "ahead", "behind"])
def test_plan_and_costs_round_trip_through_the_safe_loader(tmp_path, policy):
    plan, costs = a_plan(policy)
    path = tmp_path / "state.pt"
    torch.save({"plan": engine_state.encode_plan(plan), "costs": engine_state.encode_costs(costs)}, path)
    loaded = torch.load(path, weights_only=True)
    assert engine_state.decode_plan(loaded["plan"]) == plan
    assert engine_state.decode_plan(loaded["plan"]).notes == engine_state.plain(plan.notes)
    assert engine_state.decode_costs(loaded["costs"]) == costs  # floats round-trip exactly


def test_only_plain_values_pass_and_the_culprit_is_named():
    assert engine_state.plain({"a": (1, 2.5, [True, None]), 3: "x"}) == {"a": [1, 2.5, [True, None]], 3: "x"}
    nested = OmegaConf.create({"choice": "zen", "sizes": [1, 2]})  # strategy options from a Hydra config
    assert engine_state.plain({"comm_options": nested}) == {"comm_options": {"choice": "zen", "sizes": [1, 2]}}
    with pytest.raises(TypeError, match=r"sparsifier state\['scale'\] holds a numpy.float64"):
        engine_state.plain({"scale": np.float64(1.0)}, "sparsifier state")
    with pytest.raises(TypeError, match=r"memory state\['m'\]\[0\] holds a .*Link"):
        engine_state.plain({"m": [Link(1.0, 2.0)]}, "memory state")
    with pytest.raises(TypeError, match="keys must be"):
        engine_state.plain({(1, 2): 0})


def format0(state: dict) -> dict:
    """What the first releases pickled: Plan and CostProfile objects, no format field."""
    old = {key: copy.deepcopy(value) for key, value in state.items() if key != "format"}
    old["plan"] = engine_state.decode_plan(state["plan"])
    old["costs"] = engine_state.decode_costs(state["costs"])
    return old


def test_format0_states_migrate_and_unknown_formats_are_refused():
    plan, costs = a_plan()
    state = {
        "format": 1,
        "step": 7,
        "plan": engine_state.encode_plan(plan),
        "order": [4, 3, 2, 1, 0],
        "costs": engine_state.encode_costs(costs),
        "sparsifier": {"step": 7, "thresholds": {"bias": [0.5, 1, 6]}},
        "memory": {"residuals": {"bias": torch.ones(3)}},
        "communicator": {},
        "accumulated": None,
    }
    old = format0(state)
    old["sparsifier"]["thresholds"]["bias"] = (0.5, 1, 6)  # threshold_reuse saved tuples
    migrated = engine_state.upgrade(old)
    assert migrated.keys() == state.keys()
    for key in state:
        if key != "memory":
            assert migrated[key] == state[key], key
    assert torch.equal(migrated["memory"]["residuals"]["bias"], torch.ones(3))
    with pytest.raises(ValueError, match="format 2 was written by another ssfusion-lightning"):
        engine_state.upgrade(dict(state, format=2))
    with pytest.raises(ValueError, match="corrupted engine state: expected entries"):
        engine_state.upgrade({"step": "garbage"})


def test_format0_plans_pickled_under_the_old_module_name_still_load():
    """The first releases kept the plan types in ssfusion_lightning/engine/plan.py, and format-0
    checkpoints name that module in their pickles."""
    plan, _ = a_plan()
    data = pickle.dumps(plan, protocol=2)  # names classes as text: "ssfusion_lightning.vocabulary\nPlan"
    assert b"ssfusion_lightning.vocabulary\n" in data
    old = data.replace(b"ssfusion_lightning.vocabulary\n", b"ssfusion_lightning.engine.plan\n")
    assert pickle.loads(old) == plan


def test_strip_engine_state_leaves_what_ddp_writes(tmp_path):
    checkpoint = {"state_dict": {"w": torch.arange(3.0)}, "epoch": 1, engine_state.CHECKPOINT_KEY: {"ranks": [{"x": torch.ones(2)}]}}
    torch.save(checkpoint, tmp_path / "in.ckpt")
    assert ssf.strip_engine_state(tmp_path / "in.ckpt", tmp_path / "out.ckpt") is True
    stripped = torch.load(tmp_path / "out.ckpt")
    assert stripped.keys() == {"state_dict", "epoch"} and torch.equal(stripped["state_dict"]["w"], torch.arange(3.0))
    assert ssf.strip_engine_state(tmp_path / "out.ckpt", tmp_path / "again.ckpt") is False


# ---------------------------------------------------------------- transport to rank 0
def gather_run():
    from ssfusion_lightning.engine.state import gather_to_rank0

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    # ranks send different sizes (gloo gathers equal sizes only) and every dtype a state may hold
    state = {
        "rank": rank,
        "floats": torch.randn(5 + 7 * rank, generator=g),
        "nested": [{"half": torch.randn(2, 3, generator=g).to(torch.bfloat16)}, torch.tensor(rank, dtype=torch.int64)],
        "flags": torch.rand(4, generator=g) > 0.5,
        "empty": torch.zeros(0, 3, dtype=torch.float64),
        "noncontiguous": torch.randn(4, 6, generator=g).t(),
        "sparse": torch.sparse_coo_tensor([[0, 2 + rank]], [1.5, -2.0], (6,)),
        "scalars": [None, 1.25, "x", True],
    }
    original, torch.save = torch.save, Mock(wraps=torch.save)
    try:
        gathered = gather_to_rank0(state, torch.device("cpu"))
        saves = torch.save.call_count
    finally:
        torch.save = original
    return state, gathered, saves


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.layout == b.layout and a.shape == b.shape and torch.equal(a.to_dense(), b.to_dense())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_every_rank_state_reaches_rank0_exactly_without_torch_save(pool2):
    (state0, gathered, saves0), (state1, nothing, saves1) = pool2.run(gather_run)
    assert nothing is None and saves0 == saves1 == 0
    assert same(gathered[0], state0) and same(gathered[1], state1)


# ---------------------------------------------------------------- checkpoints written by 2 ranks
def portable_run(directory: str):
    L.seed_everything(3, verbose=False)
    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    trainer = make_trainer(ssf.SSFusionStrategy(**SPARSE), 6, max_epochs=-1, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(PortableNet(width=12), DataLoader(regression_data(), batch_size=16))


LOADER = """
import sys


class BlockPackage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ssfusion_lightning":
            raise ImportError(f"{name} is blocked: loading a checkpoint must not need ssfusion_lightning")


sys.meta_path.insert(0, BlockPackage())
import lightning as L
import torch

MODEL_SOURCE

path, out = sys.argv[1], sys.argv[2]
checkpoint = torch.load(path)  # torch's default: weights_only=True
model = PortableNet.load_from_checkpoint(path)
assert not [name for name in sys.modules if name.split(".")[0] == "ssfusion_lightning"]
engine = checkpoint["ssfusion_engine"]
torch.save(
    {
        "state_dict": model.state_dict(),
        "width": model.hparams.width,
        "ranks": len(engine["ranks"]),
        "residuals": sorted(engine["ranks"][1]["memory"]["residuals"]),
    },
    out,
)
"""


def test_a_mid_training_checkpoint_loads_with_torch_defaults_and_without_the_package(pool2, tmp_path):
    pool2.run(portable_run, str(tmp_path))
    path = tmp_path / "step=3.ckpt"
    checkpoint = torch.load(path)  # torch's default, weights_only=True
    assert checkpoint["global_step"] == 3 and checkpoint["ssfusion_engine"]["world_size"] == 2
    model = PortableNet.load_from_checkpoint(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, checkpoint["state_dict"][name]), name

    script = tmp_path / "load_elsewhere.py"
    script.write_text(LOADER.replace("MODEL_SOURCE", textwrap.dedent(inspect.getsource(PortableNet))))
    out = tmp_path / "loaded.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script), str(path), str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = torch.load(out)
    assert loaded["width"] == 12 and loaded["ranks"] == 2
    assert loaded["residuals"] == sorted(n for n, p in model.named_parameters())
    for name, tensor in checkpoint["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor), name

    # Lightning's own strategies resume from it and ignore the engine entry
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(PortableNet(width=12), DataLoader(regression_data(), batch_size=16), ckpt_path=path)
    assert trainer.global_step == 4


def test_the_blocker_really_blocks(tmp_path):
    """The subprocess above proves something only if importing the package there fails."""
    script = tmp_path / "probe.py"
    script.write_text(LOADER.split("import lightning")[0] + "import ssfusion_lightning\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "ssfusion_lightning is blocked" in done.stderr


class CountSaves(ModelCheckpoint):
    """Lightning's ModelCheckpointTestInvocations: torch.save calls from the start of training on."""

    def on_train_start(self, trainer, pl_module):
        self.original = torch.save
        torch.save = Mock(wraps=torch.save)

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        self.calls = torch.save.call_count
        torch.save = self.original


def saves_run(directory: str, strategy: str, save_top_k: int, epochs: int):
    L.seed_everything(2, verbose=False)
    counter = CountSaves(dirpath=os.path.join(directory, strategy), save_top_k=save_top_k)
    trainer = make_trainer(strategy, -1, max_epochs=epochs, callbacks=[counter], enable_checkpointing=True)
    original = torch.save
    try:
        trainer.fit(Regressor(), DataLoader(regression_data(), batch_size=16))
    finally:
        torch.save = original
    return counter.calls


@pytest.mark.parametrize("save_top_k", [-1, 0])
def test_no_torch_save_call_that_ddp_would_not_make(pool2, tmp_path, save_top_k):
    # "ssfusion" with its preset's defaults: dgc, selective fusion, auto comm, offload auto
    epochs = 3
    expected = [epochs if save_top_k else 0, 0]  # only rank 0 writes, once per epoch
    assert pool2.run(saves_run, str(tmp_path), "ddp", save_top_k, epochs) == expected
    assert pool2.run(saves_run, str(tmp_path), "ssfusion", save_top_k, epochs) == expected


def weights_only_save_run(directory: str):
    L.seed_everything(2, verbose=False)
    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_weights_only=True, filename="{step}")
    trainer = make_trainer(ssf.SSFusionStrategy(**SPARSE), 2, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(Regressor(), DataLoader(regression_data(), batch_size=16))


def test_a_weights_only_checkpoint_holds_no_engine_state(pool2, tmp_path):
    pool2.run(weights_only_save_run, str(tmp_path))
    checkpoint = torch.load(tmp_path / "step=2.ckpt")
    assert "optimizer_states" not in checkpoint and "ssfusion_engine" not in checkpoint


# ---------------------------------------------------------------- checkpoints of the first releases
def old_format_run(directory: str):
    """Resume bitwise from a checkpoint whose engine state is in format 0 (pickled Plan objects):
    refused under torch's safe default with a clear message, migrated with weights_only=False."""
    new, old = os.path.join(directory, "step=4.ckpt"), os.path.join(directory, "old.ckpt")

    def train(callbacks=(), **fit):
        L.seed_everything(4, verbose=False)
        model = Regressor()
        # no checkpoint callback, no checkpointing: Lightning's default one would write into the cwd
        trainer = make_trainer(
            ssf.SSFusionStrategy(**SPARSE), 8, max_epochs=-1, callbacks=list(callbacks), enable_checkpointing=bool(callbacks)
        )
        trainer.fit(model, ResumableDataLoader(regression_data(), batch_size=16, shuffle=True), **fit)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    straight = train([ModelCheckpoint(dirpath=directory, every_n_train_steps=4, save_top_k=-1, filename="{step}")])
    if dist.get_rank() == 0:
        checkpoint = torch.load(new)
        entry = checkpoint["ssfusion_engine"]
        checkpoint["ssfusion_engine"] = {"world_size": entry["world_size"], "ranks": [format0(s) for s in entry["ranks"]]}
        torch.save(checkpoint, old)
    dist.barrier()
    try:
        train(ckpt_path=old)
        refused = "no error"
    except Exception as error:  # noqa: BLE001 - the message is what is tested
        refused = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        migrated = train(ckpt_path=old, weights_only=False)
    resumed = train(ckpt_path=new)
    return straight, refused, migrated, resumed, [str(w.message) for w in caught]


def test_old_checkpoints_are_refused_by_default_and_migrate_when_trusted(pool2, tmp_path):
    for rank, (straight, refused, migrated, resumed, caught) in enumerate(pool2.run(old_format_run, str(tmp_path))):
        assert "pickled format of ssfusion-lightning before format 1" in refused and "weights_only=False" in refused
        assert torch.equal(resumed, straight) and torch.equal(migrated, straight)
        if rank == 0:
            assert any("predates saved configurations" in message for message in caught), caught

"""Count the collectives one training step issues, per preset (issue 14, item 4: fewer rounds).

    python -m experiments.count_rounds                     # P = 2 and 4, writes rounds.csv and rounds.md
    python -m experiments.count_rounds --label before      # writes rounds_before.csv instead (the baseline)
    python -m experiments.count_rounds --report-only       # rounds.md from the CSVs already there

For each system preset (offload "none", so the plan does not depend on measured offload costs; with
comm="auto" the dense fallback off, so the plan keeps its selections), the dense engine (the ssfusion
preset with sparsifier "none" and no hand-off to DDP's reducer) and the ssfusion preset with its own
offload="auto", P gloo ranks on loopback train a small MLP (five 256-wide layers, ~0.8 MB of
fp32 gradients) with ``buffer_mb=0.25`` for ``STEPS`` steps, so every plan has several buffers.

Every call of a ``torch.distributed`` collective or point-to-point function is counted by a
wrapper, with the group it ran on and its call site: the innermost frame of ssfusion_lightning
(function and source line). The call site names its kind: payload (a buffer's dense part, sparse values and
indices) or control (counts, the non-finite vote, thresholds, region edges, one-off agreements).
Calls on the default (world) group are not the strategy's rounds: Lightning's logging sync
(``self.log(..., sync_dist=True)``: a barrier and an all_reduce on gloo) and set-up; they are
reported in a separate column.

A step is one optimizer step (Lightning's ``global_step``): every collective the engine issues
for it completes inside the batch. The first step runs in registration order and rebuilds the
plan from the ready order; steps 1-3 profile costs and step 4 agrees on them (for cost-driven
policies; ZEN profiles its choice against SparCML over the first rounds of every buffer too).
The table is the median over the steady-state steps ``STEADY`` of every column.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, fmt, free_port, read_csv, write_csv

STEPS = 10
STEADY = range(6, 10)
WORLDS = (2, 4)
BUFFER_MB = 0.25

#: configuration name -> SSFusionStrategy keyword arguments (start_method dropped: the ranks are ours)
def configurations() -> dict[str, dict[str, Any]]:
    from ssfusion_lightning.presets import SYSTEM_PRESETS

    def preset(name: str) -> dict[str, Any]:
        kwargs = {k: v for k, v in SYSTEM_PRESETS[name][1].items() if k != "start_method"}
        if kwargs["comm"] == "auto":
            # the rounds of the plan's selections: on loopback the modelled dense fallback may send this
            # small MLP dense, and then DDP's reducer takes the steps over (no engine round to count)
            kwargs["comm_options"] = {**kwargs.get("comm_options", {}), "dense_fallback": False}
        return kwargs

    configs: dict[str, dict[str, Any]] = {}
    for name in ("ssfusion", "safusion", "adtopk", "zen", "oktopk"):
        configs[name] = {**preset(name), "offload": "none"}
    configs["dense"] = {**configs["ssfusion"], "sparsifier": "none", "ddp_handoff": False}  # the engine's own rounds
    configs["ssfusion (offload=auto)"] = preset("ssfusion")
    # ZEN picks SparCML at these P on loopback; its balanced parallelism, which it picks at scale:
    configs["zen (choice=zen)"] = {**configs["zen"], "comm_options": {"choice": "zen"}}
    return configs


#: (innermost ssfusion_lightning function, text in its source line or None, category, kind).
#: The first match wins; a call site no rule names is reported as "unclassified".
RULES: tuple[tuple[str, str | None, str, str], ...] = (
    ("allreduce_dense", None, "payload", "dense"),
    ("allgather_pairs", None, "payload", "sparse"),
    ("exchange_counts", None, "control", "counts"),
    ("zen_pairs", "recv_counts", "control", "zen_push_counts"),
    ("zen_pairs", "all_gather", "control", "zen_pull_counts"),
    ("zen_pairs", "all_to_all_single(inbox", "payload", "sparse"),
    ("_agree_seed", None, "control", "zen_seed"),
    ("_link_for", None, "control", "zen_link"),
    ("_send_recv", "header", "control", "sparcml_header"),
    ("_send_recv", None, "payload", "sparse"),
    ("oktopk_pairs", "all_to_all_single(recv", "control", "oktopk_counts"),
    ("oktopk_pairs", "padded", "control", "oktopk_threshold"),
    ("oktopk_pairs", "message", "payload", "sparse"),
    ("_exchange_pairs", None, "payload", "sparse"),
    ("rebalance_boundaries", None, "control", "oktopk_regions"),
    ("_largest_reaching", None, "control", "oktopk_threshold"),
    ("_all_gather_counts", None, "control", "oktopk_sizes"),
    ("_broadcast_from_rank0", None, "control", "ready_order"),
    ("_nonfinite_vote", None, "control", "vote"),
    ("_usage_vote", None, "control", "usage"),
    ("probe_once", None, "control", "link_probe"),
    ("measure_links", None, "control", "link_probe"),
    ("agree", None, "control", "costs"),
)
CONTROL_KINDS = (
    "counts",
    "vote",
    "usage",
    "zen_push_counts",
    "zen_pull_counts",
    "oktopk_counts",
    "oktopk_threshold",
    "oktopk_sizes",
    "oktopk_regions",
    "sparcml_header",
    "ready_order",
    "costs",
    "link_probe",
    "zen_seed",
    "zen_link",
    "unclassified",
)
WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "_broadcast_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)


# --------------------------------------------------------------------------- counting (in a rank)
class RoundCounter:
    """Wraps the torch.distributed functions and tallies every call by step, group and kind."""

    def __init__(self) -> None:
        self.step = -1
        self.counts: dict[int, Counter] = {}
        self._lock = threading.Lock()
        self._package = str(Path(__file__).resolve().parents[1] / "ssfusion_lightning")

    def install(self) -> None:
        import torch.distributed as dist

        for name in WRAPPED:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original):
        def wrapper(*args, **kwargs):
            self._record(name, kwargs.get("group"))
            return original(*args, **kwargs)

        return wrapper

    def _record(self, name: str, group) -> None:
        import torch.distributed as dist

        strategy_group = group is not None and group is not dist.group.WORLD
        category, kind = self._classify(sys._getframe(2)) if strategy_group else ("world", name)
        with self._lock:
            self.counts.setdefault(self.step, Counter())[(category, kind)] += 1

    def _classify(self, frame) -> tuple[str, str]:
        while frame is not None and not frame.f_code.co_filename.startswith(self._package):
            frame = frame.f_back
        if frame is None:
            return "control", "unclassified"
        import linecache

        function = frame.f_code.co_name
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        for rule_function, text, category, kind in RULES:
            if function == rule_function and (text is None or text in line):
                return category, kind
        return "control", "unclassified"


def _model():
    import lightning as L
    import torch
    from torch import nn

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10),
            )  # fmt: skip

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)  # Lightning's own world-group round
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return MLP()


def _fit(name: str, kwargs: dict[str, Any], world: int, counter: RoundCounter) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from ssfusion_lightning import SSFusionStrategy

    buffers: dict[int, int] = {}

    class StepMarker(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            counter.step = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            buffers[counter.step] = trainer.strategy.last_metrics.buffers
            counter.step = -1

    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64 * STEPS, 32, generator=generator)
    data = TensorDataset(x, (x[:, :10] * 3).argmax(dim=1))
    strategy = SSFusionStrategy(**kwargs, buffer_mb=BUFFER_MB)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[StepMarker()],
        default_root_dir=os.environ["COUNT_ROUNDS_TMP"],
    )  # fmt: skip
    counter.counts = {}
    trainer.fit(_model(), DataLoader(data, batch_size=32))
    return {"counts": {step: dict(c) for step, c in counter.counts.items()}, "buffers": buffers}


def _worker(rank: int, world: int, port: int, names: list[str], out: mp.Queue) -> None:
    import tempfile

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1",
    )  # fmt: skip
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counter = RoundCounter()
    counter.install()
    configs = configurations()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            os.environ["COUNT_ROUNDS_TMP"] = scratch
            for name in names:
                out.put((rank, name, _fit(name, configs[name], world, counter)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put((rank, None, traceback.format_exc()))
    dist.destroy_process_group()


def count(world: int, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Every rank's counts per configuration."""
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, names, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[str, list[Any]] = {name: [None] * world for name in names}
    for _ in range(world * len(names)):
        rank, name, value = out.get(timeout=1800)
        if name is None:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        results[name][rank] = value
    for p in procs:
        p.join(timeout=60)
    return results


# --------------------------------------------------------------------------- tables
FIELDS = ("preset", "P", "buffers", "payload", "control", "total", "total_range", "world", *CONTROL_KINDS)


def rows_for(name: str, world: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over the steady steps of every column; every rank must have issued the same calls."""
    per_step = [ranks[0]["counts"].get(step, {}) for step in STEADY]
    for rank, result in enumerate(ranks[1:], start=1):
        theirs = [result["counts"].get(step, {}) for step in STEADY]
        if theirs != per_step:
            raise RuntimeError(f"{name} P={world}: rank {rank} issued other collectives than rank 0: {theirs} vs {per_step}")

    def median(select) -> float:
        return statistics.median(sum(n for (cat, kind), n in step.items() if select(cat, kind)) for step in per_step)

    totals = [sum(n for (cat, _), n in step.items() if cat != "world") for step in per_step]
    row = {
        "preset": name,
        "P": world,
        "buffers": statistics.median(ranks[0]["buffers"][step] for step in STEADY),
        "payload": median(lambda cat, kind: cat == "payload"),
        "control": median(lambda cat, kind: cat == "control"),
        "total": statistics.median(totals),
        "total_range": f"{min(totals)}-{max(totals)}",
        "world": median(lambda cat, kind: cat == "world"),
    }
    for kind in CONTROL_KINDS:
        row[kind] = median(lambda cat, k, kind=kind: cat == "control" and k == kind)
    return row


STEP_FIELDS = ("preset", "P", "step", "buffers", "category", "kind", "calls")


def step_rows(name: str, world: int, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rank 0's calls at every step (step -1: outside any step, e.g. set-up), one row per kind."""
    return [
        {"preset": name, "P": world, "step": step, "buffers": result["buffers"].get(step, ""),
         "category": category, "kind": kind, "calls": n}
        for step, counts in sorted(result["counts"].items())
        for (category, kind), n in sorted(counts.items())
    ]  # fmt: skip


#: what the table's "after" column removed, and what it leaves (rounds.md, below the table)
NOTES = """\
## Removed (each with its test)

- **The non-finite vote's own round** (every sparse preset, 1 per step). With no dense part in the
  last buffer to ride in, the vote rides in the last buffer's sparse exchange, in a message that
  every rank sends to every rank anyway (`Communicator.carries_votes`, `Encoded.votes`): a second
  header entry of the allgather message, the low bit of ZEN's push counts and of Ok-Topk's region
  counts, one byte per rank after SparCML's header word (merged as it doubles), P entries after
  the values of a shared-position (randomk) or dense all-reduce. Per-tensor policies with offloaded
  selections now carry it too (dense or sparse): the last buffer is packed on the offload worker
  behind every offloaded selection. Tests: `test_votes_ride_in_every_scheme_without_a_round`,
  `test_votes_ride_in_oktopk_counts` (test_sparse_allreduce.py),
  `test_the_vote_rides_in_the_last_sparse_exchange` (one case per carrier, offloaded included),
  `test_the_vote_rides_in_the_last_dense_part_when_there_is_one` (test_reliability.py).
- **Ok-Topk's all-gather of the kept counts** (`oktopk_sizes`, 1 per buffer and step when the
  threshold is reused).
  A reused threshold is one of the grid's edges, so the grid's counts, all-gathered per rank
  instead of all-reduced (24 int64 per rank), already are the owners' kept counts. Test:
  `test_oktopk_reused_threshold_round_carries_the_kept_counts`, `test_count_at_least_is_the_kept_count`.
- **SparCML's header message for a rank's own selection** (zen preset, which picks SparCML at these
  P: 2 calls per buffer, i.e. every header at P=2 and half of them at P=4). With the plan's count
  bound (`max_count`, now passed by the ZEN communicator), the fold and the first doubling round
  send the selection in one message, header in front, padded to the bound (no padding for top-k);
  ZEN's cost model counts the message it saves. Tests:
  `test_sparcml_sends_a_bounded_selection_with_its_header`, `test_sparcml_refuses_a_violated_bound`
  (test_sparse_allreduce.py), `test_zen_counts_one_message_for_sparcml_first_round_when_counts_are_bounded`
  (test_scheme_fidelity.py).

Already absent before: the allgather count exchange (dgc and top-k bound their counts by the plan's
k, adtopk's count is exact, SAFusion's alignment makes counts equal), usage agreement
(find_unused_parameters off), the ready-order broadcast and cost agreement (first step and step 4).

## Left, and why

- SparCML's later headers (`sparcml_header`): a merged set's size is the union of several
  selections, known only after the merge; padding to the sum of the bounds would send the overlap
  of the ranks' selections as padding, the bytes SparCML exists to save.
- ZEN's push counts (`zen_push_counts`): per-destination counts of a hash partition; the only bound
  is a rank's whole selection per destination, P times the push's bytes. Its pull counts
  (`zen_pull_counts`): the owners' nonzero counts after the push, needed to size the pull's uneven
  all_to_all; no bound short of the partition itself (n/P elements).
- Ok-Topk's region counts (`oktopk_counts`): per-region counts for the uneven all_to_all of pairs,
  bounded only by the whole selection (P times the bytes). Its threshold rounds
  (`oktopk_threshold`, coarse then fine): the fine grid sits inside the step the coarse round
  picks; one round would count all 24 x 24 fine edges, about 4.6 KB per rank all-gathered (P times
  that received), more than Ok-Topk's whole payload at small k and past its 3(P-1)/P k(v+x) bound.
  Every 32nd round (the exact threshold) also all-gathers candidate counts, candidates and kept counts.
- Threshold sparsifiers whose count may exceed k (gaussiank, redsync, sidco, threshold_reuse on
  allgather): the count exchange stays; padding to the bound (4/3 k to 2k) would cost
  (P-1) x (bound - count) pairs per rank every step to save one latency, which pays only for
  buffers small enough that those bytes take less than alpha (a per-buffer choice from the agreed
  alpha-beta costs would be the way to take it; none of the presets needs it).
- Whole-buffer (`behind`) policies with an offloaded buffer keep the vote's round: an earlier
  buffer's check may finish on the worker after the last buffer is packed on the main thread.

Calls, not rounds: a SparCML exchange with a partner is an isend and an irecv (2 calls, one round
trip); every other call here is one collective.
"""


def write_report(out: Path) -> None:
    after = read_csv(out / "rounds.csv") if (out / "rounds.csv").exists() else []
    before_path = out / "rounds_before.csv"
    before = {(r["preset"], r["P"]): r for r in read_csv(before_path)} if before_path.exists() else {}
    kinds = [k for k in CONTROL_KINDS if any(r.get(k, "0") != "0" for r in [*after, *before.values()])]

    def change(old: dict[str, str], row: dict[str, str], field: str) -> str:
        was, now = old.get(field, "?"), row.get(field, "0")
        return now if was == now else f"{was} → {now}"

    lines = [
        "# Collectives per training step (issue 14, item 4)",
        "",
        f"`python -m experiments.count_rounds`: P gloo ranks on loopback, a 5-layer MLP (256 wide), "
        f"buffer_mb={BUFFER_MB}, {STEPS} steps; each cell is the median over steps {STEADY.start}-{STEADY.stop - 1} "
        "(0-based; after the ready-order rebuild, cost profiling and agreement, and ZEN's scheme choice). "
        "Presets run with offload='none' except where the row says otherwise; dense = the ssfusion preset "
        "with sparsifier='none'. Counted: every torch.distributed call on the strategy's process groups, "
        "by call site; payload = a buffer's dense part or sparse values and indices, control = everything "
        "else. `world` = calls on the default group, Lightning's own (`self.log(sync_dist=True)`: a barrier "
        "and an all_reduce on gloo), not counted in the total. \"before → after\": before = rounds_before.csv (the "
        "commit before this change), after = rounds.csv; one number where they agree. adtopk's partial "
        "and ssfusion's selective plans follow measured costs, so their dense/sparse split (and payload) "
        "may differ between runs.",
        "",
        "| preset | P | buffers | payload | control | total | " + " | ".join(kinds) + " | world |",
        "|---|---|---|---|---|---|" + "---|" * len(kinds) + "---|",
    ]
    for row in after:
        old = before.get((row["preset"], row["P"]), {})
        cells = [
            row["preset"], row["P"], row["buffers"], change(old, row, "payload"), change(old, row, "control"),
            change(old, row, "total"), *(change(old, row, k) for k in kinds), row["world"],
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Range of the total over the steady steps (after): "]
    lines.append(", ".join(f"{r['preset']} P={r['P']}: {r['total_range']}" for r in after) + ".")
    (out / "rounds.md").write_text("\n".join(lines) + "\n\n" + NOTES)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--presets", nargs="+", default=None, help="default: every configuration")
    parser.add_argument("--label", choices=("after", "before"), default="after")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        names = args.presets or list(configurations())
        rows, steps = [], []
        for world in args.worlds:
            results = count(world, names)
            for name in names:
                row = rows_for(name, world, results[name])
                rows.append(row)
                steps += step_rows(name, world, results[name][0])
                print(", ".join(f"{k}={fmt(v)}" for k, v in row.items() if v not in (0, 0.0)), flush=True)
        suffix = "" if args.label == "after" else "_before"
        write_csv(args.out / f"rounds{suffix}.csv", FIELDS, rows, cell=fmt)
        write_csv(args.out / f"rounds{suffix}_steps.csv", STEP_FIELDS, steps)
    write_report(args.out)


if __name__ == "__main__":
    main()

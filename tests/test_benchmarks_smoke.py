"""Fast smoke tests of the benchmark harnesses (experiments/bench_e2e.py, e2e_worker.py,
simulate.py, gpu/bench_gpu.py) and of REPORT.md's generated numbers against the committed CSVs."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from experiments import bench_fused_passes, common, e2e_analyze, e2e_report, simulate
from ssfusion_lightning import commcost

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "experiments" / "results"


# --------------------------------------------------------------------------- simulate.py
def _write(path: Path, fields: list[str], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in fields})


def _synthetic_e2e(tmp: Path) -> None:
    """A tiny e2e.csv / e2e_runs.csv: one workload, P = 2 and 4, one shaped and the unshaped link."""
    params, batch = 1_000_000, 32
    summary, runs = [], []
    for world in (2, 4):
        for rate, mbit in (("unshaped", "inf"), ("100mbit", "100")):
            bw = (2e9 if mbit == "inf" else 100e6) / 8 * 0.95
            dense = 2 * (world - 1) / world * params * 4
            # k = 10,000 values and compact positions: a 4-byte count per 2**16-element block, 2 bytes each
            gathered = (world - 1) * (10_000 * 4 + 16 * 4 + 10_000 * 2)
            compute = 0.1 * world / 2
            for scheme, sent, compress in (("compute_only", 0, None), ("ddp", dense, None),
                                           ("ddp_powersgd", 2 * (world - 1) / world * 40_000, None),
                                           ("ssfusion", gathered, 0.01), ("zen", 150_000, 0.01),
                                           ("oktopk", 200_000, 0.01), ("safusion", gathered, 0.01)):
                exposed = 0.0 if scheme == "compute_only" else sent / bw + 0.002
                step = compute + exposed + (compress or 0) + 0.005
                summary.append({
                    "world": world, "rate": rate, "rate_mbit": mbit, "workload": "toy", "scheme": scheme,
                    "step_ms": step * 1e3, "compute_ms": compute * 1e3, "compress_ms": "" if compress is None else compress * 1e3,
                    "exposed_comm_ms": "" if scheme == "compute_only" else exposed * 1e3,
                    "other_ms": "" if scheme == "compute_only" else 5.0, "bytes_per_step": sent,
                })
                plan = {"plan_buffers": 1, "plan_dense_elements": 0, "plan_sparse_elements": params,
                        "plan_sparse_k": 10_000} if scheme in simulate.SPARSE_KIND else {}
                runs.append({"world": world, "rate": "none" if mbit == "inf" else rate, "workload": "toy",
                             "scheme": scheme, "rep": 0, "params": params, "per_rank_batch": batch, **plan})
    _write(tmp / "e2e.csv", e2e_analyze.SUMMARY_FIELDS, summary)
    _write(tmp / "e2e_runs.csv", e2e_analyze.RUN_FIELDS, runs)


def test_simulate_projects_a_monotone_step_time_from_a_tiny_csv(tmp_path):
    _synthetic_e2e(tmp_path)
    assert simulate.main(["--e2e", str(tmp_path), "--out", str(tmp_path), "--no-report", "--no-paper"]) == 0
    for name in ("simulate.csv", "simulate_check.csv", "simulate.md", "simulate_scaling.png", "simulate_check.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    with (tmp_path / "simulate.csv").open() as f:
        rows = list(csv.DictReader(f))
    series = defaultdict(list)
    for r in rows:
        series[(r["workload"], r["link"], r["scheme"])].append((int(r["world"]), float(r["step_ms"]), float(r["comm_ms"])))
    assert {s for _, _, s in series} >= {"ddp", "ssfusion", "zen", "oktopk", "sparcml"}
    for key, points in series.items():
        points.sort()
        assert [p for p, _, _ in points] == simulate.WORLDS, key
        steps, comms = [s for _, s, _ in points], [c for _, _, c in points]
        assert all(b >= a - 1e-9 for a, b in zip(steps, steps[1:])), (key, steps)
        assert all(b >= a - 1e-9 for a, b in zip(comms, comms[1:])), (key, comms)
    with (tmp_path / "simulate_check.csv").open() as f:
        checked = list(csv.DictReader(f))
    assert {int(r["world"]) for r in checked} == {2, 4}
    # the synthetic bytes follow the formulas exactly for ddp and the allgather schemes
    for r in checked:
        if r["scheme"] in ("ddp", "ssfusion", "safusion"):
            assert abs(float(r["bytes_gap_pct"])) < 6, r


def test_fused_passes_variants_select_the_same_and_are_tabled(tmp_path):
    """The three ways of compensating and making the selection's pass agree bit for bit (the script
    checks it before it times them), and each gets a row."""
    assert bench_fused_passes.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = common.read_csv(tmp_path / "fused_passes.csv")
    assert [r["variant"] for r in rows] == ["fresh", "reused", "chunk_fused"]
    assert float(next(r for r in rows if r["variant"] == "reused")["x_reused"]) == 1.0
    assert (tmp_path / "fused_passes.png").stat().st_size > 0


def test_batched_selection_bench_checks_and_tables_each_sparsifier(tmp_path):
    """One row per sparsifier, the floor beside it; the compiled columns are filled exactly where
    numba is installed (the run checks the compiled top-k's selection before it times it)."""
    from experiments import bench_batched_selection

    assert bench_batched_selection.main(
        ["--quick", "--threads", "1", "--sparsifiers", "topk", "dgc", "--out", str(tmp_path)]
    ) == 0
    rows = common.read_csv(tmp_path / "batched_selection.csv")
    assert [r["sparsifier"] for r in rows] == ["topk", "dgc"]
    assert all(float(r["floor_x_abs_out"]) > 0 and float(r["many_ms"]) > 0 for r in rows)
    has_numba = importlib.util.find_spec("numba") is not None
    assert [r["compiled_many_ms"] != "" for r in rows] == [has_numba, False]
    assert "Target of issue 14" in (tmp_path / "batched_selection.md").read_text()


def test_compiled_topk_selects_what_the_library_selects_ties_included():
    pytest.importorskip("numba")
    import torch

    from experiments.compiled_topk import CompiledTopK
    from ssfusion_lightning.sparsifiers import build_sparsifier

    generator = torch.Generator().manual_seed(3)
    shapes = [(7, 3, 3, 3), (7,), (40, 900), (300,), (5000,)]
    # small integers: many equal magnitudes at every cut, so the tie rule decides
    tensors = [torch.randint(-6, 7, shape, generator=generator).float() for shape in shapes]
    sparsifier = build_sparsifier("topk", density=0.05)
    ks = [sparsifier.resolve_k(t.numel(), None) for t in tensors]
    expected = sparsifier.select_many(tensors, [f"t{i}" for i in range(len(tensors))], [None] * len(tensors))
    for (values, positions), (want_values, want_positions), k in zip(CompiledTopK(tensors, ks)(tensors), expected, ks):
        order = torch.argsort(want_positions)
        assert positions.numel() == k
        assert torch.equal(positions, want_positions[order]) and torch.equal(values, want_values[order])


def test_byte_formulas_follow_algorithms_section_7():
    n, k = 1_000_000, 10_000
    w = simulate.Workload("toy", n, 0, n, k, 1)
    for world in (2, 4, 16, 1024):
        assert simulate.scheme_bytes("ddp", w, world) == pytest.approx(2 * (world - 1) / world * n * 4)
        # k values, positions compact: a 4-byte count per 2**16-element block (16 here), 2 bytes each
        assert simulate.scheme_bytes("safusion", w, world) == pytest.approx((world - 1) * (k * 4 + 16 * 4 + k * 2))
        union = n * (1 - (1 - k / n) ** world)
        # the pull as a bitmap or as COO, whichever is smaller (ZEN sends the smaller)
        pull = min(n / 8 + union * 4, union * 8)
        assert simulate.scheme_bytes("zen", w, world) == pytest.approx((world - 1) / world * (k * 8 + pull))
        # (P-1)/P k(v+x) split (int32 positions), the kept entries C(v+x) (P-1)/P and a third of them
        # crossing slices, C = 1.1 k on 31 rounds in 32 and k on the exact threshold's; the region counts,
        # 31 rounds in 32 the two grids' 24 counts per rank, every 32 rounds the exact threshold's sizes,
        # kept counts and each owner's top magnitudes (K/P of them, 4 B each), and every 64 rounds the
        # regions' all-reduce of P-1 boundaries (2(P-1)/P of them)
        kept = (31 * 1.1 + 1) / 32 * k
        gathers = 31 * 2 * 24 * 8 + 2 * 8 + min(k, union / world) * 4
        okt = ((world - 1) / world * (k + 4 / 3 * kept) * 8 + (world - 1) * 8 + (world - 1) * gathers / 32
               + 2 * (world - 1) / world * (world - 1) * 8 / 64)
        assert simulate.scheme_bytes("oktopk", w, world) == pytest.approx(okt)
        assert simulate.scheme_bytes("auto", w, world) <= min(simulate.scheme_bytes(s, w, world) for s in ("ddp", "zen", "oktopk", "safusion", "sparcml"))
    assert simulate.scheme_bytes("ddp", w, 1) == 0.0
    # allgather grows linearly with P, the ring and Ok-Topk do not: at 1024 ranks dense is cheaper than allgather
    assert simulate.scheme_bytes("safusion", w, 1024) > simulate.scheme_bytes("ddp", w, 1024) > simulate.scheme_bytes("oktopk", w, 1024)


# --------------------------------------------------------------------------- bench_e2e.py analysis
def test_bench_e2e_summary_and_targets_from_raw_rows(tmp_path):
    runs = []
    for scheme, seconds in (("compute_only", 0.1), ("compute_sync", 0.11), ("ddp", 0.5), ("ddp_fp16", 0.3),
                            ("ddp_powersgd", 0.2), ("ssfusion", 0.12), ("ssfusion_dense", 0.14)):
        for rate in ("none", "50mbit"):
            step = seconds if rate == "50mbit" else min(seconds, 0.13)
            runs.append({
                "world": 4, "phase": rate, "workload": "resnet18", "scheme": scheme, "rep": 0, "steps": 8, "warmup": 2,
                "params": 1000, "param_tensors": 3, "per_rank_batch": 32, "fit_seconds": 1.0,
                "step_seconds": [1.0, 1.0] + [step] * 6,
                "step_cpu_seconds": [0.9, 0.9] + [0.08 if scheme == "ddp" else 0.1] * 6,
                "engine": [{"bytes_sent": 100.0, "compress_seconds": 0.005, "exposed_comm_seconds": 0.01}] * 8
                if scheme == "ssfusion" else [],
                "hook_payload": [500] * 8 if scheme.startswith("ddp_") else [],
                "eval": {"val_acc": 0.9, "val_loss": 0.3} if rate == "none" and scheme in ("ddp", "ssfusion") else None,
            })
    steps, rows = e2e_analyze.raw_rows(runs)
    common.write_csv(tmp_path / "e2e_steps.csv", e2e_analyze.STEP_FIELDS, steps)
    common.write_csv(tmp_path / "e2e_runs.csv", e2e_analyze.RUN_FIELDS, rows)
    summary, targets = e2e_report.write_all(tmp_path, "e2e", update=False)
    row = next(r for r in summary if r["scheme"] == "ssfusion" and r["rate"] == "50mbit")
    assert row["step_s"] == pytest.approx(0.12)
    assert row["x_ddp"] == pytest.approx(0.5 / 0.12)
    assert row["x_best_hook"] == pytest.approx(0.2 / 0.12)
    assert row["of_compute"] == pytest.approx(0.1 / 0.12)
    ddp = next(r for r in summary if r["scheme"] == "ddp" and r["rate"] == "50mbit")
    assert ddp["comm_fraction"] == pytest.approx(0.4 / 0.5)
    assert ddp["bytes_per_step"] == pytest.approx(1.5 * 4000)
    checks = {t["check"]: t for t in targets}
    assert checks["ssfusion_x_ddp"]["met"] and checks["ssfusion_x_best_hook"]["met"] and checks["ssfusion_of_compute"]["met"]
    assert checks["ssfusion_acc_minus_ddp_points"]["value"] == pytest.approx(0.0)
    # unshaped: ddp's step is capped at 0.13 s, the dense engine's 0.13 s too; CPU 0.1 vs 0.08 s
    assert checks["dense_engine_step_over_ddp"]["value"] == pytest.approx(1.0)
    assert "CPU time per step 1.250x (100.0 vs 80.0 ms)" in checks["dense_engine_step_over_ddp"]["note"]
    for name in ("e2e.csv", "e2e.md", "e2e_targets.csv", "e2e_throughput.png", "e2e_breakdown.png"):
        assert (tmp_path / name).stat().st_size > 0, name


# --------------------------------------------------------------------------- the worker on 2 ranks
def _cluster_usable() -> bool:
    try:
        from experiments.cluster import probe_support

        return bool(probe_support().get("usable"))
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _cluster_usable(), reason="network namespaces / tc are not permitted here")
def test_e2e_worker_runs_two_tiny_configurations_on_two_emulated_nodes(tmp_path):
    from experiments.cluster import EmulatedCluster

    out = tmp_path / "runs.jsonl"
    runs = [
        {"workload": "gpt2", "scheme": "ssfusion", "steps": 2, "warmup": 0, "eval": True},
        {"workload": "gpt2", "scheme": "ddp_powersgd", "steps": 3, "warmup": 0},
    ]
    spec = {"ctl": str(tmp_path), "out": str(out), "quick": True, "phases": [{"label": "none", "runs": runs}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "go_0").write_text("go")
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with EmulatedCluster(nodes=2, rate=None) as cluster:
        result = cluster.run([sys.executable, "-m", "experiments.e2e_worker", str(tmp_path / "spec.json")],
                             env=env, timeout=150, log_dir=tmp_path / "logs", stream=False, fail_grace=5)
    assert result.returncode == 0, result.log(0)[-3000:] + result.log(1)[-2000:]
    assert (tmp_path / "done_0").exists()
    recorded = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["scheme"] for r in recorded] == ["ssfusion", "ddp_powersgd"]
    ssf, psgd = recorded
    assert ssf["world"] == 2 and len(ssf["step_seconds"]) == 2 and all(t > 0 for t in ssf["step_seconds"])
    assert len(ssf["step_cpu_seconds"]) == 2 and all(t > 0 for t in ssf["step_cpu_seconds"])
    assert ssf["rank_step_seconds"][0] == ssf["step_seconds"] and len(ssf["rank_step_seconds"]) == 2
    assert all(len(steps) == 2 and all(t > 0 for t in steps) for steps in ssf["rank_step_seconds"])
    assert 0 < ssf["engine"][-1]["bytes_sent"] < ssf["engine"][-1]["dense_equivalent_bytes"]
    assert ssf["plan_sparse_k"] > 0 and ssf["plan_buffers"] >= 1
    # comm="auto" notes a choice per buffer; 2 steps measure no costs yet (profiling starts at step 1)
    assert len(ssf["plan_comm"].split(";")) == ssf["plan_buffers"] and ssf["plan_costs"] is None
    assert math.isfinite(ssf["eval"]["val_loss"]) and 0 <= ssf["eval"]["val_acc"] <= 1
    # PowerSGD compresses from its third step on (start_powerSGD_iter=2): fewer bytes than its plain first step
    assert len(psgd["hook_payload"]) == 3 and 0 < psgd["hook_payload"][-1] < psgd["hook_payload"][0]


# --------------------------------------------------------------------------- the GPU script on a CPU
def test_gpu_script_runs_on_cpu_quick(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "-m", "experiments.gpu.bench_gpu", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["quick"]
    assert {r["sparsifier"] for r in result["sparsifiers"]} >= {"topk", "dgc", "threshold_reuse"}
    assert all(fit["per_element_seconds"] >= 0 for fit in result["compress_fit"].values())
    assert result["offload"]["mode"] == "thread" and 0 <= result["offload"]["hidden_fraction"] <= 1
    assert {m["model"] for m in result["models"]} == {"resnet152", "vit", "gpt2", "bert"}
    assert all(m["step_ms"] > 0 and m["params"] > m["params_1d"] > 0 for m in result["models"])


# --------------------------------------------------------------------------- REPORT.md vs committed CSVs
@pytest.mark.skipif(not (RESULTS / "e2e_steps.csv").exists(), reason="no committed e2e results")
def test_report_e2e_numbers_come_from_the_committed_csvs():
    steps = common.read_csv(RESULTS / "e2e_steps.csv")
    runs = common.read_csv(RESULTS / "e2e_runs.csv")
    summary = e2e_analyze.summarize(steps, runs)
    targets = e2e_analyze.targets(summary)
    assert common.report_section("e2e") == e2e_report.report_block(summary, targets).strip()
    assert common.report_section("e2e-headline") == e2e_report.headline_block(summary, targets).strip()
    if (RESULTS / "e2e_curve.csv").exists():
        curve = common.read_csv(RESULTS / "e2e_curve.csv")
        assert common.report_section("e2e-curve") == e2e_report.curve_markdown(curve).strip()
    # and the committed summary CSV is the one these raw rows give
    with (RESULTS / "e2e.csv").open() as f:
        committed = list(csv.DictReader(f))
    assert committed == [{k: str(v) for k, v in r.items()} for r in e2e_analyze.summary_csv_rows(summary)]


@pytest.mark.parametrize("stem", ["e2e_cpu"])
def test_bench_e2e_from_raw_rebuilds_the_committed_tables(tmp_path, stem):
    """``python -m experiments.bench_e2e --from-raw`` on a committed raw record gives the committed
    CSVs and Markdown again, byte for byte (REPORT.md cites these commands)."""
    from experiments import bench_e2e

    if not (RESULTS / f"{stem}_raw.jsonl").exists():
        pytest.skip(f"no committed {stem} results")
    for suffix in ("_raw.jsonl", "_meta.json"):
        (tmp_path / f"{stem}{suffix}").write_text((RESULTS / f"{stem}{suffix}").read_text())
    assert bench_e2e.main(["--from-raw", "--out", str(tmp_path), "--name", stem]) == 0
    for suffix in (".csv", ".md", "_targets.csv", "_targets.md", "_runs.csv", "_steps.csv", "_curve.csv"):
        name = f"{stem}{suffix}"
        assert (tmp_path / name).read_text() == (RESULTS / name).read_text(), name
    for suffix in ("_throughput.png", "_breakdown.png"):
        assert (tmp_path / f"{stem}{suffix}").stat().st_size > 0


@pytest.mark.skipif(not (RESULTS / "simulate_check.csv").exists(), reason="no committed simulate results")
def test_report_simulate_numbers_come_from_the_committed_csvs(tmp_path):
    assert simulate.main(["--out", str(tmp_path), "--no-report"]) == 0
    for name in ("simulate.csv", "simulate_check.csv"):
        assert (tmp_path / name).read_text() == (RESULTS / name).read_text(), name
    section = common.report_section("simulate")
    assert section is not None and section == (tmp_path / "simulate.md").read_text().split("\n\n", 1)[1].strip()


@pytest.mark.parametrize("stem", ["ab_first_buffer", "ab_process_groups", "ab_vote_in_dense", "ab_serial_cpu_quiet"])
def test_report_ab_tables_come_from_the_committed_csvs(stem):
    from experiments import ab_engine_options

    if not (RESULTS / f"{stem}.csv").exists():
        pytest.skip(f"no committed {stem} results")
    rows = common.read_csv(RESULTS / f"{stem}.csv")
    labels = {r["variant"]: ab_engine_options.variant_label(r["options"], r.get("revision", "")) for r in rows}
    table = ab_engine_options.markdown(rows, labels["A"], labels["B"])
    assert (RESULTS / f"{stem}.md").read_text() == table
    assert table in (RESULTS.parent / "REPORT.md").read_text()
    gpt2_40 = [r for r in rows if (r["workload"], r["rate"], r["scheme"]) == ("gpt2", "40mbit", "ssfusion")]
    assert sorted(r["variant"] for r in gpt2_40) == ["A", "A", "A", "B", "B", "B"]


# --------------------------------------------------------------------------- bench_comm_choice.py
def test_comm_choice_compares_auto_with_the_best_fixed_scheme_of_the_same_cell():
    from experiments import bench_comm_choice

    def row(variant, repeat, x, world=2, rate="40mbit", choices="", buffers=""):
        return {"variant": variant, "repeat": repeat, "world": world, "workload": "resnet18", "rate": rate,
                "scheme": "ssfusion", "x_ddp_step": x, "choices": choices, "buffers": buffers}

    rows = [row("auto", 0, 0.50, choices="allgather:3", buffers="3"), row("auto", 1, 0.54, choices="allgather:2 zen:1", buffers="3"),
            row("allgather", 0, 0.52, buffers="5"), row("allgather", 1, 0.50, buffers="3"), row("zen", 0, 0.60), row("zen", 1, 0.62),
            row("ddp_powersgd", 0, 0.40),
            row("auto", 0, 0.70, world=4), row("auto", 1, 0.72, world=4), row("zen", 0, 0.60, world=4), row("zen", 1, 0.64, world=4)]
    p2, p4 = bench_comm_choice.summarize(rows)
    # medians: auto 0.52, allgather 0.51 (best), zen 0.61: auto / best = 0.52 / 0.51, within 5%
    assert p2["best_fixed"] == "allgather" and p2["auto_over_best"] == pytest.approx(0.52 / 0.51) and p2["met"]
    assert p2["medians"]["ddp_powersgd"] == 0.40 and p2["choices"] == ["allgather:3", "allgather:2 zen:1"]
    # a hook never counts as a fixed scheme: at P = 4 zen is the best, and auto is 0.71 / 0.62 of it, too slow
    assert p4["best_fixed"] == "zen" and p4["auto_over_best"] == pytest.approx(0.71 / 0.62) and not p4["met"]
    table = bench_comm_choice.markdown([p2, p4], ["allgather", "zen"], {"repeats": 2})
    assert "| 2 | resnet18 | 40mbit | 0.520 | 0.510 | 0.610 | 0.400 |  | allgather | 1.020 | yes |" in table
    assert "within 1.05x of the best fixed scheme in 1 of 2 cases" in table
    # runs grouped by their plan's buffers: auto's two 3-buffer runs, allgather's one of 3 and one of 5
    table = bench_comm_choice.markdown([p2, p4], ["allgather", "zen"], {"repeats": 2}, rows)
    assert "| 2 | resnet18 | 40mbit | auto | 3 | 0.520 | 2 |" in table
    assert "| 2 | resnet18 | 40mbit | allgather | 3 | 0.500 | 1 |" in table and "| allgather | 5 | 0.520 | 1 |" in table
    assert "| zen |" not in table.split("Step / ddp by the buffers")[1]  # runs without a buffer count stay out


def test_comm_choice_pairs_the_runs_of_one_launch():
    from experiments import bench_comm_choice

    args = argparse.Namespace(rates=["150mbit"], workloads=["resnet18"], pairs=2, steps=bench_comm_choice.STEPS)
    chosen = bench_comm_choice.variants(["allgather"])
    (phase,) = bench_comm_choice.launch_phases(args, chosen, repeat=0)
    order = [(r["scheme"], r.get("variant"), r["rep"]) for r in phase["runs"]]
    # ddp beside every pair, the variants' order reversed in the second pair, the hooks once
    assert order == [("ddp", None, 0), ("ssfusion", "auto", 0), ("ssfusion", "allgather", 0), ("ddp_powersgd", None, 0),
                     ("ddp_powersgd4", None, 0), ("ddp", None, 1), ("ssfusion", "allgather", 1), ("ssfusion", "auto", 1)]
    assert phase["runs"][1]["overrides"] == {"comm": "auto"} and phase["runs"][0]["warmup"] < phase["runs"][1]["warmup"]
    # extra variants run beside the others, under names no scheme or hook has
    assert bench_comm_choice.variants(["allgather"], {"hybrid": {"comm": "hybrid"}})["hybrid"] == {"comm": "hybrid"}
    with pytest.raises(ValueError, match="zen"):
        bench_comm_choice.variants(["allgather"], {"zen": {"comm": "hybrid"}})

    def record(scheme, rep, seconds, variant=None, **extra):
        return {"world": 2, "workload": "resnet18", "phase": "150mbit", "scheme": scheme, "rep": rep, "warmup": 1,
                "step_seconds": [9.0, *seconds], **({"variant": variant} if variant else {}), **extra}

    # launch 0 fast, launch 1 slow (every run 1.5x): across launches the medians mix the modes,
    # pairs compare runs of one mode
    records = [[record("ddp", 0, [0.2]), record("ssfusion", 0, [s * 0.050], "auto", plan_comm="allgather;allgather"),
                record("ssfusion", 0, [s * 0.049], "allgather"), record("ddp_powersgd", 0, [s * 0.04])]
               for s in (1.0, 1.5)]
    rows = bench_comm_choice.rows_of(records[0], 0) + bench_comm_choice.rows_of(records[1], 1)
    assert [r["pair"] for r in rows] == ["0.0"] * 3 + ["1.0"] * 3
    assert rows[0]["choices"] == "allgather:2" and rows[1]["choices"] == "" and rows[0]["x_ddp_step"] == "0.250"
    (cell_,) = bench_comm_choice.summarize(rows)
    assert cell_["best_fixed"] == "allgather" and cell_["paired"] == pytest.approx(0.050 / 0.049)
    assert cell_["met"] and cell_["medians"]["ddp_powersgd"] == pytest.approx((0.2 + 0.3) / 2)
    table = bench_comm_choice.markdown([cell_], ["allgather"], {"repeats": 2, "pairs": 1}, rows)
    assert "2 launches, every variant 1 times in each" in table and "| 1.020 | 1.020 | yes |" in table
    # a failed run or one without a ddp beside it gives no row
    assert bench_comm_choice.rows_of([record("ssfusion", 0, [0.05], "auto")], 0) == []
    assert bench_comm_choice.rows_of([record("ddp", 0, [0.2]), record("ssfusion", 0, [0.05], "auto", error="boom")], 0) == []


@pytest.mark.skipif(not (RESULTS / "comm_choice.csv").exists(), reason="no committed comm_choice results")
def test_report_comm_choice_table_comes_from_the_committed_csv():
    import json

    from experiments import bench_comm_choice

    meta = json.loads((RESULTS / "comm_choice_meta.json").read_text())
    rows = common.read_csv(RESULTS / "comm_choice.csv")
    summary = bench_comm_choice.summarize(rows)
    expected = bench_comm_choice.markdown(summary, bench_comm_choice.shown_variants(meta), meta, rows)
    assert common.report_section("comm-choice") == expected.strip()


# --------------------------------------------------------------------------- bench_memory.py
def test_bench_memory_summary_and_targets_from_rows():
    from experiments import bench_memory

    grad = 10 * bench_memory.MiB

    def row(scheme, rank, peak_mb, state=0, rep=0, anon_mb=300, file_mb=150):
        return {"workload": "mlp12m", "scheme": scheme, "rep": str(rep), "rank": str(rank), "device": "cpu",
                "steps": "20", "params": str(grad // 4), "grad_bytes": str(grad), "state_bytes": str(state),
                "peak_rss_bytes": str(int(peak_mb * bench_memory.MiB)), "baseline_rss_bytes": str(400 * bench_memory.MiB),
                "train_start_rss_bytes": str(410 * bench_memory.MiB), "end_rss_bytes": str(450 * bench_memory.MiB),
                "end_anon_bytes": str(anon_mb * bench_memory.MiB), "end_file_bytes": str(file_mb * bench_memory.MiB),
                "cuda_max_allocated_bytes": "", "error": ""}

    runs = [row("ddp", 0, 500), row("ddp", 1, 900), row("ddp", 0, 510, rep=1), row("ddp", 1, 510, rep=1),
            row("ssfusion_dense", 0, 520), row("ssfusion", 0, 520, grad, anon_mb=310, file_mb=153),
            row("ssfusion", 0, 530, grad, rep=1, anon_mb=310, file_mb=153),
            row("ssfusion_dgc", 0, 530, 2 * grad), {**row("zen", 0, 1), "error": "boom"}]
    summary = {r["scheme"]: r for r in bench_memory.summarize(runs)}
    assert list(summary) == ["ddp", "ssfusion_dense", "ssfusion", "ssfusion_dgc"]  # the failed run is left out
    assert summary["ddp"]["peak"] == pytest.approx(505 * bench_memory.MiB)  # rank 0's median over the repeats
    assert summary["ddp"]["peak_max_rank"] == pytest.approx(705 * bench_memory.MiB)
    assert summary["ssfusion"]["extra_x_grad"] == pytest.approx(2.0) and not summary["ssfusion"]["met"]
    assert summary["ssfusion"]["state_x_grad"] == pytest.approx(1.0)
    assert summary["ssfusion"]["end_anon_extra_x_grad"] == pytest.approx(1.0)
    assert summary["ssfusion"]["end_file_extra"] == pytest.approx(3 * bench_memory.MiB)
    assert summary["ssfusion_dgc"]["extra_x_grad"] == pytest.approx(2.5) and not summary["ssfusion_dgc"]["met"]
    assert summary["ssfusion_dgc"]["target"] == "extra <= 2.3 x grad"
    assert summary["ssfusion_dense"]["target_value"] == pytest.approx(520 / 505) and summary["ssfusion_dense"]["met"]
    assert summary["ddp"]["met"] is None
    table = bench_memory.markdown(list(summary.values()), runs)
    assert "| mlp12m | ssfusion | 525.0 | +20.0 | +2.00 | +0.00 | +1.00 | +3.0 | 1.00 | extra <= 1.15 x grad | **no** |" in table
    # runs recorded before the split: its cells stay empty
    old = [{k: v for k, v in r.items() if not k.startswith("end_anon") and not k.startswith("end_file")} for r in runs]
    assert "| mlp12m | ssfusion | 525.0 | +20.0 | +2.00 | +0.00 | - | - | 1.00 |" in bench_memory.markdown(bench_memory.summarize(old), old)
    assert "Failed runs (left out): mlp12m/zen." in table


def test_bench_memory_measures_two_tiny_runs_on_two_ranks(tmp_path):
    from experiments import bench_memory

    argv = ["--workloads", "mlp_tiny", "--schemes", "ddp", "ssfusion", "--steps", "3", "--repeats", "1",
            "--out", str(tmp_path), "--no-report", "--no-retry", "--timeout", "120"]
    assert bench_memory.main(argv) == 0
    with (tmp_path / "memory_runs.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == bench_memory.RUN_FIELDS
        runs = list(reader)
    assert sorted((r["scheme"], r["rank"]) for r in runs) == [("ddp", "0"), ("ddp", "1"), ("ssfusion", "0"), ("ssfusion", "1")]
    for r in runs:
        assert not r["error"], r["error"]
        assert int(r["grad_bytes"]) == 4 * int(r["params"]) > 0
        assert int(r["peak_rss_bytes"]) >= int(r["baseline_rss_bytes"]) > 0
        assert int(r["train_start_rss_bytes"]) > 0 and int(r["end_rss_bytes"]) > 0
        assert 0 < int(r["end_anon_bytes"]) < int(r["end_rss_bytes"]) and 0 < int(r["end_file_bytes"]) < int(r["end_rss_bytes"])
        # the residual memory holds at most one gradient (dense-sent tensors keep none); DDP none
        assert (0 < int(r["state_bytes"]) <= int(r["grad_bytes"])) if r["scheme"] == "ssfusion" else r["state_bytes"] == "0"
    with (tmp_path / "memory.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == bench_memory.SUMMARY_FIELDS
        summary = {r["scheme"]: r for r in reader}
    assert float(summary["ddp"]["peak_mb"]) > 0 and float(summary["ssfusion"]["peak_mb"]) > 0
    assert summary["ssfusion"]["target"] == "extra <= 1.15 x grad" and summary["ssfusion"]["met"] in ("yes", "no")
    for name in ("memory.md", "memory.png"):
        assert (tmp_path / name).stat().st_size > 0, name


@pytest.mark.skipif(not (RESULTS / "memory_runs.csv").exists(), reason="no committed memory results")
@pytest.mark.parametrize("stem", ["memory", "memory_mmap"])
def test_report_memory_tables_come_from_the_committed_csvs(stem):
    from experiments import bench_memory

    if not (RESULTS / f"{stem}_runs.csv").exists():
        pytest.skip(f"no committed {stem} results")
    runs = common.read_csv(RESULTS / f"{stem}_runs.csv")
    table = bench_memory.markdown(bench_memory.summarize(runs), runs)
    assert common.report_section(stem.replace("_", "-")) == table.strip()
    assert (RESULTS / f"{stem}.md").read_text().endswith(table)


# --------------------------------------------------------------------------- count_rounds.py
@pytest.mark.skipif(not (RESULTS / "rounds.csv").exists(), reason="no committed rounds results")
def test_rounds_table_comes_from_the_committed_csvs(tmp_path):
    from experiments import count_rounds

    for name in ("rounds.csv", "rounds_before.csv"):
        if (RESULTS / name).exists():
            (tmp_path / name).write_text((RESULTS / name).read_text())
    count_rounds.write_report(tmp_path)
    assert (tmp_path / "rounds.md").read_text() == (RESULTS / "rounds.md").read_text()


def test_count_rounds_finds_no_control_round_in_a_steady_step():
    """Two ranks, every call classified: the ssfusion and zen presets issue payload only once
    steady; Ok-Topk keeps its region counts and two threshold rounds per buffer."""
    from experiments import count_rounds

    names = ["ssfusion", "zen", "oktopk"]
    results = count_rounds.count(2, names)
    rows = {name: count_rounds.rows_for(name, 2, results[name]) for name in names}
    for name, row in rows.items():
        assert row["unclassified"] == 0 and row["buffers"] > 1, row
    assert rows["ssfusion"]["control"] == rows["zen"]["control"] == 0, rows
    buffers = rows["oktopk"]["buffers"]
    assert (rows["oktopk"]["oktopk_counts"], rows["oktopk"]["oktopk_threshold"]) == (buffers, 2 * buffers), rows
    assert rows["oktopk"]["control"] == 3 * buffers and rows["oktopk"]["vote"] == 0, rows


# --------------------------------------------------------------------------- simulate.py: host and node layouts
def test_cpu_bound_terms_scale_with_the_hosts_oversubscription(tmp_path):
    _synthetic_e2e(tmp_path)
    rows, plans = simulate.load_e2e(tmp_path)
    assert simulate.oversubscription(2, 2) == 1.0 and simulate.oversubscription(4, 2) == 2.0
    assert simulate.oversubscription(8, 16) == 1.0 and simulate.oversubscription(6, 4, threads=2) == 3.0
    assert simulate.host_scale(4, 2, cores=2) == 2.0 and simulate.host_scale(4, 2, cores=4) == 1.0
    plain = {(r["world"], r["rate"], r["scheme"]): r for r in simulate.check(rows, plans, 1e-4, 2, 2000.0)}
    hosted = {(r["world"], r["rate"], r["scheme"]): r for r in simulate.check(rows, plans, 1e-4, 2, 2000.0, cores=2)}
    # at the base P nothing scales; at P = 4 on 2 cores the engine's compression (10 ms) and
    # overhead (5 ms) of the base P take twice as long: +15 ms on a shaped link
    for scheme in ("ssfusion", "zen", "oktopk"):
        assert hosted[(2, "100mbit", scheme)]["predicted_step_ms"] == pytest.approx(plain[(2, "100mbit", scheme)]["predicted_step_ms"])
        assert hosted[(4, "100mbit", scheme)]["predicted_step_ms"] == pytest.approx(plain[(4, "100mbit", scheme)]["predicted_step_ms"] + 15)
    # plain DDP has no hook work; its shaped-link prediction does not change
    assert hosted[(4, "100mbit", "ddp")]["predicted_step_ms"] == pytest.approx(plain[(4, "100mbit", "ddp")]["predicted_step_ms"])


GOOD = 0.95  # simulate.GOODPUT


def _layout(nodes, per_node, nics, node_mbit, nic_mbit, alpha, rings=1):
    return simulate.Layout(nodes, per_node, nics, (node_mbit, alpha), (nic_mbit, alpha), rings)


def test_hierarchical_and_flat_schemes_on_2_nodes_of_2_ranks_at_hand_computed_points():
    # 2 nodes x 2 ranks, one NIC per node (the emulated node): node link 800 Mbit/s, NIC 8 Mbit/s,
    # both at 95% goodput (95e6 and 0.95e6 B/s), 1 ms per round. One buffer, N = 10^6 sparse, k = 10^4.
    a, bn, bc = 1e-3, 800e6 / 8 * GOOD, 8e6 / 8 * GOOD
    w = simulate.Workload("toy", 10**6, 0, 10**6, 10**4, 1)
    layout = _layout(2, 2, 1, 800.0, 8.0, a)
    assert bn == pytest.approx(95e6) and bc == pytest.approx(0.95e6)
    # hierarchical:allgather: the sparse node step, 3 collectives of 1 round each, 4 B values and
    # compact positions (a 4-byte count per 2^16-element block, 16 of them, then 2 B each): the
    # other local rank's 10^4 pairs, 60,064 B, a count (8 B), the other stripe's share of the sum's
    # 10^6 (1 - 0.99^4) = 39,403.99 nonzeros, 6 * 19,701.995 + 64 B: 3a + 178,347.97 / bn (the dense
    # step's reduce-scatter and all-gather of half of 4 MB each would take 2 * (a + 2e6 / bn)); a node's union of 2
    # selections is 10^6 (1 - 0.99^2) = 19,900, 9,950 per stripe; the 2 local ranks cross at once on
    # the one NIC (half its rate each): the allgather over 2 nodes moves 9,950 values of 4 B and
    # their positions compact (8 blocks of the 5 * 10^5-element stripe, 4 B each, and 2 B per
    # position): a + 59,732 / (bc / 2), after a round that agrees on the largest count (8 B): a + 8 / (bc / 2)
    hier = 3 * a + 178_347.97 / bn + a + 59_732 / (bc / 2) + a + 8 / (bc / 2)
    assert hier == pytest.approx(0.132646, rel=1e-5)
    assert simulate.layout_comm_seconds("hierarchical:allgather", w, layout) == pytest.approx(hier)
    # flat allgather: gloo's one ring crosses each node once each way, so the ring runs at the
    # NIC's rate: 3 rounds and 3 * 10^4 pairs (4 B values, positions in 16 blocks of 4 B and 2 B each)
    flat = 3 * a + 3 * (10**4 * 4 + 16 * 4 + 10**4 * 2) / bc
    assert simulate.layout_comm_seconds("allgather", w, layout) == pytest.approx(flat)
    assert simulate.layout_comm_seconds("allgather", w, _layout(4, 1, 1, 800.0, 8.0, a)) == pytest.approx(flat)
    assert hier / flat == pytest.approx(0.6884, abs=1e-4)
    # dense DDP: the workload's 1 bucket, 2(P-1) rounds, 2 * 3/4 * 4 MB through the NIC
    assert simulate.layout_comm_seconds("ddp", w, layout) == pytest.approx(6 * a + 6e6 / bc)
    # all_to_all: 2/3 of a rank's bytes leave the node, 2 ranks per NIC: 4/3 of the NIC's time per byte
    node, across = simulate.hierarchy_links(layout)
    assert across.allgather.beta == pytest.approx(2 / bc) and node.allgather.beta == pytest.approx(1 / bn)
    assert simulate.flat_links(layout).alltoall.beta == pytest.approx(4 / 3 / bc)
    assert simulate.hierarchy_links(_layout(4, 1, 1, 800.0, 8.0, a)) is None
    assert not any(s.startswith("hierarchical") for s in simulate.layout_candidates(_layout(1, 4, 4, 800.0, 8.0, a)))


def test_auto_leaves_out_the_hierarchical_schemes_where_ranks_have_no_cpu_to_spare():
    # the same 2x2 cluster where hierarchical:allgather is modelled 0.688 x the flat allgather (above)
    # relay forms no sums: the other local rank's 2 pieces of 10^4 pairs and their counts inside the
    # node, a + 160,008 / bn; the rank's 10^4 pairs to the other node on half the NIC, positions
    # compact, a + 60,064 / (bc / 2)
    a, bn, bc = 1e-3, 800e6 / 8 * GOOD, 8e6 / 8 * GOOD
    relay = 2 * a + 160_008 / bn + 60_064 / (bc / 2)
    w = simulate.Workload("toy", 10**6, 0, 10**6, 10**4, 1)
    spare = _layout(2, 2, 1, 800.0, 8.0, a)
    assert relay == pytest.approx(0.130135, rel=1e-5)
    assert simulate.layout_comm_seconds(commcost.RELAY_SCHEME, w, spare) == pytest.approx(relay)
    assert set(simulate.HIER_SCHEMES) <= set(simulate.layout_candidates(spare))
    assert simulate.auto_choice(w, spare) == commcost.RELAY_SCHEME
    for serial in (0.51, 1.0):
        busy = simulate.Layout(2, 2, 1, (800.0, a), (8.0, a), serial_cpu=serial)
        assert simulate.layout_candidates(busy) == (*simulate.FLAT_SCHEMES, commcost.RELAY_SCHEME)
        assert simulate.auto_choice(w, busy) == commcost.RELAY_SCHEME
    at_limit = simulate.Layout(2, 2, 1, (800.0, 1e-3), (8.0, 1e-3), serial_cpu=0.5)
    assert simulate.auto_choice(w, at_limit) == simulate.auto_choice(w, spare)
    # the emulation host: one intra-op thread per rank, 2 cores
    assert simulate.host_serial_cpu(4, 2) == simulate.host_serial_cpu(2, 2) == 1.0
    assert simulate.host_serial_cpu(2, 16) == 0.0


def test_nccl_rings_use_every_nic_of_the_projections_nodes():
    # 2 nodes x 8 ranks, a NIC per rank at 25 Gbit/s, node link 2.4 Tbit/s: NCCL's 8 rings cross on
    # 8 NICs, so a flat ring runs at 200 Gbit/s; one node: the node link
    layout = simulate.paper_layout(16, "25gbit")
    assert (layout.nodes, layout.per_node, layout.nics, layout.rings) == (2, 8, 8, 8)
    assert layout.ring_rate == pytest.approx(200e3)
    assert simulate.paper_layout(8, "25gbit").ring_rate == pytest.approx(simulate.NODE_LINK[0])
    assert simulate.paper_layout(4, "100gbit").nodes == 1
    # the hierarchical cross step: each local rank its own NIC, full rate
    across = simulate.hierarchy_links(layout)[1]
    assert across.allgather.beta == pytest.approx(1 / (25e9 / 8 * GOOD))


@pytest.mark.parametrize("link", sorted(simulate.PAPER_LINKS))
@pytest.mark.parametrize("density", simulate.LAYOUT_DENSITIES)
def test_auto_meets_the_issue_16_target_on_every_projected_layout(link, density):
    sparse = 300_000_000
    w = simulate.Workload("toy", sparse + 300_000, 300_000, sparse, int(density * sparse), 48)
    for world in simulate.WORLDS:
        layout = simulate.paper_layout(world, link)
        auto = simulate.layout_comm_seconds("auto", w, layout)
        fixed = [simulate.layout_comm_seconds(s, w, layout) for s in simulate.layout_candidates(layout)]
        assert auto <= simulate.layout_comm_seconds("ddp", w, layout) * (1 + 1e-9), world
        assert auto <= 1.05 * min(fixed), world


def test_layout_targets_flag_a_slow_auto():
    rows = [{"workload": "m", "density": 0.01, "link": "25gbit", "world": 64, "scheme": s, "comm_ms": t}
            for s, t in (("ddp", 10.0), ("allgather", 4.0), ("hierarchical:sparcml", 2.0), ("auto", 2.2))]
    (target,) = simulate.layout_targets(rows)
    assert target["best_fixed"] == "hierarchical:sparcml" and target["never_slower_than_dense"]
    assert not target["within_5pct_of_best"] and target["auto_vs_best"] == pytest.approx(2.0 / 2.2)


def test_bench_layouts_summary_and_paired_ratios():
    from experiments import bench_layouts

    assert bench_layouts.parse_layout("2x2") == (2, 2)
    assert bench_layouts.variants_for((4, 1), ["ddp", "hier_allgather", "flat"]) == ["ddp", "flat"]
    records = []
    for round_, (hier, flat, ddp) in enumerate(((0.3, 0.4, 1.0), (0.5, 0.45, 1.2))):
        for layout, per_node in (("2x2", 2), ("4x1", 1)):
            for variant, step in (("hier_allgather", hier), ("flat", flat), ("ddp", ddp), ("compute_only", 0.2)):
                if variant.startswith("hier") and per_node == 1:
                    continue
                records.append({
                    "layout": layout, "nodes": 4 // per_node, "per_node": per_node, "ranks_per_node": per_node,
                    "world": 4, "phase": "40mbit", "round": round_, "launch": 0, "order": 0, "workload": "toy",
                    "variant": variant, "scheme": "ssfusion", "steps": 6, "warmup": 2, "params": 10,
                    "step_seconds": [9.0, 9.0] + [step * (1.1 if layout == "4x1" else 1.0)] * 4,
                    "engine": [{"bytes_sent": 100.0, "compress_seconds": 0.01, "exposed_comm_seconds": 0.1}] * 6,
                    "plan_comm": "allgather;hierarchical:allgather",
                })
    runs, steps = bench_layouts.run_rows(records)
    assert len(steps) == 6 * len(records)
    summary = {(r["layout"], r["variant"]): r for r in bench_layouts.summarize(runs)}
    assert summary[("2x2", "hier_allgather")]["step_ms"] == pytest.approx(400.0)  # median of 300 and 500
    assert summary[("2x2", "hier_allgather")]["x_flat_same_layout"] == pytest.approx(425 / 400)
    assert summary[("2x2", "flat")]["plan_comm"] == "allgather:2 hierarchical:allgather:2"
    ratios = bench_layouts.paired_ratios(runs, [(("2x2", "hier_allgather"), ("2x2", "flat")),
                                                (("2x2", "hier_allgather"), ("4x1", "flat"))])
    same, across = ratios
    assert same["rounds"] == 2 and same["faster_in"] == 1
    assert same["min"] == pytest.approx(0.9) and same["max"] == pytest.approx(4 / 3)
    assert across["median"] == pytest.approx(statistics.median([0.44 / 0.3, 0.495 / 0.5]))


def test_layout_check_predicts_2x2_from_the_flat_run_of_the_same_p():
    # measured (s): 4x1 flat step 0.5 = compute 0.2 + exposed 0.2 + 0.1 of compression and overhead;
    # on 2x2 the compute is 0.25 and the model adds the same 0.1 to its own exposed communication
    def row(layout, variant, step, compute, exposed=None):
        nodes, per_node = (int(x) for x in layout.split("x"))
        return {"layout": layout, "nodes": nodes, "per_node": per_node, "rate": "40mbit", "workload": "toy",
                "variant": variant, "step_s": step, "compute_s": compute, "compress_s": 0.01, "exposed_s": exposed}

    rows = [row("4x1", "flat", 0.5, 0.2, 0.2), row("2x2", "flat", 0.6, 0.25, 0.3),
            row("2x2", "hier_allgather", 0.55, 0.25, 0.25), row("4x1", "ddp", 2.0, 0.2), row("2x2", "ddp", 2.1, 0.25),
            row("4x1", "auto", 0.45, 0.2, 0.15), row("2x2", "auto", 0.5, 0.25, 0.2)]
    sparse = simulate.Workload("toy", 10**6, 0, 10**6, 10**4, 4)
    dense = simulate.Workload("toy", 10**6, 10**6, 0, 0, 1)
    plans = {(lay, "toy", v): (dense if v == "ddp" else sparse) for lay in ("4x1", "2x2") for v in ("flat", "hier_allgather", "ddp", "auto")}
    choices = {("2x2", "toy", "auto"): {"allgather": 0.5, "hierarchical:allgather": 0.5}}
    out = {r["variant"]: r for r in simulate.check_layouts(rows, plans, choices, 1e-3, 1000.0, 2.0)}
    assert set(out) == {"flat", "hier_allgather", "ddp", "auto"}  # the 2x2 rows only
    busy = {r["variant"]: r for r in simulate.check_layouts(rows, plans, choices, 1e-3, 1000.0, 2.0, serial_cpu=1.0)}
    # relay is modelled fastest here and stays a candidate on busy ranks, where the striped ones leave
    assert busy["auto"]["model"].startswith(f"auto -> {commcost.RELAY_SCHEME}")
    assert out["auto"]["model"].startswith(f"auto -> {commcost.RELAY_SCHEME}")
    layout = simulate.Layout(2, 2, 1, (500.0, 1e-3), (40.0, 1e-3))
    for variant, model, extra in (("flat", "allgather", 0.1), ("hier_allgather", "hierarchical:allgather", 0.1),
                                  ("ddp", "ddp", 0.0), ("auto", "auto", 0.45 - 0.2 - 0.15)):
        w = plans[("2x2", "toy", variant)]
        comm = simulate.layout_comm_seconds(model, w, layout)
        predicted = 0.25 + extra + simulate.exposed_seconds(comm, 0.25, w.buffers)
        assert out[variant]["predicted_step_ms"] == pytest.approx(predicted * 1e3), variant
    # auto: costed by its modelled choice; the run's per-buffer choices are shown, not costed
    choice = simulate.auto_choice(sparse, layout)
    assert out["auto"]["comm_ms"] == pytest.approx(1e3 * simulate.layout_comm_seconds(choice, sparse, layout))
    assert out["auto"]["model"] == f"auto -> {choice} (run: allgather:0.50 hierarchical:allgather:0.50)"
    # the run's choices cost like this when given (a share of the plan's equal buffers each)
    half = [simulate.layout_comm_seconds(s, sparse, layout) for s in ("allgather", "hierarchical:allgather")]
    assert simulate.layout_comm_seconds("auto", sparse, layout, choices[("2x2", "toy", "auto")]) == pytest.approx(sum(half) / 2)


# --------------------------------------------------------------------------- timeline_spread.py
def test_timeline_spread_measures_the_ranks_drift_from_their_events():
    from experiments import timeline_spread

    def rank(steps):  # (backward begin, backward end, last collective end) in ms, per step
        events = []
        for step, (begin, end, comm) in enumerate(steps):
            ms = lambda t: int(t * 1e6)  # noqa: E731
            events += [
                {"name": "backward.begin", "step": step, "start_ns": ms(begin), "end_ns": ms(begin)},
                {"name": "backward.end", "step": step, "start_ns": ms(end), "end_ns": ms(end)},
                {"name": "comm", "step": step, "start_ns": ms(end - 5), "end_ns": ms(comm)},
            ]
        return {"plan_buffers": 4, "events": events}

    # step 0 is skipped; steps 1-3: rank 1 ends 10, 20 and 30 ms after rank 0
    first = rank([(0, 999, 999), (100, 200, 203), (300, 400, 401), (500, 600, 602)])
    second = rank([(0, 1, 1), (100, 210, 212), (300, 420, 421), (500, 630, 640)])
    row = timeline_spread.summarise([first, second], skip=1)
    assert row["buffers"] == 4 and row["steps"] == 3
    assert row["backward_ms"] == [100.0, 120.0]
    assert row["end_gap_ms"] == [20.0, 30.0]  # 10, 20 and 30 ms: median 20, 75th percentile 30
    # a rank's last collective after its own backward end, the larger rank's a step: 3, 1 and 10 ms
    assert row["tail_ms"] == [3.0, 10.0]


def test_rank_cpu_shares_py_spy_samples_by_the_engines_functions():
    from experiments.rank_cpu import shares_by_function

    engine = "/x/ssfusion_lightning/engine/engine.py"
    raw = "\n".join([
        f"main (run.py:1);_engine_run_backward (/t/torch/autograd/graph.py:9);FusionEngine._mark_ready ({engine}:5);"
        f"FusionEngine._mark_ready ({engine}:5) 3",
        "main (run.py:1);SGD.step (/t/torch/optim/sgd.py:1);_use_grad (/t/torch/optim/optimizer.py:2);"
        "_single_tensor_sgd (/t/torch/optim/sgd.py:3) 1",
    ])
    shares = shares_by_function(raw)
    assert shares == {"_engine_run_backward": 0.75, "FusionEngine._mark_ready": 0.75, "_single_tensor_sgd": 0.25}
    assert shares_by_function("") is None


@pytest.mark.parametrize("memory", ["residual", "dgc", "adam"])
def test_engine_floor_round_sends_exactly_k_and_writes_every_ranks_values(memory):
    import torch

    from experiments.engine_floor import DENSITY, WORLD, FlatRound

    flat = FlatRound(10_000, memory, contract=True, clips=memory == "adam")
    for _ in range(3):  # the state moves on: each round's threshold is its own k-th magnitude
        times = flat.round()
        positions, values = flat.sent
        assert positions.numel() == math.ceil(DENSITY * 10_000)
        assert torch.equal(flat.averaged[positions], values * WORLD)
        assert int(torch.count_nonzero(flat.averaged)) == positions.numel()
    assert set(times) == {"clip", "compensate", "check", "select", "commit", "write"}


def test_engine_floor_budgets_come_from_the_side_by_side_rows():
    from experiments.engine_floor import budgets

    def scheme(wall, proc, **extra):
        return {"wall_ms": wall, "proc_ms": proc, **extra}

    side = {"results": {"40mbit gpt2": {
        "compute_only": scheme(90.0, 80.0), "compute_sync": scheme(95.0, 82.0),
        "ddp_powersgd": scheme(120.0, 100.0), "ssfusion": scheme(130.0, 110.0, compress_ms=20.0),
    }, "40mbit resnet18": {}}}
    assert budgets(side, "gpt2") == {"40mbit": {"step": 5.0, "powersgd": 25.0, "cpu": 10.0, "compress": 20.0, "engine_cpu": 28.0}}


def test_rank_cpu_reads_each_threads_cpu_and_names_its_kind():
    """The /proc reading rank_cpu sums per thread kind: a busy main thread's CPU time grows while an
    idle helper thread's does not, and gloo's thread names are told apart from the engine's."""
    import threading
    import time

    from experiments.rank_cpu import thread_cpu, thread_kind

    pid, stop = os.getpid(), threading.Event()
    idle = threading.Thread(target=stop.wait, daemon=True)
    idle.start()
    before = thread_cpu([pid])
    started = time.thread_time()
    while time.thread_time() - started < 0.3:
        pass
    after = thread_cpu([pid])
    stop.set()
    grown = {key: after[key][1] - before[key][1] for key in before if key in after}
    assert grown[(pid, pid)] >= 0.2  # the busy loop, in clock ticks
    assert grown[(pid, idle.native_id)] <= 0.05
    assert thread_kind(pid, pid, "python") == "main thread"
    assert thread_kind(pid, pid + 1, "gloo_tcp_loop") == "gloo threads"
    assert thread_kind(pid, pid + 1, "python") == "other threads (engine workers)"


def test_flat_states_bench_times_both_forms_and_checks_they_agree(tmp_path):
    """bench_flat_states times DGC's flat states against its foreach forms on the digits CNN's slots
    (it refuses to run if the forms compared are not those, or end in different states) and tables
    each step."""
    from experiments import bench_flat_states

    rows = bench_flat_states.measure(dense=43, rounds=3)
    assert [step for step, _, _ in rows] == list(bench_flat_states.STEPS)
    assert all(a > 0 and b > 0 for _, a, b in rows)
    assert bench_flat_states.main(["--rounds", "2", "--out", str(tmp_path)]) == 0
    assert "| sparse slots: commit |" in (tmp_path / "flat_states.md").read_text()


# --------------------------------------------------------------------------- trial_replay.py
def test_trial_replay_keeps_dense_exactly_where_every_window_says_it_is_faster():
    from experiments import trial_replay

    def run(cell, label, seconds, dense):
        workload, world, link = cell
        return {"workload": workload, "world": world, "phase": link, "label": label, "step_seconds": [seconds] * 300,
                "engine": [{"sparse_tensors": 0 if dense else 5}] * 300}

    runs = []
    for cell, ((sparse_label, _), (dense_label, _)) in trial_replay.CELLS.items():
        runs += [run(cell, sparse_label, 0.10, dense=False), run(cell, dense_label, 0.05, dense=True)]
    rows = trial_replay.replay(runs, steps=8, draws=50, seed=0)
    assert len(rows) == 2 * len(trial_replay.CELLS)
    for row in rows:
        swapped = row["cell"].endswith("(roles swapped)")
        assert row["dense ms"] == (100.0 if swapped else 50.0)
        assert row["one window"] == row["confirm"] == (0.0 if swapped else 1.0)


def test_trial_replay_on_every_ranks_steps_takes_each_agreement():
    """Rank 1's dense steps are slow, the others' fast: the max over ranks finds dense slower, the
    mean (0.05 on three ranks, 0.11 on one: 0.065) finds it faster than sparse's 0.07."""
    from experiments import trial_replay

    def run(seed, scheme, per_rank):
        return {"seed": seed, "scheme": scheme, "rank_step_seconds": [[seconds] * 300 for seconds in per_rank]}

    runs = [run(0, "ssfusion", [0.07] * 4), run(0, "ddp", [0.05, 0.11, 0.05, 0.05])]
    rows = trial_replay.replay_ranks(runs, steps=(8, 16), draws=20, seed=0)
    assert [(r["agreement"], r["steps"]) for r in rows] == [("max", 8), ("mean", 8), ("max", 16), ("mean", 16)]
    for row in rows:
        kept = row["agreement"] == "mean"
        assert row["dense slower"] == (1.0 if kept else 0.0)
        assert row["dense faster"] == (0.0 if kept else 1.0)
        assert row["sparse ms"] == pytest.approx(70.0) and row["dense ms"] == pytest.approx(50.0)


# --------------------------------------------------------------------------- trial_outcomes.py
def test_trial_outcomes_names_the_kept_plan_and_compares_each_seed_with_its_own_ddp(tmp_path):
    from experiments import trial_outcomes

    def run(seed, scheme, seconds, dense=False, trial=None):
        return {"launch": "a", "world": 4, "phase": "300mbit", "workload": "digits", "seed": seed, "scheme": scheme,
                "label": scheme, "step_seconds": [seconds] * 100, "dense_trial": trial,
                "engine": [{"sparse_tensors": 0 if dense else 5}] * 100}

    trial = {"phase": "done", "sparse_seconds": 0.08, "dense_seconds": 0.09}
    runs = [
        run(0, "ddp", 0.09), run(0, "ssfusion", 0.08, trial=trial),
        run(1, "ddp", 0.07),
        run(1, "ssfusion", 0.095, dense=True, trial=dict(trial, confirmed_seconds=0.1, discarded=[0.06, 0.11])),
        run(1, "ssfusion_notrial", 0.05),
    ]
    rows = trial_outcomes.outcomes(runs, first=60)
    assert [(r["seed"], r["kept"], r["ddp step"]) for r in rows] == [(0, "sparse", 0.09), (1, "dense", 0.07)]
    assert rows[1]["confirmed"] == 0.1 and rows[0]["confirmed"] is None
    total = trial_outcomes.summary(rows)
    assert (total["seeds"], total["kept dense"], total["slower than DDP"]) == (2, 1, 1)
    assert (total["sparse step"], total["dense step"]) == (0.08, 0.095)
    raw = tmp_path / "a_raw.jsonl"
    raw.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "launch"}) + "\n" for r in runs))
    assert trial_outcomes.main(["a", "--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "trial_outcomes.md").read_text()
    assert "2 seeds: dense kept in 1, a step slower than DDP's in 1" in text
    assert "| a | ssfusion | 1 | 80.0 | - | - | 60.0, 110.0 | 90.0 | 100.0 | dense |" in text  # the drifted first comparison


# --------------------------------------------------------------------------- ef_optimizers.py
def test_sparse_adamw_update_steps_dense_like_torch_adamw():
    import torch

    from experiments.ef_optimizers import SparseAdamWUpdate

    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(5, 4))
    theirs.data.copy_(ours.data)
    sparse, reference = SparseAdamWUpdate([ours], lr=0.01, density=0.1), torch.optim.AdamW([theirs], lr=0.01, weight_decay=0.01)
    for _ in range(3):
        grad = torch.randn(5, 4)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        sparse.step(dense=True)
        reference.step()
        torch.testing.assert_close(ours.data, theirs.data)


def test_sparse_adamw_update_applies_the_top_of_update_plus_residual_and_keeps_the_rest():
    import torch

    from experiments.ef_optimizers import SparseAdamWUpdate

    param = torch.nn.Parameter(torch.zeros(8))
    opt = SparseAdamWUpdate([param], lr=0.1, density=0.25, weight_decay=0.0)
    param.grad = torch.tensor([1.0, -4.0, 2.0, 0.5, -3.0, 0.1, 0.2, 0.3])
    opt.step()
    # the first bias-corrected AdamW update is lr * sign(grad), to eps: every coordinate ties, so
    # what moved plus what is kept is the whole update, and exactly 2 of 8 coordinates moved
    moved = -param.detach()
    assert int((moved != 0).sum()) == 2
    torch.testing.assert_close(moved + opt.residuals[0], 0.1 * param.grad.sign(), rtol=0, atol=1e-6)
    before = param.detach().clone()
    param.grad = torch.zeros(8)
    opt.step()  # a zero gradient still moves the residual's largest coordinates: nothing is lost
    assert int((param.detach() != before).sum()) == 2


def test_side_by_side_times_schemes_in_the_same_ranks_and_checks_the_dense_path(tmp_path):
    """Two ranks, each with a copy of a small workload per scheme: the engine's dense path writes DDP's
    gradients to the bit (the harness checks it after the timed blocks), and every scheme gets its row."""
    from experiments import side_by_side

    schemes = ["ddp", "ssfusion_dense", "compute_only", "ssfusion"]
    assert side_by_side.main(["--quick", "--schemes", *schemes, "--workloads", "resnet18", "gpt2", "--warmup", "3",
                              "--steps", "2", "--blocks", "2", "--name", "side", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "side.json").read_text())
    assert saved["equal"] == {"none resnet18": True, "none gpt2": True}
    for cell, rows in saved["results"].items():
        assert list(rows) == schemes, cell
        for scheme, row in rows.items():
            assert row["wall_ms"] > 0 and row["proc_ms"] > 0 and row["wall_x_ddp"] > 0, (cell, scheme)
        # ssfusion_dense keeps its own rounds; ssfusion may hand its steps to DDP's reducer on loopback
        assert rows["ssfusion_dense"]["buffers"] >= 1 and rows["ssfusion"]["compress_ms"] >= 0
    # the preset's memory="auto" picks by optimizer, as in Lightning: resnet18 trains with SGD + momentum, gpt2 AdamW
    memories = {cell: rows["ssfusion"]["memory"] for cell, rows in saved["results"].items()}
    assert memories == {"none resnet18": "dgc", "none gpt2": "adam"}
    assert saved["results"]["none gpt2"]["ssfusion_dense"]["memory"] == "residual"
    assert "| none | gpt2 | ssfusion |" in (tmp_path / "side.md").read_text()
    from experiments import glance

    assert glance.main(["side", "--out", str(tmp_path), "--no-report"]) == 0
    table = (tmp_path / "glance.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| 2 | unshaped | gpt2 |"))
    assert row.count("/2)") == 2 and row.endswith("| side |")  # x DDP and x compute-only, two block pairs each
    assert (tmp_path / "glance.png").stat().st_size > 0


def test_side_by_side_stops_when_a_rank_fails(tmp_path):
    """A rank that raises (density 0 is refused when the engine is built) stops the launch with the ranks'
    exit codes, where the harness used to wait for results that never came."""
    from experiments import side_by_side

    with pytest.raises(RuntimeError, match=r"the ranks failed \(exit codes \{0: 1, 1: 1\}\)"):
        side_by_side.main(["--quick", "--schemes", "ddp", "ssfusion", "--workloads", "resnet18", "--density", "0",
                           "--timeout", "120", "--out", str(tmp_path)])


def test_glance_pairs_each_block_with_its_partner_and_counts_the_faster_pairs():
    """Two ranks, three block pairs: per pair the median over ranks of the baseline's block median over
    ssfusion's; the cell is their median, with the pairs ssfusion won."""
    from experiments import glance

    def blocks(*walls):
        return [[{"wall": w}, {"wall": w}, {"wall": 9.0 * w}] for w in walls]  # a block's median ignores the outlier

    by_rank = {
        "0": {"gpt2": {"samples": {"ssfusion": blocks(1.0, 1.0, 2.0), "ddp": blocks(2.0, 0.5, 3.0)}}},
        "1": {"gpt2": {"samples": {"ssfusion": blocks(1.0, 1.0, 2.0), "ddp": blocks(4.0, 0.5, 3.0)}}},
    }
    assert glance.pair_speeds(by_rank, "gpt2", "ddp") == [3.0, 0.5, 1.5]
    row = {"world": 2, "link": "40mbit", "workload": "gpt2", "memory": "adam", "launch": "x", "speed": {"ddp": (1.5, 2, 3)}}
    assert "| 2 | 40mbit | gpt2 | adam | 1.50 (2/3) | - | - | - | x |" in glance.markdown([row])


@pytest.mark.skipif(common.report_section("glance") is None, reason="no glance block in REPORT.md")
def test_report_glance_block_comes_from_the_committed_launches():
    from experiments import glance

    command = common.report_section("glance").split("`")[1]
    names = command.split("python -m experiments.glance ")[1].split()
    assert common.report_section("glance") == glance.block(names, glance.cells(names)).strip()


def test_side_by_side_overlap_targets_mark_what_is_met_and_skip_cells_without_the_baselines():
    from experiments.side_by_side import overlap_targets

    mine = {"wall_x_compute_only": 1.05, "wall_x_powersgd": 0.98, "exposed_share": 0.08, "proc_x_compute_only": 1.2}
    rows = overlap_targets({
        ("40mbit", "gpt2"): {"compute_only": {}, "ddp_powersgd": {}, "ssfusion": mine},
        ("40mbit", "resnet18"): {"compute_only": {}, "ssfusion": mine},  # no PowerSGD: no row
    })
    assert rows[2:] == ["| 40mbit | gpt2 | **0.95** | 0.98 | **0.08** | 1.20 |"]
    assert overlap_targets({("40mbit", "gpt2"): {"compute_only": {}, "ssfusion": mine}}) == []


def test_side_by_side_names_each_engines_plan_trial_and_the_plan_it_kept():
    from experiments.side_by_side import trial_lines

    kept_one = {"phase": "done", "sparse_seconds": 0.291, "fused_seconds": 0.28, "recut_seconds": 0.30,
                "dense_seconds": None, "confirmed_seconds": None, "discarded": None}
    kept_cut = dict(kept_one, fused_seconds=0.329, recut_seconds=None)
    rows = trial_lines({
        ("150mbit", "gpt2_10m"): {"compute_only": {}, "ssfusion": {"trial": kept_one, "buffers": 1.0}},
        ("40mbit", "gpt2_10m"): {"ssfusion": {"trial": kept_cut, "buffers": 3.0}, "ddp_powersgd": {}},
        ("40mbit", "gpt2"): {"ssfusion": {"trial": None, "buffers": 1.0}},  # no trial ran: no row
    })
    assert rows[4:-1] == [
        "| 150mbit | gpt2_10m | ssfusion | sparse 291 ms, one buffer 280 ms, sparse after one buffer 300 ms a step -> one buffer | 1 |",
        "| 40mbit | gpt2_10m | ssfusion | sparse 291 ms, one buffer 329 ms a step -> sparse | 3 |",
    ]
    assert trial_lines({("40mbit", "gpt2"): {"compute_only": {}}}) == []


def test_averaged_update_times_the_replacement_beside_sgd_and_adamw(tmp_path):
    from experiments import bench_averaged_update

    rows = bench_averaged_update.measure("gpt2", steps=2)
    assert [r["step"].split(" ")[0] for r in rows] == ["AveragedUpdate.step", "torch", "AdamW", "AdamW"]
    assert all(r["tensors"] > 0 and r["elements"] > 0 and r["ms"] > 0 for r in rows)
    assert bench_averaged_update.main(["--workload", "gpt2", "--steps", "2", "--name", "step", "--out", str(tmp_path)]) == 0
    assert "| AveragedUpdate.step (fused SGD kernel) |" in (tmp_path / "step.md").read_text()


def test_feedback_round_times_each_memory_on_the_workloads_large_tensors(tmp_path):
    from experiments import bench_feedback_round

    rows = bench_feedback_round.measure("gpt2", ["residual", "adam"], rounds=2)
    assert [r["memory"] for r in rows] == ["residual", "adam"]
    assert all(r["tensors"] > 0 and r["elements"] >= 4096 * r["tensors"] and r["compensate_ms"] > 0 for r in rows)
    assert bench_feedback_round.main(["--workload", "gpt2", "--rounds", "2", "--name", "round", "--out", str(tmp_path)]) == 0
    assert "| adam |" in (tmp_path / "round.md").read_text()
    dense = bench_feedback_round.measure("gpt2", ["adam"], rounds=2, slots="dense")
    assert dense[0]["tensors"] > 0 and dense[0]["elements"] < 4096 * dense[0]["tensors"]


def test_op_sites_files_the_engines_ops_under_their_call_sites(tmp_path):
    from experiments import op_sites

    assert op_sites.main(["--workload", "gpt2", "--quick", "--start", "3", "--stop", "5", "--top", "500", "--out", str(tmp_path), "--name", "ops"]) == 0
    rows = [line.split(" | ") for line in (tmp_path / "ops.md").read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    sites = [row[3] for row in rows]
    assert any("engine.py" in site for site in sites), sites  # the engine's own ops, under its functions
    assert any("memory.py" in site for site in sites), sites  # the memory's round ran on rank 1
    assert not any("op_sites.py" in site for site in sites)  # the counter's own frames name no site
    assert all(float(row[1]) > 0 for row in rows)

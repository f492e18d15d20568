"""Fast smoke tests of the benchmark harnesses (experiments/bench_e2e.py, e2e_worker.py,
simulate.py, gpu/bench_gpu.py) and of REPORT.md's generated numbers against the committed CSVs."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from experiments import common, e2e_analyze, e2e_report, simulate

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
            compute = 0.1 * world / 2
            for scheme, sent, compress in (("compute_only", 0, None), ("ddp", dense, None),
                                           ("ddp_powersgd", 2 * (world - 1) / world * 40_000, None),
                                           ("ssfusion", (world - 1) * 10_000 * 8, 0.01), ("zen", 150_000, 0.01),
                                           ("oktopk", 200_000, 0.01), ("safusion", (world - 1) * 10_000 * 8, 0.01)):
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


def test_byte_formulas_follow_algorithms_section_7():
    n, k = 1_000_000, 10_000
    w = simulate.Workload("toy", n, 0, n, k, 1)
    for world in (2, 4, 16, 1024):
        assert simulate.scheme_bytes("ddp", w, world) == pytest.approx(2 * (world - 1) / world * n * 4)
        assert simulate.scheme_bytes("safusion", w, world) == pytest.approx((world - 1) * k * 8)
        union = n * (1 - (1 - k / n) ** world)
        # the pull as a bitmap or as COO, whichever is smaller (ZEN sends the smaller)
        pull = min(n / 8 + union * 4, union * 8)
        assert simulate.scheme_bytes("zen", w, world) == pytest.approx((world - 1) / world * (k * 8 + pull))
        # 3(P-1)/P k(v+x) (int32 positions), the counts and the threshold grid's 24 counts per rank, and every 32
        # rounds the exact threshold's gather of each owner's top magnitudes (K/P of them, 4 B each)
        okt = 3 * (world - 1) / world * k * 8 + (world - 1) * (1 + 24) * 8 + (world - 1) * min(k, union / world) * 4 / 32
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
    assert 0 < ssf["engine"][-1]["bytes_sent"] < ssf["engine"][-1]["dense_equivalent_bytes"]
    assert ssf["plan_sparse_k"] > 0 and ssf["plan_buffers"] >= 1
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


@pytest.mark.parametrize("stem", ["ab_first_buffer", "ab_process_groups", "ab_vote_in_dense"])
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


# --------------------------------------------------------------------------- bench_memory.py
def test_bench_memory_summary_and_targets_from_rows():
    from experiments import bench_memory

    grad = 10 * bench_memory.MiB

    def row(scheme, rank, peak_mb, state=0, rep=0):
        return {"workload": "mlp12m", "scheme": scheme, "rep": str(rep), "rank": str(rank), "device": "cpu",
                "steps": "20", "params": str(grad // 4), "grad_bytes": str(grad), "state_bytes": str(state),
                "peak_rss_bytes": str(int(peak_mb * bench_memory.MiB)), "baseline_rss_bytes": str(400 * bench_memory.MiB),
                "train_start_rss_bytes": str(410 * bench_memory.MiB), "end_rss_bytes": str(450 * bench_memory.MiB),
                "cuda_max_allocated_bytes": "", "error": ""}

    runs = [row("ddp", 0, 500), row("ddp", 1, 900), row("ddp", 0, 510, rep=1), row("ddp", 1, 510, rep=1),
            row("ssfusion_dense", 0, 520), row("ssfusion", 0, 520, grad), row("ssfusion", 0, 530, grad, rep=1),
            row("ssfusion_dgc", 0, 530, 2 * grad), {**row("zen", 0, 1), "error": "boom"}]
    summary = {r["scheme"]: r for r in bench_memory.summarize(runs)}
    assert list(summary) == ["ddp", "ssfusion_dense", "ssfusion", "ssfusion_dgc"]  # the failed run is left out
    assert summary["ddp"]["peak"] == pytest.approx(505 * bench_memory.MiB)  # rank 0's median over the repeats
    assert summary["ddp"]["peak_max_rank"] == pytest.approx(705 * bench_memory.MiB)
    assert summary["ssfusion"]["extra_x_grad"] == pytest.approx(2.0) and not summary["ssfusion"]["met"]
    assert summary["ssfusion"]["state_x_grad"] == pytest.approx(1.0)
    assert summary["ssfusion_dgc"]["extra_x_grad"] == pytest.approx(2.5) and not summary["ssfusion_dgc"]["met"]
    assert summary["ssfusion_dgc"]["target"] == "extra <= 2.3 x grad"
    assert summary["ssfusion_dense"]["target_value"] == pytest.approx(520 / 505) and summary["ssfusion_dense"]["met"]
    assert summary["ddp"]["met"] is None
    table = bench_memory.markdown(list(summary.values()), runs)
    assert "| mlp12m | ssfusion | 525.0 | +20.0 | +2.00 | +0.00 | 1.00 | extra <= 1.15 x grad | **no** |" in table
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

"""experiments/bench_tta.py's analysis on hand-made runs: time to DDP's final value over a longer
budget, the equal-steps comparison at DDP's steps, and the medians over seeds."""

from __future__ import annotations

import argparse

import pytest

from experiments import bench_tta


def run(label: str, seed: int, accuracies: list[float], step_seconds: float, every: int = 10) -> dict:
    """One finished run with an evaluation every ``every`` steps and constant step times."""
    steps = every * len(accuracies)
    return {
        "world": 4, "phase": "40mbit", "workload": "digits", "seed": seed, "label": label, "scheme": label.split("@")[0],
        "density": 0.01 if "@" in label else None, "steps": steps, "equal_steps": 30,
        "step_seconds": [step_seconds] * steps,
        "eval_curve": [{"step": every * (i + 1), "val_loss": 1 - a, "val_acc": a} for i, a in enumerate(accuracies)],
    }


def analyse(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    table = bench_tta.time_to_accuracy(bench_tta.curve_rows(runs), runs)
    return table, bench_tta.across_seeds(table)


def test_a_scheme_with_faster_steps_may_reach_the_target_after_ddps_steps():
    # DDP: 30 steps of 1 s, final 0.9 (the target). ssfusion: 0.25 s steps, 0.9 first at step 50:
    # 12.5 s against DDP's 30 s. At DDP's 30 steps it had 0.8: the equal-steps columns say so.
    runs = [run("ddp", 0, [0.5, 0.8, 0.9], 1.0), run("ssfusion@1%", 0, [0.4, 0.7, 0.8, 0.85, 0.9, 0.95], 0.25)]
    floor = {**run(bench_tta.FLOOR, 0, [], 0.2), "steps": 30, "step_seconds": [0.2] * 30}
    table, _ = analyse([floor, *runs])
    assert {r["label"] for r in table} == {"ddp", "ssfusion@1%"}  # the floor only times steps
    ssfusion = next(r for r in table if r["label"] == "ssfusion@1%")
    assert (ssfusion["steps_to_target"], ssfusion["seconds_to_target"]) == (50, 12.5)
    assert ssfusion["x_ddp"] == pytest.approx(30 / 12.5)
    assert ssfusion["final_acc"] == 0.8
    assert ssfusion["acc_minus_ddp"] == pytest.approx(-10.0)
    # gaps from a quarter of DDP's 30 steps on, at DDP's evaluation points only: -10, -10 and -10
    assert ssfusion["worst_gap_from_quarter"] == pytest.approx(-10.0)
    assert ssfusion["steps_run"] == 60
    assert ssfusion["of_floor"] == pytest.approx(0.25 / 0.2)


def test_medians_over_seeds_count_a_seed_that_missed_the_target_as_no_speed_up():
    runs = [run("ddp", seed, [0.5, 0.8, 0.9], 1.0) for seed in (0, 1, 2)]
    runs += [
        run("ssfusion@1%", 0, [0.6, 0.9, 0.9], 0.5),  # 20 steps, 10 s: 3x
        run("ssfusion@1%", 1, [0.6, 0.7, 0.8], 0.5),  # never: 0
        run("ssfusion@1%", 2, [0.9, 0.9, 0.9], 0.5),  # 10 steps, 5 s: 6x
    ]
    _, summary = analyse(runs)
    ssfusion = next(r for r in summary if r["label"] == "ssfusion@1%")
    assert (ssfusion["seeds"], ssfusion["reached"]) == (3, 2)
    assert ssfusion["x_ddp_per_seed"] == [pytest.approx(3.0), 0.0, pytest.approx(6.0)]
    assert ssfusion["x_ddp"] == pytest.approx(3.0)
    assert ssfusion["steps_to_target"] == 15
    checks = {c["check"]: c for c in bench_tta.targets(summary)}
    assert checks["time to DDP's accuracy: x_ddp >= 3.0"]["met"]
    # a majority of misses leaves no median speed-up
    runs[3] = run("ssfusion@1%", 0, [0.6, 0.7, 0.8], 0.5)
    _, summary = analyse(runs)
    assert next(r for r in summary if r["label"] == "ssfusion@1%")["x_ddp"] is None


def test_every_scheme_but_ddp_gets_the_longer_budget_and_an_evaluation_at_ddps_steps():
    args = argparse.Namespace(
        seeds=[0, 3], workloads=["digits"], steps={"digits": 25}, budget_factor=2.0, eval_every=10, floor=True,
        baselines=["ddp", "ddp_powersgd4"], presets=["ssfusion"], densities=[0.01], warmup_epochs=0.0,
        variants={"ends": {"dense_params": ["*stem.*"]}},
    )
    runs = bench_tta.build_runs(args)
    assert [(r["seed"], r["label"], r["steps"]) for r in runs] == [
        (seed, label, steps) for seed in (0, 3) for label, steps in
        (("compute_sync", 25), ("ddp", 25), ("ddp_powersgd4", 50), ("ssfusion@1%", 50), ("ssfusion+ends@1%", 50))
    ]
    assert (runs[0]["eval"], runs[0]["eval_at"]) == (False, [])
    assert runs[1]["eval_at"] == [10, 20, 25]
    assert runs[2]["eval_at"] == [10, 20, 25, 30, 40, 50]
    assert all(r["equal_steps"] == 25 for r in runs)


def test_pooled_gaps_compare_each_run_with_its_own_launchs_ddp(tmp_path):
    # two launches: the same scheme ends 2 points under DDP in one and 1 point over in the other;
    # the averaged gap spans DDP's last three evaluations, and a run that stopped early is left out
    from experiments import tta_pool

    fields = "world,rate,workload,seed,label,scheme,density,step,seconds,val_loss,val_acc"
    launches = {
        "a_curve.csv": {("0", "ddp"): [0.90, 0.92, 0.94], ("0", "zen@0.1%"): [0.80, 0.90, 0.92]},
        "b_curve.csv": {("0", "ddp"): [0.90, 0.90, 0.90], ("0", "zen@0.1%"): [0.93, 0.91, 0.91],
                        ("1", "ddp"): [0.5, 0.6, 0.7], ("1", "zen@0.1%"): [0.5, 0.6]},
    }
    paths = []
    for name, curves in launches.items():
        lines = [fields] + [
            f"4,40mbit,digits,{seed},{label},{label},,{10 * (i + 1)},{i},0,{acc}"
            for (seed, label), accs in curves.items() for i, acc in enumerate(accs)
        ]
        paths.append(tmp_path / name)
        paths[-1].write_text("\n".join(lines) + "\n")
    gaps = [gap for path in paths for gap in tta_pool.run_gaps(path)]
    assert [(g["launch"], round(g["final"], 6), round(g["averaged"], 6)) for g in gaps] == [
        ("a", -2.0, round(100 * (2.62 - 2.76) / 3, 6)),  # (80 + 90 + 92 - 90 - 92 - 94) / 3
        ("b", 1.0, round(100 * (2.75 - 2.70) / 3, 6)),
    ]
    assert "| zen@0.1% | 2 | 2 | -0.50 (-0.50) |" in tta_pool.table(gaps, band=1.0)
    assert tta_pool.main([*map(str, paths), "--out", str(tmp_path), "--name", "pool"]) == 0
    assert (tmp_path / "pool.md").exists() and (tmp_path / "pool.png").exists()


def test_the_target_may_be_the_mean_of_ddps_last_evaluations():
    # DDP ends on a lucky 0.9 after 0.8 and 0.8: its final sets 0.9, the mean of its last 3 0.833.
    runs = [run("ddp", 0, [0.5, 0.8, 0.8, 0.9], 1.0), run("ssfusion@1%", 0, [0.6, 0.85, 0.85, 0.85, 0.9], 0.5)]
    final = {r["label"]: r for r in analyse(runs)[0]}
    assert final["ssfusion@1%"]["steps_to_target"] == 50
    table = bench_tta.time_to_accuracy(bench_tta.curve_rows(runs), runs, target_last=3)
    by_label = {r["label"]: r for r in table}
    assert by_label["ddp"]["target"] == pytest.approx((0.8 + 0.8 + 0.9) / 3)
    assert (by_label["ddp"]["steps_to_target"], by_label["ssfusion@1%"]["steps_to_target"]) == (40, 20)
    # the comparison at DDP's steps stays against DDP's final evaluation
    assert by_label["ssfusion@1%"]["final_minus_ddp"] == pytest.approx(0.85 - 0.9)


def test_an_end_still_inside_the_density_warm_up_does_not_pass_the_01_percent_check():
    def sparse(seed: int, reached_at: int | None) -> dict:
        r = {**run("ssfusion@0.1%", seed, [0.85, 0.9, 0.9], 0.5), "density": 0.001}
        steps = len(r["step_seconds"])
        r["engine"] = [{"requested_density": 0.001 if reached_at is not None and s >= reached_at else 0.004}
                       for s in range(steps)]
        return r

    def check(*runs) -> dict:
        _, summary = analyse([run("ddp", seed, [0.5, 0.8, 0.9], 1.0) for seed in (0, 1)] + list(runs))
        return next(c for c in bench_tta.targets(summary) if c["check"].startswith("within 1 point"))

    table, _ = analyse([run("ddp", 0, [0.5, 0.8, 0.9], 1.0), sparse(0, 12)])
    assert next(r for r in table if r["label"] == "ssfusion@0.1%")["at_density_from"] == 12
    assert check(sparse(0, 12), sparse(1, 20))["met"]  # DDP ran 30 steps: both seeds were at 0.1% before its end
    late = check(sparse(0, 12), sparse(1, 30))
    assert not late["met"] and "only from step 30, past DDP's 30 steps" in late["value"]
    never = check(sparse(0, 12), sparse(1, None))
    assert not never["met"] and "from step 30" in never["value"]  # never got there in its 30 steps

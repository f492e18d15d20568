"""experiments/gap_curves.py: each run against its own launch's DDP at the same seed and step."""

from __future__ import annotations

import pytest

from experiments import gap_curves


def point(label: str, seed: int, step: int, acc: float, world: int = 4) -> dict[str, str]:
    return {"world": str(world), "rate": "40mbit", "workload": "digits", "seed": str(seed), "label": label,
            "step": str(step), "val_acc": str(acc)}


def test_gaps_pair_each_seed_and_step_with_ddps_and_summarise_over_seeds():
    curve = [
        point("ddp", 0, 10, 0.50), point("ddp", 0, 20, 0.90), point("ddp", 1, 10, 0.40), point("ddp", 1, 20, 0.80),
        point("ddp", 2, 10, 0.60),
        point("fp16", 0, 10, 0.45), point("fp16", 0, 20, 0.95), point("fp16", 1, 10, 0.46), point("fp16", 1, 20, 0.70),
        point("fp16", 2, 10, 0.61),
        point("fp16", 0, 30, 0.99),  # no DDP evaluation at step 30: left out
        point("ddp", 0, 10, 0.10, world=2),  # another world: not this run's reference
    ]
    gaps = gap_curves.gaps_to_ddp(curve, "fp16")
    assert sorted(gaps) == [10, 20]
    assert sorted(gaps[10].values()) == pytest.approx([-5.0, 1.0, 6.0])
    rows = gap_curves.summary(gaps)
    assert rows[0] == pytest.approx((10, 1.0, -5.0, 6.0, 3))
    # two seeds: the median is their mean
    assert rows[1] == pytest.approx((20, (5.0 - 10.0) / 2, -10.0, 5.0, 2))


def test_an_unknown_label_names_the_runs_labels():
    with pytest.raises(SystemExit, match="'fp32'.*ddp, fp16"):
        gap_curves.gaps_to_ddp([point("ddp", 0, 10, 0.5), point("fp16", 0, 10, 0.5)], "fp32")


def test_the_table_takes_the_worst_median_from_the_quarter_on(tmp_path):
    gaps = {10: {"a": -20.0}, 40: {"a": -1.0, "b": -3.0}, 50: {"a": 0.5}}
    text = gap_curves.markdown({"run: x": gaps}, quarter_from=37)
    assert text.splitlines()[-1].endswith("| -2.0 |")  # step 40's median; step 10 is before the quarter

"""The sweep summary: one table (CSV and Markdown) of every job's results.json in a sweep directory.

``SweepSummary`` is a Hydra callback (configured under ``hydra.callbacks`` in conf/train.yaml): it
rewrites the table after each job of a multirun, so a sweep that stops early still has one, and
once more when the multirun ends.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig

from ssfusion_lightning.app import RESULTS_FILE

log = logging.getLogger(__name__)

SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
_FIXED = (
    "job",
    "overrides",
    "status",
    "strategy",
    "sparsifier",
    "fusion",
    "comm",
    "density",
    "world_size",
    "global_step",
    "samples_per_sec",
    "bytes_sent_per_step",
    "dense_equivalent_bytes_per_step",
    "compression_ratio",
)


def _job_sort_key(path: Path) -> tuple[int, Any]:
    name = path.parent.name
    return (0, int(name)) if name.isdigit() else (1, str(path))


def _row(path: Path, sweep_dir: Path, results: dict[str, Any]) -> dict[str, Any]:
    config = results.get("config") or {}
    strategy = config.get("strategy") or {}
    dense = strategy.get("kind") == "ddp"

    def group_name(group: str) -> Any:
        return "-" if dense else (config.get(group) or {}).get("name")

    row: dict[str, Any] = {
        "job": str(path.parent.relative_to(sweep_dir)),
        "overrides": list((results.get("job") or {}).get("overrides") or []),
        "status": results.get("status"),
        "strategy": strategy.get("name", strategy.get("kind")),
        "sparsifier": group_name("sparsifier"),
        "fusion": group_name("fusion"),
        "comm": group_name("comm"),
        "density": "-" if dense else strategy.get("density"),
        "world_size": results.get("world_size"),
        "global_step": results.get("global_step"),
        "samples_per_sec": results.get("samples_per_sec"),
        "bytes_sent_per_step": results.get("bytes_sent_per_step"),
        "dense_equivalent_bytes_per_step": results.get("dense_equivalent_bytes_per_step"),
        "compression_ratio": (results.get("communication") or {}).get("compression_ratio"),
    }
    for key, value in (results.get("final_metrics") or {}).items():
        if not key.startswith("perf/"):
            row[key] = value
    if results.get("error"):
        row["error"] = results["error"].strip().splitlines()[-1][:200]
    return row


def collect_rows(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per job; ``overrides`` keeps only the overrides that differ between jobs (the swept ones)."""
    sweep_dir = Path(sweep_dir)
    rows = []
    for path in sorted(sweep_dir.rglob(RESULTS_FILE), key=_job_sort_key):
        try:
            rows.append(_row(path, sweep_dir, json.loads(path.read_text())))
        except (OSError, ValueError, AttributeError) as error:  # one bad file must not lose the other rows
            log.warning("skipping %s in the sweep summary: %s", path, error)
    common = set.intersection(*(set(row["overrides"]) for row in rows)) if len(rows) > 1 else set()
    for row in rows:
        row["overrides"] = " ".join(o for o in row["overrides"] if o not in common)
    return rows


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.4e}"
    return str(value).replace("|", "\\|")


def write_summary(sweep_dir: str | Path) -> tuple[Path, Path] | None:
    """Write ``summary.csv`` and ``summary.md`` into ``sweep_dir``; None when it holds no results."""
    sweep_dir = Path(sweep_dir)
    rows = collect_rows(sweep_dir)
    if not rows:
        return None
    metric_keys = sorted({key for row in rows for key in row} - set(_FIXED))
    columns = [*_FIXED, *metric_keys]
    csv_path, md_path = sweep_dir / SUMMARY_CSV, sweep_dir / SUMMARY_MD
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# Sweep summary: {len(rows)} job(s) in {sweep_dir}",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(_format(row.get(column)) for column in columns) + " |" for row in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


class SweepSummary(HydraCallback):
    """Hydra callback: keep ``summary.csv``/``summary.md`` of a multirun's jobs up to date in its sweep dir."""

    def _sweep_dir(self, config: DictConfig) -> Path | None:
        try:
            return Path(config.hydra.sweep.dir)
        except Exception:  # noqa: BLE001 - no hydra node: nothing to summarize
            return None

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        from hydra.types import RunMode

        try:
            multirun = config.hydra.mode == RunMode.MULTIRUN
        except Exception:  # noqa: BLE001
            multirun = False
        sweep_dir = self._sweep_dir(config) if multirun else None
        if sweep_dir is not None:
            write_summary(sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = self._sweep_dir(config)
        written = write_summary(sweep_dir) if sweep_dir is not None else None
        if written:
            print(f"Sweep summary: {written[1]} (and {written[0].name})")

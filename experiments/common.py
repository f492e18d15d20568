"""Helpers shared by the experiment scripts: paths, CSV cells and files, small statistics, Markdown
cells, link rates, the generated blocks of REPORT.md, plotting, free ports.

Light on purpose (no torch, no matplotlib until a plot is drawn), so that analysing results
does not start the training stack.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import socket
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
REPORT = HERE / "REPORT.md"


# =========================================================================== where results go
def results_dir(args: argparse.Namespace, quick_name: str) -> tuple[Path, bool]:
    """The directory a benchmark with --out, --quick and --no-report writes to (--out; by default
    experiments/results, or $TMPDIR/<quick_name> for --quick), created, and whether it updates
    REPORT.md: only a full run into experiments/results without --no-report does."""
    out = args.out or (Path(tempfile.gettempdir()) / quick_name if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    return out, not args.no_report and not args.quick and out.resolve() == RESULTS.resolve()


def publish_md(text: str, name: str, out: str | None) -> Path:
    """Print a result table and write it to <out or results>/<name>.md."""
    print(text)
    folder = Path(out) if out else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.md"
    path.write_text(text + "\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# =========================================================================== CSV
def fmt(value: Any) -> str:
    """One CSV cell: "" for None, a whole float without ".0", any other float to 6 significant digits."""
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:.6g}" if not value.is_integer() else str(int(value))
    return str(value)


def fmt_rounded(value: Any) -> str:
    """One CSV cell: "" for None, every float to 6 significant digits (whole ones too: 1.5e+06)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(path: Path, fields: Iterable[str], rows: Iterable[dict[str, Any]],
              cell: Callable[[Any], str] | None = None) -> None:
    """``rows`` under the header ``fields`` (other keys are left out, missing ones empty); ``cell``
    formats every value (e.g. ``fmt``), without it they are written as they are."""
    fields = list(fields)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row if cell is None else {k: cell(row.get(k)) for k in fields})


def write_rounded_csv(path: Path, fields: Iterable[str], rows: Iterable[dict[str, Any]]) -> None:
    """``write_csv`` with every value through ``fmt_rounded`` (the simulator's tables)."""
    write_csv(path, fields, rows, cell=fmt_rounded)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# =========================================================================== numbers
def num(value: Any) -> float | None:
    """A CSV cell as a float; None for an empty one."""
    return float(value) if value not in ("", None) else None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile, interpolated linearly between the closest ranks (numpy's default)."""
    if not values:
        return None
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# =========================================================================== Markdown
def cell(value: Any, spec: str = "{:.3g}", empty: str = "") -> str:
    """One Markdown table cell: a number through the format string ``spec``, ``empty`` for None or ""."""
    if value is None or value == "":
        return empty
    return spec.format(value) if isinstance(value, (int, float)) else str(value)


# =========================================================================== link rates
def rate_mbit(rate: str) -> float:
    """Link rate in Mbit/s; inf for an unshaped link."""
    if rate in ("none", "", None):
        return math.inf
    from experiments.cluster.units import parse_rate

    return parse_rate(rate) / 1e6


def rate_label(rate: str) -> str:
    return "unshaped" if rate_mbit(rate) == math.inf else rate


# =========================================================================== REPORT.md
def update_report(block: str, marker: str, path: Path = REPORT) -> bool:
    """Replace the text between ``<!-- {marker}:begin -->`` and ``<!-- {marker}:end -->`` in REPORT.md."""
    if not path.exists():
        return False
    text = path.read_text()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{block.rstrip()}\n{end}{tail}")
    return True


def report_section(marker: str, path: Path = REPORT) -> str | None:
    """The text between the ``marker`` lines of REPORT.md, stripped; None without them."""
    text = path.read_text() if path.exists() else ""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


# =========================================================================== plots
#: one fixed colour per scheme in every plot
COLORS = {
    "compute_only": "black", "compute_sync": "dimgray", "ddp": "tab:red", "ddp_fp16": "tab:pink",
    "ddp_powersgd": "tab:orange", "ddp_powersgd4": "gold", "ssfusion": "tab:blue", "ssfusion_dense": "lightskyblue",
    "safusion": "tab:green",
    "adtopk": "tab:olive", "zen": "tab:purple", "oktopk": "tab:brown", "layerwise": "tab:gray", "behind": "tab:cyan",
}


def pyplot():
    """matplotlib.pyplot drawing to files only (the Agg backend), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


# =========================================================================== processes
def free_port() -> int:
    """A TCP port free on the loopback interface right now (for a local process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

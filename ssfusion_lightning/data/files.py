"""Finding a dataset's files under a user-given root, with an error that says what is expected where."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import BinaryIO, Sequence


def locate(
    root: str | Path,
    dataset: str,
    names: Sequence[str],
    subdirs: Sequence[str] = ("",),
    suffixes: Sequence[str] = ("",),
    hint: str = "",
) -> list[Path]:
    """Paths of ``names`` in the first of ``root/<subdir>`` that holds all of them with one of ``suffixes``.

    Raises FileNotFoundError naming the files expected under ``root/<subdirs[0]>``.
    """
    base = Path(root).expanduser()
    for subdir in subdirs:
        for suffix in suffixes:
            paths = [base / subdir / (name + suffix) for name in names]
            if all(path.is_file() for path in paths):
                return paths
    expected = ", ".join(str(base / subdirs[0] / (name + suffixes[0])) for name in names)
    raise FileNotFoundError(f"{dataset} not found: expected {expected}. {hint}".rstrip())


def open_binary(path: Path) -> BinaryIO:
    """Open a file for reading, decompressing it if its name ends in ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")

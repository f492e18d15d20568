"""Finding a dataset's files under a user-given root, or inside the package that ships them, with an
error that says what is expected where."""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Sequence

#: how to install every package that ships a dataset the real-data modules read by default
REALDATA_INSTALL = 'pip install "ssfusion-lightning[realdata]"'


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


@dataclass(frozen=True)
class PackagedFile:
    """A data file that an installable package ships: ``<the package's folder>/<relative>``."""

    package: str  # the import name, e.g. sklearn
    distribution: str  # the name pip installs, e.g. scikit-learn
    relative: str

    def path(self) -> Path | None:
        """Where the installed package keeps the file; None when the package is not installed.

        Found without importing the package: importing scikit-learn or gensim costs seconds and loads SciPy.
        """
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations))) / self.relative


def locate_file(path: str | Path | None, dataset: str, packaged: PackagedFile, expected: str) -> Path:
    """``path``, or the packaged copy when ``path`` is None.

    Raises FileNotFoundError naming the missing path (or package) and both ways to get the file:
    install the ``realdata`` extra, or point ``data.path`` at a file in the ``expected`` format.
    """
    if path is not None:
        file = Path(path).expanduser()
        if file.is_file():
            return file
        raise FileNotFoundError(
            f"{dataset} not found: expected {expected} at {file}. Point data.path at an existing file, or set "
            f"data.path=null to read the copy that {packaged.distribution} ships ({REALDATA_INSTALL})"
        )
    file = packaged.path()
    if file is None:
        raise FileNotFoundError(
            f"{dataset} not found: it is read from the {packaged.distribution} package, which is not installed. "
            f"Install it with {REALDATA_INSTALL}, or point data.path at {expected}"
        )
    if not file.is_file():
        raise FileNotFoundError(
            f"{dataset} not found: expected {file}, which this version of {packaged.distribution} does not ship. "
            f"Reinstall it with {REALDATA_INSTALL}, or point data.path at {expected}"
        )
    return file

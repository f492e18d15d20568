"""The package's imports run one way, read from the source (ast), without importing anything.

    strategy -> engine -> fusion -> sparsifiers
                       -> comm
    and all of them -> vocabulary.py, timeline.py (leaves: they import nothing of the package)

The fusion policies and the communicators share their types (the plan, the encoded buffer)
through ``vocabulary.py``, never through each other or through the engine that drives them.
Imports inside functions and under ``TYPE_CHECKING`` count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "ssfusion_lightning"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: subpackage -> the parts of the package its modules must never import
NEVER = {
    "comm": ("engine", "fusion", "sparsifiers", "strategy", "app"),
    "fusion": ("engine", "comm", "strategy", "app"),
    "sparsifiers": ("engine", "fusion", "comm", "strategy", "app"),
}
#: modules that import nothing of the package
LEAVES = ("vocabulary", "timeline")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module of the package that the file imports, anywhere in it."""
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module's package
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            found.add(origin)
            # ``from ssfusion_lightning import engine`` imports the subpackage ``engine``
            found.update(f"{origin}.{alias.name}" for alias in node.names)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def modules(subpackage: str) -> list[Path]:
    return sorted((ROOT / subpackage).rglob("*.py"))


def part(module: str) -> str:
    """The top-level part of the package a module belongs to: ``ssfusion_lightning.comm.zen`` -> comm."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_rules_see_every_module():
    for subpackage in NEVER:
        assert len(modules(subpackage)) > 3, subpackage
    for leaf in LEAVES:
        assert (ROOT / f"{leaf}.py").is_file(), leaf


def test_the_parser_finds_imports_of_every_form():
    source = """
from typing import TYPE_CHECKING
import torch
import ssfusion_lightning.engine.engine
from ssfusion_lightning import strategy
from . import channels
from ..fusion.base import Encoded
if TYPE_CHECKING:
    from ssfusion_lightning.app import builders
def later():
    from ssfusion_lightning.sparsifiers import Memory
"""
    found = {part(m) for m in imports_of(source, f"{PACKAGE}.comm.zen")}
    assert found >= {"engine", "strategy", "comm", "fusion", "app", "sparsifiers"}
    assert "torch" not in found and "typing" not in found


@pytest.mark.parametrize("subpackage", sorted(NEVER))
def test_imports_run_one_way(subpackage):
    wrong = []
    for path in modules(subpackage):
        found = {module for module in imported(path) if part(module) in NEVER[subpackage]}
        # one line per import: ``from a.b import c`` also lists a.b.c, in case c is a module
        wrong += [f"{path.relative_to(ROOT.parent)} imports {m}" for m in sorted(found) if m.rpartition(".")[0] not in found]
    assert not wrong, f"{subpackage}/ must not import {', '.join(NEVER[subpackage])}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("leaf", LEAVES)
def test_the_shared_vocabulary_imports_nothing_of_the_package(leaf):
    assert imported(ROOT / f"{leaf}.py") == set()

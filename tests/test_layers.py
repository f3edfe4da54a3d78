"""The layers of docs/architecture.md hold: every module of ``dspark`` belongs to exactly one row of the layer table,
and no import (at the top of a module or inside a function, ``TYPE_CHECKING`` blocks included) reaches a row above
its own. The table is the source: move a module or add one, and this test reads the change from the document."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from test_package_health import _modules  # every module of the package by dotted name

ARCHITECTURE = Path(__file__).parents[1] / "docs" / "architecture.md"


def layer_table(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """The rows of the table under '## Layers', top (entry points) first: (layer name, its module patterns)."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    table = []
    for line in rows:
        name, modules = (c.strip() for c in line.strip("|").split("|")[:2])
        table.append((name, tuple(re.findall(r"`([^`]+)`", modules))))
    return table


def layer_of(module: str, table: list[tuple[str, tuple[str, ...]]]) -> int | None:
    """The row index of a dotted module name (``dspark.engine.runner``); None when no row names it."""
    rel = module.removeprefix("dspark.").replace(".", "/")
    for i, (_, patterns) in enumerate(table):
        for p in patterns:
            if (p.endswith("/") and (rel + "/").startswith(p)) or rel == p.removesuffix(".py"):
                return i
    return None


def imports(source: str) -> list[tuple[str, int]]:
    """Every absolute ``dspark`` import in a module's source, wherever it sits: (imported name, line)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.module, node.lineno)] + [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return [(name, line) for name, line in out if name.startswith("dspark.")]


def upward_imports(table, mods: dict[str, str]) -> list[str]:
    """'importer (layer) -> imported (layer)' for every import that points to a higher row. ``mods``: module name
    -> source; the package root (``dspark``: lazy re-exports for users) stands above every layer."""
    found = []
    for name, source in sorted(mods.items()):
        if name == "dspark":
            continue
        own = layer_of(name, table)
        for target, line in imports(source):
            if target not in mods or target == "dspark":
                continue
            theirs = layer_of(target, table)
            if theirs is not None and own is not None and theirs < own:
                found.append(f"{name}:{line} ({table[own][0]}) imports {target} ({table[theirs][0]})")
    return found


@pytest.fixture(scope="module")
def table():
    return layer_table(ARCHITECTURE.read_text())


@pytest.fixture(scope="module")
def sources():
    return {name: path.read_text() for name, path in _modules().items()}


def test_the_table_is_read(table):
    names = [name for name, _ in table]
    assert names[0] == "entry points" and names[-1] == "configuration"
    assert len(names) == len(set(names)) >= 8


def test_every_module_has_one_layer(table, sources):
    unplaced = sorted(m for m in sources if m != "dspark" and layer_of(m, table) is None)
    assert unplaced == [], "add these modules to the layer table of docs/architecture.md"


def test_the_finder_sees_a_planted_upward_import(table):
    """A function-level import from the configuration layer up to the engine, and a downward one that is fine."""
    planted = {
        "dspark.config.planted": "def f():\n    from dspark.engine.engine import Engine\n    return Engine\n",
        "dspark.engine.engine": "from dspark.config import EngineConfig\n",
        "dspark.config": "",
    }
    found = upward_imports(table, planted)
    assert len(found) == 1 and found[0].startswith("dspark.config.planted:2 (configuration) imports dspark.engine")


def test_no_module_imports_a_layer_above_its_own(table, sources):
    assert upward_imports(table, sources) == []

"""Package structure: the import graph of ``dspark`` (every import, also the lazy ones inside functions) has no
cycles, subcommand modules share helpers through ``dspark.cli_common`` rather than importing the top-level CLI,
and the CLI carries no placeholder subcommands."""

from __future__ import annotations

import ast
from pathlib import Path

import dspark

PACKAGE = Path(dspark.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts).removesuffix(".__init__")] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the dspark modules it imports anywhere in its source (top level or inside functions)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_package_import_graph_has_no_cycles():
    graph = import_graph()
    assert "dspark.bench.speed" in graph and "dspark.train.trainer" in graph
    assert cycles(graph) == []


def test_no_module_imports_the_top_level_cli():
    """Subcommand modules (bench, serve, train) are imported BY dspark.cli; shared helpers live in cli_common."""
    importers = sorted(m for m, deps in import_graph().items() if "dspark.cli" in deps)
    assert importers == []


def test_cli_has_no_placeholder_subcommands():
    import dspark.cli as cli

    assert not hasattr(cli, "PLANNED") and not hasattr(cli, "_not_yet")
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    for name in cli.MODULES:
        assert name in sub.choices
    for name, parser in sub.choices.items():
        func = parser.get_default("func")
        assert func is not None and func.__name__.startswith("cmd_"), name

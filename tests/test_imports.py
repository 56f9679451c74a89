"""The house's import graph runs one way: no module of pipeline/, stages/ or flows/ reaches
itself through imports, counting imports inside functions too (a lazy import is fine for a
heavy dependency, never to hide a cycle). Layers, bottom to top: errors, config, store,
engines and runtime, stages, the DAG, flows and the CLI."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGES = ("pipeline", "stages", "flows")


def modules() -> dict[str, Path]:
    out = {}
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in PACKAGES:
            out[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body. `from pkg import name`
    counts as importing pkg.name when that is a module, else pkg. Importing a.b.c imports
    the package a.b (its __init__) too, unless that package is the importer's own."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            else:
                continue
            found = {r for r in map(resolve, targets) if r}
            found |= {parent for r in found for parent in packages_of(r, mods) if not mod.startswith(parent + ".")}
            graph[mod] |= found - {mod}
    return graph


def packages_of(module: str, mods: dict) -> list[str]:
    """The project packages above `module` (their __init__ runs when it is imported)."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in mods]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycles():
    assert cycles(import_graph()) == []


def test_the_bottom_layers_import_nothing_above_them():
    graph = import_graph()
    for low in ("pipeline.errors", "pipeline.config", "pipeline.store", "pipeline.remote_store", "pipeline.seeding"):
        above = {m for m in graph[low] if m.startswith(("stages", "flows")) or m in
                 ("pipeline.dag", "pipeline.cli", "pipeline.runtime", "pipeline.preflight", "pipeline.engines")}
        assert not above, (low, above)


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

"""The house's import graph runs one way: no module of pipeline/, stages/ or flows/ reaches
itself through imports, and every import goes to the importer's own level or below,
counting imports inside functions too (a lazy import is fine for a heavy dependency, never
to hide a cycle or climb a level). The levels are the sub-packages of pipeline/ plus the
stages, flows and the CLI (LEVELS)."""
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


# Longest matching prefix wins. Why this order: the core (config, store, schemas...) is
# what everything shares; tasks (prompts, grading) and models (runtime, engines) need only the
# core and not each other; services (servers, Prefect client, progress, MLflow tracking) use
# tasks for pool lineage; the training library and the DAG (specs, graph, placement,
# preflight) both sit on services and below, and neither imports the other; stages combine
# training, dag and models; reports read the DAG's keys and the stages' artifacts; flows
# call stages and reports; the CLI sits on top of everything.
LEVELS = {
    "pipeline": 0, "pipeline.core": 0,
    "pipeline.tasks": 1, "pipeline.models": 1,
    "pipeline.services": 2,
    "pipeline.training": 3, "pipeline.dag": 3,
    "stages": 4,
    "pipeline.reports": 5,
    "flows": 6,
    "pipeline.cli": 7,
}


def level(module: str) -> int:
    prefixes = [p for p in LEVELS if module == p or module.startswith(p + ".")]
    assert prefixes, f"{module}: no level in LEVELS (a new sub-package? give it one)"
    return LEVELS[max(prefixes, key=len)]


def test_every_module_has_a_level():
    for mod in modules():
        level(mod)


def test_every_import_goes_to_the_same_level_or_below():
    graph = import_graph()
    upward = sorted(f"{m} ({level(m)}) -> {t} ({level(t)})" for m, targets in graph.items()
                    for t in targets if level(t) > level(m))
    assert not upward, upward


def test_tasks_and_models_and_training_and_dag_do_not_import_each_other():
    graph = import_graph()
    for a, b in (("pipeline.tasks", "pipeline.models"), ("pipeline.training", "pipeline.dag")):
        for x, y in ((a, b), (b, a)):
            across = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith(x + ".")
                            for t in ts if t.startswith(y + ".") or t == y)
            assert not across, across


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

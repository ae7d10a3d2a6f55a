"""Package layering: no import cycle between stapo's modules (module-level and function-level imports alike),
and nothing in the core imports from ``stapo/integrations/`` (adapters depend on the core, never the reverse)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_graph() -> dict[str, set[str]]:
    """module → the stapo modules it imports anywhere in its file (``stapo.x.y`` names)."""
    files = {}
    for f in (REPO / "stapo").rglob("*.py"):
        name = ".".join(f.relative_to(REPO).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = f

    def resolve(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "stapo":
                targets = [resolve(f"{node.module}.{a.name}") for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names if a.name.split(".")[0] == "stapo"]
            else:
                continue
            # a module importing its own package's __init__ (or the top-level package) is not an edge of the layering
            graph[mod] |= {t for t in targets if t and t != mod and not mod.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_stapo():
    graph = import_graph()
    assert "stapo.train.trainer" in graph and "stapo.train.update" in graph["stapo.train.trainer"]
    assert cycles(graph) == []


def test_the_core_never_imports_the_integrations():
    graph = import_graph()
    bad = sorted((m, t) for m, ts in graph.items() if not m.startswith("stapo.integrations") for t in ts
                 if t.startswith("stapo.integrations"))
    assert bad == []

"""Package layering: no import cycle between stapo's modules (module-level and function-level imports alike),
imports only run down the layers of ``stapo.LAYERS`` (the algorithm in ``stapo/core/`` imports nothing above it, the
run shell ``stapo/run/`` nothing of training or evaluation), and the package map in ``stapo/__init__.py`` names every
module of the tree."""
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


def layer_of(module: str) -> int:
    """The index in ``stapo.LAYERS`` of a module's layer (``stapo.core.masks`` → that of ``core``), or -1 for the
    package itself and its private top-level modules (``stapo``, ``stapo._vision_guard``)."""
    from stapo import LAYERS

    parts = module.split(".")
    if len(parts) == 1 or parts[1].startswith("_"):
        return -1
    assert parts[1] in LAYERS, f"{module} is in no layer of stapo.LAYERS"
    return LAYERS.index(parts[1])


def test_layer_of_by_hand():
    # LAYERS = (common, core, tasks, model, rollout, config, run, evaluation, train, study, tools, integrations)
    assert (layer_of("stapo.common.registry"), layer_of("stapo.core.masks"), layer_of("stapo.config")) == (0, 1, 5)
    assert layer_of("stapo.train.update") == 8 and layer_of("stapo._vision_guard") == -1


def test_imports_only_run_down_the_layers():
    graph = import_graph()
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if layer_of(t) > layer_of(m) >= 0)
    assert up == []
    # the algorithm imports only the bottom layer; the run shell never imports training or evaluation
    core = {t for m, ts in graph.items() if m.startswith("stapo.core.") for t in ts}
    assert {t.split(".")[1] for t in core} <= {"core", "common"}, core
    run = {t for m, ts in graph.items() if m.startswith("stapo.run.") for t in ts}
    assert not {t for t in run if t.startswith(("stapo.train", "stapo.evaluation", "stapo.study"))}, run


def test_the_package_map_names_every_module():
    """Every sub-package of stapo/ is a layer, and the map in stapo/__init__.py names each module (by its file
    stem) and each sub-package (``core/``...)."""
    import stapo

    doc = stapo.__doc__
    folders = sorted(p.name for p in (REPO / "stapo").iterdir() if (p / "__init__.py").is_file())
    assert set(folders) | {"config"} == set(stapo.LAYERS)
    missing = [f"{d}/" for d in folders if f"{d}/" not in doc]
    for f in (REPO / "stapo").rglob("*.py"):
        stem = f.stem
        if stem.startswith("_") or f.parent.name == "configs":
            continue
        if not any(word.strip(",():;") == stem for word in doc.split()):
            missing.append(str(f.relative_to(REPO)))
    assert missing == []


def test_the_readme_layout_names_every_sub_package_and_module():
    """README.md's Layout section has a row per sub-package of stapo/ and names each of its modules."""
    text = (REPO / "README.md").read_text()
    layout = text[text.index("## Layout\n"):text.index("\n## ", text.index("## Layout\n") + 1)]
    missing = []
    for f in sorted((REPO / "stapo").rglob("*.py")):
        rel = f.relative_to(REPO)
        if f.stem.startswith("_") or "configs" in rel.parts:
            continue
        if len(rel.parts) == 2:  # stapo/config.py
            ok = f"`{rel}`" in layout
        else:
            row = next((line for line in layout.splitlines() if line.startswith(f"| `stapo/{rel.parts[1]}/` |")), "")
            ok = f"`{f.stem}`" in row
        if not ok:
            missing.append(str(rel))
    assert missing == []


#: Modules that import without torch (nor transformers, vLLM, datasets): the config schema, the console scripts' entry
#: points and the study runner (their --help and --dry-run start in a fraction of a second), the run shell's lock,
#: parser, pre-flight, provenance and tracking, the data and grading layer, the cost estimate, the common helpers.
#: Their function-local imports of stapo modules that would pull torch in are what keeps them so (the heavy modules
#: keep a few function-local imports too: optional paths such as the evaluation runner's engine and verifier, and
#: names tests patch at their source). A fresh interpreter imports each and checks.
LIGHT_MODULES = ("stapo.config", "stapo.core.params", "stapo.run.preflight", "stapo.tools.entry_points", "stapo.study",
                 "stapo.common.checkpoint_files", "stapo.common.errors", "stapo.common.fingerprint",
                 "stapo.common.logs", "stapo.common.plotting", "stapo.common.registry", "stapo.core.metric_names",
                 "stapo.integrations.verl_reward", "stapo.run.cli", "stapo.run.console", "stapo.run.provenance",
                 "stapo.run.run_identity", "stapo.run.runlock", "stapo.run.throughput", "stapo.run.tracking",
                 "stapo.tasks.boxed", "stapo.tasks.data", "stapo.tasks.golds", "stapo.tasks.grader",
                 "stapo.tasks.prompts", "stapo.tasks.records", "stapo.tasks.rewards", "stapo.tasks.splits",
                 "stapo.tasks.synthetic", "stapo.tasks.word_problems", "stapo.tools.estimate")


def test_light_modules_import_without_torch():
    import subprocess
    import sys

    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "print(sorted({k.split('.')[0] for k in sys.modules} & {'torch', 'transformers', 'vllm', 'datasets'}))")
    out = subprocess.run([sys.executable, "-c", code, *LIGHT_MODULES], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"

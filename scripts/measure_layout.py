"""Measure the package's layout (issue 34): files per folder, the trainer's two long methods, the algorithm core's
share of the code, and the functions a reader passes from ``train_step`` to the optimizer step.

    python scripts/measure_layout.py [--json]

All figures are read from the source text (``ast``), nothing is imported or run:

* **files per folder**: ``*.py`` files of each folder of ``stapo/``;
* **method lines**: ``Trainer.__init__`` and ``Trainer.train`` of ``stapo/train/trainer.py``, first to last line;
* **shares**: lines of the algorithm core (:data:`CORE`: token statistics, masks, objectives, advantages, the
  mini-batch mask) and of the run shell (:data:`SHELL`) over all lines of ``stapo/``;
* **update path**: the functions defined in ``stapo/`` that the update of a training step reaches — everything
  ``Trainer._update`` calls, transitively, down to the optimizer step —
  and the files they are in. A call ``self.f(...)`` (or ``up.f(...)``, the mini-batch's name for its
  ``PolicyUpdate``) is resolved to the method of that class when it has one; any other call is matched by name
  against the package's module-level functions (``f(...)``, ``module.f(...)``: every top-level ``def f``; names
  too generic to resolve, :data:`GENERIC`, are not followed; the file's own ``def f`` when it has one, and a
  ``_private`` name only there); a method of another object (``x.f(...)``) is followed when one class only
  defines ``f``. The same rules measure both trees;
* **names for one thing**: the functions on the update path named for the mini-batch mask (``*mask*``, the
  mask builders and their checks) and for the loss denominator (``*denominator*``).

Caveats: the update path starts at ``Trainer._update`` (step 5 of ``train_step``); the whole step,
``Trainer.train_step`` with rollout, reward, advantages and logging, is printed beside it; torch's and
transformers' functions are not counted; :data:`CORE` and :data:`SHELL` are lists of
module stems chosen by hand (the same lists measure both trees). ``--repo DIR`` measures another checkout (e.g. a
worktree of the commit before a change) with the same rules.
"""
from __future__ import annotations

import argparse
import ast
import json
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "stapo"
#: The algorithm core, by module stem, wherever the file lives (before or after the move into a sub-package).
CORE = {"token_stats", "masks", "objectives", "advantages", "dp_mask", "minibatch", "tensor_utils", "analysis",
        "registry", "metric_names"}
#: The run shell (the lifecycle of a run's folder and process), by module stem.
SHELL = {"runlock", "cli", "interrupts", "preflight", "provenance", "checkpoint_files", "console", "estimate",
         "memory_plan", "perf", "fingerprint", "run_identity", "tracking", "viewer", "plotting", "entry_points",
         "run_folder", "folder"}


#: Method names shared with the standard library / torch that a name match would follow wrongly.
GENERIC = {"run", "step", "get", "update", "items", "append", "close", "write", "read", "load", "save", "log",
           "format", "__init__", "__call__", "reset", "train", "eval", "forward", "backward", "sum", "mean", "to",
           "copy", "keys", "values", "pop", "clear", "extend", "add", "text", "item", "zero_grad", "flush",
           "get_last_lr", "open", "record", "kill", "apply", "replace"}
#: Receiver names whose class is known: ``self`` (the enclosing class), ``up`` (``_MiniBatch.up``) and
#: ``self.updater`` (the trainer's :class:`PolicyUpdate`).
RECEIVERS = {"up": "PolicyUpdate", "updater": "PolicyUpdate"}


def _files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def method_lines(cls: str = "Trainer", names: tuple[str, ...] = ("__init__", "train")) -> dict[str, int]:
    """Lines (first to last, docstring included) of ``cls``'s methods ``names`` in stapo/train/trainer.py."""
    tree = ast.parse((PKG / "train" / "trainer.py").read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in names:
                    out[f"{cls}.{item.name}"] = item.end_lineno - item.lineno + 1
    return out


def update_path(start: str = "stapo/train/trainer.py::Trainer._update") -> tuple[list[str], list[str]]:
    """(functions, files) the update reaches from ``start`` (``file::Class.method``: the method ``Trainer._update``
    hands the step to)."""
    defs: dict[str, list[tuple[str, ast.AST]]] = defaultdict(list)  # name -> [(qualified name, node)]
    methods: dict[tuple[str, str], str] = {}  # (class, method) -> qualified name
    owner: dict[str, str] = {}  # qualified name -> its class
    for path in _files():
        rel = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        q = f"{rel}::{node.name}.{item.name}"
                        defs[item.name].append((q, item))
                        methods.setdefault((node.name, item.name), q)
                        owner[q] = node.name
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs[node.name].append((f"{rel}::{node.name}", node))
    nodes = {q: n for lst in defs.values() for q, n in lst}
    calls: dict[str, set[str]] = {}
    for q, n in nodes.items():
        out = set()
        for c in ast.walk(n):
            if isinstance(c, ast.Call):
                f = c.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                v = f.value if isinstance(f, ast.Attribute) else None
                recv = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
                cls = owner.get(q) if recv == "self" else RECEIVERS.get(recv or "")
                if cls and (cls, name) in methods:  # self.f / up.f: that class's own method, generic or not
                    out.add(methods[(cls, name)])
                elif name and name in defs and name not in GENERIC:
                    top = {d for d, _ in defs[name] if d not in owner}  # f(...), module.f(...): module-level defs
                    here = {d for d in top if d.split("::")[0] == q.split("::")[0]}
                    top = here or (set() if name.startswith("_") else top)  # a file's own def; _private: its own
                    meth = [d for d, _ in defs[name] if d in owner]  # x.f(...): a method defined once only
                    out |= top | (set(meth) if isinstance(f, ast.Attribute) and len(meth) == 1 else set())
        calls[q] = out - {q}
    reach, todo = {start}, [start]
    while todo:
        for w in calls[todo.pop()]:
            if w not in reach:
                reach.add(w)
                todo.append(w)
    on = sorted(reach)
    return on, sorted({q.split("::")[0] for q in on})


def measure() -> dict:
    files = _files()
    per_folder = Counter(str(p.parent.relative_to(REPO)) for p in files)
    total = sum(_lines(p) for p in files)
    core = sum(_lines(p) for p in files if p.stem in CORE)
    shell = sum(_lines(p) for p in files if p.stem in SHELL)
    functions, where = update_path()
    names = [q.split("::")[1].split(".")[-1] for q in functions]
    step, step_files = update_path("stapo/train/trainer.py::Trainer.train_step")
    return {"files_per_folder": dict(sorted(per_folder.items())), "lines_total": total,
            "core_share": round(core / total, 3), "shell_share": round(shell / total, 3),
            "method_lines": method_lines(), "update_path_functions": len(functions),
            "update_path_files": len(where), "update_path": functions,
            "step_functions": len(step), "step_files": len(step_files),
            "mask_names": sorted({n for n in names if "mask" in n.lower()}),
            "denominator_names": sorted({n for n in names if "denominator" in n.lower()})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print everything as JSON")
    ap.add_argument("--repo", type=Path, default=None, help="the checkout to measure (default: this one)")
    args = ap.parse_args()
    if args.repo is not None:
        global REPO, PKG
        REPO, PKG = args.repo.resolve(), args.repo.resolve() / "stapo"
    m = measure()
    if args.json:
        print(json.dumps(m, indent=1))
        return
    for folder, n in m["files_per_folder"].items():
        print(f"{folder:<24} {n:>3} files")
    print(f"lines of stapo/: {m['lines_total']}; core share {m['core_share']:.1%}, run-shell share "
          f"{m['shell_share']:.1%}")
    print("  ".join(f"{k}: {v} lines" for k, v in m["method_lines"].items()))
    print(f"the step (Trainer.train_step, all it reaches): {m['step_functions']} functions in {m['step_files']} files")
    print(f"the update (Trainer._update down to optimizer.step()): {m['update_path_functions']} functions in "
          f"{m['update_path_files']} files")
    print(f"  names for the mini-batch mask: {', '.join(m['mask_names'])}")
    print(f"  names for the loss denominator: {', '.join(m['denominator_names'])}")


if __name__ == "__main__":
    main()

"""The console scripts of an installed package (``pyproject.toml`` ``[project.scripts]``):

* ``stapo-train`` runs ``train.py`` — the same file and ``main()`` as ``python train.py`` (arguments alike);
* ``stapo-eval`` runs ``evaluate.py`` likewise;
* ``stapo-study`` runs ``python -m stapo.study``;
* ``stapo-summarize``, ``stapo-compare`` and ``stapo-prepare-data`` run ``scripts/summarize_run.py``,
  ``scripts/compare.py`` and ``scripts/prepare_data.py`` (the commands train.py's end-of-run summary suggests).

``train.py`` and ``evaluate.py`` stay at the repository root (the README's commands); a wheel carries them as
``stapo/_cli/train.py`` / ``evaluate.py`` (and ``scripts/`` as ``stapo/_cli/scripts``) and an editable install maps
``stapo._cli`` onto the repository root (``[tool.setuptools.package-dir]``), so both kinds of install run the
repository's own files.

``--config PATH`` that does not exist as given but names a file under ``configs/`` (``configs/tiny_test.yaml``,
``tiny_test.yaml``, ``eval/cpu_smollm2.yaml``) is read from the installed package's configs
(:func:`resolve_config`): the repository's ``configs/`` for a checkout or an editable install, the package data
``stapo/configs`` for a wheel. A config's ``defaults:`` parents are relative to the file, so they resolve there
too; paths inside a config that are relative to the working directory (``prompt.from_train_config``,
``data.root``) are not rewritten.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path, PurePath

from stapo.config import configs_dir

__all__ = ["train", "evaluate", "study", "summarize", "compare", "prepare_data", "configs_dir", "resolve_config"]


def resolve_config(path: str, base: Path | None = None) -> str:
    """``path`` when it exists (or is empty); else the shipped config it names, as an absolute path string.

    ``configs/tiny_test.yaml``, ``tiny_test.yaml`` and an absolute or relative path ending in ``.../configs/X`` all
    name ``<configs_dir>/X``. A path that names no shipped file either is returned unchanged (the command then
    fails with its usual one-line "config file not found").

    Args:
        path: the ``--config`` argument.
        base: the configs folder to search (default :func:`configs_dir`).
    """
    if not path or os.path.exists(path):
        return path
    base = base if base is not None else configs_dir()
    if base is None:
        return path
    parts = PurePath(path).parts
    rel = parts[len(parts) - parts[::-1].index("configs"):] if "configs" in parts else parts
    candidate = base.joinpath(*rel) if rel else None
    return str(candidate) if candidate is not None and candidate.is_file() else path


def _with_resolved_config(argv: list[str]) -> list[str]:
    """``argv`` with the value of ``--config`` (``--config X`` or ``--config=X``) through :func:`resolve_config`."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + resolve_config(arg.split("=", 1)[1])
    return out


def _run(module: str, script: str | None = None) -> None:
    """Run ``module`` as ``__main__`` (as ``python FILE`` / ``python -m``) with ``sys.argv``'s ``--config``
    resolved; its ``sys.exit`` code is the process's. ``script``: the repository file to run instead when
    ``module`` cannot be found (an editable install made before ``stapo._cli`` existed)."""
    import importlib.util

    sys.argv = [sys.argv[0], *_with_resolved_config(sys.argv[1:])]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    repo_file = Path(__file__).resolve().parents[2] / script if script else None
    if not found and repo_file is not None and repo_file.is_file():
        runpy.run_path(str(repo_file), run_name="__main__")
    else:
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def train() -> None:
    """``stapo-train``: ``python train.py`` (docs: ``train.py --help``)."""
    _run("stapo._cli.train", "train.py")


def evaluate() -> None:
    """``stapo-eval``: ``python evaluate.py`` (docs: ``evaluate.py --help``)."""
    _run("stapo._cli.evaluate", "evaluate.py")


def study() -> None:
    """``stapo-study``: ``python -m stapo.study`` (docs/study.md)."""
    _run("stapo.study")


def summarize() -> None:
    """``stapo-summarize``: ``python scripts/summarize_run.py`` (a run's Markdown report)."""
    _run("stapo._cli.scripts.summarize_run", "scripts/summarize_run.py")


def compare() -> None:
    """``stapo-compare``: ``python scripts/compare.py`` (several evaluation results in one table)."""
    _run("stapo._cli.scripts.compare", "scripts/compare.py")


def prepare_data() -> None:
    """``stapo-prepare-data``: ``python scripts/prepare_data.py`` (the benchmarks and training sets under data/)."""
    _run("stapo._cli.scripts.prepare_data", "scripts/prepare_data.py")

"""Plot any train.py run folders as one figure, a local dashboard with no server (no W&B, no TensorBoard):

    python scripts/plot_runs.py runs/stapo_embedded-smollm2_seed0 runs/grpo_embedded-smollm2_seed* --out runs.png
    python scripts/plot_runs.py runs/* --metrics critic/score/mean actor/entropy 'actor/*/masked_frac'

Reads each folder's ``metrics.jsonl`` (:func:`stapo.run.tracking.read_metrics`) and ``config.json``, groups the runs
(:func:`group_runs`: by their recorded W&B group, ``logging.group``, which is one setting — a family or study and a
method — so seeds of a method share it; for runs from before that rule, by the objective, ``algorithm.objective``;
``--by`` chooses),
and draws one panel per metric against the training step: per group a thin line per seed, the mean over seeds as a
thick line and a light band from the seeds' minimum to their maximum, clipped to the metric's physical range
(stapo/common/plotting.py, the same drawing as the study report's curves.png). A metric may be an :mod:`fnmatch` pattern
(``actor/*/masked_frac``: each run's first matching key, the mask's own). A later row of a step (a resumed run)
replaces an earlier one. A folder named twice is read once. Exit codes: 0 written; 2 a folder without config.json /
metrics.jsonl, a damaged metrics.jsonl line, no metric with a value, or a --out that cannot be written (one line
each).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from stapo.common.plotting import draw_seed_curves, physical_range  # noqa: E402
from stapo.run.tracking import CorruptJsonlError, read_metrics  # noqa: E402

#: The panels drawn without --metrics (docs/metrics.md): reward, grader accuracy, entropy, the mask's masked fraction
#: (S2T and its ablations) or kept fraction (20-Entropy's top_entropy; a panel only when a run logs it), response
#: length and the PPO clip fraction.
DEFAULT_METRICS = ["critic/score/mean", "reward/grader/accuracy", "actor/entropy", "actor/*/masked_frac",
                   "actor/*/kept_frac", "response_length/mean", "actor/pg_clipfrac"]


@dataclass(frozen=True)
class Run:
    """One run folder: its group label, its seed (``trainer.seed``) and its path."""

    label: str
    seed: int
    path: Path


class PlotError(ValueError):
    """A run folder or metrics file that cannot be plotted (one line)."""


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def run_label(config: dict[str, Any], by: str = "auto") -> str:
    """A run's group from its ``config.json`` (a dict).

    Args:
        config: the run's resolved config.
        by: ``"auto"``: ``logging.group`` when the run also records ``logging.method`` (its group is then one
            setting: ``<family or study>-<method>``), else ``algorithm.objective`` (runs from before that rule
            have the family or study as their group, shared by every method); ``"group"``: the group
            (``"(no group)"`` when none); ``"method"``: ``logging.method`` when recorded, else the objective;
            ``"objective"``: ``algorithm.objective``.
    """
    objective = str(_get(config, "algorithm.objective") or "(no objective)")
    group = _get(config, "logging.group")
    if by == "objective":
        return objective
    if by == "method":
        return str(_get(config, "logging.method") or objective)
    if by == "group":
        return str(group or "(no group)")
    if by != "auto":
        raise ValueError(f"--by must be auto, group, method or objective, got {by!r}")
    return str(group) if group and _get(config, "logging.method") else objective


def group_runs(run_dirs: Sequence[str | Path], by: str = "auto") -> dict[str, list[Run]]:
    """{label: runs} of ``run_dirs`` (:func:`run_label`), labels in the order they first appear, each group's runs
    by seed.

    A folder named twice (``runs/stapo_* runs/stapo_seed0``: overlapping shell patterns, ``runs/x`` and
    ``runs/x/``) is read once: it is one run, not two seeds.

    Raises:
        PlotError: a folder without ``config.json`` or with one that is not a JSON object.
    """
    groups: dict[str, list[Run]] = {}
    seen: set[Path] = set()
    for d in run_dirs:
        path = Path(d)
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise PlotError(f"{path}: no config.json (not a train.py run folder)")
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise PlotError(f"{cfg_path}: not JSON ({e})") from None
        if not isinstance(config, dict):
            raise PlotError(f"{cfg_path}: not a JSON object")
        seed = _get(config, "trainer.seed")
        groups.setdefault(run_label(config, by), []).append(Run(run_label(config, by), int(seed or 0), path))
    return {k: sorted(v, key=lambda r: (r.seed, str(r.path))) for k, v in groups.items()}


def _series(rows: list[dict[str, Any]], metric: str) -> tuple[str | None, dict[int, float]]:
    """(the key read, {step: value}) of one run: ``metric`` itself, or the first key matching the pattern."""
    if any(c in metric for c in "*?["):
        key = next((k for r in rows for k in r if k != "step" and fnmatch.fnmatchcase(k, metric)), None)
    else:
        key = metric
    out: dict[int, float] = {}
    for r in rows:
        v = r.get(key) if key else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[int(r["step"])] = float(v)  # a resumed run's later row of a step wins
    return (key if out else None), out


def collect(groups: dict[str, list[Run]], metrics: Sequence[str]
            ) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray, list[str]]]]:
    """{metric: {label: (steps [T] int, values [S, T] float64 with NaN where a seed has no value, keys read)}};
    a metric no run logs is left out, and so is a group without it.

    Raises:
        PlotError: a folder without metrics.jsonl, or a damaged line in one (file and line named).
    """
    rows: dict[Path, list[dict[str, Any]]] = {}
    for runs in groups.values():
        for run in runs:
            path = run.path / "metrics.jsonl"
            if not path.is_file():
                raise PlotError(f"{run.path}: no metrics.jsonl")
            try:
                rows[run.path] = read_metrics(path)
            except CorruptJsonlError as e:
                raise PlotError(str(e)) from None
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray, list[str]]]] = {}
    for metric in metrics:
        for label, runs in groups.items():
            per_seed = [_series(rows[r.path], metric) for r in runs]
            steps = sorted({s for _, d in per_seed for s in d})
            if not steps:
                continue
            values = np.full((len(runs), len(steps)), np.nan)
            for i, (_, d) in enumerate(per_seed):
                for j, s in enumerate(steps):
                    values[i, j] = d.get(s, np.nan)
            keys = sorted({k for k, _ in per_seed if k})
            out.setdefault(metric, {})[label] = (np.array(steps), values, keys)
    return out


def plot(series: dict[str, dict[str, tuple[np.ndarray, np.ndarray, list[str]]]], groups: dict[str, list[Run]],
         out: str | Path, title: str | None = None) -> Path:
    """One panel per metric (up to 3 per row), each group in its own colour in every panel; writes ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(series)
    ncol = min(3, len(names))
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.4 * nrow), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {label: colors[k % len(colors)] for k, label in enumerate(groups)}
    for i, name in enumerate(names):
        ax = axes[i // ncol, i % ncol]
        for label, (steps, values, keys) in series[name].items():
            ranges = {physical_range(k) for k in keys}
            draw_seed_curves(ax, steps, values, color[label], f"{label} ({len(groups[label])})",
                             clip=ranges.pop() if len(ranges) == 1 else (None, None))
        shown = sorted({k for _, _, keys in series[name].values() for k in keys})
        ax.set_title(name if shown == [name] else f"{name}\n({', '.join(shown)})", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.set_xlabel("training step", fontsize=8)
        if i == 0:
            ax.legend(fontsize=7, title="group (runs)", title_fontsize=7)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    fig.suptitle(title or "thin lines = seeds, thick = mean over seeds, band = the seeds' min–max", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="train.py run folders (each with config.json and metrics.jsonl)")
    p.add_argument("--out", default="runs.png", help="the PNG to write (default runs.png)")
    p.add_argument("--metrics", nargs="+", default=DEFAULT_METRICS,
                   help="metrics.jsonl keys or fnmatch patterns, one panel each (default: %(default)s)")
    p.add_argument("--by", choices=["auto", "group", "method", "objective"], default="auto",
                   help="how runs are grouped: auto = the recorded W&B group (one per method), else the objective")
    p.add_argument("--title", help="the figure's title")
    args = p.parse_args(argv)
    try:
        groups = group_runs(args.runs, args.by)
        series = collect(groups, args.metrics)
    except PlotError as e:
        print(f"plot_runs.py: {e}", file=sys.stderr)
        return 2
    if not series:
        print(f"plot_runs.py: none of {', '.join(args.metrics)} has a value in these runs", file=sys.stderr)
        return 2
    for label, runs in groups.items():  # two folders of one seed (a rerun, a copy) would count as two seeds
        seeds = [r.seed for r in runs]
        for seed in sorted({x for x in seeds if seeds.count(x) > 1}):
            paths = ", ".join(str(r.path) for r in runs if r.seed == seed)
            print(f"plot_runs.py: warning: {label} has trainer.seed={seed} in {seeds.count(seed)} runs ({paths}): "
                  "each is drawn as its own seed", file=sys.stderr)
    try:
        out = plot(series, groups, args.out, args.title)
    except OSError as e:  # a folder that cannot be made or written: one line, not a traceback
        print(f"plot_runs.py: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    for label, runs in groups.items():
        print(f"{label}: {len(runs)} run(s), seeds {', '.join(str(r.seed) for r in runs)}")
    print(f"wrote {out} ({len(series)} panel(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A finished run in a few lines: start → end of its main metrics, where its files are, and what to run next.

Shared by ``train.py`` (the end-of-run summary it prints) and ``scripts/summarize_run.py`` (the Markdown report).
"Start" and "end" are the means of a metric over the first and the last ``window`` training steps of
``metrics.jsonl`` (one step of a few dozen responses is noisy); ``window`` is capped at half the number of training
steps so the two never overlap (one step: start = end = that step). Missing values (a key absent from a row, or
``null``: a non-finite value) are left out of the means.

A training step is a row holding :data:`TRAINING_KEY` (``critic/score/mean``); other rows, such as the step-0
validation-only row of ``trainer.val_before_train``, are not counted as steps, and the windows are labelled by the
rows' own ``step`` values.
"""
from __future__ import annotations

import math
import os
import shlex
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from stapo.config import configs_dir
from stapo.core.metric_names import masked_fraction_key
from stapo.evaluation.runner import benchmark_file
from stapo.model.checkpoint import latest_checkpoint
from stapo.run.tracking import read_metrics

__all__ = ["Change", "REPORT_KEYS", "TRAINING_KEY", "training_rows", "window_size", "start_end", "step_span",
           "masked_fraction_key", "markdown_report", "end_of_run_text", "end_of_run_summary", "eval_config_for",
           "missing_benchmarks", "evaluate_suggestion", "Commands", "commands_here"]

#: (metric key, label, format) of the Markdown report, in order (docs/metrics.md names the keys).
REPORT_KEYS: list[tuple[str, str, str]] = [
    ("critic/score/mean", "reward (mean, ±1)", "{:+.3f}"),
    ("reward/grader/accuracy", "accuracy (math-verify)", "{:.3f}"),
    ("actor/entropy", "entropy (nats / token)", "{:.3f}"),
    ("actor/s2t/masked_frac", "S2T masked fraction", "{:.4f}"),
    ("actor/s2t/num_masked", "S2T masked tokens / step", "{:.1f}"),
    ("frac_reward_zero_std", "groups with zero reward std", "{:.2f}"),
    ("response_length/mean", "response length (tokens)", "{:.1f}"),
    ("response_length/clip_ratio", "truncated responses", "{:.2f}"),
    ("actor/grad_norm", "grad norm", "{:.3f}"),
    ("timing_s/step", "s / step", "{:.1f}"),
    ("timing_s/rollout", "rollout s", "{:.1f}"),
    ("timing_s/old_log_prob", "old log-prob s", "{:.1f}"),
    ("timing_s/update", "update s", "{:.1f}"),
    ("timing_s/sync", "sync s", "{:.2f}"),
]
_FORMATS = {key: (label, fmt) for key, label, fmt in REPORT_KEYS}

#: The key every training step's row holds (the rollout's mean reward); a row without it (the step-0 validation of
#: ``trainer.val_before_train``) is not a training step.
TRAINING_KEY = "critic/score/mean"


def training_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of training steps (those holding :data:`TRAINING_KEY`), in file order."""
    return [r for r in rows if TRAINING_KEY in r]


def step_span(rows: Sequence[dict[str, Any]]) -> str:
    """``"steps a–b"`` from the first and last rows' ``step`` values (``"step a"`` for one row; ``""`` for none)."""
    if not rows:
        return ""
    a, b = rows[0]["step"], rows[-1]["step"]
    return f"step {a}" if a == b else f"steps {a}–{b}"


@dataclass(frozen=True)
class Change:
    """A metric's start and end means (NaN where no step of the window has it)."""

    key: str
    label: str
    fmt: str
    start: float
    end: float

    def text(self) -> str:
        """``"<start> → <end>"`` in the metric's format (``n/a`` for NaN)."""
        return f"{_fmt(self.fmt, self.start)} → {_fmt(self.fmt, self.end)}"


def _fmt(fmt: str, v: float) -> str:
    return "n/a" if math.isnan(v) else fmt.format(v)


def window_size(num_steps: int, window: int) -> int:
    """Steps averaged at each end: ``window`` capped at half of ``num_steps`` (at least 1)."""
    return max(1, min(window, num_steps // 2 or 1))


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float:
    """Mean of ``key`` over the rows that log it; a non-finite value in the window makes the mean non-finite (NaN /
    ±inf), never silently left out (docs/metrics.md#non-finite-values)."""
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return statistics.fmean(vals) if vals else float("nan")


def start_end(rows: Sequence[dict[str, Any]], keys: Sequence[str], window: int = 5) -> tuple[int, list[Change]]:
    """Start and end means of ``keys`` over the first / last :func:`window_size` training rows (file order).

    Args:
        rows: ``metrics.jsonl`` rows (dicts with ``step`` and metric keys), in step order; rows that are not training
            steps (:func:`training_rows`) are left out before the windows are taken.
        keys: metric keys; those that no row of either window holds are left out of the result.
        window: steps averaged at each end (capped, :func:`window_size`).

    Returns:
        ``(w, changes)``: the window used and one :class:`Change` per key kept, in ``keys``' order (no change when
        there is no training row).
    """
    rows = training_rows(rows)
    w = window_size(len(rows), window)
    first, last = rows[:w], rows[-w:]
    out = []
    for key in keys:
        label, fmt = _FORMATS.get(key, (key, "{:.4g}"))
        a, b = _mean(first, key), _mean(last, key)
        if not (math.isnan(a) and math.isnan(b)):
            out.append(Change(key, label, fmt, a, b))
    return w, out


def markdown_report(rows: Sequence[dict[str, Any]], run_name: str, summary_command: str, window: int = 5,
                    wall_s: float | None = None, command: str | None = None) -> str:
    """The Markdown report of ``scripts/summarize_run.py``: the command lines, the training-step count and windows
    (labelled by the rows' ``step`` values), the sum of step times, a start/end table of :data:`REPORT_KEYS` and one
    line per training step. Rows that are not training steps (:func:`training_rows`: the step-0 validation of
    ``trainer.val_before_train``) are named, not counted."""
    w, changes = start_end(rows, [k for k, _, _ in REPORT_KEYS], window)
    other = [r for r in rows if TRAINING_KEY not in r]
    rows = training_rows(rows)
    lines = [f"# Run summary: {run_name}", ""]
    if command:
        lines += [f"- Command: `{command}`"]
    steps = (f"- Steps: {len(rows)} (start = mean of {step_span(rows[:w])}, end = mean of {step_span(rows[-w:])})"
             if rows else "- Steps: 0 (no training step was logged)")
    if other:
        steps += (f"; {len(other)} row{'s' if len(other) > 1 else ''} without training metrics (validation only: "
                  f"step{'s' if len(other) > 1 else ''} {', '.join(str(r['step']) for r in other)}) not counted")
    lines += [f"- Summary: `{summary_command}`", steps,
              f"- Sum of step times: {sum(r.get('timing_s/step') or 0.0 for r in rows) / 60:.1f} min"
              + (f"; wall time of the whole command: {wall_s / 60:.1f} min" if wall_s else ""), "",
              "| metric | start | end |", "|---|---|---|"]
    lines += [f"| {c.label} (`{c.key}`) | {_fmt(c.fmt, c.start)} | {_fmt(c.fmt, c.end)} |" for c in changes]
    lines += ["", "Per step:", "", "| step | reward | entropy | masked frac | zero-std groups | length | s |",
              "|---|---|---|---|---|---|---|"]

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        v = r.get(key)
        return _fmt(fmt, float("nan") if v is None else float(v))

    for r in rows:
        lines.append(f"| {r['step']} | {cell(r, 'critic/score/mean', '{:+.3f}')} | {cell(r, 'actor/entropy', '{:.3f}')} "
                     f"| {cell(r, 'actor/s2t/masked_frac', '{:.4f}')} | {cell(r, 'frac_reward_zero_std', '{:.2f}')} | "
                     f"{cell(r, 'response_length/mean', '{:.1f}')} | {cell(r, 'timing_s/step', '{:.1f}')} |")
    return "\n".join(lines) + "\n"


def _rel(path: Path) -> str:
    """``path`` relative to the current directory when it is below it, else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Commands:
    """How the next steps are run from where the user is: a source checkout's files or the installed console
    scripts (``pyproject.toml`` ``[project.scripts]``).

    Attributes:
        evaluate / summarize / compare / prepare_data: the command prefixes (``python evaluate.py`` or
            ``stapo-eval``...).
        eval_dir: the folder searched for ``<family>.yaml`` evaluate configs.
        shown_eval_dir: how that folder is written in a suggested command (``configs/eval``: relative to the
            checkout, or the name the console scripts resolve in the installed package's configs).
    """
    evaluate: str = "python evaluate.py"
    summarize: str = "python scripts/summarize_run.py"
    compare: str = "python scripts/compare.py"
    prepare_data: str = "python scripts/prepare_data.py"
    eval_dir: Path = Path("configs/eval")
    shown_eval_dir: str = "configs/eval"


#: The console scripts the end-of-run suggestions name (pyproject.toml ``[project.scripts]``).
CONSOLE_SCRIPTS = ("stapo-eval", "stapo-summarize", "stapo-compare", "stapo-prepare-data")


def _console_scripts_installed() -> bool:
    """True when every one of :data:`CONSOLE_SCRIPTS` is on ``$PATH`` or beside this Python (a venv's ``bin/``)."""
    beside = Path(sys.executable).parent
    return all(shutil.which(name) or (beside / name).is_file() for name in CONSOLE_SCRIPTS)


def _is_checkout(folder: Path) -> bool:
    """Whether ``folder`` holds a source checkout's ``evaluate.py`` and ``scripts/`` (the README's commands)."""
    return (folder / "evaluate.py").is_file() and (folder / "scripts" / "summarize_run.py").is_file()


def commands_here(cwd: str | os.PathLike | None = None) -> Commands:
    """The :class:`Commands` that work from ``cwd`` (default: the current directory):

    1. the checkout's files when ``cwd`` holds ``evaluate.py`` and ``scripts/`` (the README's commands);
    2. else the console scripts with the installed package's configs (:func:`stapo.config.configs_dir`;
       ``stapo-eval --config configs/eval/X.yaml`` resolves there) when they are installed (on ``$PATH`` or beside
       this Python);
    3. else, when this package is a source checkout's (``python /path/to/train.py`` from another folder, with no
       console scripts installed), that checkout's files by absolute path (``python /path/to/evaluate.py``, which
       resolves ``configs/eval/X.yaml`` there too);
    4. else the console scripts (a wheel whose ``bin/`` is not on ``$PATH``: still their names).
    """
    here = Path(cwd) if cwd is not None else Path(".")
    if _is_checkout(here):
        return Commands(eval_dir=here / "configs" / "eval") if cwd is not None else Commands()

    shipped = configs_dir()
    eval_dir = (shipped / "eval") if shipped is not None else here / "configs" / "eval"
    repo = Path(__file__).resolve().parents[2]  # .../stapo/train/summary.py -> the checkout holding stapo/
    if not _console_scripts_installed() and _is_checkout(repo):
        return Commands(evaluate=f"python {shlex.quote(str(repo / 'evaluate.py'))}",
                        summarize=f"python {shlex.quote(str(repo / 'scripts' / 'summarize_run.py'))}",
                        compare=f"python {shlex.quote(str(repo / 'scripts' / 'compare.py'))}",
                        prepare_data=f"python {shlex.quote(str(repo / 'scripts' / 'prepare_data.py'))}",
                        eval_dir=eval_dir)
    return Commands(evaluate="stapo-eval", summarize="stapo-summarize", compare="stapo-compare",
                    prepare_data="stapo-prepare-data", eval_dir=eval_dir)


def end_of_run_text(rows: Sequence[dict[str, Any]], run_dir: str | os.PathLike, *, window: int = 5,
                    checkpoint: str | os.PathLike | None = None, wandb_mode: str = "disabled",
                    wandb_dirs: Sequence[str | os.PathLike] = (), eval_config: str | None = None,
                    evaluate_command: str | None = None, commands: Commands = Commands()) -> str:
    """train.py's end-of-run summary (plain text, a dozen lines).

    Args:
        rows: the run's ``metrics.jsonl`` rows (every launch's), in step order; only training rows
            (:func:`training_rows`) are counted as steps.
        run_dir: the run directory.
        window: steps averaged at each end (:func:`window_size`).
        checkpoint: the latest complete checkpoint folder, or None.
        wandb_mode: the W&B mode in use (``offline``: the sync command is printed).
        wandb_dirs: the run's W&B run folders (``<run_dir>/wandb/offline-run-*`` offline).
        eval_config: an evaluate.py config to suggest (``configs/eval/<family>.yaml``), or None.
        evaluate_command: the whole "evaluate" suggestion (:func:`evaluate_suggestion`); replaces the one made
            from ``eval_config``.
        commands: the command prefixes to print (:func:`commands_here`; default: the checkout's files).

    Returns:
        The text, lines joined with newlines (no trailing newline).
    """
    run = _rel(Path(run_dir))
    keys = ["critic/score/mean", "reward/grader/accuracy", "actor/entropy"]
    mask_key = masked_fraction_key(rows)
    keys += [mask_key] if mask_key else []
    keys += ["timing_s/step"]
    lines = []
    train = training_rows(rows)  # not the step-0 validation-only row of trainer.val_before_train
    if train:
        w, changes = start_end(train, keys, window)
        total_s = sum(r.get("timing_s/step") or 0.0 for r in train)
        lines.append(f"finished: {step_span(train)}, {total_s / 60:.1f} min of step time; start → end "
                     f"(means of {step_span(train[:w])} / {step_span(train[-w:])}):")
        width = max(len(f"{c.label} ({c.key})") for c in changes) if changes else 0
        lines += [f"  {f'{c.label} ({c.key})':<{width}}  {c.text()}" for c in changes]
    else:
        lines.append("finished: no training step was logged")
    lines.append("files:")
    lines.append(f"  metrics      {run}/metrics.jsonl")
    lines.append(f"  checkpoints  {run}/checkpoints" + (f" (latest: {Path(checkpoint).name})" if checkpoint else
                                                        " (none)"))
    if wandb_mode != "disabled" and wandb_dirs:
        where = f"{run}/wandb/offline-run-*" if wandb_mode == "offline" else _rel(Path(wandb_dirs[-1]))
        lines.append(f"  W&B          {where} ({wandb_mode}{': not uploaded yet' if wandb_mode == 'offline' else ''})")
    lines.append("next:")
    lines.append(f"  summarise    {commands.summarize} {shlex.quote(run)}")
    command = evaluate_command or (commands.evaluate + (f" --config {eval_config}" if eval_config else "")
                                   + f" --model {shlex.quote(run)} --all-checkpoints")
    lines.append(f"  evaluate     {command}")
    if wandb_mode == "offline" and wandb_dirs:
        lines.append(f"  sync         wandb sync {run}/wandb/offline-run-*")
    lines.append(f"  compare      {commands.compare} A=runs/eval/<label A> B=runs/eval/<label B>  "
                 f"(evaluation results of several runs)")
    return "\n".join(lines)


def eval_config_for(family: str | None, config_path: str | os.PathLike | None = None,
                    eval_dir: str | os.PathLike = "configs/eval") -> Path | None:
    """The evaluate.py config of a training config family: ``<eval_dir>/<family>.yaml`` (``cpu_smollm2``,
    ``tiny_test``), else, for a training config in a folder of ``configs/`` whose name starts the family
    (``configs/paper/qwen3_8b_stapo.yaml`` → family ``paper_qwen3_8b``), ``<eval_dir>/<folder>.yaml``
    (``paper.yaml``); None when neither file exists (paths relative to the current directory, as evaluate.py
    reads them)."""
    if not family:
        return None
    names = [family]
    folder = Path(config_path).parent.name if config_path else ""
    if folder and folder != "configs" and family.startswith(folder + "_"):
        names.append(folder)
    return next((p for p in (Path(eval_dir) / f"{n}.yaml" for n in names) if p.is_file()), None)


def missing_benchmarks(benchmarks: Sequence[str], root: str | os.PathLike | None,
                       custom: dict[str, Any] | None = None) -> list[str]:
    """The names of ``benchmarks`` whose data file is not there under the data root ``root`` (generated benchmarks
    such as ``arith_test`` and hub datasets have none: never missing). An unknown name or a missing root counts as
    missing (evaluate.py would refuse it)."""
    out = []
    for name in benchmarks:
        try:
            path = benchmark_file(root if root is not None else "data", str(name), custom)
        except Exception:  # noqa: BLE001 - unknown name, missing data root: evaluate.py would stop on it
            out.append(str(name))
            continue
        if path is not None and not Path(path).is_file():
            out.append(str(name))
    return out


def evaluate_suggestion(run_dir: str | os.PathLike, *, family: str | None,
                        config_path: str | os.PathLike | None = None, validation_benchmarks: Sequence[str] = (),
                        data_root: str | None = None, commands: Commands = Commands()) -> str:
    """The end-of-run "evaluate" suggestion: a command that evaluates every checkpoint of the run
    (``--all-checkpoints``) and does not fail on missing data.

    1. The config family's evaluate.py config (:func:`eval_config_for`; the family, not the W&B group, which in a
       study or a custom group names no config) when the data of all its benchmarks is there;
    2. else that config (or evaluate.py's default, the paper protocol, without one) on the training config's own
       validation benchmarks (``validation.benchmarks`` under ``data.root``) when their data is there;
    3. else the family config's command with what to pass: the benchmarks whose data is missing and how to get it
       (``python scripts/prepare_data.py --out <the config's data root>``), point at data elsewhere
       (``--data-root``) or choose others (``--benchmarks``).

    ``commands`` (:func:`commands_here`): the checkout's ``python evaluate.py`` and ``configs/eval`` (default), or,
    outside a checkout, ``stapo-eval`` (or ``python /path/to/evaluate.py``) and the installed package's configs,
    written ``configs/eval/X.yaml``.
    """
    run = shlex.quote(_rel(Path(run_dir)))
    found = eval_config_for(family, config_path, commands.eval_dir)
    eval_cfg = f"{commands.shown_eval_dir}/{found.name}" if found is not None else None
    base = commands.evaluate + (f" --config {eval_cfg}" if eval_cfg else "") + f" --model {run} --all-checkpoints"
    missing: list[str] = []
    if eval_cfg is not None:
        try:
            from stapo.evaluation.config import load_eval_config

            ecfg = load_eval_config(found)
            missing = missing_benchmarks(ecfg.data.benchmarks, ecfg.data.root, dict(ecfg.data.custom_benchmarks))
            root = ecfg.data.root
        except Exception as e:  # noqa: BLE001 - a config evaluate.py would refuse: say so instead
            return f"{base}  ({eval_cfg} does not load: {(str(e).splitlines() or [type(e).__name__])[0][:120]})"
        if not missing:
            return base
    val = [str(b) for b in validation_benchmarks]
    if val and not missing_benchmarks(val, data_root):
        return (f"{base} --benchmarks {' '.join(val)}"
                + (f" --data-root {shlex.quote(str(data_root))}" if data_root is not None else "")
                + "  (this config's validation benchmarks" + (f"; {eval_cfg}'s need data you do not have)"
                                                              if eval_cfg else f"; no {commands.shown_eval_dir}/"
                                                              f"{family}.yaml: evaluate.py's default settings, "
                                                              "the paper protocol, or pass --config)"))
    if eval_cfg is None:
        return (f"{base}  (no {commands.shown_eval_dir}/{family}.yaml: pass --config with an evaluate.py config "
                f"and --benchmarks with data you have; default: the paper protocol)")
    # prepare_data.py writes data/ unless told otherwise: name the config's root, or the data lands where the
    # command does not look
    out = f" --out {shlex.quote(str(root))}" if root is not None and Path(str(root)) != Path("data") else ""
    return (f"{base}  (needs data for {', '.join(missing)} under {root if root is not None else 'data'}: "
            f"{commands.prepare_data}{out}, or pass --data-root with a folder that has it, or --benchmarks with data "
            f"you have)")


def end_of_run_summary(run_dir: str | os.PathLike, *, wandb_mode: str = "disabled", family: str | None = None,
                       config_path: str | os.PathLike | None = None, validation_benchmarks: Sequence[str] = (),
                       data_root: str | None = None, window: int = 5) -> str:
    """:func:`end_of_run_text` of a run directory: reads ``metrics.jsonl`` (a torn last line is left out), finds
    the latest checkpoint and the W&B run folders (``<run_dir>/wandb/*-<id of wandb_run_id>``), and suggests an
    evaluation from the config family (:func:`evaluate_suggestion`; paths relative to the current directory)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    wandb_dirs = sorted((run_dir / "wandb").glob(f"*-{run_id}")) if run_id else []
    commands = commands_here()  # the checkout's files, or the console scripts outside one
    command = evaluate_suggestion(run_dir, family=family, config_path=config_path,
                                  validation_benchmarks=validation_benchmarks, data_root=data_root, commands=commands)
    return end_of_run_text(rows, run_dir, window=window, checkpoint=latest_checkpoint(run_dir / "checkpoints"),
                           wandb_mode=wandb_mode, wandb_dirs=wandb_dirs, evaluate_command=command,
                           commands=commands)

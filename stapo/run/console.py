"""What the console shows while a run trains: progress bars or plain step lines, and where the run writes.

Progress while training (``trainer.progress_bar``, :func:`use_progress_bars`): tqdm bars on a terminal; when the
output goes to a file (Slurm, ``nohup``, ``> log``) bars would write dozens of cursor-code lines per step, so
instead one plain line per step (:func:`step_line`). Either way the run folder and where W&B writes are printed at
start (:func:`start_lines`). The third-party libraries' own logs (quiet by default, all with ``--verbose``) are
:mod:`stapo.common.logs`; its functions are re-exported here for train.py / evaluate.py.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from stapo.common.logs import (
    HARMLESS_VLLM_WARNINGS,
    drop_rotary_reload_warning,
    is_verbose,
    quiet_libraries,
    set_verbose,
)
from stapo.core.metric_names import masked_fraction_key

__all__ = ["set_verbose", "is_verbose", "quiet_libraries", "drop_rotary_reload_warning", "HARMLESS_VLLM_WARNINGS",
           "use_progress_bars", "step_line", "STEP_LINE_KEYS", "start_lines"]


def use_progress_bars(setting: bool | str, streams: tuple[Any, ...] | None = None) -> bool:
    """Whether to draw tqdm progress bars: ``setting`` (``trainer.progress_bar``) when True / False; ``"auto"``:
    True only when every stream of ``streams`` (default ``sys.stdout`` and ``sys.stderr``: the step lines and the
    bars) is a terminal (``isatty()``; a stream without it, or a closed one, counts as not a terminal).

    Raises:
        ValueError: ``setting`` is neither a bool nor ``"auto"``.
    """
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"trainer.progress_bar must be true, false or auto, got {setting!r}")
    for stream in streams if streams is not None else (sys.stdout, sys.stderr):
        try:
            if not stream.isatty():
                return False
        except (AttributeError, ValueError):  # no isatty / a closed file
            return False
    return True


#: (metric key, label, format) of :func:`step_line`, in order; the masked fraction's key depends on the mask
#: (:func:`stapo.core.metric_names.masked_fraction_key`) and is added after ``actor/pg_clipfrac``.
STEP_LINE_KEYS: list[tuple[str, str, str]] = [
    ("critic/score/mean", "reward", "{:+.3f}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("actor/pg_clipfrac", "clipfrac", "{:.4f}"),
]


def step_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    """One plain line for a finished training step (no cursor codes), e.g.
    ``step 3/20 | reward +0.125 | entropy 1.234 | len 45.2 | clipfrac 0.0000 | masked 0.0045 | 41.2 s/step``.

    Args:
        step: the step just finished (1-based); total: ``trainer.total_steps``.
        metrics: the step's metrics (docs/metrics.md names): :data:`STEP_LINE_KEYS`, the mask's
            ``actor/<mask>/masked_frac`` (a fraction of the response tokens; left out for a method that masks
            nothing) and ``timing_s/step`` (seconds). A missing key is left out; a non-finite value prints as
            ``nan`` / ``inf``.
    """
    parts = [f"step {step}/{total}"]
    keys = list(STEP_LINE_KEYS)
    mask_key = masked_fraction_key([metrics])
    if mask_key is not None:
        keys.append((mask_key, "masked", "{:.4f}"))
    for key, label, fmt in keys:
        v = metrics.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            parts.append(f"{label} {fmt.format(v)}")
    seconds = metrics.get("timing_s/step")
    if isinstance(seconds, (int, float)):
        parts.append(f"{seconds:.1f} s/step")
    return " | ".join(parts)


def start_lines(run_dir: str | os.PathLike, *, mode: str, project: str | None = None, group: str | None = None,
                wandb_dir: str | os.PathLike | None = None, url: str | None = None) -> list[str]:
    """What train.py prints when a run starts: the run folder and where W&B writes.

    Args:
        run_dir: the run folder (metrics.jsonl, checkpoints, config.json).
        mode: the W&B mode the run actually got (``offline``, ``online``, ``disabled``; after a fallback).
        project, group: ``logging.project`` / ``logging.group``.
        wandb_dir: the W&B run's local folder (offline: what ``wandb sync`` uploads); url: the online run's page.

    Returns:
        Two lines: ``run folder: <run_dir>`` and ``W&B: <mode>, project <p>, group <g>`` followed by the online run's
        URL, or offline by ``; upload later with: wandb sync <wandb_dir>`` (``W&B: disabled ...`` when off).
    """
    lines = [f"run folder: {run_dir}"]
    if mode == "disabled":
        lines.append("W&B: disabled (logging.wandb_mode; metrics.jsonl holds every metric)")
        return lines
    text = f"W&B: {mode}, project {project}, group {group}"
    if mode == "online" and url:
        text += f", {url}"
    elif wandb_dir is not None:
        text += f"; upload later with: wandb sync {wandb_dir}" if mode == "offline" else f", files in {wandb_dir}"
    lines.append(text)
    return lines

"""A training step's samples: the completions table and the saved rollouts (docs/metrics.md#samples-and-rollouts).

Both are built from one list of **response records** (:func:`response_records`), one plain dict per response of
the step (JSON-ready: non-finite floats become ``None``):

    step, prompt_index (the prompt's index in the step's batch), prompt_id (its record id, e.g. ``synthetic/12``),
    sample (the response's index 0..G-1 within its group), prompt (text), gold, response (text),
    extracted_answer (what the reward function read; ``None``: no answer / not reported), reward, advantage (Â),
    finish_reason (``eos`` | ``length`` | ``boxed``), mask (the objective's token mask, e.g. ``s2t``), response_length,
    num_silenced, mean_p, mean_entropy — and with ``token_arrays``, per response token (n = response_length):
    token_ids [n], tokens [n] (each id decoded alone, special tokens kept), logprobs [n] (log p, nats),
    entropy [n] (H, nats), silenced [n] (1 = the token received no gradient under the step's mask).

p and H are the trainer's old-policy statistics of the step (:class:`~stapo.train.batch.StepBatch` ``old``: the
rollout policy recomputed in fp32 at the rollout temperature, :mod:`stapo.core.token_stats`), the values the mask
reads for the step's first mini-batch (later mini-batches with ``algorithm.mask_stats_source=current`` read the
then-current policy's). ``silenced`` is ``response_mask & ~keep``: for S2T exactly the tokens counted by
``actor/s2t/num_masked``; for a mask that keeps a subset (``top_entropy``) every token it dropped; none for ``none``.

- :func:`completions_table`: the W&B / ``tables.jsonl`` table ``completions`` (one incremental W&B table; its
  ``step`` column says which step a row is of).
- :func:`write_rollouts`: ``<run_dir>/rollouts/step_XXXXXX.jsonl.gz``, one record per line, written to a temporary
  file and renamed (a crash never leaves a torn file; a redone step replaces its file); :func:`read_rollouts`
  reads one back, :func:`drop_rollouts_after` removes a crashed run's files past the step a resume restarts from.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from stapo.run.preflight import write_error

__all__ = [
    "ROLLOUTS_DIR",
    "COMPLETIONS_TABLE",
    "COMPLETION_COLUMNS",
    "COMPLETIONS_MAX_ROWS",
    "RolloutFileError",
    "response_records",
    "completions_table",
    "rollouts_path",
    "write_rollouts",
    "read_rollouts",
    "saved_steps",
    "drop_rollouts_after",
]

ROLLOUTS_DIR = "rollouts"  # under the run directory
_FILE_RE = re.compile(r"^step_(\d+)\.jsonl\.gz$")
#: the completions table's columns (the record keys of the same names)
#: The name of the completions table (W&B key and ``tables.jsonl`` ``name``); it was ``completions/step_XXXXXX``, one
#: per step, before the incremental table.
COMPLETIONS_TABLE = "completions"
COMPLETION_COLUMNS = ("step", "prompt_index", "prompt_id", "sample", "prompt", "response", "extracted_answer",
                      "reward", "advantage", "num_silenced", "mean_p", "mean_entropy", "response_length",
                      "finish_reason")
#: at most this many rows per completions table (whole groups, the first prompts of the step)
COMPLETIONS_MAX_ROWS = 256


class RolloutFileError(ValueError):
    """A rollouts file (or folder) cannot be read: one line naming the file (and line) and what to do."""


def _num(x: float) -> float | None:
    """A JSON-safe float: 7 significant digits (fp32 holds about 7), ``None`` for NaN / ±inf."""
    return float(f"{x:.7g}") if math.isfinite(x) else None


def response_records(sb: Any, tokenizer: Any, step: int, token_mask: str,
                     prompt_indices: Sequence[int] | None = None, token_arrays: bool = True) -> list[dict[str, Any]]:
    """One record per response of a :class:`~stapo.train.batch.StepBatch` (this rank's rows, row order); the keys
    are listed in the module docstring.

    Args:
        sb: the step after its update: ``rollout`` (responses, rewards [B], advantages [B], ``extracted``,
            ``prompts``), ``old`` (logprobs / entropy [B, R] fp32, nats) and ``keep`` [B, R] bool.
        tokenizer: decodes the prompt, and each response token alone (``tokens``).
        step: the training step (1-based, as logged).
        token_mask: the objective's token mask name (recorded as ``mask``).
        prompt_indices: the index in the step's whole batch of each of this rank's prompts (``group`` → index;
            data-parallel ranks), or None (``prompt_index = group``).
        token_arrays: include the per-token arrays (the rollouts file; the completions table needs none).

    Returns:
        B dicts, JSON-serialisable. ``mean_p`` = mean over the response's tokens of exp(log p), ``mean_entropy`` =
        mean of H (nats); both ``None`` for an empty response.
    """
    ro = sb.rollout
    mask = ro.batch.response_mask.bool()  # [B, R]
    silenced = mask & ~sb.keep.bool()  # [B, R] tokens without gradient under the step's mask
    logp = sb.old.logprobs.float()  # [B, R] nats
    ent = sb.old.entropy.float()  # [B, R] nats
    n_tok = mask.sum(dim=1)  # [B]
    denom = n_tok.clamp(min=1).float()
    mean_p = torch.where(mask, logp.exp(), 0.0).sum(dim=1) / denom  # [B]
    mean_h = torch.where(mask, ent, 0.0).sum(dim=1) / denom  # [B]
    num_silenced = silenced.sum(dim=1)  # [B]
    prompts = ro.prompts or []
    records = []
    for b, r in enumerate(ro.responses):
        n = int(n_tok[b])
        prompt = prompts[r.group] if r.group < len(prompts) else None
        rec: dict[str, Any] = {
            "step": int(step),
            "prompt_index": int(prompt_indices[r.group]) if prompt_indices is not None else int(r.group),
            "prompt_id": prompt[2] if prompt is not None and len(prompt) > 2 else None,
            "sample": int(r.index),
            "prompt": tokenizer.decode(list(r.prompt_ids), skip_special_tokens=True),
            "gold": prompt[1] if prompt is not None else None,
            "response": r.text,
            "extracted_answer": ro.extracted[b] if ro.extracted is not None else None,
            "reward": _num(float(ro.rewards[b])),
            "advantage": _num(float(ro.advantages[b])),
            "finish_reason": r.finish_reason,
            "mask": token_mask,
            "response_length": n,
            "num_silenced": int(num_silenced[b]),
            "mean_p": _num(float(mean_p[b])) if n else None,
            "mean_entropy": _num(float(mean_h[b])) if n else None,
        }
        if token_arrays:
            ids = [int(i) for i in r.response_ids[:n]]
            rec["token_ids"] = ids
            rec["tokens"] = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False) if ids else []
            rec["logprobs"] = [_num(x) for x in logp[b, :n].tolist()]
            rec["entropy"] = [_num(x) for x in ent[b, :n].tolist()]
            rec["silenced"] = [int(x) for x in silenced[b, :n].tolist()]
        records.append(rec)
    return records


def completions_table(step: int, records: Sequence[dict[str, Any]], max_rows: int = COMPLETIONS_MAX_ROWS
                      ) -> tuple[str, list[str], list[list[Any]]]:
    """The step's completions table: one row per response (:data:`COMPLETION_COLUMNS`), in record order, cut to
    the whole groups of the first prompts that fit in ``max_rows`` (at least one group).

    Returns:
        ``(table name "completions", columns, rows)`` for :meth:`stapo.run.tracking.Tracker.log_table` (logged with
        ``incremental=True``: one W&B table under one key that grows by each logged step's rows).
    """
    sizes: dict[Any, int] = {}  # prompt_index → responses, in record order
    for rec in records:
        sizes[rec["prompt_index"]] = sizes.get(rec["prompt_index"], 0) + 1
    kept: set[Any] = set()
    total = 0
    for group, n in sizes.items():
        if kept and total + n > max_rows:
            break
        kept.add(group)
        total += n
    rows = [[rec.get(c) for c in COMPLETION_COLUMNS] for rec in records if rec["prompt_index"] in kept]
    return COMPLETIONS_TABLE, list(COMPLETION_COLUMNS), rows


def rollouts_path(run_dir: str | os.PathLike, step: int) -> Path:
    """``<run_dir>/rollouts/step_XXXXXX.jsonl.gz`` (6-digit step, as the checkpoints)."""
    return Path(run_dir) / ROLLOUTS_DIR / f"step_{step:06d}.jsonl.gz"


def write_rollouts(run_dir: str | os.PathLike, step: int, records: Sequence[dict[str, Any]]) -> Path:
    """Write the step's response records as gzip-compressed JSONL, atomically: a temporary file in the same folder,
    flushed and fsync'ed, then renamed over ``rollouts_path(run_dir, step)`` (an older file of the step is
    replaced whole). The gzip header carries no timestamp (same records → same bytes).

    Raises:
        OSError: the write failed (full disk, read-only folder): same errno, the message names the file; the
            temporary file is removed and an existing file of the step is left as it was.
        ValueError: a record holds a non-finite float (records from :func:`response_records` never do).
    """
    path = rollouts_path(run_dir, step)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
                for rec in records:
                    gz.write((json.dumps(rec, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8"))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(e, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_rollouts(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The response records of one rollouts file, in file order.

    Raises:
        RolloutFileError: the file is missing, not complete gzip, or a line is not a JSON object with an integer
            ``step`` (naming the file and the line).
    """
    path = Path(path)
    if not path.is_file():
        raise RolloutFileError(f"{path}: no such rollouts file")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise RolloutFileError(f"{path}: not a complete gzip file ({e}); rerun the step or delete the file") from None
    out = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise RolloutFileError(f"{path}: line {lineno} is not JSON ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise RolloutFileError(f"{path}: line {lineno} is not a response record (a JSON object with an integer "
                                   f"'step')")
        out.append(rec)
    return out


def saved_steps(run_dir: str | os.PathLike) -> list[int]:
    """The steps that have a rollouts file under ``<run_dir>/rollouts``, ascending (``[]`` when none)."""
    root = Path(run_dir) / ROLLOUTS_DIR
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _FILE_RE.match(p.name)))


def drop_rollouts_after(run_dir: str | os.PathLike, step: int) -> list[int]:
    """Remove the rollouts files of steps after ``step`` (a crashed run's steps that a resume redoes, or never
    reaches) and leftover temporary files. Returns the steps removed."""
    root = Path(run_dir) / ROLLOUTS_DIR
    if not root.is_dir():
        return []
    for tmp in root.glob("step_*.jsonl.gz.tmp"):
        tmp.unlink(missing_ok=True)
    dropped = [s for s in saved_steps(run_dir) if s > step]
    for s in dropped:
        rollouts_path(run_dir, s).unlink(missing_ok=True)
    return dropped

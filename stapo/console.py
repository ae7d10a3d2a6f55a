"""What the console shows: third-party libraries quiet by default, everything with ``train.py --verbose``.

Quiet (the default) means, set before the libraries are imported (:func:`quiet_libraries`; environment variables
already set by the user win):

* vLLM logs at WARNING (``VLLM_LOGGING_LEVEL``; its INFO lines describe the engine's configuration at start-up);
  its ``FutureWarning`` / ``DeprecationWarning`` lines are ignored;
* transformers logs errors only (``TRANSFORMERS_VERBOSITY``), torch's C++ log errors only (``TORCH_CPP_LOG_LEVEL``:
  e.g. the CPU worker's "NUMA binding" notice);
* vLLM's "RotaryEmbedding: Failed to load weights" warning, logged at every weight sync, is dropped
  (:func:`drop_rotary_reload_warning`: harmless, see there).

``--verbose`` (:func:`set_verbose`) leaves all of them as the libraries set them.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["set_verbose", "is_verbose", "quiet_libraries", "drop_rotary_reload_warning"]

_verbose = False


def set_verbose(verbose: bool) -> None:
    """``True``: leave the libraries' logging as they set it (train.py ``--verbose``); ``False``: quiet."""
    global _verbose
    _verbose = bool(verbose)


def is_verbose() -> bool:
    return _verbose


def quiet_libraries() -> None:
    """Unless verbose: vLLM at WARNING, transformers and torch's C++ log at ERROR, vLLM's future/deprecation
    warnings off (module doc). Environment variables take effect only for libraries imported afterwards, so call it
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


class _DropRotaryReload(logging.Filter):
    """Drops vLLM's ``"%s: Failed to load weights"`` record when the layer is a rotary embedding."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and isinstance(record.args, tuple)
                    and record.args and str(record.args[0]).endswith("RotaryEmbedding"))


_ROTARY_FILTER = _DropRotaryReload()
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

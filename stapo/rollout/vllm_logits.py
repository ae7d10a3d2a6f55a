"""A vLLM (v1) logits processor that masks the ids a padded embedding has beyond the tokenizer.

Imported only by :class:`stapo.rollout.vllm_backend.VLLMRolloutEngine` (it imports vllm). The limit is read
from the engine's model config, key ``stapo_vocab_size`` (written by the engine into the config it serves).
It is a batch-level operation (``logits[:, limit:] = -inf``) applied where vLLM applies ``allowed_token_ids``
— before temperature, top-p and the processed log-probs — at no per-request cost (a per-request
``allowed_token_ids`` list of ~150k ids costs a mask row fill and a validation loop for every request).
"""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

__all__ = ["MaskUnknownIdsLogitsProcessor"]


class MaskUnknownIdsLogitsProcessor(LogitsProcessor):
    """``logits[:, stapo_vocab_size:] = -inf`` for every request (no-op when the key is absent)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        hf_config = vllm_config.model_config.hf_config
        limit = getattr(hf_config, "stapo_vocab_size", None)
        self.limit = int(limit) if limit is not None else None

    def is_argmax_invariant(self) -> bool:
        return False  # it can change the argmax: applied to greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None  # stateless

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.limit is not None and logits.shape[-1] > self.limit:
            logits[:, self.limit:] = float("-inf")
        return logits

"""The rollout interface shared by the HF and vLLM backends.

A rollout engine samples ``G`` responses for each prompt from the *current* policy weights (the trainer pushes
them with :meth:`RolloutEngine.sync_weights` before each rollout step). What it returns per response is a
:class:`Response`. The engine's own log-probs (``Response.engine_logprobs``) are kept only to measure the
train/inference mismatch; the loss and the S2T mask always use the trainer's recomputation from logits / T in
fp32 (:func:`stapo.train.policy.policy_token_stats`).

Token ids the tokenizer does not know (rows of a padded embedding matrix, as in Qwen) are never sampled by
either backend: the HF backend masks logits ``>= vocab_size`` to −inf, the vLLM backend passes
``allowed_token_ids`` (see :func:`stapo.model.models.token_vocab_size`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

__all__ = ["Response", "RolloutEngine", "SamplingParams", "WAKE_TAGS", "check_prompts", "finish_reason_of",
           "group_seeds", "prompt_seeds", "resolve_stop_token_ids"]

#: What :meth:`RolloutEngine.wake_up` can restore separately (vLLM's ``LLM.wake_up(tags=...)``): the weights, then
#: (after the weight sync and freeing the trainer's cached memory) the KV cache.
WAKE_TAGS: tuple[str, ...] = ("weights", "kv_cache")


@dataclass
class SamplingParams:
    """How to sample.

    Attributes:
        temperature: softmax temperature T (> 0; 0 means greedy decoding).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        max_new_tokens: the most tokens a response may have (the EOS token included).
        seed: makes sampling reproducible (same prompts, G, params and weights → same responses);
            ``None`` draws from the engine's own random state.
        prompt_indices: with ``seed``: the index of each prompt in the GLOBAL batch, which selects its seed
            (:func:`prompt_seeds`); ``None`` = 0 … n−1. A data-parallel rank passes the global indices of its
            share, so a prompt gets the same samples however the batch is split over ranks.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    prompt_indices: Sequence[int] | None = None

    def seeds(self, num_prompts: int) -> list[int] | None:
        """The per-prompt seeds of a call with ``num_prompts`` prompts (None without ``seed``).

        Raises:
            ValueError: ``prompt_indices`` does not have ``num_prompts`` entries.
        """
        if self.seed is None:
            return None
        if self.prompt_indices is None:
            return group_seeds(self.seed, num_prompts)
        if len(self.prompt_indices) != num_prompts:
            raise ValueError(f"prompt_indices has {len(self.prompt_indices)} entries for {num_prompts} prompts")
        return prompt_seeds(self.seed, self.prompt_indices)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if self.seed is not None and (int(self.seed) != self.seed or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed}")
        if self.prompt_indices is not None and any(int(i) != i or i < 0 for i in self.prompt_indices):
            raise ValueError(f"prompt_indices must be integers >= 0, got {list(self.prompt_indices)}")


@dataclass
class Response:
    """One sampled response.

    Attributes:
        group: index of its prompt in the ``generate()`` call (a group's G responses are contiguous).
        prompt_ids: the prompt's token ids.
        response_ids: the sampled ids; ends with the EOS token when ``finish_reason == "eos"``.
        text: ``response_ids`` decoded with special tokens skipped.
        engine_logprobs: per response token (same length as ``response_ids``), the engine's natural-log
            probability of the sampled token under the *sampling* distribution (logits / T, top-p applied,
            unknown ids masked); ``None`` where the engine did not report them.
        finish_reason: ``"eos"`` (stopped on a stop token) or ``"length"`` (hit ``max_new_tokens``); ``"boxed"``:
            cut after its first complete ``\\boxed{}`` by ``rollout.stop_at_first_boxed``
            (:func:`stapo.rollout.boxed_cut.cut_at_first_boxed`; the engines themselves never return it).
    """

    group: int
    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    engine_logprobs: list[float] | None
    finish_reason: Literal["eos", "length", "boxed"]
    index: int = field(default=0)  # position of the response within its group (0..G-1)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout backend (:class:`~stapo.rollout.hf.HFRolloutEngine`,
    :class:`~stapo.rollout.vllm_backend.VLLMRolloutEngine`)."""

    def generate(self, prompts: list[list[int]], group_size: int, sampling: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[Response]:
        """``len(prompts) * group_size`` responses; prompt ``i``'s group is ``[i*G:(i+1)*G]``. ``progress(n)``,
        when given, is called as responses finish with how many just did (the calls add up to the total; an
        engine may report them all at the end)."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (in place, no disk)."""
        ...

    def sleep(self, level: int | None = None) -> None:
        """Free the engine's accelerator memory while the trainer computes (no-op where unsupported).

        ``level`` (vLLM's sleep levels): 1 = the weights move to host memory, the KV cache is dropped; 2 = both are
        dropped, so the caller must :meth:`sync_weights` before the next :meth:`generate` (what the trainer does
        every step); ``None`` = the engine's default. The trainer calls an engine whose ``sleep`` takes no
        ``level`` without it."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`sleep` for the memory named by ``tags`` (:data:`WAKE_TAGS`: ``"weights"``, ``"kv_cache"``;
        vLLM's tags), ``None`` = all of it; no-op for memory that is not asleep or where unsupported. The trainer
        wakes in stages (weights → :meth:`sync_weights` → KV cache) and calls an engine whose ``wake_up`` takes no
        ``tags`` once, without them."""
        ...

    def close(self) -> None:
        """Release what the engine holds (processes, memory, temporary files); the engine is unusable after."""
        ...


def check_prompts(prompts: Sequence[Sequence[int]], group_size: int, vocab_rows: int | None = None) -> None:
    """Validate ``generate()`` inputs; raise ``ValueError``/``TypeError`` naming the offending prompt."""
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise TypeError(f"prompt {i} must be a list of token ids, got {type(p).__name__} (tokenize it first)")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        lo, hi = min(p), max(p)
        if lo < 0 or (vocab_rows is not None and hi >= vocab_rows):
            raise ValueError(f"prompt {i} has token id out of range [0, {vocab_rows}): min {lo}, max {hi}")


def resolve_stop_token_ids(tokenizer, model=None, extra: Sequence[int] | None = None) -> list[int]:
    """The ids that end a response: the tokenizer's eos, the model's ``generation_config.eos_token_id`` (int
    or list) and ``extra``; sorted, de-duplicated.

    Raises:
        ValueError: none is found (a response could then never finish with ``"eos"``).
    """
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None) if model is not None else None
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids.update(int(e) for e in ([eos] if isinstance(eos, int) else eos))
    if extra:
        ids.update(int(e) for e in extra)
    if not ids:
        raise ValueError("no stop token: the tokenizer has no eos_token_id and none was given (stop_token_ids=)")
    return sorted(ids)


def finish_reason_of(response_ids: Sequence[int], stop_ids: set[int] | frozenset[int]) -> Literal["eos", "length"]:
    """``"eos"`` when the last id is a stop id, else ``"length"``."""
    return "eos" if len(response_ids) > 0 and response_ids[-1] in stop_ids else "length"


def group_seeds(seed: int, num_prompts: int) -> list[int]:
    """Per-prompt seeds derived from one call seed (numpy ``SeedSequence([seed, i])``, 31-bit).

    Independent streams for every (call seed, prompt index); vLLM derives the G samples' seeds of a request
    from its seed (``seed + j``), so neighbouring prompts must not get neighbouring seeds.
    """
    return prompt_seeds(seed, range(num_prompts))


def prompt_seeds(seed: int, indices: Sequence[int]) -> list[int]:
    """The seeds of the prompts with global indices ``indices``: ``prompt_seeds(s, range(n)) == group_seeds(s, n)``.

    Seed of prompt i = ``SeedSequence([seed, i]).generate_state(1, uint32)[0] >> 1`` (31-bit).
    """
    return [int(np.random.SeedSequence([int(seed), int(i)]).generate_state(1, np.uint32)[0] >> 1)
            for i in indices]

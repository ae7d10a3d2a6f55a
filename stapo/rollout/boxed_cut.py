"""``rollout.stop_at_first_boxed``: end each response at its first complete ``\\boxed{...}``.

The cut is made on the response's token list, after generation and before the reward and the batch
(``Trainer._generate``): a response is cut right after the token whose text closes its first complete box (that
token is kept whole, e.g. SmolLM2's ``"}."``), so the tokens after it (the rest of the text, a second box, the EOS
token) are in neither the loss nor any token statistic, for every objective alike; the reward grades the text up to
the cut. The engines are untouched and both decode ``Response.text`` the same way
(``tokenizer.decode(ids, skip_special_tokens=True)``), so the HF and vLLM backends cut identically. A response
without a complete box is kept whole.

Not from the paper (docs/method.md#word-problem-task): it keeps post-answer text out of the study's statistics.
Generation itself is not stopped early (the engines still sample up to their stop token or the cap).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from stapo.rollout.base import Response
from stapo.tasks.boxed import first_boxed_end

__all__ = ["boxed_cut_length", "cut_at_first_boxed", "cut_responses_at_first_boxed"]


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def boxed_cut_length(response_ids: Sequence[int], tokenizer: Any) -> int | None:
    """The fewest leading tokens whose decoded text holds the first complete ``\\boxed{...}`` of the response.

    Args:
        response_ids: the sampled ids.
        tokenizer: the policy's tokenizer (``decode(ids, skip_special_tokens=True)``, as the engines decode).

    Returns:
        ``k`` with ``1 <= k <= len(response_ids)`` (keep ``response_ids[:k]``), or ``None`` when the decoded
        response has no complete first box. Found by bisection: once a prefix holds a complete box, every longer
        prefix does too (decoding a longer prefix changes the text only after the last complete character).
    """
    ids = list(response_ids)
    if first_boxed_end(_decode(tokenizer, ids)) is None:
        return None
    lo, hi = 1, len(ids)  # the answer is in [lo, hi]; hi holds a complete box
    while lo < hi:
        mid = (lo + hi) // 2
        if first_boxed_end(_decode(tokenizer, ids[:mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    return hi


def cut_at_first_boxed(response: Response, tokenizer: Any) -> Response:
    """``response`` ending at its first complete ``\\boxed{...}`` (:func:`boxed_cut_length`).

    Returns:
        A new :class:`~stapo.rollout.base.Response` with ``response_ids`` and ``engine_logprobs`` cut to the first
        ``k`` tokens, ``text`` their decoding and ``finish_reason="boxed"``; the same object when the response has
        no complete box.
    """
    k = boxed_cut_length(response.response_ids, tokenizer)
    if k is None:
        return response
    ids = list(response.response_ids[:k])
    logprobs = None if response.engine_logprobs is None else list(response.engine_logprobs[:k])
    return dataclasses.replace(response, response_ids=ids, text=_decode(tokenizer, ids), engine_logprobs=logprobs,
                               finish_reason="boxed")


def cut_responses_at_first_boxed(responses: Sequence[Response], tokenizer: Any) -> list[Response]:
    """:func:`cut_at_first_boxed` for each response (order kept)."""
    return [cut_at_first_boxed(r, tokenizer) for r in responses]

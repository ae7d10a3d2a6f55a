"""Trainer-side forward: collate rollout responses into tensors, and recompute the response tokens'
log-probs / entropies / collision probabilities from the policy's logits / T in fp32.

docs/method.md#token-statistics: p_{i,t} and H_{i,t} come from logits / T in fp32 — always recomputed here, never taken
from the
rollout engine (whose log-probs only measure the train/inference mismatch). docs/method.md#pitfalls: log-probs and
entropy use
the rollout temperature; logits of padded vocabulary rows are excluded (they are never sampled).

Layout of a :class:`RolloutBatch` (B rows, P prompt columns, R response columns)::

    input_ids  = [ pad … pad  prompt_ids | response_ids  pad … pad ]      # [B, P+R]
                  left-padded to P         right-padded to R

so the response token ``j`` of every row sits at column ``P + j`` and is predicted by the logits at column
``P + j − 1``. Position ids count real tokens only (0 at the first prompt token), so a left-padded row gives
the same logits as the row alone.

That padded layout is how a batch is stored. A forward may lay its rows out differently
(``actor.use_remove_padding``; :func:`forward_layout`, :func:`layout_inputs`;
docs/scaling.md#padding-free-micro-batches):

* ``padded`` — the stored layout with its attention mask (the default). With any padding transformers builds a
  dense [b, 1, L, L] mask, so SDPA cannot take its flash kernel.
* ``trailing`` — each row's prompt ‖ response from column 0, padding only at the end, no attention mask and
  position ids 0 … L−1: causal attention hides the trailing pads from every real token, and transformers passes
  SDPA ``is_causal=True`` (its flash kernel) instead of a mask. For ``sdpa`` and ``eager``.
* ``packed`` — the rows concatenated into one [1, T] sequence (T = Σ prompt + response tokens), position ids
  restarting at 0 for each row, no attention mask: transformers' flash-attention path derives ``cu_seqlens``
  from the position ids (varlen kernel, no padding at all). For ``flash_attention_*``. (With ``sdpa`` / ``eager``
  transformers detects the packing too but builds a dense block-diagonal [1, 1, T, T] mask: correct, used by the
  tests, not by a run.)

Either way the per-token results are the padded forward's up to float rounding (tests/test_packing.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from stapo.core.token_stats import TokenStats, token_stats
from stapo.model.lm_head import TokenStatsRequest, forward_token_stats
from stapo.rollout.base import Response

__all__ = ["RolloutBatch", "collate_responses", "policy_hidden", "policy_logits", "policy_token_stats",
           "shared_prompt_logits", "check_fused_head", "policy_decoder", "LAYOUTS", "ForwardInputs", "forward_layout",
           "layout_inputs"]

#: The forward layouts of :func:`layout_inputs` (see the module docstring).
LAYOUTS = ("padded", "trailing", "packed")


@dataclass
class RolloutBatch:
    """What flows from the rollout to the update (see the module docstring for the layout).

    Attributes:
        input_ids: [B, P+R] int64, left-padded prompt ‖ right-padded response.
        attention_mask: [B, P+R] int64, 1 on real tokens.
        position_ids: [B, P+R] int64, ``cumsum(attention_mask) − 1`` clamped at 0.
        response_ids: [B, R] int64, the response tokens (pad id where ``response_mask`` is False).
        response_mask: [B, R] bool, True on response tokens (EOS included).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor

    @property
    def prompt_width(self) -> int:
        """P, the number of prompt columns."""
        return int(self.input_ids.shape[1] - self.response_ids.shape[1])

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, idx: torch.Tensor | Sequence[int] | slice) -> "RolloutBatch":
        """Rows ``idx`` (int index tensor / list, or a slice) as a new batch, in that order; columns unchanged.

        Raises:
            TypeError: a boolean or floating index (use ``mask.nonzero().squeeze(1)`` for a mask).
        """
        if isinstance(idx, slice):
            return dataclasses.replace(self, **{f.name: getattr(self, f.name)[idx] for f in dataclasses.fields(self)})
        idx = torch.as_tensor(idx)
        if idx.dtype == torch.bool or idx.dtype.is_floating_point:
            raise TypeError(f"select() takes integer row indices, got dtype {idx.dtype}")
        idx = idx.to(device=self.input_ids.device, dtype=torch.long).reshape(-1)
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).index_select(0, idx)
                                            for f in dataclasses.fields(self)})

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """The same batch on ``device``."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    def trim(self) -> "RolloutBatch":
        """Drop all-padding columns: prompt columns left of every row's prompt, response columns right of
        every row's response (keeps at least one response column). Values are unchanged."""
        P = self.prompt_width
        lengths = self.response_mask.sum(dim=1)
        r = max(int(lengths.max()) if lengths.numel() else 0, 1)
        present = self.attention_mask[:, :P].bool().any(dim=0)  # [P]
        left = int(present.nonzero()[0, 0]) if bool(present.any()) else P
        left = min(left, P - 1) if P > 0 else 0  # keep one prompt column (the first response's predictor)
        return RolloutBatch(
            input_ids=self.input_ids[:, left:P + r], attention_mask=self.attention_mask[:, left:P + r],
            position_ids=self.position_ids[:, left:P + r], response_ids=self.response_ids[:, :r],
            response_mask=self.response_mask[:, :r])


def collate_responses(responses: Sequence[Response], pad_token_id: int) -> RolloutBatch:
    """Stack responses into a :class:`RolloutBatch` (row i = ``responses[i]``, order kept).

    Args:
        responses: from ``RolloutEngine.generate`` (any order; each needs a non-empty ``prompt_ids``).
        pad_token_id: the id written in padding positions (its value never matters: padding is masked).

    Returns:
        A batch with P = longest prompt, R = longest response (at least 1).

    Raises:
        ValueError: no responses, or a response with an empty prompt.
    """
    if len(responses) == 0:
        raise ValueError("collate_responses: no responses")
    B = len(responses)
    P = max(len(r.prompt_ids) for r in responses)
    R = max(max(len(r.response_ids) for r in responses), 1)
    input_ids = torch.full((B, P + R), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    response_ids = torch.full((B, R), int(pad_token_id), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.bool)
    for i, r in enumerate(responses):
        p, n = len(r.prompt_ids), len(r.response_ids)
        if p == 0:
            raise ValueError(f"response {i} has an empty prompt (the first response token needs a predictor)")
        input_ids[i, P - p:P] = torch.as_tensor(r.prompt_ids, dtype=torch.long)
        attention_mask[i, P - p:P + n] = 1
        if n:
            ids = torch.as_tensor(r.response_ids, dtype=torch.long)
            input_ids[i, P:P + n] = ids
            response_ids[i, :n] = ids
            response_mask[i, :n] = True
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
    return RolloutBatch(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        response_ids=response_ids, response_mask=response_mask)


def forward_layout(use_remove_padding: bool, attn_implementation: str) -> str:
    """The layout of the trainer's forwards (one of :data:`LAYOUTS`; see the module docstring).

    ``actor.use_remove_padding=false`` → ``padded``. Otherwise by ``model.attn_implementation``:
    ``flash_attention_2`` / ``_3`` / ``_4`` → ``packed`` (transformers' varlen flash path reads ``cu_seqlens``
    from the restarting position ids: no padding, no mask); every other implementation (``sdpa``, ``eager``) →
    ``trailing`` (no mask: SDPA gets ``is_causal=True`` and may take its flash kernel; packing would make
    transformers build a dense block-diagonal [1, 1, T, T] mask over T = Σ row lengths instead).
    Source: transformers 5.19 ``masking_utils.find_packed_sequence_indices`` / ``_ignore_causal_mask_sdpa`` and
    ``modeling_flash_attention_utils._is_packed_sequence``; verl's ``use_remove_padding``.
    """
    if not use_remove_padding:
        return "padded"
    return "packed" if str(attn_implementation).startswith("flash_attention") else "trailing"


@dataclass
class ForwardInputs:
    """One forward's model inputs in a padding-free layout, and where its outputs go (:func:`layout_inputs`).

    Attributes:
        layout: ``"trailing"`` or ``"packed"``.
        input_ids: [N, L] int64 — trailing: N = b rows, L = the longest row, each row's prompt ‖ response from
            column 0, then pad id 0; packed: N = 1, L = T = Σ row lengths, the rows one after another.
        position_ids: [N, L] int64 — trailing: 0 … L−1 in every row (the pads continue the count, so transformers
            sees no packing); packed: 0 … len_i − 1 for each row.
        positions: [K'] int64 flat index (row-major) into the N·L positions: the position whose output predicts
            response token k, where k runs over ``response_mask``'s True entries in row-major order (row 0's
            tokens 0 … n_0 − 1, then row 1's …). K' = max(K, 1): with no response token one dummy position 0.
        targets: [K'] int64 the response token ids (0 for the dummy).
        keep_cols: [C] int64 the columns the logits path keeps (``logits_to_keep``): packed the K' positions
            (C = K'); trailing the columns from the first to the last predicting column of any row.
        kept: [K'] int64 index into the N·C kept outputs (row-major) of token k.
        response_mask: [b, r] bool, the batch's (where :meth:`scatter` writes).
        num_tokens: K, the real response tokens (0 when no row has one).
    """

    layout: str
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    keep_cols: torch.Tensor
    kept: torch.Tensor
    response_mask: torch.Tensor
    num_tokens: int

    def model_kwargs(self) -> dict:
        """The forward's keyword arguments: ids, position ids, no attention mask, no KV cache (a cache would make
        transformers skip its packed-sequence detection)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                "use_cache": False}

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[K'] per-token values → [b, r] in the batch's layout, 0 where ``response_mask`` is False
        (differentiable)."""
        out = torch.zeros(self.response_mask.shape, dtype=values.dtype, device=values.device)  # [b, r]
        return out.masked_scatter(self.response_mask.to(values.device), values[:self.num_tokens])


def layout_inputs(batch: RolloutBatch, layout: str) -> ForwardInputs:
    """Lay the rows of ``batch`` (any ``select``-ed / ``trim``-med slice, on any device) out for one forward
    without left padding or attention mask (see the module docstring; per-token outputs equal the padded
    forward's up to float rounding).

    Example (rows ``[5 6 7 | 9 2]`` and ``[8 | 13 2 4]``, ``|`` between prompt and response):
    packed ``input_ids = [[5, 6, 7, 9, 2, 8, 13, 2, 4]]``, ``position_ids = [[0, 1, 2, 3, 4, 0, 1, 2, 3]]``,
    ``positions = [2, 3, 5, 6, 7]`` (response token 9 is predicted by the output at 2, …, token 4 by the one at 7);
    trailing ``input_ids = [[5, 6, 7, 9, 2], [8, 13, 2, 4, 0]]``, ``positions = [2, 3, 5, 6, 7]`` (row 1's
    start at 5 = 1·L), ``keep_cols = [0, 1, 2, 3]``.

    Raises:
        ValueError: an unknown layout (``padded`` has no :class:`ForwardInputs`: it is the batch itself), or a
            batch without a prompt column.
    """
    if layout not in ("trailing", "packed"):
        raise ValueError(f"layout_inputs: layout must be 'trailing' or 'packed', got {layout!r}")
    P = batch.prompt_width
    if P < 1:
        raise ValueError("the batch has no prompt column: the first response token has no predictor")
    dev = batch.input_ids.device
    real = batch.attention_mask.bool()  # [b, P+R] real tokens
    lengths = real.sum(dim=1)  # [b] prompt + response tokens
    pos = real.long().cumsum(dim=1) - 1  # [b, P+R] each real token's index in its row (0 at the first prompt token)
    rmask = batch.response_mask.bool()  # [b, r]
    rows_k = rmask.nonzero(as_tuple=True)[0]  # [K] row of response token k (row-major)
    q = pos[:, P:][rmask] - 1  # [K] index in its row of the token predicting response token k
    targets = batch.response_ids[rmask]  # [K]
    K = int(q.numel())
    b = int(lengths.shape[0])
    if layout == "packed":
        offsets = lengths.cumsum(0) - lengths  # [b] first position of each row
        positions = offsets[rows_k] + q  # [K], strictly increasing
        input_ids = batch.input_ids[real].unsqueeze(0)  # [1, T]
        position_ids = pos[real].unsqueeze(0)  # [1, T]
    else:
        L = int(lengths.max())
        r_idx, c_idx = real.nonzero(as_tuple=True)  # [T] each real token's row and padded column
        input_ids = torch.zeros((b, L), dtype=torch.long, device=dev)  # [b, L], pad id 0 (never attended to)
        input_ids[r_idx, pos[r_idx, c_idx]] = batch.input_ids[r_idx, c_idx]
        position_ids = torch.arange(L, device=dev).repeat(b, 1)  # [b, L]
        positions = rows_k * L + q  # [K]
    if K == 0:  # no response token: one dummy output keeps the forward (a collective under FSDP2) and its graph
        positions = torch.zeros(1, dtype=torch.long, device=dev)
        targets = torch.zeros(1, dtype=torch.long, device=dev)
        rows_k, q = positions, positions
    if layout == "packed":
        keep_cols, kept = positions, torch.arange(positions.numel(), device=dev)  # [K'], [K']
    else:
        c0, c1 = int(q.min()), int(q.max())
        keep_cols = torch.arange(c0, c1 + 1, device=dev)  # [C]
        kept = rows_k * (c1 - c0 + 1) + (q - c0)  # [K'] into [b·C]
    return ForwardInputs(layout=layout, input_ids=input_ids, position_ids=position_ids, positions=positions,
                         targets=targets.long(), keep_cols=keep_cols, kept=kept, response_mask=rmask, num_tokens=K)


def _run(model: torch.nn.Module, hidden: bool, keep: int | None, head=None, **kw):
    """One forward → (the last ``keep`` positions' logits [B, keep, V] or, with ``hidden``, final hidden states
    [B, keep, d]; the KV cache when ``use_cache``). ``keep=None``: every position. With ``head`` (a
    :class:`stapo.model.lm_head.TokenStatsRequest`) the hidden states come from the model's own forward
    (:func:`stapo.model.lm_head.forward_token_stats`: inside FSDP2's root forward) instead of the decoder called
    alone."""
    if head is not None:
        out = forward_token_stats(model, head.hidden_only(), keep=keep, **kw)
        return out.hidden, out.past_key_values
    if hidden:
        out = policy_decoder(model)(**kw)
        h = out.last_hidden_state  # [B, L, d], after the final norm
        return (h if keep is None else h[:, -keep:]), out.past_key_values
    out = model(**kw, **({} if keep is None else {"logits_to_keep": keep}))
    return out.logits, out.past_key_values


def policy_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model's decoder (the causal LM without its output embedding): ``get_decoder()`` or ``.model``."""
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    if dec is None or dec is model:
        dec = getattr(model, "model", None)
    if dec is None:
        raise ValueError(f"{type(model).__name__} has no decoder (get_decoder() / .model): actor.lm_head=fused "
                         "needs the final hidden states")
    return dec


def check_fused_head(model: torch.nn.Module) -> torch.Tensor:
    """The output embedding [V_rows, d] of an HF causal LM whose logits are exactly ``hidden @ weightᵀ``
    (what :func:`stapo.model.lm_head.lm_head_token_stats` computes).

    Under FSDP2 the returned weight is the root's sharded DTensor (its ``shape`` is the full one); the fused head
    itself runs inside the root module's forward (:func:`stapo.model.lm_head.forward_token_stats`), where it is whole.

    Raises:
        ValueError: the model has no plain output embedding (a bias, or a logit scale / soft-cap in its
            config, e.g. Gemma's ``final_logit_softcapping``).
    """
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"{type(model).__name__} has no output embedding: actor.lm_head=fused needs one")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s output embedding has a bias: use actor.lm_head=logits")
    cfg = getattr(model, "config", None)
    for key, neutral in (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0)):
        v = getattr(cfg, key, neutral)
        if v is not None and v != neutral:
            raise ValueError(f"{type(model).__name__} scales its logits (config.{key}={v}): use actor.lm_head=logits")
    return head.weight


def _fused_request(model: torch.nn.Module, targets: torch.Tensor, temperature: float, vocab_size: int | None,
                   entropy_grad: bool, backend: str):
    """The :class:`stapo.model.lm_head.TokenStatsRequest` of ``actor.lm_head=fused`` for ``targets`` (on the model's
    device): the head's GEMMs in the autocast dtype when autocast is on, the real vocabulary ``vocab_size``.

    Raises:
        ValueError: the model's logits are not ``hidden @ Wᵀ`` (:func:`check_fused_head`).
    """
    weight = check_fused_head(model)  # [V_rows, d] (FSDP2: a DTensor; only its full shape is read)
    dev = targets.device
    cdtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None
    vocab = vocab_size if vocab_size is not None and vocab_size < weight.shape[0] else None
    return TokenStatsRequest(targets, temperature, vocab_size=vocab, entropy_grad=entropy_grad, compute_dtype=cdtype,
                             backend=backend)


def _response_states(model: torch.nn.Module, batch: RolloutBatch, share_prompt: bool, hidden: bool, head=None):
    """[B, R, V] logits (or [B, R, d] final hidden states) at the columns ``P−1 … P+R−2``, which predict the
    response tokens; see :func:`policy_logits` and :func:`shared_prompt_logits`.

    With ``head`` (a :class:`stapo.model.lm_head.TokenStatsRequest` whose targets are [B, R]): the response tokens'
    statistics instead, computed inside the model's forward by the last pass from exactly those [B, R, d] hidden
    states (:func:`stapo.model.lm_head.forward_token_stats`) → a :class:`stapo.model.lm_head.HeadOutput` with [B, R]
    fields."""
    B, R = batch.response_ids.shape
    P = batch.prompt_width
    if P < 1:
        raise ValueError("the batch has no prompt column: the first response token has no predictor")
    if share_prompt:
        key = torch.cat([batch.input_ids[:, :P], batch.attention_mask[:, :P]], dim=1)  # [B, 2P]
        unique, inverse = torch.unique(key, dim=0, return_inverse=True)  # [U, 2P], [B] row → its prompt
        U = unique.shape[0]
        if U < B:
            rows = torch.arange(B, device=inverse.device)
            first = torch.full((U,), B, dtype=torch.long, device=inverse.device).scatter_reduce(
                0, inverse, rows, reduce="amin")  # [U] a representative row of each prompt
            # 1. prompt pass: [U, P] → cache of P positions, the last prompt column's output [U, 1, ·]
            prompt_kw = dict(input_ids=batch.input_ids[first, :P], attention_mask=batch.attention_mask[first, :P],
                             position_ids=batch.position_ids[first, :P], use_cache=True)
            if head is not None and R == 1:  # the prompt pass is the only one: the head runs in it
                return forward_token_stats(model, head, keep=1, rows=inverse, **prompt_kw)  # [B, 1] fields
            out, cache = _run(model, hidden, 1, head, **prompt_kw)
            first_out = out.index_select(0, inverse)  # [B, 1, ·]
            if R == 1:
                return first_out
            # 2. gather each row's prompt cache
            cache.batch_select_indices(inverse)  # every layer's keys/values: [U, h, P, d] → [B, h, P, d]
            # 3. response pass: tokens 0 … R−2 predict tokens 1 … R−1
            response_kw = dict(input_ids=batch.input_ids[:, P:P + R - 1],
                               attention_mask=batch.attention_mask[:, :P + R - 1],
                               position_ids=batch.position_ids[:, P:P + R - 1], past_key_values=cache, use_cache=True)
            if head is not None:  # the head on first_out ‖ this pass's states [B, R, d], inside this forward
                return forward_token_stats(model, head, prefix=first_out, **response_kw)  # [B, R] fields
            out, _ = _run(model, hidden, None, **response_kw)
            return torch.cat([first_out, out], dim=1)  # [B, R, ·]
    plain_kw = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                    use_cache=False)
    if head is not None:  # the states at columns P−1 … P+R−2 (the last R+1 but one), inside the forward
        return forward_token_stats(model, head, keep=slice(-(R + 1), -1), **plain_kw)  # [B, R] fields
    out, _ = _run(model, hidden, R + 1, **plain_kw)
    return out[:, :-1, :]  # [B, R, ·]


def policy_logits(model: torch.nn.Module, batch: RolloutBatch, *, share_prompt: bool = False) -> torch.Tensor:
    """Logits predicting the response tokens: [B, R, V] in the model's dtype (the columns ``P−1 … P+R−2``).

    Only the last R+1 positions go through the LM head (``logits_to_keep``), so prompt positions cost no
    [·, V] logits.

    Args:
        model: an HF causal LM.
        batch: a :class:`RolloutBatch` on the model's device.
        share_prompt: run each distinct prompt of the batch through the model once and let its rows attend to
            that one key/value cache (:func:`shared_prompt_logits`) — the G responses of a GRPO group share
            their prompt, so the prompt's tokens are computed once per group instead of G times. Same values
            (up to float rounding) and same gradients as the plain forward.

    Raises:
        ValueError: the batch has no prompt column.
    """
    return _response_states(model, batch, share_prompt, hidden=False)


def policy_hidden(model: torch.nn.Module, batch: RolloutBatch, *, share_prompt: bool = False) -> torch.Tensor:
    """Final hidden states (after the last norm) at the positions that predict the response tokens:
    [B, R, d] — :func:`policy_logits` without the output embedding (``logits = hidden @ Wᵀ``), for the fused
    LM head (:func:`stapo.model.lm_head.lm_head_token_stats`). Same arguments and errors as :func:`policy_logits`."""
    return _response_states(model, batch, share_prompt, hidden=True)


def shared_prompt_logits(model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """:func:`policy_logits` computing each distinct prompt once (prefix sharing across a group's responses).

    Rows whose prompt columns (ids and attention mask) are identical share one prompt forward:

        1. prompt pass on the U distinct prompts ``[U, P]`` with a KV cache; its last position's logits predict
           the first response token;
        2. the cache rows are gathered for the B rows (``index_select`` — differentiable, so each prompt's
           gradient is the sum over the rows that attend to it);
        3. response pass on the response tokens ``0 … R−2`` ``[B, R−1]`` attending to the gathered cache, with
           position ids continuing the prompt's.

    Worked example (GRPO, 2 prompts × G = 8, prompt 95 tokens, responses ≤ 128): the plain forward runs
    16 × (95 + 128) = 3,568 token positions, this one 2 × 95 + 16 × 127 = 2,222.

    Returns:
        [B, R, V] logits in the model's dtype (a fresh tensor: the prompt pass's last logits ‖ the response pass's).
        If no two rows share a prompt, the plain forward is used.

    Raises:
        ValueError: the batch has no prompt column.
    """
    return _response_states(model, batch, True, hidden=False)


def policy_token_stats(model: torch.nn.Module, batch: RolloutBatch, temperature: float, *,
                       entropy_grad: bool = False, vocab_size: int | None = None, backend: str = "auto",
                       chunk_size: int | None = None, share_prompt: bool = False, lm_head: str = "logits",
                       layout: str = "padded"):
    """Response tokens' log-probs, entropies and collision probabilities under ``model`` at ``temperature``.

    One forward pass (gradients flow if enabled by the caller; under the caller's ``torch.autocast`` the logits
    come out in bf16), then :func:`stapo.core.token_stats.token_stats` on the response logits / T in fp32, outside
    autocast — or, with ``lm_head="fused"``, the LM head and the statistics in one tiled pass.

    Args:
        model: an HF causal LM (``model(input_ids, attention_mask, position_ids, logits_to_keep=)``).
        batch: a :class:`RolloutBatch` (or a ``select``-ed / ``trim``-med slice) on the model's device.
        temperature: the rollout temperature T > 0.
        entropy_grad: make ``entropy`` differentiable (see ``token_stats``).
        vocab_size: number of real token ids; logit columns ``>= vocab_size`` (padded embedding rows, never
            sampled) are left out of the softmax. Default: ``model.config.stapo_vocab_size`` when set
            (by :func:`stapo.model.models.load_policy` / ``build_tiny_model``), else all columns.
        backend, chunk_size: passed to ``token_stats``.
        share_prompt: compute each distinct prompt once (see :func:`policy_logits`); ``padded`` layout only.
        lm_head: ``"logits"`` — the model's own LM head makes the [B, R, V] logits, then ``token_stats``;
            ``"fused"`` — the final hidden states and the output embedding go to
            :func:`stapo.model.lm_head.lm_head_token_stats`, which never holds the [B, R, V] logits (forward or
            backward); its GEMMs run in the autocast dtype when autocast is on. Same values up to float rounding.
            It runs inside the model's own forward (:func:`stapo.model.lm_head.forward_token_stats`; under FSDP2 the
            root module's, where the output embedding — tied or not — is unsharded), the same path with or without
            FSDP2.
        layout: how the forward lays the rows out (:data:`LAYOUTS`, :func:`forward_layout`): ``padded`` (the
            batch as stored, with its attention mask), ``trailing`` or ``packed`` (:func:`layout_inputs`: no
            attention mask). Same values and gradients up to float rounding.

    Returns:
        :class:`stapo.core.token_stats.TokenStats` with ``logprobs``, ``entropy``, ``collision``, each [B, R] fp32
        (nats; Σπ²). Positions where ``batch.response_mask`` is False hold 0 in all three.

    Raises:
        ValueError: temperature <= 0 (from ``token_stats``); a batch without prompt columns; an unknown
            ``lm_head``; ``lm_head="fused"`` on a model whose logits are not ``hidden @ Wᵀ``
            (:func:`check_fused_head`); an unknown ``layout``, or ``share_prompt`` with a layout other than
            ``padded``.
    """
    if layout != "padded":
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if share_prompt:
            raise ValueError("share_prompt needs the padded layout (its KV cache holds left-padded prompts)")
        return _layout_token_stats(model, batch, temperature, layout, entropy_grad=entropy_grad,
                                   vocab_size=vocab_size, backend=backend, chunk_size=chunk_size, lm_head=lm_head)

    if vocab_size is None:
        vocab_size = getattr(getattr(model, "config", None), "stapo_vocab_size", None)
    if lm_head == "fused":  # the head inside the model's forward (FSDP2: the root's), never [B, R, V] logits
        dev = batch.response_ids.device  # the model's (the forward needs the batch there)
        mask = batch.response_mask.to(dev)
        targets = torch.where(mask, batch.response_ids, 0)  # [B, R]
        request = _fused_request(model, targets, temperature, vocab_size, entropy_grad, backend)
        st = _response_states(model, batch, share_prompt, True, head=request)  # HeadOutput, [B, R] fields
    elif lm_head == "logits":
        logits = policy_logits(model, batch, share_prompt=share_prompt)  # [B, R, V]
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits = logits[..., :vocab_size]
        dev = logits.device
        mask = batch.response_mask.to(dev)
        targets = torch.where(mask, batch.response_ids.to(dev), 0)
        with torch.autocast(device_type=dev.type, enabled=False):  # fp32 math on (bf16) logits
            st = token_stats(logits, targets, temperature, entropy_grad=entropy_grad, backend=backend,
                             chunk_size=chunk_size)
    else:
        raise ValueError(f"lm_head must be 'logits' or 'fused', got {lm_head!r}")
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    return TokenStats(logprobs=torch.where(mask, st.logprobs, zero), entropy=torch.where(mask, st.entropy, zero),
                      collision=torch.where(mask, st.collision, zero))


def _layout_token_stats(model: torch.nn.Module, batch: RolloutBatch, temperature: float, layout: str, *,
                        entropy_grad: bool, vocab_size: int | None, backend: str, chunk_size: int | None,
                        lm_head: str):
    """:func:`policy_token_stats` with a padding-free ``layout`` (:func:`layout_inputs`): one forward without
    attention mask, the statistics of the K response tokens' predicting positions, scattered back to [b, r]."""
    if lm_head not in ("logits", "fused"):
        raise ValueError(f"lm_head must be 'logits' or 'fused', got {lm_head!r}")
    if vocab_size is None:
        vocab_size = getattr(getattr(model, "config", None), "stapo_vocab_size", None)
    fi = layout_inputs(batch, layout)
    if lm_head == "fused":  # the head inside the model's forward (FSDP2: the root's) on the K' predicting positions
        request = _fused_request(model, fi.targets, temperature, vocab_size, entropy_grad, backend)
        st = forward_token_stats(model, request, keep=fi.positions, **fi.model_kwargs())  # [K'] each
    else:
        logits = model(**fi.model_kwargs(), logits_to_keep=fi.keep_cols).logits  # [N, C, V]
        logits = logits.reshape(-1, logits.shape[-1])  # [N·C, V]
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits = logits[:, :vocab_size]
        packed = fi.layout == "packed"  # the kept outputs are exactly the K' predicting positions
        targets = fi.targets if packed else torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device
                                                        ).index_copy(0, fi.kept, fi.targets)  # [N·C]
        with torch.autocast(device_type=logits.device.type, enabled=False):  # fp32 math on (bf16) logits
            st = token_stats(logits, targets, temperature, entropy_grad=entropy_grad, backend=backend,
                             chunk_size=chunk_size)  # [N·C] each
        if not packed:
            st = TokenStats(logprobs=st.logprobs.index_select(0, fi.kept), entropy=st.entropy.index_select(0, fi.kept),
                            collision=st.collision.index_select(0, fi.kept))  # [K'] each
    return TokenStats(logprobs=fi.scatter(st.logprobs), entropy=fi.scatter(st.entropy),
                      collision=fi.scatter(st.collision))  # [b, r] each, 0 off the response tokens

"""Measurements that answer STAPO's mechanism directly (issue 32, item 4): pure functions, no trainer state.

The trainer hook that calls them is :class:`stapo.train.mechanism.MechanismHook` (config section ``mechanism``,
docs/metrics.md#mechanism-measurements-mechanism-probe). Four pieces:

1. **Probe set** (:class:`ProbeRow`, :func:`read_probe_set`, :func:`write_probe_set`, :func:`build_probe_set`): a
   fixed set of prompt + response pairs (token ids), e.g. the base model's responses to held-out prompts, saved once.
   Its teacher-forced entropy (:func:`probe_entropy`)

       H_probe(θ) = (1 / N) Σ_{rows i} Σ_{response tokens t of i} H(π_θ(· | prompt_i, response_i,<t))      (nats)

   is the token mean of the full-vocabulary entropy at the rollout temperature over all N probe response tokens: the
   same tokens at every step, so it does not depend on how long the policy's own responses become.
   :func:`first_k_entropy` is the on-policy counterpart: the mean entropy of the first K tokens of each response.

2. **Token groups** (:func:`token_groups`, :data:`GROUPS`) by S2T's own rule (docs/method.md#s2t-mask) on one
   mini-batch: ``silenced`` (Â > 0, p < τ_p, H < τ_h: what S2T silences), ``kept_candidates`` (Â > 0, p < τ_p, not
   silenced), ``pos_high_p`` (Â > 0, p ≥ τ_p) and ``neg`` (Â < 0); ``adv_zero`` (Â = 0) has no gradient.
   :func:`token_weights` writes a loss aggregation as per-token weights (Σ_t w_t ℓ_t = the aggregated loss), so a
   loss splits exactly into group losses L_k = Σ_{t ∈ k} w_t ℓ_t and its gradient into g = Σ_k g_k
   (:func:`weighted_token_gradients`).

3. **Attribution through AdamW** (:class:`AdamWLinearisation`). One AdamW step (torch's, decoupled weight decay)
   with the gradient g after the norm clip (scale s = min(1, c / (‖g‖ + 1e-6)), c = ``actor.grad_clip``) is

       m_t = β1 m_{t-1} + (1 − β1) s g,    v_t = β2 v_{t-1} + (1 − β2) (s g)²,
       D   = √v_t / √(1 − β2^t) + ε,       a = lr / (1 − β1^t),
       Δθ  = − lr λ θ  −  a β1 m_{t-1} / D  −  a (1 − β1) s g / D.

   Freezing the diagonal preconditioner P = a (1 − β1) s / D at this step (D holds the whole g through v_t), Δθ is
   exactly linear in g: with g = Σ_k g_k,

       Δθ = Δθ_wd + Δθ_mom + Σ_k Δθ_k,     Δθ_k = − P ⊙ g_k,

   an identity of the step (tests/test_mechanism.py checks it against ``torch.optim.AdamW.step``). The first-order
   change of the probe entropy caused by group k is

       ΔH_k = ∇_θ H_probe · Δθ_k = − Σ_params ∇H_probe ⊙ P ⊙ g_k,

   and Σ_k ΔH_k + ΔH_mom + ΔH_wd = ∇H_probe · Δθ, the whole first-order change of the step.

4. **Counterfactual** (in the hook): the same step's update applied twice, with and without S2T, from one state.

Everything here is on plain tensors and lists of tensors (one per parameter); nothing is distributed.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from stapo.core.masks import ENTROPY_QUANTILE, PROB_THRESHOLD, QUANTILE_SCOPE, s2t_mask
from stapo.core.tensor_utils import as_bool_mask, check_same_shape
from stapo.rollout.base import Response
from stapo.train.policy import collate_responses

__all__ = [
    "ProbeRow",
    "ProbeSetError",
    "PROBE_FORMAT",
    "read_probe_set",
    "write_probe_set",
    "probe_digest",
    "build_probe_set",
    "probe_batch",
    "ProbeEntropy",
    "probe_entropy",
    "first_k_entropy",
    "GROUPS",
    "token_groups",
    "token_weights",
    "weighted_token_gradients",
    "AdamWLinearisation",
    "dot",
    "shares",
]

#: The token groups of the attribution, in report order (:func:`token_groups`).
GROUPS: tuple[str, ...] = ("silenced", "kept_candidates", "pos_high_p", "neg")
#: ``format`` field of a probe-set row written by :func:`write_probe_set`.
PROBE_FORMAT = "stapo-probe-v1"


# --- the probe set ----------------------------------------------------------------------------------------
class ProbeSetError(ValueError):
    """A probe-set file that cannot be used; the message is one line naming the file and the line."""


@dataclass(frozen=True)
class ProbeRow:
    """One probe pair: a prompt and a fixed response, as token ids (the authority) and, for people, as text.

    Attributes:
        prompt_ids: the prompt's token ids (non-empty; the prompt exactly as the policy sees it, template included).
        response_ids: the response's token ids (non-empty); every one of them is a probe token.
        prompt, response: the texts (informative; None when unknown).
        source: where the pair comes from (e.g. ``"arith_test/12#0"``: problem id and sample), or None.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    prompt: str | None = None
    response: str | None = None
    source: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The JSONL object of this row (:data:`PROBE_FORMAT`)."""
        return {"format": PROBE_FORMAT, "prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
                "prompt": self.prompt, "response": self.response, "source": self.source}


def _ids(value: Any, where: str, field: str, vocab_size: int | None) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ProbeSetError(f"{where}: '{field}' must be a non-empty list of token ids")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ProbeSetError(f"{where}: '{field}' holds a value that is not a non-negative integer token id")
    if vocab_size is not None and max(value) >= vocab_size:
        raise ProbeSetError(f"{where}: '{field}' holds token id {max(value)}, outside the vocabulary "
                            f"(size {vocab_size}): a probe set of another tokenizer?")
    return tuple(value)


def read_probe_set(path: str | os.PathLike, tokenizer: Any = None, *, vocab_size: int | None = None
                   ) -> list[ProbeRow]:
    """Read a probe set: a JSONL file, one object per line (blank lines skipped).

    Each object has either token ids — ``prompt_ids`` and ``response_ids``, non-empty lists of non-negative integers
    (the authority when present) — or texts — ``prompt`` and ``response`` strings, encoded here with ``tokenizer``
    as given, without special tokens added (a chat-templated prompt carries its own; write ids for exact control).
    Optional: ``source`` (string), ``format`` (``"stapo-probe-v1"`` when present). Other fields are ignored.

    Args:
        path: the file.
        tokenizer: needed only for rows given as texts.
        vocab_size: when given, ids ≥ it are refused (a probe set made with another tokenizer).

    Returns:
        The rows in file order.

    Raises:
        ProbeSetError: a missing or unreadable file, a line that is not a JSON object, a row without usable ids or
            texts, an id outside the vocabulary, an unknown ``format``, or no row at all — one line ``<file>:<line>:
            <what>``.

    Example: the line ``{"prompt_ids": [5, 6], "response_ids": [9, 2]}`` is one probe pair with 2 probe tokens.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProbeSetError(f"{p}: probe set not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProbeSetError(f"{p}: cannot read the probe set: {e}") from None
    rows: list[ProbeRow] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ProbeSetError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ProbeSetError(f"{where}: a probe row must be a JSON object, got {type(obj).__name__}")
        fmt = obj.get("format", PROBE_FORMAT)
        if fmt != PROBE_FORMAT:
            raise ProbeSetError(f"{where}: unknown format {fmt!r} (this version reads {PROBE_FORMAT!r})")
        prompt, response, source = obj.get("prompt"), obj.get("response"), obj.get("source")
        for name, v in (("prompt", prompt), ("response", response), ("source", source)):
            if v is not None and not isinstance(v, str):
                raise ProbeSetError(f"{where}: '{name}' must be a string or null")
        if "prompt_ids" in obj or "response_ids" in obj:
            pid = _ids(obj.get("prompt_ids"), where, "prompt_ids", vocab_size)
            rid = _ids(obj.get("response_ids"), where, "response_ids", vocab_size)
        elif prompt and response:
            if tokenizer is None:
                raise ProbeSetError(f"{where}: a row given as texts needs a tokenizer to encode it")
            pid = _ids(list(tokenizer(prompt, add_special_tokens=False)["input_ids"]), where, "prompt", vocab_size)
            rid = _ids(list(tokenizer(response, add_special_tokens=False)["input_ids"]), where, "response", vocab_size)
        else:
            raise ProbeSetError(f"{where}: a probe row needs 'prompt_ids' and 'response_ids' (token ids) or "
                                f"non-empty 'prompt' and 'response' texts")
        rows.append(ProbeRow(pid, rid, prompt, response, source))
    if not rows:
        raise ProbeSetError(f"{p}: the probe set has no row")
    return rows


def write_probe_set(path: str | os.PathLike, rows: Iterable[ProbeRow]) -> Path:
    """Write ``rows`` as a probe set (JSONL of :meth:`ProbeRow.as_json`, atomically: a temporary file renamed).

    Returns the path. Raises ProbeSetError for no rows, OSError when the file cannot be written.
    """
    rows = list(rows)
    if not rows:
        raise ProbeSetError(f"{path}: refusing to write an empty probe set")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(r.as_json(), ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, p)
    return p


def probe_digest(rows: Sequence[ProbeRow]) -> str:
    """SHA-256 (hex) of the rows' token ids, in order — what the measurement depends on (texts and sources are not
    part of it). Equal digests = the same probe tokens."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([list(r.prompt_ids), list(r.response_ids)]).encode())
        h.update(b"\n")
    return h.hexdigest()


def build_probe_set(engine: Any, prompts: Sequence[tuple[Sequence[int], str]], sampling: Any, tokenizer: Any, *,
                    samples: int = 1, cut: Callable[[list[int]], int] | None = None) -> list[ProbeRow]:
    """Generate a probe set: ``samples`` responses of ``engine`` (e.g. the base model's) to each prompt.

    Args:
        engine: a rollout engine (:class:`stapo.rollout.RolloutEngine`: ``generate(prompt_ids, n, sampling)``).
        prompts: ``(prompt token ids, source id)`` per prompt, e.g. held-out problems formatted as in training.
        sampling: :class:`stapo.rollout.SamplingParams` (give it a ``seed`` for a reproducible set).
        tokenizer: decodes the responses into the rows' informative texts.
        samples: responses per prompt (≥ 1).
        cut: optional ``fn(response ids) -> n``: keep only the first n tokens (e.g. up to the first closed
            ``\\boxed{}``); a response cut to 0 tokens is dropped.

    Returns:
        One :class:`ProbeRow` per kept response, sources ``"<source>#<sample>"``, in prompt order.

    Raises:
        ProbeSetError: no prompt, ``samples`` < 1, or no response left.
    """
    if not prompts:
        raise ProbeSetError("build_probe_set: no prompt")
    if samples < 1:
        raise ProbeSetError(f"build_probe_set: samples must be ≥ 1, got {samples}")
    responses = engine.generate([list(p[0]) for p in prompts], samples, sampling)
    rows = []
    for r in responses:
        ids = list(r.response_ids)
        if cut is not None:
            ids = ids[:max(int(cut(ids)), 0)]
        if not ids:
            continue
        ptext = tokenizer.decode(list(r.prompt_ids)) if tokenizer is not None else None
        rtext = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None
        rows.append(ProbeRow(tuple(r.prompt_ids), tuple(ids), ptext, rtext,
                             f"{prompts[r.group][1]}#{getattr(r, 'index', 0)}"))
    if not rows:
        raise ProbeSetError("build_probe_set: every response was empty")
    return rows


def probe_batch(rows: Sequence[ProbeRow], pad_token_id: int):
    """The probe rows as a :class:`stapo.train.policy.RolloutBatch` (row i = ``rows[i]``; :func:`stapo.train.policy.
    collate_responses`): input_ids [N, P+R] int64, response_mask [N, R] bool (True on every probe token)."""
    responses = [Response(group=i, prompt_ids=list(r.prompt_ids), response_ids=list(r.response_ids), text="",
                          engine_logprobs=None, finish_reason="eos") for i, r in enumerate(rows)]
    return collate_responses(responses, pad_token_id)


@dataclass
class ProbeEntropy:
    """:func:`probe_entropy`'s result.

    Attributes:
        value: H_probe, the token-mean entropy over every probe token (nats/token).
        num_tokens: N, the probe tokens.
        grad: ∇_θ H_probe, one tensor per parameter of ``params`` (the parameters' dtype, zeros where unused), or
            None without ``grad``.
    """

    value: float
    num_tokens: int
    grad: list[torch.Tensor] | None = None


def probe_entropy(stats_fn: Callable[[Any, torch.Tensor, bool], Any], batch: Any, micro_batch_size: int, *,
                  params: Sequence[torch.Tensor] | None = None) -> ProbeEntropy:
    """Teacher-forced probe entropy H_probe = (1 / N) Σ_t H_t over every probe token, and optionally ∇_θ H_probe.

    Args:
        stats_fn: ``fn(batch, rows [b] int64, entropy_grad) -> TokenStats`` with ``entropy`` [b, r] fp32 (nats; 0
            off the response tokens) for rows ``rows`` of ``batch`` — the trainer's policy forward at the rollout
            temperature (:func:`stapo.train.policy.policy_token_stats`); with ``entropy_grad`` the entropy must carry a
            gradient.
        batch: :func:`probe_batch`'s batch (its ``response_mask`` [N_rows, R] selects the probe tokens).
        micro_batch_size: rows per forward.
        params: the parameters to differentiate (None: the value only, under ``torch.no_grad``).

    Returns:
        :class:`ProbeEntropy`. The gradient of each micro-batch's share Σ_t H_t / N is accumulated (one backward
        per micro-batch, ``torch.autograd.grad``: no parameter's ``.grad`` is touched).

    Example: 2 probe rows with token entropies [1.0, 2.0] and [3.0] → H_probe = 6 / 3 = 2.0.
    """
    mask = batch.response_mask.bool()  # [N_rows, R]
    n = int(mask.sum())
    if n == 0:
        raise ValueError("probe_entropy: the probe batch has no response token")
    rows_all = torch.arange(mask.shape[0])
    total = 0.0
    grad = None if params is None else [torch.zeros_like(p) for p in params]
    for start in range(0, mask.shape[0], micro_batch_size):
        idx = rows_all[start:start + micro_batch_size]  # [b]
        if params is None:
            with torch.no_grad():
                st = stats_fn(batch, idx, False)
            total += float(st.entropy.float().sum())
            continue
        st = stats_fn(batch, idx, True)
        share = st.entropy.float().sum()  # 0-dim, Σ over this micro-batch's probe tokens (0 off them)
        total += float(share.detach())
        parts = torch.autograd.grad(share / n, list(params), allow_unused=True)
        for acc, g in zip(grad, parts):
            if g is not None:
                acc.add_(g.to(acc.dtype))
    return ProbeEntropy(value=total / n, num_tokens=n, grad=grad)


def first_k_entropy(entropy: torch.Tensor, response_mask: torch.Tensor, k: int) -> float:
    """Mean entropy of the first ``k`` tokens of every response (nats/token): Σ_{i, t < k, mask} H_it / their count.

    A response shorter than k contributes all its tokens. Independent of response length beyond k.

    Args:
        entropy: [B, R] float (nats).
        response_mask: [B, R] bool (or 0/1): response tokens, left-aligned (column t = the t-th response token).
        k: K ≥ 1.

    Returns:
        A Python float; NaN when there is no response token.

    Example: entropies [[1, 2, 3], [4, 0, 0]] with mask [[1, 1, 1], [1, 0, 0]] and k = 2 → (1 + 2 + 4) / 3 = 7/3.
    """
    if k < 1:
        raise ValueError(f"first_k_entropy: k must be ≥ 1, got {k}")
    mask = as_bool_mask(response_mask, "response_mask")
    check_same_shape("entropy", entropy, response_mask=mask)
    first = mask.clone()
    first[:, k:] = False  # [B, R]
    n = int(first.sum())
    return float(entropy.float()[first].sum()) / n if n else float("nan")


# --- token groups and weights --------------------------------------------------------------------------------
def token_groups(logprobs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                 *, prob_threshold: float = PROB_THRESHOLD, entropy_quantile: float = ENTROPY_QUANTILE,
                 quantile_scope: str = QUANTILE_SCOPE) -> dict[str, torch.Tensor]:
    """The response tokens of ONE mini-batch split by S2T's rule (docs/method.md#s2t-mask; :func:`stapo.core.masks.
    s2t_mask` with the same parameters decides ``silenced``, its τ_h is a mini-batch quantity).

    Args:
        logprobs: [B, R] log p of the sampled tokens (nats), entropy: [B, R] H (nats), both at the policy whose update
            is attributed (π_old at the start of the step).
        advantages: [B] or [B, R] Â.
        response_mask: [B, R] bool.
        prob_threshold, entropy_quantile, quantile_scope: τ_p, q and the quantile pool (``algorithm.s2t``).

    Returns:
        ``{"silenced", "kept_candidates", "pos_high_p", "neg", "adv_zero"}`` → [B, R] bool, disjoint, their union the
        response tokens: silenced = Â > 0 ∧ p < τ_p ∧ H < τ_h; kept_candidates = Â > 0 ∧ p < τ_p ∧ ¬silenced;
        pos_high_p = Â > 0 ∧ p ≥ τ_p; neg = Â < 0; adv_zero = Â = 0.

    Example: Â = [1, 1, −1] per row, p of each row's one token = [0.001, 0.5, 0.001], H = [0.1, 2, 3] → the candidate
    set is row 0 alone, τ_h = 0.1 and a single candidate is never silenced: kept_candidates = row 0, pos_high_p = row
    1, neg = row 2.
    """
    mask = as_bool_mask(response_mask, "response_mask")
    adv = advantages[:, None].expand_as(mask) if advantages.dim() == 1 else advantages  # [B, R]
    check_same_shape("response_mask", mask, logprobs=logprobs, entropy=entropy, advantages=adv)
    tm = s2t_mask(logprobs, entropy, adv, mask, prob_threshold=prob_threshold, entropy_quantile=entropy_quantile,
                  quantile_scope=quantile_scope)
    silenced = mask & ~tm.keep  # [B, R]
    adv = adv.detach().float()
    low_p = logprobs.detach().float() < math.log(prob_threshold)  # [B, R]
    pos = mask & (adv > 0)
    return {"silenced": silenced, "kept_candidates": pos & low_p & ~silenced, "pos_high_p": pos & ~low_p,
            "neg": mask & (adv < 0), "adv_zero": mask & (adv == 0)}


def token_weights(keep: torch.Tensor, loss_agg_mode: str, denominator: float) -> torch.Tensor:
    """Per-token weights w [B, R] fp32 with Σ_t w_t ℓ_t = :func:`stapo.core.objectives.aggregate_loss` (ℓ, keep, mode,
    D) for every ℓ: ``token-mean`` and ``seq-mean-token-sum-norm`` w = keep / D; ``seq-mean-token-mean`` w = keep /
    (|keep_i| · D) in row i. 0 off ``keep``.

    Args:
        keep: [B, R] bool, the tokens the loss keeps.
        loss_agg_mode: one of :data:`stapo.core.objectives.LOSS_AGG_MODES`.
        denominator: :func:`stapo.core.objectives.loss_denominator` of the whole mini-batch (> 0).

    Example: keep [[1, 1, 0], [1, 0, 0]], seq-mean-token-mean, D = 2 → [[1/4, 1/4, 0], [1/2, 0, 0]].
    """
    keep = as_bool_mask(keep, "keep")
    if float(denominator) <= 0:
        raise ValueError(f"token_weights: denominator must be > 0, got {denominator}")
    w = keep.float() / float(denominator)  # [B, R]
    if loss_agg_mode in ("token-mean", "seq-mean-token-sum-norm"):
        return w
    if loss_agg_mode == "seq-mean-token-mean":
        return w / keep.sum(dim=-1, keepdim=True).clamp(min=1).float()
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}")


def weighted_token_gradients(token_losses: Callable[[torch.Tensor], Mapping[str, torch.Tensor]],
                             micro_batches: Sequence[torch.Tensor],
                             weights: Mapping[str, tuple[str, torch.Tensor]],
                             params: Sequence[torch.Tensor]) -> dict[str, list[torch.Tensor] | None]:
    """Gradients of several weighted sums of per-token losses over the same forwards: one forward per micro-batch,
    one backward per key that has a non-zero weight in it.

        g_key = ∇_θ Σ_{micro-batches} Σ_t weights[key][1][t] · token_losses(rows)[weights[key][0]][t]

    Args:
        token_losses: ``fn(rows [b] int64) -> {name: [b, r] fp32 per-token loss with a graph}`` (one forward of the
            rows; r ≤ R columns, the rest of the row weighs nothing).
        micro_batches: the row index tensors, together covering the rows whose weights are non-zero.
        weights: key → (loss name, weights [B, R] fp32 over the whole batch's rows).
        params: the parameters to differentiate.

    Returns:
        key → one tensor per parameter (their dtype), or None when the key weighs nothing in any micro-batch (no
        buffer is allocated for it). No ``.grad`` is touched. By linearity, keys whose weights add up have gradients
        that add up (to float rounding).
    """
    params = list(params)
    out: dict[str, list[torch.Tensor] | None] = {k: None for k in weights}
    for idx in micro_batches:
        live = [k for k, (_, w) in weights.items() if bool((w[idx] != 0).any())]
        if not live:
            continue
        losses = token_losses(idx)
        for j, key in enumerate(live):
            name, w = weights[key]
            mat = losses[name]  # [b, r]
            share = (mat.float() * w[idx, :mat.shape[1]].to(mat.device)).sum()
            parts = torch.autograd.grad(share, params, retain_graph=j < len(live) - 1, allow_unused=True)
            if out[key] is None:
                out[key] = [torch.zeros_like(p) for p in params]
            for acc, g in zip(out[key], parts):
                if g is not None:
                    acc.add_(g.to(acc.dtype))
    return out


# --- AdamW, linearised ---------------------------------------------------------------------------------------
def _f(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (fp64 stays fp64)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Σ over parameters of ⟨a_p, b_p⟩, accumulated in fp64."""
    return float(sum(torch.dot(_f(x).reshape(-1).double(), _f(y).reshape(-1).double()) for x, y in zip(a, b)))


class AdamWLinearisation:
    """One ``torch.optim.AdamW`` step from the optimizer's current state, split into parts linear in the gradient
    (module docstring, point 3): Δθ = Δθ_wd + Δθ_mom − P ⊙ g with P frozen from the whole clipped gradient.

    Args:
        params: the parameters, in the optimizer's order (every one must belong to one of its param groups).
        optimizer: a ``torch.optim.AdamW`` (or ``Adam`` with ``decoupled_weight_decay``); read, never changed.
        grad: the step's whole gradient, before the norm clip, one tensor per parameter.
        grad_clip: c of ``clip_grad_norm_(params, c)`` (the trainer's ``actor.grad_clip``), or None for no clip.

    Attributes:
        clip_scale: s = min(1, c / (‖g‖₂ + 1e-6)) as ``clip_grad_norm_`` applies it; NaN when ‖g‖ is not finite
            (the trainer then skips the step: every part is 0).
        skipped: True when ‖g‖ is not finite.

    Raises:
        ValueError: an optimizer other than AdamW / decoupled Adam, amsgrad or maximize, a parameter it does not hold.
    """

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                 grad: Sequence[torch.Tensor], grad_clip: float | None) -> None:
        self.params = list(params)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        name = type(optimizer).__name__
        total = math.sqrt(sum(float(_f(g).norm()) ** 2 for g in grad))
        self.skipped = not math.isfinite(total)
        self.clip_scale = float("nan") if self.skipped else (
            1.0 if grad_clip is None else min(1.0, float(grad_clip) / (total + 1e-6)))
        self._coef: list[torch.Tensor] = []  # P per parameter
        self._mom: list[torch.Tensor | None] = []  # Δθ_mom per parameter (None: no state yet, 0)
        self._wd: list[float] = []  # lr·λ per parameter
        for p, g in zip(self.params, grad):
            group = group_of.get(id(p))
            if group is None:
                raise ValueError("AdamWLinearisation: a parameter is not held by the optimizer")
            if not (isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)):
                raise ValueError(f"AdamWLinearisation needs AdamW (decoupled weight decay), got {name}")
            if group.get("amsgrad", False) or group.get("maximize", False):
                raise ValueError("AdamWLinearisation: amsgrad and maximize are not supported")
            lr, (b1, b2), eps, wd = (float(group["lr"]), (float(group["betas"][0]), float(group["betas"][1])),
                                     float(group["eps"]), float(group["weight_decay"]))
            state = optimizer.state.get(p, {})
            step = int(state["step"]) + 1 if "step" in state else 1
            bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
            sg = _f(g) * (0.0 if self.skipped else self.clip_scale)
            v_prev = state.get("exp_avg_sq")
            v = (1.0 - b2) * sg * sg if v_prev is None else b2 * _f(v_prev) + (1.0 - b2) * sg * sg
            denom = v.sqrt() / math.sqrt(bc2) + eps
            a = lr / bc1
            if self.skipped:
                self._coef.append(torch.zeros_like(denom))
                self._mom.append(None)
                self._wd.append(0.0)
                continue
            self._coef.append(a * (1.0 - b1) * self.clip_scale / denom)
            m_prev = state.get("exp_avg")
            self._mom.append(None if m_prev is None else -a * b1 * _f(m_prev) / denom)
            self._wd.append(lr * wd)

    def delta(self, g_part: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Δθ_k = −P ⊙ g_k for a part g_k of the (unclipped) gradient, one tensor per parameter (≥ fp32)."""
        return [-c * _f(g) for c, g in zip(self._coef, g_part)]

    def momentum_delta(self) -> list[torch.Tensor]:
        """Δθ_mom = −a β1 m_{t−1} / D, the part carried by earlier steps' gradients (0 at the first step)."""
        return [torch.zeros_like(c) if m is None else m for c, m in zip(self._coef, self._mom)]

    def weight_decay_delta(self) -> list[torch.Tensor]:
        """Δθ_wd = −lr λ θ (decoupled weight decay), θ read when called: call it before the step is applied."""
        return [-w * _f(p.detach()) for w, p in zip(self._wd, self.params)]

    def full_delta(self, grad: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Δθ of the whole step for the gradient ``grad`` it was built with: Δθ_wd + Δθ_mom − P ⊙ g."""
        return [a + b + c for a, b, c in zip(self.weight_decay_delta(), self.momentum_delta(), self.delta(grad))]

    def dH(self, h: Sequence[torch.Tensor], g_part: Sequence[torch.Tensor]) -> float:
        """ΔH_k = h · Δθ_k = −Σ h ⊙ P ⊙ g_k (first-order entropy change of the part g_k), without storing Δθ_k."""
        return -dot([_f(hp) * c for hp, c in zip(h, self._coef)], g_part)

    def momentum_dH(self, h: Sequence[torch.Tensor]) -> float:
        """h · Δθ_mom."""
        return sum(dot([hp], [m]) for hp, m in zip(h, self._mom) if m is not None)

    def weight_decay_dH(self, h: Sequence[torch.Tensor]) -> float:
        """h · Δθ_wd (θ read when called, as :meth:`weight_decay_delta`)."""
        return sum(-w * dot([hp], [p.detach()]) for hp, w, p in zip(h, self._wd, self.params) if w)


def shares(values: Mapping[str, float]) -> dict[str, float]:
    """Each value's share of the sum of absolute values: |x_k| / Σ_j |x_j| (NaN for all when the sum is 0 or not
    finite). Example: {a: 3, b: −1} → {a: 0.75, b: 0.25}."""
    total = sum(abs(v) for v in values.values())
    if not (total > 0 and math.isfinite(total)):
        return {k: float("nan") for k in values}
    return {k: abs(v) / total for k, v in values.items()}

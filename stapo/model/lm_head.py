"""Fused LM head + token statistics: log π(target), entropy and collision from the final hidden states,
without ever materialising the [N, V] logits.

Source: docs/method.md#token-statistics (π = softmax(logits / T) in fp32, H in nats over the real vocabulary,
padded embedding rows excluded) and docs/method.md#token-analysis (Σ_v π(v)²).  Same semantics as
``stapo.core.token_stats.token_stats(hidden @ weight[:vocab_size].T, targets, T)``; only the evaluation order differs.

For hidden states h ∈ R^{N×d} and the output embedding W ∈ R^{V_rows×d} (HF
``model.get_output_embeddings().weight``, possibly tied to the input embedding), with V = ``vocab_size`` ≤ V_rows:

    x = h · W[:V]ᵀ                    (logits, [N, V], in the compute dtype — never stored whole)
    z = x / T,  π = softmax(z)
    log p = log π(target),  H = −Σ_v π_v log π_v  (nats),  C = Σ_v π_v²

Forward, in vocabulary tiles [v0, v1) (and row tiles of ``row_tile`` rows):

    1. x_tile = F.linear(h_rows, W[v0:v1])   — a GEMM in ``compute_dtype`` (bf16: both operands cast to
       bf16 and a bf16 result, exactly what an ``nn.Linear`` under ``torch.autocast`` produces);
    2. the token_stats chunk kernel (compiled or eager) gives the tile's raw row sums in base 2:
       m_t = max y, s_t = Σ e, s1_t = Σ e (y − m_t), s2_t = Σ e²,  y = x · log2(e)/T,  e = 2^(y − m_t);
    3. an ONLINE log-sum-exp merges them into the running row state (M, S, S1, S2) in fp64:

           M' = max(M, m_t),  a = 2^(M − M'),  b = 2^(m_t − M')
           S'  = a S + b s_t
           S1' = a (S1 + S (M − M')) + b (s1_t + s_t (m_t − M'))        (Σ e (y − M'))
           S2' = a² S2 + b² s2_t

    4. the target's logit is read from the tile that holds it.

    Finally log2 s = log2 S, H = ln 2 · (log2 s − S1 / S), C = S2 / S², log p = ln 2 · ((y_t − M) − log2 s).

Backward (custom ``torch.autograd.Function``): saves only references to ``hidden`` and ``weight``, the targets
and per-row fp32 statistics (M, log2 s, and H with ``entropy_grad``); per tile it recomputes x_tile, gets
G_tile = d loss / d x_tile from the token_stats backward kernel (d log p/dz = onehot − π,
dH/dz = −π (log π + H), divided by T; a target outside the tile adds no one-hot term), then

    grad_hidden[rows]    += G_tile · W[v0:v1]          ([rows, d])
    grad_weight[v0:v1]   += G_tileᵀ · h_rows           ([v1 − v0, d])

as GEMMs in the compute dtype, accumulated in fp32 and returned in hidden's / weight's dtype.  Rows ≥ V of
``grad_weight`` are exactly 0: padded rows never enter the softmax, whatever they hold (garbage, huge values).

Memory: besides O(N·d + V_rows·d) (the fp32 gradient accumulators, the compute-dtype copy of hidden) and O(N)
row state, the extra peak is one logits tile in the forward and the logits tile plus its gradient tile in the
backward: ≤ row_tile × vocab_tile × (itemsize + 4) bytes (+ the eager kernel's two fp32 [chunk, vocab_tile]
buffers, ≈ 5 MiB).  No [N, V] tensor is ever allocated (tests/test_lm_head.py checks this op by op).

Non-finite values: hidden states and the first V weight rows must be finite; +inf/NaN logits (overflow, NaN
inputs) give NaN statistics for the rows concerned, as in ``token_stats``.

Example (d = 2, V = 2: logits [0, ln 3] → π = [1/4, 3/4]):

    >>> import math, torch
    >>> h = torch.tensor([[1.0, 0.0]])                          # [N=1, d=2] fp32
    >>> W = torch.tensor([[0.0, 5.0], [math.log(3.0), 7.0], [1e30, 1e30]])   # [V_rows=3, d]; row 2 = padding
    >>> st = lm_head_token_stats(h, W, torch.tensor([1]), vocab_size=2, backend="eager")
    >>> round(st.logprobs.item(), 4), round(st.entropy.item(), 4), round(st.collision.item(), 4)
    (-0.2877, 0.5623, 0.625)
"""
from __future__ import annotations

import functools
import math
import numbers
import types
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

import stapo.core.token_stats as _ts
from stapo.core.token_stats import (
    _BACKENDS,
    _LN2,
    _LOG2E,
    _LOGIT_DTYPES,
    Backend,
    TokenStats,
    _bwd_chunk,
    _chunks,
    _eager_chunk_rows,
    _fp32,
    _fwd_chunk_sums,
    _gpu_sizes,
    _Workspace,
)

__all__ = ["HeadOutput", "TokenStatsRequest", "forward_token_stats", "install_token_stats_forward",
           "lm_head_tiles", "lm_head_token_stats"]

# Default tile sizes.  A short sweep on the 2-core AVX-512 dev box (N = 2048, d = 576, V = 32,768, compiled
# kernels, best of 2, machine shared: load average ≈ 3), fwd+bwd with entropy_grad, seconds fp32 / bf16:
#   vocab_tile × row_tile   4096 × 1024: 4.7 / 3.2   8192 × 1024: 5.7 / 2.4   4096 × 2048: 4.3 / 2.8
#                           8192 × 2048: 4.1 / 2.4
# (forward alone: 2048-column tiles were ~1.5-2x slower, 512-row tiles ~1.3-1.5x slower).  The GEMMs dominate;
# larger tiles mean fewer, larger GEMMs and fewer kernel launches.  8192 × 2048 costs one logits tile of
# 64 MiB fp32 / 32 MiB bf16 (twice that in the backward: the tile and its gradient) — vs 2.3 GiB for the
# [4096, 151,669] fp32 logits of the current path.
_VOCAB_TILE = 8192
_ROW_TILE = 2048
# CUDA: 16,384 × 8,192 tiles (one bf16 logits tile = 256 MiB; the backward holds it and its gradient, 512 MiB).
# At the paper's micro-batch (4 × 15,360 rows, V = 151,936, d = 2,048) that is 8 row tiles × 10 vocabulary tiles,
# each GEMM ≈ 0.55 TFLOP (well above the size where an H100/H200 GEMM reaches its peak), and one compiled stats call
# per tile (reading the bf16 tile directly, see token_stats.chunk_sizes): ≈ 80 tiles × ~30 small launches, against
# ≈ 4,700 compiled calls per micro-batch with the CPU sizes.
_CUDA_VOCAB_TILE = 16384
_CUDA_ROW_TILE = 8192


def lm_head_tiles(device: torch.device | str) -> tuple[int, int]:
    """Default ``(vocab_tile, row_tile)`` of :func:`lm_head_token_stats` for hidden states on ``device``:
    (16,384, 8,192) on CUDA, (8,192, 2,048) elsewhere (see the sweep above).  Only the device type matters:
    ``torch.device("cuda")`` works without a GPU.

    Example:
        >>> lm_head_tiles("cpu"), lm_head_tiles("cuda:0")
        ((8192, 2048), (16384, 8192))
    """
    return (_CUDA_VOCAB_TILE, _CUDA_ROW_TILE) if _gpu_sizes(device) else (_VOCAB_TILE, _ROW_TILE)


def _kernel_chunk(rows: int, vocab_tile: int, backend: str, device: torch.device | None = None) -> int:
    """Rows per stats-kernel call inside a tile: the whole tile for the compiled kernel (it allocates
    nothing per call), the eager kernel's chunk otherwise (token_stats._eager_chunk_rows: ~2.5 MiB fp32
    buffers on CPU, 256 MiB on CUDA)."""
    if backend == "eager" or (backend == "auto" and _ts._compile_error is not None):
        return _eager_chunk_rows(vocab_tile, device)
    return max(rows, 1)


def _tile_sums(x: torch.Tensor, c: float, backend: str, ws: _Workspace) -> tuple[torch.Tensor, ...]:
    """Raw row sums of one logits tile x [rt, vt] → (m [rt] fp32, Σe, Σe·(y−m), Σe² [rt] fp64), the stats
    kernel run on row chunks of the tile (one call for the compiled kernel)."""
    parts = [_fwd_chunk_sums(x[a:b], c, backend, ws)
             for a, b in _chunks(x.shape[0], _kernel_chunk(x.shape[0], x.shape[1], backend, x.device), backend)]
    if len(parts) == 1:
        m, s, s1, s2 = parts[0]
        return m, s.double(), s1.double(), s2.double()
    m = torch.cat([q[0] for q in parts])  # [rt] fp32
    return (m, *(torch.cat([q[i].double() for q in parts]) for i in (1, 2, 3)))  # [rt] fp64 each


def _merge(state, r: slice, m, s, s1, s2, first: bool) -> None:
    """Online log-sum-exp: fold one tile's row sums (relative to its row max m) into the running state.

    state = (M [N] fp32, S, S1, S2 [N] fp64) with S = Σ 2^(y − M), S1 = Σ 2^(y − M)(y − M), S2 = Σ 2^(2(y − M));
    the tile's m [n] is fp32, its sums s, s1, s2 [n] fp64.
    """
    M, S, S1, S2 = state
    if first:
        M[r], S[r], S1[r], S2[r] = m, s, s1, s2
        return
    m_old = M[r]  # [n] fp32
    m_new = torch.maximum(m_old, m)  # [n] fp32 (NaN propagates)
    d_old = m_old.double() - m_new.double()  # [n] fp64, ≤ 0, exact
    d_new = m.double() - m_new.double()  # [n] fp64, ≤ 0, exact
    a = torch.exp2(d_old)  # [n] rescale of the old sums
    b = torch.exp2(d_new)  # [n] rescale of the tile's sums
    S_old = S[r]  # [n]
    S1[r] = a * (S1[r] + S_old * d_old) + b * (s1 + s * d_new)  # [n] Σ e (y − M')
    S[r] = a * S_old + b * s  # [n] Σ e
    S2[r] = (a * a) * S2[r] + (b * b) * s2  # [n] Σ e²
    M[r] = m_new


class _LMHeadStatsFunction(torch.autograd.Function):
    """Autograd wrapper: (hidden [N, d], weight [V_rows, d]) → (logprobs, entropy, collision) [N] fp32.

    Saved for backward: hidden and weight (references, no copy), targets [N] int64, and per row (fp32 [N]) the
    max M of y = x·log2(e)/T, log2 s = log2 Σ 2^(y − M) and, with entropy_grad, the entropy.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab, c, inv_t, entropy_grad, cdtype, vocab_tile, row_tile,
                backend):  # noqa: D401
        n_rows, dev = hidden.shape[0], hidden.device
        with torch.autocast(device_type=dev.type, enabled=False):
            h_c = hidden.to(cdtype).contiguous()  # [N, d] compute dtype (a no-op when already so)
            M = torch.empty(n_rows, dtype=torch.float32, device=dev)  # [N] running row max of y (log2 units)
            S = torch.empty(n_rows, dtype=torch.float64, device=dev)  # [N] Σ 2^(y − M)
            S1 = torch.empty(n_rows, dtype=torch.float64, device=dev)  # [N] Σ 2^(y − M)(y − M)
            S2 = torch.empty(n_rows, dtype=torch.float64, device=dev)  # [N] Σ 2^(2(y − M))
            y_t = torch.zeros(n_rows, dtype=torch.float32, device=dev)  # [N] target's y
            state = (M, S, S1, S2)
            row_tiles = _chunks(n_rows, row_tile, "compiled")  # no trailing 1-row tile (compile specialisation)
            ws = _Workspace(1, 1, dev)  # eager kernel buffers, allocated lazily
            for ti, (v0, v1) in enumerate(_chunks(vocab, vocab_tile, "compiled")):
                w_t = weight[v0:v1].to(cdtype)  # [vt, d] compute dtype (a view when already so)
                vt = v1 - v0
                if ws.vocab != vt:
                    ws = _Workspace(1, vt, dev)
                for r0, r1 in row_tiles:
                    x = F.linear(h_c[r0:r1], w_t)  # [rt, vt] logits tile, compute dtype
                    _merge(state, slice(r0, r1), *_tile_sums(x, c, backend, ws), first=ti == 0)
                    loc = targets[r0:r1] - v0  # [rt] target column inside this tile
                    inside = (loc >= 0) & (loc < vt)  # [rt] bool
                    val = x.gather(1, loc.clamp(0, vt - 1).unsqueeze(-1)).squeeze(-1).float() * c  # [rt] fp32
                    y_t[r0:r1] = torch.where(inside, val, y_t[r0:r1])
                    del x
            log2_s = S.log2()  # [N] fp64
            # log p = ln2 · ((y_t − M) − log2 s): y_t − M first, in fp32, as token_stats does.
            logprobs = (((y_t - M).double() - log2_s) * _LN2).float()  # [N] nats
            entropy = ((log2_s - S1 / S) * _LN2).float()  # [N] nats
            collision = (S2 / (S * S)).float()  # [N]
            row_log2_s = log2_s.float()  # [N] saved for the backward (as token_stats saves it)

        ctx.vocab, ctx.c, ctx.inv_t, ctx.cdtype = vocab, c, inv_t, cdtype
        ctx.vocab_tile, ctx.row_tile, ctx.backend, ctx.entropy_grad = vocab_tile, row_tile, backend, entropy_grad
        ctx.save_for_backward(hidden, weight, targets, M, row_log2_s, entropy if entropy_grad else None)
        ctx.set_materialize_grads(False)
        if entropy_grad:
            ctx.mark_non_differentiable(collision)  # (one call: each call replaces the set)
        else:
            ctx.mark_non_differentiable(entropy, collision)
        return logprobs, entropy, collision

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logprobs, g_entropy, g_collision):
        hidden, weight, targets, M, row_log2_s, entropy = ctx.saved_tensors
        none = (None,) * 9
        if not ctx.entropy_grad:
            g_entropy = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logprobs is None and g_entropy is None) or not (need_h or need_w):
            return (None, None, *none)
        n_rows, d, dev, cdtype = hidden.shape[0], hidden.shape[1], hidden.device, ctx.cdtype
        g_lp = g_logprobs.float() if g_logprobs is not None else None  # [N] fp32 (may be a stride-0 expand)
        g_h = g_entropy.float() if g_entropy is not None else None  # [N] fp32
        with torch.autocast(device_type=dev.type, enabled=False):
            h_c = hidden.to(cdtype).contiguous()  # [N, d] compute dtype
            grad_h = torch.zeros(n_rows, d, dtype=torch.float32, device=dev) if need_h else None  # [N, d] fp32
            grad_w = torch.zeros(weight.shape, dtype=weight.dtype, device=dev) if need_w else None  # [V_rows, d]
            row_tiles = _chunks(n_rows, ctx.row_tile, "compiled")
            ws = _Workspace(1, 1, dev)
            for v0, v1 in _chunks(ctx.vocab, ctx.vocab_tile, "compiled"):
                w_t = weight[v0:v1].to(cdtype)  # [vt, d] compute dtype
                vt = v1 - v0
                if ws.vocab != vt:
                    ws = _Workspace(1, vt, dev)
                gw_t = torch.zeros(vt, d, dtype=torch.float32, device=dev) if need_w else None  # [vt, d] fp32
                for r0, r1 in row_tiles:
                    h_r = h_c[r0:r1]  # [rt, d]
                    x = F.linear(h_r, w_t)  # [rt, vt] recomputed logits tile (same GEMM as the forward)
                    g = torch.empty_like(x)  # [rt, vt] d loss / d x, compute dtype
                    loc = targets[r0:r1] - v0  # [rt] target column in the tile (outside [0, vt): none)
                    chunk = _kernel_chunk(r1 - r0, vt, ctx.backend, dev)
                    for a, b in _chunks(r1 - r0, chunk, ctx.backend):
                        r = slice(r0 + a, r0 + b)
                        _bwd_chunk(
                            g[a:b],  # [n, vt] written in place
                            x[a:b],  # [n, vt]
                            M[r],
                            row_log2_s[r],
                            entropy[r] if g_h is not None else None,
                            g_lp[r] if g_lp is not None else None,
                            g_h[r] if g_h is not None else None,
                            loc[a:b],
                            ctx.c,
                            ctx.inv_t,
                            ctx.backend,
                            ws,
                            tgt_inside=False,
                        )
                    del x
                    if need_h:
                        if cdtype == torch.float32:
                            grad_h[r0:r1].addmm_(g, w_t)  # [rt, d] += G · W_tile
                        else:
                            grad_h[r0:r1] += torch.mm(g, w_t)  # [rt, d] bf16/fp16 GEMM, fp32 accumulation
                    if need_w:
                        if cdtype == torch.float32:
                            gw_t.addmm_(g.t(), h_r)  # [vt, d] += Gᵀ · h_rows
                        else:
                            gw_t += torch.mm(g.t(), h_r)  # [vt, d]
                    del g
                if need_w:
                    grad_w[v0:v1] = gw_t  # cast to the weight's dtype
            grad_hidden = grad_h.to(hidden.dtype) if need_h else None  # [N, d]
        return (grad_hidden, grad_w, *none)


def _validate(hidden, weight, targets, temperature, vocab_size, compute_dtype, vocab_tile, row_tile,
              backend) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if compute_dtype is not None and compute_dtype not in _LOGIT_DTYPES:
        raise TypeError(f"compute_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got {compute_dtype!r}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor (token ids, int64), got {targets.dtype}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must have shape [B, T, d] or [N, d], got {tuple(hidden.shape)}")
    if hidden.shape[-1] < 1:
        raise ValueError("hidden must have a non-empty feature dimension (d >= 1)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape [V_rows, d = {hidden.shape[-1]}] (the output embedding), got {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one row (V_rows >= 1)")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(
            f"hidden ({hidden.device}), weight ({weight.device}) and targets ({targets.device}) must be on one device"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    if not (math.isfinite(float(temperature)) and float(temperature) > 0.0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral)
        or not 1 <= vocab_size <= weight.shape[0]
    ):
        raise ValueError(f"vocab_size must be None or an integer in [1, V_rows={weight.shape[0]}], got {vocab_size!r}")
    for name, v in (("vocab_tile", vocab_tile), ("row_tile", row_tile)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ValueError(f"{name} must be None or an integer >= 1, got {v!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if targets.numel():
        vocab = weight.shape[0] if vocab_size is None else int(vocab_size)
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one host sync (GPU)
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"targets must be token ids in [0, vocab_size={vocab}), got values in [{lo}, {hi}] "
                "(map padding/ignore ids such as -100 to a valid id and mask the result instead)"
            )


def _stats_flat(hidden, weight, targets, temperature, vocab_size, entropy_grad, compute_dtype, vocab_tile, row_tile,
                backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`lm_head_token_stats` before the final reshape: (logprobs, entropy, collision), each [N] fp32 with
    N = targets.numel() — the autograd function's own outputs (not views).  Same arguments and errors."""
    _validate(hidden, weight, targets, temperature, vocab_size, compute_dtype, vocab_tile, row_tile, backend)
    d = hidden.shape[-1]
    h2 = hidden.reshape(-1, d)  # [N, d] (a copy only for non-viewable strides, e.g. h[:, :-1])
    flat_targets = targets.reshape(-1).to(torch.int64)  # [N]
    vocab = weight.shape[0] if vocab_size is None else int(vocab_size)
    inv_t = _fp32(1.0 / float(temperature))  # fp32-rounded 1/T (backward chain rule)
    c = _fp32(_LOG2E / float(temperature))  # fp32-rounded log2(e)/T: y = x·c = z / ln 2
    cdtype = hidden.dtype if compute_dtype is None else compute_dtype
    default_vt, default_rt = lm_head_tiles(hidden.device)
    return _LMHeadStatsFunction.apply(
        h2, weight, flat_targets, vocab, c, inv_t, bool(entropy_grad), cdtype,
        int(vocab_tile) if vocab_tile is not None else default_vt,
        int(row_tile) if row_tile is not None else default_rt,
        backend,
    )


def lm_head_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    vocab_size: int | None = None,
    entropy_grad: bool = False,
    compute_dtype: torch.dtype | None = None,
    vocab_tile: int | None = None,
    row_tile: int | None = None,
    backend: Backend = "auto",
) -> TokenStats:
    """Log-prob of each target token, entropy and collision probability straight from the final hidden states.

    Equivalent to ``token_stats(F.linear(hidden, weight[:vocab_size]), targets, temperature)``
    (docs/method.md#token-statistics: π = softmax(logits / T), fp32 statistics, H in nats over the real
    vocabulary; docs/method.md#token-analysis: Σ_v π(v)²), but the [N, V] logits are produced, reduced and
    (in the backward) differentiated one [row_tile, vocab_tile] tile at a time with an online log-sum-exp
    (see the module docstring), so neither the logits nor their gradient ever exist in full.

    Args:
        hidden: [B, T, d] or [N, d] final hidden states (after the last norm), float32 or bfloat16 (float16
            accepted); may be a strided view such as ``h[:, :-1]`` (copied once to a contiguous [N, d]).
        weight: [V_rows, d] output embedding (``model.get_output_embeddings().weight``), float32/bfloat16/
            float16; may be tied to the input embedding (autograd adds both gradients).  No bias.
        targets: hidden.shape[:-1] integer token ids in [0, vocab_size), on hidden's device.
        temperature: sampling temperature T > 0 (finite); the logits are divided by it.
        vocab_size: number of real token ids V (1 ≤ V ≤ V_rows, default V_rows).  Rows ≥ V of ``weight``
            (padded vocabulary, e.g. Qwen3: 151,936 rows for 151,669 tokens) are never read: they do not enter
            the softmax whatever they hold, and get exactly zero gradient.
        entropy_grad: if True, ``entropy`` is differentiable w.r.t. hidden and weight; otherwise detached.
        compute_dtype: dtype of the GEMMs and of the logits tiles.  None → hidden's dtype.  torch.bfloat16
            casts the hidden rows and each weight tile to bf16 and produces bf16 logits, exactly like an
            ``nn.Linear`` under ``torch.autocast(dtype=torch.bfloat16)``; the statistics are still fp32.
            Any surrounding autocast is disabled inside (this argument decides).
        vocab_tile: vocabulary columns per tile (None → :func:`lm_head_tiles`: 8,192 on CPU, 16,384 on CUDA).
        row_tile: rows per tile (None → 2,048 on CPU, 8,192 on CUDA).  Peak extra memory ≈ row_tile · vocab_tile
            · (itemsize + 4) bytes (logits tile + its gradient in the backward) + O(N·d + V_rows·d).
        backend: stats kernels, as in ``token_stats``: "compiled" (torch.compile'd; raises RuntimeError if it
            fails), "eager", or "auto" (compiled, falling back to eager with a one-time RuntimeWarning).

    Returns:
        :class:`stapo.core.token_stats.TokenStats` with ``logprobs``, ``entropy`` (nats) and ``collision``, each fp32
        with shape ``targets.shape``.  ``logprobs`` (and ``entropy`` with ``entropy_grad``) carry gradients to
        ``hidden`` and ``weight``, returned in their own dtypes (accumulated in fp32); ``collision`` is always
        detached.

    Raises:
        TypeError: hidden/weight/targets not tensors; hidden/weight/compute_dtype not float32/bfloat16/float16;
            targets not an integer dtype; temperature not a real number.
        ValueError: hidden not 2-D/3-D or d == 0; weight not [V_rows ≥ 1, d]; targets shape != hidden.shape[:-1];
            tensors on different devices; temperature <= 0 or not finite; vocab_size outside [1, V_rows];
            target ids outside [0, vocab_size); vocab_tile / row_tile < 1; unknown backend.
        RuntimeError: backend="compiled" and torch.compile fails.

    Example:
        >>> import torch
        >>> h = torch.zeros(2, 3, 8)                       # [B=2, T=3, d=8]: all logits 0 → uniform π
        >>> W = torch.randn(6, 8)                          # [V_rows=6, d=8]
        >>> st = lm_head_token_stats(h, W, torch.zeros(2, 3, dtype=torch.long), 0.7, vocab_size=4,
        ...                          backend="eager")
        >>> st.entropy.shape, round(st.entropy[0, 0].item(), 6)   # ln 4 nats: the 2 padded rows are ignored
        (torch.Size([2, 3]), 1.386294)
        >>> round(st.logprobs[0, 0].item(), 6), st.collision[0, 0].item()   # −ln 4, 1/4
        (-1.386294, 0.25)
    """
    out_shape = targets.shape
    logprobs, entropy, collision = _stats_flat(hidden, weight, targets, temperature, vocab_size, entropy_grad,
                                               compute_dtype, vocab_tile, row_tile, backend)  # [N] each
    return TokenStats(
        logprobs=logprobs.view(out_shape),  # [B, T] / [N]
        entropy=entropy.view(out_shape),  # [B, T] / [N]
        collision=collision.view(out_shape),  # [B, T] / [N]
    )


# --------------------------------------------------------------------------------------------------
# The fused head inside the model's own forward (FSDP2: inside the root module's forward).
#
# Under FSDP2 (stapo.model.distributed.wrap_policy: fully_shard per decoder layer, then the root) the root's parameters
# — embed_tokens, the final norm and lm_head (one Parameter when tied, as in Qwen3-1.7B) — are DTensor shards except
# between the root's pre-forward hook (all-gather) and its post-backward (reduce-scatter of their gradients).  So the
# head must run inside the root's forward, as verl does by patching the model's forward (``use_fused_kernels``:
# verl/models/transformers/dense_common.py ``forward_with_torch_backend`` calls the decoder, then a fused
# linear + log-prob/entropy on ``self.lm_head.weight``).  Here the patch is per instance (not the class), installed by
# install_token_stats_forward: ``model(..., stapo_token_stats=...)`` runs the decoder and lm_head_token_stats;
# any other call is the model's own forward.  One process and ``replicate`` take exactly the same path.
# --------------------------------------------------------------------------------------------------


class TokenStatsRequest:
    """The statistics :func:`forward_token_stats` computes from the kept hidden states (a plain object on purpose:
    FSDP2's root pre-forward casts floating tensors among the forward's arguments to its ``param_dtype`` and moves
    them to the device, looking into tuples, dicts and dataclasses; it leaves this alone, so its tensors must already
    be on the model's device).

    Attributes:
        targets: integer token ids, one per kept hidden position: [B', K] for kept states [B', K, d], [K] for a flat
            ``keep`` index; None → no statistics, the forward returns the kept hidden states (for a later forward's
            ``prefix``, e.g. the shared-prompt pass of :func:`stapo.train.policy.policy_token_stats`).
        temperature, vocab_size, entropy_grad, compute_dtype, vocab_tile, row_tile, backend: as in
            :func:`lm_head_token_stats` (``compute_dtype`` None → the hidden states' dtype; pass the autocast dtype
            when the caller runs under autocast).
    """

    __slots__ = ("targets", "temperature", "vocab_size", "entropy_grad", "compute_dtype", "vocab_tile", "row_tile",
                 "backend")

    def __init__(self, targets: torch.Tensor | None, temperature: float = 1.0, *, vocab_size: int | None = None,
                 entropy_grad: bool = False, compute_dtype: torch.dtype | None = None, vocab_tile: int | None = None,
                 row_tile: int | None = None, backend: Backend = "auto") -> None:
        self.targets, self.temperature, self.vocab_size = targets, temperature, vocab_size
        self.entropy_grad, self.compute_dtype, self.backend = entropy_grad, compute_dtype, backend
        self.vocab_tile, self.row_tile = vocab_tile, row_tile

    def hidden_only(self) -> "TokenStatsRequest":
        """The same request without targets: the forward returns the kept hidden states."""
        return TokenStatsRequest(None, self.temperature, vocab_size=self.vocab_size, entropy_grad=self.entropy_grad,
                                 compute_dtype=self.compute_dtype, vocab_tile=self.vocab_tile, row_tile=self.row_tile,
                                 backend=self.backend)


class HeadOutput(NamedTuple):
    """What the token-statistics forward returns (a NamedTuple: FSDP2 registers its pre-backward hook on the tensors
    of tuples, dicts and dataclasses, whatever the torch version).

    Attributes:
        logprobs, entropy, collision: fp32 with the request's ``targets.shape`` (None for a hidden-only request);
            as in :func:`lm_head_token_stats` (``entropy`` differentiable with ``entropy_grad``, ``collision`` never).
        hidden: [B', K, d] (or [K, d]) the kept final hidden states for a hidden-only request, else None.
        past_key_values: the decoder's KV cache (with ``use_cache=True``), else None.
    """

    logprobs: torch.Tensor | None
    entropy: torch.Tensor | None
    collision: torch.Tensor | None
    hidden: torch.Tensor | None
    past_key_values: Any


class _Call:
    """One call's request and hidden-state selection (plain object: FSDP2 does not touch it)."""

    __slots__ = ("request", "keep", "rows", "prefix")

    def __init__(self, request, keep, rows, prefix) -> None:
        self.request, self.keep, self.rows, self.prefix = request, keep, rows, prefix


def _select_hidden(h: torch.Tensor, keep, rows, prefix) -> torch.Tensor:
    """The final hidden states [B, L, d] → the kept ones: ``keep`` (None: all; int k > 0: the last k positions, as
    HF's ``logits_to_keep``; a slice of positions; a 1-D int64 tensor: flat row-major indices into the B·L positions →
    [K, d]), then ``rows`` (int64 [B'] index_select of the rows), then ``prefix`` ([B', k0, d], prepended along the
    positions)."""
    if keep is not None:
        if isinstance(keep, torch.Tensor):
            if keep.dim() != 1 or keep.dtype.is_floating_point or keep.dtype == torch.bool:
                raise ValueError(f"keep must be a 1-D integer tensor of flat positions, got {keep.dtype} "
                                 f"{tuple(keep.shape)}")
            h = h.reshape(-1, h.shape[-1]).index_select(0, keep)  # [K, d]
        elif isinstance(keep, slice):
            h = h[:, keep]  # [B, K, d]
        elif isinstance(keep, numbers.Integral) and not isinstance(keep, bool) and keep > 0:
            h = h[:, -int(keep):]  # [B, k, d]
        else:
            raise ValueError(f"keep must be None, an int > 0, a slice or a 1-D int64 tensor, got {keep!r}")
    if rows is not None:
        h = h.index_select(0, rows)  # [B', ·, d]
    if prefix is not None:
        h = torch.cat([prefix, h], dim=1)  # [B', k0 + K, d]
    return h


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    if dec is None or dec is model:
        dec = getattr(model, "model", None)
    if dec is None:
        raise ValueError(f"{type(model).__name__} has no decoder (get_decoder() / .model)")
    return dec


def _forward_with_stats(model: torch.nn.Module, call: _Call, args, kwargs) -> HeadOutput:
    """Body of the token-statistics forward (runs inside ``model.__call__``: FSDP2's root hooks around it)."""
    out = _decoder(model)(*args, **kwargs)
    h = _select_hidden(out.last_hidden_state, call.keep, call.rows, call.prefix)  # [B', K, d] or [K, d]
    req = call.request
    cache = getattr(out, "past_key_values", None)
    if req.targets is None:
        # a fresh tensor, not a view of the decoder's output (FSDP2 warns about views: in-place ops on them would
        # skip its pre-backward hook)
        return HeadOutput(None, None, None, h.clone() if h._base is not None else h, cache)
    weight = model.get_output_embeddings().weight  # [V_rows, d]: unsharded here under FSDP2 (the root's forward)
    lp, ent, coll = _stats_flat(h, weight, req.targets, req.temperature, req.vocab_size, req.entropy_grad,
                                req.compute_dtype, req.vocab_tile, req.row_tile, req.backend)  # [N] each, not views
    return HeadOutput(lp, ent, coll, None, cache)


def install_token_stats_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model`` (an HF causal LM, FSDP2-wrapped or not) a forward that also accepts
    ``stapo_token_stats=`` (what :func:`forward_token_stats` passes): then it runs the decoder and
    :func:`lm_head_token_stats` on ``model.get_output_embeddings().weight`` and returns a :class:`HeadOutput`; without
    it, the model's own forward runs unchanged.  Instance-level (``model.forward``; the class and other instances
    are untouched), idempotent, before or after ``fully_shard`` (FSDP2's hooks are module hooks around
    ``model.forward``).  The signature HF inspects (``logits_to_keep`` support in ``generate``) is the original's.

    Returns:
        ``model`` itself.
    """
    current = model.__dict__.get("forward")
    if getattr(current, "_stapo_token_stats", False):
        return model
    original = type(model).forward

    @functools.wraps(original)
    def forward(self, *args, stapo_token_stats: _Call | None = None, **kwargs):
        if stapo_token_stats is None:
            return current(*args, **kwargs) if current is not None else type(self).forward(self, *args, **kwargs)
        return _forward_with_stats(self, stapo_token_stats, args, kwargs)

    forward._stapo_token_stats = True
    model.forward = types.MethodType(forward, model)
    return model


def forward_token_stats(model: torch.nn.Module, request: TokenStatsRequest, *, keep=None,
                        rows: torch.Tensor | None = None, prefix: torch.Tensor | None = None,
                        **model_kwargs) -> HeadOutput:
    """One forward of ``model`` that returns the target tokens' statistics (or the kept hidden states) computed
    INSIDE the model's forward, never the [N, V] logits — under FSDP2 within the root module's forward, so the
    output embedding (tied or not) is the unsharded parameter and its gradient is reduce-scattered with the root's.

    Same values and gradients as ``lm_head_token_stats(<kept final hidden states>, model.get_output_embeddings().weight,
    request.targets, ...)`` (the computation is the same op for op).  Installs the forward
    (:func:`install_token_stats_forward`) on first use.

    Args:
        model: an HF causal LM whose logits are ``hidden @ Wᵀ`` (see :func:`stapo.train.policy.check_fused_head`).
        request: a :class:`TokenStatsRequest` (tensors on the model's device).
        keep: which final hidden states [B, L, d] are kept (see ``_select_hidden``): None → all; int k → the last k
            positions ([B, k, d]); a slice of positions ([B, K, d]); a 1-D int64 tensor → those flat row-major
            positions of the B·L ([K, d], e.g. the predicting positions of a packed [1, T] or trailing-padded
            batch).
        rows: optional int64 [B'] index of the kept rows (e.g. a shared prompt's state for each of its responses).
        prefix: optional [B', k0, d] hidden states from an earlier forward, prepended along the positions.
        **model_kwargs: the decoder's inputs, as the caller lays them out (``input_ids``, ``attention_mask`` —
            possibly None —, ``position_ids``, ``past_key_values``, ``use_cache``, …).

    Returns:
        :class:`HeadOutput`: logprobs / entropy / collision [targets.shape] fp32, or ``hidden`` for a hidden-only
        request; ``past_key_values``.

    Raises:
        ValueError / TypeError: as :func:`lm_head_token_stats` (e.g. targets' shape ≠ the kept states' shape[:-1]);
            a bad ``keep``.
    """
    install_token_stats_forward(model)
    out = model(**model_kwargs, stapo_token_stats=_Call(request, keep, rows, prefix))
    if request.targets is None:
        return out
    shape = request.targets.shape
    return out._replace(logprobs=out.logprobs.view(shape), entropy=out.entropy.view(shape),
                        collision=out.collision.view(shape))

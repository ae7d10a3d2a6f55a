"""Per-token log-probability, entropy and collision probability from logits, chunked.

Source: docs/method.md#token-statistics (p_{i,t} and H_{i,t} are taken from ``logits / T`` in fp32, H in nats over the
full vocabulary) and docs/method.md#token-analysis (the collision probability Σ_v π(v)² enters the logit-gradient norm
‖∇_a‖² = w²(1 − 2p + Σ_v π(v)²)); docs/method.md#pitfalls (entropy from logits containing −inf must be finite; log-probs
and entropy must use the rollout temperature).

For one row of logits x ∈ R^V (one token position) at temperature T, with z = x / T:

    m      = max_v z_v
    s      = Σ_v exp(z_v − m)
    lse    = m + log s                                 (log-partition function)
    log p  = z_target − lse                            (log-prob of the target token)
    H      = log s − Σ_v e_v (z_v − m) / s,  e_v = exp(z_v − m)       (Shannon entropy, nats)
    C      = Σ_v e_v² / s²  = Σ_v π(v)²                 (collision probability)

The kernels evaluate exactly these formulas in base 2 (y = z / ln 2 = x · c with c = fp32(log2(e)/T),
e_v = 2^(y_v − max y), H = ln 2 · (log2 s − Σ e (y − max y) / s), log p = ln 2 · (y_t − max y − log2 s)),
because exp2 is about a third cheaper than exp on CPU; the results are in nats.

All of this is computed in fp32 whatever the logits' dtype (fp32, bf16 or fp16), row by row in
chunks of rows, so that no fp32 copy of the whole [B, T, V] logits and no full softmax is ever
materialised.  The backward pass is a custom ``torch.autograd.Function`` that saves only a reference
to the logits (their own dtype) and per-row fp32 statistics (max y and log2 s, i.e. the
log-partition, plus H when the entropy needs a gradient) and recomputes the softmax chunk by chunk:

    d log p / d z_j = 1[j = target] − π_j
    d H     / d z_j = −π_j (log π_j + H)
    d / d x_j       = (d / d z_j) / T

The gradient w.r.t. the logits is returned in the logits' dtype (that [B, T, V] tensor is the only
full-size allocation, and it is unavoidable).

Two interchangeable kernels compute a chunk, a ``torch.compile``'d fused one (``"compiled"``, fp64 accumulation)
and plain PyTorch ops (``"eager"``); ``backend="auto"`` falls back to the eager one with a one-time warning.
How each one works, its chunk sizes on CPU and GPU, and why: docs/scaling.md, "The token-statistics kernels".

Non-finite logits:

* −inf entries (padded vocabulary, masked ids) get probability exactly 0: (y − max y) and log2 π are
  clamped at ``_LOG2_FLOOR`` = −63 and entries at the floor get weight 0, so 0 · (−inf) never
  makes NaN.  Finite entries below the floor (relative probability < 2^−63 ≈ 1e−19) are dropped the
  same way; the effect is < 1e−13 relative on the sums, i.e. invisible in fp32 results (see
  ``_LOG2_FLOOR``).  A target whose logit is −inf gets log p = −inf
  (its gradient stays finite).
* A row whose logits are ALL −inf, or a row containing +inf or NaN, gives NaN log-prob, entropy and
  collision for that row (and NaN gradients for it).  Other rows are unaffected.

Example (V = 2, logits [0, ln 3] → π = [1/4, 3/4]):

    >>> import math, torch
    >>> logits = torch.tensor([[0.0, math.log(3.0)]])          # [N=1, V=2] fp32
    >>> st = token_stats(logits, torch.tensor([1]), backend="eager")
    >>> round(st.logprobs.item(), 4)                             # ln(3/4)
    -0.2877
    >>> round(st.entropy.item(), 4)                              # −(¼ ln ¼ + ¾ ln ¾) nats
    0.5623
    >>> round(st.collision.item(), 4)                            # ¼² + ¾² = 10/16
    0.625
"""
from __future__ import annotations

import contextlib
import math
import numbers
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Literal

import torch

__all__ = ["ChunkSizes", "TokenStats", "chunk_sizes", "token_stats"]

Backend = Literal["auto", "compiled", "eager"]
_BACKENDS = ("auto", "compiled", "eager")
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Floor, in log2 units, for (y − max y) in the forward and for log2 π in the backward.  A vocabulary
# entry at or below it (relative weight 2^−63 ≈ 1.1e−19, or a −inf logit) gets weight exactly 0, and
# the clamped value keeps every product finite (0 · (−inf) = NaN cannot happen).  What is dropped
# changes Σ e by at most V · 2^−63 relative (< 1e−13 for V < 2^20), far below fp32 resolution, and
# −Σ p log p by less than V · 5e−18 nats.  The floor also keeps every operand and result in the
# normal fp32 range (e ≥ 2^−63, e² ≥ 2^−126): denormals made the kernels 2-3x slower on wide
# (realistic) logits on the dev CPU.
_LOG2_FLOOR = -63.0
# Eager kernels: 2^(floor) = 2^−63 is exact; anything ≤ this (slightly larger) weight is set to 0 by a
# single in-place threshold_ pass (no bool mask buffer) — the same set as "y − m > floor" in the
# compiled kernels.
_FLOOR_WEIGHT = 2.0**-63 * (1.0 + 2.0**-20)
_LN2 = math.log(2.0)
_LOG2E = 1.0 / math.log(2.0)

# Default rows per chunk.  Eager: two fp32 [chunk, V] buffers of ~2.5 MiB each (4 rows at
# V = 151,936), which stay in cache between the ~8 passes over them; a sweep on the 2-core dev box
# gave 2-8 rows as the sweet spot (16+ rows: ~1.5-2x slower).  Compiled: the forward allocates
# nothing per chunk and the backward writes in place, so the chunk only sets the number of kernel
# launches (~0.3 ms of Python/guard overhead each).
_EAGER_CHUNK_BYTES = 5 * 2**19
_COMPILED_CHUNK_ROWS = 256
# Compiled forward on bf16/fp16 logits: each chunk is upcast, _UPCAST_BYTES of fp32 rows at a time (13 rows at
# V = 151,936, cache-resident), into a reused buffer, and the fp32 kernel runs on it.  Inductor's kernel reading
# bf16 directly was slower than the eager kernel on an AVX-512 + AVX512-BF16 EPYC (issue 15: 1.18x vs 0.65x of
# logsumexp) although it was the fastest on an AVX2-only one (results/benchmarks/token_stats.md); with the upcast
# the compiled bf16 row is 0.10-0.19x there (results/benchmarks/token_stats_avx512.md), and the path no longer
# depends on how inductor vectorises mixed bf16 / fp64 loops on a given CPU.
_UPCAST_BYTES = 8 * 2**20


# GPU (CUDA) sizes.  The CPU sizes above are set by cache sizes and a per-call overhead of ~0.3 ms; on a GPU a
# kernel over 8 MiB is a few µs of work, so the CPU sizes make the host's dispatch the bottleneck (≈ 4,700
# compiled calls + 4,700 upcast copies per [4 × 15,360, 151,936] bf16 micro-batch, issue 30 / defect 6).  On CUDA:
# * compiled kernel: 4,096 rows per call (15 calls for 61,440 rows; 1.2 GiB of bf16 logits read per call), the
#   bf16/fp16 logits read directly by the Triton kernel (``x.float()`` inside it: no upcast buffer, no copy);
#   the kernels allocate only [rows] outputs (forward) or write into the gradient (backward), so the chunk adds
#   no memory;
# * eager fallback: two fp32 [chunk, V] buffers of 256 MiB each (441 rows at V = 151,936).
# Other non-CPU devices keep the CPU sizes (untested).
_CUDA_COMPILED_CHUNK_ROWS = 4096
_CUDA_EAGER_CHUNK_BYTES = 256 * 2**20


def _upcast_rows(vocab: int) -> int:
    """Rows per upcast sub-chunk (≥ 2: a 1-row compiled call would recompile, see ``_chunks``)."""
    return max(2, _UPCAST_BYTES // (4 * max(vocab, 1)))


def _gpu_sizes(device: torch.device | str | None) -> bool:
    """True when ``device`` gets the GPU chunk sizes (CUDA); CPU (and None) keep the CPU sizes."""
    return device is not None and torch.device(device).type == "cuda"


def _eager_chunk_rows(vocab: int, device: torch.device | str | None = None) -> int:
    """Rows per eager-kernel chunk: two fp32 [rows, vocab] buffers of ``_EAGER_CHUNK_BYTES`` (CPU: ~2.5 MiB,
    4 rows at V = 151,936) or ``_CUDA_EAGER_CHUNK_BYTES`` (CUDA: 256 MiB, 441 rows) each."""
    budget = _CUDA_EAGER_CHUNK_BYTES if _gpu_sizes(device) else _EAGER_CHUNK_BYTES
    return max(1, budget // (4 * max(vocab, 1)))


@dataclass(frozen=True)
class ChunkSizes:
    """How :func:`token_stats` splits [N, V] logits on a device (see :func:`chunk_sizes`).

    Attributes:
        rows: rows per kernel call (the default ``chunk_size``).
        upcast_rows: compiled kernel on bf16/fp16 logits — rows upcast per sub-chunk into one fp32 buffer (CPU);
            None when the compiled kernel reads bf16/fp16 directly (CUDA) or is not used (eager).
    """

    rows: int
    upcast_rows: int | None


def chunk_sizes(device: torch.device | str, vocab: int, backend: str = "auto",
                dtype: torch.dtype = torch.bfloat16) -> ChunkSizes:
    """Default chunking of the token-statistics kernels for logits [N, vocab] of ``dtype`` on ``device``.

    CPU (and any non-CUDA device): today's cache-sized chunks — compiled kernel 256 rows per call, bf16/fp16 upcast
    ``_UPCAST_BYTES`` (8 MiB) of fp32 rows at a time (13 rows at V = 151,936); eager kernel ~2.5 MiB buffers
    (4 rows).  CUDA: compiled kernel 4,096 rows per call reading bf16/fp16 directly; eager kernel 256 MiB buffers
    (441 rows).  Only the device's type matters: ``torch.device("cuda")`` works without a GPU.

    Args:
        device: the logits' device (``torch.device`` or a string such as ``"cuda:0"``).
        vocab: V, the logits' last dimension (≥ 1).
        backend: "auto" | "compiled" | "eager", as in :func:`token_stats` ("auto" after a failed compile: eager).
        dtype: the logits' dtype (float32 → no upcast).

    Returns:
        :class:`ChunkSizes`.

    Example:
        >>> chunk_sizes("cpu", 151_936, "compiled"), chunk_sizes("cuda", 151_936, "compiled")
        (ChunkSizes(rows=256, upcast_rows=13), ChunkSizes(rows=4096, upcast_rows=None))
    """
    if backend == "eager" or (backend == "auto" and _compile_error is not None):
        return ChunkSizes(rows=_eager_chunk_rows(vocab, device), upcast_rows=None)
    if _gpu_sizes(device):
        return ChunkSizes(rows=_CUDA_COMPILED_CHUNK_ROWS, upcast_rows=None)
    return ChunkSizes(rows=_COMPILED_CHUNK_ROWS, upcast_rows=None if dtype == torch.float32 else _upcast_rows(vocab))


@dataclass
class TokenStats:
    """Per-token statistics of the sampling distribution π = softmax(logits / T).

    Attributes:
        logprobs:  [B, T] (or [N]) fp32, log π(target) in nats; carries gradient to the logits.
        entropy:   [B, T] (or [N]) fp32, −Σ_v π(v) log π(v) in nats; detached unless
                   ``entropy_grad=True`` was passed to :func:`token_stats`.
        collision: [B, T] (or [N]) fp32, Σ_v π(v)² (probability that two draws coincide, in (0, 1]);
                   always detached.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    collision: torch.Tensor


# --------------------------------------------------------------------------------------------------
# Chunk kernels.  x: [n, V] logits chunk (fp32/bf16/fp16, rows may be strided, last dim may not).
# All kernels work in base 2: y = x · c with c = fp32(log2(e) / T), so that y = z / ln 2 and
# exp(z − max z) = exp2(y − max y)  (exp2 is ~1/3 cheaper than exp on CPU, eager and compiled).
# --------------------------------------------------------------------------------------------------


class _Workspace:
    """Two fp32 [chunk, V] buffers for the eager kernel, allocated on first use and reused by every
    chunk of one call (no per-chunk allocation: fresh pages are expensive, and the peak stays at
    exactly two chunk buffers)."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.rows, self.vocab, self.device = rows, vocab, device
        self.bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def upcast_buffer(self, n: int) -> torch.Tensor:
        """An fp32 [n, V] buffer (n ≤ :data:`_upcast_rows`) for the compiled kernel's bf16/fp16 path."""
        buf = getattr(self, "_upcast", None)
        if buf is None or buf.shape[0] < n:
            buf = self._upcast = torch.empty((n, self.vocab), dtype=torch.float32, device=self.device)  # [n, V]
        return buf[:n]

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bufs is None or n > self.rows:
            self.rows = max(self.rows, n)
            shape = (self.rows, self.vocab)
            self.bufs = (
                torch.empty(shape, dtype=torch.float32, device=self.device),  # [chunk, V]
                torch.empty(shape, dtype=torch.float32, device=self.device),  # [chunk, V]
            )
        return self.bufs[0][:n], self.bufs[1][:n]  # [n, V] each


def _fwd_sums_eager(x: torch.Tensor, c: float, ws: _Workspace) -> tuple[torch.Tensor, ...]:
    """Eager forward kernel, raw row sums → (m, Σe, Σe·(y−m), Σe²), each [n] fp32 (m in log2 units).

    e = 2^(y − m) with y = x · c; uses the two workspace buffers; torch.sum on CPU is a cascade sum,
    so fp32 accumulation is accurate (~1e-7 relative).  :func:`_finish_eager` turns the sums into
    statistics; :mod:`stapo.model.lm_head` merges the sums of vocabulary tiles instead.
    """
    d, e = ws.get(x.shape[0])  # [n, V] fp32 each
    d.copy_(x)  # [n, V] fp32 upcast (exact)
    if c != 1.0:
        d.mul_(c)  # [n, V] y = x · log2(e) / T
    m = d.amax(dim=-1, keepdim=True)  # [n, 1] row max of y
    d.sub_(m).clamp_(min=_LOG2_FLOOR)  # [n, V] y − m ∈ [−63, 0]  (NaN stays NaN)
    torch.exp2(d, out=e)  # [n, V] e = 2^(y − m) = exp(z − max z)
    torch.nn.functional.threshold_(e, _FLOOR_WEIGHT, 0.0)  # [n, V] e = 0 at the floor (−inf logits)
    s = e.sum(dim=-1)  # [n] Σ e
    s1 = d.mul_(e).sum(dim=-1)  # [n] Σ e·(y − m)
    s2 = e.square_().sum(dim=-1)  # [n] Σ e²
    return m.squeeze(-1), s, s1, s2


def _finish_eager(m, s, s1, s2) -> tuple[torch.Tensor, ...]:
    """(m, log2 s, entropy, collision), each [n] fp32, from the eager kernel's fp32 row sums."""
    log2_s = torch.log2(s)  # [n]
    entropy = (log2_s - s1 / s) * _LN2  # [n] nats
    collision = s2 / (s * s)  # [n]
    return m, log2_s, entropy, collision


def _fwd_chunk_eager(x: torch.Tensor, c: float, ws: _Workspace) -> tuple[torch.Tensor, ...]:
    """Eager forward kernel → (m, log2 s, entropy, collision), each [n] fp32 (m, log2 s in log2 units)."""
    return _finish_eager(*_fwd_sums_eager(x, c, ws))


def _fwd_chunk_fused(x: torch.Tensor, c: float) -> tuple[torch.Tensor, ...]:
    """Body of the compiled forward kernel → (m [n, 1] fp32, Σe, Σe·(y−m), Σe² [n] fp64).

    Written as one expression graph for inductor, which fuses it into ONE loop over rows, each row
    read twice back to back (max, then the three sums; the second read hits the cache) with no
    [n, V] intermediate.  Sums are accumulated in fp64 (see module docstring).  The O(n) epilogue
    is left to :func:`_finish_fused`: inside the graph it stops inductor from fusing the two row loops.
    """
    y = x.float() * c  # [n, V] fp32 (virtual: fused, never stored)
    m = y.amax(dim=-1, keepdim=True)  # [n, 1]
    d = (y - m).clamp_min(_LOG2_FLOOR)  # [n, V] y − m ∈ [−63, 0], finite for −inf logits
    e = torch.where(d > _LOG2_FLOOR, d.exp2(), 0.0)  # [n, V] fp32, 0 at the floor
    s = e.double().sum(dim=-1)  # [n] fp64 Σ e
    s1 = (e * d).double().sum(dim=-1)  # [n] fp64 Σ e·(y − m)
    s2 = (e * e).double().sum(dim=-1)  # [n] fp64 Σ e²
    return m, s, s1, s2


def _finish_fused(m, s, s1, s2) -> tuple[torch.Tensor, ...]:
    """(m [n] fp32, log2 s [n] fp64, entropy, collision [n] fp32) from fp64 row sums (m: [n] fp32)."""
    log2_s = s.log2()  # [n] fp64
    entropy = ((log2_s - s1 / s) * _LN2).float()  # [n] fp32, nats
    collision = (s2 / (s * s)).float()  # [n] fp32
    return m, log2_s, entropy, collision


def _bwd_chunk_eager(
    out: torch.Tensor,
    x: torch.Tensor,
    m: torch.Tensor,
    log2_s: torch.Tensor,
    entropy: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_h: torch.Tensor | None,
    tgt: torch.Tensor,
    c: float,
    inv_t: float,
    ws: _Workspace,
    tgt_inside: bool = True,
) -> None:
    """Eager backward kernel: writes d loss / d x for one chunk into ``out`` ([n, V], x's dtype).

    out = (g_lp · (onehot − π) − g_h · π (log π + H)) / T, using the two workspace buffers;
    ``m`` and ``log2_s`` [n] are the forward's row max of y and log2 Σ 2^(y − m): log2 π = y − m − log2 s.
    ``tgt`` [n] are column indices in this chunk; with ``tgt_inside=False`` they may lie outside
    [0, V) (a vocabulary tile that does not hold the row's target: no one-hot term for that row).
    """
    lp, p = ws.get(x.shape[0])  # [n, V] fp32 each
    lp.copy_(x)  # [n, V] fp32 upcast
    if c != 1.0:
        lp.mul_(c)  # [n, V] y
    lp.sub_(m.unsqueeze(-1)).sub_(log2_s.unsqueeze(-1)).clamp_(min=_LOG2_FLOOR)  # [n, V] log2 π
    torch.exp2(lp, out=p)  # [n, V] π
    torch.nn.functional.threshold_(p, _FLOOR_WEIGHT, 0.0)  # [n, V] π = 0 at the floor (−inf logits)
    if g_h is not None:
        assert entropy is not None
        lp.mul_(_LN2).add_(entropy.unsqueeze(-1)).mul_(g_h.unsqueeze(-1))  # [n, V] g_h (log π + H)
        if g_lp is not None:
            lp.add_(g_lp.unsqueeze(-1))  # [n, V] g_lp + g_h (log π + H)
        grad = lp.mul_(p).neg_()  # [n, V] −π (g_lp + g_h (log π + H))
    else:
        assert g_lp is not None
        grad = p.mul_(-g_lp.unsqueeze(-1))  # [n, V] −g_lp π
    if g_lp is not None:
        rows = torch.arange(x.shape[0], device=x.device)  # [n]
        if tgt_inside:
            grad[rows, tgt] += g_lp  # [n, V] + g_lp · onehot(target)
        else:  # vocabulary tile: a target outside [0, V) of this chunk adds no one-hot term
            v = x.shape[1]
            inside = (tgt >= 0) & (tgt < v)  # [n] bool
            grad[rows, tgt.clamp(0, v - 1)] += torch.where(inside, g_lp, 0.0)  # [n, V] + 0 off-tile
    if inv_t != 1.0:
        grad.mul_(inv_t)  # [n, V] chain rule through z = x / T
    out.copy_(grad)  # cast to the logits' dtype


def _bwd_chunk_fused(
    out: torch.Tensor,
    x: torch.Tensor,
    m: torch.Tensor,
    log2_s: torch.Tensor,
    entropy: torch.Tensor,
    g_lp: torch.Tensor,
    g_h: torch.Tensor,
    tgt: torch.Tensor,
    c: float,
    inv_t: float,
) -> None:
    """Body of the compiled backward kernel; all per-row inputs are [n] fp32 (zeros when unused).

    Inductor fuses it into a single pass that writes ``out`` in place (no [n, V] intermediate).
    A target index outside [0, V) matches no column, so it adds no one-hot term (vocabulary tiles).
    """
    lp2 = (x.float() * c - m.unsqueeze(-1) - log2_s.unsqueeze(-1)).clamp_min(_LOG2_FLOOR)  # [n, V]
    p = torch.where(lp2 > _LOG2_FLOOR, lp2.exp2(), 0.0)  # [n, V] π, 0 at the floor
    g = -p * (g_lp.unsqueeze(-1) + g_h.unsqueeze(-1) * (lp2 * _LN2 + entropy.unsqueeze(-1)))  # [n, V]
    hit = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == tgt.unsqueeze(-1)  # [n, V] bool
    g = torch.where(hit, g + g_lp.unsqueeze(-1), g)  # [n, V] + g_lp · onehot(target)
    out.copy_(g * inv_t)  # [n, V] in out's dtype


# --------------------------------------------------------------------------------------------------
# Compiled-kernel management: lazy compilation, one-time fallback for backend="auto".
# --------------------------------------------------------------------------------------------------

_COMPILE_OPTIONS = {"cpp.dynamic_threads": True}
_compiled_kernels: dict[str, Callable] = {}
_compile_error: BaseException | None = None
_lock = threading.Lock()


def _get_compiled(name: str) -> Callable:
    with _lock:
        fn = _compiled_kernels.get(name)
        if fn is None:
            body = {"fwd": _fwd_chunk_fused, "bwd": _bwd_chunk_fused}[name]
            # cpp.dynamic_threads: always emit an OpenMP parallel loop and let the runtime pick the
            # thread count.  Otherwise inductor decides serial-vs-parallel from the FIRST call's
            # sizes (a tiny first call gives a serial kernel, 2x slower on 2 cores for large
            # inputs) and bakes the thread count in, and its on-disk cache then hands that kernel
            # to later processes whatever their sizes or thread counts.
            fn = torch.compile(body, dynamic=True, fullgraph=True, options=_COMPILE_OPTIONS)
            _compiled_kernels[name] = fn
        return fn


def _use_compiled(backend: str) -> bool:
    return backend == "compiled" or (backend == "auto" and _compile_error is None)


def _compiled_failed(backend: str, exc: BaseException) -> None:
    """Record a compile failure; re-raise for backend="compiled", warn once for "auto"."""
    global _compile_error
    if backend == "compiled":
        raise RuntimeError(
            f"token_stats: the torch.compile'd kernel failed ({type(exc).__name__}: {exc}); "
            'use backend="eager" or backend="auto" (which falls back to eager)'
        ) from exc
    if _compile_error is None:
        _compile_error = exc
        warnings.warn(
            f"token_stats: torch.compile of the fused kernel failed ({type(exc).__name__}: {exc}); "
            "falling back to the eager kernel for the rest of this process",
            RuntimeWarning,
            stacklevel=3,
        )


def _no_duck_shapes():
    """Context in which dynamo does not tie equal sizes together (e.g. n == V == 3), if supported."""
    try:
        from torch.fx.experimental import _config as fx_config

        return fx_config.patch(use_duck_shape=False)
    except Exception:  # noqa: BLE001 - private config moved/removed: accept the rare recompilation
        return contextlib.nullcontext()


def _fwd_chunk_sums(x: torch.Tensor, c: float, backend: str, ws: _Workspace) -> tuple[torch.Tensor, ...]:
    """Raw row sums of one chunk x [n, V] → (m [n] fp32, Σe, Σe·(y−m), Σe² [n]), e = 2^(y − m), y = x·c.

    The sums are fp64 from the compiled kernel, fp32 from the eager one (cascade-summed).
    """
    if x.shape[0] >= 2 and _use_compiled(backend):
        try:
            with _no_duck_shapes():
                if x.dtype != torch.float32 and not _gpu_sizes(x.device):  # CPU: upcast sub-chunks; CUDA: direct
                    return _fwd_sums_upcast(x, c, ws)
                # detach(): a plain (non-view, requires_grad=False) alias, so that dynamo guards on
                # neither the autograd flag nor the layout of the tensor the chunk was sliced from.
                m, s, s1, s2 = _get_compiled("fwd")(x.detach(), c)  # [n, 1] fp32, [n] fp64 ×3
            return m.squeeze(-1), s, s1, s2
        except Exception as exc:  # noqa: BLE001 - any compile/codegen error → fallback or re-raise
            _compiled_failed(backend, exc)
    return _fwd_sums_eager(x, c, ws)


def _fwd_sums_upcast(x: torch.Tensor, c: float, ws: _Workspace) -> tuple[torch.Tensor, ...]:
    """Compiled forward on a bf16/fp16 chunk x [n, V]: sub-chunks of :func:`_upcast_rows` rows are upcast
    (exactly) into one fp32 buffer and run through the fp32 kernel → (m [n] fp32, Σe, Σe·(y−m), Σe² [n] fp64)."""
    if ws.vocab != x.shape[1]:
        ws = _Workspace(1, x.shape[1], x.device)
    parts = []
    for a, b in _chunks(x.shape[0], _upcast_rows(x.shape[1]), "compiled"):
        buf = ws.upcast_buffer(b - a)  # [b − a, V] fp32
        buf.copy_(x[a:b])  # exact upcast
        m, s, s1, s2 = _get_compiled("fwd")(buf, c)  # [b − a, 1] fp32, [b − a] fp64 ×3
        parts.append((m.squeeze(-1), s, s1, s2))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat([q[i] for q in parts]) for i in range(4))  # [n] each


def _fwd_chunk(x: torch.Tensor, c: float, backend: str, ws: _Workspace):
    """(m, log2 s, entropy, collision) [n] of one chunk (log2 s fp64 from the compiled kernel)."""
    m, s, s1, s2 = _fwd_chunk_sums(x, c, backend, ws)
    if s.dtype == torch.float64:
        return _finish_fused(m, s, s1, s2)
    return _finish_eager(m, s, s1, s2)


def _bwd_chunk(out, x, m, log2_s, entropy, g_lp, g_h, tgt, c, inv_t, backend, ws, tgt_inside=True) -> None:
    """d loss / d x of one chunk into ``out`` (see :func:`_bwd_chunk_eager`; ``tgt`` may fall outside
    the chunk's columns when ``tgt_inside`` is False)."""
    if x.shape[0] >= 2 and _use_compiled(backend):

        def row_arg(t: torch.Tensor | None) -> torch.Tensor:
            # [n] fp32, contiguous (upstream grads are often stride-0 expands), distinct tensors
            # (dynamo guards on aliasing between arguments), zeros for an absent term.
            if t is None:
                return torch.zeros_like(m)
            return t.detach().float().contiguous()

        try:
            with _no_duck_shapes():
                _get_compiled("bwd")(
                    out.detach(),
                    x.detach(),
                    row_arg(m),
                    row_arg(log2_s),
                    row_arg(entropy),
                    row_arg(g_lp),
                    row_arg(g_h),
                    tgt.detach(),
                    c,
                    inv_t,
                )
            return
        except Exception as exc:  # noqa: BLE001
            _compiled_failed(backend, exc)
    _bwd_chunk_eager(out, x, m, log2_s, entropy, g_lp, g_h, tgt, c, inv_t, ws, tgt_inside)


# --------------------------------------------------------------------------------------------------
# Row blocks and chunking (no copy of the logits, even for non-contiguous views such as
# logits[:, :-1]).
# --------------------------------------------------------------------------------------------------


def _row_blocks(t: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Split [N, V] or [B, T, V] into 2-D row blocks ([rows, V] views) with their first flat row."""
    if t.dim() == 2:
        return [(t, 0)]
    b, tt, v = t.shape
    try:
        return [(t.view(b * tt, v), 0)]  # [B·T, V] view when the strides allow it
    except RuntimeError:
        return [(t[i], i * tt) for i in range(b)]  # [T, V] views


def _chunks(n: int, chunk: int, backend: str) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of at most ``chunk`` rows (compiled: a trailing lone row is merged)."""
    bounds = [(i, min(i + chunk, n)) for i in range(0, n, chunk)]
    if backend != "eager" and chunk >= 2 and len(bounds) >= 2 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]  # avoid a 1-row compiled call (size-1 specialisation)
    return bounds


def _default_chunk(vocab: int, backend: str, device: torch.device | str | None = None) -> int:
    """Default rows per chunk (:func:`chunk_sizes`; ``device`` None → the CPU sizes)."""
    if backend == "eager" or (backend == "auto" and _compile_error is not None):
        return _eager_chunk_rows(vocab, device)
    return _CUDA_COMPILED_CHUNK_ROWS if _gpu_sizes(device) else _COMPILED_CHUNK_ROWS


class _TokenStatsFunction(torch.autograd.Function):
    """Autograd wrapper: outputs (logprobs [N], entropy [N], collision [N]), all fp32.

    Saved for backward: the logits (a reference, no copy), targets [N], and per row (fp32 [N]): the
    max m of y = x·log2(e)/T, log2 s = log2 Σ 2^(y − m) (log-partition = ln2·(m + log2 s)) and, with
    entropy_grad, the entropy.
    """

    @staticmethod
    def forward(ctx, logits, targets, c, inv_t, entropy_grad, chunk, backend):  # noqa: D401
        n_rows = targets.numel()
        dev = logits.device
        logprobs = torch.empty(n_rows, dtype=torch.float32, device=dev)  # [N] nats
        row_max = torch.empty(n_rows, dtype=torch.float32, device=dev)  # [N] max y, log2 units
        row_log2_s = torch.empty(n_rows, dtype=torch.float32, device=dev)  # [N] log2 Σ 2^(y − m)
        entropy = torch.empty(n_rows, dtype=torch.float32, device=dev)  # [N] nats
        collision = torch.empty(n_rows, dtype=torch.float32, device=dev)  # [N]
        ws = _Workspace(min(chunk, max(n_rows, 1)), logits.shape[-1], dev)  # eager buffers, lazy
        for block, row0 in _row_blocks(logits):
            for a, b in _chunks(block.shape[0], chunk, backend):
                x = block[a:b]  # [n, V] view, logits' dtype
                r = slice(row0 + a, row0 + b)
                m, log2_s, ent, coll = _fwd_chunk(x, c, backend, ws)  # [n] each
                y_tgt = x.gather(1, targets[r].unsqueeze(-1)).squeeze(-1).float() * c  # [n] fp32
                # log p = ln2 · ((y_t − m) − log2 s): the difference y_t − m is taken first, in fp32,
                # so a large row max does not cost precision.
                logprobs[r] = ((y_tgt - m).double() - log2_s.double()) * _LN2
                row_max[r] = m
                row_log2_s[r] = log2_s
                entropy[r] = ent
                collision[r] = coll

        ctx.c, ctx.inv_t, ctx.chunk, ctx.backend = c, inv_t, chunk, backend
        ctx.entropy_grad = entropy_grad
        ctx.save_for_backward(logits, targets, row_max, row_log2_s, entropy if entropy_grad else None)
        ctx.set_materialize_grads(False)
        if entropy_grad:
            ctx.mark_non_differentiable(collision)  # (one call: each call replaces the set)
        else:
            ctx.mark_non_differentiable(entropy, collision)
        return logprobs, entropy, collision

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logprobs, g_entropy, g_collision):
        logits, targets, row_max, row_log2_s, entropy = ctx.saved_tensors
        if not ctx.entropy_grad:
            g_entropy = None
        if g_logprobs is None and g_entropy is None:
            return None, None, None, None, None, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [.., V]
        grad_rows = grad.view(-1, logits.shape[-1])  # [N, V] contiguous
        ws = _Workspace(min(ctx.chunk, max(targets.numel(), 1)), logits.shape[-1], logits.device)
        for block, row0 in _row_blocks(logits):
            for a, b in _chunks(block.shape[0], ctx.chunk, ctx.backend):
                r = slice(row0 + a, row0 + b)
                _bwd_chunk(
                    grad_rows[r],  # [n, V] written in place
                    block[a:b],  # [n, V]
                    row_max[r],
                    row_log2_s[r],
                    entropy[r] if g_entropy is not None else None,
                    g_logprobs[r].float() if g_logprobs is not None else None,
                    g_entropy[r].float() if g_entropy is not None else None,
                    targets[r],
                    ctx.c,
                    ctx.inv_t,
                    ctx.backend,
                    ws,
                )
        return grad, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------------------


def _fp32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _validate(logits, targets, temperature, chunk_size, backend) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor (token ids, int64), got {targets.dtype}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must have shape [B, T, V] or [N, V], got {tuple(logits.shape)}")
    if targets.dim() != logits.dim() - 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
            f"got {tuple(targets.shape)}"
        )
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a non-empty vocabulary dimension (V >= 1)")
    if targets.device != logits.device:
        raise ValueError(f"targets are on {targets.device} but logits are on {logits.device}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    if not (math.isfinite(float(temperature)) and float(temperature) > 0.0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be None or an integer >= 1, got {chunk_size!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if targets.numel():
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one host sync (GPU)
        if lo < 0 or hi >= logits.shape[-1]:
            raise ValueError(
                f"targets must be token ids in [0, V={logits.shape[-1]}), got values in [{lo}, {hi}] "
                "(map padding/ignore ids such as -100 to a valid id and mask the result instead)"
            )


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy_grad: bool = False,
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> TokenStats:
    """Log-prob of each target token, full-vocabulary entropy and collision probability.

    The distribution is π = softmax(logits / temperature) over the last dimension (docs/method.md#token-statistics:
    p_{i,t} and H_{i,t} use the rollout temperature, in fp32; docs/method.md#token-analysis: Σ_v π(v)²).  Computed in
    fp32, in
    chunks of rows, without a full fp32 copy of the logits or a full softmax, forward and backward.

    Args:
        logits: [B, T, V] or [N, V] (packed tokens), float32, bfloat16 or float16.  Rows may be a
            strided view (e.g. ``logits[:, :-1]``); the last dimension is the vocabulary.  −inf
            entries are allowed (see the module docstring for all-−inf / +inf / NaN rows).
        targets: [B, T] or [N] (= logits.shape[:-1]) integer token ids in [0, V), on the logits'
            device; converted to int64.
        temperature: sampling temperature T > 0 (finite).  Internally the logits are multiplied
            by the fp32 value of log2(e)/T (base-2 kernels, see the module docstring).
        entropy_grad: if True, ``entropy`` is differentiable w.r.t. the logits (backward recomputes
            the softmax chunk by chunk); otherwise it is detached (``requires_grad`` False).
        chunk_size: rows per chunk.  None → the default for the logits' device and the backend
            (:func:`chunk_sizes`; CPU — eager: ~2.5 MiB per fp32 chunk buffer, 4 rows at V = 151,936; compiled:
            256 rows, the kernel allocates no [rows, V] buffer; CUDA — eager: 256 MiB buffers, compiled: 4,096).
            Peak extra memory of the eager kernel ≈ 2 · chunk_size · V · 4 bytes.
        backend: "compiled" (torch.compile'd fused kernel; raises RuntimeError if it fails),
            "eager" (plain PyTorch ops), or "auto" (compiled, falling back to eager with a one-time
            RuntimeWarning if compilation fails).

    Returns:
        :class:`TokenStats` with ``logprobs``, ``entropy`` and ``collision``, each fp32 with shape
        ``targets.shape``.  ``logprobs`` carries the gradient to ``logits`` (returned in the
        logits' dtype); ``collision`` is always detached.

    Raises:
        TypeError: logits/targets not tensors; logits dtype not float32/bfloat16/float16; targets
            not an integer dtype; temperature not a real number.
        ValueError: logits not 2-D/3-D; targets shape != logits.shape[:-1]; V == 0; different
            devices; temperature <= 0 or not finite; target ids outside [0, V); chunk_size < 1;
            unknown backend.
        RuntimeError: backend="compiled" and torch.compile fails.

    Example:
        >>> import torch
        >>> logits = torch.zeros(2, 3, 4)                    # [B=2, T=3, V=4], uniform π
        >>> st = token_stats(logits, torch.zeros(2, 3, dtype=torch.long), 0.7, backend="eager")
        >>> st.entropy.shape, round(st.entropy[0, 0].item(), 6)   # ln 4 nats
        (torch.Size([2, 3]), 1.386294)
        >>> round(st.logprobs[0, 0].item(), 6), st.collision[0, 0].item()   # −ln 4, 1/4
        (-1.386294, 0.25)
    """
    _validate(logits, targets, temperature, chunk_size, backend)
    out_shape = targets.shape
    flat_targets = targets.reshape(-1).to(torch.int64)  # [N]
    inv_t = _fp32(1.0 / float(temperature))  # fp32-rounded 1/T (backward chain rule)
    c = _fp32(_LOG2E / float(temperature))  # fp32-rounded log2(e)/T: y = x·c = z / ln 2
    chunk = int(chunk_size) if chunk_size is not None else _default_chunk(logits.shape[-1], backend, logits.device)
    logprobs, entropy, collision = _TokenStatsFunction.apply(
        logits, flat_targets, c, inv_t, bool(entropy_grad), chunk, backend
    )
    return TokenStats(
        logprobs=logprobs.view(out_shape),  # [B, T] / [N]
        entropy=entropy.view(out_shape),  # [B, T] / [N]
        collision=collision.view(out_shape),  # [B, T] / [N]
    )

"""What the machine can do and what a training step asks of it: CPU features, measured GEMM rate and memory
bandwidth, and the FLOPs / bytes of each stage of a step (the utilisation report of
``scripts/bench_train_step.py``; issue 15).

FLOP convention (the usual model-FLOPs count, as in the PaLM / Megatron MFU papers): a matmul of [M, K] by
[K, N] is 2·M·K·N FLOPs; attention counts QKᵀ and PV over the causal keys only (query t of a sequence
attends to t + 1 keys); norms, activations, RoPE and the softmax are left out (they are a few percent at
these shapes). A backward pass is 2× its forward (the gradients of the inputs and of the weights).

Worked example (SmolLM2-135M: d = 576, 30 layers, 9 query / 3 key-value heads of 64, MLP 1536, V = 49,152):

    per-layer linear parameters = 576·576 (q) + 2·576·192 (k, v) + 576·576 (o) + 3·576·1536 (MLP) = 3,538,944
    forward FLOPs of one token = 2 · 30 · 3,538,944 ≈ 0.212 GFLOP   (+ 2·576·49,152 ≈ 0.057 GFLOP if its
                                 logits are computed, + 4·30·576·keys for attention)
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

__all__ = ["ModelShape", "cpu_flags", "native_bf16", "machine_line", "gemm_rate", "memory_bandwidth",
           "prefill_work", "decode_work", "forward_work", "Work", "PEAK_FLOPS", "peak_flops", "update_flops",
           "mfu", "max_memory_gb"]


# --- the machine ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (Linux; empty elsewhere), e.g. ``avx2``, ``avx512f``,
    ``avx512_bf16``, ``amx_bf16``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> bool:
    """True when the CPU computes bf16 dot products natively (AVX512-BF16 or AMX-BF16): where bf16 matmuls
    are faster than fp32 ones rather than emulated."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def machine_line() -> str:
    """One line naming the CPU, its core count, the SIMD flags that decide kernel speed, and torch's version,
    e.g. ``AMD EPYC, 2 cores, flags avx2 avx512f avx512_bf16, torch 2.13.0+cpu, 2 threads``, followed by
    ``, kernels capped at ATEN_CPU_CAPABILITY=avx2`` when that variable is set."""
    import os
    import platform

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    flags = " ".join(f for f in wanted if f in cpu_flags()) or "none of " + "/".join(wanted)
    # ATEN_CPU_CAPABILITY caps the SIMD level ATen's kernels and inductor's generated code use (e.g. avx2 on an
    # AVX-512 CPU: the code paths of an AVX2-only machine, not its micro-architecture)
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    return (f"{name}, {os.cpu_count()} cores, flags {flags}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads" + (f", kernels capped at ATEN_CPU_CAPABILITY={cap}" if cap else ""))


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up (allocator, kernel selection)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rate(shapes: Sequence[tuple[int, int, int]], dtype: torch.dtype = torch.float32, reps: int = 3,
              seed: int = 0) -> float:
    """Measured matmul rate over ``shapes`` in GFLOP/s: Σ 2·M·K·N / Σ (median time of [M, K] @ [K, N]).

    The FLOP-weighted rate of exactly the products a workload runs (pass the model's own shapes), so one
    slow shape counts as much as its share of the work. Inputs are random normal in ``dtype``; the output
    is in ``dtype`` (bf16 @ bf16 → bf16, as under ``torch.autocast``).

    Raises:
        ValueError: no shapes, or a non-positive size.
    """
    if not shapes:
        raise ValueError("gemm_rate: no shapes")
    g = torch.Generator().manual_seed(seed)
    flops = secs = 0.0
    for m, k, n in shapes:
        if min(m, k, n) < 1:
            raise ValueError(f"gemm_rate: shape {(m, k, n)} has a non-positive size")
        a = torch.randn(m, k, generator=g).to(dtype)  # [M, K]
        b = torch.randn(k, n, generator=g).to(dtype)  # [K, N]
        out = torch.empty(m, n, dtype=dtype)  # [M, N]
        secs += _median_time(lambda: torch.matmul(a, b, out=out), reps)
        flops += 2.0 * m * k * n
    return flops / secs / 1e9


def memory_bandwidth(gib: float = 1.0, reps: int = 3) -> dict[str, float]:
    """Measured DRAM bandwidth in GB/s (10⁹ bytes): ``read`` (a sum over a ``gib``-GiB fp32 tensor — what a
    decode step does with the weights) and ``copy`` (read + write bytes of a copy)."""
    n = int(gib * 2**30 // 4)
    x = torch.ones(n, dtype=torch.float32)  # touched: its pages exist
    y = torch.empty_like(x)
    y.fill_(0.0)
    read = _median_time(lambda: x.sum(), reps)
    copy = _median_time(lambda: y.copy_(x), reps)
    return {"read": 4.0 * n / read / 1e9, "copy": 8.0 * n / copy / 1e9}


# --- the model ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder-only transformer's FLOPs and bytes (Llama / Qwen layout: q, k, v, o
    projections and a gated MLP of three matrices per layer; output embedding of ``vocab_rows`` rows).

    Attributes:
        hidden: d. intermediate: the MLP width. layers: L. heads / kv_heads: query and key-value heads.
        head_dim: per head. vocab_rows: rows of the output embedding (≥ the tokenizer's vocabulary).
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_rows: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelShape":
        """From a transformers config (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (default d / heads), ``vocab_size``)."""
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        return cls(hidden=int(cfg.hidden_size), intermediate=int(cfg.intermediate_size),
                   layers=int(cfg.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   vocab_rows=int(cfg.vocab_size))

    @property
    def layer_linear_params(self) -> int:
        """Weights of one layer's matmuls: q, k, v, o and the gated MLP (gate, up, down)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return d * q + 2 * d * kv + q * d + 3 * d * self.intermediate

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab_rows

    def linear_shapes(self, tokens: int, backward: bool = False) -> list[tuple[int, int, int]]:
        """The (M, K, N) matmuls of one layer plus the LM head for ``tokens`` rows (forward; with
        ``backward`` also the input-gradient [M, N] @ [N, K] and weight-gradient [N, M] @ [M, K] products) —
        the shapes :func:`gemm_rate` should be measured at."""
        d, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        fwd = [(tokens, d, q), (tokens, d, kv), (tokens, d, kv), (tokens, q, d), (tokens, d, i), (tokens, d, i),
               (tokens, i, d), (tokens, d, self.vocab_rows)]
        if not backward:
            return fwd
        return fwd + [(m, n, k) for m, k, n in fwd] + [(n, m, k) for m, k, n in fwd]

    def weight_bytes(self, itemsize: int) -> int:
        """Bytes of the weights a forward reads once: every layer's matmuls and the output embedding."""
        return (self.layers * self.layer_linear_params + self.lm_head_params) * itemsize

    def kv_bytes_per_key(self, itemsize: int) -> int:
        """KV-cache bytes one cached token occupies (and a query reads): K and V of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class Work:
    """FLOPs and DRAM bytes of one stage (either may be 0 where it is not the stage's bound)."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes)

    def scaled(self, k: float) -> "Work":
        return Work(self.flops * k, self.bytes * k)


def _forward_flops(shape: ModelShape, positions: int, keys: int, lm_positions: int) -> float:
    """2·L·(layer params)·positions + 4·L·(heads·head_dim)·keys + 2·d·V_rows·lm_positions."""
    return (2.0 * shape.layers * shape.layer_linear_params * positions
            + 4.0 * shape.layers * shape.heads * shape.head_dim * keys
            + 2.0 * shape.lm_head_params * lm_positions)


def _causal_keys(length: int, offset: int = 0) -> int:
    """Σ over queries t = offset … offset+length−1 of (t + 1) keys."""
    return length * offset + length * (length + 1) // 2


def prefill_work(shape: ModelShape, prompt_lengths: Iterable[int]) -> Work:
    """Forward FLOPs of prefilling ``prompt_lengths`` (one logits row per prompt: the first sampled token)."""
    lengths = [int(p) for p in prompt_lengths]
    return Work(flops=_forward_flops(shape, sum(lengths), sum(_causal_keys(p) for p in lengths), len(lengths)))


def decode_work(shape: ModelShape, prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                itemsize: int) -> Work:
    """Decode of each response after its prompt: one forward (with logits) per generated token after the
    first, whose logits came from the prefill.

    Bytes (the bandwidth floor): the sequences decode together, so every decode step reads the weights once
    — (max response length − 1) × :meth:`ModelShape.weight_bytes` — and each query reads its cached keys
    and values (:meth:`ModelShape.kv_bytes_per_key` per key).

    Raises:
        ValueError: the two length lists differ in length.
    """
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError(f"decode_work: {len(prompt_lengths)} prompts but {len(response_lengths)} responses")
    positions = keys = 0
    for p, r in zip(prompt_lengths, response_lengths):
        n = max(int(r) - 1, 0)  # tokens 1 … r−1 are each one decode forward
        positions += n
        keys += _causal_keys(n, offset=int(p))  # token j ≥ 1 comes from position p + j − 1: p + j keys
    steps = max((max(int(r) for r in response_lengths) - 1) if response_lengths else 0, 0)
    byts = steps * shape.weight_bytes(itemsize) + keys * shape.kv_bytes_per_key(itemsize)
    return Work(flops=_forward_flops(shape, positions, keys, positions), bytes=float(byts))


def forward_work(shape: ModelShape, rows: int, prompt_width: int, response_width: int, *, prompts: int | None = None
                 ) -> Work:
    """Forward FLOPs of the trainer's pass over a (trimmed) micro-batch of ``rows`` rows, ``prompt_width``
    prompt and ``response_width`` response columns, as :func:`stapo.train.policy.policy_logits` executes it
    (padding included: the matmuls run over it). ``prompts``: the number of distinct prompts when the prompt
    is shared (``actor.share_prompt``): a prompt pass over ``prompts`` × P, then ``rows`` × (R − 1) response
    positions attending to the cached prompt; None: every row runs P + R positions. Logits for R (+1 without
    sharing) positions per row (``logits_to_keep``).

    Example: 16 rows, P = 95, R = 128, 2 prompts → 2·95 + 16·127 = 2,222 positions instead of 16·223 = 3,568.
    """
    P, R = int(prompt_width), int(response_width)
    if prompts is None:  # logits_to_keep = R + 1 (the last one is dropped)
        positions, keys, lm = rows * (P + R), rows * _causal_keys(P + R), rows * (R + 1)
    else:  # the prompt pass's last logits + the response pass's R − 1
        positions = prompts * P + rows * max(R - 1, 0)
        keys = prompts * _causal_keys(P) + rows * _causal_keys(max(R - 1, 0), offset=P)
        lm = rows * R
    return Work(flops=_forward_flops(shape, positions, keys, lm))


def fraction(achieved_s: float, floor_s: float) -> float:
    """floor / achieved (1.0 = at the machine's limit); NaN when either is not positive."""
    return floor_s / achieved_s if achieved_s > 0 and floor_s > 0 else math.nan


# --- logged utilisation: perf/mfu/actor, perf/max_memory_allocated_gb ------------------------------------------
#: Dense bf16/fp16 tensor-core peak FLOP/s of one GPU (no sparsity), by a substring of ``torch.cuda.get_device_name``,
#: the first match in this order (vendor datasheets; the same figures as verl's ``get_device_flops``). A device not
#: here has no known peak: ``trainer.peak_flops`` sets one.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
    ("H20", 148e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12),
    ("A40", 149.7e12), ("L20", 119.5e12), ("L4", 121e12),
)


def peak_flops(device_name: str | None, compute_dtype: str, configured: float | None = None) -> float | None:
    """Peak FLOP/s of one device for the MFU: ``configured`` (``trainer.peak_flops``) when set; else the
    :data:`PEAK_FLOPS` entry whose key is in ``device_name`` (a CUDA device's name) when ``compute_dtype`` is
    ``bfloat16`` or ``float16`` (the table's peaks are for those); else None (unknown: MFU is not logged).

    Example: ``peak_flops("NVIDIA H100 80GB HBM3", "bfloat16")`` → 989e12; ``peak_flops("NVIDIA H100 PCIe",
    "bfloat16")`` → 756e12; ``peak_flops(None, "float32")`` → None; ``peak_flops(None, "float32", 1e12)`` → 1e12.
    """
    if configured is not None:
        return float(configured)
    if not device_name or compute_dtype not in ("bfloat16", "float16"):
        return None
    return next((v for key, v in PEAK_FLOPS if key in device_name), None)


def update_flops(shape: ModelShape, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> float:
    """Model FLOPs of the policy update over these rows: 3 × the forward of each row at its real length (prompt +
    response positions, logits for its response positions + 1; forward + backward = 3 forwards, this module's
    convention). Padding, recompute (gradient checkpointing) and the no-grad passes are not counted.

    Example (:class:`ModelShape` d = 4, 1 layer, 1 head of 4, MLP 8, V = 10; layer params 16 + 2·16 + 16 + 3·32 =
    160): one row of 2 + 1 tokens: forward = 2·160·3 + 4·4·6 (keys 1 + 2 + 3) + 2·40·2 = 960 + 96 + 160 = 1,216;
    ``update_flops`` = 3,648.

    Raises:
        ValueError: the two length lists differ in length.
    """
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError(f"update_flops: {len(prompt_lengths)} prompts but {len(response_lengths)} responses")
    total = 0.0
    for p, r in zip(prompt_lengths, response_lengths):
        n = int(p) + int(r)
        total += _forward_flops(shape, n, _causal_keys(n), int(r) + 1)
    return 3.0 * total


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops / (seconds · peak)`` (a fraction), or None when ``peak`` is unknown or
    ``seconds`` is not positive."""
    if peak is None or peak <= 0 or seconds <= 0:
        return None
    return flops / (seconds * peak)


def max_memory_gb(device: Any = None) -> float:
    """Peak memory of this process so far in GiB (2^30 bytes; verl's ``perf/max_memory_allocated_gb``): on a CUDA
    ``device`` ``torch.cuda.max_memory_allocated`` (tensors allocated by PyTorch on that GPU); otherwise the
    process's peak resident set size, ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux, bytes on
    macOS) — everything the process held in RAM, not only tensors."""
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20

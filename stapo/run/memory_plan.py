"""GPU memory per phase of a training step, per GPU: what ``train.py`` checks at start-up and ``train.py --dry-run``
and ``scripts/memory_plan.py`` print (issue 30, item 5). Arithmetic, not a measurement.

A pure function of the resolved config, the model's shape, the number of ranks and the device memory
(:func:`plan_memory`) gives a :class:`MemoryPlan`: for each phase of a step the terms resident on one GPU, each with
its value and the formula it comes from, and which of them belong to the vLLM engine. The phases, in the order a
step runs them (``stapo/train/trainer.py``; the engine's memory per phase follows verl / TRL's colocated route):

* ``rollout`` — the engine awake (``rollout.gpu_memory_utilization`` × device memory: its bf16 weights, KV cache,
  activations, CUDA graphs) while the trainer's resident state stays on the GPU (parameters, AdamW moments, the
  GRPO reference; no gradients: they are freed after the last optimizer step of a step);
* ``old pass`` — the old-policy log-probs (no grad), the engine asleep (``rollout.sleep_level``: 1 = weights to
  host memory, 2 = weights dropped; either way only a residual stays: CUDA graphs, buffers);
* ``reference pass`` — GRPO (β > 0) only: the frozen reference model's log-probs (no grad), the engine asleep;
* ``update`` — forward + backward of one micro-batch (or the optimizer step, whichever is larger), gradients
  allocated, the engine asleep;
* ``sync`` — the staged wake-up: the engine's weights back on the GPU and overwritten from the trainer's, its KV
  cache not yet (it is mapped after the allocator cache is emptied);
* ``validation`` — like ``rollout`` (the same engine, awake).

With ``rollout.sleep_during_update=false`` the engine never sleeps and holds its whole share in every phase.

Every term with its formula (bytes per GPU), the micro-batch sizes and what is not counted: docs/scaling.md,
"The terms of the memory plan".

Example (tests/test_memory_plan.py works it term by term): a 2-layer shape with d = 64, I = 128, 2 × 32 query and
1 × 32 key-value heads, V = 1,000 untied, on one GPU with fp32 parameters and bf16 compute, micro-batches of 2
rows of 16 + 48 tokens: P = 202,176 parameters, 4 × 202,176 B of fp32 weights; the padded mask 2·64²·3 B = 24,576 B.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stapo.config import ConfigError

__all__ = ["GIB", "GPUS", "ASSUMED_GPU", "TARGET_FRACTION", "ModelShape", "PAPER_SHAPES", "Term", "Phase",
           "MemoryPlan", "MemoryPlanError", "shape_from_hf_config", "model_shape", "plan_inputs", "plan_memory",
           "device_memory", "check_memory_plan", "format_plan"]

GIB = 2 ** 30
#: Visible memory (``torch.cuda.get_device_properties(...).total_memory`` / 2³⁰) of the GPUs the paper configs are
#: planned for.
GPUS = {"H100": 79.2, "H200": 139.8}
#: What a CPU dry run plans for when ``trainer.gpu_memory_gib`` is null.
ASSUMED_GPU = ("an 80-GB H100", GPUS["H100"])
#: The share of the device every phase of the paper configs is fitted under (the rest: fragmentation, cached blocks).
TARGET_FRACTION = 0.9

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_CUDA_CONTEXT = 0.5 * GIB  # the CUDA context of the process (cuBLAS/cuDNN workspaces included), assumed
_NCCL = 1.0 * GIB  # NCCL communicators and their buffers when W > 1, assumed
_ASLEEP = 1.0 * GIB  # a sleeping vLLM engine: CUDA graphs, sampler and input buffers (assumed)
_ASLEEP_EAGER = 0.25 * GIB  # the same with enforce_eager (no CUDA graphs)


# --- model shapes ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (Llama / Qwen layout) that its memory depends on.

    Attributes:
        name: for the output. layers: n_l. hidden: d. intermediate: I (gated MLP). heads / kv_heads / head_dim:
        attention. vocab: rows of the (input and output) embedding V. tied: the LM head is the input embedding.
        qk_norm: per-head RMSNorms of q and k (Qwen3).
    """

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = True

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """q, k, v, o projections (+ q/k norms) + gated MLP + two RMSNorms."""
        d, q, kv = self.hidden, self.q_dim, self.kv_dim
        norms = 2 * self.head_dim if self.qk_norm else 0
        return d * q + 2 * d * kv + q * d + norms + 3 * d * self.intermediate + 2 * d

    @property
    def root_params(self) -> int:
        """Embedding (+ the untied LM head) + final norm: FSDP2's root module."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """Keys + values of every layer for one token (the engine's KV cache)."""
        return 2 * self.layers * self.kv_dim * itemsize


#: The public shapes (config.json) of the paper's models, so a plan needs no hub access.
PAPER_SHAPES: dict[str, ModelShape] = {
    "Qwen/Qwen3-1.7B-Base": ModelShape("Qwen3-1.7B", 28, 2048, 6144, 16, 8, 128, 151_936, tied=True),
    "Qwen/Qwen3-8B-Base": ModelShape("Qwen3-8B", 36, 4096, 12288, 32, 8, 128, 151_936, tied=False),
    "Qwen/Qwen3-14B-Base": ModelShape("Qwen3-14B", 40, 5120, 17408, 40, 8, 128, 151_936, tied=False),
}
# the post-trained checkpoints share the shapes
PAPER_SHAPES.update({k.removesuffix("-Base"): v for k, v in list(PAPER_SHAPES.items())})
#: ``model.path: tiny`` (stapo.model.models.build_tiny_model's defaults with the SmolLM2 tokenizer's 49,152 tokens).
_TINY = ModelShape("tiny", 2, 64, 128, 2, 1, 32, 49_152, tied=False)


def shape_from_hf_config(config: dict[str, Any], name: str) -> ModelShape:
    """A :class:`ModelShape` from a transformers ``config.json`` (dict): ``num_hidden_layers``, ``hidden_size``,
    ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads`` (default: the heads), ``head_dim``
    (default: hidden / heads), ``vocab_size``, ``tie_word_embeddings`` (default false, as Qwen3 / Llama).

    Raises:
        KeyError, TypeError, ValueError: a field missing or not a number.
    """
    c = config.get("text_config", config) if "hidden_size" not in config else config
    heads = int(c["num_attention_heads"])
    return ModelShape(name=name, layers=int(c["num_hidden_layers"]), hidden=int(c["hidden_size"]),
                      intermediate=int(c["intermediate_size"]), heads=heads,
                      kv_heads=int(c.get("num_key_value_heads") or heads),
                      head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
                      vocab=int(c["vocab_size"]), tied=bool(c.get("tie_word_embeddings", False)),
                      qk_norm=str(c.get("model_type", "")).startswith("qwen3"))


def model_shape(path: str, cache_dir: str | None = None) -> ModelShape | None:
    """The shape of ``model.path`` without loading weights: the paper models from :data:`PAPER_SHAPES`; a local
    folder (or the embedded model's folder) from its ``config.json``; ``tiny`` from the test model's defaults; any
    other hub id from the HF cache (``AutoConfig``, offline when the hub cannot be reached).

    Returns:
        :class:`ModelShape`, or None when the config cannot be read (the plan is then "unknown", nothing checked).
    """
    name = str(path)
    if name in PAPER_SHAPES:
        return PAPER_SHAPES[name]
    if name == "tiny":
        return _TINY
    try:
        from stapo.model.models import _resolve_source, _source_kwargs

        source, local = _resolve_source(name, cache_dir)
        short = name.rstrip("/").split("/")[-1]
        if local:
            return shape_from_hf_config(json.loads((Path(source) / "config.json").read_text()), short)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, **_source_kwargs(local, cache_dir, source))
        return shape_from_hf_config(config.to_dict(), short)
    except Exception:  # noqa: BLE001 - a plan without the shape says unknown; loading the model reports the error
        return None


# --- the plan ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Term:
    """One allocation of a phase: ``name``, its size in bytes, the formula with the numbers put in, and whether
    it is the vLLM engine's."""

    name: str
    bytes: float
    formula: str
    engine: bool = False

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class Phase:
    """A phase of the step and what is on one GPU during it.

    Attributes:
        name: ``rollout``, ``old pass``, ``reference pass``, ``update``, ``sync`` or ``validation``.
        terms: its allocations (:class:`Term`).
        keys: the config keys that lower it (named when it does not fit).
        note: one line on how the phase was counted (e.g. which of backward and optimizer step is larger).
    """

    name: str
    terms: tuple[Term, ...]
    keys: tuple[str, ...] = ()
    note: str = ""

    @property
    def gib(self) -> float:
        """Σ terms, GiB."""
        return sum(t.bytes for t in self.terms) / GIB

    @property
    def engine_gib(self) -> float:
        """The engine's share of :attr:`gib`."""
        return sum(t.bytes for t in self.terms if t.engine) / GIB


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory of each phase (:func:`plan_memory`).

    Attributes:
        shape: the model. world: ranks W. strategy: ``fsdp2`` / ``replicate`` / ``none`` (one process).
        device_gib: the device memory M it is planned against; device: where M comes from (for the output).
        phases: :class:`Phase` in step order. settings: the config values used (``key: value``, for the header).
        kv_tokens: KV-cache tokens the awake engine holds at most: ``(u·M − c·P − residual) / KV bytes per
            token``.
        checked: whether the start-up refuses a phase over ``device_gib`` (a CUDA device or
            ``trainer.gpu_memory_gib``); False for a CPU run planned for :data:`ASSUMED_GPU`.
    """

    shape: ModelShape
    world: int
    strategy: str
    device_gib: float
    device: str
    phases: tuple[Phase, ...]
    settings: dict[str, Any] = field(default_factory=dict)
    kv_tokens: float = 0.0
    checked: bool = True

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.gib)

    def phase(self, name: str) -> Phase:
        """The phase called ``name`` (KeyError when the step has none, e.g. ``reference pass`` with β = 0)."""
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(name)

    def over(self, fraction: float = 1.0) -> list[Phase]:
        """The phases above ``fraction`` × the device memory."""
        return [p for p in self.phases if p.gib > fraction * self.device_gib + 1e-9]


class MemoryPlanError(ConfigError):
    """A phase of the memory plan exceeds the device: the message is one line (naming the phase and the key to
    change); :attr:`details` holds the plan's table, printed after it (train.py)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def _get(cfg: Any, dotted: str, default: Any) -> Any:
    """A config value, or ``default`` when the key does not exist (a key being added by other work)."""
    node = cfg
    for part in dotted.split("."):
        if not hasattr(node, part):
            return default
        node = getattr(node, part)
    return default if node is None else node


def _strategy(cfg: Any, world: int) -> str:
    if world <= 1:
        return "none"
    dp = _get(cfg, "trainer.data_parallel", "auto")
    device = _get(cfg, "trainer.device", "auto")
    return "fsdp2" if dp == "fsdp2" or (dp == "auto" and device != "cpu") else "replicate"


def plan_inputs(cfg: Any) -> dict[str, Any]:
    """The config values :func:`plan_memory` reads (defaults where a key does not exist), as ``key: value``."""
    compute = _get(cfg, "model.compute_dtype", "bfloat16")
    return {
        "model.param_dtype": _get(cfg, "model.param_dtype", "float32"),
        "model.compute_dtype": "bfloat16" if compute == "auto" else compute,  # auto: bf16 on a GPU
        "model.gradient_checkpointing": bool(_get(cfg, "model.gradient_checkpointing", False)),
        "model.attn_implementation": _get(cfg, "model.attn_implementation", "sdpa"),
        "data.max_prompt_length": int(_get(cfg, "data.max_prompt_length", 1024)),
        "rollout.response_length": int(_get(cfg, "rollout.response_length", 15360)),
        "rollout.backend": _get(cfg, "rollout.backend", "vllm"),
        "rollout.gpu_memory_utilization": float(_get(cfg, "rollout.gpu_memory_utilization", 0.5)),
        "rollout.sleep_during_update": bool(_get(cfg, "rollout.sleep_during_update", False)),
        "rollout.sleep_level": int(_get(cfg, "rollout.sleep_level", 2)),
        "rollout.enforce_eager": bool(_get(cfg, "rollout.enforce_eager", True)),
        "actor.ppo_micro_batch_size": int(_get(cfg, "actor.ppo_micro_batch_size", 8)),
        "actor.use_dynamic_bsz": bool(_get(cfg, "actor.use_dynamic_bsz", False)),
        "actor.ppo_max_token_len_per_gpu": int(_get(cfg, "actor.ppo_max_token_len_per_gpu", 16384)),
        "actor.use_remove_padding": bool(_get(cfg, "actor.use_remove_padding", False)),
        "actor.lm_head": _get(cfg, "actor.lm_head", "logits"),
        "kl": _kl(cfg),
    }


def _kl(cfg: Any) -> float:
    """β of the objective (the GRPO reference model exists when > 0)."""
    try:
        from stapo.config import objective_from_config

        return float(objective_from_config(cfg).kl_coef)
    except Exception:  # noqa: BLE001 - a bare config object (tests): algorithm.kl_coef or 0
        return float(_get(cfg, "algorithm.kl_coef", 0.0))


def _layout(s: dict[str, Any]) -> str:
    """padded / trailing / packed: as stapo.train.policy.forward_layout."""
    if not s["actor.use_remove_padding"]:
        return "padded"
    return "packed" if str(s["model.attn_implementation"]).startswith("flash_attention") else "trailing"


def _g(x: float) -> str:
    """A number for a formula: 1.72 G, 330 M, 4,096."""
    for scale, unit in ((1e9, " G"), (1e6, " M")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:.3g}"


def _tiles(device_type: str) -> tuple[int, int]:
    """(vocab_tile, row_tile) of the fused head on the device (stapo.model.lm_head.lm_head_tiles when it has them)."""
    try:
        from stapo.model.lm_head import lm_head_tiles

        return tuple(lm_head_tiles(device_type))  # type: ignore[return-value]
    except ImportError:
        from stapo.model.lm_head import _ROW_TILE, _VOCAB_TILE

        return _VOCAB_TILE, _ROW_TILE


def plan_memory(cfg: Any, shape: ModelShape, world: int, device_gib: float, *, device: str = "",
                strategy: str | None = None, checked: bool = True, device_type: str = "cuda") -> MemoryPlan:
    """The per-GPU memory of every phase of a step of ``cfg`` on ``world`` GPUs of ``device_gib`` GiB (see the
    module docstring for each term and its formula).

    Args:
        cfg: a :class:`~stapo.config.TrainConfig` (keys that do not exist yet take their defaults:
            :func:`plan_inputs`).
        shape: the model (:func:`model_shape`).
        world: ranks W (GPUs).
        device_gib: the memory of one GPU, GiB (``total_memory`` / 2³⁰).
        device: where ``device_gib`` comes from, for the output.
        strategy: ``fsdp2`` / ``replicate`` / ``none``; default from ``trainer.data_parallel`` (auto: FSDP2 on a
            GPU) and W.
        checked: recorded in the plan (:attr:`MemoryPlan.checked`).
        device_type: selects the fused head's tile sizes (``cuda``: stapo.model.lm_head's CUDA tiles).

    Returns:
        :class:`MemoryPlan` (bytes per term, GiB per phase).
    """
    s = plan_inputs(cfg)
    strategy = strategy or _strategy(cfg, world)
    S = world if strategy == "fsdp2" else 1
    p, c = _ITEMSIZE[s["model.param_dtype"]], _ITEMSIZE[s["model.compute_dtype"]]
    P, Pl, Pr = shape.params, shape.layer_params, shape.root_params
    d, I, q, kv, V, nl = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim, shape.vocab, shape.layers
    M = device_gib * GIB
    u = s["rollout.gpu_memory_utilization"]
    prompt, R = s["data.max_prompt_length"], s["rollout.response_length"]
    L = prompt + R
    layout = _layout(s)
    if s["actor.use_dynamic_bsz"]:  # tokens as laid out ≤ the budget (stapo/train/plan.py::micro_batch_tokens)
        T = max(s["actor.ppo_max_token_len_per_gpu"], L)
        micro = f"token budget: T = {T:,} tokens, rows of up to L = {L:,}"
        K = T  # the LM-head positions of a micro-batch are at most its tokens
    else:
        b = s["actor.ppo_micro_batch_size"]
        T = b * L
        micro = f"{b} rows of L = {L:,} tokens, T = {T:,}"
        K = {"padded": b * (R + 1), "trailing": b * L, "packed": b * R}[layout]
    a = c if strategy == "fsdp2" else p  # the residual stream's item size
    vllm = s["rollout.backend"] == "vllm"
    sleeps = vllm and s["rollout.sleep_during_update"]
    asleep_b = _ASLEEP_EAGER if s["rollout.enforce_eager"] else _ASLEEP
    shard = f" ÷ {S}" if S > 1 else ""

    # resident on the GPU in every phase
    resident = [Term(f"parameters ({s['model.param_dtype']})", p * P / S, f"{p} B × {_g(P)}{shard}"),
                Term("AdamW moments", 2 * p * P / S, f"2 × {p} B × {_g(P)}{shard}")]
    if s["kl"] > 0:
        resident.append(Term(f"GRPO reference ({s['model.compute_dtype']})", c * P / S, f"{c} B × {_g(P)}{shard}"))
    resident.append(Term("CUDA context" + (" + NCCL" if world > 1 else ""), _CUDA_CONTEXT + (_NCCL if world > 1 else 0),
                         "0.5 GiB" + (" + 1 GiB" if world > 1 else "") + " (assumed)"))
    grads = Term(f"gradients ({s['model.param_dtype']})", p * P / S, f"{p} B × {_g(P)}{shard}")

    # the engine
    weights = c * P
    awake = [Term("vLLM weights", weights, f"{c} B × {_g(P)}", engine=True),
             Term("vLLM KV cache, activations, graphs", max(u * M - weights, 0.0),
                  f"{u:g} × {device_gib:g} GiB − weights", engine=True)] if vllm else []
    level = s["rollout.sleep_level"]
    what = "buffers; enforce_eager" if asleep_b < _ASLEEP else "CUDA graphs, buffers"
    asleep = [Term(f"vLLM asleep (level {level})", asleep_b, f"{asleep_b / GIB:g} GiB (assumed: {what})",
                   engine=True)] if sleeps else awake
    kv_tokens = max(u * M - weights - asleep_b, 0.0) / shape.kv_bytes_per_token(c) if vllm else 0.0

    # the compute copy of the weights during a forward (and backward)
    def weight_copies(backward: bool, model: str = "policy") -> list[Term]:
        if strategy == "fsdp2":
            out = [Term(f"FSDP2: 2 decoder layers all-gathered ({model})", 2 * c * Pl, f"2 × {c} B × {_g(Pl)}"),
                   Term(f"FSDP2: root module unsharded ({model})", c * Pr, f"{c} B × {_g(Pr)}")]
            if backward:
                out += [Term("FSDP2: layer gradient + fp32 reduce-scatter input", (c + 4) * Pl,
                             f"({c} + 4) B × {_g(Pl)}"),
                        Term("FSDP2: root gradient + fp32 reduce-scatter input", (c + 4) * Pr,
                             f"({c} + 4) B × {_g(Pr)}")]
            return out
        if model == "policy" and p != c:
            return [Term("autocast weight copies", c * P, f"{c} B × {_g(P)}")]
        return []

    mask = []  # b·L_mb² ≤ T·L for a micro-batch of b rows padded to L_mb ≤ L with b·L_mb ≤ T
    if layout == "padded":
        mask.append(Term("attention mask + SDPA bias [b,1,L,L]", T * L * (1 + c), f"{_g(T)} × {L:,} × (1 + {c}) B"))
    if s["model.attn_implementation"] == "eager":
        mask.append(Term("eager attention scores + probs", 2 * c * shape.heads * T * L,
                         f"2 × {c} B × {shape.heads} × {_g(T)} × {L:,}"))

    vt, rt = _tiles(device_type)
    vt, rt = min(vt, V), min(rt, K)
    fused = s["actor.lm_head"] == "fused"

    def head(backward: bool) -> list[Term]:
        if not fused:
            n = 2 if backward else 1
            return [Term("LM head: logits" + (" + gradient" if backward else ""), n * c * K * V,
                         f"{n} × {c} B × {_g(K)} × {V:,}" if n > 1 else f"{c} B × {_g(K)} × {V:,}")]
        if not backward:
            return [Term("fused head: one logits tile", rt * vt * c, f"{rt:,} × {vt:,} × {c} B")]
        return [Term("fused head: tile + gradient tile", rt * vt * (c + 4), f"{rt:,} × {vt:,} × ({c} + 4) B"),
                Term("fused head: fp32 gradient accumulators", 4 * (K + V) * d, f"4 B × ({_g(K)} + {V:,}) × {d:,}")]

    nograd_acts = Term("one layer's working set (no grad)", T * (2 * a * d + 4 * d + 3 * c * I),
                       f"{_g(T)} × (2·{a}·{d} + 4·{d} + 3·{c}·{I}) B")
    saved = 2 * (4 + c) * d + c * (2 * q + 2 * kv) + (4 * (q + kv) if shape.qk_norm else 0)
    if s["model.gradient_checkpointing"]:
        acts = [Term("checkpointed layer inputs", nl * T * d * a, f"{nl} × {_g(T)} × {d:,} × {a} B"),
                Term("one layer recomputed (backward)", T * (saved + 6 * c * I),
                     f"{_g(T)} × ({saved:,} + 6·{c}·{I:,}) B")]
    else:
        acts = [Term("every layer's saved activations", nl * T * (saved + 4 * c * I),
                     f"{nl} × {_g(T)} × ({saved:,} + 4·{c}·{I:,}) B"),
                Term("backward temporaries of a layer", 2 * c * I * T, f"2 × {c} B × {I:,} × {_g(T)}")]

    micro_keys = (("actor.ppo_max_token_len_per_gpu",) if s["actor.use_dynamic_bsz"] else
                  ("actor.ppo_micro_batch_size",)) + (("actor.lm_head",) if not fused else ()) + (
        ("actor.use_remove_padding",) if layout == "padded" else ())
    engine_keys = ("rollout.sleep_during_update",) if vllm and not sleeps else ()
    phases = []
    rollout = Phase("rollout", tuple(awake + resident), ("rollout.gpu_memory_utilization",),
                    f"the engine awake; KV cache ≈ {kv_tokens / 1e3:,.0f}k tokens" if vllm else
                    f"rollout.backend={s['rollout.backend']}: the engine's memory is not modelled")
    phases.append(rollout)
    old = asleep + resident + weight_copies(False) + [nograd_acts] + mask + head(False)
    phases.append(Phase("old pass", tuple(old), micro_keys + engine_keys, micro))
    if s["kl"] > 0:
        phases.append(Phase("reference pass", tuple(asleep + resident + weight_copies(False, "reference")
                                                    + [nograd_acts] + mask + head(False)), micro_keys + engine_keys,
                            micro))
    backward = asleep + resident + [grads] + weight_copies(True) + acts + mask + head(True)
    step = asleep + resident + [grads, Term("AdamW step temporaries (foreach)", p * P / S,
                                            f"{p} B × {_g(P)}{shard}")]
    bwd_b, step_b = sum(t.bytes for t in backward), sum(t.bytes for t in step)
    if bwd_b >= step_b:
        phases.append(Phase("update", tuple(backward), micro_keys + engine_keys,
                            f"forward + backward of one micro-batch ({micro}); the optimizer step: "
                            f"{step_b / GIB:.1f} GiB"))
    else:
        phases.append(Phase("update", tuple(step), ("trainer.data_parallel",),
                            f"the optimizer step; forward + backward: {bwd_b / GIB:.1f} GiB ({micro})"))
    if vllm:
        woken = ([Term("vLLM weights (woken)", weights, f"{c} B × {_g(P)}", engine=True)] + asleep if sleeps
                 else awake)
        unit = max(Pl, V * d)
        phases.append(Phase("sync", tuple(woken + resident + [
            Term("largest gathered unit (bf16)", c * unit, f"{c} B × max({_g(Pl)}, {V:,} × {d:,})"),
            Term("vLLM per-layer reload buffer", c * Pl, f"{c} B × {_g(Pl)}")]),
            ("trainer.data_parallel",), "engine weights woken, KV cache not yet" if sleeps else "engine awake"))
    phases.append(Phase("validation", rollout.terms, rollout.keys, "as rollout (the same engine, awake)"))
    settings = {k: v for k, v in s.items() if k != "kl"}
    settings["layout"] = layout
    return MemoryPlan(shape=shape, world=world, strategy=strategy, device_gib=device_gib, device=device,
                      phases=tuple(phases), settings=settings, kv_tokens=kv_tokens, checked=checked)


_STRATEGY = {"none": "one process", "fsdp2": "FSDP2", "replicate": "replicated"}


# --- formatting -------------------------------------------------------------------------------------------------
def format_plan(plan: MemoryPlan, terms: bool = True) -> str:
    """The plan as text: a header, one row per phase (total, the engine's share, % of the device, ✗ over it) and,
    with ``terms``, every term of every phase with its formula."""
    sh = plan.shape
    head = (f"memory plan per GPU (GiB, arithmetic: stapo/run/memory_plan.py): {sh.name} ({sh.params / 1e9:.2f} B "
            f"parameters), {plan.world} GPU{'s' if plan.world > 1 else ''} "
            f"({_STRATEGY.get(plan.strategy, plan.strategy)}), "
            f"{plan.device_gib:.1f} GiB per GPU ({plan.device})" + ("" if plan.checked else "; not checked"))
    rows = [("phase", "total", "engine", "% GPU", "")]
    for ph in plan.phases:
        rows.append((ph.name, f"{ph.gib:.1f}", f"{ph.engine_gib:.1f}", f"{100 * ph.gib / plan.device_gib:.0f} %",
                     ("✗ " if ph.gib > plan.device_gib else "") + ph.note))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [head] + [f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}  {r[4]}".rstrip()
                      for r in rows]
    if terms:
        lines.append("terms (GiB = formula):")
        for ph in plan.phases:
            if ph.name == "validation":
                continue
            lines.append(f"  {ph.name}: " + "; ".join(f"{t.name} {t.gib:.2f} = {t.formula}" for t in ph.terms))
    return "\n".join(lines)


# --- start-up -----------------------------------------------------------------------------------------------------
def device_memory(cfg: Any, device: Any) -> tuple[float, str, bool]:
    """The memory one GPU of this run has, GiB: ``trainer.gpu_memory_gib`` when set (a plan for a GPU this
    machine may not have), else the CUDA device's ``total_memory``, else (a CPU device) :data:`ASSUMED_GPU`.

    Returns:
        ``(GiB, where it comes from, checked)``: ``checked`` is False for a CPU device without
        ``trainer.gpu_memory_gib`` (CPU runs are not checked).
    """
    set_gib = _get(cfg, "trainer.gpu_memory_gib", None)
    if set_gib is not None:
        return float(set_gib), f"trainer.gpu_memory_gib={float(set_gib):g}", True
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        return props.total_memory / GIB, f"{props.name}, {dev}", True
    return ASSUMED_GPU[1], f"assumed: {ASSUMED_GPU[0]}, {ASSUMED_GPU[1]} GiB visible; trainer.device={dev.type}", False


def check_memory_plan(cfg: Any, world: int, device: Any, strategy: str | None = None) -> MemoryPlan | None:
    """The start-up check (:class:`stapo.train.Trainer`, before any model loads; ``train.py --dry-run`` prints the
    plan): plan ``cfg`` (:func:`plan_memory`) for this run's ranks and device memory (:func:`device_memory`) and
    refuse a phase over the device.

    Args:
        cfg: the resolved config. world: ranks. device: this rank's device. strategy: the data-parallel strategy
            (default from the config).

    Returns:
        The :class:`MemoryPlan`, or None when the model's shape cannot be read (nothing checked).

    Raises:
        MemoryPlanError: a checked plan (a CUDA device, or ``trainer.gpu_memory_gib`` set) whose largest phase
            exceeds the device memory: one line naming the phase, its size, the device memory and the keys that
            lower it; :attr:`MemoryPlanError.details` holds :func:`format_plan`.
    """
    shape = model_shape(cfg.model.path, _get(cfg, "model.cache_dir", None))
    if shape is None:
        return None
    gib, where, checked = device_memory(cfg, device)
    plan = plan_memory(cfg, shape, world, gib, device=where, strategy=strategy, checked=checked)
    over = plan.over() if checked else []
    if over:
        worst = max(over, key=lambda ph: ph.gib)
        key = "trainer.gpu_memory_gib" if _get(cfg, "trainer.gpu_memory_gib", None) is not None else worst.keys[0]
        also = [ph.name for ph in over if ph is not worst and ph.name != "validation"]
        raise MemoryPlanError(
            f"invalid value for {key!r} ({_get(cfg, key, None)}): the {worst.name} phase needs {worst.gib:.1f} GiB "
            f"per GPU, more than the {gib:.1f} GiB of the device ({where})"
            + (f" (also over: {', '.join(also)})" if also else "")
            + f"; {_advice(cfg, plan, over)} (the memory plan per phase follows)", format_plan(plan))
    return plan


def _advice(cfg: Any, plan: MemoryPlan, over: list[Phase]) -> str:
    """What lowers the phases in ``over``: more GPUs when the training state alone (with the engine's weights) does
    not fit; else the engine's share (the largest ``rollout.gpu_memory_utilization`` that keeps the rollout within
    :data:`TARGET_FRACTION` of the device) and the keys of the largest trainer phase."""
    more = ("shard the training state over more GPUs (torchrun --nproc_per_node, trainer.data_parallel=fsdp2)"
            if plan.strategy != "fsdp2" else "shard the training state over more GPUs (torchrun --nproc_per_node)")
    M = plan.device_gib
    fixed_names = ("parameters", "AdamW", "gradients", "GRPO reference", "CUDA context", "autocast", "vLLM")
    for ph in over:  # the state, the engine's weights and fixed buffers alone over the device: no key helps
        fixed = sum(t.gib for t in ph.terms if t.name.startswith(fixed_names) and
                    t.name != "vLLM KV cache, activations, graphs")
        if fixed > M:
            return (f"the training state, the engine's weights and the context alone take {fixed:.1f} GiB in the "
                    f"{ph.name} phase: {more}")
    out = []
    trainer = [ph for ph in over if "rollout.gpu_memory_utilization" not in ph.keys]
    if len(trainer) < len(over):  # the rollout (and validation): the engine's share beside the training state
        ro = plan.phase("rollout")
        u_max = math.floor(100 * (TARGET_FRACTION * M - (ro.gib - ro.engine_gib)) / M) / 100
        weights = next((t.gib for t in ro.terms if t.name == "vLLM weights"), 0.0)
        if u_max * M < weights + _ASLEEP / GIB + 1.0:  # no KV cache of ≥ 1 GiB left
            return (f"the training state ({ro.gib - ro.engine_gib:.1f} GiB) leaves the engine no room for its weights "
                    f"({weights:.1f} GiB) and a KV cache: {more}")
        out.append(f"rollout.gpu_memory_utilization ≤ {u_max:.2f} keeps the rollout within "
                   f"{100 * TARGET_FRACTION:.0f} % of the device")
    if trainer:
        ph = max(trainer, key=lambda p: p.gib)
        if ph.keys == ("trainer.data_parallel",):
            out.append(f"the {ph.name} phase: {more}")
        else:
            shown = ", ".join(f"{k} ({_get(cfg, k, None)})" for k in ph.keys)
            out.append(f"the {ph.name} phase shrinks with {shown} (smaller micro-batches, the fused LM head, "
                       f"padding-free rows, an engine asleep) or more GPUs")
    return "; ".join(out)

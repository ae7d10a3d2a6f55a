"""GPU memory arithmetic of the paper recipe on Qwen3-1.7B / 8B / 14B with our trainer (FSDP2, fp32 master + bf16).

    python scripts/memory_plan.py [--gpu-gib 80] [--ranks 8 64] [--out results/memory_plan.md]

Arithmetic, not a measurement: the shapes are the public Qwen3 configs (no hub access needed), the recipe is
configs/paper/base.yaml (micro-batch 4 responses of up to 1,024 + 15,360 tokens, gradient checkpointing,
vLLM with gpu_memory_utilization 0.6 sleeping during the update). Per GPU:

* training state: 16 bytes / parameter (fp32 weights 4 + fp32 gradients 4 + AdamW moments 8), sharded over N ranks;
* FSDP2 transients during the update: one decoder layer all-gathered in bf16 (2 B/param) plus its unsharded
  fp32 gradient before the reduce-scatter (4 B/param), and the root module's embedding + LM head in bf16 for the
  whole forward (2 B/param) and their fp32 gradients (4 B/param) at the end of the backward;
* activations with gradient checkpointing: each layer's input hidden state in bf16 (tokens × hidden × 2 B ×
  layers) plus one layer's recomputation (≈ 16 × tokens × hidden × 2 B, attention with SDPA/flash: no T² term);
* the LM head of one micro-batch: logits [tokens, V] in bf16 and their gradient in bf16 (token statistics run in
  fp32 chunk by chunk on top: stapo/token_stats.py);
* the vLLM engine: its own bf16 copy of the weights (2 B/param; tensor_parallel_size 1) + KV cache, within
  gpu_memory_utilization × GPU memory; asleep (weights offloaded, KV cache freed) during the update.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

GIB = 2 ** 30


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 151_936
    tied: bool = False

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim  # q, k, v, o projections + q/k norms
        return attn + 3 * h * self.intermediate + 2 * h  # + gated MLP + 2 RMSNorms

    @property
    def root_params(self) -> int:  # embedding (+ untied LM head) + final norm
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def kv_bytes_per_token(self) -> int:  # keys + values, bf16, every layer
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


QWEN3 = [  # config.json of Qwen/Qwen3-{1.7B,8B,14B}-Base
    Shape("Qwen3-1.7B", 2048, 28, 16, 8, 128, 6144, tied=True),
    Shape("Qwen3-8B", 4096, 36, 32, 8, 128, 12288),
    Shape("Qwen3-14B", 5120, 40, 40, 8, 128, 17408),
]


def plan(s: Shape, ranks: int, gpu_gib: float, util: float, micro_rows: int, seq: int,
         response: int) -> dict[str, float]:
    """GiB per GPU of each term (see the module docstring); ``kv_tokens`` in tokens."""
    tokens = micro_rows * seq
    state = 16 * s.params / ranks
    layer = 6 * s.layer_params  # bf16 gather + fp32 unsharded gradient
    root = 6 * s.root_params
    acts = 2 * tokens * s.hidden * s.layers + 16 * tokens * s.hidden * 2
    head = 2 * 2 * micro_rows * response * s.vocab  # bf16 logits of the response positions + their bf16 gradient
    engine = util * gpu_gib * GIB
    weights = 2 * s.params
    kv = max(engine - weights, 0.0)
    return {"params_B": s.params / 1e9, "state": state / GIB, "update_transient": (layer + root) / GIB,
            "activations": acts / GIB, "lm_head": head / GIB, "update_peak": (state + layer + root + acts + head) / GIB,
            "engine_weights": weights / GIB, "kv_cache": kv / GIB, "kv_tokens": kv / s.kv_bytes_per_token,
            "rollout_peak": (state + engine) / GIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (80: A100/H100; 141: H200)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--util", type=float, default=0.6, help="rollout.gpu_memory_utilization")
    ap.add_argument("--micro-rows", type=int, default=4, help="actor.ppo_micro_batch_size")
    ap.add_argument("--seq", type=int, default=1024 + 15360, help="prompt + response tokens of the longest row")
    ap.add_argument("--response", type=int, default=15360, help="response tokens (LM-head positions) per row")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    lines = [f"Per-GPU memory (GiB) of the paper recipe, {a.gpu_gib:g} GiB GPUs, micro-batch {a.micro_rows} × "
             f"{a.seq} tokens ({a.response} response positions), vLLM utilisation {a.util:g} (`python scripts/memory_plan.py --gpu-gib {a.gpu_gib:g} --micro-rows {a.micro_rows}`; "
             "arithmetic, not measured).", "",
             "| model | params | GPUs | training state (16 B/param ÷ N) | FSDP2 transients | activations (ckpt) "
             "| LM head (logits + grad) | update peak | engine bf16 weights | KV cache (tokens) | rollout peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in QWEN3:
        for n in a.ranks:
            p = plan(s, n, a.gpu_gib, a.util, a.micro_rows, a.seq, a.response)
            up = "" if p["update_peak"] <= a.gpu_gib else " ✗"
            ro = "" if p["rollout_peak"] <= a.gpu_gib else " ✗"
            lines.append(f"| {s.name} | {p['params_B']:.2f} B | {n} | {p['state']:.1f} | {p['update_transient']:.1f} | "
                         f"{p['activations']:.1f} | {p['lm_head']:.1f} | {p['update_peak']:.1f}{up} | "
                         f"{p['engine_weights']:.1f} | {p['kv_cache']:.1f} ({p['kv_tokens'] / 1e3:.0f}k) | "
                         f"{p['rollout_peak']:.1f}{ro} |")
    lines += ["", f"Lower `actor.ppo_micro_batch_size` where the update is ✗: the LM head and activations scale with it "
              "(the loss is unchanged: the denominator is the mini-batch's).", "",
              "✗: over the GPU's memory. Rollout peak = training state (kept on the GPU) + the engine's "
              "share; update peak = training state + transients + activations + LM head (the engine asleep)."]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

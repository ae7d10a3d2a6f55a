"""GPU memory arithmetic of the paper recipe on Qwen3-1.7B / 8B / 14B with our trainer (FSDP2, fp32 master + bf16).

    python scripts/memory_plan.py [--gpu-gib 80] [--ranks 8 64] [--micro-rows K] [--out results/memory_plan.md]

Arithmetic, not a measurement: the shapes are the public Qwen3 configs (no hub access needed), the recipe is
configs/paper/ (``actor.ppo_micro_batch_size`` read from each model's config unless ``--micro-rows`` is given:
4 for 1.7B, 2 for 8B/14B; responses of up to 1,024 + 15,360 tokens, gradient checkpointing, vLLM with
gpu_memory_utilization 0.6 sleeping during the update). Per GPU:

* training state: 16 bytes / parameter (fp32 weights 4 + fp32 gradients 4 + AdamW moments 8), sharded over N ranks;
* FSDP2 transients during the update: one decoder layer all-gathered in bf16 (2 B/param) plus its unsharded
  fp32 gradient before the reduce-scatter (4 B/param), and the root module's embedding + LM head in bf16 for the
  whole forward (2 B/param) and their fp32 gradients (4 B/param) at the end of the backward;
* activations with gradient checkpointing: each layer's input hidden state in bf16 (tokens × hidden × 2 B ×
  layers) plus one layer's recomputation (≈ 16 × tokens × hidden × 2 B, attention with SDPA/flash: no T² term);
* the LM head of one micro-batch: logits [tokens, V] in bf16 and their gradient in bf16 (token statistics run in
  fp32 chunk by chunk on top: stapo/token_stats.py);
* the vLLM engine: its own bf16 copy of the weights (2 B/param; tensor_parallel_size 1) + KV cache, within
  gpu_memory_utilization × GPU memory; asleep (weights offloaded, KV cache freed) during the update;
* GRPO only (β > 0): the frozen reference model in bf16, FSDP2-sharded like the policy (2 B/param ÷ N), on the GPU
  throughout (its forwards run before the update).
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
REPO = Path(__file__).resolve().parents[1]


def config_micro_rows(s: Shape) -> int:
    """``actor.ppo_micro_batch_size`` of configs/paper/qwen3_<size>_stapo.yaml (the same for every method)."""
    import sys

    sys.path.insert(0, str(REPO))
    from stapo.config import load_config

    size = s.name.split("-")[1].lower()
    return load_config(REPO / "configs" / "paper" / f"qwen3_{size}_stapo.yaml").actor.ppo_micro_batch_size


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
    ref = 2 * s.params / ranks  # GRPO's bf16 reference model, sharded
    update = state + layer + root + acts + head
    return {"params_B": s.params / 1e9, "state": state / GIB, "update_transient": (layer + root) / GIB,
            "activations": acts / GIB, "lm_head": head / GIB, "update_peak": update / GIB,
            "update_peak_grpo": (update + ref) / GIB, "engine_weights": weights / GIB, "kv_cache": kv / GIB,
            "kv_tokens": kv / s.kv_bytes_per_token, "rollout_peak": (state + engine) / GIB,
            "rollout_peak_grpo": (state + engine + ref) / GIB, "reference": ref / GIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (80: A100/H100; 141: H200)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--util", type=float, default=0.6, help="rollout.gpu_memory_utilization")
    ap.add_argument("--micro-rows", type=int, default=None,
                    help="actor.ppo_micro_batch_size (default: each model's configs/paper config)")
    ap.add_argument("--seq", type=int, default=1024 + 15360, help="prompt + response tokens of the longest row")
    ap.add_argument("--response", type=int, default=15360, help="response tokens (LM-head positions) per row")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    cmd = "python scripts/memory_plan.py" + (f" --gpu-gib {a.gpu_gib:g}" if a.gpu_gib != 80 else "") + (
        f" --micro-rows {a.micro_rows}" if a.micro_rows else "")
    lines = [f"Per-GPU memory (GiB) of the paper recipe on {a.gpu_gib:g} GiB GPUs: rows of {a.seq} tokens "
             f"({a.response} response positions), vLLM utilisation {a.util:g}; `{cmd}` (arithmetic, not measured).", "",
             "| model | params | GPUs | micro-batch | training state (16 B/param ÷ N) | FSDP2 transients | activations "
             "(ckpt) | LM head (logits + grad) | update peak | + GRPO reference | engine bf16 weights | "
             "KV cache (tokens) | rollout peak | + GRPO reference |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mark(v: float) -> str:
        return f"{v:.1f}" + (" ✗" if v > a.gpu_gib else "")

    for s in QWEN3:
        micro = a.micro_rows or config_micro_rows(s)
        for n in a.ranks:
            p = plan(s, n, a.gpu_gib, a.util, micro, a.seq, a.response)
            lines.append(f"| {s.name} | {p['params_B']:.2f} B | {n} | {micro} | {p['state']:.1f} | "
                         f"{p['update_transient']:.1f} | {p['activations']:.1f} | {p['lm_head']:.1f} | "
                         f"{mark(p['update_peak'])} | {mark(p['update_peak_grpo'])} | {p['engine_weights']:.1f} | "
                         f"{p['kv_cache']:.1f} ({p['kv_tokens'] / 1e3:.0f}k) | {mark(p['rollout_peak'])} | "
                         f"{mark(p['rollout_peak_grpo'])} |")
    lines += ["", "✗: over the GPU's memory. Update peak = training state + transients + activations + LM head (the "
              "engine asleep); rollout peak = training state (kept on the GPU) + the engine's share; GRPO adds its "
              "sharded bf16 reference model (2 B/param ÷ N) to both. Where the update is ✗, lower "
              "`actor.ppo_micro_batch_size`: the LM head and the activations scale with it, the loss does not "
              "(its denominator is the mini-batch's)."]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Probe: one micro-batch's forward + backward under the update's settings, to compare what might speed it up.

    .venv/bin/python scripts/probe_update_variants.py                          # bf16, shared prompt, fused head
    .venv/bin/python scripts/probe_update_variants.py --dtype fp32 --no-share --compile --attn eager

Workload: the embedded SmolLM2-135M-Instruct in train mode, a micro-batch of 2 groups × 8 responses (one random
95-token prompt per group, response lengths uniform in [40, 128)), as the CPU benchmark's micro-batches of 16
(scripts/bench_train_step.py). For each of --seeds batches: --reps forward + backward of Σ log p, printed with
their wall times; the last line is the median over all timed calls after the first batch's first (warm-up)
call. Variants: the compute dtype (bf16 autocast or fp32), the shared-prompt forward (actor.share_prompt), the
LM head (actor.lm_head), the attention implementation (model.attn_implementation) and ``torch.compile`` of the
decoder's forward (dynamic shapes). Not a test and not a benchmark table: a quick A/B of one stage, run each
variant in its own process on an idle machine.

``--profile``: after the timed calls, one more forward + backward under ``torch.profiler`` (CPU activities), and
the share of self CPU time by operator class — matmuls (``aten::mm`` / ``addmm`` / ``bmm`` / ``linear`` and their
backward kernels), attention (``scaled_dot_product`` / flash-attention kernels), and the rest — plus the top
operators by self CPU time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--no-share", action="store_true", help="plain forward instead of the shared prompt")
    ap.add_argument("--lm-head", choices=["logits", "fused"], default="fused")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decoder's forward (dynamic=True)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="profile one more call: time shares by operator class")
    args = ap.parse_args()

    import torch

    from stapo.model.models import load_policy
    from stapo.train.policy import collate_responses, policy_token_stats
    from stapo.rollout import Response

    model, tok = load_policy("embedded:smollm2", dtype="float32", attn_implementation=args.attn)
    model.train()
    if args.compile:
        model.model.forward = torch.compile(model.model.forward, dynamic=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    times = []
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(seed)
        responses = []
        for group in range(2):
            prompt = torch.randint(3, 49000, (95,), generator=g).tolist()
            for _ in range(8):
                n = int(torch.randint(40, 128, (1,), generator=g))
                responses.append(Response(group=group, prompt_ids=prompt, text="", engine_logprobs=None,
                                          response_ids=torch.randint(3, 49000, (n,), generator=g).tolist(),
                                          finish_reason="eos"))
        batch = collate_responses(responses, tok.pad_token_id).trim()
        for rep in range(args.reps):
            t0 = time.perf_counter()
            with autocast:
                st = policy_token_stats(model, batch, 1.0, share_prompt=not args.no_share, lm_head=args.lm_head)
            t1 = time.perf_counter()
            st.logprobs.sum().backward()
            t2 = time.perf_counter()
            print(f"batch {tuple(batch.input_ids.shape)}: forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s", flush=True)
            if seed or rep:
                times.append(t2 - t0)
    print(f"{vars(args)}: median forward + backward {statistics.median(times):.2f} s over {len(times)} calls")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with autocast:
                st = policy_token_stats(model, batch, 1.0, share_prompt=not args.no_share, lm_head=args.lm_head)
            st.logprobs.sum().backward()
        print(operator_shares(prof.key_averages()))


#: operator-name substrings of each class (checked in this order; the first match wins)
OP_CLASSES = (("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "attention")),
              ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn_matmul",
                          "aten::_addmm", "aten::baddbmm")))


def operator_shares(averages, top: int = 12) -> str:
    """The profile's self CPU time split into :data:`OP_CLASSES` and "other" (percent of the total), then the
    ``top`` operators by self CPU time. ``averages``: ``prof.key_averages()``."""
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    shares = {name: 0.0 for name, _ in OP_CLASSES} | {"other": 0.0}
    for e in averages:
        cls = next((name for name, keys in OP_CLASSES if any(k in e.key for k in keys)), "other")
        shares[cls] += e.self_cpu_time_total
    lines = ["profile (self CPU time): " + ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in shares.items()),
             f"top {top} operators:"]
    for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:top]:
        lines.append(f"  {e.key:48s} {e.self_cpu_time_total / 1e6:7.2f} s  {100 * e.self_cpu_time_total / total:5.1f} %"
                     f"  calls {e.count}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

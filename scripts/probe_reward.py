"""Probe which CPU recipe gives GRPO a learning signal: sample the embedded model on the synthetic task
under prompt/reward variants and report how often rewards vary within a group.

    python scripts/probe_reward.py [--prompts 16] [--group-size 8] [--max-new-tokens 128] \
        [--levels 1 2] [--out results/cpu_recipe_probe.md]

For each variant (prompt style × optional system prompt) it reports: the fraction of responses with a
\\boxed{} in their last 100 characters, accuracy under the strict-box reward and under math-verify, and the
fraction of groups whose rewards are not all equal (only those groups produce gradient).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from stapo.config import load_config
from stapo.tasks.data import load_train_set
from stapo.model.models import load_policy
from stapo.tasks.prompts import encode_prompt
from stapo.tasks.rewards import MathVerifyReward, StrictBoxReward, extract_strict_box_answer
from stapo.rollout import SamplingParams, build_rollout_engine

REPO = Path(__file__).resolve().parents[1]
# The one-shot system prompt is read from the CPU config, so the probe measures exactly what training uses.
ONE_SHOT = load_config(REPO / "configs" / "cpu_smollm2_base.yaml").data.system_prompt
VARIANTS = {
    "chat": dict(style="chat", system_prompt=None),
    "chat+one-shot system prompt": dict(style="chat", system_prompt=ONE_SHOT),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--truncate-at", type=int, nargs="*", default=[],
                    help="also score each variant's responses cut to these many tokens (how much budget the "
                         "answer needs)")
    ap.add_argument("--out", default="results/cpu_recipe_probe.md")
    args = ap.parse_args()

    model, tok = load_policy("embedded:smollm2")
    engine = build_rollout_engine("vllm", model, tok, max_model_len=512, kv_cache_gib=1.0, seed=args.seed)
    records = load_train_set("synthetic", n=args.prompts, seed=args.seed, levels=tuple(args.levels)).records
    strict, mv = StrictBoxReward(), MathVerifyReward()
    lines = [f"# CPU recipe probe: SmolLM2-135M-Instruct on synthetic arithmetic (levels {args.levels})", "",
             f"Command: `python scripts/probe_reward.py --prompts {args.prompts} --group-size {args.group_size} "
             f"--max-new-tokens {args.max_new_tokens} --levels {' '.join(map(str, args.levels))}"
             + (f" --truncate-at {' '.join(map(str, args.truncate_at))}" if args.truncate_at else "") + "`", "",
             "| variant | boxed in last 100 chars | strict-box correct | math-verify correct | groups with varied "
             "strict-box reward | groups with varied math-verify reward | mean length (tokens) | s |",
             "|---|---|---|---|---|---|---|---|"]
    truncated: list[str] = []
    try:
        for name, v in VARIANTS.items():
            t0 = time.perf_counter()
            prompts = [encode_prompt(r.problem, tok, use_chat_template=v["style"], system_prompt=v["system_prompt"])
                       for r in records]
            out = engine.generate(prompts, args.group_size, SamplingParams(
                temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed))
            texts = [r.text for r in out]
            golds = [records[r.group].answer for r in out]
            rs, rm = strict(texts, golds).rewards, mv(texts, golds).rewards
            G = args.group_size

            def varied(rew):
                groups = [rew[i:i + G] for i in range(0, len(rew), G)]
                return sum(len(set(g)) > 1 for g in groups) / len(groups)

            boxed = sum(extract_strict_box_answer(t) is not None for t in texts) / len(texts)
            mean_len = sum(len(r.response_ids) for r in out) / len(out)
            lines.append(f"| {name} | {boxed:.2f} | {sum(x > 0 for x in rs) / len(rs):.2f} | "
                         f"{sum(x > 0 for x in rm) / len(rm):.2f} | {varied(rs):.2f} | {varied(rm):.2f} | "
                         f"{mean_len:.0f} | {time.perf_counter() - t0:.0f} |")
            print(lines[-1], flush=True)
            print("   example:", repr(texts[0][-200:]))
            for L in args.truncate_at:  # the same responses, cut to L tokens
                cut = [tok.decode(r.response_ids[:L], skip_special_tokens=True) for r in out]
                rm_cut = mv(cut, golds).rewards
                truncated.append(f"| {name} | {L} | {sum(x > 0 for x in rm_cut) / len(rm_cut):.2f} | "
                                 f"{varied(rm_cut):.2f} | {sum(len(r.response_ids) <= L for r in out) / len(out):.2f} |")
                print(truncated[-1], flush=True)
    finally:
        mv.close()
    if truncated:
        lines += ["", "Responses cut to L tokens (the same samples; how much of the budget the answer needs):", "",
                  "| variant | L | math-verify correct | groups with varied math-verify reward | ended within L |",
                  "|---|---|---|---|---|", *truncated]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

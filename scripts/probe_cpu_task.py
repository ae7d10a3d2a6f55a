"""Probe the CPU study's training task (issue 17): does the base model have a learning signal on it, and how much
of math-verify's "correct" is an echo of the question?

    python scripts/probe_cpu_task.py [--prompts 24] [--group-size 8] [--out results/cpu_task_probe.md]

Samples the embedded SmolLM2-135M-Instruct exactly as the CPU recipe does (configs/cpu_smollm2_base.yaml: its chat
prompt with the one-shot system prompt, T = 1, top-p = 1, ``rollout.response_length`` new tokens) on each candidate
problem set, G responses per problem, and scores every response with both rewards:

* ``math_verify``: the grader alone; math-verify evaluates an unevaluated expression, so "So 9 + 5." is correct
  for 14;
* ``math_verify_value``: the same, and an answer that is still an expression scores -1
  (:func:`stapo.tasks.grader.is_unevaluated_expression`).

Per set it reports the accuracy under each, the echo share (responses correct under ``math_verify`` only, as a
share of its correct ones), the share of groups whose rewards vary (only those give GRPO a gradient), the mean
response length and the truncation rate. The candidate sets: the synthetic training split at levels [1, 2] (the CPU
recipe), [1] and [2] alone, and the two held-out benchmarks (``arith_test``: level 2, ``arith_hard``: levels 3-4).
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from stapo.config import load_config
from stapo.tasks.data import load_train_set
from stapo.tasks.grader import MathGrader
from stapo.model.models import load_policy
from stapo.tasks.prompts import encode_prompt
from stapo.tasks.rewards import MathVerifyReward
from stapo.rollout import SamplingParams, build_rollout_engine
from stapo.tasks.synthetic import generated_benchmark

REPO = Path(__file__).resolve().parents[1]


def candidate_sets(n: int, seed: int) -> dict[str, list]:
    """Problem set name → the first ``n`` records (training split sets are drawn with ``split="train"``)."""
    train = {f"train levels {lv}": load_train_set("synthetic", n=n, seed=seed, levels=tuple(lv), split="train").records
             for lv in ([1, 2], [1], [2])}
    held = {f"{name} (held out)": generated_benchmark(name)[:n] for name in ("arith_test", "arith_hard")}
    return {**train, **held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24, help="problems per candidate set")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="configs/cpu_smollm2_base.yaml", help="the recipe whose prompt and budget to use")
    ap.add_argument("--out", default="results/cpu_task_probe.md")
    args = ap.parse_args()

    cfg = load_config(REPO / args.config)
    G, budget = args.group_size, int(cfg.rollout.response_length)
    model, tok = load_policy(cfg.model.path)
    engine = build_rollout_engine("vllm", model, tok, max_model_len=cfg.data.max_prompt_length + budget,
                                  kv_cache_gib=1.0, seed=args.seed)
    plain, value = MathVerifyReward(), MathVerifyReward(grader=MathGrader(num_workers=2, require_value=True))
    command = (f"python scripts/probe_cpu_task.py --prompts {args.prompts} --group-size {G} --seed {args.seed}"
               + (f" --config {args.config}" if args.config != "configs/cpu_smollm2_base.yaml" else ""))
    lines = [f"# CPU study task probe: SmolLM2-135M-Instruct, the CPU recipe's prompt, {budget} new tokens", "",
             f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"{platform.processor() or platform.machine()}). {args.prompts} problems × G = {G} per set, T = 1, "
             "top-p = 1.", "",
             "| problem set | math_verify accuracy | math_verify_value accuracy | echo share of math_verify's correct "
             "| groups with varied reward (math_verify) | groups with varied reward (math_verify_value) "
             "| mean length (tokens) | truncated |",
             "|---|---|---|---|---|---|---|---|"]
    examples: list[str] = []
    try:
        for name, records in candidate_sets(args.prompts, args.seed).items():
            prompts = [encode_prompt(r.problem, tok, use_chat_template=cfg.data.prompt_style,
                                     system_prompt=cfg.data.system_prompt) for r in records]
            out = engine.generate(prompts, G, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=budget,
                                                             seed=args.seed))
            texts = [r.text for r in out]
            golds = [records[r.group].answer for r in out]
            rp, rv = plain(texts, golds).rewards, value(texts, golds).rewards

            def varied(rew: list[float]) -> float:
                groups = [rew[i:i + G] for i in range(0, len(rew), G)]
                return sum(len(set(g)) > 1 for g in groups) / len(groups)

            n_p, n_v = sum(x > 0 for x in rp), sum(x > 0 for x in rv)
            echo = (n_p - n_v) / n_p if n_p else float("nan")
            mean_len = sum(len(r.response_ids) for r in out) / len(out)
            trunc = sum(r.finish_reason == "length" for r in out) / len(out)
            lines.append(f"| {name} | {n_p / len(rp):.3f} | {n_v / len(rv):.3f} | {echo:.2f} | {varied(rp):.2f} | "
                         f"{varied(rv):.2f} | {mean_len:.0f} | {trunc:.2f} |")
            print(lines[-1], flush=True)
            for t, g, a, b in zip(texts, golds, rp, rv):
                if a > 0 and b < 0 and len(examples) < 4:  # an echo: correct for math_verify only
                    examples.append(f"- gold {g}: `{t.strip()[-120:]!s}`".replace("\n", " "))
    finally:
        plain.close()
        value.grader.close()
    if examples:
        lines += ["", "Responses math_verify pays and math_verify_value does not (their last 120 characters):", "",
                  *examples]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

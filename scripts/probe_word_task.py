"""Probe the word-problem task (issue 32, item 2) on the base model: accuracy and response lengths per level.

    python scripts/probe_word_task.py [--problems 32] [--group-size 2] [--levels 2 3 4] [--backend vllm]
                                      [--out results/word_task_probe.md] [--dump responses.jsonl]

Samples the policy of ``--config`` (default configs/cpu_smollm2_word_justrl.yaml: the embedded SmolLM2-135M-Instruct,
its chat prompt with the one-shot worked example, T and the 256-token cap) on ``--problems`` held-out problems of
each level (``generate_word_problems(split="test")``, the split of ``word_test``), G responses each, and cuts every
response at its first complete ``\\boxed{}`` as ``rollout.stop_at_first_boxed`` does in training
(:func:`stapo.rollout.boxed_cut.cut_responses_at_first_boxed`). Per level it reports:

* accuracy under the strict-box reward and under math-verify, both on the cut text;
* boxed: the share of responses with a complete box (before the cap); capped: the share that hit the cap without one;
* the mean response length before and after the cut, the median and 90th percentile after it, and the mean length
  of the strict-box-correct responses (tokens, EOS included where kept);
* the share of groups whose strict-box rewards vary (only those give GRPO a gradient; needs G >= 2);
* the reference solutions' mean length (:func:`stapo.tasks.word_problems.reference_solution`, + 1 for the EOS);
* from the engine's log-probs of the sampled tokens (cut responses): their mean −log p, an unbiased estimate of the
  policy's mean token entropy (E over y ~ π of −log π(y) = H), and the share of sampled tokens with p < τ_p = 0.002
  (S2T's probability condition: the candidates before the advantage and entropy conditions).

``--dump`` writes every response (level, problem, gold, rewards, lengths, cut text) as JSON lines. It guides the
calibration stage (issue 32, item 5: a difficulty mix with 25-50 % accuracy). One example response per
level (cut, its first 300 characters) follows the table.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stapo.config import load_config  # noqa: E402
from stapo.core.params import PROB_THRESHOLD  # noqa: E402
from stapo.model.models import load_policy  # noqa: E402
from stapo.tasks.prompts import encode_prompt  # noqa: E402
from stapo.tasks.rewards import MathVerifyReward, StrictBoxReward  # noqa: E402
from stapo.rollout import SamplingParams, build_rollout_engine  # noqa: E402
from stapo.rollout.boxed_cut import cut_responses_at_first_boxed  # noqa: E402
from stapo.tasks.word_problems import WORD_LEVELS, generate_word_problems, reference_solution  # noqa: E402


def _quantile(values: list[int], q: float) -> float:
    """The ``q`` quantile (nearest rank) of a non-empty list."""
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=32, help="held-out problems per level")
    ap.add_argument("--group-size", type=int, default=2, help="responses per problem (G)")
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 3, 4], help=f"of {sorted(WORD_LEVELS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--config", default="configs/cpu_smollm2_word_justrl.yaml", help="its model, prompt and budget")
    ap.add_argument("--model", default=None, help="another model.path than the config's (e.g. a cold-start folder)")
    ap.add_argument("--out", default="results/word_task_probe.md")
    ap.add_argument("--dump", default=None, help="also write every response (JSON lines) to this file")
    ap.add_argument("--json", default=None, help="also write the table's rows (one object per level) to this file")
    args = ap.parse_args()
    bad = [lv for lv in args.levels if lv not in WORD_LEVELS]
    if bad or args.problems < 1 or args.group_size < 1:
        print(f"probe_word_task.py: --levels must be of {sorted(WORD_LEVELS)} (got {bad}), --problems and "
              "--group-size >= 1", file=sys.stderr)
        sys.exit(2)

    cfg = load_config(REPO / args.config, [f"model.path={args.model}"] if args.model else [])
    G, budget = args.group_size, int(cfg.rollout.response_length)
    model, tok = load_policy(cfg.model.path)
    kwargs = ({"max_model_len": cfg.data.max_prompt_length + budget, "kv_cache_gib": 1.0, "seed": args.seed}
              if args.backend == "vllm" else {})
    engine = build_rollout_engine(args.backend, model, tok, **kwargs)
    strict, verify = StrictBoxReward(), MathVerifyReward(num_workers=1)
    command = (f"python scripts/probe_word_task.py --problems {args.problems} --group-size {G} --levels "
               f"{' '.join(map(str, args.levels))} --seed {args.seed} --backend {args.backend}"
               + (f" --config {args.config}" if args.config != "configs/cpu_smollm2_word_justrl.yaml" else "")
               + (f" --model {args.model}" if args.model else ""))
    lines = [f"# Word-task probe: {cfg.model.path}, the one-shot worked-example prompt, {budget} new tokens", "",
             f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"{platform.processor() or platform.machine()}). {args.problems} held-out problems × G = {G} per level, "
             f"T = {cfg.rollout.temperature}, top-p = {cfg.rollout.top_p}; every response cut at its first complete "
             "\\boxed{} (rollout.stop_at_first_boxed). Lengths in tokens.", "",
             "| level | K | strict-box accuracy | math-verify accuracy | boxed | capped | groups with varied reward "
             "| mean length (uncut) | mean / median / p90 length (cut) | mean length, correct | reference mean "
             "| mean −log p (≈ entropy) | p < 0.002 share | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    examples: list[str] = []
    dumped: list[str] = []
    rows: list[dict] = []
    try:
        for level in args.levels:
            t0 = time.perf_counter()
            records = generate_word_problems(args.problems, seed=args.seed, levels=[level], split="test")
            prompts = [encode_prompt(r.problem, tok, use_chat_template=cfg.data.prompt_style,
                                     system_prompt=cfg.data.system_prompt) for r in records]
            raw = engine.generate(prompts, G, SamplingParams(temperature=cfg.rollout.temperature,
                                                             top_p=cfg.rollout.top_p, max_new_tokens=budget,
                                                             seed=args.seed))
            out = cut_responses_at_first_boxed(raw, tok)
            texts, golds = [r.text for r in out], [records[r.group].answer for r in out]
            rs, rv = strict(texts, golds).rewards, verify(texts, golds).rewards
            cut_len = [len(r.response_ids) for r in out]
            correct_len = [n for n, x in zip(cut_len, rs) if x > 0]
            groups = [rs[i:i + G] for i in range(0, len(rs), G)]
            ref = [len(tok(reference_solution(r.problem))["input_ids"]) + 1 for r in records]
            n = len(out)
            lps = [x for r in out for x in (r.engine_logprobs or [])]
            nll = f"{-statistics.mean(lps):.3f}" if lps else "–"
            low_p = f"{sum(x < math.log(PROB_THRESHOLD) for x in lps) / len(lps):.4f}" if lps else "–"
            correct_mean = f"{statistics.mean(correct_len):.0f}" if correct_len else "–"
            lines.append(
                f"| {level} | {WORD_LEVELS[level].operations} | {sum(x > 0 for x in rs) / n:.3f} "
                f"| {sum(x > 0 for x in rv) / n:.3f} | {sum(r.finish_reason == 'boxed' for r in out) / n:.2f} "
                f"| {sum(r.finish_reason == 'length' for r in out) / n:.2f} "
                f"| {sum(len(set(g)) > 1 for g in groups) / len(groups):.2f} "
                f"| {statistics.mean(len(r.response_ids) for r in raw):.0f} "
                f"| {statistics.mean(cut_len):.0f} / {statistics.median(cut_len):.0f} / {_quantile(cut_len, 0.9):.0f} "
                f"| {correct_mean} | {statistics.mean(ref):.0f} | {nll} | {low_p} | {time.perf_counter() - t0:.0f} |")
            print(lines[-1], flush=True)
            rows.append({"level": level, "operations": WORD_LEVELS[level].operations, "n": n,
                         "accuracy": sum(x > 0 for x in rs) / n, "math_verify_accuracy": sum(x > 0 for x in rv) / n,
                         "boxed_rate": sum(r.finish_reason == "boxed" for r in out) / n,
                         "capped_rate": sum(r.finish_reason == "length" for r in out) / n,
                         "varied_groups": sum(len(set(g)) > 1 for g in groups) / len(groups),
                         "mean_length": statistics.mean(cut_len), "model": cfg.model.path,
                         "mean_nll": -statistics.mean(lps) if lps else None,
                         "low_p_share": sum(x < math.log(PROB_THRESHOLD) for x in lps) / len(lps) if lps else None,
                         "temperature": cfg.rollout.temperature, "seed": args.seed})
            dumped += [json.dumps({"level": level, "problem": records[r.group].problem, "gold": golds[i],
                                   "strict": rs[i], "math_verify": rv[i], "finish_reason": r.finish_reason,
                                   "tokens": len(r.response_ids), "uncut_tokens": len(raw[i].response_ids),
                                   "response": r.text}) for i, r in enumerate(out)]
            first = out[0]
            examples += [f"Level {level}, gold {golds[0]}, strict reward {rs[0]:+.0f}, {len(first.response_ids)} "
                         f"tokens ({first.finish_reason}):", "", "```", first.text[:300], "```", ""]
    finally:
        verify.close()
        engine.close()
    lines += ["", "One response per level (the first sample of the first problem, cut):", "", *examples]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.out}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.dump:
        Path(args.dump).write_text("\n".join(dumped) + "\n")
        print(f"wrote {args.dump}")


if __name__ == "__main__":
    main()

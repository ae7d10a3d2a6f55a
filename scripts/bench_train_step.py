#!/usr/bin/env python
"""Training-step throughput: our trainer vs TRL's GRPOTrainer on the same prompts, reward and model.

    .venv/bin/python scripts/bench_train_step.py                      # writes results/benchmarks/train_step.md
    .venv/bin/python scripts/bench_train_step.py --rounds 1 --steps 1 --out /tmp/train_step.md

Workload (issue 5): the CPU SmolLM2 config (configs/cpu_smollm2_stapo.yaml: embedded SmolLM2-135M-Instruct, fp32,
the one-shot chat prompt, math-verify reward, STAPO) at 8 prompts × G = 8, ≤ 128 new tokens, T = 1, top-p = 1,
one optimizer step per training step over micro-batches of 16 responses.

* **ours**: :class:`stapo.train.Trainer` (vLLM-CPU rollouts; ``actor.fused_forward`` as in the CPU config: one
  mini-batch per step, so the S2T statistics and the old log-probs come from the update's own forward and there
  is no separate old-policy pass; shared-prompt forward, compiled token statistics), with its per-stage timings
  ``timing_s/*``. ``--ours-overrides actor.fused_forward=false`` measures the variant with the no-grad pass.
* **TRL**: ``trl.GRPOTrainer`` (HF ``generate`` rollouts — TRL's vLLM modes need a CUDA server or colocated
  CUDA engine), ``loss_type="dapo"``, ``beta=0`` (so no reference pass; with one optimizer step per generation
  TRL also skips the old-policy pass), per-device batch 16 × gradient accumulation 4 = 64 responses, the same
  learning rate and clipping. Its rollout time is the wall time of ``_generate_and_score_completions``
  (generation + reward + advantages), the rest of the step is "update".

Both get the same prompt texts in the same order (those our data loader yields for seed 0) and the same reward
function. Each (method, round) runs in a fresh subprocess: one untimed warm-up step (compilation, engine
start-up, allocator warm-up), then ``--steps`` timed steps. Rounds alternate ours / TRL to spread machine-load
drift over both. Throughput = response tokens (EOS included) / step wall time; responses differ between the
two (different samplers), so tokens/s — not s/step — is the comparable number. The ratio is computed from
the medians of the two methods measured in the same invocation.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "cpu_smollm2_stapo.yaml"
OVERRIDES = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=16",
             "rollout.response_length=128", "data.max_prompt_length=256"]


def _load_cfg(extra: list[str]):
    from stapo.config import load_config

    return load_config(CONFIG, OVERRIDES + extra)


def _prompt_batches(cfg, tokenizer, n_steps: int) -> list[list[tuple[str, str]]]:
    """The (prompt text, gold) of each step, in the order our trainer's PromptLoader yields them."""
    from stapo.data import load_train_set
    from stapo.prompts import encode_prompt
    from stapo.train import PromptLoader

    dc = cfg.data
    recs = load_train_set("synthetic", n=dc.synthetic.num_problems, seed=dc.synthetic.seed,
                          levels=tuple(dc.synthetic.levels))
    prompts = [(encode_prompt(r.problem, tokenizer, use_chat_template=dc.prompt_style,
                              system_prompt=dc.system_prompt), r.answer, r.id) for r in recs]
    loader = PromptLoader(prompts, dc.train_batch_size, cfg.trainer.seed, dc.shuffle)
    return [[(tokenizer.decode(ids), gold) for ids, gold, _ in loader.next_batch()] for _ in range(n_steps)]


def run_ours(steps: int, overrides: list[str] = ()) -> dict:
    from stapo.train import Trainer

    with tempfile.TemporaryDirectory(prefix="bench-ours-") as tmp:
        cfg = _load_cfg([f"trainer.output_dir={tmp}", "trainer.run_name=bench", "logging.wandb_mode=disabled",
                         "trainer.progress_bar=false", "trainer.save_every=0", "trainer.log_examples_every=0",
                         f"trainer.total_steps={steps + 1}", *overrides])
        trainer = Trainer(cfg)
        trainer.save = lambda: None  # no checkpoint writes inside the timing
        history = trainer.train()
    rows = []
    for m in history[1:]:
        rows.append({"step_s": m["timing_s/step"], "tokens": m["response_length/total_tokens"],
                     "rollout_s": m["timing_s/rollout"] + m["timing_s/reward"],
                     "old_log_prob_s": m["timing_s/old_log_prob"], "update_s": m["timing_s/update"],
                     "sync_s": m["timing_s/sync"], "reward": m["critic/score/mean"]})
    return {"method": "ours", "steps": rows}


def run_trl(steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stapo.models import load_policy
    from stapo.rewards import make_reward_fn

    cfg = _load_cfg([])
    model, tok = load_policy(cfg.model.path, dtype=cfg.model.param_dtype)
    G = cfg.rollout.n
    batches = _prompt_batches(cfg, tok, steps + 1)
    # TRL repeats each prompt G times itself; one row per prompt, in our order, no shuffling.
    ds = Dataset.from_list([{"prompt": p, "answer": gold} for batch in batches for p, gold in batch])
    reward = make_reward_fn(cfg.algorithm.reward)

    def reward_func(completions, answer, **_):
        return list(reward(list(completions), list(answer)).rewards)

    micro = cfg.actor.ppo_micro_batch_size
    per_step = cfg.data.train_batch_size * G
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
            logging_steps=1, seed=cfg.trainer.seed, shuffle_dataset=False, dataloader_num_workers=0,
            per_device_train_batch_size=micro, gradient_accumulation_steps=per_step // micro,
            num_generations=G, max_completion_length=cfg.rollout.response_length,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=0,
            loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, num_iterations=1,
            learning_rate=cfg.actor.lr, weight_decay=cfg.actor.weight_decay, max_grad_norm=cfg.actor.grad_clip,
            warmup_steps=cfg.actor.warmup_steps, lr_scheduler_type="constant_with_warmup",
            max_steps=steps + 1, use_vllm=False, disable_dropout=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_func, args=args, train_dataset=ds,
                              processing_class=tok)
        rollout_s: list[float] = []
        tokens: list[float] = []
        orig = trainer._generate_and_score_completions

        def timed_generate(*a, **kw):
            t0 = time.perf_counter()
            out = orig(*a, **kw)
            rollout_s.append(time.perf_counter() - t0)
            tokens.append(float(out["completion_mask"].sum()))
            return out

        trainer._generate_and_score_completions = timed_generate
        step_s: list[float] = []

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                step_s.append(time.perf_counter() - self.t0)

        trainer.add_callback(StepTimer())
        torch.manual_seed(cfg.trainer.seed)
        trainer.train()
    reward.close()
    if len(rollout_s) != len(step_s):
        raise RuntimeError(f"TRL generated {len(rollout_s)} times in {len(step_s)} steps: expected one per step")
    rows = [{"step_s": s, "tokens": n, "rollout_s": r, "update_s": s - r}
            for s, n, r in list(zip(step_s, tokens, rollout_s))[1:]]
    return {"method": "trl", "steps": rows}


def _worker(method: str, steps: int, out: str, ours_overrides: list[str]) -> None:
    import resource

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res = run_ours(steps, ours_overrides) if method == "ours" else run_trl(steps)
    res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux → GiB
    Path(out).write_text(json.dumps(res))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="alternating (ours, TRL) rounds")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--methods", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    ap.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "train_step.md"))
    ap.add_argument("--ours-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra config overrides for our trainer (e.g. actor.fused_forward=false)")
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker[0], args.steps, args.worker[1], args.ours_overrides)
        return

    load_before = _load()
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for rnd in range(args.rounds):
        for method in args.methods:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--worker", method, out,
                                   "--ours-overrides", *args.ours_overrides], cwd=REPO)
            if proc.returncode != 0:
                sys.exit(f"bench_train_step: the {method} worker failed (exit {proc.returncode})")
            res = json.loads(Path(out).read_text())
            os.unlink(out)
            rows = [{**r, "peak_rss_gib": res["peak_rss_gib"]} for r in res["steps"]]
            results[method].extend(rows)
            for r in rows:
                print(f"round {rnd + 1} {method:4s}: {r['step_s']:.1f} s/step, {r['tokens']:.0f} response tokens, "
                      f"{r['tokens'] / r['step_s']:.1f} tok/s  (process {time.perf_counter() - t0:.0f} s)", flush=True)
    load_after = _load()

    import torch

    def med(rows, key):
        vals = [r[key] for r in rows if key in r]
        return statistics.median(vals) if vals else float("nan")

    summary = {}
    for m, rows in results.items():
        summary[m] = {"tok_s": statistics.median(r["tokens"] / r["step_s"] for r in rows),
                      "step_s": med(rows, "step_s"), "tokens": med(rows, "tokens"),
                      "rollout_s": med(rows, "rollout_s"), "old_log_prob_s": med(rows, "old_log_prob_s"),
                      "update_s": med(rows, "update_s"), "sync_s": med(rows, "sync_s"), "n": len(rows),
                      "rss": max(r["peak_rss_gib"] for r in rows)}
    base = summary.get("trl", {}).get("tok_s")
    lines = [
        "# Training-step benchmark: stapo trainer vs TRL GRPOTrainer",
        "",
        "SmolLM2-135M-Instruct (embedded), fp32, CPU; the CPU STAPO config at 8 prompts × G = 8, ≤ 128 new tokens,",
        "one optimizer step per training step (micro-batches of 16 responses); the same prompts (in the same order),",
        "the same one-shot chat prompt and the same math-verify reward for both. TRL: GRPOTrainer with",
        "loss_type=dapo, beta=0, HF generate. Each run in a fresh process: one warm-up step, then timed steps;",
        "runs alternate ours / TRL. Throughput = response tokens / step wall time (median over timed steps).",
        "",
        f"- Command: `python scripts/bench_train_step.py --rounds {args.rounds} --steps {args.steps}"
        + (f" --ours-overrides {' '.join(args.ours_overrides)}" if args.ours_overrides else "") + "`",
        f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {platform.processor() or platform.machine()}, nproc = {os.cpu_count()}, torch {torch.__version__}"
        + (f", trl {__import__('trl').__version__}" if "trl" in results else ""),
        f"- Load average (1/5/15 min) before / after: {load_before} / {load_after}",
        "",
        "| method | timed steps | response tokens / step | s / step | rollout s | old log-prob s | update s | "
        "sync s | tokens / s | ratio to TRL | peak RSS GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "—" if x != x else f"{x:.1f}"

    for m, s in summary.items():
        ratio = f"{s['tok_s'] / base:.2f}×" if base else "—"
        name = "stapo Trainer (vLLM-CPU rollouts)" if m == "ours" else "TRL GRPOTrainer (HF generate)"
        lines.append(f"| {name} | {s['n']} | {s['tokens']:.0f} | {f(s['step_s'])} | {f(s['rollout_s'])} | "
                     f"{f(s['old_log_prob_s'])} | {f(s['update_s'])} | {f(s['sync_s'])} | {s['tok_s']:.1f} | {ratio} | "
                     f"{s['rss']:.1f} |")
    lines += ["", "Per-step rows:", "", "| method | s / step | response tokens | tokens / s |", "|---|---|---|---|"]
    for m, rows in results.items():
        for r in rows:
            lines.append(f"| {m} | {r['step_s']:.1f} | {r['tokens']:.0f} | {r['tokens'] / r['step_s']:.1f} |")
    lines += ["", "TRL's rollout column is `_generate_and_score_completions` (generation, reward, advantages); its",
              "update column is the rest of the step. Neither computes a separate old-policy pass here (one optimizer",
              "step per generation): TRL uses the update's log-probs, detached; ours (actor.fused_forward) forwards the",
              "whole mini-batch with grad, builds the S2T mask from the detached p and H, then runs the backwards.",
              "Peak RSS: the worker process's maximum resident memory (model, optimizer, activations; for ours also",
              "the in-process vLLM engine with its 1 GiB KV cache)."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

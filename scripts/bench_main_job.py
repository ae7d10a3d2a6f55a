#!/usr/bin/env python
"""The README's main job (20 CPU steps of STAPO on SmolLM2), timed end to end, before and after a change.

    python scripts/bench_main_job.py [--seeds 0 1] [--variants before after] [--out results/benchmarks/main_job.md]

Each run is the README's first command, ``python train.py --config configs/cpu_smollm2_stapo.yaml``, in a fresh
process, into a temporary folder (no W&B, no progress bar), with one variant's overrides:

* **before**: ``model.compute_dtype=float32 actor.lm_head=logits`` — the CPU config as it was before issue 15;
* **after**: the config as it is on main (``compute_dtype: auto`` → bf16 where the CPU has native bf16,
  ``lm_head: fused``);
* **bf16-logits** (optional): ``model.compute_dtype=bfloat16 actor.lm_head=logits`` — bf16 compute without the
  fused head, to tell the two switches apart.

Runs alternate variants within each seed (before, after, then the next seed). Reported per run: the wall time of
the whole command (start-up, 20 steps, checkpoint writes), the sum of the steps' ``timing_s/step``, and the means
over the first and last 5 steps of reward, accuracy, entropy and S2T masked fraction.

Tolerance of the changed arithmetic: bf16 matmuls change the sampled responses from the first step on, so the two
variants' runs differ as two seeds do, not by rounding. A metric counts as the same when the difference of the
variants' means over seeds is at most 2 × the pooled between-seed standard deviation (needs ≥ 2 seeds); the
script prints the test and its numbers, it does not decide for the reader.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from stapo.run.tracking import read_metrics  # noqa: E402

CONFIG = "configs/cpu_smollm2_stapo.yaml"
VARIANTS = {"before": ["model.compute_dtype=float32", "actor.lm_head=logits"], "after": [],
            # which of the two switches moves a metric: bf16 compute with the model's own LM head
            "bf16-logits": ["model.compute_dtype=bfloat16", "actor.lm_head=logits"]}
METRICS = [("critic/score/mean", "reward", "{:+.3f}"), ("reward/grader/accuracy", "accuracy", "{:.3f}"),
           ("actor/entropy", "entropy", "{:.3f}"), ("actor/s2t/masked_frac", "masked frac", "{:.4f}")]
WINDOW = 5


def run_once(variant: str, seed: int, extra: list[str]) -> dict:
    """One main job in a fresh process → wall time, Σ step time, and the first/last-window metric means.

    Raises:
        SystemExit: the run failed (its last stderr lines are printed).
    """
    with tempfile.TemporaryDirectory(prefix="bench-main-job-") as tmp:
        cmd = [sys.executable, "train.py", "--config", CONFIG, f"trainer.output_dir={tmp}", "trainer.run_name=run",
               f"trainer.seed={seed}", "logging.wandb_mode=disabled", "trainer.progress_bar=false",
               *VARIANTS[variant], *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"bench_main_job: {variant} seed {seed} failed (exit {proc.returncode}):\n"
                     + "\n".join(proc.stderr.splitlines()[-5:]))
        rows = read_metrics(Path(tmp) / "run" / "metrics.jsonl")
        resolved = json.loads((Path(tmp) / "run" / "config.json").read_text())
    rows = [r for r in rows if "timing_s/step" in r]  # training steps (validation rows have no step timing)
    out = {"variant": variant, "seed": seed, "wall_s": wall, "steps": len(rows),
           "step_s_sum": sum(r["timing_s/step"] for r in rows),
           "compute_dtype": resolved.get("model", {}).get("compute_dtype"),
           "lm_head": resolved.get("actor", {}).get("lm_head")}
    for key, _, _ in METRICS:
        vals = [r[key] for r in rows if key in r]
        out[f"{key}/first"] = statistics.fmean(vals[:WINDOW]) if vals else float("nan")
        out[f"{key}/last"] = statistics.fmean(vals[-WINDOW:]) if vals else float("nan")
    return out


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def report(runs: list[dict], args, machine: str, load: tuple[str, str]) -> list[str]:
    """The markdown report: one row per run, then per-variant means and the speed ratio and tolerance test."""
    lines = ["# The CPU main job, end to end: before and after issue 15", "",
             f"- Command: `python scripts/bench_main_job.py --seeds {' '.join(map(str, args.seeds))} --variants "
             f"{' '.join(args.variants)}`" + (f" (extra overrides: {' '.join(args.overrides)})" if args.overrides else ""),
             f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC" + (f"; {args.note}" if args.note else ""),
             f"- Machine: {machine}", f"- Load average (1/5/15 min) before / after: {load[0]} / {load[1]}",
             "- Each run: `python train.py --config configs/cpu_smollm2_stapo.yaml` + the variant's overrides "
             "(" + "; ".join(f"{v}: {' '.join(VARIANTS[v]) or 'the config on main'}" for v in args.variants)
             + "), fresh process, "
             f"W&B disabled. First / last = mean over the first / last {WINDOW} steps.", "",
             "| variant | seed | compute dtype | lm_head | wall s | Σ step s | "
             + " | ".join(f"{name} first → last" for _, name, _ in METRICS) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(METRICS)]
    for r in runs:
        cells = [f"{fmt.format(r[k + '/first'])} → {fmt.format(r[k + '/last'])}" for k, _, fmt in METRICS]
        lines.append(f"| {r['variant']} | {r['seed']} | {r['compute_dtype']} | {r['lm_head']} | {r['wall_s']:.0f} | "
                     f"{r['step_s_sum']:.0f} | " + " | ".join(cells) + " |")
    by = {v: [r for r in runs if r["variant"] == v] for v in args.variants}
    if "before" in by and "after" in by and by["before"] and by["after"]:
        wb = statistics.fmean(r["wall_s"] for r in by["before"])
        wa = statistics.fmean(r["wall_s"] for r in by["after"])
        sb = statistics.fmean(r["step_s_sum"] for r in by["before"])
        sa = statistics.fmean(r["step_s_sum"] for r in by["after"])
        lines += ["", f"**Speed-up (before / after, means over seeds): wall {wb / wa:.2f}× ({wb:.0f} → {wa:.0f} s), "
                  f"steps {sb / sa:.2f}× ({sb:.0f} → {sa:.0f} s).**", "",
                  "Last-window metrics, mean ± between-seed sd; tolerance |Δ| ≤ 2 × pooled sd "
                  "(bf16 changes the samples from step 1: the variants differ as seeds do):", "",
                  "| metric | before | after | Δ | 2 × pooled sd | within |", "|---|---|---|---|---|---|"]
        for key, name, fmt in METRICS:
            b = [r[f"{key}/last"] for r in by["before"]]
            a = [r[f"{key}/last"] for r in by["after"]]
            pooled = ((_sd(b) ** 2 + _sd(a) ** 2) / 2) ** 0.5
            delta = statistics.fmean(a) - statistics.fmean(b)
            within = "—" if pooled != pooled else ("yes" if abs(delta) <= 2 * pooled else "no")
            lines.append(f"| {name} | {fmt.format(statistics.fmean(b))} ± {fmt.format(_sd(b))} | "
                         f"{fmt.format(statistics.fmean(a))} ± {fmt.format(_sd(a))} | {fmt.format(delta)} | "
                         f"{fmt.format(2 * pooled)} | {within} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variants", nargs="+", default=["before", "after"], choices=sorted(VARIANTS))
    ap.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "main_job.md"))
    args = ap.parse_args()
    from stapo.common import perf

    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    runs = []
    for seed in args.seeds:
        for variant in args.variants:
            runs.append(run_once(variant, seed, args.overrides))
            r = runs[-1]
            print(f"{variant} seed {seed}: wall {r['wall_s']:.0f} s, steps {r['step_s_sum']:.0f} s, reward "
                  f"{r['critic/score/mean/first']:+.3f} → {r['critic/score/mean/last']:+.3f}", flush=True)
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = report(runs, args, perf.machine_line(), (load_before, load_after))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

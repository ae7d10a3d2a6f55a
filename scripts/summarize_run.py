#!/usr/bin/env python
"""Summarise a training run from its metrics.jsonl: start → end of reward, entropy, masked fraction, timings.

    python scripts/summarize_run.py runs/stapo_embedded-smollm2_seed0 [--window 5] [--wall-s 1234] [--out F.md]

"Start" and "end" are means over the first and last ``--window`` steps (one step of 32 responses is noisy).
Runs logged before the one metric vocabulary (``s2t/*`` keys...) are read through
:func:`stapo.metric_names.rename_legacy` (docs/metrics.md#one-vocabulary-native-trainer-and-verl-plugin).
``--wall-s``: the measured wall time of the whole command (e.g. from ``/usr/bin/time``), reported as given;
the sum of the steps' ``timing_s/step`` is always reported (it excludes start-up and checkpoint writes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stapo.metric_names import rename_legacy  # noqa: E402

KEYS = [("critic/score/mean", "reward (mean, ±1)", "{:+.3f}"),
        ("reward/grader/accuracy", "accuracy (math-verify)", "{:.3f}"),
        ("actor/entropy", "entropy (nats / token)", "{:.3f}"),
        ("actor/s2t/masked_frac", "S2T masked fraction", "{:.4f}"),
        ("actor/s2t/num_masked", "S2T masked tokens / step", "{:.1f}"),
        ("frac_reward_zero_std", "groups with zero reward std", "{:.2f}"),
        ("response_length/mean", "response length (tokens)", "{:.1f}"),
        ("response_length/clip_ratio", "truncated responses", "{:.2f}"),
        ("actor/grad_norm", "grad norm", "{:.3f}"),
        ("timing_s/step", "s / step", "{:.1f}"),
        ("timing_s/rollout", "rollout s", "{:.1f}"),
        ("timing_s/old_log_prob", "old log-prob s", "{:.1f}"),
        ("timing_s/update", "update s", "{:.1f}"),
        ("timing_s/sync", "sync s", "{:.2f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--wall-s", type=float, default=None)
    ap.add_argument("--command", default=None, help="the command that produced the run (printed as given)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = Path(args.run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"summarize_run: {path} not found (is {args.run_dir} a train.py run directory?)")
    rows = [rename_legacy(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"summarize_run: {path} has no rows")
    w = max(1, min(args.window, len(rows) // 2 or 1))
    first, last = rows[:w], rows[-w:]

    def mean(rs, k):
        vals = [r[k] for r in rs if k in r]
        return statistics.fmean(vals) if vals else float("nan")

    lines = [f"# Run summary: {Path(args.run_dir).name}", ""]
    if args.command:
        lines += [f"- Command: `{args.command}`"]
    lines += [f"- Summary: `python scripts/summarize_run.py {args.run_dir} --window {args.window}"
              + (f" --wall-s {args.wall_s:.0f}" if args.wall_s else "") + "`",
              f"- Steps: {len(rows)} (start = mean of steps 1–{w}, end = mean of steps "
              f"{len(rows) - w + 1}–{len(rows)})",
              f"- Sum of step times: {sum(r.get('timing_s/step', 0.0) for r in rows) / 60:.1f} min"
              + (f"; wall time of the whole command: {args.wall_s / 60:.1f} min" if args.wall_s else ""), "",
              "| metric | start | end |", "|---|---|---|"]
    for key, label, fmt in KEYS:
        a, b = mean(first, key), mean(last, key)
        if a == a or b == b:
            lines.append(f"| {label} (`{key}`) | {fmt.format(a)} | {fmt.format(b)} |")
    lines += ["", "Per step:", "", "| step | reward | entropy | masked frac | zero-std groups | length | s |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r.get('critic/score/mean', float('nan')):+.3f} | "
                     f"{r.get('actor/entropy', float('nan')):.3f} | {r.get('actor/s2t/masked_frac', float('nan')):.4f} | "
                     f"{r.get('frac_reward_zero_std', float('nan')):.2f} | {r.get('response_length/mean', float('nan')):.1f} | "
                     f"{r.get('timing_s/step', float('nan')):.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Summarise a training run from its metrics.jsonl: start → end of reward, entropy, masked fraction, timings.

    python scripts/summarize_run.py runs/stapo_embedded-smollm2_seed0 [--window 5] [--wall-s 1234] [--out F.md]

"Start" and "end" are means over the first and last ``--window`` training steps (one step of 32 responses is noisy),
labelled by their ``step`` values; a row without training metrics (the step-0 validation of
``trainer.val_before_train``) is named but not counted as a step.
Runs logged before the one metric vocabulary (``s2t/*`` keys...) are read through
:func:`stapo.core.metric_names.rename_legacy` (docs/metrics.md#one-vocabulary-native-trainer-and-verl-plugin).
``--wall-s``: the measured wall time of the whole command (e.g. from ``/usr/bin/time``), reported as given;
the sum of the steps' ``timing_s/step`` is always reported (it excludes start-up and checkpoint writes).
The computation is :mod:`stapo.train.summary` (train.py prints its short form at the end of a run).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from stapo.run.tracking import CorruptJsonlError, read_metrics
    from stapo.core.metric_names import rename_legacy
    from stapo.train.summary import markdown_report

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--wall-s", type=float, default=None)
    ap.add_argument("--command", default=None, help="the command that produced the run (printed as given)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = Path(args.run_dir) / "metrics.jsonl"

    def fail(msg: str) -> None:  # one line, exit 2 (the other tools' code for bad input)
        print(f"summarize_run: {msg}", file=sys.stderr)
        raise SystemExit(2)

    if (Path(args.run_dir) / "eval_manifest.json").is_file():  # an evaluate.py folder (a checkpoint sweep's too)
        sweep = Path(args.run_dir) / "sweep.md"
        fail(f"{args.run_dir} is an evaluate.py output folder, not a train.py run"
             + (f": its checkpoints' results are in {sweep}" if sweep.is_file() else ": see its results.md"))
    if not path.is_file():
        fail(f"{path} not found (is {args.run_dir} a train.py run directory?)")
    try:
        # a torn last line (a run killed mid-write) is left out; keys logged before the one vocabulary renamed
        rows = [rename_legacy(r) for r in read_metrics(path)]  # NaN/inf as floats
    except CorruptJsonlError as e:
        fail(str(e))
    if not rows:
        fail(f"{path} has no rows")
    summary = (f"python scripts/summarize_run.py {args.run_dir} --window {args.window}"
               + (f" --wall-s {args.wall_s:.0f}" if args.wall_s else ""))
    text = markdown_report(rows, Path(args.run_dir).name, summary, window=args.window, wall_s=args.wall_s,
                           command=args.command)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Measure the grader's throughput on 2,000 MATH500-style answers and write results/benchmarks/grader.md.

The 2,000 answers are 4 responses for each of the 500 MATH500 problems:

1. the gold answer in a box after a sentence ("... so the answer is $\\boxed{gold}$.")  -> correct
2. the gold answer of the *next* problem in a box (a realistic wrong answer)          -> mostly incorrect
3. the reference solution text (long, with its own \\boxed{} answer)                 -> correct
4. the gold answer without a box ("The final answer is gold.")                       -> math-verify's
   own extraction

Each run uses a fresh :class:`stapo.tasks.grader.MathGrader` (cold math-verify caches); start-up
(spawning workers, importing sympy) is timed separately from grading.  Worker counts are run
``--repeats`` times, interleaved, and the median is reported (the sandbox CPUs are shared).

Usage::

    python scripts/bench_grader.py [--data-root ../shared/data] [--workers 1 2] [--timeout 5]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from stapo.tasks.data import load_benchmark  # noqa: E402
from stapo.tasks.grader import MathGrader  # noqa: E402


def build_answers(root: Path) -> tuple[list[str], list[str], list[str]]:
    """(responses, golds, kinds) for the 2,000 answers described in the module docstring."""
    records = load_benchmark("math500", root).records

    solutions = [
        json.loads(line)["solution"]
        for line in (root / "benchmarks" / "math500" / "test.jsonl").read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    responses, golds, kinds = [], [], []
    for i, record in enumerate(records):
        other = records[(i + 1) % len(records)].answer
        for kind, response in (
            ("boxed_gold", f"Working through the algebra, the answer is $\\boxed{{{record.answer}}}$."),
            ("boxed_other", f"Working through the algebra, the answer is $\\boxed{{{other}}}$."),
            ("solution", solutions[i]),
            ("unboxed_gold", f"The final answer is ${record.answer}$."),
        ):
            responses.append(response)
            golds.append(record.answer)
            kinds.append(kind)
    return responses, golds, kinds


def run(workers: int, timeout: float, responses: list[str], golds: list[str], kinds: list[str]) -> dict:
    t0 = time.perf_counter()
    grader = MathGrader(num_workers=workers, timeout_s=timeout)
    startup = time.perf_counter() - t0
    try:
        batch = grader.grade(responses, golds)
    finally:
        grader.close()
    per_kind: dict[str, list[int]] = {}
    for kind, result in zip(kinds, batch.results):
        per_kind.setdefault(kind, [0, 0])
        per_kind[kind][0] += result.correct
        per_kind[kind][1] += 1
    return {"workers": workers, "startup_s": startup, "stats": batch.stats, "per_kind": per_kind}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", type=Path, default=REPO_ROOT.parent / "shared" / "data")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="runs per worker count (interleaved); the median is reported")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "benchmarks" / "grader.md")
    args = parser.parse_args(argv)

    responses, golds, kinds = build_answers(args.data_root)
    load_before = os.getloadavg()
    runs: dict[int, list[dict]] = {w: [] for w in args.workers}
    for repeat in range(args.repeats):
        order = args.workers if repeat % 2 == 0 else list(reversed(args.workers))
        for workers in order:
            result = run(workers, args.timeout, responses, golds, kinds)
            s = result["stats"]
            print(f"run {repeat} workers={workers}: {s.n / s.seconds:.1f} answers/s ({s.seconds:.1f} s, start-up {result['startup_s']:.1f} s), {s}", flush=True)
            runs[workers].append(result)
    load_after = os.getloadavg()

    lines = [
        "# Grader throughput",
        "",
        f"Measured {dt.date.today().isoformat()} with `python scripts/bench_grader.py` on {os.cpu_count()} CPU cores "
        f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, "
        f"math-verify {version('math-verify')}, sympy {version('sympy')}; per-answer timeout {args.timeout:g} s; "
        f"{args.repeats} interleaved runs per worker count, each with a fresh grader.",
        "",
        f"{len(responses):,} MATH500-style answers: for each of the 500 MATH500 problems, (1) the gold answer boxed, "
        "(2) the next problem's gold answer boxed (a wrong answer), (3) the reference solution text, "
        "(4) the gold answer without a box (math-verify's own extraction).",
        "",
        f"Caveat: the machine was shared with other jobs (1-minute load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after), so the numbers are noisy; the range over runs is given.",
        "",
        "| workers | answers/s (median) | answers/s (min-max) | grading time, median (s) | worker start-up, median (s) | correct | incorrect | no answer | timeouts | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workers, results in runs.items():
        rates = sorted(r["stats"].n / r["stats"].seconds for r in results)
        secs = sorted(r["stats"].seconds for r in results)
        starts = sorted(r["startup_s"] for r in results)
        s = results[0]["stats"]
        mid = len(results) // 2
        lines.append(
            f"| {workers} | {rates[mid]:.0f} | {rates[0]:.0f}-{rates[-1]:.0f} | {secs[mid]:.1f} | {starts[mid]:.1f} | "
            f"{s.correct} | {s.incorrect} | {s.no_answer} | {s.timeouts} | {s.errors} |"
        )
    last = runs[args.workers[-1]][-1]
    lines += ["", "Correct per kind of response (verdicts are identical in every run):", "", "| kind | correct / total |", "|---|---|"]
    for kind, (correct, total) in last["per_kind"].items():
        lines.append(f"| {kind} | {correct} / {total} |")
    lines.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

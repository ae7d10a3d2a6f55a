"""Compare two runs' metrics.jsonl key by key (the "behaviour unchanged" check of a refactor).

    python scripts/compare_metrics.py results/reference/cpu_smollm2_stapo_seed0_metrics.jsonl runs/x/metrics.jsonl [--steps K]

Wall-clock keys (``timing_s/*``, ``perf/*``, ``reward/grader/seconds``) are skipped. Prints how many values differ,
whether any count (``*/num_*``, ``*/count``, lengths) differs, the largest relative difference of the other keys
and, separately, of the train/inference gap ``rollout/logprob_diff_*`` (itself a ~1e-5 rounding-level quantity).
Exit 0 always; read the numbers. Rows logged before the one metric vocabulary (``s2t/*`` keys..., e.g.
results/reference/*.jsonl) are read through :func:`stapo.core.metric_names.rename_legacy`, so an old reference and a new
run compare key by key. Both files are read with :func:`stapo.run.tracking.read_metrics` (NaN / ±inf as floats, old
files' ``null`` / ``±1e308`` too; docs/metrics.md#non-finite-values); NaN equals NaN here.
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stapo.core.metric_names import rename_legacy  # noqa: E402
from stapo.run.tracking import read_metrics  # noqa: E402

WALL = ("timing_s/", "perf/", "reward/grader/seconds")


def same(u: object, v: object) -> bool:
    """Equal values, NaN equal to NaN."""
    nan = isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v)
    return nan or u == v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--steps", type=int, default=None, help="compare only the first K steps (a partial run)")
    args = ap.parse_args()
    a = [rename_legacy(r) for r in read_metrics(args.a)]
    b = [rename_legacy(r) for r in read_metrics(args.b)]
    n = min(len(a), len(b)) if args.steps is None else args.steps
    values = differ = 0
    counts_differ, worst, worst_gap = [], (0.0, None), (0.0, None)
    for x, y in zip(a[:n], b[:n]):
        for k in sorted(set(x) | set(y)):
            if k.startswith(WALL):
                continue
            values += 1
            u, v = x.get(k), y.get(k)
            if same(u, v):
                continue
            differ += 1
            if "/num_" in k or k.endswith("/count") or k.startswith("response_length/") or not (
                    isinstance(u, (int, float)) and isinstance(v, (int, float))):
                counts_differ.append((x["step"], k, u, v))
                continue
            rel = abs(u - v) / max(abs(u), 1e-6)
            if k.startswith("rollout/logprob_diff"):
                worst_gap = max(worst_gap, (rel, (x["step"], k)))
            else:
                worst = max(worst, (rel, (x["step"], k)))
    identical_steps = [x["step"] for x, y in zip(a[:n], b[:n])
                       if all(same(x.get(k), y.get(k)) for k in set(x) | set(y) if not k.startswith(WALL))]
    print(f"{n} steps, {values} values compared, {differ} differ; steps identical: {identical_steps}")
    print(f"counts / lengths / non-numbers that differ: {counts_differ[:10] or 'none'}")
    print(f"largest relative difference, other keys: {worst[0]:.1e} {worst[1] or ''}")
    print(f"largest relative difference, rollout/logprob_diff_*: {worst_gap[0]:.1e} {worst_gap[1] or ''}")


if __name__ == "__main__":
    main()

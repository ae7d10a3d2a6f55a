"""Merge several evaluate.py results into one paper-layout table and bar chart.

    python scripts/compare.py GRPO=runs/eval/grpo 20-Entropy=runs/eval/entropy20 \\
        JustRL=runs/eval/justrl/results.json STAPO=runs/eval/stapo --out results/compare_cpu

Each argument is a results.json or a run directory holding one, optionally prefixed ``LABEL=`` to name its row
(default: the label stored in the file). Writes ``<out>/<name>.md`` (avg@N, pass@N and maj@N tables: rows =
methods, columns = the six benchmarks + Avg, the second decoding setting in parentheses), ``<name>.csv`` (long
format) and ``<name>.png`` (grouped bars, one panel per setting), and prints the avg@N table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="[LABEL=]path/to/results.json or run directory")
    parser.add_argument("--out", default="results/compare", help="output folder (default results/compare)")
    parser.add_argument("--name", default="comparison", help="file stem of the outputs (default comparison)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)

    from stapo.evaluation.errors import EvalError
    from stapo.evaluation.report import load_results, markdown_table, write_comparison

    try:
        loaded = []
        for item in args.results:
            label, sep, path = item.partition("=")
            if not sep or not label or Path(item).exists():
                label, path = None, item
            loaded.append(load_results(path, label))
        paths = write_comparison(loaded, args.out, name=args.name, plot=not args.no_plot)
    except EvalError as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(loaded, "avg@N"))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

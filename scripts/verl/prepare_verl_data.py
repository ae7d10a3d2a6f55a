#!/usr/bin/env python
"""Write DAPO-Math-17k and the validation benchmarks as verl RL parquet files with the JustRL prompt.

verl's RLHFDataset reads the chat messages of column ``prompt`` and applies the tokenizer's chat template
(base models too, as JustRL's verl pipeline does). JustRL appends its instruction inside its own fork of
verl's dataset (``use_boxed_suffix_prompt``); stock verl has no such option, so the suffix is written into the
user message here with :func:`stapo.tasks.prompts.user_content` (``problem + "\\n\\n" + BOXED_SUFFIX``).

Output rows (the verl format)::

    data_source   "dapo_math_17k" / "aime24" / ...
    prompt        [{"role": "user", "content": "<problem>\\n\\nPlease reason step by step, and put your final
                    answer within \\boxed{}."}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "<normalised gold answer>"}
    extra_info    {"index": <row>, "id": "<source>/<id>", "split": "train" | "test"}

Usage::

    python scripts/verl/prepare_verl_data.py --data-root ../shared/data --out data/verl
    # -> data/verl/train.parquet (17,917 rows), data/verl/aime24.parquet, aime25.parquet, amc23.parquet

Exit codes: 0 ok; 2 a data file is missing or unreadable.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from stapo.tasks.data import BENCHMARKS, DataError, Record, load_benchmark, load_train_set, resolve_data_root  # noqa: E402
from stapo.tasks.prompts import user_content  # noqa: E402

DEFAULT_VAL = ("aime24", "aime25", "amc23")  # JustRL validates on these three during training


def verl_rows(records: Iterable[Record], split: str) -> list[dict]:
    """verl RL rows for ``records`` (see the module docstring); ``split`` is ``"train"`` or ``"test"``."""
    return [{
        "data_source": r.source,
        "prompt": [{"role": "user", "content": user_content(r.problem)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": r.answer},
        "extra_info": {"index": i, "id": r.id, "split": split},
    } for i, r in enumerate(records)]


def write_parquet(rows: list[dict], path: Path) -> None:
    """Write ``rows`` to ``path`` (parent folders created)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default=None, help="data root (default: $STAPO_DATA_ROOT or data/)")
    ap.add_argument("--out", default="data/verl", help="output folder (default data/verl)")
    ap.add_argument("--train-set", default="dapo_math_17k")
    ap.add_argument("--val", default=",".join(DEFAULT_VAL),
                    help=f"comma-separated benchmarks for verl's validation (any of {', '.join(BENCHMARKS)})")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        root = resolve_data_root(args.data_root)
        train = load_train_set(args.train_set, root)
        write_parquet(verl_rows(train, "train"), out / "train.parquet")
        print(f"{out / 'train.parquet'}: {len(train)} rows ({train.stats.skipped} skipped)")
        for name in [v for v in args.val.split(",") if v]:
            bench = load_benchmark(name, root)
            write_parquet(verl_rows(bench, "test"), out / f"{name}.parquet")
            print(f"{out / (name + '.parquet')}: {len(bench)} rows")
    except (DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

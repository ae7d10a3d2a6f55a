#!/usr/bin/env python
"""A token-level viewer of a training step's rollouts: one static HTML page (docs/metrics.md#token-viewer).

    python scripts/view_rollouts.py runs/<run> [--step K] [--out F.html]

Needs a run trained with ``trainer.save_rollouts=true`` (``<run>/rollouts/step_XXXXXX.jsonl.gz``). ``--step``
defaults to the last saved step, ``--out`` to ``<run>/rollouts/step_XXXXXX.html``. Open the page in any browser
(it needs no network). The page is built by :func:`stapo.tools.viewer.write_page`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stapo.run.cli import ArgumentParser  # noqa: E402
from stapo.tools.viewer import ViewerError, write_page  # noqa: E402


def _step(text: str) -> int:
    """``--step``: a training step, an integer >= 1 (argparse turns the error into one usage line, exit 2)."""
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if step < 1:
        raise argparse.ArgumentTypeError(f"step must be >= 1, got {step}")
    return step


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="view_rollouts.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a train.py run directory")
    ap.add_argument("--step", type=_step, default=None, help="training step (default: the last saved one)")
    ap.add_argument("--out", default=None, help="HTML file to write (default: <run>/rollouts/step_XXXXXX.html)")
    args = ap.parse_args(argv)
    try:
        out = write_page(args.run_dir, args.step, args.out)
    except (ViewerError, OSError) as e:
        print(f"view_rollouts.py: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

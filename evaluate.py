"""Evaluate a checkpoint on the six math benchmarks: `python evaluate.py --config configs/eval/<name>.yaml`."""
import sys

if __name__ == "__main__":
    sys.exit("evaluate.py: the evaluation harness is not implemented yet (tracked in issue 6).")

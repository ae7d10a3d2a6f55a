"""Train a policy with STAPO or a baseline: `python train.py --config configs/<name>.yaml [key=value ...]`."""
import sys

if __name__ == "__main__":
    sys.exit("train.py: the trainer is not implemented yet (tracked in issue 5); "
             "the algorithm core lives in stapo/ and is exercised by `pytest`.")

"""Train a policy with STAPO or a baseline.

    python train.py --config configs/cpu_smollm2_stapo.yaml [dotted.key=value ...] [--resume]
    torchrun --nproc_per_node=N train.py --config ...      # N data-parallel ranks (stapo/distributed.py)

The config schema and its checks live in stapo/config.py; the training loop in stapo/train/ (trainer.py: the loop and the step).
"""
import argparse
import os
import sys


def _error(message: str) -> int:
    """Print a start-up error (once: rank 0 under torchrun) and return exit code 2. Under torchrun every rank
    exits 2 and torchrun itself then reports the failed child processes."""
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest intact checkpoint; "
                        "refused when the run folder has none (trainer.resume=required; docs/scaling.md)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.lr=2e-6")
    args = parser.parse_args(argv)

    from stapo.config import ConfigError, load_config

    overrides = list(args.overrides) + (["trainer.resume=required"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        return _error(str(e))

    from stapo.checkpoint import CheckpointError
    from stapo.data import DataError
    from stapo.distributed import barrier, teardown
    from stapo.evaluation import EvalError, make_validation_hook_from_config
    from stapo.registry import ExtensionError
    from stapo.runlock import RunLockError
    from stapo.tracking import CorruptJsonlError
    from stapo.train import Trainer

    trainer = None
    try:  # under torchrun: every rank runs this; torch.distributed is set up by the Trainer (stapo/distributed.py)
        try:  # bad paths / data / run directory / batch sizes vs ranks: one line naming the problem, exit code 2
            hook = make_validation_hook_from_config(cfg)  # None when trainer.val_every=0; checks the data now
            trainer = Trainer(cfg, validation_hook=hook)
        except (ConfigError, DataError, EvalError, FileNotFoundError, FileExistsError, CheckpointError) as e:
            return _error(str(e))
        try:
            trainer.train()
        except (CheckpointError, ExtensionError) as e:  # a damaged checkpoint; a user mask / loss breaking its
            return _error(str(e))                       # contract: one line, what to do (finished checkpoints kept)
        except (RunLockError, CorruptJsonlError) as e:  # another process writes the run directory; a damaged
            return _error(str(e))                       # metrics.jsonl / tables.jsonl line (not a torn last one)
        if trainer.dist.is_main:
            print(f"run directory: {trainer.run_dir}")
        barrier(trainer.dist)  # every rank done before any tears the process group down (W = 1: no-op)
        return 0
    finally:
        if trainer is not None:
            trainer.close()  # the vLLM engine first: under torchrun it tears down its own process groups
        teardown()


if __name__ == "__main__":
    sys.exit(main())

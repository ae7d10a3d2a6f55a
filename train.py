"""Train a policy with STAPO or a baseline.

    python train.py --config configs/cpu_smollm2_stapo.yaml [dotted.key=value ...] [--resume]
    torchrun --nproc_per_node=N train.py --config ...      # N data-parallel ranks (stapo/model/distributed.py)

Ctrl-C, SIGTERM (a scheduler's preemption) or SIGHUP (the terminal closed): the first finishes the step in progress
and checkpoints it (trainer.save_on_interrupt), a second stops at once keeping the checkpoints already written; either
way one line says how to --resume (or, with no checkpoint yet, to rerun), and the exit code is 130 (Ctrl-C), 143
(SIGTERM) or 129 (SIGHUP). A run that cannot learn (non-finite losses or gradients, no kept token: trainer.stop_after_*)
stops with one line and exit code 1.

The config schema and its checks live in stapo/config.py; the training loop in stapo/train/ (trainer.py: the loop and
the step); the run folder and the run's lifecycle around it in stapo/run/folder.py.
"""
import argparse
import os
import sys


def _runtime_error(e: BaseException) -> int:
    """A failure outside the known user errors (a library, the file system, the device): one line with its type
    and first message line, the hint to rerun with --debug, exit code 1. Every rank reports its own (rank-tagged
    under torchrun); the finished checkpoints and metrics are kept."""
    import errno

    from stapo.model.checkpoint import CheckpointSaveError

    first = (str(e).strip().splitlines() or [""])[0][:500]
    rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    storage = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
    if isinstance(e, CheckpointSaveError) or (isinstance(e, OSError) and e.errno in storage):
        first += "; free space (or fix the file system) and rerun (--resume continues from the latest checkpoint)"
    print(f"train.py: {rank}{type(e).__name__}: {first} (rerun with --debug or STAPO_DEBUG=1 for the traceback)",
          file=sys.stderr)
    return 1


def _error(message: str, details: str = "") -> int:
    """Print a start-up error (once: rank 0 under torchrun) and return exit code 2. Under torchrun every rank
    exits 2 and torchrun itself then reports the failed child processes. ``details``: lines printed after the
    one-line message (the memory plan per phase of a config refused for its memory: stapo/run/memory_plan.py)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: {message}", file=sys.stderr)
        if details:
            print(details, file=sys.stderr)
    return 2


def _interrupted(args: argparse.Namespace, trainer, exc: KeyboardInterrupt) -> int:
    """Ctrl-C / SIGTERM / SIGHUP: one line (rank 0) saying where the run stopped and the command that resumes it;
    exit code 128 + the signal (130, 143, 129)."""
    import shlex
    import signal

    from stapo.model.checkpoint import latest_checkpoint
    from stapo.run.cli import signal_name

    signum = getattr(exc, "signum", signal.SIGINT)  # stapo.run.folder.Interrupted carries it
    if os.environ.get("RANK", "0") == "0":
        if hasattr(exc, "checkpoint"):  # stapo.run.folder.Interrupted
            step, ckpt = exc.step, exc.checkpoint
        elif trainer is not None:  # before the training loop (resuming, starting W&B)
            step, ckpt = trainer.step, latest_checkpoint(trainer.ckpt_root)
        else:  # while building the trainer (loading the model)
            step, ckpt = None, None
        script = os.path.relpath(os.path.abspath(__file__))
        if script.startswith(".."):
            script = os.path.abspath(__file__)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        launcher = ["torchrun", f"--nproc_per_node={world}"] if world > 1 else ["python"]
        overrides = [o for o in args.overrides if not o.startswith("trainer.resume=")]
        base = [*launcher, script, "--config", args.config, *overrides]
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}"
        if step is None:  # whether it was a resume is unknown here: the user's own command
            command = shlex.join(base + (["--resume"] if args.resume else []))
            print(f"train.py: {how} before training started; rerun: {command}", file=sys.stderr)
        elif ckpt is None:  # nothing to resume from: the same command starts afresh
            print(f"train.py: {how} after step {step}; no checkpoint yet, rerun to start afresh: "
                  f"{shlex.join(base)}", file=sys.stderr)
        else:
            print(f"train.py: {how} after step {step}; resume (continues from {ckpt}): "
                  f"{shlex.join(base + ['--resume'])}", file=sys.stderr)
    return 128 + signum


def main(argv: list[str] | None = None) -> int:
    from stapo.run.cli import ArgumentParser

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest intact checkpoint; "
                        "refused when the run folder has none (trainer.resume=required; docs/scaling.md)")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of a runtime failure (also: STAPO_DEBUG=1)")
    parser.add_argument("--dry-run", action="store_true", help="check the config, data and run folder, print the "
                        "resolved config and the cost estimate, and exit: no model loaded, nothing written "
                        "(docs/runs.md#dry-run)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the libraries' own logs (vLLM's INFO lines, transformers, torch), quiet by default")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.lr=2e-6")
    args = parser.parse_intermixed_args(argv)  # key=value overrides before or after the flags
    from stapo.run import console

    console.set_verbose(args.verbose)
    console.quiet_libraries()  # before vLLM / transformers are imported (stapo/run/console.py)
    from stapo.run.cli import sigterm_as_interrupt

    sigterm_as_interrupt()  # SIGTERM while starting up: one line and exit 143 (the step loop handles it itself)

    from stapo.tools.entry_points import resolve_config

    args.config = resolve_config(args.config)  # run from another folder: configs/X.yaml is the shipped one

    from stapo.config import ConfigError, load_config

    overrides = list(args.overrides) + (["trainer.resume=required"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        return _error(str(e))
    from stapo.run.provenance import apply_identity

    # W&B group (the config family and method; changed algorithm.* parameters name a method of their own) / tags /
    # job_type left unset
    apply_identity(cfg, args.config, overrides=args.overrides)

    from stapo.model.checkpoint import CheckpointError
    from stapo.tasks.data import DataError
    from stapo.model.distributed import barrier, teardown
    from stapo.evaluation import EvalError, make_validation_hook_from_config
    from stapo.common.registry import ExtensionError
    from stapo.run.runlock import RunLockError
    from stapo.run.tracking import CorruptJsonlError, TrackerError
    from stapo.train import Trainer
    from stapo.train.trainer import CannotLearn

    trainer = None
    try:  # under torchrun: every rank runs this; torch.distributed is set up by the Trainer (stapo/model/distributed.py)
        try:  # bad paths / data / run directory / batch sizes vs ranks: one line naming the problem, exit code 2
            hook = make_validation_hook_from_config(cfg)  # None when trainer.val_every=0; checks the data now
            trainer = Trainer(cfg, validation_hook=hook, preflight_only=args.dry_run,  # argv: run_info.json
                              argv=sys.argv if argv is None else [os.path.relpath(__file__), *argv])
            if args.dry_run:
                from stapo.tools.estimate import train_dry_run

                if trainer.dist.is_main:
                    print(train_dry_run(trainer))
                return 0
        except (ConfigError, DataError, EvalError, FileNotFoundError, FileExistsError, CheckpointError,
                RunLockError, CorruptJsonlError) as e:
            return _error(str(e), getattr(e, "details", ""))
        try:
            trainer.train()
        except CannotLearn as e:  # non-finite losses / gradients, no kept token: a runtime failure, one line, exit 1
            if trainer.dist.is_main:
                print(f"train.py: {e}", file=sys.stderr)
            return 1
        # One line, what to do; the finished checkpoints are kept: no intact checkpoint to resume from; a user
        # mask / loss breaking its contract; another process writing the run directory; a damaged metrics.jsonl /
        # tables.jsonl line (not a torn last one); W&B online that cannot start with logging.wandb_fallback=error.
        except (CheckpointError, ExtensionError, RunLockError, CorruptJsonlError, TrackerError) as e:
            return _error(str(e))
        if trainer.dist.is_main:  # start → end of the main metrics, where the files are, the next commands
            from stapo.train.summary import end_of_run_summary

            from stapo.core.objectives import OBJECTIVES
            from stapo.run.provenance import config_family

            mode = trainer.tracker.mode if trainer.tracker is not None else "disabled"
            # the evaluation to suggest follows the config family (configs/eval/<family>.yaml), not the W&B group
            family = (getattr(cfg.logging, "family", None)
                      or config_family(args.config, {*OBJECTIVES, cfg.algorithm.objective}))
            print(end_of_run_summary(trainer.run_dir, wandb_mode=mode, family=family, config_path=args.config,
                                     validation_benchmarks=list(cfg.validation.benchmarks), data_root=cfg.data.root),
                  flush=True)
            print(f"run directory: {trainer.run_dir}")
        barrier(trainer.dist)  # every rank done before any tears the process group down (W = 1: no-op)
        return 0
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM (stapo.run.folder.Interrupted from train(), or before it)
        return _interrupted(args, trainer, e)
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # the error boundary: any other failure is one line, exit 1 (checkpoints are kept);
        if args.debug or os.environ.get("STAPO_DEBUG") == "1":  # BaseException: torch DCP's CheckpointException
            raise
        return _runtime_error(e)
    finally:
        if trainer is not None:
            trainer.close()  # the vLLM engine first: under torchrun it tears down its own process groups
        teardown()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM / SIGHUP while importing or reading the config: nothing started
        signum = getattr(e, "signum", 2)
        from stapo.run.cli import signal_name

        print(f"train.py: {'interrupted' if signum == 2 else 'stopped by ' + signal_name(signum)} before training "
              f"started", file=sys.stderr)
        sys.exit(128 + signum)

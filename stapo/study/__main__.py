"""Run a study: a grid of methods × seeds with train.py, then its report (docs/study.md).

    python -m stapo.study --config configs/study/cpu_methods.yaml             # run (or resume) the grid + report
    python -m stapo.study --config configs/study/cpu_methods.yaml --dry-run   # what would run / be skipped
    python -m stapo.study --config configs/study/cpu_methods.yaml --report-only

Rerunning the same command resumes the study: finished runs are skipped, interrupted ones resume from their last
checkpoint (also past a raised trainer.total_steps), finished final evaluations are reused. A run folder that is not
the run the study would make now (its recorded config differs from the plan, config.json edited, model or data
changed, a symlink or copy of another run) is refused before anything runs; --rerun-changed trains such runs afresh,
moving their old folders to <output_dir>/superseded/ (nothing is ever deleted). --report-only only reads the runs
(allowed while a runner works in the folder). Exit codes: 0 all runs finished; 1 a run failed (the others ran; rerun
to retry); 2 a bad study config, a locked study folder, a damaged metrics.jsonl line (named) or runs that differ from
the plan (named); 130 / 143 interrupted (Ctrl-C / SIGTERM).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stapo.run.cli import ArgumentParser, sigterm_as_interrupt


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="stapo.study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="study YAML (configs/study/)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="list what would run, resume or be skipped, and exit")
    mode.add_argument("--report-only", action="store_true", help="write the report from the runs as they are")
    mode.add_argument("--export", metavar="DIR", help="copy the runs' small files (metrics, configs, finished markers, "
                      "validation and final-evaluation results; no checkpoints, W&B files, rollouts or generations) "
                      "to DIR, keeping the layout, and exit (read-only, like --report-only)")
    p.add_argument("--rerun-changed", action="store_true", help="train afresh the runs whose folders differ from "
                   "the plan (refused without it), moving their old folders to <output_dir>/superseded/ (kept)")
    p.add_argument("--verbose", action="store_true", help="show the runs' own output here (default: only in "
                   "<output_dir>/logs/<run>.log)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the study config, e.g. seeds=[0] "
                   "(before, between or after the options)")
    args = p.parse_intermixed_args(argv)  # `--report-only seeds=[0]` as well as `seeds=[0] --report-only`
    sigterm_as_interrupt()
    try:  # the imports (torch) take seconds: Ctrl-C / SIGTERM then is one line, not an import traceback
        from stapo.config import ConfigError
        from stapo.run.runlock import RunLock, RunLockError
        from stapo.run.tracking import CorruptJsonlError
        from stapo.study.config import load_study_config, run_specs
        from stapo.study.report import write_report
        from stapo.study.runner import RunIdentityError, describe_plan, run_grid

        cfg = load_study_config(args.config, args.overrides)
        specs = run_specs(cfg)
    except ConfigError as e:
        print(f"stapo.study: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # nothing ran yet
        print("stapo.study: interrupted while starting; nothing ran (rerun the same command)", file=sys.stderr)
        return 128 + int(getattr(e, "signum", 2))
    if args.dry_run:
        try:
            print(describe_plan(cfg, specs, rerun_changed=args.rerun_changed))
        except CorruptJsonlError as e:  # a damaged metrics line (file and line): the runner would stop on it too
            print(f"stapo.study: {e}", file=sys.stderr)
            return 2
        return 0
    if args.export:
        from stapo.run.preflight import check_writable
        from stapo.study.runner import export_study

        dest, src = Path(args.export).resolve(), Path(cfg.output_dir).resolve()
        if dest == src or dest.is_relative_to(src / "runs"):
            print(f"stapo.study: --export {args.export}: that is the study's own folder (output_dir {cfg.output_dir}"
                  f"{'' if dest == src else ', its runs/'}); export into another folder, e.g. "
                  f"results/{cfg.name}/grid", file=sys.stderr)
            return 2
        try:
            check_writable(dest, "--export")
            written = export_study(cfg, Path(args.export))
        except ConfigError as e:
            print(f"stapo.study: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # a failed copy (a full disk): the file and the reason, not a traceback
            print(f"stapo.study: --export {args.export}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(f"exported {len(written)} files to {args.export}")
        return 0
    rc = 0
    try:
        if args.report_only:  # read-only: no lock, nothing written under runs/ (allowed beside a working runner)
            if not any((s.run_dir / "metrics.jsonl").is_file() for s in specs):
                print(f"stapo.study: no runs with metrics under {Path(cfg.output_dir) / 'runs'} (is output_dir "
                      f"right? nothing was written)", file=sys.stderr)
                return 2
            report = write_report(cfg, specs)
        else:
            from stapo.run.preflight import check_writable

            check_writable(cfg.output_dir, "output_dir")  # a read-only study folder: one line, before the lock
            with RunLock(cfg.output_dir, "stapo.study"):
                rc = run_grid(cfg, specs, verbose=args.verbose, rerun_changed=args.rerun_changed)
                report = write_report(cfg, specs)
    except (RunLockError, CorruptJsonlError, RunIdentityError) as e:  # a second runner; a damaged metrics line
        # (file and line); runs that are not what the study would make now (each named, with the keys)
        print(f"stapo.study: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # the study folder cannot be written (read-only, no space): named
        print(f"stapo.study: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a failed read or write of a study file that the checks did not foresee (named)
        print(f"stapo.study: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # between runs or while writing the report
        print("stapo.study: interrupted; rerun the same command to resume the study", file=sys.stderr)
        return 128 + int(getattr(e, "signum", 2))
    print(f"report: {report}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

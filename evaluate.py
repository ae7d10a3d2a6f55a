"""Evaluate a checkpoint on the six math benchmarks under the paper's two decoding settings
(docs/method.md#evaluation-protocol).

    python evaluate.py --config configs/eval/cpu_smollm2.yaml --limit 2
    python evaluate.py --model runs/stapo_smollm2/checkpoints/step_000020 --benchmarks aime24 math500
    python evaluate.py --config configs/eval/paper.yaml --model /models/qwen3-8b-stapo [key=value ...]
    python evaluate.py --config configs/eval/cpu_smollm2.yaml --model runs/stapo_smollm2 --all-checkpoints --limit 1

--model takes an HF folder, a train.py checkpoint (or run folder: its latest checkpoint), a hub id, or
embedded:smollm2. --backend takes any registered rollout backend, including one registered by a module listed in
the config's import_modules (e.g. 'import_modules=[my_backend.py]'; docs/extending.md). Outputs go to the run
directory (default runs/eval/<label>): per-sample JSONL with grades, results.json / .md / .csv / .png, and a W&B
summary (offline by default): a train.py checkpoint is logged at its training step, in the training run's W&B
group. --all-checkpoints (model.checkpoints=all|latest|[steps]) evaluates every checkpoint of a run in turn into
runs/eval/<run>/step_XXXXXX and writes sweep.csv / .md / .png (accuracy against the step) and one W&B run holding the
curve. Rerunning the same command resumes where it stopped. The harness lives in stapo/evaluation/.
"""
import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    from stapo.run.cli import ArgumentParser

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (configs/eval/); default: the paper protocol")
    p.add_argument("--model", help="model.path: HF folder, train.py checkpoint/run folder, hub id, embedded:smollm2")
    p.add_argument("--label", help="model.label: the row name in tables")
    p.add_argument("--all-checkpoints", action="store_true",
                   help="model.checkpoints=all: evaluate every checkpoint of the train.py run --model names, each at "
                        "its training step (resumable: finished checkpoints are skipped)")
    p.add_argument("--checkpoints", nargs="+", help="model.checkpoints: all, latest, or training steps (10 20 ...)")
    p.add_argument("--benchmarks", nargs="+", help="data.benchmarks, space- or comma-separated "
                   "(aime24 aime25 amc23 math500 minerva olympiad; the synthetic task's held-out arith_test "
                   "arith_hard; data.custom_benchmarks names)")
    p.add_argument("--settings", nargs="+", help="keep only these decoding settings by name (t1.0_p1.0 t0.7_p0.9)")
    p.add_argument("--limit", type=int, help="data.limit: first K problems of each benchmark")
    p.add_argument("--max-new-tokens", type=int, help="generation.max_new_tokens")
    p.add_argument("--backend", help="engine.backend: a registered rollout backend (vllm, hf, or one registered by a "
                   "module of import_modules); checked after the config's modules are imported")
    p.add_argument("--data-root", help="data.root")
    p.add_argument("--output", help="output.dir (run directory)")
    p.add_argument("--wandb", choices=["offline", "online", "disabled"], help="logging.wandb_mode")
    p.add_argument("--debug", action="store_true",
                   help="show the full traceback of a runtime failure (also: STAPO_DEBUG=1)")
    p.add_argument("--verbose", action="store_true",
                   help="show the libraries' own logs (vLLM's INFO lines, transformers, torch), quiet by default")
    p.add_argument("--dry-run", action="store_true", help="check the config, model path, data and run directory, "
                   "print the resolved config and the cost estimate, and exit: no model loaded, nothing written "
                   "(docs/evaluation.md#dry-run)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.samples.aime24=8")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # key=value overrides before or after the flags
    from stapo.run import console

    console.set_verbose(args.verbose)
    console.quiet_libraries()  # before vLLM / transformers are imported (stapo/run/console.py, as train.py)
    from stapo.run.cli import sigterm_as_interrupt

    sigterm_as_interrupt()  # SIGTERM / SIGHUP: the lock released, one line, exit 143 / 129 (as Ctrl-C: 130)

    from stapo.tools.entry_points import resolve_config

    args.config = resolve_config(args.config)  # run from another folder: configs/eval/X.yaml is the shipped one
    for name in ("benchmarks", "settings", "checkpoints"):  # nargs="+" swallows key=value overrides that follow:
        # give them back
        values = getattr(args, name)
        if values:
            args.overrides += [v for v in values if "=" in v]
            setattr(args, name, [x for v in values if "=" not in v for x in v.split(",") if x] or None)

    from stapo.config import ConfigError
    from stapo.evaluation import EvalError, load_eval_config, run_evaluation
    from stapo.evaluation.config import validate_eval_config

    flags = {("model", "path"): args.model, ("model", "label"): args.label, ("data", "limit"): args.limit,
             ("generation", "max_new_tokens"): args.max_new_tokens, ("engine", "backend"): args.backend,
             ("data", "root"): args.data_root, ("output", "dir"): args.output,
             ("logging", "wandb_mode"): args.wandb, ("data", "benchmarks"): args.benchmarks,
             ("model", "checkpoints"): "all" if args.all_checkpoints else (
                 args.checkpoints[0] if args.checkpoints and len(args.checkpoints) == 1 else args.checkpoints)}
    try:
        cfg = load_eval_config(args.config, list(args.overrides))
        for (section, key), value in flags.items():  # flags win over the file and the overrides
            if value is not None:
                setattr(getattr(cfg, section), key, list(value) if isinstance(value, list) else value)
        if args.settings:
            known = {s.name: s for s in cfg.generation.settings}
            unknown = [s for s in args.settings if s not in known]
            if unknown:
                raise EvalError(f"unknown decoding setting(s) {unknown}; configured: {', '.join(known)}")
            cfg.generation.settings = [known[s] for s in args.settings]
        validate_eval_config(cfg)
        if args.dry_run:
            from stapo.tools.estimate import eval_dry_run

            print(eval_dry_run(cfg))
            return 0
        if cfg.model.checkpoints is not None:
            from stapo.evaluation.sweep import run_sweep

            sweep = run_sweep(cfg)
        else:
            results = run_evaluation(cfg)
    except (EvalError, ConfigError) as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (stapo.run.cli.Terminated)
        from stapo.run.cli import signal_name

        signum = getattr(e, "signum", 2)
        what = "interrupted" if signum == 2 else f"stopped by {signal_name(signum)}"
        print(f"evaluate.py: {what}; rerun the same command to resume", file=sys.stderr)
        return 128 + signum
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # the error boundary: any other failure is one line, exit 1 (finished records
        if args.debug or os.environ.get("STAPO_DEBUG") == "1":  # kept); BaseException: e.g. torch DCP's errors
            raise
        first = (str(e).strip().splitlines() or [""])[0][:500]
        print(f"evaluate.py: {type(e).__name__}: {first} (rerun the same command to resume; --debug or "
              f"STAPO_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1

    from stapo.evaluation.report import markdown_table, sweep_markdown

    if cfg.model.checkpoints is not None:
        print(sweep_markdown(sweep["results"], "avg@N"))
        print(f"run directory: {sweep['run_dir']}")
        return 0
    print(markdown_table([results], "avg@N"))
    print(f"run directory: {results['run_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build the fixed probe set of the mechanism measurements (mechanism.probe_file): the config's initial model answers
held-out problems once (docs/metrics.md#mechanism-measurements-mechanism-probe).

    python scripts/build_probe_set.py --config configs/X.yaml --benchmark arith_test --num-prompts 32 \\
        --out probes/arith_test_32.jsonl [--samples 1] [--seed 0] [key=value ...]
    python scripts/build_probe_set.py --config configs/mechanism/justrl.yaml --word-levels 3 4 13 ...

With --word-levels the prompts are the first --num-prompts held-out word problems of exactly those levels
(stapo.tasks.word_problems.generate_word_problems(split="test", seed=0), the levels in turn) instead of a benchmark's.

The prompts are the benchmark's first --num-prompts problems (a benchmark under data.root or a generated one such as
arith_test), encoded as training encodes them (data.prompt_style, data.system_prompt); the responses are sampled from
model.path with the rollout settings (backend, temperature, top_p, response_length) and --seed, and cut at the first
complete \\boxed{} when rollout.stop_at_first_boxed is set, as training cuts them. The file holds token ids (and the
texts, for people): stapo.train.probes.read_probe_set reads it, the trainer measures on it unchanged for the whole run.

Exit codes: 0 written; 2 a bad argument, config key or benchmark (one line); 1 a runtime failure (one line).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stapo.run.cli import ArgumentParser  # noqa: E402


def _load(cfg):
    """The tokenizer and the initial policy of ``cfg.model`` (``tiny``: the seeded test model), on the CPU."""
    import torch

    from stapo.model.models import EMBEDDED_ALIASES, build_tiny_model, load_policy, load_tokenizer

    mc = cfg.model
    tok = load_tokenizer(EMBEDDED_ALIASES[0] if mc.path == "tiny" else mc.path, cache_dir=mc.cache_dir)
    if mc.path == "tiny":
        return tok, build_tiny_model(seed=cfg.trainer.seed, dtype=torch.float32, cache_dir=mc.cache_dir,
                                     tokenizer=tok)[0]
    return tok, load_policy(mc.path, dtype=mc.param_dtype, attn_implementation=mc.attn_implementation,
                            cache_dir=mc.cache_dir, tokenizer=tok)[0]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="build_probe_set.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the training config whose model, prompts and rollout it uses")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--benchmark", help="held-out problems (e.g. arith_test, math500)")
    src.add_argument("--word-levels", type=int, nargs="+", metavar="LEVEL",
                     help="held-out word problems of these levels (stapo.tasks.word_problems, split=test, seed 0)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=1, help="responses per prompt")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (the set is reproducible)")
    ap.add_argument("--out", required=True, help="the probe-set file to write (JSONL)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, key=value")
    args = ap.parse_args(argv)
    prog = "build_probe_set.py"
    if args.num_prompts < 1 or args.samples < 1:
        print(f"{prog}: error: --num-prompts and --samples must be ≥ 1", file=sys.stderr)
        return 2

    from stapo.config import ConfigError, load_config
    from stapo.evaluation.runner import EvalError, load_problems
    from stapo.train.probes import ProbeSetError, build_probe_set, write_probe_set
    from stapo.model.precision import resolve_compute_dtype
    from stapo.tasks.prompts import encode_prompt
    from stapo.rollout import EngineOptions, SamplingParams, build_rollout_engine, engine_kwargs

    try:
        cfg = load_config(args.config, args.overrides)
        if args.word_levels:  # (problem text, id) of held-out word problems of exactly these levels
            from stapo.tasks.word_problems import generate_word_problems

            source = f"word levels {' '.join(map(str, args.word_levels))}"
            problems = [(r.problem, r.id) for r in generate_word_problems(args.num_prompts, seed=0,
                                                                          levels=args.word_levels, split="test")]
        else:
            source = args.benchmark
            problems = [(p.record.problem, p.id) for p in
                        load_problems(cfg.data.root, [args.benchmark], limit=args.num_prompts)[args.benchmark]]
    except (ConfigError, EvalError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    try:
        tok, model = _load(cfg)
        prompts = [(encode_prompt(text, tok, use_chat_template=cfg.data.prompt_style,
                                  system_prompt=cfg.data.system_prompt), pid) for text, pid in problems]
        rc = cfg.rollout
        import torch

        device = "cuda" if cfg.trainer.device != "cpu" and torch.cuda.is_available() else "cpu"
        dtype = getattr(torch, resolve_compute_dtype(cfg.model.compute_dtype, device))
        options = EngineOptions(dtype=dtype, max_model_len=cfg.data.max_prompt_length + rc.response_length,
                                seed=args.seed, gpu_memory_utilization=rc.gpu_memory_utilization,
                                kv_cache_gib=rc.kv_cache_gib, enforce_eager=rc.enforce_eager)
        engine = build_rollout_engine(rc.backend, model, tok, **engine_kwargs(rc.backend, options))
        cut = None
        if getattr(rc, "stop_at_first_boxed", False):  # as training cuts its responses
            from stapo.rollout.boxed_cut import boxed_cut_length

            def cut(ids: list[int]) -> int:
                k = boxed_cut_length(ids, tok)
                return len(ids) if k is None else k

        sampling = SamplingParams(temperature=rc.temperature, top_p=rc.top_p, max_new_tokens=rc.response_length,
                                  seed=args.seed)
        rows = build_probe_set(engine, prompts, sampling, tok, samples=args.samples, cut=cut)
        path = write_probe_set(args.out, rows)
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    except ProbeSetError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"{prog}: {type(e).__name__}: {first}", file=sys.stderr)
        return 1
    tokens = sum(len(r.response_ids) for r in rows)
    print(f"{prog}: wrote {len(rows)} probe pairs ({tokens} response tokens) of {source} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

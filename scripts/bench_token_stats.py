#!/usr/bin/env python
"""Benchmark stapo.core.token_stats against the usual ways of getting log-probs / entropy from logits.

Not a test.  Measures, at N tokens × V vocabulary (default 4096 × 151,936, the Qwen3 vocabulary), in
fp32 and bf16, IN THE SAME RUN:

  logsumexp (baseline)   torch.logsumexp(logits.float() / T, -1)  — eager; the same expression for
                         both dtypes (for fp32 ``.float()`` is a no-op, ``/ T`` makes one full copy).
  logsumexp, allocator keeps its pages   the same, in a process where glibc malloc never returns
                         memory to the OS (MALLOC_MMAP_MAX_=0, huge MALLOC_TRIM_THRESHOLD_), so the
                         timed calls reuse the warm-up call's pages: the baseline without its
                         page-fault cost (on this VM, first-touching fresh pages costs ~1 s per 2.5 GB).
                         Its peak memory is not measurable this way (reported as —).
  naive softmax          log_softmax → exp → entropy, collision, gather (full-size temporaries).
  TRL                    trl's selective_log_softmax + entropy_from_logits (skipped if trl is absent).
  token_stats eager      stapo.core.token_stats(backend="eager"), default chunk size.
  token_stats compiled   stapo.core.token_stats(backend="compiled"), default chunk size.
  token_stats compiled fwd+bwd   forward + backward of logprobs.sum() + entropy.sum()
                         (entropy_grad=True); its peak includes the [N, V] gradient (1.0×, unavoidable).

Each (method, dtype) runs in a fresh subprocess:
  * the logits are generated chunk by chunk straight into their dtype (no full-size temporary),
  * time: one warm-up call (reported separately as "first call": for the compiled backend that is
    the compilation, measured with an EMPTY inductor cache dir in a separate process, and again with
    the warm on-disk cache in the timing process), then the median of --repeats calls,
  * peak extra memory: before each timed call, glibc's free memory is returned to the OS
    (malloc_trim(0)) and the kernel's peak-RSS counter is reset (`echo 5 > /proc/self/clear_refs`);
    peak extra = VmHWM after the call − VmRSS before it (from /proc/self/status), max over the
    repeats, expressed as a multiple of the logits' size (N·V·itemsize).  So it counts every page the
    call touches beyond the logits themselves (outputs included, which are negligible except for the
    fwd+bwd row's gradient).
  * accuracy: max |Δ| of the target log-prob and of the entropy vs a float64 computation on the same
    values (bf16 upcast exactly), over --acc-rows evenly spaced rows.

Usage:
  .venv/bin/python scripts/bench_token_stats.py                       # full run, writes the .md
  .venv/bin/python scripts/bench_token_stats.py --n 256 --vocab 32768 --repeats 2 --out /tmp/t.md
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

METHODS = {
    "lse": "logsumexp (baseline)",
    "lse_prefaulted": "logsumexp, allocator keeps its pages",
    "naive": "naive softmax",
    "trl": "TRL selective_log_softmax + entropy_from_logits",
    "ts_eager": "token_stats eager",
    "ts_compiled": "token_stats compiled",
    "ts_compiled_bwd": "token_stats compiled fwd+bwd",
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_NOTES_MARK = "<!-- hand-written notes below: kept when the script rewrites this file -->"


# --------------------------------------------------------------------------------------------------
# Worker side (one method, one dtype, fresh process).
# --------------------------------------------------------------------------------------------------


def _proc_status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


_LIBC = None


def _reset_peak(trim: bool = True) -> int:
    """Trim glibc's free lists, reset the peak-RSS counter; return the current RSS in bytes."""
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        if trim:
            _LIBC.malloc_trim(0)
    except OSError:
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # falls back to the process-lifetime peak (an over-estimate)
    return _proc_status()["VmRSS"]


def _make_logits(n: int, vocab: int, dtype, seed: int = 0):
    """[n, V] logits like an LM's: N(0, 3²), every 4th row dominated by one id at +40 (low entropy,
    and a spread of ~55 nats, as in real LM logits, that pushes most of the row below 1e-19)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, vocab, dtype=dtype)  # [N, V]
    step = 64
    for i in range(0, n, step):
        block = torch.randn(min(step, n - i), vocab, generator=g) * 3.0  # [≤64, V] fp32
        block[::4, 0] = 40.0
        out[i : i + step] = block
    targets = torch.randint(0, vocab, (n,), generator=g)  # [N]
    targets[::3] = 0  # some targets are the dominant id (log p ≈ 0)
    return out, targets


def _method_fn(method: str, temperature: float):
    import torch

    if method in ("lse", "lse_prefaulted"):
        return lambda x, t: torch.logsumexp(x.float() / temperature, dim=-1)
    if method == "naive":

        def naive(x, t):
            logpi = torch.log_softmax(x.float() / temperature, dim=-1)  # [N, V]
            p = logpi.exp()  # [N, V]
            entropy = -(p * logpi).sum(-1)
            collision = (p * p).sum(-1)
            return logpi.gather(-1, t.unsqueeze(-1)).squeeze(-1), entropy, collision

        return naive
    if method == "trl":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        def trl_fn(x, t):
            logp = selective_log_softmax(x, t, temperature=temperature)
            xs = x if temperature == 1.0 else x / temperature
            return logp, entropy_from_logits(xs)

        return trl_fn
    from stapo.core.token_stats import token_stats

    if method == "ts_eager":
        return lambda x, t: token_stats(x, t, temperature, backend="eager")
    if method == "ts_compiled":
        return lambda x, t: token_stats(x, t, temperature, backend="compiled")
    if method == "ts_compiled_bwd":

        def fwd_bwd(x, t):
            xr = x.detach().requires_grad_(True)
            st = token_stats(xr, t, temperature, entropy_grad=True, backend="compiled")
            (st.logprobs.sum() + st.entropy.sum()).backward()
            return st, xr.grad

        return fwd_bwd
    raise ValueError(method)


def _accuracy(method, out, logits, targets, temperature, acc_rows):
    """max |Δ| of log p and H vs float64 on the same values, over evenly spaced rows."""
    import torch

    n = logits.shape[0]
    rows = torch.linspace(0, n - 1, min(acc_rows, n)).long()  # [R]
    z = logits[rows].double() / temperature  # [R, V] fp64
    logpi = torch.log_softmax(z, -1)
    ref_lp = logpi.gather(-1, targets[rows, None]).squeeze(-1)
    ref_h = -(logpi.exp() * logpi).sum(-1)
    if method in ("lse", "lse_prefaulted"):
        lp = logits[rows].gather(-1, targets[rows, None]).squeeze(-1).float() / temperature - out[rows]
        h = None
    elif method in ("naive", "trl"):
        lp, h = out[0][rows], out[1][rows]
    else:
        st = out[0] if method == "ts_compiled_bwd" else out
        lp, h = st.logprobs[rows], st.entropy[rows]
    d_lp = (lp.double() - ref_lp).abs().max().item()
    d_h = None if h is None else (h.double() - ref_h).abs().max().item()
    return d_lp, d_h


def _flat_out(method, out):
    """Flatten the outputs' token dims to [N] for the accuracy check."""
    if method in ("lse", "lse_prefaulted"):
        return out.reshape(-1)
    if method in ("naive", "trl"):
        return tuple(t.reshape(-1) for t in out)
    st = out[0] if method == "ts_compiled_bwd" else out
    flat = type(st)(*(t.reshape(-1) for t in (st.logprobs, st.entropy, st.collision)))
    return (flat, None) if method == "ts_compiled_bwd" else flat


def worker(args) -> None:
    import torch

    dtype = getattr(torch, DTYPES[args.dtype])
    fn = _method_fn(args.method, args.temperature)
    flat_logits, flat_targets = _make_logits(args.n, args.vocab, dtype)
    # Every method gets the same [B, T, V] view (free), as a trainer would pass it: TRL loops over the
    # leading dim in Python, so a flat [N, V] input would cost it N tiny calls.
    batch = args.batch if args.n % args.batch == 0 else 1
    logits = flat_logits.view(batch, args.n // batch, args.vocab)  # [B, T, V]
    targets = flat_targets.view(batch, args.n // batch)  # [B, T]
    logits_bytes = logits.numel() * logits.element_size()
    result = {"method": args.method, "dtype": args.dtype, "logits_bytes": logits_bytes}

    rss0 = _reset_peak()
    t0 = time.perf_counter()
    out = fn(logits, targets)
    result["first_s"] = time.perf_counter() - t0
    result["first_peak_extra"] = (_proc_status()["VmHWM"] - rss0) / logits_bytes
    if args.first_only:
        print("RESULT " + json.dumps(result), flush=True)
        return
    result["max_abs_d_logp"], result["max_abs_d_entropy"] = _accuracy(
        args.method, _flat_out(args.method, out), flat_logits, flat_targets, args.temperature, args.acc_rows
    )
    del out

    times, cpu_times, peaks = [], [], []
    keep_pages = args.method == "lse_prefaulted"
    for _ in range(args.repeats):
        rss0 = _reset_peak(trim=not keep_pages)
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn(logits, targets)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        peaks.append(_proc_status()["VmHWM"] - rss0)
        del out
    result["times_s"] = times
    result["median_s"] = statistics.median(times)
    result["median_cpu_s"] = statistics.median(cpu_times)
    result["peak_extra"] = None if keep_pages else max(peaks) / logits_bytes
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------------------------------


# Rough peak of each method beyond the logits, in units of an fp32 [N, V] tensor (for the guard below).
_PEAK_FP32_COPIES = {"lse": 3.0, "lse_prefaulted": 3.0, "naive": 3.2, "trl": 2.6, "ts_eager": 0.1, "ts_compiled": 0.1,
                     "ts_compiled_bwd": 0.6}


def _mem_available() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"MemAvailable:\s+(\d+) kB", text).group(1)) * 1024


def _run_worker(args, method, dtype, env_extra=None, first_only=False) -> dict | None:
    itemsize = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
    need = args.n * args.vocab * (itemsize + 4 * _PEAK_FP32_COPIES[method]) + 4 * 2**30  # 4 GiB margin
    avail = _mem_available()
    if avail < need:  # don't push a shared machine into the OOM killer
        print(f"  {method}/{dtype} skipped: needs ~{need / 2**30:.1f} GiB, "
              f"{avail / 2**30:.1f} GiB available", file=sys.stderr)
        return None
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--method", method, "--dtype", dtype,
        "--n", str(args.n), "--vocab", str(args.vocab), "--repeats", str(args.repeats),
        "--temperature", str(args.temperature), "--acc-rows", str(args.acc_rows),
        "--batch", str(args.batch),
    ]
    if first_only:
        cmd.append("--first-only")
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  {method}/{dtype} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def _machine() -> dict[str, str]:
    import torch

    info = {"torch": torch.__version__, "nproc": str(os.cpu_count())}
    try:
        info["nproc"] = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Model name:\s*(.+)", lscpu)
        info["cpu"] = m.group(1).strip() if m else "?"
    except OSError:
        info["cpu"] = "?"
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = "not installed"
    info["torch_threads"] = str(torch.get_num_threads())
    from stapo.common.perf import machine_line

    line = machine_line()
    info["flags"] = line.split(", flags ", 1)[1].split(", torch ", 1)[0]  # the SIMD flags that matter
    if ", kernels capped at " in line:  # ATEN_CPU_CAPABILITY set: say so next to the flags
        info["flags"] += " (" + line.split(", kernels capped at ", 1)[1] + ")"
    return info


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[0:3])
    except OSError:
        return "?"


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096, help="tokens (rows)")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary size V")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats after the warm-up call")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=8,
                   help="the logits are passed as a [B, N/B, V] view (B = 1 if it does not divide N)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32,bf16,fp16")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ",".join(METHODS))
    p.add_argument("--acc-rows", type=int, default=32, help="rows checked against float64")
    p.add_argument("--out", default=str(REPO_ROOT / "results/benchmarks/token_stats.md"),
                   help="markdown report path ('' = don't write)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    methods = [m for m in args.methods.split(",") if m]
    try:
        import trl  # noqa: F401
    except ImportError:
        if "trl" in methods:
            methods.remove("trl")
            print("trl is not importable: skipping the TRL row", file=sys.stderr)
    dtypes = [d for d in args.dtypes.split(",") if d]
    started = _dt.datetime.now().astimezone()
    load_before = _load()
    rows, compile_cold = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_token_stats_inductor_") as cache_dir:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir}
        for dtype in dtypes:
            for method in methods:
                if method.startswith("ts_compiled"):
                    # Cold compile in its own process with an empty cache dir for this dtype.
                    cold_env = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="ind_cold_")}
                    cold = _run_worker(args, method, dtype, cold_env, first_only=True)
                    if cold:
                        compile_cold[(method, dtype)] = cold["first_s"]
                        print(f"  {method}/{dtype}: first call, empty inductor cache: {cold['first_s']:.1f} s",
                              flush=True)
                    # Fill the shared cache so the timing process sees a warm on-disk cache.
                    _run_worker(args, method, dtype, env, first_only=True)
                run_env = env
                if method == "lse_prefaulted":
                    run_env = dict(env, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(2**50))
                res = _run_worker(args, method, dtype, run_env)
                if res is None:
                    continue
                rows.append(res)
                print(f"{METHODS[method]:<50} {dtype}: median {res['median_s']:.3f} s  "
                      f"(first {res['first_s']:.2f} s)  peak extra {_fmt(res['peak_extra'], '.3f')}×  "
                      f"|Δlogp| {_fmt(res['max_abs_d_logp'], '.1e')}  |ΔH| {_fmt(res['max_abs_d_entropy'], '.1e')}",
                      flush=True)
    load_after = _load()

    base = {r["dtype"]: r["median_s"] for r in rows if r["method"] == "lse"}
    lines = [
        "| method | dtype | median s | ratio to baseline | median CPU s | first call s "
        "| peak extra memory (× logits) | max abs Δ logp | max abs Δ H |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\nratios to the eager-logsumexp baseline (same run):")
    for r in rows:
        ratio = r["median_s"] / base[r["dtype"]] if r["dtype"] in base else None
        first = f"{r['first_s']:.2f}"
        if (r["method"], r["dtype"]) in compile_cold:
            first += f" (cold cache: {compile_cold[(r['method'], r['dtype'])]:.1f})"
        lines.append(
            f"| {METHODS[r['method']]} | {r['dtype']} | {r['median_s']:.3f} | {_fmt(ratio, '.2f')}× "
            f"| {r['median_cpu_s']:.3f} | {first} "
            f"| {_fmt(r['peak_extra'], '.3f')} | {_fmt(r['max_abs_d_logp'], '.1e')} | {_fmt(r['max_abs_d_entropy'], '.1e')} |"
        )
        print(f"  {METHODS[r['method']]:<50} {r['dtype']}: {_fmt(ratio, '.2f')}×")
    table = "\n".join(lines)
    print("\n" + table)
    if not args.out:
        return
    info = _machine()
    gib = args.n * args.vocab * 4 / 2**30
    cmd = "python scripts/bench_token_stats.py " + " ".join(sys.argv[1:])
    md = f"""# token_stats benchmark

Per-token log-prob + entropy (+ collision) from logits, N = {args.n} tokens × V = {args.vocab:,}
(fp32 logits = {gib:.2f} GiB) passed to every method as a [B = {args.batch}, T = N/B, V] view,
sampling temperature {args.temperature}, median of {args.repeats} timed calls after one
warm-up call, each (method, dtype) in a fresh subprocess.  All ratios are to the baseline
`torch.logsumexp(logits.float() / T, -1)` (eager, same dtype) **measured in the same run**.

- Command: `{cmd.strip()}`
- Date: {started.strftime('%Y-%m-%d %H:%M %Z')}
- Machine: {info['cpu']}, nproc = {info['nproc']} (torch threads {info['torch_threads']}), CPU flags {info['flags']}, torch {info['torch']}, trl {info['trl']}
- Load average (1/5/15 min) before / after the run: {load_before} / {load_after}

{table}

How each column is measured (see the script's docstring):
- **median s**: wall time of one call (all outputs computed), median over the timed calls.
- **median CPU s**: process CPU time (user + system, all threads) of the same calls: less sensitive
  than wall time to other processes on the machine, but it includes OpenMP spin-waiting.
- **first call s**: the warm-up call in the timing process.  For the compiled rows this process found
  a warm inductor on-disk cache (filled by a previous process); "cold cache" is the same first call in
  a process with an empty `TORCHINDUCTOR_CACHE_DIR` (the full compilation cost).
- **peak extra memory**: before each timed call `malloc_trim(0)` and `echo 5 > /proc/self/clear_refs`
  (resets the kernel's peak RSS), then (VmHWM after − VmRSS before) / (N·V·itemsize), max over the
  timed calls.  The logits themselves are not counted; outputs are (the fwd+bwd row includes its
  [N, V] gradient in the logits' dtype, 1.0×, which any backward must allocate).
- **max abs Δ**: vs float64 log-softmax on the same values (bf16 upcast exactly), over
  {args.acc_rows} evenly spaced rows.  The baseline computes only the log-partition, so its Δ logp is
  for gather(logits)/T − lse and it has no entropy.
"""
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if out_path.exists() and _NOTES_MARK in out_path.read_text():
        # keep the hand-written discussion below the marker across reruns
        md += "\n" + _NOTES_MARK + out_path.read_text().split(_NOTES_MARK, 1)[1]
    out_path.write_text(md)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

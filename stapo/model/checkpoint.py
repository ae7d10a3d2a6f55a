"""Crash-safe checkpoints: the policy in HF format for evaluation plus a sharded state to resume exactly.

Layout of ``<run_dir>/checkpoints/step_000010/`` (the same for one process, ``replicate`` and ``fsdp2``):
  config.json, generation_config.json,     — the policy in HF format, loadable by transformers and vLLM as is
  model.safetensors  or                      (``export_dtype``, e.g. the bf16 compute dtype of fp32 master
  model-0000k-of-0000n.safetensors +          weights); sharded the way ``save_pretrained`` shards (files of at
  model.safetensors.index.json,               most ``max_shard_size``, index ``weight_map``), written by rank 0
  tokenizer files                             with at most one shard's tensors in memory (gathered one tensor
                                              at a time from FSDP2 shards, :func:`export_hf`)
  dcp/                                     — ``torch.distributed.checkpoint`` folder: model parameters (master
                                              dtype) and optimizer state keyed by parameter name, written by
                                              every rank (its own shards, nothing gathered) and re-sharded on
                                              load to any rank count / strategy
                                              (:func:`stapo.model.distributed.save_sharded_state` /
                                              :func:`~stapo.model.distributed.load_sharded_state`)
  trainer_state.pt                         — scheduler, data-loader state, RNG states (per rank), step, config;
                                              no tensors of the model or optimizer
  COMPLETE.json                            — the completeness marker, written last (atomically, by rank 0): the
                                              size of every other file of the folder and a SHA-256 of it (files
                                              up to :data:`FULL_HASH_LIMIT` bytes: of the whole file; larger
                                              ones: of their first and last MiB), checked on resume
                                              (:func:`verify_checkpoint`)

A checkpoint is written to ``step_000010.tmp`` (under several ranks a folder all ranks share: every rank writes its
DCP shards into it) and renamed by rank 0 when complete, so a crash during a save leaves the previous checkpoints
intact; leftover ``*.tmp`` folders are ignored and cleaned up. Only the last ``keep_last`` checkpoints are kept.
:func:`latest_checkpoint` only picks folders with ``trainer_state.pt`` and, when they hold ``dcp/``, its
``.metadata`` (DCP's last file) and HF weights, and whose ``COMPLETE.json`` (when there is one) lists files of the
sizes found. :func:`resumable_checkpoints` goes further for a resume: the checksums too, newest first, with the
reason each damaged folder is skipped for. Checkpoints written before ``COMPLETE.json`` existed are judged by the
file rule alone (they still load).

Previous format (still loaded, :func:`is_sharded` False): the same HF files and a ``trainer_state.pt`` holding the
full ``"optimizer"`` state dict; no ``dcp/``. The trainer resumes it through
:func:`stapo.model.distributed.load_full_state` (weights from the HF files).
"""
from __future__ import annotations

import copy
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from stapo.common.checkpoint_files import (
    _SAFE_INDEX,
    DCP_DIR,
    FULL_HASH_LIMIT,
    MARKER,
    _fsync_dir,
    _write_marker,
    complete_checkpoints,
    is_sharded,
    latest_checkpoint,
    resumable_checkpoints,
    verify_checkpoint,
)
from stapo.model import distributed as dist
from stapo.model.models import hf_class_name, resolve_dtype

__all__ = ["CheckpointError", "CheckpointSaveError", "save_checkpoint", "latest_checkpoint", "load_trainer_state",
           "rng_state", "set_rng_state", "export_hf", "is_sharded", "verify_checkpoint", "resumable_checkpoints",
           "DCP_DIR", "MARKER", "DEFAULT_MAX_SHARD_SIZE", "FULL_HASH_LIMIT"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names its folder and what to do."""


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (a full disk, a quota, a file system that refuses writes): the message names the
    folder and the cause; the partial folder is removed and the earlier checkpoints are intact."""


#: Largest HF export shard (``save_pretrained``'s ``max_shard_size`` syntax) when none is passed; rank 0 holds at
#: most one shard (or one tensor, when a tensor is larger) of the export in memory. Looked up at call time.
DEFAULT_MAX_SHARD_SIZE: int | str = "5GB"


def rng_state() -> dict[str, Any]:
    """The Python, NumPy and torch (CPU and CUDA) RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    checkpoint_root: str | Path,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    keep_last: int = 2,
    export_dtype: torch.dtype | str | None = None,
    max_shard_size: int | str | None = None,
    ctx: Any = None,
) -> Path:
    """Write ``<checkpoint_root>/step_<step>`` atomically and prune old checkpoints (layout: module docstring).

    Collective under torchrun (every rank calls it with its own shards; ``checkpoint_root`` must be a folder all
    ranks share): the DCP shards are written by every rank, the HF export and ``trainer_state.pt`` by rank 0,
    which then renames the folder; every rank returns after the checkpoint is complete. Rank 0's extra memory:
    one HF shard (≤ ``max_shard_size``, or the largest tensor) plus one gathered tensor — never the full
    optimizer state, nor (with shards smaller than the model) the full model.

    Args:
        checkpoint_root: folder holding the checkpoints (created if needed).
        step: the number of completed training steps.
        model: a transformers ``PreTrainedModel``, plain, replicated or FSDP2-sharded (``fully_shard``).
        tokenizer: its tokenizer (saved beside it), or None.
        trainer_state: picklable dict (scheduler state, RNG, data-loader position...; rank 0's is written). Large
            tensors do not belong here: the optimizer goes to ``dcp/``.
        optimizer: the policy's optimizer (its state is written to ``dcp/`` with the parameters), or None.
        keep_last: number of most recent checkpoints to keep (≥ 1).
        export_dtype: dtype of the floating-point tensors of the HF export (``torch.bfloat16``, ``"bf16"``, ...);
            None = each parameter's own dtype. ``dcp/`` always keeps the parameters' dtype.
        max_shard_size: largest HF weight file (``5GB``, ``"16MB"``, bytes); None = :data:`DEFAULT_MAX_SHARD_SIZE`.
        ctx: the :class:`stapo.model.distributed.DistContext` (None = one process).

    Returns:
        The final checkpoint folder.

    Raises:
        ValueError: ``keep_last`` < 1 or an unknown ``export_dtype``.
        CheckpointSaveError: a file could not be written (full disk, quota, read-only): the message names the
            folder and the OS error; the partial folder is removed, earlier checkpoints are untouched.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ctx = ctx if ctx is not None else dist.DistContext()
    root = Path(checkpoint_root)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier(ctx)  # the folder exists before any rank writes into it
    try:
        dist.save_sharded_state(model, optimizer, tmp / DCP_DIR)  # collective; every rank writes its shards
        export_hf(model, tmp, tokenizer, dtype=export_dtype, max_shard_size=max_shard_size, ctx=ctx)  # collective
        if ctx.is_main:
            torch.save({**trainer_state, "step": step, "format": "dcp"}, tmp / "trainer_state.pt")
            _fsync_dir(tmp / DCP_DIR)
            _write_marker(tmp, step)  # last: lists every other file (every rank's shards are written by now)
    except (Exception, CheckpointException) as e:  # full disk, quota, EROFS, ...: torch, safetensors and DCP
        raise _save_failed(root, final, tmp, e, ctx) from e  # word it each their own way
    if ctx.is_main:
        if final.exists():  # re-saving the same step (e.g. a resumed run): replace it atomically-ish
            old = root / f"step_{step:06d}.old"
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        for stale in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
        for leftover in [*root.glob("step_*.tmp"), *root.glob("step_*.old")]:  # an interrupted save or re-save
            shutil.rmtree(leftover, ignore_errors=True)
    dist.barrier(ctx)
    return final


def _save_failed(root: Path, final: Path, tmp: Path, e: BaseException, ctx: Any) -> CheckpointSaveError:
    """The one-line error for a failed save; rank 0 removes the partial ``.tmp`` folder (freeing its space)."""
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    earlier = complete_checkpoints(root)
    cause = _root_cause(e, root)
    keep = (f"the latest checkpoint {earlier[-1]} is intact" if earlier else
            "no earlier checkpoint exists (the run restarts from step 0)")
    return CheckpointSaveError(f"saving checkpoint {final} failed: {cause}; the partial folder was removed and "
                               f"{keep}")


def _root_cause(e: BaseException, folder: Path | None = None) -> str:
    """What made a write fail, in one line: the innermost ``OSError`` of the exception chain (DCP's
    ``CheckpointException`` is unwrapped to its first rank's error) as ``[Errno 28] No space left on device``;
    else the first line of the innermost message, followed by what ``folder``'s file system says (free space, a
    file-size limit of this process), since torch's C++ writer drops the OS error."""
    chain: list[BaseException] = []
    seen: BaseException | None = e
    while seen is not None and len(chain) < 20:
        chain.append(seen)
        failures = getattr(seen, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict) and failures:
            seen = next(iter(failures.values()))[0]
            continue
        seen = seen.__cause__ or seen.__context__
    for err in chain:
        if isinstance(err, OSError) and err.errno is not None:
            return f"[Errno {err.errno}] {err.strerror or err}"
    inner = chain[-1]
    text = f"{type(inner).__name__}: {(str(inner).strip().splitlines() or [''])[0][:300]}"
    return text + (_storage_state(folder) if folder is not None else "")


def _storage_state(folder: Path) -> str:
    """``" (file system of <folder>: 12.0 MiB free; this process may write files of at most 2.0 MiB)"``."""
    import resource

    notes = []
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        notes.append(f"{shutil.disk_usage(probe).free / 2**20:.1f} MiB free")
    except OSError:
        pass
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft != resource.RLIM_INFINITY:
        notes.append(f"this process may write files of at most {soft / 2**20:.1f} MiB (ulimit -f)")
    return f" (file system of {probe}: {'; '.join(notes)})" if notes else ""


def export_hf(model: torch.nn.Module, folder: str | Path, tokenizer: Any = None, *,
              dtype: torch.dtype | str | None = None, max_shard_size: int | str | None = None,
              ctx: Any = None) -> None:
    """Write ``model`` as an HF folder (config, generation config, safetensors weights, tokenizer) into ``folder``.

    What ``save_pretrained`` writes — config with ``dtype`` and ``architectures`` (the ``FSDP`` class prefix
    removed), tied weights stored once, ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` +
    ``model.safetensors.index.json`` split by ``huggingface_hub.split_torch_state_dict_into_shards`` — but built
    shard by shard: the tensors of one shard are cast to ``dtype`` (FSDP2: this rank's shard, before gathering),
    gathered one at a time (:func:`stapo.model.distributed.full_tensor`, an all-gather for FSDP2 ``DTensor``
    parameters), moved to CPU, written by rank 0 and released.
    Models whose transformers class renames/fuses weights on load (``revert_weight_conversion`` would change
    the names, e.g. some MoE) fall back to a full gather on rank 0 and ``save_pretrained``.

    Collective under FSDP2 (every rank must call it); with replicate / one process only rank 0 does any work.

    Args:
        model: a transformers ``PreTrainedModel`` (plain, replicated or FSDP2-sharded).
        folder: existing or new output folder (rank 0 creates it).
        tokenizer: saved with ``save_pretrained`` beside the weights, or None.
        dtype: dtype of the floating-point tensors (None = their own); integer/bool buffers keep theirs.
        max_shard_size: largest weight file (None = :data:`DEFAULT_MAX_SHARD_SIZE`).
        ctx: the :class:`stapo.model.distributed.DistContext` (None = one process).

    Raises:
        ValueError: an unknown ``dtype`` name.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    ctx = ctx if ctx is not None else dist.DistContext()
    folder = Path(folder)
    out_dtype = resolve_dtype(dtype) if dtype is not None else None
    sharded = ctx.strategy == "fsdp2"
    if not (ctx.is_main or sharded):
        return
    shard_size = max_shard_size if max_shard_size is not None else DEFAULT_MAX_SHARD_SIZE
    state = model.state_dict()  # FSDP2: sharded DTensors (no gathering); else the parameters themselves

    def cast(t: torch.Tensor) -> torch.dtype:
        return out_dtype if out_dtype is not None and t.is_floating_point() else t.dtype

    meta = {k: torch.empty(v.shape, dtype=cast(v), device="meta") for k, v in state.items()}
    meta = _without_tied(meta, model)
    if not _plain_names(model, meta):
        _export_full_fallback(model, folder, out_dtype, shard_size, ctx)
    else:
        split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=shard_size)
        if ctx.is_main:
            folder.mkdir(parents=True, exist_ok=True)
        for filename, names in split.filename_to_tensors.items():
            shard: dict[str, torch.Tensor] = {}
            for name in names:
                local = state[name].detach().to(meta[name].dtype)  # cast before gathering: half the bytes for bf16
                full = dist.full_tensor(local)  # FSDP2: every rank joins the all-gather
                del local
                if ctx.is_main:
                    shard[name] = full.to("cpu").contiguous()
                del full
            if ctx.is_main:
                save_file(shard, folder / filename, metadata={"format": "pt"})
            del shard
        if ctx.is_main and split.is_sharded:
            total = sum(t.numel() for t in meta.values())
            index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": split.tensor_to_filename}
            (folder / _SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if ctx.is_main:
        config = copy.deepcopy(model.config)
        config.dtype = str(out_dtype or _param_dtype(model)).removeprefix("torch.")
        config.architectures = [hf_class_name(model)]
        config.save_pretrained(folder)
        gen = getattr(model, "generation_config", None)
        if gen is not None and model.can_generate():
            gen.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _without_tied(meta: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``meta`` without the aliases of tied weights (safetensors stores a tensor once): transformers' own rule
    (``remove_tied_weights_from_state_dict``: keeps the name the model expects on reload; for meta tensors it
    compares the model's parameter objects), else the first name of every parameter object is kept."""
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        return remove_tied_weights_from_state_dict(dict(meta), model)
    except ImportError:
        params = dict(model.named_parameters(remove_duplicate=False))
        seen: set[int] = set()
        out = {}
        for name, t in meta.items():
            key = id(params[name]) if name in params else id(t)
            if key not in seen:
                seen.add(key)
                out[name] = t
        return out


def _plain_names(model: torch.nn.Module, meta: dict[str, torch.Tensor]) -> bool:
    """True when transformers saves the state-dict names as they are (no weight conversion to revert)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return True
    return revert_weight_conversion(model, meta) is meta


def _export_full_fallback(model: torch.nn.Module, folder: Path, dtype: torch.dtype | None, shard_size: int | str,
                          ctx: Any) -> None:
    """``save_pretrained`` of the full state dict on rank 0 (gathered tensor by tensor) — for models whose
    export renames or fuses weights; holds the whole model (not the optimizer) on rank 0."""
    full: dict[str, torch.Tensor] = {}
    for name, t in dist.iter_full_state_dict(model):  # collective under FSDP2
        if ctx.is_main:
            full[name] = t.detach().to("cpu", dtype if dtype is not None and t.is_floating_point() else t.dtype)
    if ctx.is_main:
        model.save_pretrained(folder, state_dict=full, max_shard_size=shard_size, is_main_process=True)


def load_trainer_state(checkpoint_dir: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Load ``trainer_state.pt`` of a checkpoint (CPU).

    ``mmap=True`` maps the tensors from the file instead of reading them into memory (previous format: its full
    optimizer state, shared by the data-parallel ranks of one node through the page cache).

    Raises:
        FileNotFoundError: no ``trainer_state.pt``, naming the path.
    """
    path = Path(checkpoint_dir) / "trainer_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {checkpoint_dir} is not a complete train.py checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)

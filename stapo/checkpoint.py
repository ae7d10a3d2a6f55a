"""Crash-safe checkpoints: the policy in HF format plus everything needed to resume exactly.

Layout of ``<run_dir>/checkpoints/step_000010/``:
  config.json, model.safetensors, tokenizer files   — ``save_pretrained`` output, loadable by transformers
                                                      and vLLM as is
  trainer_state.pt                                  — optimizer, scheduler, RNG states, data-loader state,
                                                      step (and anything else the trainer adds)

A checkpoint is written to ``step_000010.tmp`` and renamed when complete, so a crash during a save leaves
the previous checkpoints intact; leftover ``*.tmp`` folders are ignored and cleaned up. Only the last
``keep_last`` checkpoints are kept.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["save_checkpoint", "latest_checkpoint", "load_trainer_state", "rng_state", "set_rng_state"]

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


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
    keep_last: int = 2,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``<checkpoint_root>/step_<step>`` atomically and prune old checkpoints.

    Args:
        checkpoint_root: folder holding the checkpoints (created if needed).
        step: the number of completed training steps.
        model: a transformers ``PreTrainedModel`` (saved with ``save_pretrained``, safetensors).
        tokenizer: its tokenizer (saved beside it), or None.
        trainer_state: picklable dict (optimizer/scheduler state dicts, RNG, data-loader position...).
        keep_last: number of most recent checkpoints to keep (≥ 1).
        state_dict: the weights to write instead of ``model.state_dict()`` (a full state dict gathered from an
            FSDP2-sharded model, :func:`stapo.distributed.full_model_state_dict`); HF names, CPU tensors.

    Returns:
        The final checkpoint folder.
    """
    root = Path(checkpoint_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    extra = {"state_dict": state_dict} if state_dict is not None else {}
    model.save_pretrained(tmp, safe_serialization=True, **extra)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save({**trainer_state, "step": step}, tmp / "trainer_state.pt")
    _fsync_dir(tmp)
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
    for stale in _checkpoints(root)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)
    for leftover in root.glob("step_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
             and (p / "trainer_state.pt").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(checkpoint_root: str | Path) -> Path | None:
    """The most recent complete checkpoint folder, or None."""
    found = _checkpoints(Path(checkpoint_root))
    return found[-1] if found else None


def load_trainer_state(checkpoint_dir: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Load ``trainer_state.pt`` of a checkpoint. Raises ``FileNotFoundError`` naming the path.

    ``mmap=True`` maps the tensors (optimizer state) from the file instead of reading them into memory, so the
    data-parallel ranks of one node share one copy through the page cache."""
    path = Path(checkpoint_dir) / "trainer_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {checkpoint_dir} is not a complete train.py checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)

"""The file rules of a train.py checkpoint folder, without torch: which ``step_N`` folders are complete, the
completeness marker (``COMPLETE.json``: every file's size and SHA-256, written last) and its verification.

Shared by :mod:`stapo.model.checkpoint` (save, resume) and :mod:`stapo.evaluation.model_source` (``evaluate.py --model
<run>`` picks the same latest checkpoint a resume would), so the rule exists once.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from stapo.common.fingerprint import model_digest

__all__ = ["DCP_DIR", "MARKER", "FULL_HASH_LIMIT", "WEIGHT_GLOBS", "has_hf_weights", "is_sharded", "verify_checkpoint",
           "checkpoint_digest", "step_folders", "resumable_checkpoints", "complete_checkpoints", "latest_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
#: The ``torch.distributed.checkpoint`` subfolder of a checkpoint.
DCP_DIR = "dcp"
#: The completeness marker of a checkpoint folder (its file list, sizes and checksums), written last.
MARKER = "COMPLETE.json"
#: Files up to this many bytes are hashed whole in :data:`MARKER`; larger ones by their first and last MiB (with
#: their size: a truncated or zero-filled shard is caught without reading gigabytes at every save and resume).
FULL_HASH_LIMIT = 64 * 2**20
_HASH_EDGE = 2**20
#: The weight files of an HF model folder (safetensors, sharded or not, or PyTorch pickles).
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"



def has_hf_weights(folder: str | Path) -> bool:
    """Whether ``folder`` holds HF weight files (:data:`WEIGHT_GLOBS`); a ``config.json`` alone is not a model."""
    return any(any(Path(folder).glob(pattern)) for pattern in WEIGHT_GLOBS)

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


def _file_digest(path: Path, size: int, limit: int | None = None) -> str:
    """SHA-256 (hex) of the whole file when ``size`` ≤ ``limit`` (None: :data:`FULL_HASH_LIMIT`) bytes, else of
    its first and last MiB."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= (FULL_HASH_LIMIT if limit is None else limit):
            for chunk in iter(lambda: f.read(8 * 2**20), b""):
                h.update(chunk)
        else:
            h.update(f.read(_HASH_EDGE))
            f.seek(size - _HASH_EDGE)
            h.update(f.read(_HASH_EDGE))
    return h.hexdigest()


def _write_marker(folder: Path, step: int) -> None:
    """Write ``folder/COMPLETE.json`` atomically (a temporary file, fsync, rename, fsync of the folder):
    ``{"step", "files": {relative path: {"size": bytes, "sha256": hex}}}`` for every other file of the folder."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name not in (MARKER, MARKER + ".tmp"):
            size = path.stat().st_size
            files[path.relative_to(folder).as_posix()] = {"size": size, "sha256": _file_digest(path, size)}
    tmp = folder / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "full_hash_limit": FULL_HASH_LIMIT, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)
    _fsync_dir(folder)


def verify_checkpoint(checkpoint_dir: str | Path, checksums: bool = True) -> str | None:
    """Why a checkpoint folder cannot be resumed from, or None when it is intact.

    With a :data:`MARKER`: every file it lists must exist with its size and (``checksums=True``) its SHA-256.
    Without one (written before the marker existed): the file rule of :func:`latest_checkpoint`. Reads at most
    :data:`FULL_HASH_LIMIT` bytes + 2 MiB per file (sizes only: ``stat`` calls).

    Returns:
        A short reason (``"dcp/__0_0.distcp is 1200 bytes, 4096 were written"``), or None.
    """
    path = Path(checkpoint_dir)
    marker = path / MARKER
    if not marker.is_file():
        if not (path / "trainer_state.pt").is_file():
            return f"no trainer_state.pt and no {MARKER} (an incomplete or emptied folder)"
        if not _is_complete(path):
            return "files are missing (HF weights, config.json or dcp/.metadata)"
        return None
    try:
        manifest = json.loads(marker.read_text())
        listed, limit = manifest["files"], int(manifest.get("full_hash_limit", FULL_HASH_LIMIT))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MARKER} is unreadable ({type(e).__name__})"
    for name, want in sorted(listed.items()):
        f = path / name
        try:
            size = f.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} is {size} bytes, {want['size']} were written"
    if checksums:
        for name, want in sorted(listed.items()):
            try:
                digest = _file_digest(path / name, want["size"], limit)
            except OSError as e:
                return f"{name} cannot be read ({e.strerror or type(e).__name__})"
            if digest != want["sha256"]:
                return f"{name} does not match its checksum (its bytes changed after the save)"
    return None


def checkpoint_digest(checkpoint_dir: str | Path) -> str:
    """The content digest of a checkpoint folder (64 hex characters): SHA-256 of its :data:`MARKER`'s file list
    (every file's relative path, size and SHA-256 — of the whole file, or of its first and last MiB above
    :data:`FULL_HASH_LIMIT`), so it costs one small read; a folder without a marker (written before it existed):
    :func:`stapo.common.fingerprint.model_digest` of its weights, configs and ``trainer_state.pt``. A copy of the folder
    elsewhere has the same digest. Recorded by a fork (``trainer.init_from``) in its ``run_info.json``.

    Raises:
        OSError: a file cannot be read.
    """
    path = Path(checkpoint_dir)
    marker = path / MARKER
    if marker.is_file():
        files = json.loads(marker.read_text()).get("files", {})
        text = json.dumps(files, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    return model_digest(path)


def step_folders(checkpoint_root: str | Path) -> list[Path]:
    """Every ``step_N`` folder under ``checkpoint_root``, oldest first, complete or not (nothing is read).
    ``*.tmp`` / ``*.old`` folders (interrupted saves) are not listed. [] when there is no folder."""
    root = Path(checkpoint_root)
    if not root.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    return [p for _, p in found]


def resumable_checkpoints(checkpoint_root: str | Path) -> list[tuple[Path, str | None]]:
    """Every ``step_N`` folder under ``checkpoint_root`` (:func:`step_folders`), newest first, with
    :func:`verify_checkpoint`'s reason (None = intact). [] when there is no folder."""
    return [(p, verify_checkpoint(p)) for p in reversed(step_folders(checkpoint_root))]


def is_sharded(checkpoint_dir: str | Path) -> bool:
    """True for a checkpoint of the current format (model + optimizer in ``dcp/``), False for the previous one
    (full optimizer state in ``trainer_state.pt``, weights from the HF files)."""
    return (Path(checkpoint_dir) / DCP_DIR).is_dir()


def _is_complete(path: Path) -> bool:
    if not (path / "trainer_state.pt").is_file():
        return False
    if not is_sharded(path):
        return True  # previous format: trainer_state.pt was its last file
    has_weights = (path / _SAFE_WEIGHTS).is_file() or (path / _SAFE_INDEX).is_file()
    return has_weights and (path / DCP_DIR / ".metadata").is_file() and (path / "config.json").is_file()


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (with a marker: its files at their sizes; a damaged
    folder is neither resumed from nor counted by ``keep_last``, and stays until its step is saved again)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
             and _is_complete(p) and verify_checkpoint(p, checksums=False) is None]
    return [p for _, p in sorted(found)]


def latest_checkpoint(checkpoint_root: str | Path) -> Path | None:
    """The most recent complete checkpoint folder (``trainer_state.pt``; current format: also ``dcp/.metadata``,
    ``config.json`` and the HF weights; with a :data:`MARKER`: its files at their sizes), or None."""
    found = complete_checkpoints(checkpoint_root)
    return found[-1] if found else None

"""What a result was made from, by content: digests of files, model folders, data files, configs and the machine.

A **fingerprint** is a flat dict of named parts (``{"config": "3f2a…", "model": "9c01…", "data": "…",
"machine": "cpu:AMD EPYC 7B13:avx512_bf16", "compute_dtype": "bfloat16"}``): each part a SHA-256 hex digest of
the input's bytes (or, for the machine and dtype, a plain string). Runs, evaluations and studies record one and
compare it, not paths: a model folder whose weights were replaced has another ``model`` part although its path is
the same; a run folder copied elsewhere keeps its parts. :func:`differences` names the parts that differ.

Digests of large files are cached on disk (``$STAPO_CACHE_DIR/digests.json`` or ``~/.cache/stapo/digests.json``)
keyed by (real path, size, modification and change times in ns, inode), so a 28-GB checkpoint is read once, not per
launch; a failed cache read or write only costs a re-hash.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["FINGERPRINT_FILE", "WEIGHT_SUFFIXES", "file_sha256", "folder_sha256", "model_digest", "files_digest",
           "json_digest", "machine_kind", "differences", "read_fingerprint", "write_fingerprint"]

#: The file a run or evaluation folder keeps its fingerprint in.
FINGERPRINT_FILE = "fingerprint.json"
#: Files of a model folder that are its content: weights (any shard) and the configs that change what they compute.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MODEL_CONFIGS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "chat_template.jinja", "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                  "added_tokens.json")
_CACHE_MIN_BYTES = 16 * 2**20  # smaller files are re-hashed (faster than the cache's read-modify-write)


def _cache_file() -> Path:
    root = os.environ.get("STAPO_CACHE_DIR")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "stapo") / "digests.json"


def _cache_key(path: Path) -> str:
    st = path.stat()
    # ctime too: an in-place rewrite whose mtime was restored (touch -r, cp -p) still changes it
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"


def _cache_get(key: str) -> str | None:
    try:
        return json.loads(_cache_file().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _cache_put(key: str, digest: str) -> None:
    path = _cache_file()
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(data, dict):
            data = {}
        data[key] = digest
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex, 64 characters) of every byte of ``path``; files of 16 MiB and more are cached on disk.

    Raises:
        OSError: the file cannot be read (the caller names the key it came from).
    """
    p = Path(path)
    key = _cache_key(p)
    big = p.stat().st_size >= _CACHE_MIN_BYTES
    if big and (hit := _cache_get(key)):
        return hit
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(8 * 2**20), b""):
            h.update(block)
    digest = h.hexdigest()
    if big:
        _cache_put(key, digest)
    return digest


def folder_sha256(folder: str | os.PathLike, names: Iterable[str]) -> str:
    """SHA-256 of the (relative path, file digest) list of the given files of ``folder`` (sorted; absent names
    skipped), so renaming the folder keeps the digest and changing one byte of one file changes it."""
    root = Path(folder)
    entries = [(n, file_sha256(root / n)) for n in sorted(set(names)) if (root / n).is_file()]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def model_digest(path_or_id: str | os.PathLike) -> str:
    """Content digest of a model: for a local folder, :func:`folder_sha256` of its weight files (any
    :data:`WEIGHT_SUFFIXES`, in subfolders too) and its config / tokenizer files; for a single local file (a GGUF),
    its :func:`file_sha256`; for anything else (a hub id, not resolvable here), ``"id:<the id>"``.

    Example: two copies of one checkpoint folder have the same digest; ``config.json`` edited to another
    ``hidden_size`` or one weight shard replaced gives another.
    """
    p = Path(path_or_id).expanduser()
    if p.is_file():
        return file_sha256(p)
    if not p.is_dir():
        return f"id:{path_or_id}"
    names = [q.relative_to(p).as_posix() for q in p.rglob("*")
             if q.is_file() and (q.suffix in WEIGHT_SUFFIXES or q.name in _MODEL_CONFIGS)
             and "optim" not in q.name and not any(part.startswith(".") for part in q.relative_to(p).parts)]
    return folder_sha256(p, names)


def files_digest(paths: Iterable[str | os.PathLike]) -> str:
    """SHA-256 of the ordered list of the files' :func:`file_sha256` (the order of ``paths`` is part of it)."""
    return hashlib.sha256(json.dumps([file_sha256(p) for p in paths]).encode()).hexdigest()


def json_digest(value: Any) -> str:
    """SHA-256 of ``value`` as canonical JSON (sorted keys, no spaces; non-JSON values by ``str``)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def machine_kind() -> str:
    """The kind of machine results are comparable within: ``cuda:<device name>`` on a GPU, else
    ``cpu:<model name>:<SIMD level>`` with the level the fastest of ``amx_bf16``, ``avx512_bf16``, ``avx512f``,
    ``avx2`` the CPU has (or ``ATEN_CPU_CAPABILITY`` when that variable caps it), e.g.
    ``cpu:AMD EPYC 7B13 64-Core Processor:avx2``."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    from stapo.common.perf import cpu_flags

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    level = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in cpu_flags()), "base")
    level = os.environ.get("ATEN_CPU_CAPABILITY") or level
    return f"cpu:{name}:{level}"


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The part names whose values differ between two fingerprints (a part present in only one counts), sorted."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def read_fingerprint(folder: str | os.PathLike) -> dict[str, Any] | None:
    """``folder/fingerprint.json`` as a dict, or None when absent or unreadable (results made before it existed)."""
    try:
        data = json.loads((Path(folder) / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_fingerprint(folder: str | os.PathLike, fingerprint: Mapping[str, Any]) -> Path:
    """Write ``folder/fingerprint.json`` atomically (temporary file + rename) → its path."""
    path = Path(folder) / FINGERPRINT_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(fingerprint), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path

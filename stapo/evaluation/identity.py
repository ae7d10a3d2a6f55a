"""What an evaluation was made from, by content: its fingerprint, the content key of each problem, and the checks
that reuse (a rerun into the same output) and paired comparisons (``scripts/paired_eval_diff.py``) make with them.

An evaluation folder records (``fingerprint.json``, :mod:`stapo.common.fingerprint`; rewritten by every launch)::

    {"model": <stapo.common.fingerprint.model_digest of the resolved local folder, or "id:<spec>">,
     "data:<benchmark>": <SHA-256 of its file, or "generated:<name>:<digest of its problems>">, ...,
     "protocol": <json_digest of protocol(): decoding settings, N, max new tokens, prompt, grader, verifier,
                  seed, samples per call, backend>,
     "machine": "cpu:AMD EPYC ...:avx2", "compute_dtype": "float32"}

and its ``eval_manifest.json`` the readable values behind them (:func:`stapo.evaluation.runner._manifest`).

**Rerun into the same output.** A model whose content changed under the same path (weights replaced) is refused in
one line naming the part and how to choose a new output (the finished results are kept). A benchmark file whose
content changed is *not* refused: every stored sample carries the :func:`content_key` of its problem (problem text
and gold), so the problems whose text or gold changed (or that moved, for files whose ids are row numbers) are
generated and graded again, their old samples moved to ``generations/superseded/`` (kept, never deleted), and the
unchanged ones are reused (:class:`stapo.evaluation.store.GenerationStore`).

**Paired comparisons.** :func:`protocol_differences` names what makes two evaluations incomparable pair by pair
(other decoding settings, N, new-token limit, prompt, grader, or another file for a shared benchmark);
:func:`same_inputs` says when two folders hold one evaluation twice (the same model content, data, protocol, seed
and dtype: a tie by construction).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from stapo.common.fingerprint import file_sha256, json_digest, model_digest

__all__ = ["content_key", "model_part", "data_part", "protocol", "eval_fingerprint", "protocol_differences",
           "same_inputs"]


def content_key(problem: str, gold: str) -> str:
    """The content key of one problem: 16 hex digits of SHA-256 over ``[problem text, gold answer]`` (JSON).

    Stored in every sample record (``content``); a stored sample counts for a problem only when its key is the
    problem's current one. Example: ``content_key("1+1?", "2") != content_key("1+1?", "3")``.
    """
    return hashlib.sha256(json.dumps([problem, gold]).encode()).hexdigest()[:16]


def model_part(source: Any) -> str:
    """The ``model`` part of a resolved ``--model`` (:class:`~stapo.evaluation.model_source.ModelSource`): the
    :func:`stapo.common.fingerprint.model_digest` of a local folder (an HF folder or a train.py checkpoint: weights and
    config / tokenizer files, cached per file), else ``"id:<spec>"`` (the embedded model, ``tiny``, a hub id: not
    content, compared by name).

    Raises:
        OSError: a file of the folder cannot be read (the caller names ``model.path``).
    """
    if source.kind in ("hf_folder", "checkpoint"):
        return model_digest(source.path)
    return f"id:{source.path}"


def data_part(path: str | Path | None, name: str, problems: Sequence[Any] = ()) -> str:
    """The ``data:<benchmark>`` part: the SHA-256 of the benchmark's file, or for a generated benchmark (no file)
    ``"generated:<name>:<16 hex digits over its problems' content keys>"``.

    Raises:
        OSError: the file cannot be read.
    """
    if path is not None:
        return file_sha256(path)
    keys = [content_key(p.record.problem, p.record.answer) for p in problems]
    return f"generated:{name}:{hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:16]}"


def protocol(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The protocol of an evaluation, from its manifest: the values that decide what a sample is and how it is
    graded — ``prompt``, ``max_new_tokens``, ``samples`` (N per benchmark), ``settings`` (temperature, top-p by
    name), ``grader``, ``verifier``, ``seed``, ``samples_per_call`` (it fixes the engine calls and their seeds) and
    ``backend``. Keys a manifest lacks (written before they were recorded) are None."""
    keys = ("prompt", "max_new_tokens", "samples", "settings", "grader", "verifier", "seed", "samples_per_call",
            "backend")
    return {k: manifest.get(k) for k in keys}


def eval_fingerprint(manifest: Mapping[str, Any], machine: str) -> dict[str, Any]:
    """The evaluation's ``fingerprint.json`` parts (module docstring) from its manifest and the machine kind."""
    out: dict[str, Any] = {"model": manifest.get("model_digest"), "protocol": json_digest(protocol(manifest)),
                           "machine": machine, "compute_dtype": manifest.get("dtype")}
    out.update({f"data:{b}": d for b, d in (manifest.get("data") or {}).items()})
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    if isinstance(value, str) and len(value) == 64:
        text = repr(value[:12] + "…")
    return text if len(text) <= 80 else text[:77] + "..."


def protocol_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """What differs between two evaluations' protocols on what they share (their ``eval_manifest.json``).

    Compared: ``max_new_tokens``, ``prompt`` (style and system prompt), the decoding ``settings`` both have (by
    name: temperature, top-p), N of the benchmarks both have, ``grader`` and ``verifier`` (when both recorded them),
    and the file digest (``data``) of each benchmark both recorded. Not compared: the model, its dtype, the backend,
    the seed, ``--limit`` (a paired comparison is made on the problems both answered).

    Returns:
        ``"<key>: <a> vs <b>"`` strings (empty: comparable).
    """
    out = []
    for key in ("max_new_tokens", "prompt"):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {_short(a.get(key))} vs {_short(b.get(key))}")
    for kind in ("settings", "samples"):
        sa, sb = a.get(kind) or {}, b.get(kind) or {}
        for name in sorted(set(sa) & set(sb)):
            if sa[name] != sb[name]:
                label = "settings[{}] (temperature, top-p)" if kind == "settings" else "samples[{}] (N)"
                out.append(f"{label.format(name)}: {_short(sa[name])} vs {_short(sb[name])}")
    for key in ("grader", "verifier"):
        if key in a and key in b and a[key] != b[key]:
            out.append(f"{key}: {_short(a[key])} vs {_short(b[key])}")
    da, db = a.get("data") or {}, b.get("data") or {}
    for name in sorted(set(da) & set(db)):
        if da[name] != db[name]:
            out.append(f"data[{name}] (the benchmark file's SHA-256): {_short(da[name])} vs {_short(db[name])}")
    return out


def same_inputs(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two evaluations' manifests describe one evaluation made twice: the same model content (digest; for
    ``id:`` models the same name), dtype, backend, seed, samples per call and protocol on what they share
    (:func:`protocol_differences` empty), and at least one shared benchmark and setting. Their samples are then the
    same samples; a paired difference of them is 0 by construction."""
    ma, mb = a.get("model_digest"), b.get("model_digest")
    if ma is None or mb is None or ma != mb:
        return False
    if ma.startswith("id:") and (a.get("model") or {}).get("path") != (b.get("model") or {}).get("path"):
        return False
    for key in ("dtype", "backend", "seed", "samples_per_call"):
        if a.get(key) != b.get(key):
            return False
    shared = set(a.get("samples") or {}) & set(b.get("samples") or {})
    shared_settings = set(a.get("settings") or {}) & set(b.get("settings") or {})
    return bool(shared and shared_settings) and not protocol_differences(a, b)

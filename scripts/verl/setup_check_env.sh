#!/usr/bin/env bash
# Create ./.venv-verl, the environment of the verl launch check (DRY_RUN=1 bash scripts/verl/run_stapo_qwen3_1.7b.sh).
#   bash scripts/setup.sh && bash scripts/verl/setup_check_env.sh      # ~10 s after scripts/setup.sh
# verl's config is composed with hydra, and hydra-core 1.3.x does not work with the omegaconf 2.4 this project pins.
# .venv-verl is a thin layer over the project's .venv: its own site-packages hold only hydra-core 1.3.8, omegaconf
# 2.3.1 and antlr4 4.9.3 (requirements-verl-check.txt, the versions verl[vllm]==0.9.1 resolves), and a .pth file
# appends .venv's site-packages (verl 0.9.1, torch, ray, tensordict, transformers and the editable stapo) behind
# them. Nothing in .venv changes. Use it as
#   source .venv-verl/bin/activate && DRY_RUN=1 NNODES=8 bash scripts/verl/run_stapo_qwen3_1.7b.sh
# STAPO_VENV=<dir> layers it over another project environment (default ./.venv). Re-running rebuilds it.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=${STAPO_VENV:-.venv}
OUT=${STAPO_VERL_CHECK_VENV:-.venv-verl}
[[ -x "$BASE/bin/python" ]] || { echo "no project environment at $BASE: run bash scripts/setup.sh first" >&2; exit 1; }
"$BASE/bin/python" -c "import verl" 2>/dev/null \
  || { echo "verl is not installed in $BASE: run bash scripts/setup.sh (requirements-verl-cpu.txt)" >&2; exit 1; }
BASE_SITE=$("$BASE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$OUT"
"$BASE/bin/python" -m venv --without-pip "$OUT"   # same interpreter version as the base environment
OUT_SITE=$("$OUT/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# pip of the base environment installs into the layer (--target), without dependencies: the three are pinned.
"$BASE/bin/python" -m pip install -q --no-deps --target "$OUT_SITE" -r requirements-verl-check.txt
# site.addsitedir (not a bare path line) so that the base's own .pth files (the editable stapo) are processed too.
echo "import site; site.addsitedir('$BASE_SITE')" > "$OUT_SITE/zz_stapo_base_env.pth"
"$OUT/bin/python" - <<'PYEOF'
import hydra, omegaconf, verl
assert omegaconf.__version__.startswith("2.3"), omegaconf.__file__
print(f"{__import__('sys').prefix}: hydra-core {hydra.__version__}, omegaconf {omegaconf.__version__}, verl {verl.__version__}")
PYEOF

"""Measure what tests/test_precision.py bounds: how much of one paper-lr update survives, and bf16-vs-fp32 agreement.

    python scripts/probe_precision.py

Prints, for the tiny model at the paper's lr 1e-6, warm-up 10, weight decay 0.1 (one training step, toy reward),
the fraction of the weights that got a gradient (AdamW exp_avg ≠ 0) which changed — fp32 master + bf16 compute,
fp32, and bf16 parameters (the refused setting, via model.allow_low_precision_params) — and, on one fixed batch,
the relative loss difference and gradient cosine of bf16 autocast vs fp32 compute (the test's own batch).
"""
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import test_precision as tp  # noqa: E402

if __name__ == "__main__":
    out = Path(tempfile.mkdtemp(prefix="probe_precision_"))
    for name, label, ov in (
            ("mixed", "fp32 master + bf16 compute", ["model.compute_dtype=bfloat16"]), ("fp32", "fp32", []),
            ("bf16", "bf16 parameters", ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16",
                                         "model.allow_low_precision_params=true"])):
        changed = tp._one_update(out, name, ov)["changed"]
        print(f"{label:28s} weights with a gradient that changed: {100 * changed:.2f} %")
    loss32, g32, loss16, g16, _ = tp.bf16_vs_fp32_loss_and_grad()
    print(f"bf16 vs fp32 compute: loss rel. diff {abs(loss16 - loss32) / abs(loss32):.1e}, gradient cosine "
          f"{float(torch.nn.functional.cosine_similarity(g16, g32, dim=0)):.6f}, norm rel. diff "
          f"{abs(float(g16.norm()) - float(g32.norm())) / float(g32.norm()):.1e}")

"""algorithm.log_kl_to_ref: the rollout policy's k3 KL to the initial policy, logged at β = 0 without changing the run
(issue 32, item 3: the KL to the base model as a diagnostic of the mechanism study's recipe)."""
from __future__ import annotations

import torch

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402

_TIMED = ("timing_s/", "perf/", "actor/kl_to_ref")


def test_kl_to_ref_is_logged_at_zero_beta_and_leaves_the_run_unchanged(tmp_path):
    """Two JustRL steps with and without the diagnostic: the same metrics and weights bit for bit (the reference pass
    is a no-grad forward that draws no random numbers); actor/kl_to_ref is 0 at step 1, where the rollout policy is
    the reference itself (same weights, so log π_old = log π_ref and k3 = e^0 − 0 − 1 = 0), and > 0 at step 2, after
    one update has moved the policy (k3 ≥ 0, equality only where the two distributions agree on every token)."""
    runs = {}
    for on in (False, True):
        trainer = make_trainer(str(tmp_path / str(on)), [
            "algorithm.objective=justrl", "trainer.total_steps=2", "trainer.save_every=0",
            "trainer.log_examples_every=0", "actor.lr=1e-3", f"algorithm.log_kl_to_ref={str(on).lower()}"])
        runs[on] = (trainer.train(), {k: v.detach().clone() for k, v in trainer.model.named_parameters()})
    (h_off, w_off), (h_on, w_on) = runs[False], runs[True]

    def same(m):  # repr: NaN (a quadrant without tokens) compares equal to NaN
        return {k: repr(v) for k, v in m.items() if not k.startswith(_TIMED)}

    assert [same(m) for m in h_on] == [same(m) for m in h_off]
    assert all(torch.equal(w_on[k], w_off[k]) for k in w_off)
    assert not any("actor/kl_to_ref" in m for m in h_off)
    assert abs(h_on[0]["actor/kl_to_ref"]) < 1e-6
    assert h_on[1]["actor/kl_to_ref"] > 1e-6
    assert "actor/kl_loss" not in h_on[1] or h_on[1]["actor/kl_loss"] == 0.0  # never in the loss at β = 0
    from test_docs_metrics import undocumented

    assert undocumented(h_on[1]) == []

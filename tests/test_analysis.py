"""The docs/method.md#token-analysis analysis: gradient norm w.r.t. logits, its bounds, entropy change, quadrants."""
import math

import pytest
import torch

from stapo.core.analysis import (
    entropy_change_estimate,
    logit_grad_norm,
    logit_grad_norm_bounds,
    quadrant_summary,
    token_loss_weight,
)
from stapo.core.objectives import clipped_surrogate


def test_grad_norm_hand_case():
    # V = 2, π = (0.5, 0.5), y = 0, w = 1: ‖e_y − π‖² = 0.25 + 0.25 = 0.5 = 1 − 2·0.5 + (0.25 + 0.25).
    g = logit_grad_norm(torch.tensor([math.log(0.5)]), torch.tensor([0.5]), torch.tensor([1.0]))
    assert g.item() == pytest.approx(math.sqrt(0.5))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grad_norm_formula_equals_autograd_of_the_clipped_surrogate(temperature):
    torch.manual_seed(0)
    n, v = 64, 50
    logits = (torch.randn(n, v, dtype=torch.float64) * 3).requires_grad_(True)  # raw logits a
    y = torch.randint(0, v, (n,))
    adv = torch.randn(n, dtype=torch.float64)
    # Reference statistics from a plain float64 softmax (independent of stapo.core.token_stats).
    with torch.no_grad():
        pi = torch.softmax(logits / temperature, dim=-1)
        logp = pi.log().gather(1, y[:, None]).squeeze(1)
        collision = (pi * pi).sum(-1)
        entropy = -(pi * pi.log()).sum(-1)
    old = logp + 0.3 * torch.randn(n, dtype=torch.float64)  # some tokens end up clipped
    # The token losses, through autograd: ℓ_i = clipped surrogate of token i (rows are independent).
    logp_g = torch.log_softmax(logits / temperature, dim=-1).gather(1, y[:, None]).squeeze(1)
    loss, clipped, dual, ratio = clipped_surrogate(logp_g[:, None], old[:, None], adv[:, None], 0.2, 0.28, 10.0)
    loss.sum().backward()
    autograd_norm = logits.grad.norm(dim=-1)  # [n]
    w = token_loss_weight(ratio, adv[:, None].float(), clipped | dual).squeeze(1)
    assert bool((clipped | dual).any()) and bool((~(clipped | dual)).any())  # both kinds present
    formula = logit_grad_norm(logp.float(), collision.float(), w, temperature=temperature)
    assert torch.allclose(formula.double(), autograd_norm, rtol=1e-4, atol=1e-6)
    lower, upper = logit_grad_norm_bounds(logp.float(), entropy.float(), w, v, temperature=temperature)
    assert bool((lower <= formula * (1 + 1e-4) + 1e-7).all()) and bool((formula <= upper * (1 + 1e-4) + 1e-7).all())


def test_entropy_change_sign_and_value():
    # p = e^−3, H = 1, Â = 1 → −e^−3 · (−3 + 1) · 1 = 2e^−3 (rare token, positive Â: entropy goes up)
    # p = e^−0.1, H = 1, Â = 1 → −e^−0.1 · 0.9 < 0 (likely token, positive Â: entropy goes down)
    d = entropy_change_estimate(torch.tensor([-3.0, -0.1]), torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]))
    assert d.tolist() == pytest.approx([2 * math.exp(-3), -math.exp(-0.1) * 0.9], rel=1e-6)
    d = entropy_change_estimate(torch.tensor([-3.0]), torch.tensor([1.0]), torch.tensor([1.0]),
                                lr=0.5, expected_advantage=0.5)
    assert d.item() == pytest.approx(0.5 * 2 * math.exp(-3) * 0.5, rel=1e-6)


def test_quadrant_summary_hand_case():
    # Â > 0 tokens (row 0): p = [.5, .5, .001, .001], H = [2.0, 0.1, 2.0, 0.1] → one token per quadrant,
    # with entropy_threshold = 1.0: (high p, high H), (high p, low H), (low p, high H), (low p, low H).
    # Row 1 has Â < 0 and is ignored. grad norms [1, 2, 3, 4] → each quadrant's mean is its own value.
    logp = torch.tensor([[0.5, 0.5, 0.001, 0.001], [0.001, 0.001, 0.5, 0.5]]).log()
    ent = torch.tensor([[2.0, 0.1, 2.0, 0.1], [0.1, 0.1, 0.1, 0.1]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4, dtype=torch.bool)
    gn = torch.tensor([[1.0, 2.0, 3.0, 4.0], [9.0, 9.0, 9.0, 9.0]])
    out = quadrant_summary(logp, ent, adv, mask, grad_norm=gn, entropy_threshold=1.0)
    assert out["quadrant/num_tokens"] == 4
    for name, g in (("high_p_high_h", 1.0), ("high_p_low_h", 2.0), ("low_p_high_h", 3.0), ("low_p_low_h", 4.0)):
        assert out[f"quadrant/{name}/share"] == 0.25
        assert out[f"quadrant/{name}/grad_norm"] == g
    # entropy change of the low-p/low-H token: −0.001 · (ln 0.001 + 0.1) · 1 = 0.001 · 6.8078 > 0
    assert out["quadrant/low_p_low_h/entropy_change"] == pytest.approx(0.001 * (math.log(1000) - 0.1), rel=1e-4)
    # default threshold: median of the 4 considered entropies [0.1, 0.1, 2.0, 2.0] = 1.05
    out = quadrant_summary(logp, ent, adv, mask)
    assert out["quadrant/entropy_threshold"] == pytest.approx(1.05)
    assert "quadrant/low_p_low_h/grad_norm" not in out

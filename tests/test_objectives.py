"""Policy objectives: clipped surrogate, KL, aggregation, the registry, and STAPO vs JustRL."""
import math

import pytest
import torch

from stapo.core.objectives import (
    OBJECTIVES,
    Objective,
    aggregate_loss,
    clipped_surrogate,
    compute_token_mask,
    get_objective,
    kl_k3,
    loss_denominator,
    objective_loss,
    policy_loss,
)


def test_token_mean_uses_the_mini_batch_denominator():
    # Micro-batch A: 4 tokens of loss 1. Micro-batch B: 1 token of loss 5 (3 padding positions).
    # Correct token-mean over the mini-batch: (4·1 + 1·5) / 5 = 1.8 (a mean of means would give 3.0).
    loss_a, keep_a = torch.ones(1, 4), torch.tensor([[True, True, True, True]])
    loss_b, keep_b = torch.tensor([[5.0, 7.0, 7.0, 7.0]]), torch.tensor([[True, False, False, False]])
    denom = loss_denominator(torch.cat([keep_a, keep_b]), "token-mean")
    assert denom == 5.0
    total = aggregate_loss(loss_a, keep_a, "token-mean", denom) + aggregate_loss(loss_b, keep_b, "token-mean", denom)
    assert total.item() == pytest.approx(1.8)


def test_seq_mean_token_mean_and_dr_grpo_aggregation():
    # seq 1 (micro-batch A): losses [1, 3] → mean 2; seq 2 (micro-batch B): [4] → 4; seq 3: no kept token.
    # seq-mean-token-mean: S = 2 sequences with kept tokens → (2 + 4) / 2 = 3.0.
    # seq-mean-token-sum-norm with L = 4: (1 + 3 + 4) / (2 · 4) = 1.0.
    loss_a, keep_a = torch.tensor([[1.0, 3.0, 0.0]]), torch.tensor([[True, True, False]])
    loss_b = torch.tensor([[4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    keep_b = torch.tensor([[True, False, False], [False, False, False]])
    keep_all = torch.cat([keep_a, keep_b])
    d = loss_denominator(keep_all, "seq-mean-token-mean")
    assert d == 2.0
    total = sum(aggregate_loss(l, k, "seq-mean-token-mean", d) for l, k in ((loss_a, keep_a), (loss_b, keep_b)))
    assert total.item() == pytest.approx(3.0)
    d = loss_denominator(keep_all, "seq-mean-token-sum-norm", max_response_length=4)
    assert d == 8.0
    total = sum(aggregate_loss(l, k, "seq-mean-token-sum-norm", d) for l, k in ((loss_a, keep_a), (loss_b, keep_b)))
    assert total.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_response_length"):
        loss_denominator(keep_all, "seq-mean-token-sum-norm")


def test_all_masked_micro_batch_gives_finite_zero_loss_and_zero_gradient():
    logp = torch.randn(2, 3, requires_grad=True)
    keep = torch.zeros(2, 3, dtype=torch.bool)
    assert loss_denominator(keep, "token-mean") == 1.0  # clamped, never 0
    loss, _ = policy_loss(get_objective("stapo"), logp, logp.detach() - 0.1, torch.ones(2), keep, 1.0)
    assert torch.isfinite(loss) and loss.item() == 0.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_clipped_surrogate_hand_values():
    # token: (Â, ρ) → loss, clipped, dual-clipped   (ε_low = 0.2, ε_high = 0.28, c = 10)
    #  (+1, 1.5) → max(−1.5, −1.28) = −1.28, clipped
    #  (+1, 0.5) → max(−0.5, −0.8)  = −0.5,  not clipped (a positive-Â token below the band keeps its gradient)
    #  (−1, 0.5) → max(0.5, 0.8)    = 0.8,   clipped
    #  (−1, 20)  → max(20, 1.28) = 20 → capped at −c·Â = 10, dual-clipped
    #  (−1, 1.1) → max(1.1, 1.1)    = 1.1,   not clipped
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    ratio = torch.tensor([[1.5, 0.5, 0.5, 20.0, 1.1]])
    old = torch.zeros(1, 5)
    loss, clipped, dual, r = clipped_surrogate(ratio.log(), old, adv, 0.2, 0.28, 10.0)
    assert loss.tolist()[0] == pytest.approx([-1.28, -0.5, 0.8, 10.0, 1.1], rel=1e-6)
    assert clipped.tolist() == [[True, False, True, False, False]]
    assert dual.tolist() == [[False, False, False, True, False]]
    assert r.tolist()[0] == pytest.approx(ratio.tolist()[0], rel=1e-6)
    # without dual clip the (−1, 20) token costs 20
    loss, _, dual, _ = clipped_surrogate(ratio.log(), old, adv, 0.2, 0.28, None)
    assert loss[0, 3].item() == pytest.approx(20.0) and not dual.any()


def test_clipped_tokens_get_zero_gradient_unclipped_get_minus_adv_ratio():
    # d(−Â ρ)/d log p = −Â ρ for unclipped tokens; clipped ones have zero gradient.
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(20.0)]], requires_grad=True)
    loss, *_ = clipped_surrogate(logp, torch.zeros(1, 3), adv, 0.2, 0.28, 10.0)
    loss.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.5, 0.0], abs=1e-6)


def test_kl_k3_hand_value():
    # log π_θ = ln 0.5, log π_ref = ln 0.25 → d = ln 0.5 → e^d − d − 1 = 0.5 + 0.693147 − 1 = 0.193147
    kl = kl_k3(torch.tensor([[math.log(0.5), 0.0]]), torch.tensor([[math.log(0.25), 0.0]]))
    assert kl.tolist()[0] == pytest.approx([0.1931472, 0.0], abs=1e-6)


def test_registry_definitions_follow_method_md():
    assert set(OBJECTIVES) == {"grpo", "justrl", "entropy20", "stapo",
                               "stapo_high_entropy", "stapo_random", "justrl_fullmask"}  # + the S2T ablations
    j, s, e, g = (get_objective(n) for n in ("justrl", "stapo", "entropy20", "grpo"))
    assert (j.loss_agg_mode, j.clip_ratio_low, j.clip_ratio_high, j.clip_ratio_c, j.kl_coef, j.token_mask) == \
        ("token-mean", 0.2, 0.28, 10.0, 0.0, "none")
    # STAPO and 20-Entropy differ from JustRL only in the token mask
    assert s.replace(name="justrl", token_mask="none", mask_params={}) == j
    assert e.replace(name="justrl", token_mask="none", mask_params={}) == j
    assert s.mask_params == {"prob_threshold": 0.002, "entropy_quantile": 0.75, "quantile_scope": "candidates"}
    assert e.mask_params == {"ratio": 0.2}
    assert (g.loss_agg_mode, g.clip_ratio_low, g.clip_ratio_high, g.kl_coef) == ("seq-mean-token-mean", 0.2, 0.2, 0.04)
    with pytest.raises(KeyError, match=r"valid names: \['entropy20', 'grpo', 'justrl', 'justrl_fullmask', 'stapo', "
                                       r"'stapo_high_entropy', 'stapo_random'\]"):
        get_objective("dapo")
    with pytest.raises(KeyError, match="valid names"):
        Objective("x", "token-mean", 0.2, 0.2, None, 0.0, token_mask="s2t_v2")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        Objective("x", "token-sum", 0.2, 0.2, None, 0.0, token_mask="none")


def _stapo_batch():
    """2 responses × 4 tokens; Â = [+1, −1]; response 0 has 3 rare tokens (p = 0.001).

    Candidates (Â > 0, p < 0.002): (0,0) H 0.1, (0,1) H 0.3, (0,2) H 0.5 → τ_h = 0.3 + 0.5·(0.5 − 0.3) = 0.4
    (q = 0.75, pos = 1.5) → silenced: (0,0), (0,1). Kept response tokens: 8 − 2 − 1 (padding (1,3)) = 5.
    """
    logp = torch.tensor([[0.001, 0.001, 0.001, 0.6], [0.001, 0.4, 0.3, 0.5]]).log()
    old = logp + torch.tensor([[0.05, -0.02, 0.1, 0.0], [0.03, -0.1, 0.2, 0.0]])  # ρ in [0.82, 1.11]
    ent = torch.tensor([[0.1, 0.3, 0.5, 1.0], [0.05, 0.2, 0.4, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    return logp, old, ent, adv, mask


def test_stapo_equals_justrl_on_the_unmasked_subset_and_silenced_tokens_get_zero_gradient():
    logp, old, ent, adv, mask = _stapo_batch()
    logp_s = logp.clone().requires_grad_(True)
    loss_s, m = objective_loss("stapo", logp_s, old, adv, mask, entropy=ent)
    assert m["actor/s2t/num_candidates"] == 3 and m["actor/s2t/num_masked"] == 2
    assert m["actor/s2t/entropy_threshold"] == pytest.approx(0.4)
    assert m["actor/num_kept_tokens"] == 5

    # JustRL on the subset alone: the hand-derived kept tokens as its response mask.
    subset = mask.clone()
    subset[0, 0] = subset[0, 1] = False
    logp_j = logp.clone().requires_grad_(True)
    loss_j, _ = objective_loss("justrl", logp_j, old, adv, subset)
    assert loss_s.item() == pytest.approx(loss_j.item(), rel=1e-6)

    loss_s.backward()
    loss_j.backward()
    assert torch.equal(logp_s.grad, logp_j.grad)
    assert logp_s.grad[0, 0].item() == 0.0 and logp_s.grad[0, 1].item() == 0.0  # exactly zero
    assert logp_s.grad[1, 3].item() == 0.0  # padding
    # kept, unclipped tokens: grad = −Â ρ / N with N = 5
    rho = (logp - old).exp()
    assert logp_s.grad[0, 2].item() == pytest.approx(-1.0 * rho[0, 2].item() / 5, rel=1e-5)
    assert logp_s.grad[1, 0].item() == pytest.approx(+1.0 * rho[1, 0].item() / 5, rel=1e-5)

    # and it differs from JustRL over all tokens (which would count the silenced ones)
    loss_all, _ = objective_loss("justrl", logp, old, adv, mask)
    assert loss_all.item() != pytest.approx(loss_s.item())


def test_stapo_split_into_micro_batches_equals_one_pass():
    # Mask and denominator from the whole mini-batch, loss accumulated over two micro-batches (one row each).
    logp, old, ent, adv, mask = _stapo_batch()
    obj = get_objective("stapo")
    tm = compute_token_mask(obj, logp, ent, adv, mask)
    denom = loss_denominator(tm.keep, obj.loss_agg_mode)
    parts = [policy_loss(obj, logp[i:i + 1], old[i:i + 1], adv[i:i + 1], tm.keep[i:i + 1], denom)[0] for i in (0, 1)]
    whole, _ = objective_loss(obj, logp, old, adv, mask, entropy=ent)
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)


def test_entropy20_keeps_top_20_percent_and_renormalises():
    # 7 response tokens → k = ceil(1.4) = 2: the two highest entropies (0,3) H 1.0 and (0,2) H 0.5.
    logp, old, ent, adv, mask = _stapo_batch()
    loss, m = objective_loss("entropy20", logp, old, adv, mask, entropy=ent)
    assert m["actor/top_entropy/num_kept"] == 2 and m["actor/num_kept_tokens"] == 2
    rho = (logp - old).exp()
    # token-mean over the 2 kept tokens (Â = +1): (−ρ02 − ρ03) / 2 with ρ02 = e^−0.1, ρ03 = 1, inside the band
    expected = (-math.exp(-0.1) - 1.0) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="needs entropy"):
        objective_loss("entropy20", logp, old, adv, mask)


def test_grpo_kl_term_and_metrics():
    logp, old, _, adv, mask = _stapo_batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        objective_loss("grpo", logp, old, adv, mask)
    # ref = current policy → KL 0 → loss equals the pure surrogate with seq-mean-token-mean
    loss0, m0 = objective_loss("grpo", logp, old, adv, mask, ref_logprobs=logp)
    assert m0["actor/kl_loss"] == 0.0 and m0["actor/kl_coef"] == 0.04
    # ref shifted by ln 0.5 on every token → k3 = 0.193147 everywhere → KL term = 0.04 · 0.193147
    loss1, m1 = objective_loss("grpo", logp, old, adv, mask, ref_logprobs=logp + math.log(0.5))
    assert m1["actor/kl_loss"] == pytest.approx(0.1931472, rel=1e-5)
    assert (loss1 - loss0).item() == pytest.approx(0.04 * 0.1931472, rel=1e-5)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert key in m0
    # ppo_kl = mean over kept tokens of (log p_old − log p): offsets (.05 −.02 .1 0 .03 −.1 .2) / 7
    assert m0["actor/ppo_kl"] == pytest.approx(0.26 / 7, rel=1e-5)


def test_kl_k3_gradient_stays_finite_for_extreme_log_ratios():
    # Token 2 is masked and has log p = −100 (ref − logp = 99.5 would overflow exp): its gradient must be 0,
    # not NaN. Kept token: d = −1.2 + 1 = −0.2 → k3 = e^−0.2 + 0.2 − 1; d k3/d logp = 1 − e^d = 1 − e^−0.2.
    lp = torch.tensor([[-1.0, -100.0]], requires_grad=True)
    ref = torch.tensor([[-1.2, -0.5]])
    kl = kl_k3(lp, ref)
    loss = aggregate_loss(kl, torch.tensor([[True, False]]), "token-mean", 1.0)
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(-0.2) + 0.2 - 1, rel=1e-6)
    assert lp.grad.tolist()[0] == pytest.approx([1 - math.exp(-0.2), 0.0], abs=1e-6)
    # a kept token with a huge ratio: value clamped at 10, gradient finite
    lp2 = torch.tensor([[-100.0]], requires_grad=True)
    kl2 = kl_k3(lp2, torch.tensor([[0.0]]))
    kl2.sum().backward()
    assert kl2.item() == 10.0 and torch.isfinite(lp2.grad).all()


def test_wrong_batch_size_of_per_response_advantages_is_a_clear_error():
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        objective_loss("justrl", torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(3), torch.ones(2, 4, dtype=torch.bool))


def test_s2t_silencing_a_whole_micro_batch_gives_finite_zero_loss_and_zero_gradient():
    # Mini-batch of two responses (Â = +1 both), split into two micro-batches of one response each.
    # Every token is rare (p = 0.001) → 4 candidates with H: A = [0.1, 0.2, 0.3], B = [0.9]
    # → sorted [0.1, 0.2, 0.3, 0.9], q = 0.75, pos = 2.25 → τ_h = 0.3 + 0.25·0.6 = 0.45
    # → all three tokens of micro-batch A are silenced; B's token is kept (N = 1).
    logp = torch.full((2, 3), math.log(0.001))
    ent = torch.tensor([[0.1, 0.2, 0.3], [0.9, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([1.0, 1.0])
    obj = get_objective("stapo")
    tm = compute_token_mask(obj, logp, ent, adv, mask)
    assert tm.keep.tolist() == [[False, False, False], [True, False, False]]
    denom = loss_denominator(tm.keep, obj.loss_agg_mode)
    assert denom == 1.0
    logp_a = logp[:1].clone().requires_grad_(True)
    loss_a, m = policy_loss(obj, logp_a, logp[:1], adv[:1], tm.keep[:1], denom)
    loss_a.backward()
    assert torch.isfinite(loss_a) and loss_a.item() == 0.0
    assert torch.equal(logp_a.grad, torch.zeros(1, 3))
    assert m["actor/num_kept_tokens"] == 0 and m["actor/pg_clipfrac"] == 0.0  # no 0/0 in the metrics either


def test_build_objective_applies_overrides_and_mask_parameters_by_config_key():
    from stapo.core.objectives import build_objective

    # the docstring's example: ε_high 0.3 and q 0.8; the other S2T parameters keep the objective's values
    obj = build_objective("stapo", {"clip_ratio_high": 0.3, "kl_coef": None},
                          {"algorithm.s2t.entropy_quantile": 0.8}.get)
    assert obj.clip_ratio_high == 0.3 and obj.kl_coef == 0.0
    assert obj.mask_params == {"prob_threshold": 0.002, "entropy_quantile": 0.8, "quantile_scope": "candidates"}
    assert build_objective("grpo") is get_objective("grpo")  # nothing to change: the registered objective itself
    with pytest.raises(KeyError, match="cannot be overridden"):
        build_objective("stapo", {"token_mask": "none"})


def test_a_loss_formula_registered_by_name_replaces_the_clipped_surrogate():
    from stapo.core.objectives import POLICY_LOSSES, register_policy_loss

    @register_policy_loss("test_unclipped")
    def unclipped(logprobs, old_logprobs, advantages, keep, objective):
        ratio = torch.exp(logprobs - old_logprobs.detach())  # [B, T]
        adv = advantages[:, None].expand_as(ratio)
        return -adv * ratio, {"pg_clipfrac": torch.zeros_like(keep), "pg_clipfrac_lower": torch.zeros_like(keep)}

    try:
        obj = get_objective("justrl").replace(name="t", policy_loss="test_unclipped")
        # 1 × 2 tokens, Â = 2, ρ = [1.5, 1] (the clipped surrogate would clip 1.5 to 1.28):
        # loss = −2·(1.5 + 1) / 2 = −2.5; the clipped one: −2·(1.28 + 1) / 2 = −2.28
        logp = torch.tensor([[math.log(0.75), math.log(0.5)]])
        old = torch.tensor([[math.log(0.5), math.log(0.5)]])
        keep = torch.ones(1, 2, dtype=torch.bool)
        loss, m = policy_loss(obj, logp, old, torch.tensor([2.0]), keep, 2.0)
        assert loss.item() == pytest.approx(-2.5) and m["actor/pg_clipfrac"] == 0.0
        loss, m = policy_loss(get_objective("justrl"), logp, old, torch.tensor([2.0]), keep, 2.0)
        assert loss.item() == pytest.approx(-2.28) and m["actor/pg_clipfrac"] == 0.5
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_unclipped")(unclipped)
    finally:
        POLICY_LOSSES.pop("test_unclipped")
    with pytest.raises(KeyError, match="unknown policy loss"):
        get_objective("justrl").replace(policy_loss="test_unclipped")


def test_gspo_style_sequence_ratio_by_hand():
    # Response 0 (Â = +1): kept log ρ = [ln 2, 0] → s = exp(ln 2 / 2) = √2 ≈ 1.414 > 1 + ε_high = 1.28 → clipped:
    #   loss −1.28 on both tokens, zero gradient.
    # Response 1 (Â = −1): kept log ρ = [ln 0.9, ln 0.9], 3rd token padding with log ρ = 5 (must not count)
    #   → s = 0.9 ∈ [0.8, 1.28] → loss +0.9 per token; ∂ℓ_t/∂log p_t = −Â·s = 0.9.
    # seq-mean-token-mean, S = 2: loss = (−1.28 + 0.9) / 2 = −0.19; ∂loss/∂log p_{1,t} = 0.9 / 2 / 2 = 0.225.
    obj = get_objective("grpo").replace(name="gspo_test", policy_loss="gspo", kl_coef=0.0, clip_ratio_high=0.28)
    old = torch.zeros(2, 3)
    logp = torch.tensor([[math.log(2.0), 0.0, 0.0], [math.log(0.9), math.log(0.9), 5.0]]).requires_grad_(True)
    keep = torch.tensor([[True, True, False], [True, True, False]])
    loss, m = policy_loss(obj, logp, old, torch.tensor([1.0, -1.0]), keep, loss_denominator(keep, obj.loss_agg_mode))
    assert loss.item() == pytest.approx(-0.19, abs=1e-6)
    assert m["actor/pg_clipfrac"] == 0.5  # the 2 tokens of response 0 out of 4 kept
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [0.225, 0.225, 0.0]]))

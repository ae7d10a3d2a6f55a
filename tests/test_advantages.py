"""GRPO advantages (docs/method.md#grpo-advantages). Expected values worked out by hand."""
import pytest
import torch

from stapo.core.advantages import broadcast_to_tokens, grpo_advantages


def test_grpo_advantages_hand_example():
    # Group 1: rewards [1, −1, −1, −1]: mean −0.5, deviations [1.5, −.5, −.5, −.5],
    #   ddof=1 variance = (2.25 + 3·0.25) / 3 = 1.0 → std 1 → Â = dev / (1 + 1e-6).
    # Group 2: rewards all 1 → std 0 → Â = 0 (and counted in frac_reward_zero_std).
    out = grpo_advantages(torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    expected = [1.5 / (1 + 1e-6), -0.5 / (1 + 1e-6), -0.5 / (1 + 1e-6), -0.5 / (1 + 1e-6), 0.0, 0.0, 0.0, 0.0]
    assert out.advantages.dtype == torch.float32
    assert out.advantages.tolist() == pytest.approx(expected, rel=1e-6)
    assert out.frac_reward_zero_std == 0.5
    assert out.metrics["frac_reward_zero_std"] == 0.5
    assert out.metrics["critic/advantages/max"] == pytest.approx(1.5, rel=1e-5)


def test_dr_grpo_skips_std_division_and_2d_input():
    # rewards [[2, 0], [1, 1]] → means [1, 1] → Â = [1, −1, 0, 0] without the std division.
    out = grpo_advantages(torch.tensor([[2.0, 0.0], [1.0, 1.0]]), group_size=2, norm_by_std=False)
    assert out.advantages.tolist() == [1.0, -1.0, 0.0, 0.0]
    # with it: std (ddof 1) of [2, 0] = sqrt(2) → Â = ±1/sqrt(2)
    out = grpo_advantages(torch.tensor([[2.0, 0.0], [1.0, 1.0]]), group_size=2)
    assert out.advantages[:2].tolist() == pytest.approx([2 ** -0.5, -(2 ** -0.5)], rel=1e-5)


def test_grpo_advantages_bad_input():
    with pytest.raises(ValueError, match="≥ 2"):
        grpo_advantages(torch.ones(4), group_size=1)
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(torch.ones(4), group_size=3)
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), group_size=2)


def test_broadcast_to_tokens():
    adv = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert adv.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


def test_equal_non_representable_rewards_give_exactly_zero_advantage():
    # fp32 std of [0.1] * 8 is ~7e-9, not 0; the group must still count as zero-std with Â = 0
    # (docs/method.md#grpo-advantages)
    out = grpo_advantages(torch.tensor([0.1] * 8 + [0.0, 1.0] * 4), group_size=8)
    assert out.advantages[:8].tolist() == [0.0] * 8
    assert out.frac_reward_zero_std == 0.5

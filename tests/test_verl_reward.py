"""stapo.integrations.verl_reward: our grader in verl's compute_score signature (verl itself is optional here)."""
from __future__ import annotations

import pytest

from stapo.integrations import verl_reward
from stapo.integrations.verl_reward import compute_score


def test_strict_box_scores_like_our_reward():
    # the last box in the final 100 characters is compared with the gold answer after light normalisation
    assert compute_score("DAPO-17k", "so the answer is \\boxed{34}.", "34") == {"score": 1.0, "acc": 1.0, "pred": "34"}
    assert compute_score("DAPO-17k", "\\boxed{35}", "34", {"index": 0}) == {"score": -1.0, "acc": 0.0, "pred": "35"}
    assert compute_score("aime24", "no box at all", "34") == {"score": -1.0, "acc": 0.0, "pred": ""}
    # a box that starts more than 100 characters before the end does not count (JustRL strict box)
    assert compute_score(None, "\\boxed{34}" + " " * 120, "34")["score"] == -1.0
    assert compute_score(None, "\\boxed{34}", 34)["score"] == 1.0  # integer gold answers are stringified


def test_verl_call_convention_keywords_and_errors():
    # verl's reward loop calls with keywords only and may add the reward-router keywords
    out = compute_score(data_source="DAPO-17k", solution_str="\\boxed{$7$}", ground_truth="7", extra_info={},
                        reward_router_address=None, reward_model_tokenizer=None)
    assert out["score"] == 1.0
    with pytest.raises(TypeError, match="unexpected"):
        compute_score("x", "\\boxed{7}", "7", None, temperature=1.0)
    with pytest.raises(TypeError):
        compute_score("x", None, "7")
    with pytest.raises(TypeError):
        compute_score("x", "\\boxed{7}", None)
    with pytest.raises(ValueError, match="unknown reward"):
        compute_score("x", "\\boxed{7}", "7", reward="nope")


def test_math_verify_reward_option():
    try:
        out = compute_score("aime24", "The answer is \\boxed{\\frac{1}{2}}", "0.5", reward="math_verify")
        assert out["score"] == 1.0 and out["acc"] == 1.0
        assert compute_score("aime24", "\\boxed{3}", "0.5", reward="math_verify")["score"] == -1.0
    finally:
        verl_reward.close()


def test_loads_through_verls_custom_reward_mechanism():
    pytest.importorskip("verl", reason="verl is not installed")
    from verl.utils.import_utils import load_extern_object

    # reward.custom_reward_function.path=pkg://stapo.integrations.verl_reward, name=compute_score
    fn = load_extern_object(module_path="pkg://stapo.integrations.verl_reward", object_name="compute_score")
    assert fn is compute_score

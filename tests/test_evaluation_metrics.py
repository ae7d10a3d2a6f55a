"""Evaluation metrics on hand-made cases: avg@N, unbiased pass@k, maj@N (ties), benchmark summaries.

Every expected value is worked out by hand in the comments (binomials written out), never by calling the code
under test again.
"""
from __future__ import annotations

import math

import pytest

from stapo.evaluation.metrics import (answer_key, average_over_benchmarks, avg_at_n, majority_vote, mean_pass_at_k,
                                      paired_difference, pass_at_k, per_problem_accuracy, summarize_benchmark)


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25),          # 1 - C(3,1)/C(4,1) = 1 - 3/4
    (4, 2, 2, 5 / 6),         # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (5, 2, 3, 0.9),           # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (4, 0, 4, 0.0),           # no correct sample: C(4,4)/C(4,4) = 1
    (4, 1, 4, 1.0),           # n - c = 3 < k = 4: every draw of 4 contains the correct one
    (32, 3, 32, 1.0),         # pass@N with c >= 1
    (32, 0, 32, 0.0),
    (32, 32, 1, 1.0),
    (10, 3, 2, 8 / 15),       # 1 - C(7,2)/C(10,2) = 1 - 21/45 = 24/45
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_1_is_fraction_correct():
    # pass@1 = 1 - (n-c)/n = c/n for every c: 32 samples, 7 correct -> 7/32 = 0.21875
    assert pass_at_k(32, 7, 1) == pytest.approx(0.21875, abs=1e-15)


@pytest.mark.parametrize("args", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5), (4.5, 1, 1)])
def test_pass_at_k_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        pass_at_k(*args)


def test_mean_pass_at_k_and_avg_at_n():
    # problem A: 1 of 4 correct, problem B: 2 of 4 correct
    # pass@2: A = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; B = 5/6; mean = (1/2 + 5/6)/2 = 2/3
    assert mean_pass_at_k([(4, 1), (4, 2)], 2) == pytest.approx(2 / 3)
    # avg@4 = (1/4 + 2/4)/2 = 0.375
    assert avg_at_n([[True, False, False, False], [True, True, False, False]]) == pytest.approx(0.375)
    # problems with different N: (1/2 + 3/3)/2 = 0.75
    assert avg_at_n([[True, False], [True, True, True]]) == pytest.approx(0.75)
    assert math.isnan(avg_at_n([]))
    assert math.isnan(mean_pass_at_k([], 1))
    with pytest.raises(ValueError, match="problem 1 has no samples"):
        avg_at_n([[True], []])


def test_answer_key_normalisation():
    assert answer_key(" 34. ") == "34"
    assert answer_key("$34$") == "34"
    assert answer_key("\\dfrac{1}{2}") == "\\frac{1}{2}"
    assert answer_key("(1, 2)") == "(1,2)"
    assert answer_key("\\left( 1,\\, 2 \\right)") == "(1,2)"
    assert answer_key(None) is None
    assert answer_key("  ") is None


def test_majority_vote_tie_goes_to_earliest_first_vote():
    # 2 votes each for "5" (samples 0, 3) and "7" (samples 1, 2): "5" voted first -> wins, and it is correct
    v = majority_vote(["5", "7", "7", "5"], [True, False, False, True])
    assert (v.answer, v.votes, v.correct, v.tied) == ("5", 2, True, True)
    # the mirror image: "7" first -> the wrong answer wins the tie
    v = majority_vote(["7", "5", "5", "7"], [False, True, True, False])
    assert (v.answer, v.votes, v.correct, v.tied) == ("7", 2, False, True)


def test_majority_vote_groups_by_normalised_string_and_ignores_missing_answers():
    # None does not vote; " 3. " and "3" are one key (2 votes) against "\\dfrac{1}{2}" (1 vote)
    v = majority_vote([None, "3", " 3. ", "\\dfrac{1}{2}"], [False, True, False, False])
    assert (v.answer, v.votes, v.correct, v.tied) == ("3", 2, True, False)  # any voter correct -> correct
    # string voting, not equivalence: 1/2 and 0.5 are separate keys; 3 votes for 0.5 win
    v = majority_vote(["1/2", "0.5", "0.5", "0.5"], [True, True, True, True])
    assert (v.answer, v.votes) == ("0.5", 3)


def test_majority_vote_without_answers_is_wrong():
    v = majority_vote([None, None], [False, False])
    assert (v.answer, v.votes, v.correct, v.tied) == (None, 0, False, False)
    with pytest.raises(ValueError):
        majority_vote(["1"], [True, False])


def _rec(correct, extracted, status, tokens, finish, accepted=False):
    return {"correct": correct, "extracted": extracted, "status": status, "response_tokens": tokens,
            "finish_reason": finish, "verifier_accepted": accepted}


def test_summarize_benchmark_hand_case():
    p1 = [_rec(True, "1", "correct", 10, "eos"), _rec(False, "2", "incorrect", 20, "eos"),
          _rec(False, "2", "incorrect", 30, "length"), _rec(False, None, "no_answer", 40, "length")]
    p2 = [_rec(True, "9", "correct", 5, "eos"), _rec(True, "9", "correct", 5, "eos"),
          _rec(False, "8", "incorrect", 5, "eos"), _rec(False, "8", "timeout", 5, "eos")]
    s = summarize_benchmark([p1, p2], 4)
    assert (s["N"], s["problems"], s["samples"]) == (4, 2, 8)
    assert s["avg@N"] == pytest.approx(0.375)      # (1/4 + 2/4) / 2
    # se: per-problem accuracies 0.25, 0.5 (mean 0.375); sd (ddof 1) = sqrt(2 · 0.125² / 1) = 0.1768; / sqrt(2) = 0.125
    assert s["avg@N_se"] == pytest.approx(0.125)
    assert math.isnan(summarize_benchmark([p1], 4)["avg@N_se"])  # one problem: undefined
    assert s["pass@1"] == pytest.approx(0.375)     # equals avg@N
    assert s["pass@N"] == pytest.approx(1.0)       # both problems have >= 1 correct sample
    # maj: p1 "2" (2 votes) beats "1" (1 vote) -> wrong; p2 "9" vs "8" tie, "9" first -> right: 1/2
    assert s["maj@N"] == pytest.approx(0.5)
    assert s["maj_ties"] == 1
    assert s["grader"] == {"correct": 3, "incorrect": 3, "no_answer": 1, "timeout": 1, "error": 0}
    assert s["mean_response_tokens"] == pytest.approx(15.0)  # (10+20+30+40 + 4*5) / 8 = 120/8
    assert s["truncation_rate"] == pytest.approx(0.25)       # 2 "length" of 8
    assert s["no_answer_rate"] == pytest.approx(0.125)
    assert s["verifier_accepted"] == 0


def test_summarize_benchmark_checks_sample_count_and_status():
    with pytest.raises(ValueError, match="problem 0 has 1 samples, expected N=2"):
        summarize_benchmark([[_rec(True, "1", "correct", 1, "eos")]], 2)
    with pytest.raises(ValueError, match="unknown grader status"):
        summarize_benchmark([[_rec(True, "1", "right", 1, "eos")]], 1)
    empty = summarize_benchmark([], 4)
    assert empty["problems"] == 0 and math.isnan(empty["avg@N"])


def test_average_over_benchmarks():
    # (0.5 + 0.25 + 0.0) / 3 = 0.25
    per = {"a": {"avg@N": 0.5}, "b": {"avg@N": 0.25}, "c": {"avg@N": 0.0}}
    assert average_over_benchmarks(per) == pytest.approx(0.25)
    assert math.isnan(average_over_benchmarks({}))


def test_per_problem_accuracy_groups_by_benchmark_and_setting():
    recs = [{"benchmark": "b", "setting": "s", "problem_id": "b/0", "correct": c} for c in (True, False, True, True)]
    recs += [{"benchmark": "b", "setting": "s", "problem_id": "b/1", "correct": False}] * 4
    recs += [{"benchmark": "b", "setting": "t", "problem_id": "b/0", "correct": True}] * 2
    # b/0 at s: 3 of 4 = 0.75; b/1 at s: 0 of 4; b/0 at t: 2 of 2 = 1
    assert per_problem_accuracy(recs) == {("b", "s"): {"b/0": 0.75, "b/1": 0.0}, ("b", "t"): {"b/0": 1.0}}
    with pytest.raises(ValueError, match="record 1 lacks correct"):
        per_problem_accuracy([recs[0], {"benchmark": "b", "setting": "s", "problem_id": "b/0"}])


def test_paired_difference_by_hand():
    a = {"x": 1.0, "y": 0.5, "z": 0.0, "only_a": 1.0}
    b = {"x": 0.5, "y": 0.5, "z": 0.0, "only_b": 0.0}
    r = paired_difference(a, b)
    # shared x, y, z: d = [0.5, 0, 0], mean 1/6; deviations 1/3, -1/6, -1/6 -> sd = sqrt((1/9 + 1/36 + 1/36) / 2)
    # = sqrt(1/12) = 0.288675; SE_paired = 0.288675 / sqrt(3) = 0.166667; resolvable = 1.96 * 0.166667 = 0.326667
    assert r["problems"] == 3
    assert r["diff"] == pytest.approx(1 / 6)
    assert r["se_paired"] == pytest.approx(1 / 6)
    assert r["resolvable"] == pytest.approx(1.96 / 6)
    # unpaired: a = [1, .5, 0] sd 0.5 -> SE 0.5/sqrt(3); b = [.5, .5, 0] sd sqrt(1/12) -> SE sqrt(1/12)/sqrt(3)
    # sqrt(0.25/3 + (1/12)/3) = sqrt(1/9) = 1/3
    assert r["se_unpaired"] == pytest.approx(1 / 3)
    # two runs that move together on every problem: SE_paired 0 although each run's own SE is not
    same = paired_difference({"p": 1.0, "q": 0.0}, {"p": 0.75, "q": -0.25})
    assert same["se_paired"] == pytest.approx(0.0) and same["se_unpaired"] > 0.5
    with pytest.raises(ValueError, match="share 1 problem"):
        paired_difference({"x": 1.0, "y": 0.0}, {"x": 0.0})

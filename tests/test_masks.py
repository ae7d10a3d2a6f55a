"""Token masks: S2T (STAPO) and top-entropy (20-Entropy). Expected values are worked out in comments."""
import math

import pytest
import torch

from stapo.core.masks import MASKS, get_token_mask, no_mask, s2t_mask, top_entropy_mask
from stapo.core.tensor_utils import quantile


def _case_2x6():
    """The 2×6 mini-batch used by several tests.

    Row 0: Â = +1.0, 6 response tokens.   Row 1: Â = +0.5, 5 response tokens + 1 padding token.
      p row 0 = [0.5,   0.001, 0.0005, 0.9,  0.001, 0.3]   H row 0 = [1.0, 0.2, 0.4, 0.1,  1.3, 2.0]
      p row 1 = [0.001, 0.7,   0.0001, 0.6,  0.2,   pad]   H row 1 = [0.6, 1.5, 0.3, 0.05, 1.2, pad]
    τ_p = 0.002 → candidates (Â > 0, p < τ_p): (0,1) H .2, (0,2) H .4, (0,4) H 1.3, (1,0) H .6, (1,2) H .3.
    The padding token (1,5) has p = 1e-4 and H = 0 but is not a response token: never a candidate.
    """
    p = torch.tensor([[0.5, 0.001, 0.0005, 0.9, 0.001, 0.3],
                      [0.001, 0.7, 0.0001, 0.6, 0.2, 0.0001]])
    h = torch.tensor([[1.0, 0.2, 0.4, 0.1, 1.3, 2.0],
                      [0.6, 1.5, 0.3, 0.05, 1.2, 0.0]])
    adv = torch.tensor([1.0, 0.5])
    mask = torch.tensor([[True] * 6, [True] * 5 + [False]])
    return p.log(), h, adv, mask


def _positions(keep, mask):
    """Sorted list of (row, col) response positions that are NOT kept (= silenced)."""
    return sorted(map(tuple, (mask & ~keep).nonzero().tolist()))


def test_s2t_2x6_candidates_scope():
    # Candidate entropies sorted: [0.2, 0.3, 0.4, 0.6, 1.3]; q = 0.75, n = 5 → pos = 0.75·4 = 3 → τ_h = 0.6.
    # Silenced = candidates with H < 0.6 (strict): (0,1) .2, (0,2) .4, (1,2) .3. (1,0) has H = 0.6 = τ_h → kept.
    logp, h, adv, mask = _case_2x6()
    out = s2t_mask(logp, h, adv, mask, prob_threshold=0.002, entropy_quantile=0.75, quantile_scope="candidates")
    assert out.keep.dtype == torch.bool
    assert _positions(out.keep, mask) == [(0, 1), (0, 2), (1, 2)]
    assert not out.keep[1, 5]  # padding is never kept
    s = out.stats
    assert s["num_candidates"] == 5
    assert s["num_masked"] == 3
    assert s["num_response_tokens"] == 11
    assert s["masked_frac"] == pytest.approx(3 / 11)
    assert s["entropy_threshold"] == pytest.approx(0.6)
    # mean p = (0.001 + 0.0005 + 0.0001) / 3; mean H = (0.2 + 0.4 + 0.3) / 3 = 0.3; mean Â = (1 + 1 + 0.5) / 3
    assert s["masked_prob_mean"] == pytest.approx(0.0016 / 3, rel=1e-5)
    assert s["masked_entropy_mean"] == pytest.approx(0.3, rel=1e-6)
    assert s["masked_adv_mean"] == pytest.approx(2.5 / 3, rel=1e-6)


def test_s2t_2x6_all_scope():
    # All 11 response entropies sorted: [.05, .1, .2, .3, .4, .6, 1.0, 1.2, 1.3, 1.5, 2.0];
    # q = 0.8 → pos = 0.8·10 = 8 → τ_h = 1.3. Silenced = candidates with H < 1.3:
    # (0,1) .2, (0,2) .4, (1,0) .6, (1,2) .3; (0,4) has H = 1.3 = τ_h → kept.
    logp, h, adv, mask = _case_2x6()
    out = s2t_mask(logp, h, adv, mask, entropy_quantile=0.8, quantile_scope="all")
    assert _positions(out.keep, mask) == [(0, 1), (0, 2), (1, 0), (1, 2)]
    assert out.stats["entropy_threshold"] == pytest.approx(1.3)
    assert out.stats["num_candidates"] == 5
    assert out.stats["num_masked"] == 4


def test_s2t_empty_candidate_set_silences_nothing():
    # All probabilities ≥ τ_p → no candidates → keep == response mask, τ_h undefined (NaN).
    logp = torch.tensor([[0.5, 0.25, 0.002], [0.9, 0.01, 0.3]]).log()
    h = torch.tensor([[0.1, 0.1, 0.1], [0.1, 0.1, 0.1]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = s2t_mask(logp, h, torch.tensor([1.0, 1.0]), mask)
    assert torch.equal(out.keep, mask)
    assert out.stats["num_candidates"] == 0 and out.stats["num_masked"] == 0
    assert math.isnan(out.stats["entropy_threshold"])
    assert math.isnan(out.stats["masked_prob_mean"])


def test_s2t_single_candidate_is_never_silenced():
    # One candidate: τ_h = its own entropy, and H < τ_h is false under the strict inequality.
    logp = torch.tensor([[0.5, 0.001, 0.5]]).log()
    h = torch.tensor([[0.9, 0.01, 0.9]])
    out = s2t_mask(logp, h, torch.tensor([2.0]), torch.ones(1, 3, dtype=torch.bool))
    assert out.stats["num_candidates"] == 1
    assert out.stats["entropy_threshold"] == pytest.approx(0.01)
    assert out.keep.all()


def test_s2t_ties_at_threshold_are_kept():
    # Five candidates, all with H = 0.5 → τ_h = 0.5, nobody has H < 0.5 → nothing silenced.
    # One of them at H = 0.25 instead: sorted [.25, .5, .5, .5, .5], pos = 3 → τ_h = 0.5 → only the 0.25 goes.
    logp = torch.full((1, 5), math.log(0.001))
    mask = torch.ones(1, 5, dtype=torch.bool)
    out = s2t_mask(logp, torch.full((1, 5), 0.5), torch.tensor([1.0]), mask)
    assert out.stats["num_candidates"] == 5 and out.stats["num_masked"] == 0
    out = s2t_mask(logp, torch.tensor([[0.5, 0.5, 0.25, 0.5, 0.5]]), torch.tensor([1.0]), mask)
    assert _positions(out.keep, mask) == [(0, 2)]


def test_s2t_probability_threshold_is_strict():
    # p exactly 0.002 (in fp32 log space: log p == ln 0.002 rounded the same way) is not < τ_p.
    logp = torch.tensor([[math.log(0.002), math.log(0.001), math.log(0.001)]])
    h = torch.tensor([[0.0, 0.1, 0.2]])
    out = s2t_mask(logp, h, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool))
    # candidates: positions 1, 2 → τ_h = 0.1 + 0.75·(0.2 − 0.1) = 0.175 → position 1 silenced.
    assert out.stats["num_candidates"] == 2
    assert _positions(out.keep, torch.ones(1, 3, dtype=torch.bool)) == [(0, 1)]


def test_s2t_negative_or_zero_advantage_never_silenced():
    # Every token is rare and confident, but Â ≤ 0 → not a candidate.
    logp = torch.full((3, 4), math.log(1e-5))
    h = torch.tensor([[0.01, 0.02, 0.03, 0.04]] * 3)
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = s2t_mask(logp, h, torch.tensor([-1.0, 0.0, -1e-3]), mask)
    assert out.keep.all()
    assert out.stats["num_candidates"] == 0
    # token-level advantages too
    adv_tok = torch.tensor([[-1.0, 0.0, -2.0, 0.0]] * 3)
    assert s2t_mask(logp, h, adv_tok, mask).keep.all()


def test_s2t_bf16_entropy_and_logprobs():
    # Same as the 2×6 case but with entropies chosen exactly representable in bf16 (multiples of 1/8).
    # Candidates H: (0,1) .25, (0,2) .5, (0,4) 1.25, (1,0) .625, (1,2) .375 → sorted [.25,.375,.5,.625,1.25]
    # → τ_h = .625 → silenced (0,1), (0,2), (1,2).
    logp, _, adv, mask = _case_2x6()
    h = torch.tensor([[1.0, 0.25, 0.5, 0.125, 1.25, 2.0],
                      [0.625, 1.5, 0.375, 0.0625, 1.125, 0.0]], dtype=torch.bfloat16)
    out = s2t_mask(logp.bfloat16(), h, adv.bfloat16(), mask)
    assert _positions(out.keep, mask) == [(0, 1), (0, 2), (1, 2)]
    assert out.stats["entropy_threshold"] == 0.625


def test_s2t_integer_mask_works_as_a_mask_not_an_index():
    logp, h, adv, mask = _case_2x6()
    int_mask = mask.long()  # 0/1; if used as an index it would gather rows 0 and 1 instead of masking
    out = s2t_mask(logp, h, adv, int_mask)
    assert out.keep.dtype == torch.bool
    assert _positions(out.keep, mask) == [(0, 1), (0, 2), (1, 2)]
    assert not out.keep[1, 5]
    with pytest.raises(TypeError, match="response_mask"):
        s2t_mask(logp, h, adv, mask.float())
    with pytest.raises(ValueError, match="0/1"):
        s2t_mask(logp, h, adv, int_mask * 2)


def test_s2t_bad_arguments():
    logp, h, adv, mask = _case_2x6()
    with pytest.raises(ValueError, match="entropy_quantile"):
        s2t_mask(logp, h, adv, mask, entropy_quantile=1.0)
    with pytest.raises(ValueError, match="prob_threshold"):
        s2t_mask(logp, h, adv, mask, prob_threshold=0.0)
    with pytest.raises(ValueError, match="quantile_scope"):
        s2t_mask(logp, h, adv, mask, quantile_scope="batch")
    with pytest.raises(ValueError, match="entropy has shape"):
        s2t_mask(logp, h[:, :5], adv, mask)


def test_threshold_over_more_than_2_pow_24_values():
    # torch.quantile refuses inputs over 2^24 elements on some versions; ours uses kthvalue.
    n = 2**24 + 7
    k = n // 2 + 5  # more than half the values are 1.0, the rest 2.0
    values = torch.full((n,), 2.0)
    values[:k] = 1.0
    # median: pos = (n−1)/2 = 8388611 < k → both neighbours are 1.0 → 1.0; q = 0.9 lands in the 2.0 block.
    assert quantile(values, 0.5).item() == 1.0
    assert quantile(values, 0.9).item() == 2.0
    # The S2T mask with scope "all" over the same number of tokens: every token is a candidate
    # (p = 0.001, Â = 1); τ_h = quantile(H, 0.5) = 1.0 → nothing has H < 1.0 → nothing silenced;
    # with q = 0.9, τ_h = 2.0 → exactly the k tokens with H = 1.0 are silenced.
    logp = torch.full((1, n), math.log(0.001))
    mask = torch.ones(1, n, dtype=torch.bool)
    out = s2t_mask(logp, values[None], torch.ones(1), mask, entropy_quantile=0.9, quantile_scope="all")
    assert out.stats["num_masked"] == k


def test_top_entropy_keeps_top_ceil_ratio_n_with_deterministic_ties():
    # 5 response tokens (row 1 position 2 is padding), entropies [0.5, 2.0, 1.0 | 2.0, 0.1];
    # ratio 0.2 → k = ceil(1.0) = 1; the two 2.0 tie, the first in row-major order, (0,1), is kept.
    h = torch.tensor([[0.5, 2.0, 1.0], [2.0, 0.1, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = top_entropy_mask(None, h, None, mask, ratio=0.2)
    assert out.keep.tolist() == [[False, True, False], [False, False, False]]
    assert out.stats["num_kept"] == 1 and out.stats["entropy_threshold"] == 2.0
    # ratio 0.5 → k = ceil(2.5) = 3 → both 2.0 and the 1.0.
    out = top_entropy_mask(None, h, None, mask, ratio=0.5)
    assert out.keep.tolist() == [[False, True, True], [True, False, False]]
    assert out.stats["kept_frac"] == pytest.approx(3 / 5)


def test_top_entropy_ratio_times_n_is_an_integer():
    # 15 tokens, ratio 0.2 → k = 3 exactly (0.2·15 = 3.0000000000000004 in floats must not become 4).
    h = torch.arange(15, dtype=torch.float32)[None]  # the top-3 are 14, 13, 12
    out = top_entropy_mask(None, h, None, torch.ones(1, 15, dtype=torch.bool), ratio=0.2)
    assert out.keep.nonzero()[:, 1].tolist() == [12, 13, 14]


def test_top_entropy_integer_mask_and_empty():
    h = torch.tensor([[0.3, 0.2, 0.1]])
    out = top_entropy_mask(None, h, None, torch.tensor([[0, 1, 1]]), ratio=0.5)  # n = 2 → k = 1 → (0,1)
    assert out.keep.tolist() == [[False, True, False]]
    out = top_entropy_mask(None, h, None, torch.zeros(1, 3, dtype=torch.bool))
    assert not out.keep.any() and out.stats["num_kept"] == 0


def test_no_mask_and_registry():
    mask = torch.tensor([[1, 0]])
    assert no_mask(None, None, None, mask).keep.tolist() == [[True, False]]
    assert set(MASKS) == {"none", "s2t", "top_entropy", "s2t_high_entropy", "s2t_random", "full_low_prob"}
    with pytest.raises(KeyError, match="valid names"):
        get_token_mask("s2T")


def test_nan_entropy_is_an_error_not_a_silent_no_op():
    # A NaN in the quantile pool would make τ_h NaN and silence nothing without a word.
    logp = torch.full((1, 4), math.log(0.001))
    h = torch.tensor([[0.1, float("nan"), 0.3, 0.4]])
    with pytest.raises(ValueError, match=r"non-finite entropy .* \(0, 1\)"):
        s2t_mask(logp, h, torch.ones(1), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="NaN entropy"):
        top_entropy_mask(None, h, None, torch.ones(1, 4, dtype=torch.bool))
    # NaN on a padding position is ignored
    out = s2t_mask(logp, h, torch.ones(1), torch.tensor([[True, False, True, True]]))
    assert out.stats["num_candidates"] == 3


def test_maskable_rows_by_mask():
    from stapo.core.masks import maskable_rows

    adv = torch.tensor([0.5, 0.0, -0.5])  # S2T silences only Â > 0 tokens (docs/method.md#s2t-mask): row 0 only
    assert maskable_rows("s2t", adv).tolist() == [True, False, False]
    assert maskable_rows("none", adv).tolist() == [False, False, False]
    assert maskable_rows("top_entropy", adv).tolist() == [True, True, True]
    with pytest.raises(KeyError, match="unknown token mask"):
        maskable_rows("s2tt", adv)


# --- the paper's ablations of S2T (same candidates as S2T: (0,1) H .2, (0,2) H .4, (0,4) H 1.3, (1,0) H .6,
# (1,2) H .3 in _case_2x6; S2T with q = 0.75 silences (0,1), (0,2), (1,2)) ------------------------------------
def test_high_entropy_masking_silences_candidates_above_the_1_minus_q_quantile():
    from stapo.core.masks import s2t_high_entropy_mask

    # candidate H sorted [0.2, 0.3, 0.4, 0.6, 1.3]; 1 − q = 0.25 → pos = 0.25·4 = 1 → τ = 0.3.
    # silenced: H > 0.3 (strict): (0,2) .4, (0,4) 1.3, (1,0) .6; (1,2) has H = τ → kept; (0,1) .2 kept.
    logp, h, adv, mask = _case_2x6()
    out = s2t_high_entropy_mask(logp, h, adv, mask, entropy_quantile=0.75)
    assert _positions(out.keep, mask) == [(0, 2), (0, 4), (1, 0)]
    assert out.stats["entropy_threshold"] == pytest.approx(0.3)
    assert (out.stats["num_candidates"], out.stats["num_masked"]) == (5, 3)
    assert out.stats["masked_entropy_mean"] == pytest.approx((0.4 + 1.3 + 0.6) / 3, rel=1e-6)
    # rows with Â ≤ 0 are never touched
    out = s2t_high_entropy_mask(logp, h, torch.tensor([0.0, -1.0]), mask)
    assert out.keep.equal(mask) and out.stats["num_candidates"] == 0


def test_random_masking_silences_as_many_candidates_as_s2t_with_a_documented_seed():
    from stapo.core.masks import s2t_random_mask

    logp, h, adv, mask = _case_2x6()
    out = s2t_random_mask(logp, h, adv, mask, seed=0)
    silenced = _positions(out.keep, mask)
    # S2T silences 3 of the 5 candidates → 3 random candidates here
    assert out.stats["num_masked"] == 3 and len(silenced) == 3
    assert set(silenced) <= {(0, 1), (0, 2), (0, 4), (1, 0), (1, 2)}
    # the docstring's seed: seed·1_000_003 + 1009·N_resp + N_cand = 0 + 1009·11 + 5 = 11104; candidates in row-major
    # order are (0,1), (0,2), (0,4), (1,0), (1,2); the first 3 of randperm(5) pick the silenced ones
    perm = torch.randperm(5, generator=torch.Generator().manual_seed(11104))[:3].tolist()
    cands = [(0, 1), (0, 2), (0, 4), (1, 0), (1, 2)]
    assert silenced == sorted(cands[i] for i in perm)
    assert out.stats["entropy_threshold"] == pytest.approx(0.6)  # S2T's τ_h, whose count is matched
    assert _positions(s2t_random_mask(logp, h, adv, mask, seed=0).keep, mask) == silenced  # a pure function
    draws = {tuple(_positions(s2t_random_mask(logp, h, adv, mask, seed=s).keep, mask)) for s in range(10)}
    assert len(draws) > 1  # the seed matters (10 seeds, 10 possible 3-subsets)


def test_random_masking_depends_on_the_candidate_sequence_not_on_the_layout():
    """The one-process trainer masks the [n, R] mini-batch, the data-parallel path its [1, N_resp] flattening
    (stapo.core.minibatch.minibatch_token_mask): both, and any padding width, silence the same tokens. By hand: seed
    11104 as above (N_resp = 11 response tokens whatever the padding, N_cand = 5); the flattening puts row 0's 6
    response tokens at 0..5 and row 1's 5 at 6..10, so the candidates (0,1), (0,2), (0,4), (1,0), (1,2) are at 1, 2, 4,
    6, 8."""
    from stapo.core.masks import s2t_random_mask

    logp, h, adv, mask = _case_2x6()
    perm = torch.randperm(5, generator=torch.Generator().manual_seed(11104))[:3].tolist()
    want = sorted([(0, 1), (0, 2), (0, 4), (1, 0), (1, 2)][i] for i in perm)
    assert _positions(s2t_random_mask(logp, h, adv, mask).keep, mask) == want
    # [1, 11]: the response tokens in row-major order, as minibatch_token_mask concatenates them
    flat = s2t_random_mask(logp[mask][None], h[mask][None], adv[:, None].expand_as(mask)[mask][None],
                           torch.ones(1, 11, dtype=torch.bool))
    assert _positions(flat.keep, torch.ones(1, 11, dtype=torch.bool)) == sorted((0, [1, 2, 4, 6, 8][i]) for i in perm)
    # more padding (width 9): same tokens
    pad = lambda x, v: torch.nn.functional.pad(x, (0, 3), value=v)  # noqa: E731
    wide = s2t_random_mask(pad(logp, -9.0), pad(h, 0.0), adv, pad(mask, False))
    assert _positions(wide.keep, pad(mask, False)) == want
    assert wide.stats == s2t_random_mask(logp, h, adv, mask).stats
    # the rows in the other order: the candidate sequence is (1,0), (1,2), (0,1), (0,2), (0,4) and the same draw
    # picks by position in it
    rev = s2t_random_mask(logp.flip(0), h.flip(0), adv.flip(0), mask.flip(0))
    swapped = [(1, 0), (1, 2), (0, 1), (0, 2), (0, 4)]  # original (row, col) of the reversed batch's candidates
    got = sorted((1 - r, c) for r, c in _positions(rev.keep, mask.flip(0)))
    assert got == sorted(swapped[i] for i in perm)


def test_justrl_fullmask_silences_every_low_probability_token_of_positive_advantage():
    from stapo.core.masks import full_low_prob_mask

    logp, h, adv, mask = _case_2x6()
    out = full_low_prob_mask(logp, h, adv, mask, prob_threshold=0.002)
    assert _positions(out.keep, mask) == [(0, 1), (0, 2), (0, 4), (1, 0), (1, 2)]  # all 5 candidates
    assert out.stats["masked_frac"] == pytest.approx(5 / 11)
    assert math.isnan(out.stats["entropy_threshold"])
    # row 1 with Â = −0.5: its rare tokens (1,0), (1,2) are kept
    out = full_low_prob_mask(logp, h, torch.tensor([1.0, -0.5]), mask)
    assert _positions(out.keep, mask) == [(0, 1), (0, 2), (0, 4)]
    with pytest.raises(ValueError, match="tau_p"):
        full_low_prob_mask(logp, h, adv, mask, prob_threshold=0.0)


def test_ablation_masks_touch_only_positive_advantage_rows():
    from stapo.core.masks import maskable_rows

    adv = torch.tensor([0.5, 0.0, -0.5])
    for name in ("s2t_high_entropy", "s2t_random", "full_low_prob"):
        assert maskable_rows(name, adv).tolist() == [True, False, False], name


def test_the_paper_values_are_written_once():
    """τ_p = 0.002 and q = 0.75 appear as numbers in one place of the package, stapo/core/params.py's constants; the
    mask functions, S2TParams (= the config section algorithm.s2t), the objectives, the config schema and the verl
    plugin read them. A second literal 0.002 / 0.75 anywhere in stapo/ code fails here (docstrings do not count)."""
    import ast
    from pathlib import Path

    from stapo.config import TrainConfig
    from stapo.core import masks
    from stapo.core.objectives import OBJECTIVES
    from stapo.integrations.verl import StapoPolicyLossConfig

    root = Path(masks.__file__).resolve().parents[1]
    found = sorted((str(f.relative_to(root.parent)), n.value) for f in root.rglob("*.py")
                   for n in ast.walk(ast.parse(f.read_text()))
                   if isinstance(n, ast.Constant) and type(n.value) is float and n.value in (0.002, 0.75))
    assert found == [("stapo/core/params.py", 0.002), ("stapo/core/params.py", 0.75)]
    assert (masks.PROB_THRESHOLD, masks.ENTROPY_QUANTILE, masks.TOP_ENTROPY_RATIO) == (0.002, 0.75, 0.2)
    cfg = TrainConfig()
    assert type(cfg.algorithm.s2t) is masks.S2TParams  # the config section is the mask's own dataclass
    assert (cfg.algorithm.s2t.prob_threshold, cfg.algorithm.s2t.entropy_quantile) == (0.002, 0.75)
    assert OBJECTIVES["stapo"].mask_params == {"prob_threshold": 0.002, "entropy_quantile": 0.75,
                                               "quantile_scope": "candidates"}
    assert OBJECTIVES["entropy20"].mask_params == {"ratio": 0.2} and cfg.algorithm.top_entropy_ratio == 0.2
    verl = StapoPolicyLossConfig()
    assert (verl.s2t_prob_threshold, verl.s2t_entropy_quantile, verl.top_entropy_ratio) == (0.002, 0.75, 0.2)

"""stapo.core.minibatch: the mini-batch mask over data-parallel ranks equals the single-process mask.

Two real gloo processes (CPU) with an uneven split: rank 0 holds 2 responses and every S2T candidate, rank 1 holds
3 responses of different lengths and no candidate (all its advantages are negative); then the same with candidates
on both ranks (rank 1's rows 0 and 2 with Â > 0). Every mask — S2T, 20-Entropy and the paper's ablations, among them
the seeded random masking of ``stapo_random`` — gives exactly the keep-mask of the one-process
``compute_token_mask`` on the concatenated [5, 6] mini-batch (what the one-process trainer computes).

The layout rule (docs/extending.md#the-layout-rule): EVERY registered mask (a loop over ``MASKS``, so a mask added
later is covered), plus ``first_k`` — docs/extending.md's example, which reads rows — run on the two ranks, with
per-row (trainer) and per-token (verl) advantages, is the one-process mask of the same rows; and every mask that
declares ``reads_rows=False`` gives the same keep-mask and statistics on the ranks' tokens as one row [1, N] (the
layout the data-parallel path then uses) as on the rows.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp

from stapo.core.masks import MASKS, TokenMask, get_mask_spec, register_token_mask, unregister_token_mask
from stapo.core.minibatch import all_gather_varlen, minibatch_token_mask
from stapo.core.objectives import compute_token_mask, get_objective

TAU_P_LOGP = -7.0  # log p < ln 0.002 ≈ −6.2146: a candidate when Â > 0


def _shares(both: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(logprobs, entropy, advantages [B], response_mask) of the two ranks; ``both``: rank 1 has candidates too (its
    rows 0 and 2, Â > 0: 4 + 1 low-p tokens)."""
    g = torch.Generator().manual_seed(7)
    # rank 0: 2 responses × 6 tokens, Â > 0; tokens 1..4 of each row are candidates (p < τ_p), 8 in all
    lp0 = torch.full((2, 6), -0.5)
    lp0[:, 1:5] = TAU_P_LOGP
    ent0 = torch.rand(2, 6, generator=g) * 2
    ent0[1, 2] = ent0[0, 3]  # a tie across rows for the top-entropy tie-break
    m0 = torch.ones(2, 6, dtype=torch.bool)
    m0[1, 5] = False
    # rank 1: 3 responses × 4 tokens, Â < 0: low-p tokens but no candidates
    lp1 = torch.full((3, 4), TAU_P_LOGP)
    ent1 = torch.rand(3, 4, generator=g) * 2
    m1 = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv1 = torch.tensor([1.0, -0.2, 0.7]) if both else torch.tensor([-1.0, -0.2, -0.7])
    return [(lp0, ent0, torch.tensor([1.0, 0.5]), m0), (lp1, ent1, adv1, m1)]


def _objectives():
    return [get_objective("stapo"), get_objective("entropy20"),
            get_objective("stapo").replace(mask_params={"prob_threshold": 0.002, "entropy_quantile": 0.8,
                                                        "quantile_scope": "all"}),
            get_objective("stapo_high_entropy"), get_objective("stapo_random"), get_objective("justrl_fullmask"),
            get_objective("stapo_random").replace(mask_params={**get_objective("stapo_random").mask_params,
                                                               "seed": 3})]


CASES = (False, True)  # _shares(both)
ROWS_MASK = "test_layout_first_k"


@dataclass
class FirstKParams:
    k: int = 2


def first_k(logprobs, entropy, advantages, response_mask, *, k=2):
    """docs/extending.md's example, a mask that reads rows: silence the first k response tokens of every Â > 0
    response (per-token Â: of every token with Â > 0 among the first k of its row)."""
    mask = response_mask.bool()
    pos = mask.long().cumsum(dim=1)  # [B, T] 1-based position among the response tokens of its row
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    silenced = mask & (pos <= k) & (adv > 0)
    return TokenMask(keep=mask & ~silenced, stats={"num_response_tokens": float(mask.sum()),
                                                   "num_masked": float(silenced.sum())})


@contextmanager
def _row_reading_mask():
    """``first_k`` registered (as docs/extending.md registers it: reads_rows=True) for the ``with`` block."""
    register_token_mask(ROWS_MASK, params=FirstKParams, maskable_rows="positive_advantage", reads_rows=True)(first_k)
    try:
        yield
    finally:
        unregister_token_mask(ROWS_MASK)


def _mask_objective(name: str):
    """JustRL with the registered mask ``name`` at its default parameters."""
    return get_objective("justrl").replace(name=f"layout_{name}", token_mask=name,
                                           mask_params=get_mask_spec(name).default_params())


def _with_adv(share, per_token: bool):
    """A share with [B] advantages (the native trainer) or the same broadcast to [B, T] (verl)."""
    lp, ent, adv, m = share
    return lp, ent, adv[:, None].expand(m.shape).clone() if per_token else adv, m


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        results = [[minibatch_token_mask(obj, *_shares(both)[rank]) for obj in _objectives()] for both in CASES]
        gathered = all_gather_varlen(torch.arange(rank + 2, dtype=torch.float32)[None, :])
        with _row_reading_mask():  # every mask this process has registered: the built-in ones and first_k
            every = {}
            for name in sorted(MASKS):
                for both in CASES:
                    for per_token in (False, True):
                        tm = minibatch_token_mask(_mask_objective(name), *_with_adv(_shares(both)[rank], per_token))
                        every[name, both, per_token] = (tm.keep, tm.num_kept, tm.stats)
        torch.save({"results": [[(r.keep, r.num_kept, r.stats) for r in case] for case in results],
                    "gathered": gathered, "every": every}, os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.barrier()  # no rank tears gloo down while the other still communicates
    finally:
        torch.distributed.destroy_process_group()


def _pad_cat(tensors: list[torch.Tensor], width: int, fill) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in tensors])


def _one_process(shares, width: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranks' shares as one [5, width] mini-batch, rank 0's rows first (rank-major order)."""
    return (_pad_cat([s[0] for s in shares], width, 0.0), _pad_cat([s[1] for s in shares], width, 0.0),
            torch.cat([s[2] for s in shares]), _pad_cat([s[3] for s in shares], width, False))


def _same_stats(a: dict, b: dict) -> bool:
    """Equal statistics, NaN equal to NaN."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@pytest.fixture(scope="module")
def gloo_out(tmp_path_factory):
    """The two gloo ranks' results (one spawn for the module's tests)."""
    tmp_path = tmp_path_factory.mktemp("dp_mask")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, 2, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]


def test_two_gloo_ranks_with_uneven_candidates_match_one_process(gloo_out):
    out = gloo_out
    assert [g.tolist() for g in out[0]["gathered"]] == [[[0.0, 1.0]], [[0.0, 1.0, 2.0]]]
    for c, both in enumerate(CASES):
        shares = _shares(both)
        lp, ent, adv, m = _one_process(shares)
        for i, obj in enumerate(_objectives()):
            ref = compute_token_mask(obj, lp, ent, adv, m)  # the one-process trainer's call on the [n, R] rows
            flat = minibatch_token_mask(obj, lp, ent, adv, m)  # one process, [1, N_resp] flattening
            assert torch.equal(flat.keep, ref.keep) and flat.num_kept == ref.num_kept, (obj.name, both)
            for rank, rows in ((0, slice(0, 2)), (1, slice(2, 5))):
                keep, num_kept, stats = out[rank]["results"][c][i]
                width = shares[rank][3].shape[1]
                assert torch.equal(keep, ref.keep[rows, :width]), (obj.name, both, rank)
                assert num_kept == ref.num_kept
                assert stats.keys() == ref.stats.keys()
                for k, v in stats.items():
                    assert v == ref.stats[k] or (v != v and ref.stats[k] != ref.stats[k]), (obj.name, both, k)
    lp, ent, adv, m = _one_process(_shares())
    s2t = minibatch_token_mask(_objectives()[0], lp, ent, adv, m)
    assert s2t.stats["actor/s2t/num_candidates"] == 8 and 0 < s2t.stats["actor/s2t/num_masked"] < 8
    assert not s2t.keep[:2].all() and s2t.keep[2:].equal(m[2:])  # rank 1 (no candidates) keeps everything
    # with candidates on both ranks, the random draw silences tokens of both ranks (8 + 5 candidates; the draw
    # over the rank-major candidate sequence is the one-process draw over the row-major one)
    shares = _shares(True)
    rand = [out[r]["results"][1][4][0] for r in (0, 1)]  # case both, objective stapo_random, keep
    assert all(not k.equal(s[3]) for k, s in zip(rand, shares))
    assert compute_token_mask(_objectives()[4], *_one_process(shares)).stats["actor/s2t_random/num_candidates"] == 13


def test_single_process_without_torch_distributed_is_the_plain_mask():
    lp, ent, adv, m = _shares()[0]
    obj = get_objective("stapo")
    from stapo.core.objectives import compute_token_mask

    ref = compute_token_mask(obj, lp, ent, adv, m)
    got = minibatch_token_mask(obj, lp, ent, adv, m)
    assert torch.equal(got.keep, ref.keep) and got.num_kept == int(ref.keep.sum()) and got.stats == ref.stats


def test_every_registered_mask_on_two_gloo_ranks_is_the_one_process_mask_of_the_same_rows(gloo_out):
    """Each rank's keep = its rows of the one-process mask of the [5, 7] mini-batch (one more padding column than
    the ranks' widest T = 6: no mask may read the padding width), N and the statistics the one-process ones, for
    every mask a fresh process registers (the built-in ones, and first_k, which reads rows), with [B] and [B, T]
    advantages."""
    every = [gloo_out[r]["every"] for r in (0, 1)]
    names = {name for name, _, _ in every[0]}
    # at least these; a mask stapo registers later is in `names` too
    assert {"none", "s2t", "top_entropy", "s2t_high_entropy", "s2t_random", "full_low_prob", ROWS_MASK} <= names
    with _row_reading_mask():
        for name, both, per_token in every[0]:
            shares = _shares(both)
            lp, ent, adv, m = _with_adv(_one_process(shares, width=7), per_token)
            ref = compute_token_mask(_mask_objective(name), lp, ent, adv, m)  # the one-process trainer's call
            for rank, rows in ((0, slice(0, 2)), (1, slice(2, 5))):
                keep, num_kept, stats = every[rank][name, both, per_token]
                width = shares[rank][3].shape[1]
                assert torch.equal(keep, ref.keep[rows, :width]), (name, both, per_token, rank)
                assert num_kept == ref.num_kept and _same_stats(stats, ref.stats), (name, both, per_token, rank)
    # first_k by hand (k = 2): rank 0's two Â > 0 rows (6 and 5 tokens) lose their first 2 tokens; rank 1 (4, 2
    # and 1 tokens) loses nothing when all its Â < 0, else rows 0 (Â = 1) and 2 (Â = 0.7): 2 + 1 tokens
    for per_token in (False, True):
        (k0, n0, _), (k1, n1, _) = (every[r][ROWS_MASK, False, per_token] for r in (0, 1))
        m0, m1 = _shares()[0][3], _shares()[1][3]
        assert k0.tolist() == (m0 & (torch.arange(6) >= 2)).tolist() and torch.equal(k1, m1)
        assert n0 == n1 == 11 + 7 - 4  # 14
        (_, n0, _), (k1, n1, _) = (every[r][ROWS_MASK, True, per_token] for r in (0, 1))
        assert k1.tolist() == [[False, False, True, True], [True, True, False, False], [False, False, False, False]]
        assert n0 == n1 == 11 + 7 - 4 - 3  # 11


@pytest.mark.parametrize("per_token", [False, True], ids=["row_adv", "token_adv"])
def test_a_mask_declaring_it_reads_no_rows_gives_the_same_mask_on_one_row(per_token):
    """The declaration reads_rows=False, checked for every registered mask that makes it: the call on the mini-batch's
    response tokens as one row [1, N] (what the data-parallel path then hands the mask, rank-major = row-major
    order) gives the keep-mask and statistics of the call on its [5, 6] rows. first_k, which reads rows, would not:
    one row silences only the first 2 tokens of the whole mini-batch (N = 18 − 2 = 16, not 14)."""
    with _row_reading_mask():
        checked = 0
        for both in CASES:
            lp, ent, adv, m = _with_adv(_one_process(_shares(both)), per_token)
            adv_tok = adv if per_token else adv[:, None].expand(m.shape)  # [5, 6]
            ones = torch.ones(1, int(m.sum()), dtype=torch.bool)  # [1, 18]
            for name, spec in MASKS.items():
                obj = _mask_objective(name)
                rows = compute_token_mask(obj, lp, ent, adv, m)
                flat = compute_token_mask(obj, lp[m][None], ent[m][None], adv_tok[m][None], ones)
                same = torch.equal(flat.keep[0], rows.keep[m]) and _same_stats(flat.stats, rows.stats)
                if not spec.reads_rows:
                    assert same, f"token mask {name!r} declares reads_rows=False but its [1, N] mask differs"
                    checked += 1
                if name == ROWS_MASK:
                    assert not same and flat.num_kept == 16 and rows.num_kept == (14 if not both else 11)
        assert checked >= 2 * 6  # the six built-in masks, in both cases

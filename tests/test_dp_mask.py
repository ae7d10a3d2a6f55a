"""stapo.core.minibatch: the mini-batch mask over data-parallel ranks equals the single-process mask.

Two real gloo processes (CPU) with an uneven split: rank 0 holds 2 responses and every S2T candidate, rank 1 holds
3 responses of different lengths and no candidate (all its advantages are negative); then the same with candidates
on both ranks (rank 1's rows 0 and 2 with Â > 0). Every mask — S2T, 20-Entropy and the paper's ablations, among them
the seeded random masking of ``stapo_random`` — gives exactly the keep-mask of the one-process
``compute_token_mask`` on the concatenated [5, 6] mini-batch (what the one-process trainer computes).
"""
from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

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


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        results = [[minibatch_token_mask(obj, *_shares(both)[rank]) for obj in _objectives()] for both in CASES]
        gathered = all_gather_varlen(torch.arange(rank + 2, dtype=torch.float32)[None, :])
        torch.save({"results": [[(r.keep, r.num_kept, r.stats) for r in case] for case in results],
                    "gathered": gathered}, os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.barrier()  # no rank tears gloo down while the other still communicates
    finally:
        torch.distributed.destroy_process_group()


def _pad_cat(tensors: list[torch.Tensor], width: int, fill) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in tensors])


def _one_process(shares) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranks' shares as one [5, 6] mini-batch, rank 0's rows first (rank-major order)."""
    return (_pad_cat([s[0] for s in shares], 6, 0.0), _pad_cat([s[1] for s in shares], 6, 0.0),
            torch.cat([s[2] for s in shares]), _pad_cat([s[3] for s in shares], 6, False))


def test_two_gloo_ranks_with_uneven_candidates_match_one_process(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, 2, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]

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

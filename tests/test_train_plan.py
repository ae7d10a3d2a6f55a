"""stapo.train.plan: the update schedule, worked by hand on small batches."""
from __future__ import annotations

import torch

from stapo.train.plan import build_plan

# 2 prompts × G = 4: rows 0–7; Â > 0 in rows 0, 2, 4, 6
ADV = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
LENGTHS = torch.tensor([5, 9, 7, 3, 6, 4, 8, 2])  # prompt + response tokens per row


def _rows(micro):
    return [m.tolist() for m in micro]


def test_the_fused_plan_of_the_module_docstring():
    plan = build_plan(LENGTHS, ADV, mini_batch_rows=4, micro_batch_size=2, token_mask="s2t", fused_forward=True,
                      sort_by_length=False)
    assert _rows(plan.old_pass) == [[4, 5], [6, 7]] and plan.ref_pass == ()
    first, second = plan.minibatches
    assert first.stats == second.stats == "own_forward" and first.fills_old and not second.fills_old
    assert [(m.rows.tolist(), m.deferred) for m in first.forwards] == [([0, 2], True), ([1, 3], False)]
    assert [(m.rows.tolist(), m.deferred) for m in second.forwards] == [([4, 6], True), ([5, 7], False)]
    assert plan.num_forwards == 6


def test_the_plain_plan_reads_the_old_pass_first_then_a_current_policy_pass():
    """Algorithm 1: mini-batch 0's mask from the old pass (π_θ = π_old), mini-batch 1's from a no-grad forward of
    the current policy; sorted by length (longest first) inside each pass; a reference pass with β > 0."""
    plan = build_plan(LENGTHS, ADV, mini_batch_rows=4, micro_batch_size=3, token_mask="s2t", has_reference=True)
    # all 8 rows by length: 9 (1), 8 (6), 7 (2) | 6 (4), 5 (0), 4 (5) | 3 (3), 2 (7)
    assert _rows(plan.old_pass) == _rows(plan.ref_pass) == [[1, 6, 2], [4, 0, 5], [3, 7]]
    first, second = plan.minibatches
    assert (first.stats, first.stats_pass) == ("old_pass", ())
    assert [m.rows.tolist() for m in first.forwards] == [[1, 2, 0], [3]]  # rows 0–3 by length: 9, 7, 5 | 3
    assert second.stats == "current_pass" and _rows(second.stats_pass) == [[6, 4, 5], [7]]
    assert not any(m.deferred for m in (*first.forwards, *second.forwards))
    assert plan.num_forwards == 3 + 3 + 2 + (2 + 2)


def test_old_statistics_or_no_mask_need_no_current_policy_pass_and_fsdp2_keeps_every_graph():
    old = build_plan(LENGTHS, ADV, mini_batch_rows=4, micro_batch_size=4, token_mask="s2t",
                     mask_stats_source="old", sort_by_length=False)
    assert [mb.stats for mb in old.minibatches] == ["old_pass", "old_pass"] and old.num_forwards == 2 + 2
    none = build_plan(LENGTHS, ADV, mini_batch_rows=4, micro_batch_size=4, token_mask="none", sort_by_length=False)
    assert [mb.stats for mb in none.minibatches] == ["old_pass", "old_pass"]  # the mask reads no statistics
    # fused, no mask: no row is deferred; FSDP2 (collective forwards): every row is
    fused = build_plan(LENGTHS, ADV, mini_batch_rows=4, micro_batch_size=4, token_mask="none", fused_forward=True,
                       sort_by_length=False)
    assert [m.deferred for m in fused.minibatches[0].forwards] == [False]
    fsdp = build_plan(LENGTHS, ADV, mini_batch_rows=4, micro_batch_size=4, token_mask="s2t", fused_forward=True,
                      sort_by_length=False, keep_all_graphs=True)
    assert [(m.rows.tolist(), m.deferred) for m in fsdp.minibatches[0].forwards] == [([0, 1, 2, 3], True)]

"""Padding-free and token-budget micro-batches (actor.use_remove_padding, actor.use_dynamic_bsz): the layouts of
stapo.train.policy.layout_inputs worked by hand, their per-token statistics and gradients against the padded forward,
the token-budget split of stapo.train.plan, and two trainer steps that must give the padded run's masks, loss
denominators and update."""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stapo.config import ConfigError, load_config  # noqa: E402
from stapo.model.models import build_tiny_model, load_tokenizer  # noqa: E402
from stapo.train.policy import collate_responses, forward_layout, layout_inputs, policy_token_stats  # noqa: E402
from stapo.rollout import Response  # noqa: E402
from stapo.train.plan import build_plan, micro_batch_tokens, token_budget_micro_batches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _resp(group, prompt, response):
    return Response(group=group, prompt_ids=prompt, response_ids=response, text="", engine_logprobs=None,
                    finish_reason="eos")


def _rows(micro):
    return [m.tolist() for m in micro]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded:smollm2")


def test_layouts_by_hand():
    # rows [5 6 7 | 9 2], [8 | 13 2 4], [4 4 | ] (empty response); '|' between prompt and response
    batch = collate_responses([_resp(0, [5, 6, 7], [9, 2]), _resp(1, [8], [13, 2, 4]), _resp(2, [4, 4], [])], 0)
    packed = layout_inputs(batch, "packed")
    assert packed.input_ids.tolist() == [[5, 6, 7, 9, 2, 8, 13, 2, 4, 4, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]]
    # token 9 is predicted by the output at 2 (the last prompt token), 2 by 3; 13, 2, 4 by 5, 6, 7
    assert packed.positions.tolist() == packed.keep_cols.tolist() == [2, 3, 5, 6, 7]
    assert packed.targets.tolist() == [9, 2, 13, 2, 4] and packed.kept.tolist() == [0, 1, 2, 3, 4]
    trailing = layout_inputs(batch, "trailing")
    assert trailing.input_ids.tolist() == [[5, 6, 7, 9, 2], [8, 13, 2, 4, 0], [4, 4, 0, 0, 0]]
    assert trailing.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    assert trailing.positions.tolist() == [2, 3, 5, 6, 7]  # row 1 starts at 1·L = 5
    assert trailing.keep_cols.tolist() == [0, 1, 2, 3]  # predicting columns 2, 3 (row 0) and 0, 1, 2 (row 1)
    assert trailing.kept.tolist() == [2, 3, 4, 5, 6]  # into [3 rows × 4 kept columns]
    out = packed.scatter(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert out.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0], [0.0, 0.0, 0.0]]
    # no response token at all: one dummy output keeps the forward, nothing is scattered
    empty = layout_inputs(batch.select([2]).trim(), "packed")
    assert empty.num_tokens == 0 and empty.positions.tolist() == [0]
    assert empty.scatter(torch.tensor([7.0])).tolist() == [[0.0]]
    with pytest.raises(ValueError, match="'trailing' or 'packed', got 'padded'"):
        layout_inputs(batch, "padded")
    # the layout per attention implementation
    assert forward_layout(False, "flash_attention_2") == "padded"
    assert forward_layout(True, "flash_attention_2") == forward_layout(True, "flash_attention_3") == "packed"
    assert forward_layout(True, "sdpa") == forward_layout(True, "eager") == "trailing"


@pytest.mark.parametrize("lm_head", ["logits", "fused"])
def test_padding_free_layouts_give_the_padded_statistics_and_gradients(tok, lm_head):
    """Rows of different prompt / response lengths (one without response): trailing padding and packing give the
    padded forward's [B, R] log p, entropy and Σπ² and its parameter gradients up to float rounding, with the model's
    LM head and with the fused one; SDPA sees no mask with trailing padding (its is_causal / flash path) and the
    dense block-diagonal mask transformers builds from the restarting position ids when packed."""
    model, _ = build_tiny_model(init_std=0.3, vocab_padding=7, tokenizer=tok)
    g = torch.Generator().manual_seed(3)
    responses = []
    for i, (plen, rlen) in enumerate([(3, 5), (9, 2), (1, 7), (6, 6), (4, 0)]):
        ids = torch.randint(3, len(tok), (plen + rlen,), generator=g).tolist()
        responses.append(_resp(i, ids[:plen], ids[plen:]))
    batch = collate_responses(responses, pad_token_id=tok.pad_token_id)
    masks = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    out = {}
    for layout in ("padded", "trailing", "packed"):
        model.zero_grad()
        st = policy_token_stats(model, batch, temperature=0.7, backend="eager", lm_head=lm_head, layout=layout,
                                entropy_grad=True)
        (st.logprobs.sum() + 0.5 * st.entropy.sum()).backward()
        out[layout] = (st, {n: p.grad.clone() for n, p in model.named_parameters()})
    padded_mask, trailing_mask, packed_mask = masks
    assert padded_mask is not None and trailing_mask is None
    assert packed_mask.shape == (1, 1, 43, 43)  # T = 8 + 11 + 8 + 12 + 4 tokens
    assert bool(packed_mask[0, 0, 9, 8]) and not bool(packed_mask[0, 0, 9, 7])  # row 1 (from 8) never sees row 0
    ref, ref_grads = out["padded"]
    for layout in ("trailing", "packed"):
        st, grads = out[layout]
        for f in ("logprobs", "entropy", "collision"):
            assert getattr(st, f).shape == (5, 7)
            # attention over other shapes: fp32 rounding of O(10) log-probs (seen ≤ 1e-5)
            torch.testing.assert_close(getattr(st, f), getattr(ref, f), atol=5e-5, rtol=0, msg=f"{layout} {f}")
        assert torch.all(st.logprobs[4] == 0) and torch.all(st.logprobs[1, 2:] == 0)  # off the response tokens
        for n, gr in ref_grads.items():  # seen ≤ 2e-6 of each gradient's scale
            torch.testing.assert_close(grads[n], gr, atol=2e-5 * float(gr.abs().max()) + 1e-7, rtol=0,
                                       msg=f"{layout} {n}")
    with pytest.raises(ValueError, match="share_prompt needs the padded layout"):
        policy_token_stats(model, batch, 1.0, share_prompt=True, layout="packed")


def test_token_budget_micro_batches_by_hand_and_within_the_budget():
    lengths, rows = torch.tensor([3, 5, 4, 5]), torch.arange(4)
    # packed: Σ tokens ≤ 10 → 5 + 5 | 4 + 3; trailing: rows × longest ≤ 10 → 2 × 5 | 2 × 4
    assert _rows(token_budget_micro_batches(lengths, rows, 10, layout="packed")) == [[1, 3], [2, 0]]
    assert _rows(token_budget_micro_batches(lengths, rows, 10, layout="trailing")) == [[1, 3], [2, 0]]
    # 3 micro-batches (another rank needs 3): balanced, largest first
    assert _rows(token_budget_micro_batches(lengths, rows, 10, layout="trailing", count=3)) == [[2, 0], [1], [3]]
    assert _rows(token_budget_micro_batches(lengths, rows, 10, layout="packed", count=3)) == [[2, 0], [1], [3]]
    # padded: rows × (longest prompt + longest response); rows 1, 2 = prompts 4, 1 + responses 1, 3 → 2 × (4 + 3)
    prompts = torch.tensor([1, 4, 1, 1])
    assert micro_batch_tokens(lengths, torch.tensor([1, 2]), "padded", prompts) == 14
    assert micro_batch_tokens(lengths, torch.tensor([1, 2]), "trailing") == 10
    assert micro_batch_tokens(lengths, torch.tensor([1, 2]), "packed") == 9
    # a row longer than the budget gets its own micro-batch
    assert _rows(token_budget_micro_batches(lengths, rows, 4, layout="packed")) == [[1], [3], [2], [0]]
    rnd = random.Random(0)
    for _ in range(200):  # every row once, count honoured, each micro-batch within the budget (or one row)
        B = rnd.randint(1, 24)
        lengths = torch.tensor([rnd.randint(2, 60) for _ in range(B)])
        prompts = torch.tensor([rnd.randint(1, int(n) - 1) for n in lengths])
        rows = torch.tensor(sorted(rnd.sample(range(B), rnd.randint(1, B))))
        budget = rnd.randint(1, 200)
        for layout in ("packed", "trailing", "padded"):
            least = len(token_budget_micro_batches(lengths, rows, budget, layout=layout, prompt_lengths=prompts))
            count = rnd.randint(least, len(rows) + 2)
            micro = token_budget_micro_batches(lengths, rows, budget, layout=layout, prompt_lengths=prompts,
                                               count=count)
            assert len(micro) == min(count, len(rows))
            assert sorted(r for m in micro for r in m.tolist()) == rows.tolist()
            assert all(len(m) == 1 or micro_batch_tokens(lengths, m, layout, prompts) <= budget for m in micro)


def test_build_plan_with_a_token_budget_runs_the_same_number_of_forwards_on_every_rank():
    """Two ranks with different row lengths: their local splits differ; with the counts agreed (the max, as the
    trainer's all-reduce does under FSDP2) every pass has as many micro-batches on both, each within the budget."""
    adv = torch.tensor([1.0, -1.0] * 4)
    lengths = {0: torch.tensor([30, 2, 3, 2, 28, 29, 3, 2]), 1: torch.tensor([3, 2, 3, 2, 2, 3, 2, 3])}
    kw = dict(mini_batch_rows=4, micro_batch_size=2, token_mask="s2t", fused_forward=True, has_reference=True,
              keep_all_graphs=True, token_budget=32, layout="packed")

    def passes(plan):
        return [plan.old_pass, plan.ref_pass] + [tuple(m.rows for m in mb.forwards) + mb.stats_pass
                                                 for mb in plan.minibatches]

    local = {r: build_plan(lengths[r], adv, **kw) for r in (0, 1)}
    seen = {}
    for r in (0, 1):  # each rank's local counts of every pass (what it hands the all-reduce) ...
        build_plan(lengths[r], adv, **kw, sync_counts=lambda c, r=r: seen.setdefault(r, c))
    top = [max(a, b) for a, b in zip(seen[0], seen[1])]  # ... and the element-wise max it returns
    assert seen[0] != seen[1]  # the ranks would disagree without the sync
    plans = {r: build_plan(lengths[r], adv, **kw, sync_counts=lambda c: top) for r in (0, 1)}
    assert [len(p) for p in passes(plans[0])] == [len(p) for p in passes(plans[1])]
    assert plans[0].num_forwards == plans[1].num_forwards > local[1].num_forwards
    for r, plan in plans.items():
        for p in passes(plan):
            assert all(micro_batch_tokens(lengths[r], m, "packed") <= 32 for m in p)
        assert sorted(x for m in plan.old_pass for x in m.tolist()) == list(range(4, 8))  # fused: mini-batch 0 fills
        assert sorted(x for m in plan.ref_pass for x in m.tolist()) == list(range(8))


def _sync_worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        from stapo.model.distributed import DistContext
        from stapo.train.plan import max_over_ranks

        # rank 0's long rows need more micro-batches of 32 tokens than rank 1's short ones
        lengths = torch.tensor([30, 2, 3, 2, 28, 29, 3, 2]) if rank == 0 else torch.tensor([3, 2, 3, 2, 2, 3, 2, 3])
        plan = build_plan(lengths, torch.tensor([1.0, -1.0] * 4), mini_batch_rows=4, micro_batch_size=2,
                          token_mask="s2t", keep_all_graphs=True, token_budget=32, layout="packed",
                          sync_counts=max_over_ranks(DistContext(world=2, rank=rank, strategy="fsdp2")))
        counts = [len(plan.old_pass)] + [len(mb.forwards) for mb in plan.minibatches]
        torch.save((counts, [m.tolist() for m in plan.old_pass]), os.path.join(out_dir, f"sync{rank}.pt"))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # 2 spawned processes (~8 s idle); the simulated ranks above cover the plan in the default suite
def test_max_over_ranks_on_two_gloo_ranks(tmp_path):
    """The trainer's sync_counts under FSDP2 (one all-reduce): both ranks plan as many micro-batches per pass."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sync_worker, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0
    (c0, old0), (c1, old1) = (torch.load(tmp_path / f"sync{r}.pt") for r in (0, 1))
    # rank 0 alone (first fit, longest first): old pass 30 + 2 | 29 + 3 | 28 + 3 | 2 + 2, mini-batch 0 30 + 2 | 3 + 2,
    # mini-batch 1 29 + 3 | 28 + 2; rank 1 alone: one micro-batch each (≤ 20 tokens)
    assert c0 == c1 == [4, 2, 2] and old0 == [[0, 1], [5, 2], [4, 6], [3, 7]]
    assert sorted(r for m in old1 for r in m) == list(range(8)) and all(m for m in old1)


def test_config_refuses_share_prompt_with_packing_and_a_budget_below_the_longest_row():
    base = REPO / "configs" / "tiny_test.yaml"
    with pytest.raises(ConfigError, match="'actor.share_prompt'.*use_remove_padding"):
        load_config(base, ["actor.share_prompt=true", "actor.use_remove_padding=true"])
    with pytest.raises(ConfigError, match=r"'actor.ppo_max_token_len_per_gpu' \(71\).*\(72\)"):
        load_config(base, ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=71"])  # 64 + 8 tokens
    cfg = load_config(base, ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=72"])
    assert cfg.actor.use_dynamic_bsz and not cfg.actor.use_remove_padding  # defaults: padded, fixed rows


def test_padding_free_token_budget_steps_give_the_padded_masks_denominators_and_update(tmp_path, monkeypatch):
    """A trainer step of two mini-batches (the second's mask reads the current policy, after the first's optimizer
    step) with the default padded, fixed-row micro-batches, with trailing padding + a token budget, and packed + a
    token budget + the fused forward path (its deferred rows) + the fused LM head: the same kept-token denominators
    (computed from the mask alone), the same masks and metrics, and the same weights up to float rounding."""
    import stapo.train.update as update

    denoms: list[float] = []
    inner = update.minibatch_loss_denominator
    monkeypatch.setattr(update, "minibatch_loss_denominator",
                        lambda *a, **k: denoms.append(inner(*a, **k)) or denoms[-1])
    budget = ["actor.use_remove_padding=true", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=150"]
    variants = {"padded": [], "trailing": budget,
                "packed": [*budget, "actor.fused_forward=true", "actor.lm_head=fused"]}
    runs = {}
    for name, overrides in variants.items():
        denoms.clear()
        t = make_trainer(str(tmp_path / name), ["trainer.save_every=0", "trainer.total_steps=1", *overrides])
        if name == "packed":  # forward_layout picks packing for flash_attention_2 only; the tiny model runs sdpa
            t.updater.layout = "packed"
        sizes = []
        forward = t.updater.forward
        t.updater.forward = lambda batch, idx, model=None: sizes.append(len(idx)) or forward(batch, idx, model)
        history = t.train()
        runs[name] = (history, list(denoms), sizes, {k: v.detach().clone() for k, v in t.model.named_parameters()})
    h0, d0, s0, p0 = runs["padded"]
    assert max(s0) == 3 and h0[0]["actor/s2t/num_masked"] > 0  # micro-batches of ≤ 3 rows; the mask works
    for name in ("trailing", "packed"):
        h1, d1, s1, p1 = runs[name]
        assert d1 == d0 and len(d0) == 2  # one denominator per mini-batch, unchanged by the layout
        assert max(s1) > 3  # the budget (150 tokens ≥ 2 rows of ≤ 72) regroups the rows
        for m0, m1 in zip(h0, h1):
            for k in m0:
                if not k.startswith(("timing_s/", "perf/")):
                    assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-5, nan_ok=True), (name, k)
        for k in p0:  # see tests/test_trainer.py::test_fused_forward_gives_the_same_masks_loss_and_update
            torch.testing.assert_close(p1[k], p0[k], rtol=1e-4, atol=5e-5, msg=f"{name} {k}")


@pytest.mark.slow  # `pytest -m slow`: a 2-rank torchrun (~20 s on idle cores)
def test_two_fsdp2_ranks_with_packing_and_a_token_budget_match_one_process(tmp_path):
    """FSDP2 (every forward a collective) with trailing padding and a token budget: the ranks' different row
    lengths give different local micro-batch counts, the trainer's all-reduce makes them equal (a mismatch would
    hang the run), and the 2-rank run matches one process of the same global batch."""
    from test_distributed import COMMON, _assert_same_metrics, _rows as _metric_rows, _torchrun, _train_one_thread

    flags = ["actor.use_remove_padding=true", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=80"]
    _torchrun(tmp_path / "fsdp2", "trainer.data_parallel=fsdp2", *flags)
    _train_one_thread(make_trainer(str(tmp_path / "one"), [*COMMON, *flags], uneven_reward=True))
    _assert_same_metrics(_metric_rows(tmp_path / "fsdp2"), _metric_rows(tmp_path / "one"))

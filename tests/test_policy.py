"""stapo.train.policy: collation of responses, batch slicing, and trainer-side log-probs / entropies.

References are independent of the code under test: tensors written out by hand for the collation, and a
plain unpadded forward of each sequence followed by a float64 log-softmax for the statistics.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stapo.model.models import build_tiny_model, load_tokenizer, set_constant_logits  # noqa: E402
from stapo.train.policy import RolloutBatch, collate_responses, policy_token_stats  # noqa: E402
from stapo.rollout import Response  # noqa: E402

N = 49152
PAD = 0


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded:smollm2")


def _resp(group, prompt, response, finish="eos"):
    return Response(group=group, prompt_ids=prompt, response_ids=response, text="", engine_logprobs=None,
                    finish_reason=finish)


RESPONSES = [_resp(0, [5, 6, 7], [9, 2]), _resp(0, [5, 6, 7], [10, 11, 12], "length"), _resp(1, [8], [13, 2])]


def test_collate_layout_by_hand():
    b = collate_responses(RESPONSES, pad_token_id=PAD)
    assert b.prompt_width == 3 and len(b) == 3
    assert b.input_ids.tolist() == [[5, 6, 7, 9, 2, 0],
                                    [5, 6, 7, 10, 11, 12],
                                    [0, 0, 8, 13, 2, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0],
                                         [1, 1, 1, 1, 1, 1],
                                         [0, 0, 1, 1, 1, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4],
                                       [0, 1, 2, 3, 4, 5],
                                       [0, 0, 0, 1, 2, 2]]
    assert b.response_ids.tolist() == [[9, 2, 0], [10, 11, 12], [13, 2, 0]]
    assert b.response_mask.tolist() == [[True, True, False], [True, True, True], [True, True, False]]
    assert b.input_ids.dtype == torch.long and b.response_mask.dtype == torch.bool


def test_select_to_and_trim():
    b = collate_responses(RESPONSES, pad_token_id=PAD)
    s = b.select(torch.tensor([2, 0]))
    assert s.input_ids.tolist() == [[0, 0, 8, 13, 2, 0], [5, 6, 7, 9, 2, 0]]
    assert s.response_mask.tolist() == [[True, True, False], [True, True, False]]
    assert b.select([1]).response_ids.tolist() == [[10, 11, 12]]
    assert b.select(slice(0, 1)).input_ids.tolist() == [[5, 6, 7, 9, 2, 0]]
    with pytest.raises(TypeError, match="integer row indices"):
        b.select(torch.tensor([True, False, True]))
    # rows 2 alone: two all-padding prompt columns on the left, one response column on the right
    t = b.select([2]).trim()
    assert t.input_ids.tolist() == [[8, 13, 2]] and t.position_ids.tolist() == [[0, 1, 2]]
    assert t.response_ids.tolist() == [[13, 2]] and t.prompt_width == 1
    assert b.trim().input_ids.shape == b.input_ids.shape  # nothing to drop
    assert b.to("cpu").input_ids.device.type == "cpu"
    with pytest.raises(ValueError, match="no responses"):
        collate_responses([], PAD)
    with pytest.raises(ValueError, match="empty prompt"):
        collate_responses([_resp(0, [], [1])], PAD)


def _reference_stats(model, prompt, response, temperature):
    """Unpadded forward of one sequence; float64 log-softmax of logits / T → (logp [n], entropy [n])."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()  # [P+n, V]
    pred = logits[len(prompt) - 1:len(prompt) - 1 + len(response)] / temperature  # [n, V]
    logp_all = torch.log_softmax(pred, dim=-1)
    logp = logp_all.gather(1, torch.tensor(response)[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    collision = (logp_all.exp() ** 2).sum(-1)
    return logp, entropy, collision


def test_left_padded_batch_matches_each_sequence_alone(tok):
    model, _ = build_tiny_model(init_std=0.3, tokenizer=tok)
    g = torch.Generator().manual_seed(0)
    responses = []
    for i, (plen, rlen) in enumerate([(3, 5), (9, 2), (1, 7), (6, 6)]):  # different prompt/response lengths
        ids = torch.randint(3, N, (plen + rlen,), generator=g).tolist()
        responses.append(_resp(i, ids[:plen], ids[plen:]))
    batch = collate_responses(responses, pad_token_id=tok.pad_token_id)
    st = policy_token_stats(model, batch, temperature=0.7, backend="eager")
    assert st.logprobs.shape == st.entropy.shape == st.collision.shape == (4, 7)
    assert st.logprobs.dtype == torch.float32
    for i, r in enumerate(responses):
        logp, ent, coll = _reference_stats(model, r.prompt_ids, r.response_ids, 0.7)
        n = len(r.response_ids)
        torch.testing.assert_close(st.logprobs[i, :n].double(), logp, atol=1e-4, rtol=0)
        torch.testing.assert_close(st.entropy[i, :n].double(), ent, atol=1e-4, rtol=0)
        torch.testing.assert_close(st.collision[i, :n].double(), coll, atol=1e-6, rtol=1e-4)
        assert torch.all(st.logprobs[i, n:] == 0) and torch.all(st.entropy[i, n:] == 0)
    # a micro-batch slice (select + trim) gives the same numbers as the full batch
    sub = policy_token_stats(model, batch.select([3, 1]).trim(), temperature=0.7, backend="eager")
    torch.testing.assert_close(sub.logprobs[0, :6], st.logprobs[3, :6], atol=1e-5, rtol=0)
    torch.testing.assert_close(sub.logprobs[1, :2], st.logprobs[1, :2], atol=1e-5, rtol=0)


def test_gradient_reaches_the_parameters_only_through_response_tokens(tok):
    model, _ = build_tiny_model(tokenizer=tok)
    batch = collate_responses(RESPONSES, pad_token_id=tok.pad_token_id)
    st = policy_token_stats(model, batch, temperature=1.0, backend="eager")
    assert st.logprobs.requires_grad and not st.entropy.requires_grad
    st.logprobs.sum().backward()
    assert model.lm_head.weight.grad is not None
    # the gradient of Σ log p w.r.t. the LM head touches the rows of the targets (1 − p) and all rows (−p)
    g = model.lm_head.weight.grad
    targets = {9, 2, 10, 11, 12, 13}
    assert all(float(g[t].norm()) > float(g[100].norm()) for t in targets)


def test_padded_vocabulary_is_left_out_of_the_softmax(tok):
    # every position predicts: real ids logit 0, the 3·N padded rows logit 5
    model, _ = build_tiny_model(vocab_padding=3 * N, tokenizer=tok)
    set_constant_logits(model, torch.cat([torch.zeros(N), torch.full((3 * N,), 5.0)]))
    assert model.config.stapo_vocab_size == N
    batch = collate_responses(RESPONSES, pad_token_id=tok.pad_token_id)
    st = policy_token_stats(model, batch, temperature=1.0, backend="eager")
    m = batch.response_mask
    # uniform over the N real ids: log p = −ln N, H = ln N, Σπ² = 1/N
    torch.testing.assert_close(st.logprobs[m], torch.full((int(m.sum()),), -math.log(N)), atol=1e-4, rtol=0)
    torch.testing.assert_close(st.entropy[m], torch.full((int(m.sum()),), math.log(N)), atol=1e-4, rtol=0)
    torch.testing.assert_close(st.collision[m], torch.full((int(m.sum()),), 1 / N), atol=0, rtol=1e-3)
    # with the padded rows included (vocab_size = all rows) the same token has log p = −ln(N + 3N·e⁵)
    full = policy_token_stats(model, batch, temperature=1.0, backend="eager", vocab_size=4 * N)
    torch.testing.assert_close(full.logprobs[m], torch.full((int(m.sum()),), -math.log(N + 3 * N * math.exp(5))),
                               atol=1e-4, rtol=0)


def test_rolloutbatch_is_a_dataclass_with_the_trainer_fields():
    import dataclasses

    names = [f.name for f in dataclasses.fields(RolloutBatch)]
    assert names == ["input_ids", "attention_mask", "position_ids", "response_ids", "response_mask"]


def test_shared_prompt_forward_matches_each_sequence_alone_and_the_plain_gradient(tok):
    """share_prompt=True: 2 distinct prompts × 3 responses (one of length 1) give each row's stand-alone
    log-probs/entropies, and Σ log p has the plain forward's gradient (the prompt's gradient sums over its rows)."""
    model, _ = build_tiny_model(init_std=0.3, tokenizer=tok)
    g = torch.Generator().manual_seed(1)
    responses = []
    for grp, plen in enumerate([4, 7]):
        prompt = torch.randint(3, N, (plen,), generator=g).tolist()
        for rlen in (1, 5, 3):
            responses.append(_resp(grp, prompt, torch.randint(3, N, (rlen,), generator=g).tolist()))
    batch = collate_responses(responses, pad_token_id=tok.pad_token_id)
    shared = policy_token_stats(model, batch, temperature=0.7, backend="eager", share_prompt=True)
    for i, r in enumerate(responses):
        logp, ent, _ = _reference_stats(model, r.prompt_ids, r.response_ids, 0.7)
        n = len(r.response_ids)
        torch.testing.assert_close(shared.logprobs[i, :n].double(), logp, atol=1e-4, rtol=0)
        torch.testing.assert_close(shared.entropy[i, :n].double(), ent, atol=1e-4, rtol=0)
        assert torch.all(shared.logprobs[i, n:] == 0)
    shared.logprobs.sum().backward()
    g_shared = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    policy_token_stats(model, batch, temperature=0.7, backend="eager").logprobs.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(g_shared[n], p.grad, atol=1e-4, rtol=1e-3, msg=n)
    # every response of length 1 (R = 1: the prompt pass alone) and rows with distinct prompts (nothing shared)
    ones = collate_responses([responses[0], responses[3]], pad_token_id=tok.pad_token_id)
    st1 = policy_token_stats(model, ones, temperature=0.7, backend="eager", share_prompt=True)
    torch.testing.assert_close(st1.logprobs[:, 0], shared.logprobs[[0, 3], 0], atol=1e-5, rtol=0)
    distinct = collate_responses([responses[1], responses[4]], pad_token_id=tok.pad_token_id)
    st2 = policy_token_stats(model, distinct, temperature=0.7, backend="eager", share_prompt=True)
    torch.testing.assert_close(st2.logprobs[0, :5], shared.logprobs[1, :5], atol=1e-5, rtol=0)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_fused_lm_head_matches_the_logits_path_values_and_gradients(tok, share_prompt):
    """actor.lm_head=fused: the same log-probs / entropies / collisions and the same parameter gradients
    (the output embedding's included) as the model's own LM head + token_stats, on a model with 7 padded
    vocabulary rows (whose weights get no gradient), at T = 0.7."""
    model, _ = build_tiny_model(init_std=0.3, vocab_padding=7, tokenizer=tok)
    g = torch.Generator().manual_seed(2)
    responses = []
    for grp, plen in enumerate([4, 6]):
        prompt = torch.randint(3, N, (plen,), generator=g).tolist()
        for rlen in (2, 5):
            responses.append(_resp(grp, prompt, torch.randint(3, N, (rlen,), generator=g).tolist()))
    batch = collate_responses(responses, pad_token_id=tok.pad_token_id)
    grads = {}
    stats = {}
    for head in ("logits", "fused"):
        model.zero_grad()
        st = policy_token_stats(model, batch, temperature=0.7, backend="eager", share_prompt=share_prompt,
                                lm_head=head, entropy_grad=True)
        (st.logprobs.sum() + 0.5 * st.entropy.sum()).backward()
        stats[head] = st
        grads[head] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for f in ("logprobs", "entropy", "collision"):
        torch.testing.assert_close(getattr(stats["fused"], f), getattr(stats["logits"], f), atol=2e-6, rtol=0,
                                   msg=f)
    for n, gl in grads["logits"].items():  # fp32 rounding of sums over ~50k vocabulary rows: ~2e-6 of the scale
        torch.testing.assert_close(grads["fused"][n], gl, atol=1e-5 * float(gl.abs().max()) + 1e-7, rtol=1e-4, msg=n)
    head_w = model.get_output_embeddings().weight
    name = next(n for n, p in model.named_parameters() if p is head_w)
    assert torch.all(grads["fused"][name][len(tok):] == 0)  # the padded rows never enter the softmax


def test_fused_lm_head_under_bf16_autocast_uses_bf16_logits(tok):
    """Under bf16 autocast (model.compute_dtype=bfloat16) the fused head's GEMMs run in bf16 like the model's
    own nn.Linear: the statistics agree with the logits path to fp32 rounding of the stats kernels."""
    model, _ = build_tiny_model(init_std=0.3, tokenizer=tok)
    batch = collate_responses(RESPONSES, pad_token_id=tok.pad_token_id)
    out = {}
    for head in ("logits", "fused"):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out[head] = policy_token_stats(model, batch, temperature=1.0, backend="eager", lm_head=head)
    torch.testing.assert_close(out["fused"].logprobs, out["logits"].logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["fused"].entropy, out["logits"].entropy, atol=1e-5, rtol=0)


def test_fused_lm_head_refuses_scaled_logits_and_unknown_modes(tok):
    model, _ = build_tiny_model(tokenizer=tok)
    batch = collate_responses(RESPONSES, pad_token_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="lm_head must be 'logits' or 'fused', got 'tiled'"):
        policy_token_stats(model, batch, 1.0, lm_head="tiled")
    model.config.final_logit_softcapping = 30.0  # Gemma-style soft-cap: logits are not hidden @ Wᵀ
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        policy_token_stats(model, batch, 1.0, lm_head="fused")

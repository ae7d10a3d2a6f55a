"""The verl plugin (stapo.integrations.verl) against verl's real registry and loss plumbing, on CPU.

verl is an optional dependency: these tests are skipped when it is not installed (install line in
stapo/integrations/verl.py's docstring / docs/scaling.md). Importing verl takes ~10 s of CPU; the tests themselves
take ~1-2 s. The launch script's dry run is tested in tests/test_verl_launch_check.py.
"""
from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("verl", reason="verl is not installed (pip install --no-deps verl==0.9.1 + deps, see docs/scaling.md)")
pytest.importorskip("ray", reason="verl needs ray to import")

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

import stapo.integrations.verl as plugin  # noqa: E402
from stapo.core.minibatch import minibatch_token_mask  # noqa: E402
from stapo.core.objectives import (  # noqa: E402
    OBJECTIVES, compute_token_mask, get_objective, loss_denominator, objective_loss, policy_loss)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _actor_config(loss_mode: str = "stapo", *, dp_size: int = 1, batch_num_tokens=None, **policy_loss) -> ActorConfig:
    """A real verl ActorConfig with the paper's clip values (docs/method.md#clipped-surrogate) and our policy-loss
    config."""
    cfg = ActorConfig(
        strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0,
        policy_loss=plugin.StapoPolicyLossConfig(loss_mode=loss_mode, **policy_loss))
    cfg.global_batch_info.update(dp_size=dp_size, batch_num_tokens=batch_num_tokens)
    return cfg


# --- hand-made tensors (B = 2 responses, T = 4) -----------------------------------------------------------
#   response 0: Â = +1, 4 tokens; response 1: Â = −1, 3 tokens (+1 padding)
#   p (current policy)  row 0: [0.5, 0.001, 0.0005, 0.0015]   row 1: [0.001, 0.3, 0.0001, pad]
#   H                   row 0: [1.0, 0.2,   0.4,    0.9   ]   row 1: [0.1,   2.0, 0.05,   pad]
#   ρ = p / p_old       row 0: [1.5, 1.0,   1.0,    1.0   ]   row 1: [1.1,   0.5, 20.0,   pad]
# S2T (τ_p = 0.002, q = 0.75 over the candidates):
#   candidates = Â > 0 and p < 0.002 = row 0, tokens 1, 2, 3 (row 1 has Â < 0) with H = [0.2, 0.4, 0.9]
#   τ_h = quantile_0.75([0.2, 0.4, 0.9]) = 0.4 + 0.5·(0.9 − 0.4) = 0.65 (linear interpolation, pos 1.5)
#   silenced = candidates with H < 0.65 = row 0 tokens 1 (H 0.2) and 2 (H 0.4); token 3 (H 0.9) kept
#   kept = row 0 {0, 3} + row 1 {0, 1, 2} → N = 5 (of 7 response tokens)
# per-token JustRL loss ℓ = max(−Âρ, −Â·clip(ρ, 0.8, 1.28)), capped at −c·Â = 10 for Â < 0:
#   r0t0: max(−1.5, −1.28) = −1.28 (clipped, no gradient)   r0t3: −1.0 (gradient −Âρ = −1)
#   r1t0: max(1.1, 1.1) = 1.1 (gradient +1.1)                r1t1: max(0.5, 0.8) = 0.8 (clipped)
#   r1t2: max(20, 1.28) = 20 → dual clip 10 (no gradient)
#   loss = (−1.28 − 1.0 + 1.1 + 0.8 + 10) / 5 = 9.62 / 5 = 1.924
#   ∂loss/∂log p = ℓ'·ρ/N: r0t3 −1/5 = −0.2, r1t0 +1.1/5 = 0.22, every other token 0 (silenced r0t1, r0t2 too)
P = torch.tensor([[0.5, 0.001, 0.0005, 0.0015], [0.001, 0.3, 0.0001, 0.5]], dtype=torch.float64)
H = torch.tensor([[1.0, 0.2, 0.4, 0.9], [0.1, 2.0, 0.05, 0.7]])
RHO = torch.tensor([[1.5, 1.0, 1.0, 1.0], [1.1, 0.5, 20.0, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True, True], [True, True, True, False]])
ADV = torch.tensor([[1.0] * 4, [-1.0] * 4])


def _hand_tensors():
    logp = P.log().float().requires_grad_(True)
    old = (P / RHO).log().float()
    return logp, old


def test_losses_are_registered_in_verls_registry():
    assert get_policy_loss_fn("stapo") is plugin.compute_policy_loss_stapo
    assert get_policy_loss_fn("entropy20") is plugin.compute_policy_loss_entropy20
    assert {"stapo", "entropy20", "vanilla"} <= set(POLICY_LOSS_REGISTRY)
    assert plugin.WORKER_HOOK_ERROR is None  # the TrainingWorker hook is installed
    from verl.workers.engine_workers import TrainingWorker
    assert getattr(TrainingWorker.train_batch, "_stapo_hook", False)


def test_stapo_on_hand_made_tensors_matches_our_objective_and_hand_values():
    logp, old = _hand_tensors()
    cfg = _actor_config(batch_num_tokens=int(MASK.sum()))
    with plugin.mask_context(entropy=H):
        loss, metrics = get_policy_loss_fn("stapo")(old, logp, ADV, MASK, "token-mean", cfg)
    loss.backward()
    grad = logp.grad.clone()

    logp_ref, old_ref = _hand_tensors()
    ref_loss, ref_metrics = objective_loss("stapo", logp_ref, old_ref, ADV, MASK, entropy=H)
    ref_loss.backward()

    assert loss.item() == pytest.approx(1.924, abs=1e-5)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    torch.testing.assert_close(grad, logp_ref.grad, rtol=0, atol=1e-6)
    expected = torch.zeros(2, 4)
    expected[0, 3], expected[1, 0] = -0.2, 0.22
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-5)
    assert metrics["actor/s2t/num_masked"] == 2.0 and metrics["actor/s2t/num_candidates"] == 3.0
    assert metrics["actor/s2t/entropy_threshold"] == pytest.approx(0.65, abs=1e-6)
    assert metrics["actor/num_kept_tokens"] == 5.0
    for k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
        assert metrics[k] == pytest.approx(ref_metrics[k], abs=1e-6)


def test_entropy20_matches_our_objective():
    # 7 response tokens → k = ceil(0.2·7) = 2: the two highest entropies, r1t1 (2.0) and r0t0 (1.0)
    logp, old = _hand_tensors()
    with plugin.mask_context(entropy=H):
        loss, metrics = get_policy_loss_fn("entropy20")(old, logp, ADV, MASK, "token-mean", _actor_config("entropy20"))
    loss.backward()
    logp_ref, old_ref = _hand_tensors()
    ref_loss, _ = objective_loss("entropy20", logp_ref, old_ref, ADV, MASK, entropy=H)
    ref_loss.backward()
    # r0t0: −1.28 (clipped), r1t1: 0.8 (clipped) → (−1.28 + 0.8) / 2 = −0.24, no gradient anywhere
    assert loss.item() == pytest.approx(-0.24, abs=1e-6)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    torch.testing.assert_close(logp.grad, logp_ref.grad, rtol=0, atol=1e-6)
    assert metrics["actor/top_entropy/num_kept"] == 2.0


ABLATIONS = ("stapo_high_entropy", "stapo_random", "justrl_fullmask")


def test_every_registered_objective_with_a_mask_token_mean_and_no_kl_is_a_loss_mode():
    """Generic registration: the paper's ablations are loss modes like stapo / entropy20, each its own function
    ``compute_policy_loss_<name>`` in verl's registry; justrl (no mask: verl's vanilla) and grpo (KL, seq-mean) not."""
    assert set(plugin.PLUGIN_LOSSES) == {"stapo", "entropy20", *ABLATIONS}
    for name in plugin.PLUGIN_LOSSES:
        fn = get_policy_loss_fn(name)
        assert fn is plugin.PLUGIN_LOSS_FNS[name] is getattr(plugin, f"compute_policy_loss_{name}")
        assert (fn.__module__, fn.__name__) == ("stapo.integrations.verl", f"compute_policy_loss_{name}")
        assert f"``{name}``" in fn.__doc__
    assert len(set(plugin.PLUGIN_LOSS_FNS.values())) == len(plugin.PLUGIN_LOSSES)
    assert "grpo" not in POLICY_LOSS_REGISTRY and "justrl" not in POLICY_LOSS_REGISTRY
    assert "seq-mean-token-mean" in plugin.plugin_loss_problem(get_objective("grpo"))
    assert "KL" in plugin.plugin_loss_problem(get_objective("stapo").replace(kl_coef=0.1))
    assert plugin.plugin_loss_problem(get_objective("justrl")) is None  # accepted when asked for explicitly


def test_an_objective_registered_later_becomes_a_loss_mode():
    from stapo.core.objectives import register_objective

    obj = register_objective(get_objective("stapo").replace(name="test_late_objective", clip_ratio_high=0.3))
    try:
        fn = plugin.register_plugin_loss("test_late_objective")
        assert get_policy_loss_fn("test_late_objective") is fn is plugin.compute_policy_loss_test_late_objective
        assert plugin.register_plugin_loss("test_late_objective") is fn  # idempotent
        cfg = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_c": 10.0,  # a dict works as the config
               "policy_loss": {"loss_mode": "test_late_objective"}, "global_batch_info": {"dp_size": 1}}
        assert plugin.objective_from_verl_config("test_late_objective", cfg) == obj
        logp, old = _hand_tensors()
        with plugin.mask_context(entropy=H):
            loss, metrics = fn(old, logp, ADV, MASK, "token-mean", cfg)
        assert loss.item() == pytest.approx(1.92, abs=1e-5)  # stapo's 1.924 with r0t0 clipped at 1.3: −1.3 − 1 + 11.9
        assert metrics["actor/num_kept_tokens"] == 5.0
    finally:
        OBJECTIVES.pop("test_late_objective")
        POLICY_LOSS_REGISTRY.pop("test_late_objective", None)
        plugin.PLUGIN_LOSSES.pop("test_late_objective", None)
        plugin.PLUGIN_LOSS_FNS.pop("test_late_objective", None)
        vars(plugin).pop("compute_policy_loss_test_late_objective", None)
    with pytest.raises(ValueError, match="cannot be a verl plugin loss: its aggregation"):
        plugin.register_plugin_loss("grpo")
    with pytest.raises(KeyError):
        plugin.register_plugin_loss("no_such_objective")
    register_objective(get_objective("stapo").replace(name="vanilla"))
    try:
        with pytest.raises(ValueError, match="verl's own"):
            plugin.register_plugin_loss("vanilla")
    finally:
        OBJECTIVES.pop("vanilla")
    assert get_policy_loss_fn("vanilla").__module__ == "verl.trainer.ppo.core_algos"


# The ablations on the hand-made tensors (candidates: row 0, tokens 1, 2, 3 with H = [0.2, 0.4, 0.9]):
#   stapo_high_entropy: τ = quantile_0.25([0.2, 0.4, 0.9]) = 0.2 + 0.5·0.2 = 0.3 → silences H > 0.3 = tokens 2, 3;
#     kept r0 {0, 1} + r1 {0, 1, 2}: (−1.28 − 1.0 + 1.1 + 0.8 + 10) / 5 = 1.924; grad r0t1 −1/5, r1t0 1.1/5
#   stapo_random: 2 of the 3 candidates (S2T's count), by the seeded draw; the kept one has ℓ = −1 whichever it is
#     → 1.924 too; grad −0.2 at the kept candidate, 0.22 at r1t0
#   justrl_fullmask: silences all 3 candidates; kept r0 {0} + r1 {0, 1, 2}: (−1.28 + 1.1 + 0.8 + 10) / 4 = 2.655;
#     grad r1t0 1.1/4 = 0.275
HAND_ABLATIONS = {"stapo_high_entropy": (1.924, 5), "stapo_random": (1.924, 5), "justrl_fullmask": (2.655, 4)}


@pytest.mark.parametrize("loss_mode", ["stapo", "entropy20", *ABLATIONS])
def test_plugin_loss_equals_our_policy_loss_over_compute_token_mask(loss_mode):
    """Every plugin loss mode on the hand-made batch: the registered verl loss (mask computed from
    mask_context(entropy=...)) = stapo.core.objectives.policy_loss over compute_token_mask's keep-mask, denominator
    N."""
    cfg = _actor_config(loss_mode, batch_num_tokens=int(MASK.sum()))
    obj = plugin.objective_from_verl_config(loss_mode, cfg)
    assert obj == get_objective(loss_mode)  # the paper's clip values, the default mask parameters
    logp, old = _hand_tensors()
    with plugin.mask_context(entropy=H):
        loss, metrics = get_policy_loss_fn(loss_mode)(old, logp, ADV, MASK, "token-mean", cfg)
    loss.backward()

    logp_ref, old_ref = _hand_tensors()
    tm = compute_token_mask(obj, logp_ref.detach(), H, ADV, MASK)
    ref_loss, ref_metrics = policy_loss(obj, logp_ref, old_ref, ADV, tm.keep,
                                        loss_denominator(tm.keep, obj.loss_agg_mode))
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    torch.testing.assert_close(logp.grad, logp_ref.grad, rtol=0, atol=1e-6)
    for k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
        assert metrics[k] == pytest.approx(ref_metrics[k], abs=1e-6)
    assert metrics["actor/num_kept_tokens"] == float(tm.keep.sum())
    for k, v in tm.stats.items():  # the same keys as the native trainer's (actor/<mask prefix>/<stat>)
        if math.isfinite(v):
            assert metrics[k] == pytest.approx(v, abs=1e-6), k
    if loss_mode in HAND_ABLATIONS:
        want_loss, want_kept = HAND_ABLATIONS[loss_mode]
        assert loss.item() == pytest.approx(want_loss, abs=1e-5) and int(tm.keep.sum()) == want_kept
        assert tm.keep[1].tolist() == [True, True, True, False] and bool(tm.keep[0, 0])  # only candidates go
        expected = torch.zeros(2, 4)
        expected[1, 0] = 1.1 / want_kept
        if want_kept == 5:  # the one kept candidate (token 1 for high-entropy, the draw's for random)
            expected[0, int(tm.keep[0, 1:].nonzero()[0]) + 1] = -0.2
        torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-5)
    if loss_mode == "stapo_high_entropy":
        assert tm.keep[0].tolist() == [True, True, False, False]


def test_ablation_mask_parameters_reach_the_objective():
    cfg = _actor_config("stapo_random", s2t_random_seed=5, s2t_prob_threshold=0.01, s2t_entropy_quantile=0.8)
    assert plugin.objective_from_verl_config("stapo_random", cfg).mask_params == {
        "prob_threshold": 0.01, "entropy_quantile": 0.8, "quantile_scope": "candidates", "seed": 5}
    assert plugin.objective_from_verl_config("justrl_fullmask", _actor_config("justrl_fullmask", s2t_prob_threshold=0.01)
                                             ).mask_params == {"prob_threshold": 0.01}
    # every parameter of every plugin loss's mask has its field in StapoPolicyLossConfig
    from stapo.core.masks import MASKS
    fields = set(plugin.StapoPolicyLossConfig.__dataclass_fields__)
    for name in plugin.PLUGIN_LOSSES:
        for key in MASKS[get_objective(name).token_mask].config_keys.values():
            assert plugin.verl_param_key(key) in fields, (name, key)
    for name in ABLATIONS:
        obj = plugin.objective_of_verl_actor(_verl_actor(name, **JUSTRL_VERL))
        assert plugin.registered_objective_name(obj) == name


def test_precomputed_mask_split_into_micro_batches_and_dp_ranks_gives_the_whole_minibatch_loss():
    """The worker-hook path: keep from minibatch_token_mask, each call sees one row; Σ over calls (and the
    FSDP average over dp ranks of loss·dp_size) equals the whole-mini-batch loss and gradient."""
    obj = plugin.objective_from_verl_config("stapo", _actor_config())
    mb = minibatch_token_mask(obj, P.log().float(), H, ADV, MASK)
    assert mb.num_kept == 5 and mb.keep.tolist() == [[True, False, False, True], [True, True, True, False]]
    logp_ref, old_ref = _hand_tensors()
    ref_loss, _ = objective_loss("stapo", logp_ref, old_ref, ADV, MASK, entropy=H)
    ref_loss.backward()
    for dp_size in (1, 2):
        logp, old = _hand_tensors()
        cfg = _actor_config(dp_size=dp_size, batch_num_tokens=int(MASK.sum()))
        total, grad = 0.0, torch.zeros(2, 4)
        for row in (0, 1):  # one micro-batch (dp_size 1) or one rank (dp_size 2) per row
            lp = logp[row:row + 1]
            # token-mean over the whole mini-batch: the denominator is N = mb.num_kept (≥ 1 here)
            with plugin.mask_context(keep=mb.keep[row:row + 1], num_kept=mb.num_kept,
                                     denominator=float(mb.num_kept), stats=mb.stats):
                loss, _ = get_policy_loss_fn("stapo")(old[row:row + 1], lp, ADV[row:row + 1], MASK[row:row + 1],
                                                      "token-mean", cfg)
            (g,) = torch.autograd.grad(loss, logp)
            total += loss.item() / dp_size  # verl reports the dp-average of the per-rank sums
            grad += g / dp_size  # FSDP/DDP average the gradients over the dp ranks
        assert total == pytest.approx(ref_loss.item(), abs=1e-6)
        torch.testing.assert_close(grad, logp_ref.grad, rtol=0, atol=1e-6)


def test_minibatch_mask_over_ranks_equals_the_single_rank_mask():
    """Two ranks simulated by splitting the rows; the all-gather is replaced by the two shares in rank order
    (the real 2-process gloo all-gather is tested in tests/test_dp_mask.py)."""
    import stapo.core.minibatch as dp

    obj = plugin.objective_from_verl_config("stapo", _actor_config())
    full = minibatch_token_mask(obj, P.log().float(), H, ADV, MASK)
    shares = [(P.log().float()[r:r + 1], H[r:r + 1], ADV[r:r + 1], MASK[r:r + 1]) for r in (0, 1)]
    parts = [torch.stack([lp[m], h[m], a[m]]) for lp, h, a, m in shares]
    orig_gather, orig_world = dp.all_gather_varlen, dp.dist_world
    try:
        dp.all_gather_varlen = lambda x, group=None: parts
        for rank in (0, 1):
            dp.dist_world = lambda group=None, rank=rank: (2, rank)
            got = minibatch_token_mask(obj, *shares[rank], group=None)
            assert got.num_kept == full.num_kept
            assert torch.equal(got.keep, full.keep[rank:rank + 1])
            assert got.stats == full.stats
    finally:
        dp.all_gather_varlen, dp.dist_world = orig_gather, orig_world


def test_errors():
    logp, old = _hand_tensors()
    fn = get_policy_loss_fn("stapo")
    with pytest.raises(RuntimeError, match="mask_context"):
        fn(old, logp, ADV, MASK, "token-mean", _actor_config())
    with plugin.mask_context(entropy=H):  # this call sees 7 of 20 response tokens: needs the worker hook
        with pytest.raises(RuntimeError, match="whole mini-batch"):
            fn(old, logp, ADV, MASK, "token-mean", _actor_config(batch_num_tokens=20))
        with pytest.raises(RuntimeError, match="whole mini-batch"):
            fn(old, logp, ADV, MASK, "token-mean", _actor_config(dp_size=2))
        with pytest.raises(ValueError, match="token-mean"):
            fn(old, logp, ADV, MASK, "seq-mean-token-mean", _actor_config())
        with pytest.raises(NotImplementedError):
            fn(old, logp, ADV, MASK, "token-mean", _actor_config(), torch.ones(2, 4))
    with plugin.mask_context(keep=MASK[:1], num_kept=7, denominator=7.0):  # one row for a [2, 4] micro-batch
        with pytest.raises(ValueError, match=r"keep-mask shape \(1, 4\) != response_mask shape \(2, 4\)"):
            fn(old, logp, ADV, MASK, "token-mean", _actor_config())
    for partial in ({"keep": MASK}, {"keep": MASK, "num_kept": 7}, {"num_kept": 7, "denominator": 7.0}):
        with pytest.raises(ValueError, match="keep, num_kept and denominator go together"):
            with plugin.mask_context(**partial):
                pass


def test_policy_loss_config_parameters_reach_the_objective():
    obj = plugin.objective_from_verl_config(
        "stapo", _actor_config(s2t_prob_threshold=0.01, s2t_entropy_quantile=0.8, s2t_quantile_scope="all"))
    assert obj.mask_params == {"prob_threshold": 0.01, "entropy_quantile": 0.8, "quantile_scope": "all"}
    assert (obj.clip_ratio_low, obj.clip_ratio_high, obj.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert plugin.objective_from_verl_config("entropy20", _actor_config("entropy20", top_entropy_ratio=0.1)
                                             ).mask_params == {"ratio": 0.1}
    # a plain verl PolicyLossConfig (no _target_ override) falls back to the paper's parameters
    from verl.workers.config import PolicyLossConfig
    cfg = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2,
                      policy_loss=PolicyLossConfig(loss_mode="stapo"))
    with pytest.warns(UserWarning, match="clip"):  # verl's default clip 0.2/0.2/3 ≠ the paper's
        obj = plugin.objective_from_verl_config("stapo", cfg)
    assert obj.mask_params["prob_threshold"] == 0.002 and obj.mask_params["entropy_quantile"] == 0.75


def _verl_actor(loss_mode="vanilla", **kw) -> ActorConfig:
    """A real verl ActorConfig (verl's defaults for everything not given)."""
    pl = plugin.StapoPolicyLossConfig(loss_mode=loss_mode)
    return ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2, policy_loss=pl, **kw)


JUSTRL_VERL = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, loss_agg_mode="token-mean")
GRPO_VERL = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1e9, loss_agg_mode="seq-mean-token-mean",
                 use_kl_loss=True, kl_loss_coef=0.04, kl_loss_type="low_var_kl")


def test_verl_actor_settings_map_to_our_registered_objectives():
    """The launch script's four methods (scripts/verl/run_stapo_qwen3_1.7b.sh) are our four objectives."""
    name = plugin.registered_objective_name
    assert name(plugin.objective_of_verl_actor(_verl_actor("vanilla", **JUSTRL_VERL))) == "justrl"
    grpo = plugin.objective_of_verl_actor(_verl_actor("vanilla", **GRPO_VERL))
    # c = 1e9 > e^20 (verl's largest ratio): the dual clip never binds → our clip_ratio_c=None; β = 0.04
    assert (grpo.clip_ratio_c, grpo.kl_coef, grpo.loss_agg_mode) == (None, 0.04, "seq-mean-token-mean")
    assert name(grpo) == "grpo"
    assert name(plugin.objective_of_verl_actor(_verl_actor("stapo", **JUSTRL_VERL))) == "stapo"
    assert name(plugin.objective_of_verl_actor(_verl_actor("entropy20", **JUSTRL_VERL))) == "entropy20"
    # near misses are not the registered objectives
    assert name(plugin.objective_of_verl_actor(_verl_actor("vanilla", **{**GRPO_VERL, "clip_ratio_c": 1e5}))) is None
    assert name(plugin.objective_of_verl_actor(_verl_actor("vanilla", **{**GRPO_VERL, "kl_loss_coef": 0.001}))) is None
    assert name(plugin.objective_of_verl_actor(_verl_actor("vanilla"))) is None  # verl defaults: clip 0.2/0.2, c = 3


def test_verl_actor_settings_without_a_counterpart_raise():
    with pytest.raises(ValueError, match="kl_loss_type"):
        plugin.objective_of_verl_actor(_verl_actor("vanilla", **{**GRPO_VERL, "kl_loss_type": "kl"}))
    with pytest.raises(ValueError, match="use_kl_loss=False"):
        plugin.objective_of_verl_actor(_verl_actor("stapo", **JUSTRL_VERL, use_kl_loss=True))
    with pytest.raises(ValueError, match="token-mean"):
        plugin.objective_of_verl_actor(_verl_actor("stapo", **{**JUSTRL_VERL, "loss_agg_mode": "seq-mean-token-mean"}))
    with pytest.raises(ValueError, match="entropy_coeff"):
        plugin.objective_of_verl_actor(_verl_actor("vanilla", **JUSTRL_VERL, entropy_coeff=0.01))
    with pytest.raises(ValueError, match="token-sum"):
        plugin.objective_of_verl_actor(_verl_actor("vanilla", **{**JUSTRL_VERL, "loss_agg_mode": "token-sum"}))
    with pytest.raises(ValueError, match="gspo"):
        plugin.objective_of_verl_actor(_verl_actor("gspo", **JUSTRL_VERL))


# --- the worker hook, end to end through verl's ppo_loss, padding and micro-batch utilities -------------
V, D = 6, 4


class _PackedLM(torch.nn.Module):
    """A tiny causal "language model" that, like verl's remove-padding path, runs on ONE packed row of all the
    micro-batch's sequences and finds the sequence boundaries from position_ids (a new sequence starts where the
    position is 0, as transformers does for packed inputs): logits_t = (E[x_t] + P[pos_t] + mean_{s ≤ t, same
    sequence} E[x_s]) @ W. Every token's log p depends on its own sequence's prefix, so a wrong packing boundary
    or a row mix-up changes the result."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.E = torch.nn.Parameter(torch.randn(V, D, generator=g) * 2.0)
        self.P = torch.nn.Parameter(torch.randn(16, D, generator=g))
        self.W = torch.nn.Parameter(torch.randn(D, V, generator=g) * 2.0)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids, pos: [n] long (one packed row) → log-softmax [n, V]."""
        x = self.E[ids]  # [n, D]
        starts = pos == 0
        seg = torch.cumsum(starts.long(), 0) - 1  # sequence index of every token
        cs = torch.cat([torch.zeros(1, D), x.cumsum(0)])  # [n + 1, D] prefix sums of the packed row
        before = cs[torch.nonzero(starts).squeeze(-1)][seg]  # prefix sum before each token's sequence start
        ctx = (cs[1:] - before) / (pos + 1).float()[:, None]  # causal mean within the sequence
        return torch.log_softmax((x + self.P[pos] + ctx) @ self.W, dim=-1)


class _FakeEngine:
    """Stands in for verl's FSDP engine: forward_backward_batch mirrors fsdp/transformer_impl.py:724-777 (global
    token count, verl's own prepare_micro_batches — fixed-size, or dynamic with verl's rearrange_micro_batches
    reordering and packing — the loss per micro-batch, backward, verl's postprocess_batch_func restoring the order).
    Each micro-batch runs packed in one row (use_remove_padding=True, verl's input_ids_rmpad_rolled labels)."""

    def __init__(self, model: _PackedLM):
        self.model = model
        self.partitions: list = []  # the micro-batch index lists of every forward_backward_batch call

    @contextmanager
    def eval_mode(self, **kwargs):
        yield

    def get_data_parallel_group(self):
        return None

    def forward(self, mb):
        ids, pos = mb["input_ids"], mb["position_ids"]  # jagged [b, j]
        values, offsets = ids.values(), ids.offsets()
        labels = torch.roll(values, shifts=-1)  # next token of the packed row (verl's input_ids_rmpad_rolled)
        logp_all = self.model(values, pos.values())  # [total, V]
        out = {"log_probs": torch.nested.nested_tensor_from_jagged(
            logp_all.gather(-1, labels[:, None]).squeeze(-1), offsets)}
        if tu.get_non_tensor_data(mb, "calculate_entropy", False):
            ent = -(logp_all.exp() * logp_all).sum(-1)
            out["entropy"] = torch.nested.nested_tensor_from_jagged(ent, offsets)
        return out

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        tu.assign_non_tensor(data, batch_num_tokens=int(data["loss_mask"].sum()), dp_size=1)
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=True)
        self.partitions.append(indices)
        outputs = []
        for mb in micro_batches:
            with torch.no_grad() if forward_only else nullcontext():
                model_output = self.forward(mb)
                loss, metrics = (loss_function(model_output=model_output, data=mb, dp_group=None)
                                 if loss_function is not None else (torch.tensor(1.0), {}))
                if not forward_only:
                    loss.backward()
            outputs.append({"model_output": {k: v.detach() for k, v in model_output.items()},
                            "loss": loss.item(), "metrics": metrics})
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def infer_batch(self, data, loss_function=None):
        with torch.no_grad():
            return self.forward_backward_batch(data, loss_function, forward_only=True)


def _orig_train_batch(self, data):
    """The part of verl's TrainingWorker.train_batch (engine_workers.py:343-368) that the hook wraps."""
    defaults = dict(use_remove_padding=self.model_config.get("use_remove_padding", False),
                    use_dynamic_bsz=self.engine_config.use_dynamic_bsz,
                    max_token_len_per_gpu=self.engine_config.max_token_len_per_gpu,
                    micro_batch_size_per_gpu=self.engine_config.micro_batch_size_per_gpu,
                    use_fused_kernels=self.engine_config.use_fused_kernels)
    for key, val in defaults.items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: val})
    return self.engine.forward_backward_batch(data, loss_function=self.loss_fn)


def _minibatch(model, prompt_len, resp_len, adv, seed=3):
    """One mini-batch in verl's v0 layout (left-padded prompts, right-padded responses → no-padding TensorDict),
    with a per-sample ``uid`` field (0..B-1) that follows the rows through verl's micro-batch split."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    prompt_len, resp_len = torch.tensor(prompt_len), torch.tensor(resp_len)
    B, Pp, T = len(prompt_len), int(prompt_len.max()), int(resp_len.max())
    prompt_mask = torch.arange(Pp)[None, :] >= (Pp - prompt_len)[:, None]
    response_mask = torch.arange(T)[None, :] < resp_len[:, None]
    prompts = torch.randint(0, V, (B, Pp), generator=g) * prompt_mask
    responses = torch.randint(0, V, (B, T), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1).long()
    td = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": response_mask.long(), "advantages": torch.tensor(adv)[:, None] * response_mask,
        "uid": torch.arange(B),
    }, batch_size=[B])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, global_batch_size=B)
    with torch.no_grad():  # π_old: the current policy perturbed, so that ρ ≠ 1 and some clips fire
        logp = no_padding_2_padding(_FakeEngine(model).forward(td)["log_probs"], td)
    td["old_log_probs"] = (logp + torch.randn(B, T, generator=g) * 0.3) * response_mask
    return td


def _reference(model, td, obj):
    """Our objective on the whole mini-batch in one call, every sequence run on its own (no packing); returns
    (loss, metrics, keep [B, T], parameter gradients)."""
    model.zero_grad()
    logp_rows, ent_rows = [], []
    for i in range(td.batch_size[0]):
        row = tu.index_select_tensor_dict(td, [i])
        tu.assign_non_tensor(row, calculate_entropy=True)
        mo = _FakeEngine(model).forward(row)
        logp_rows.append(no_padding_2_padding(mo["log_probs"], row)[0])
        ent_rows.append(no_padding_2_padding(mo["entropy"], row)[0])
    T = td["response_mask"].shape[1]
    logp = torch.stack([F.pad(r, (0, T - r.shape[0])) for r in logp_rows])
    ent = torch.stack([F.pad(r, (0, T - r.shape[0])) for r in ent_rows])
    mask = td["response_mask"].bool()
    keep = compute_token_mask(obj, logp.detach(), ent.detach(), td["advantages"], mask).keep
    loss, metrics = objective_loss(obj, logp, td["old_log_probs"], td["advantages"], mask, entropy=ent.detach())
    loss.backward()
    return loss, metrics, keep, [p.grad.clone() for p in model.parameters()]


def _spy_ppo_loss(seen, config, model_output, data, dp_group=None):
    """verl's ppo_loss, recording which rows (uid) this micro-batch holds and the keep-mask its loss receives."""
    seen.append((data["uid"].tolist(), plugin.current_mask_context().keep.clone()))
    return ppo_loss(config, model_output, data, dp_group)


def _run_hook(model, data, cfg, *, use_dynamic_bsz, max_token_len_per_gpu=None, micro_batch_size_per_gpu=None):
    """The hooked train_batch on a fake worker; returns (output, parameter gradients, engine, seen)."""
    seen: list = []
    engine = _FakeEngine(model)
    worker = SimpleNamespace(engine=engine, loss_fn=partial(_spy_ppo_loss, seen, config=cfg),
                             model_config={"use_remove_padding": True},
                             engine_config=SimpleNamespace(use_dynamic_bsz=use_dynamic_bsz,
                                                           max_token_len_per_gpu=max_token_len_per_gpu,
                                                           micro_batch_size_per_gpu=micro_batch_size_per_gpu,
                                                           use_fused_kernels=False))
    model.zero_grad()
    out = plugin._wrap_train_batch(_orig_train_batch)(worker, data)
    assert plugin.KEEP_KEY not in data.keys() and worker.loss_fn.func is _spy_ppo_loss  # cleaned up
    assert tu.get(data, "calculate_entropy", None) is None  # the training pass is not switched to entropy
    return out, [p.grad.clone() for p in model.parameters()], engine, seen


def _check_against_reference(out, grads, seen, ref, loss_mode):
    ref_loss, ref_metrics, ref_keep, ref_grads = ref
    # mask positions: each micro-batch's keep rows, put back at their uid, are the whole-mini-batch mask
    keep = torch.zeros_like(ref_keep)
    for uids, k in seen:
        keep[uids] = k[:, :keep.shape[1]]
    assert sorted(u for uids, _ in seen for u in uids) == list(range(ref_keep.shape[0]))
    assert torch.equal(keep, ref_keep)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-6)
    assert math.isclose(sum(out["loss"]), ref_loss.item(), rel_tol=1e-5, abs_tol=1e-6)
    # the mask statistics (τ_h, counts, means of the silenced tokens' p / H / Â) are the whole mini-batch's; each
    # micro-batch reports them (a verl Metric, MEAN over the micro-batches)
    from stapo.core.masks import MASKS
    prefix = f"actor/{MASKS[get_objective(loss_mode).token_mask].prefix}/"  # actor/s2t/, actor/top_entropy/...
    # (non-finite statistics, e.g. full_low_prob's entropy_threshold = NaN, are not reported)
    stats = {k: v for k, v in ref_metrics.items() if k.startswith(prefix) and math.isfinite(v)}
    assert len(stats) >= 2
    for k, v in stats.items():
        reported = out["metrics"][k]
        assert len(reported.values) == len(seen)
        assert reported.aggregate() == pytest.approx(v, rel=1e-5, abs=1e-6), k


# τ_p = 0.2 so that the 6-token vocabulary has S2T candidates; q = 0.5
_MASK_PARAMS = dict(s2t_prob_threshold=0.2, s2t_entropy_quantile=0.5)


@pytest.mark.parametrize("loss_mode", ["stapo", "entropy20", *ABLATIONS])
def test_worker_hook_end_to_end_matches_our_objective(loss_mode):
    """Hook (extra no-grad pass, global mask, keep field carried through verl's micro-batch split) + verl's
    ppo_loss + registered loss, 2 fixed-size micro-batches, give the parameter gradient of our objective on the
    whole mini-batch in one call."""
    model = _PackedLM()
    args = ([3, 2, 3, 1], [5, 3, 4, 2], [1.0, -0.5, 0.8, 1.2])
    cfg = _actor_config(loss_mode, **_MASK_PARAMS)
    obj = plugin.objective_from_verl_config(loss_mode, cfg)
    out, grads, engine, seen = _run_hook(model, _minibatch(model, *args), cfg, use_dynamic_bsz=False,
                                         micro_batch_size_per_gpu=2)
    assert [uids for uids, _ in seen] == [[0, 1], [2, 3]]  # verl's fixed-size split: 2 in order
    ref = _reference(model, _minibatch(model, *args), obj)
    n_masked = 14 - int(ref[2].sum())
    assert 0 < n_masked < 14  # the mask really removes some of the 14 response tokens, not all
    _check_against_reference(out, grads, seen, ref, loss_mode)


@pytest.mark.parametrize("loss_mode", ["stapo", "entropy20"])
def test_worker_hook_with_dynamic_batch_size_reordered_packed_micro_batches(loss_mode):
    """use_dynamic_bsz=True (the paper recipe): verl's rearrange_micro_batches packs the 8 sequences of the
    mini-batch into token-budget micro-batches and REORDERS them (balanced partitions sorted by workload), for the
    hook's no-grad pass and for the update alike; postprocess_batch_func restores the order of the pass's outputs.
    The keep-mask each micro-batch's loss receives must sit at the right tokens (= the whole-mini-batch mask at
    the rows the micro-batch holds), and the summed loss and the gradient must be our objective on the whole
    mini-batch, computed without packing."""
    model = _PackedLM()
    prompt_len = [3, 2, 4, 1, 2, 3, 1, 4]
    resp_len = [6, 2, 5, 3, 7, 1, 4, 2]  # sequence lengths 9, 4, 9, 4, 9, 4, 5, 6 = 50 tokens
    adv = [1.0, 0.5, -0.8, 1.2, 1.0, -0.6, 0.3, 0.9]
    args = (prompt_len, resp_len, adv)
    cfg = _actor_config(loss_mode, **_MASK_PARAMS)
    obj = plugin.objective_from_verl_config(loss_mode, cfg)
    data = _minibatch(model, *args)
    out, grads, engine, seen = _run_hook(model, data, cfg, use_dynamic_bsz=True, max_token_len_per_gpu=14)

    # the hook's pass and the update were split alike, into packed (≥ 2 sequences, ≤ 14 tokens) micro-batches
    # whose order is not the rows' order
    infer_parts, train_parts = engine.partitions
    assert infer_parts == train_parts == [uids for uids, _ in seen]
    seq_len = [p + r for p, r in zip(prompt_len, resp_len)]
    assert len(train_parts) >= 4 and all(sum(seq_len[i] for i in part) <= 14 for part in train_parts)
    assert any(len(part) >= 2 for part in train_parts)
    assert [i for part in train_parts for i in part] != list(range(8))
    n_resp = sum(resp_len)
    ref = _reference(model, _minibatch(model, *args), obj)
    n_masked = (ref[1]["actor/s2t/num_masked"] if loss_mode == "stapo"
                else n_resp - ref[1]["actor/top_entropy/num_kept"])
    assert 0 < n_masked < n_resp
    _check_against_reference(out, grads, seen, ref, loss_mode)


def test_keep_mask_follows_a_jagged_response_mask():
    """v1 (TransferQueue) trainer layout: response fields are jagged; the keep field uses the same layout and
    the loss wrapper pads it exactly like ppo_loss pads response_mask."""
    from tensordict import TensorDict

    rm = torch.nested.as_nested_tensor([torch.ones(4, dtype=torch.long), torch.ones(3, dtype=torch.long)],
                                       layout=torch.jagged)
    keep_padded = torch.tensor([[True, False, False, True], [True, True, True, False]])
    keep = plugin._keep_in_layout_of(keep_padded, rm)
    assert keep.is_nested and [t.tolist() for t in keep.unbind()] == [[True, False, False, True], [True, True, True]]
    td = TensorDict({"response_mask": rm, plugin.KEEP_KEY: keep}, batch_size=[2])
    seen = {}

    def loss_fn(model_output, data, dp_group=None):
        ctx = plugin.current_mask_context()
        seen["keep"], seen["n"], seen["denominator"] = ctx.keep, ctx.num_kept, ctx.denominator
        return torch.tensor(0.0), {}

    plugin._loss_fn_with_mask(loss_fn, 5, 5.0, {})(model_output={}, data=td)
    assert seen["n"] == 5 and seen["denominator"] == 5.0 and torch.equal(seen["keep"], keep_padded)
    assert plugin.current_mask_context() is None


def test_mask_parameters_use_the_train_config_key_as_the_verl_field():
    """One mapping config → objective (stapo.core.objectives.build_objective): a mask parameter's policy_loss field is
    its train-config key without 'algorithm.' / 'masks.' and with '_' for '.'."""
    assert plugin.verl_param_key("algorithm.s2t.prob_threshold") == "s2t_prob_threshold"
    assert plugin.verl_param_key("algorithm.top_entropy_ratio") == "top_entropy_ratio"
    assert plugin.verl_param_key("algorithm.masks.s2t_random.seed") == "s2t_random_seed"
    from stapo.core.masks import MASKS
    fields = {plugin.verl_param_key(k) for name in ("s2t", "top_entropy") for k in MASKS[name].config_keys.values()}
    assert fields == {"s2t_prob_threshold", "s2t_entropy_quantile", "s2t_quantile_scope", "top_entropy_ratio"}
    assert fields <= set(plugin.StapoPolicyLossConfig.__dataclass_fields__)

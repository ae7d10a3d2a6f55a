"""The mechanism measurements (stapo/train/probes.py, stapo/train/mechanism.py;
docs/metrics.md#mechanism-measurements-mechanism-probe): probe set, first-K entropy, token groups and weights, the
AdamW linearisation (by hand on a 2-layer linear toy and against torch's AdamW step), and on the tiny model: the
groups add up to the step's first-order change, the counterfactual's δ is exactly 0 when nothing is silenced, and
the run is bit-identical with the measurements on."""
from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stapo.train.probes import (GROUPS, AdamWLinearisation, ProbeRow, ProbeSetError, build_probe_set, dot,
                             first_k_entropy, probe_batch, probe_digest, probe_entropy, read_probe_set, shares,
                             token_groups, token_weights, weighted_token_gradients, write_probe_set)
from stapo.core.objectives import aggregate_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402


# --- probe set ---------------------------------------------------------------------------------------------------
class _Tok:
    """A stand-in tokenizer: one id per character (ord)."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_probe_set_round_trip_texts_and_digest(tmp_path):
    rows = [ProbeRow((5, 6), (9, 2), "p", "r", "a#0"), ProbeRow((7,), (3, 4, 5))]
    path = write_probe_set(tmp_path / "probe.jsonl", rows)
    assert read_probe_set(path) == rows
    # a row given as texts is encoded with the tokenizer, without special tokens
    (tmp_path / "texts.jsonl").write_text(json.dumps({"prompt": "ab", "response": "c"}) + "\n\n")
    (row,) = read_probe_set(tmp_path / "texts.jsonl", _Tok())
    assert (row.prompt_ids, row.response_ids) == ((97, 98), (99,))
    # the digest sees the ids only
    assert probe_digest(rows) == probe_digest([ProbeRow((5, 6), (9, 2)), ProbeRow((7,), (3, 4, 5), "x")])
    assert probe_digest(rows) != probe_digest(rows[:1])


@pytest.mark.parametrize("text, where, what", [
    ("", "probe.jsonl", "no row"),
    ('{"prompt_ids": [1], "response_ids": [2]}\n{oops\n', "probe.jsonl:2", "not valid JSON"),
    ('[1, 2]\n', "probe.jsonl:1", "must be a JSON object"),
    ('{"prompt_ids": [1], "response_ids": []}\n', "probe.jsonl:1", "'response_ids' must be a non-empty list"),
    ('{"prompt_ids": [1], "response_ids": [70000]}\n', "probe.jsonl:1", "outside the vocabulary"),
    ('{"prompt_ids": [1], "response_ids": [2.5]}\n', "probe.jsonl:1", "not a non-negative integer"),
    ('{"prompt": "a"}\n', "probe.jsonl:1", "needs 'prompt_ids' and 'response_ids'"),
    ('{"format": "other", "prompt_ids": [1], "response_ids": [2]}\n', "probe.jsonl:1", "unknown format"),
])
def test_probe_set_errors_are_one_line_naming_the_file_and_line(tmp_path, text, where, what):
    (tmp_path / "probe.jsonl").write_text(text)
    with pytest.raises(ProbeSetError) as e:
        read_probe_set(tmp_path / "probe.jsonl", vocab_size=49152)
    msg = str(e.value)
    assert "\n" not in msg and f"{tmp_path / where}:" in msg + ":" and what in msg


def test_build_probe_set_from_an_engine_cuts_and_names_the_sources():
    from stapo.rollout.base import Response

    class Engine:
        def generate(self, prompt_ids, n, sampling):
            return [Response(group=g, prompt_ids=list(p), response_ids=[10 + k, 11, 12], text="", engine_logprobs=None,
                             finish_reason="eos", index=k) for g, p in enumerate(prompt_ids) for k in range(n)]

    rows = build_probe_set(Engine(), [([65, 66], "b/0"), ([67], "b/1")], None, _Tok(), samples=2,
                           cut=lambda ids: 2 if ids[0] == 10 else 0)  # the second sample of each prompt is dropped
    assert [(r.prompt_ids, r.response_ids, r.source, r.prompt) for r in rows] == [
        ((65, 66), (10, 11), "b/0#0", "AB"), ((67,), (10, 11), "b/1#0", "C")]


def test_probe_entropy_is_the_token_mean_and_its_gradient():
    # 2 probe rows with token entropies [1, 2] and [3] (times θ): H_probe = θ · 6 / 3, dH/dθ = 2
    rows = [ProbeRow((5,), (1, 2)), ProbeRow((5,), (3,))]
    batch = probe_batch(rows, 0)
    theta = torch.tensor(1.0, requires_grad=True)
    base = torch.tensor([[1.0, 2.0], [3.0, 0.0]])

    def stats(b, idx, entropy_grad):
        return SimpleNamespace(entropy=theta * base[idx] * b.response_mask[idx].float())

    got = probe_entropy(stats, batch, micro_batch_size=1, params=[theta])
    assert got.value == pytest.approx(2.0) and got.num_tokens == 3 and got.grad[0].item() == pytest.approx(2.0)
    assert probe_entropy(stats, batch, micro_batch_size=2).grad is None


def test_first_k_entropy_by_hand():
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert first_k_entropy(ent, mask, 2) == pytest.approx(7 / 3)
    assert first_k_entropy(ent, mask, 5) == pytest.approx(10 / 4)
    assert math.isnan(first_k_entropy(ent, torch.zeros_like(mask), 2))


# --- groups and weights ------------------------------------------------------------------------------------------
def test_token_groups_follow_s2t_and_partition_the_response_tokens():
    # row 0 (Â = 1): 4 candidates p = 0.001 with H = 0.1 … 0.4 → τ_h = 0.325 silences the first three (method.md);
    # its 5th token p = 0.5 is high-p; row 1 (Â = −1) all neg; row 2 (Â = 0) adv_zero; padding in none
    lp = torch.log(torch.tensor([[0.001] * 4 + [0.5], [0.001] * 5, [0.3] * 5]))
    ent = torch.tensor([[0.1, 0.2, 0.3, 0.4, 1.0], [0.1] * 5, [1.0] * 5])
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 4] = False
    g = token_groups(lp, ent, torch.tensor([1.0, -1.0, 0.0]), mask)
    assert g["silenced"][0].tolist() == [True, True, True, False, False]
    assert g["kept_candidates"][0].tolist() == [False, False, False, True, False]
    assert g["pos_high_p"][0].tolist() == [False] * 4 + [True]
    assert int(g["neg"].sum()) == 5 and g["neg"][1].all() and int(g["adv_zero"].sum()) == 4
    total = sum(g[k].long() for k in (*GROUPS, "adv_zero"))
    assert torch.equal(total, mask.long())  # disjoint, covering every response token


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_token_weights_reproduce_the_aggregated_loss(mode):
    keep = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss = torch.tensor([[0.5, -1.5, 9.0], [2.0, 7.0, 7.0]])
    denom = {"token-mean": 3.0, "seq-mean-token-mean": 2.0, "seq-mean-token-sum-norm": 6.0}[mode]
    w = token_weights(keep, mode, denom)
    assert (w * loss).sum().item() == pytest.approx(aggregate_loss(loss, keep, mode, denom).item())
    if mode == "seq-mean-token-mean":  # the docstring's example
        assert w.tolist() == [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]


# --- the AdamW linearisation ---------------------------------------------------------------------------------------
class _TwoLayer(torch.nn.Module):
    """y(x) = b · (a · x): layer 1 a ∈ R², layer 2 b ∈ R."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1.0, 0.5]))
        self.b = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):  # x [n, 2] → [n]
        return self.b * (x @ self.a)


def test_attribution_by_hand_on_a_two_layer_linear_toy():
    """Two tokens, token-mean (weight 1/2 each), per-token loss ℓ = −Â y(x):
    A: x = (1, 0), Â = +1 → g_A = −½ (b x, a·x) = −½ ((2, 0), 1) = (−1, 0, −½);
    B: x = (0, 1), Â = −1 → g_B = +½ ((0, 2), ½) = (0, 1, ¼);  g = (−1, 1, −¼).
    First AdamW step, ε = 0, no decay, no clip: m̂ = g, v̂ = g², P = lr / |g| = lr (1, 1, 4).
    Probe stand-in H = y(1, 1) = b (a₁ + a₂): ∇H = (b, b, a₁ + a₂) = (2, 2, 1.5).
    ΔH_A = −∇H·(P ⊙ g_A) = −lr (2·(−1) + 0 + 1.5·4·(−½)) = 5 lr;  ΔH_B = −lr (0 + 2·1 + 1.5·4·¼) = −3.5 lr;
    sum 1.5 lr = ∇H · (−lr sign g) = lr (2 − 2 + 1.5)."""
    lr = 1e-3
    model = _TwoLayer()
    params = list(model.parameters())
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    weights = {"A": ("pg", torch.tensor([[0.5], [0.0]])), "B": ("pg", torch.tensor([[0.0], [0.5]])),
               "none": ("pg", torch.zeros(2, 1))}
    grads = weighted_token_gradients(lambda idx: {"pg": (-adv[idx] * model(x[idx]))[:, None]},
                                     [torch.tensor([0, 1])], weights, params)
    assert grads["none"] is None  # a key without weight allocates nothing
    assert [g.tolist() for g in grads["A"]] == [[-1.0, 0.0], -0.5]
    assert [g.tolist() for g in grads["B"]] == [[0.0, 1.0], 0.25]
    whole = [ga + gb for ga, gb in zip(grads["A"], grads["B"])]
    opt = torch.optim.AdamW(params, lr=lr, eps=0.0, weight_decay=0.0)
    lin = AdamWLinearisation(params, opt, whole, grad_clip=None)
    h = torch.autograd.grad(model(torch.tensor([[1.0, 1.0]])).sum(), params)
    assert [t.tolist() for t in h] == [[2.0, 2.0], 1.5]
    assert lin.dH(h, grads["A"]) == pytest.approx(5 * lr, rel=1e-6)
    assert lin.dH(h, grads["B"]) == pytest.approx(-3.5 * lr, rel=1e-6)
    assert lin.momentum_dH(h) == 0.0 and lin.weight_decay_dH(h) == 0.0
    # the parts are the real step: Δθ = −lr sign(g) = lr (1, −1, 1), and H moves by exactly 1.5 lr (a₁ + a₂ is fixed)
    before = [p.detach().clone() for p in params]
    h_before = model(torch.tensor([[1.0, 1.0]])).item()
    for p, g in zip(params, whole):
        p.grad = g.clone()
    opt.step()
    delta = [p.detach() - b for p, b in zip(params, before)]
    # (θ_1 − θ_0 of weights near 1 in fp32 carries rounding of ~1e-7)
    assert delta[0].tolist() == pytest.approx([lr, -lr], abs=1e-7) and delta[1].item() == pytest.approx(lr, abs=1e-7)
    full = lin.full_delta(whole)
    assert full[0].tolist() == pytest.approx(delta[0].tolist(), abs=1e-7) and full[1].item() == pytest.approx(
        delta[1].item(), abs=1e-7)
    assert model(torch.tensor([[1.0, 1.0]])).item() - h_before == pytest.approx(1.5 * lr, rel=1e-3)


def test_the_linearised_parts_add_up_to_torch_adamw_step_with_state_decay_and_clip():
    # float64 weights: the comparison is not blurred by rounding the step into fp32 weights
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)),
              torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for _ in range(3):  # some optimizer state: momentum and second moments, step 3
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    parts = [[torch.randn_like(p) for p in params] for _ in range(3)]  # g = Σ_k g_k
    whole = [sum(ps) for ps in zip(*parts)]
    lin = AdamWLinearisation(params, opt, whole, grad_clip=0.5)  # ‖g‖ ≈ 7: the clip acts
    assert lin.clip_scale < 0.1
    h = [torch.randn_like(p) for p in params]
    before = [p.detach().clone() for p in params]
    predicted = lin.full_delta(whole)
    by_parts = [a + b + sum(c) for a, b, *c in zip(lin.weight_decay_delta(), lin.momentum_delta(),
                                                    *(lin.delta(g) for g in parts))]
    first_order = sum(lin.dH(h, g) for g in parts) + lin.momentum_dH(h) + lin.weight_decay_dH(h)  # θ before the step
    for p, g in zip(params, whole):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    opt.step()
    delta = [p.detach() - b for p, b in zip(params, before)]
    for d, q, s in zip(delta, predicted, by_parts):
        assert torch.allclose(q, d, rtol=1e-9, atol=1e-12) and torch.allclose(s, d, rtol=1e-9, atol=1e-12)
    assert first_order == pytest.approx(dot(h, delta), rel=1e-9)


def test_a_non_finite_gradient_is_a_skipped_step_with_every_part_zero():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=0.1)
    lin = AdamWLinearisation([p], opt, [torch.tensor([1.0, float("nan")])], grad_clip=1.0)
    h = [torch.ones(2)]
    assert lin.skipped and lin.dH(h, [torch.ones(2)]) == 0.0 and lin.weight_decay_dH(h) == 0.0


def test_shares_of_absolute_values():
    assert shares({"a": 3.0, "b": -1.0}) == {"a": 0.75, "b": 0.25}
    assert all(math.isnan(v) for v in shares({"a": 0.0}).values())


# --- the trainer hook on the tiny model ----------------------------------------------------------------------------
def _probe_file(tmp_path: Path) -> Path:
    rows = [ProbeRow((5, 6, 7, 8), tuple(range(100 + 7 * i, 106 + 7 * i))) for i in range(3)]
    return write_probe_set(tmp_path / "probe.jsonl", rows)


def _mech_trainer(tmp_path, overrides, on=True, **cadence):
    keys = {"probe_every": 1, "attribution_every": 1, "counterfactual_every": 1, "first_k": 4, **cadence}
    mech = [f"mechanism.enabled={str(on).lower()}", f"mechanism.probe_file={_probe_file(tmp_path)}",
            *(f"mechanism.{k}={v}" for k, v in keys.items())]
    return make_trainer(str(tmp_path), ["trainer.save_every=0", "trainer.log_examples_every=0", *mech, *overrides])


def _state(trainer):
    weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return weights, copy.deepcopy(trainer.optimizer.state_dict()["state"])


_MEASURED = ("mechanism/", "probe/", "timing_s/", "perf/", "actor/entropy_first_k")


def test_the_measurements_leave_the_run_bit_identical(tmp_path):
    """Two steps of STAPO with every measurement at every step vs the same run with mechanism.enabled=false: the same
    rollouts (random streams), metrics, weights and optimizer state, bit for bit; the measurements are logged."""
    runs = {}
    for on in (False, True):  # measured at step 1 (not 2): step 2's rollouts show the random streams restored
        trainer = _mech_trainer(tmp_path / str(on), ["trainer.total_steps=2", "rollout.response_length=4"], on=on,
                                probe_every=2, attribution_every=2, counterfactual_every=2)
        history = trainer.train()
        runs[on] = (history, *_state(trainer))
    (h_off, w_off, s_off), (h_on, w_on, s_on) = runs[False], runs[True]
    def same(m):  # repr: NaN (a quadrant without tokens) compares equal to NaN
        return {k: repr(v) for k, v in m.items() if not k.startswith(_MEASURED)}

    assert [same(m) for m in h_on] == [same(m) for m in h_off]
    assert all(torch.equal(w_on[k], w_off[k]) for k in w_off)
    assert all(torch.equal(s_on[i][k], s_off[i][k]) for i in s_off for k in s_off[i])
    assert not any(k.startswith(_MEASURED[:2]) or k == "actor/entropy_first_k" for m in h_off for k in m)
    assert not any(k.startswith(("mechanism/", "probe/")) for k in h_on[1])
    for m in h_on[:1]:
        for key in ("probe/entropy", "actor/entropy_first_k", "mechanism/dH_probe/step", "timing_s/mechanism",
                    *(f"mechanism/{kind}/{g}" for kind in ("dH_probe", "abs_share", "token_share", "num_tokens")
                      for g in GROUPS), "mechanism/counterfactual/delta", "mechanism/counterfactual/num_silenced"):
            assert key in m, key
    from test_docs_metrics import undocumented

    assert undocumented(h_on[0]) == []  # every key in docs/metrics.md
    # the copy of the probe set the run measured on
    assert probe_digest(read_probe_set(tmp_path / "True" / "toy" / "mechanism_probe.jsonl")) == \
           probe_digest(read_probe_set(tmp_path / "True" / "probe.jsonl"))


@pytest.mark.slow
def test_grpo_attribution_has_a_kl_part_and_every_key_is_documented(tmp_path):
    from test_docs_metrics import undocumented

    trainer = _mech_trainer(tmp_path, ["trainer.total_steps=1", "algorithm.objective=grpo", "rollout.response_length=4",
                                       "actor.ppo_mini_batch_size=2"])
    (m,) = trainer.train()
    assert "mechanism/dH_probe/kl" in m  # β > 0: the KL term is its own part
    assert undocumented(m) == []


def _probe_grad(model, trainer, rows_file):
    """∇_θ H_probe and H_probe at ``model``'s weights, computed here from the probe file (not by the hook)."""
    from stapo.train.policy import policy_token_stats

    rows = read_probe_set(rows_file)
    params = [p for p in model.parameters() if p.requires_grad]

    def stats(batch, idx, entropy_grad):
        return policy_token_stats(model, batch.select(idx), trainer.cfg.rollout.temperature, entropy_grad=entropy_grad)

    return probe_entropy(stats, probe_batch(rows, 0), 8, params=params)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["justrl", "stapo"])
def test_groups_add_up_to_the_real_steps_first_order_probe_entropy_change(tmp_path, objective):
    """One mini-batch per step: the attribution's parts add up to ∇H_probe(θ_0) · (θ_1 − θ_0), the real AdamW step's
    first-order change computed independently here; the groups of the run's update add up to its ``update``."""
    trainer = _mech_trainer(tmp_path, [f"algorithm.objective={objective}", "trainer.total_steps=1",
                                       "actor.ppo_mini_batch_size=2"], counterfactual_every=0)
    theta0 = copy.deepcopy(trainer.model)
    (m,) = trainer.train()
    probe = _probe_grad(theta0, trainer, tmp_path / "probe.jsonl")
    assert m["probe/entropy"] == pytest.approx(probe.value, rel=1e-6)
    delta = [p1.detach() - p0.detach() for p1, p0 in zip(trainer.model.parameters(), theta0.parameters())]
    real = dot(probe.grad, delta)
    assert m["mechanism/dH_probe/momentum"] == 0.0  # the first step
    assert m["mechanism/dH_probe/step"] == pytest.approx(real, rel=1e-3)
    assert m["mechanism/dH_probe/step"] == pytest.approx(m["mechanism/dH_probe/update"] + m[
        "mechanism/dH_probe/weight_decay"], rel=1e-9)
    in_update = ("kept_candidates", "pos_high_p", "neg") + (("silenced",) if objective == "justrl" else ())
    assert m["mechanism/num_tokens/silenced"] > 0
    assert sum(m[f"mechanism/dH_probe/{g}"] for g in in_update) == pytest.approx(m["mechanism/dH_probe/update"],
                                                                                  rel=1e-9)
    assert sum(m[f"mechanism/token_share/{g}"] for g in GROUPS) == pytest.approx(1.0)
    assert sum(m[f"mechanism/abs_share/{g}"] for g in GROUPS) == pytest.approx(1.0)


def test_counterfactual_delta_is_exactly_zero_when_nothing_is_silenced(tmp_path):
    """τ_p = 1e-30: no token is a candidate, S2T silences nothing, so the S2T arm is the JustRL update itself: δ = 0
    exactly (the unmasked arm is not run), and the arm's probe-entropy change is the one the JustRL run's real step
    makes (the next step's probe/entropy minus this one's), up to float rounding of the two plans' operation order."""
    trainer = _mech_trainer(tmp_path, ["algorithm.objective=justrl", "trainer.total_steps=2",
                                       "algorithm.s2t.prob_threshold=1e-30", "rollout.response_length=4"],
                            attribution_every=0, counterfactual_every=2)
    m1, m2 = trainer.train()
    assert m1["mechanism/counterfactual/num_silenced"] == 0.0
    assert m1["mechanism/counterfactual/delta"] == 0.0
    assert m1["mechanism/counterfactual/dH_s2t"] == m1["mechanism/counterfactual/dH_unmasked"] != 0.0
    assert "mechanism/counterfactual/delta_masked" not in m1
    real = m2["probe/entropy"] - m1["probe/entropy"]  # the real JustRL step's change of H_probe
    assert m1["mechanism/counterfactual/dH_s2t"] == pytest.approx(real, rel=1e-4, abs=1e-9)


@pytest.mark.slow
def test_the_counterfactual_s2t_arm_is_a_stapo_runs_own_step(tmp_path):
    """For a STAPO run the S2T arm is the real step (same plan, state, batch): its probe-entropy change is the one the
    next step measures, bit for bit; with silenced tokens δ is also logged as delta_masked."""
    trainer = _mech_trainer(tmp_path, ["algorithm.objective=stapo", "trainer.total_steps=2"], attribution_every=0)
    m1, m2 = trainer.train()
    assert m1["mechanism/counterfactual/dH_s2t"] == m2["probe/entropy"] - m1["probe/entropy"]
    assert m1["mechanism/counterfactual/num_silenced"] == m1["actor/s2t/num_masked"] > 0
    assert m1["mechanism/counterfactual/delta_masked"] == m1["mechanism/counterfactual/delta"] != 0.0


def test_config_keys_are_validated_in_one_line(tmp_path):
    from stapo.config import ConfigError, load_config

    repo = Path(__file__).resolve().parents[1]
    for override, key in (("mechanism.probe_every=-1", "mechanism.probe_every"),
                          ("mechanism.micro_batch_size=0", "mechanism.micro_batch_size")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(repo / "configs" / "tiny_test.yaml", [override])
    with pytest.raises(ConfigError, match=r"mechanism\.probe_file"):
        load_config(repo / "configs" / "tiny_test.yaml", ["mechanism.enabled=true"])
    cfg = load_config(repo / "configs" / "tiny_test.yaml", ["mechanism.enabled=true", "mechanism.probe_every=0",
                                                           "mechanism.attribution_every=0",
                                                           "mechanism.counterfactual_every=0"])
    assert cfg.mechanism.first_k == 48  # actor/entropy_first_k alone needs no probe set
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ConfigError, match=r"mechanism\.probe_file.*bad\.jsonl:1: not valid JSON"):
        make_trainer(str(tmp_path), ["mechanism.enabled=true", f"mechanism.probe_file={tmp_path / 'bad.jsonl'}"])


def test_a_resumed_run_refuses_a_changed_probe_set(tmp_path):
    from stapo.config import ConfigError

    trainer = _mech_trainer(tmp_path, ["trainer.total_steps=1", "rollout.response_length=4"], attribution_every=0,
                            counterfactual_every=0)
    trainer.train()  # writes the run's copy of its probe set and the final checkpoint
    assert read_probe_set(tmp_path / "toy" / "mechanism_probe.jsonl") == read_probe_set(tmp_path / "probe.jsonl")
    write_probe_set(tmp_path / "probe.jsonl", [ProbeRow((5,), (6, 7))])
    with pytest.raises(ConfigError, match="differ from the probe set this run started with"):
        make_trainer(str(tmp_path), ["trainer.total_steps=2", "trainer.resume=auto", "rollout.response_length=4",
                                     "mechanism.enabled=true",
                                     f"mechanism.probe_file={tmp_path / 'probe.jsonl'}"])



def _script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "build_probe_set.py"
    spec = importlib.util.spec_from_file_location("build_probe_set", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_probe_set_script_writes_the_initial_models_answers(tmp_path, capsys):
    from stapo.tasks.prompts import encode_prompt
    from stapo.tasks.synthetic import generated_benchmark

    config = Path(__file__).resolve().parents[1] / "configs" / "tiny_test.yaml"
    out = tmp_path / "probe.jsonl"
    assert _script().main(["--config", str(config), "--benchmark", "arith_test", "--num-prompts", "2",
                           "--out", str(out)]) == 0
    rows = read_probe_set(out)
    assert [r.source for r in rows] == ["arith_test/0#0", "arith_test/1#0"]
    from stapo.model.models import EMBEDDED_ALIASES, load_tokenizer

    tok = load_tokenizer(EMBEDDED_ALIASES[0])
    problem = generated_benchmark("arith_test")[0].problem
    assert list(rows[0].prompt_ids) == encode_prompt(problem, tok, use_chat_template="plain")
    assert all(0 < len(r.response_ids) <= 8 for r in rows)  # rollout.response_length of the tiny config
    assert "wrote 2 probe pairs" in capsys.readouterr().out
    assert _script().main(["--config", str(config), "--benchmark", "nope", "--out", str(out)]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err

"""What a registered mask or loss formula must return, and what happens when it does not: one line naming the
extension and the fix (train.py: exit 2), never a traceback; registration refuses prefixes and rules that
cannot work; mask parameters are type-checked by the config library."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stapo.core.masks import MASKS, check_mask_result, get_mask_spec, register_token_mask
from stapo.core.objectives import POLICY_LOSSES, get_objective, policy_loss, register_policy_loss
from stapo.common.registry import ExtensionError
from stapo.train.metrics import MetricAccumulator

REPO = Path(__file__).resolve().parents[1]
MASK = torch.tensor([[True, True, False], [True, True, True]])  # [2, 3] response tokens (row 0 padded)


def test_check_mask_result_names_the_mask_and_what_is_wrong():
    check_mask_result("s2t", MASK.clone(), MASK, torch.tensor([1.0, -1.0]))  # keeps everything: fine
    with pytest.raises(ExtensionError, match=r"^token mask 's2t' returned keep as torch.float32 \(2, 3\); it must be "
                                             r"a bool tensor of the response mask's shape \(2, 3\)$"):
        check_mask_result("s2t", MASK.float(), MASK)
    with pytest.raises(ExtensionError, match=r"returned keep as torch.bool \(2, 2\)"):
        check_mask_result("s2t", MASK[:, :2], MASK)
    with pytest.raises(ExtensionError, match=r"^token mask 's2t' keeps 1 padding token\(s\); return keep = "
                                             r"response_mask & \.\.\."):
        check_mask_result("s2t", torch.ones(2, 3, dtype=torch.bool), MASK)
    # S2T's rule: only Â > 0 rows may lose tokens. Row 1 (Â = -1) losing its last token breaks it.
    keep = MASK.clone()
    keep[1, 2] = False
    check_mask_result("s2t", keep, MASK)  # without advantages only the form is checked
    check_mask_result("s2t", keep, MASK, torch.tensor([-1.0, 1.0]))  # row 1 has Â > 0: allowed
    with pytest.raises(ExtensionError) as err:
        check_mask_result("s2t", keep, MASK, torch.tensor([1.0, -1.0]))
    assert str(err.value) == ("token mask 's2t' silenced tokens of 1 row(s) its maskable_rows rule "
                              "'positive_advantage' leaves untouched (e.g. row 1, advantage -1); register it with "
                              "maskable_rows='all' or a rule that includes those rows")
    check_mask_result("top_entropy", keep, MASK, torch.tensor([1.0, -1.0]))  # rule 'all': any row


def test_registration_refuses_unknown_rules_and_taken_prefixes():
    fn = get_mask_spec("none").fn
    with pytest.raises(ValueError, match=r"^token mask 'x': unknown maskable_rows rule 'positve_advantage'; use one "
                                         r"of 'none', 'positive_advantage', 'all' or a function"):
        register_token_mask("x", maskable_rows="positve_advantage")(fn)
    with pytest.raises(ValueError, match=r"^token mask 'x': metric prefix 'actor' is taken by the trainer's own "
                                         r"metrics; choose another prefix$"):
        register_token_mask("x", prefix="actor")(fn)
    with pytest.raises(ValueError, match=r"^token mask 'x': metric prefix 's2t_random' is taken by token mask "
                                         r"'s2t_random'; choose another prefix$"):
        register_token_mask("x", prefix="s2t_random")(fn)
    with pytest.raises(ValueError, match=r"^token mask 'x': config_keys names 'tua', which is not a field of its "
                                         r"params dataclass \(fields: prob_threshold, entropy_quantile, "
                                         r"quantile_scope\)$"):
        register_token_mask("x", params=get_mask_spec("s2t").params, config_keys={"tua": "algorithm.s2t.x"})(fn)
    assert "x" not in MASKS


def test_mask_parameters_are_type_checked_not_silently_cast():
    spec = get_mask_spec("s2t_random")  # seed: int, prob_threshold: float
    assert spec.check_params({"seed": "3"})["seed"] == 3  # a command-line string of an int
    assert spec.check_params({"prob_threshold": 1})["prob_threshold"] == 1.0
    for bad in (2.5, True, "abc"):
        with pytest.raises(ValueError) as err:
            spec.check_params({"seed": bad})
        assert str(err.value) == (f"invalid value for 'algorithm.masks.s2t_random.seed' ({bad!r}): token mask "
                                  f"'s2t_random' needs a value of type int")


def test_a_loss_formula_with_the_wrong_output_is_one_line_naming_it():
    @register_policy_loss("test_bad_loss")
    def bad(logprobs, old_logprobs, advantages, keep, objective):
        return -advantages[:, None] * logprobs, {}  # no clip flags

    try:
        obj = get_objective("justrl").replace(name="t", policy_loss="test_bad_loss")
        lp = torch.zeros(2, 3, requires_grad=True)
        with pytest.raises(ExtensionError) as err:
            policy_loss(obj, lp, lp.detach(), torch.tensor([1.0, -1.0]), MASK, 5.0)
        assert str(err.value) == ("policy loss 'test_bad_loss' returned flags without ['pg_clipfrac', "
                                  "'pg_clipfrac_lower']; it must return (loss (2, 3) float tensor, {'pg_clipfrac': "
                                  "..., 'pg_clipfrac_lower': ...} (2, 3))")
    finally:
        POLICY_LOSSES.pop("test_bad_loss", None)


def test_a_fraction_without_its_count_is_averaged_not_zeroed():
    acc = MetricAccumulator()
    acc.add_mask_stats({"m/num_response_tokens": 10.0, "m/num_masked": 1.0, "m/masked_frac": 0.1, "m/other_frac": 0.5})
    acc.add_mask_stats({"m/num_response_tokens": 30.0, "m/num_masked": 9.0, "m/masked_frac": 0.3, "m/other_frac": 0.7})
    out = acc.result()
    assert out["m/masked_frac"] == (1 + 9) / (10 + 30)  # recomputed from the summed counts: 0.25
    assert out["m/other_frac"] == pytest.approx((0.5 + 0.7) / 2)  # no m/num_other: the mini-batch mean, 0.6


LIAR = """
from stapo.core.masks import TokenMask, register_token_mask
from stapo.core.objectives import get_objective, register_objective


@register_token_mask("liar", maskable_rows="positive_advantage")
def liar(logprobs, entropy, advantages, response_mask):
    \"\"\"Silences the first response token of EVERY row, although its rule promises only Â > 0 rows.\"\"\"
    first = response_mask & (response_mask.long().cumsum(dim=1) == 1)
    return TokenMask(keep=response_mask & ~first, stats={})


register_objective(get_objective("justrl").replace(name="justrl_liar", token_mask="liar"))
"""


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_mask_breaking_its_row_rule_stops_train_py_with_one_line_on_both_paths(tmp_path, fused):
    """tiny_test's strict-box reward is −1 for every response of the random model: Â = 0 everywhere, so the rule
    'positive_advantage' leaves every row untouched, and the liar mask breaks it in the first mini-batch."""
    module = tmp_path / "liar_mask.py"
    module.write_text(LIAR)
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
                          f"trainer.import_modules=[{module}]", "algorithm.objective=justrl_liar",
                          f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "trainer.total_steps=1",
                          f"actor.fused_forward={fused}"], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
    assert lines == ["train.py: token mask 'liar' silenced tokens of 4 row(s) its maskable_rows rule "
                     "'positive_advantage' leaves untouched (e.g. row 0, advantage 0); register it with "
                     "maskable_rows='all' or a rule that includes those rows"], out.stderr[-2000:]
    metrics = tmp_path / "r" / "metrics.jsonl"
    assert (metrics.read_text().split() if metrics.exists() else []) == []  # the step never finished: no row

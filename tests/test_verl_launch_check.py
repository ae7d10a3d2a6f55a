"""The verl step 3 of docs/scaling.md, as a new user runs it:
``DRY_RUN=1 NNODES=8 bash scripts/verl/run_stapo_qwen3_1.7b.sh`` for each method (the four of the paper's table and
the three S2T ablations), in the check environment ``.venv-verl`` (scripts/verl/setup_check_env.sh: hydra-core
1.3.8 + omegaconf 2.3 over the project's .venv; .ci/run creates it, and so does this module when it is missing).

Each dry run composes the launch line with hydra against verl 0.9.1's own config, imports the plugin the way the
workers do, checks the hook on TrainingWorker.train_batch, instantiates the actor config, runs verl's
validate_config and names the objective of stapo/core/objectives.py that verl's actor will optimise.
Cost: ~15 s to create the environment once (pip cache warm), ~8 s of CPU per dry run; the eight run at once.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed (bash scripts/setup.sh installs it)")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "verl" / "run_stapo_qwen3_1.7b.sh"
CHECK_ENV = ROOT / ".venv-verl"
ABLATIONS = ("stapo_high_entropy", "stapo_random", "justrl_fullmask")  # plugin losses, like stapo and entropy20
METHODS = ("stapo", "entropy20", "vanilla", "grpo", *ABLATIONS)
PLUGIN_METHODS = ("stapo", "entropy20", *ABLATIONS)
HOOK = "worker hook installed on verl.workers.engine_workers.TrainingWorker.train_batch"


def _check_python() -> Path:
    """.venv-verl's python; creates the environment (the one command of docs/scaling.md) when it is missing."""
    py = CHECK_ENV / "bin" / "python"
    if not py.exists():
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "verl" / "setup_check_env.sh")], cwd=ROOT,
                              env={**os.environ, "STAPO_VENV": sys.prefix}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"setup_check_env.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return py


def _env(**extra: str) -> dict[str, str]:
    # PYTHONPATH: the check imports THIS checkout's stapo (the base .venv may point at another checkout)
    return {**os.environ, "PYTHON": str(_check_python()), "PYTHONPATH": str(ROOT), "DRY_RUN": "1", "NNODES": "8",
            "HYDRA_FULL_ERROR": "1", **extra}


# a setting the plugin rejects in the workers: the check must fail on it (rc 1, one line naming the problem)
BAD = ("stapo-seq-mean", {"LOSS_MODE": "stapo", "ATTN_IMPL": "sdpa"},
       ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"])


@pytest.fixture(scope="module")
def dry_runs() -> dict[str, subprocess.CompletedProcess]:
    """The methods' dry runs and the BAD one, all at once (each is one CPU-bound python process importing
    verl, ~8 s of CPU; the machine's cores are the limit, not the order)."""
    env = _env()
    cases = [(m, {"LOSS_MODE": m}, []) for m in METHODS] + [BAD]
    procs = {name: subprocess.Popen(["bash", str(SCRIPT), *args], cwd=ROOT, env={**env, **extra},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, extra, args in cases}
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return results


EXPECTED = {  # method → (verl policy loss function, our objective, reference model line)
    "stapo": ("stapo.integrations.verl.compute_policy_loss_stapo", "stapo", "reference model: off"),
    "entropy20": ("stapo.integrations.verl.compute_policy_loss_entropy20", "entropy20", "reference model: off"),
    "vanilla": ("verl.trainer.ppo.core_algos.compute_policy_loss_vanilla", "justrl", "reference model: off"),
    "grpo": ("verl.trainer.ppo.core_algos.compute_policy_loss_vanilla", "grpo",
             "reference model: on (KL loss β = 0.04, low_var_kl)"),
    **{m: (f"stapo.integrations.verl.compute_policy_loss_{m}", m, "reference model: off") for m in ABLATIONS},
}


@pytest.mark.parametrize("method", METHODS)
def test_dry_run_of_the_launch_script(dry_runs, method):
    proc = dry_runs[method]
    assert proc.returncode == 0, f"LOSS_MODE={method}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    fn, objective, ref = EXPECTED[method]
    assert "verl 0.9.1: config composes and validates (8 node(s) × 8 GPUs)" in out
    assert HOOK in out  # the external_lib import installed the hook in this process, as in every worker
    assert ("(active)" in out) == (method in PLUGIN_METHODS)
    loss_mode = "vanilla" if method == "grpo" else method
    assert f"policy loss {loss_mode!r} -> {fn}" in out
    assert f"equals stapo.core.objectives {objective!r}" in out
    assert ref in out
    # no flash_attn on this CPU machine → the script falls back to sdpa and says so
    assert "attention (FSDP actor/ref): sdpa" in out and "flash_attn is not importable" in proc.stderr
    # the plugin's extra entropy pass never builds a [tokens, V] softmax: verl's engine reads the actor's switch
    assert "entropy from logits (FSDP actor): chunked, 2048 tokens per chunk" in out


def test_dry_run_rejects_what_the_plugin_rejects_at_run_time(dry_runs):
    """The check fails (rc 1, one line naming the problem) on a setting the plugin would reject in the workers."""
    proc = dry_runs[BAD[0]]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "check failed: verl loss 'stapo' needs actor.loss_agg_mode='token-mean'" in proc.stderr


@pytest.mark.parametrize("var, value", [("LOSS_MODE", "dapo"), ("ATTN_IMPL", "flash")])
def test_launch_script_rejects_unknown_values(var, value):
    """Bad input: exit 2 with one line naming the variable and the valid values, before any python runs."""
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env={**os.environ, "DRY_RUN": "1", var: value,
                                                                "PYTHON": "/nonexistent/python"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"{var} must be") and f"(got '{value}')" in proc.stderr


def test_sdpa_attention_is_exact_on_verls_packed_sequences():
    """ATTN_IMPL=sdpa (the fallback without flash-attn): verl's remove-padding forward (fsdp transformer_impl.py,
    ``use_remove_padding=True``) packs a micro-batch's sequences into ONE row with ``attention_mask=None`` and
    position ids restarting at 0 per sequence. transformers then builds a block-diagonal causal mask from the
    position ids, so each token attends only to its own sequence: the packed logits equal the per-sequence logits.
    A tiny random Qwen3 (the paper's model family), patched by verl's own apply_monkey_patch as the engine does."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    apply_monkey_patch(model=model, use_remove_padding=True, ulysses_sp_size=1)
    lens = [5, 9, 3, 7]
    seqs = [torch.randint(0, 64, (n,)) for n in lens]
    ids = torch.cat(seqs)[None]  # [1, 24]: verl's input_ids_rmpad
    pos = torch.cat([torch.arange(n) for n in lens])[None]  # [1, 24], restarting at 0 per sequence
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=None, position_ids=pos, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
        no_bounds = torch.arange(24)[None]  # one 24-token sequence
        leaky = model(input_ids=ids, attention_mask=None, position_ids=no_bounds, use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # the check has teeth: without the sequence boundaries the later sequences see the earlier ones
    assert (leaky[lens[0]:] - alone[lens[0]:]).abs().max() > 1e-2

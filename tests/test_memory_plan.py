"""The GPU memory plan per phase (stapo/run/memory_plan.py): every term of a small made-up shape worked by hand, the
order of the engine's memory over the phases, the start-up refusal, the dry run's table for a paper config on this
CPU machine, and results/memory_plan.md as scripts/memory_plan.py prints it now."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from stapo.config import ConfigError, load_config
from stapo.run.memory_plan import (GIB, PAPER_SHAPES, MemoryPlanError, ModelShape, check_memory_plan, format_plan,
                               model_shape, plan_memory)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_test.yaml"

# A made-up shape: 2 layers, d = 64, MLP 128, 2 query heads and 1 key-value head of 32, 1,000 embedding rows, untied.
SHAPE = ModelShape("made-up", layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, vocab=1000,
                   tied=False)
# fp32 parameters, bf16 compute, checkpointing, rows of 16 + 48 = 64 tokens, micro-batches of 2 rows (T = 128),
# padded rows with the logits head, vLLM at 0.5 of a 1 GiB GPU, asleep (enforce_eager: a 0.25 GiB residual)
HAND = ["model.param_dtype=float32", "model.compute_dtype=bfloat16", "model.gradient_checkpointing=true",
        "data.max_prompt_length=16", "rollout.response_length=48", "actor.ppo_micro_batch_size=2",
        "rollout.backend=vllm", "rollout.gpu_memory_utilization=0.5", "rollout.sleep_during_update=true",
        "rollout.enforce_eager=true"]


def _terms(phase):
    return {t.name: t.bytes for t in phase.terms}


def test_every_term_of_a_made_up_shape_worked_by_hand():
    # P_l = q 64·64 + k, v 2·64·32 + o 64·64 + q/k norms 2·32 + MLP 3·64·128 + 2 norms 2·64
    #     = 4,096 + 4,096 + 4,096 + 64 + 24,576 + 128 = 37,056
    # P_r = embedding + untied head 2·1,000·64 + final norm 64 = 128,064;  P = 2·37,056 + 128,064 = 202,176
    assert (SHAPE.layer_params, SHAPE.root_params, SHAPE.params) == (37_056, 128_064, 202_176)
    cfg = load_config(TINY, HAND)
    plan = plan_memory(cfg, SHAPE, world=1, device_gib=1.0)
    assert [p.name for p in plan.phases] == ["rollout", "old pass", "update", "sync", "validation"]  # β = 0
    resident = {"parameters (float32)": 4 * 202_176,  # 808,704
                "AdamW moments": 8 * 202_176,  # 1,617,408
                "CUDA context": 0.5 * GIB}  # one process: no NCCL
    # rollout: the engine's 0.5 × 1 GiB = its bf16 weights 2·202,176 = 404,352 + the rest (KV cache, graphs)
    assert _terms(plan.phase("rollout")) == {"vLLM weights": 404_352,
                                             "vLLM KV cache, activations, graphs": 0.5 * GIB - 404_352, **resident}
    asleep = {"vLLM asleep (level 2)": 0.25 * GIB}
    # old pass (no grad): autocast's bf16 copy of every weight 2·202,176; one layer's working set
    # T·(2a·d + 4d + 3c·I) = 128·(2·4·64 + 4·64 + 3·2·128) = 128·1,536 (a = 4: the fp32 residual stream of one
    # process); the padded mask and SDPA bias T·L·(1 + c) = 128·64·3; the logits of K = 2·(48 + 1) positions
    # c·K·V = 2·98·1,000
    old = {**asleep, **resident, "autocast weight copies": 404_352, "one layer's working set (no grad)": 196_608,
           "attention mask + SDPA bias [b,1,L,L]": 24_576, "LM head: logits": 196_000}
    assert _terms(plan.phase("old pass")) == old
    # update: + gradients 4·202,176; checkpointed layer inputs n_l·T·d·a = 2·128·64·4 = 65,536; one layer
    # recomputed T·(2(4+c)·d + c·(2q+2kv) + 4(q+kv) + 6c·I) = 128·(768 + 384 + 384 + 1,536) = 393,216; logits +
    # gradient 2·2·98·1,000 (the optimizer step, gradients + one fp32 copy 808,704, is smaller than these transients)
    update = {**asleep, **resident, "gradients (float32)": 808_704, "autocast weight copies": 404_352,
              "checkpointed layer inputs": 65_536, "one layer recomputed (backward)": 393_216,
              "attention mask + SDPA bias [b,1,L,L]": 24_576, "LM head: logits + gradient": 392_000}
    assert _terms(plan.phase("update")) == update
    # sync: the engine's weights woken (no KV cache) + the largest gathered unit 2·max(37,056, 1,000·64) and vLLM's
    # per-layer reload buffer 2·37,056
    assert _terms(plan.phase("sync")) == {"vLLM weights (woken)": 404_352, **asleep, **resident,
                                          "largest gathered unit (bf16)": 128_000,
                                          "vLLM per-layer reload buffer": 74_112}
    assert plan.phase("validation").terms == plan.phase("rollout").terms
    assert plan.phase("update").gib == pytest.approx((sum(update.values())) / GIB)


def test_fsdp2_the_fused_head_and_packed_budgets_change_the_terms_by_hand():
    cfg = load_config(TINY, HAND + ["actor.lm_head=fused", "actor.use_remove_padding=true",
                                    "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=256",
                                    "model.attn_implementation=flash_attention_2", "algorithm.objective=grpo"])
    plan = plan_memory(cfg, SHAPE, world=2, device_gib=1.0, strategy="fsdp2")
    up = _terms(plan.phase("update"))
    assert up["parameters (float32)"] == 4 * 202_176 / 2 and up["gradients (float32)"] == 4 * 202_176 / 2
    assert up["GRPO reference (bfloat16)"] == 2 * 202_176 / 2  # sharded like the policy
    assert up["CUDA context + NCCL"] == 1.5 * GIB
    assert up["FSDP2: 2 decoder layers all-gathered (policy)"] == 2 * 2 * 37_056
    assert up["FSDP2: root module unsharded (policy)"] == 2 * 128_064
    assert up["FSDP2: layer gradient + fp32 reduce-scatter input"] == 6 * 37_056
    assert up["FSDP2: root gradient + fp32 reduce-scatter input"] == 6 * 128_064
    # packed rows, a 256-token budget: T = 256, K ≤ T; no mask; the residual stream in bf16 under FSDP2
    assert up["checkpointed layer inputs"] == 2 * 256 * 64 * 2
    assert not any("mask" in name or "logits" in name for name in up)
    # the fused head: a tile of min(row_tile, K) = 256 rows × min(vocab_tile, V) = 1,000 columns, with its gradient
    # (2 + 4 B), and the fp32 accumulators of the hidden states and the output embedding 4·(256 + 1,000)·64
    assert up["fused head: tile + gradient tile"] == 256 * 1000 * 6
    assert up["fused head: fp32 gradient accumulators"] == 4 * (256 + 1000) * 64
    ref = _terms(plan.phase("reference pass"))
    assert ref["FSDP2: 2 decoder layers all-gathered (reference)"] == 2 * 2 * 37_056
    assert ref["fused head: one logits tile"] == 256 * 1000 * 2 and "autocast weight copies" not in ref


def test_the_engine_over_the_phases():
    cfg = load_config(TINY, HAND + ["algorithm.objective=grpo", "rollout.enforce_eager=false"])
    plan = plan_memory(cfg, SHAPE, world=1, device_gib=1.0)
    share = 0.5 * GIB
    assert plan.phase("rollout").engine_gib * GIB == pytest.approx(share)
    assert plan.phase("validation").engine_gib == plan.phase("rollout").engine_gib
    for name in ("old pass", "reference pass", "update"):  # asleep: the residual only, no weights, no KV cache
        names = {t.name for t in plan.phase(name).terms if t.engine}
        assert names == {"vLLM asleep (level 2)"} and plan.phase(name).engine_gib == 1.0  # CUDA graphs kept
    sync = {t.name for t in plan.phase("sync").terms if t.engine}
    assert sync == {"vLLM weights (woken)", "vLLM asleep (level 2)"}  # weights, no KV cache yet
    assert plan.phase("sync").engine_gib * GIB == 2 * 202_176 + GIB
    # the engine never sleeping (rollout.sleep_during_update=false): its whole share in every phase
    awake = plan_memory(load_config(TINY, HAND + ["rollout.sleep_during_update=false"]), SHAPE, 1, 1.0)
    assert all(p.engine_gib * GIB == pytest.approx(share) for p in awake.phases)


def test_a_config_over_the_gpu_is_refused_in_one_line_naming_the_phase_and_the_key(tmp_path, monkeypatch, capsys,
                                                                                    shared_data_root):
    # the engine's share too large for an 80 GiB GPU: the rollout phase, and the largest share that fits 90 %
    cfg = load_config(REPO / "configs" / "paper" / "qwen3_8b_grpo.yaml",
                      ["trainer.device=cpu", "trainer.gpu_memory_gib=80", "rollout.gpu_memory_utilization=0.95"])
    with pytest.raises(MemoryPlanError) as e:
        check_memory_plan(cfg, world=8, device="cpu", strategy="fsdp2")
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, ConfigError)
    rollout = plan_memory(cfg, PAPER_SHAPES["Qwen/Qwen3-8B-Base"], 8, 80.0, strategy="fsdp2").phase("rollout")
    rest = rollout.gib - rollout.engine_gib  # parameters, AdamW moments, reference, context
    u_max = int(100 * (0.9 * 80 - rest) / 80) / 100
    assert msg.startswith(f"invalid value for 'trainer.gpu_memory_gib' (80.0): the rollout phase needs "
                          f"{rollout.gib:.1f} GiB per GPU, more than the 80.0 GiB of the device "
                          f"(trainer.gpu_memory_gib=80); rollout.gpu_memory_utilization ≤ {u_max:.2f} keeps the rollout")
    assert e.value.details.startswith("memory plan per GPU")
    # a 40 GiB GPU: the largest phase is named with the keys that lower it
    cfg = load_config(REPO / "configs" / "paper" / "qwen3_8b_grpo.yaml",
                      ["trainer.device=cpu", "trainer.gpu_memory_gib=40"])
    worst = plan_memory(cfg, PAPER_SHAPES["Qwen/Qwen3-8B-Base"], 8, 40.0, strategy="fsdp2").peak
    with pytest.raises(MemoryPlanError, match=f"the {worst.name} phase needs {worst.gib:.1f} GiB per GPU") as e:
        check_memory_plan(cfg, world=8, device="cpu", strategy="fsdp2")
    assert worst.keys[0] in str(e.value) or "rollout.gpu_memory_utilization" in str(e.value)
    # 14B on one H200: 16 B per parameter alone exceed it; no key but more GPUs helps
    cfg = load_config(REPO / "configs" / "paper" / "qwen3_14b_stapo.yaml",
                      ["trainer.device=cpu", "trainer.gpu_memory_gib=139.8"])
    with pytest.raises(MemoryPlanError, match="alone take .* GiB in the .* phase: shard the training state over more "
                                              r"GPUs \(torchrun --nproc_per_node, trainer.data_parallel=fsdp2\)"):
        check_memory_plan(cfg, world=1, device="cpu")
    # a CPU run without trainer.gpu_memory_gib is planned for an assumed H100 and never refused
    plan = check_memory_plan(load_config(REPO / "configs" / "paper" / "qwen3_14b_grpo.yaml",
                                         ["trainer.device=cpu"]), world=1, device="cpu")
    assert not plan.checked and plan.device_gib == 79.2 and plan.over()
    assert load_config(TINY, ["trainer.gpu_memory_gib=0.5"]).trainer.gpu_memory_gib == 0.5
    with pytest.raises(ConfigError, match="trainer.gpu_memory_gib"):
        load_config(TINY, ["trainer.gpu_memory_gib=0"])
    # train.py: one line, then the table; before the tokenizer or any model (a hub id this machine cannot reach)
    import train

    monkeypatch.chdir(tmp_path)
    rc = train.main(["--config", str(REPO / "configs" / "paper" / "qwen3_14b_stapo.yaml"), "trainer.device=cpu",
                     "trainer.gpu_memory_gib=40", f"data.root={shared_data_root}", "trainer.val_every=0",
                     "trainer.val_before_train=false", "--dry-run"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[0].startswith("train.py: invalid value for 'trainer.gpu_memory_gib' (40.0): the ")
    assert err[1].startswith("memory plan per GPU (GiB") and any(line.lstrip().startswith("update") for line in err)


def _qwen_folder(root: Path) -> Path:
    """A local folder with the public Qwen3-1.7B config.json, the SmolLM2 tokenizer and an empty weights file (a dry
    run never reads weights): the paper config's model where the hub cannot be reached."""
    from stapo.model.models import embedded_model_path

    folder = root / "Qwen3-1.7B-Base"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded_model_path() / name, folder / name)
    (folder / "model.safetensors").write_bytes(b"")
    s = PAPER_SHAPES["Qwen/Qwen3-1.7B-Base"]
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": s.hidden,
        "intermediate_size": s.intermediate, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab,
        "tie_word_embeddings": s.tied}))
    return folder


def test_the_dry_run_of_a_paper_config_prints_the_plan_on_a_cpu_machine(tmp_path, shared_data_root, capsys):
    import train

    folder = _qwen_folder(tmp_path)
    shape = model_shape(str(folder))
    assert shape.params == PAPER_SHAPES["Qwen/Qwen3-1.7B-Base"].params  # config.json read as the built-in shape
    rc = train.main(["--config", str(REPO / "configs" / "paper" / "qwen3_1.7b_stapo.yaml"), "trainer.device=cpu",
                     f"model.path={folder}", f"data.root={shared_data_root}", f"trainer.output_dir={tmp_path / 'r'}",
                     "data.train_set=synthetic", "trainer.val_every=0", "trainer.val_before_train=false", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    head = next(line for line in out.splitlines() if line.startswith("memory plan per GPU"))
    assert "Qwen3-1.7B-Base (1.72 B parameters), 1 GPU (one process), 79.2 GiB per GPU (assumed: an 80-GB H100" in head
    assert head.endswith("not checked")
    cfg = load_config(REPO / "configs" / "paper" / "qwen3_1.7b_stapo.yaml", ["trainer.device=cpu"])
    expected = format_plan(plan_memory(cfg, shape, 1, 79.2, device="x", checked=False))
    assert expected.split("\n", 1)[1] in out  # the same phases and terms as the plan itself


def test_the_committed_memory_plan_is_what_the_script_prints():
    spec = importlib.util.spec_from_file_location("memory_plan_script", REPO / "scripts" / "memory_plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert (REPO / "results" / "memory_plan.md").read_text() == script.main(), \
        "rerun: python scripts/memory_plan.py --out results/memory_plan.md"

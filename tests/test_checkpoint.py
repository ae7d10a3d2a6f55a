"""stapo/model/checkpoint.py in one process: the HF export, the dcp/ round trip, completeness, crash safety, bad input.

(The 2-rank FSDP2 / replicate cases, resharding and rank 0's memory: tests/test_distributed.py.)
"""
from __future__ import annotations

import copy
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from stapo.model import checkpoint as ck
from stapo.model import distributed as dist
from stapo.model.models import build_tiny_model, load_tokenizer, EMBEDDED_ALIASES


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_ALIASES[0])


def _model_and_optimizer(tokenizer, seed: int = 0, **kw):
    """A tiny model and an AdamW that has taken one step (gradients 0.5·p + 0.01: non-trivial moments)."""
    model, _ = build_tiny_model(seed=seed, tokenizer=tokenizer, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 0.01
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.parametrize("tied", [False, True])
def test_export_hf_writes_what_save_pretrained_writes(tmp_path, tokenizer, tied):
    """bf16 export of fp32 weights in 2 MB shards: the same files, config.json, generation_config.json, index and
    tensors as ``save_pretrained`` of the model cast to bf16 (tied embeddings stored once), and ``load_policy``
    (transformers; what train.py and evaluate.py use) loads it, ties restored."""
    from safetensors import safe_open

    model, _ = build_tiny_model(tokenizer=tokenizer, tie_word_embeddings=tied)
    ck.export_hf(model, tmp_path / "mine", tokenizer, dtype="bf16", max_shard_size="2MB")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "ref", max_shard_size="2MB")
    tokenizer.save_pretrained(tmp_path / "ref")
    names = sorted(os.listdir(tmp_path / "ref"))
    assert sorted(os.listdir(tmp_path / "mine")) == names
    assert "model.safetensors.index.json" in names and sum("-of-" in n for n in names) >= 2  # sharded
    for f in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        assert json.loads((tmp_path / "mine" / f).read_text()) == json.loads((tmp_path / "ref" / f).read_text()), f
    for f in (n for n in names if n.endswith(".safetensors")):
        with safe_open(tmp_path / "mine" / f, "pt") as a, safe_open(tmp_path / "ref" / f, "pt") as b:
            assert a.metadata() == b.metadata() == {"format": "pt"}
            assert sorted(a.keys()) == sorted(b.keys())
            for k in b.keys():
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    from stapo.model.models import load_policy

    loaded, _ = load_policy(str(tmp_path / "mine"), dtype="bfloat16")  # what evaluate.py / train.py call
    assert loaded.dtype == torch.bfloat16
    sd = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k].to(torch.bfloat16)), k
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == tied


def test_sharded_save_and_load_round_trip(tmp_path, tokenizer):
    """save_checkpoint → load_sharded_state into a differently initialised model and a fresh AdamW: every parameter
    and optimizer tensor bit-identical; trainer_state.pt holds no optimizer tensors; the HF export in the
    parameters' dtype equals the parameters."""
    from safetensors.torch import load_file

    model, opt = _model_and_optimizer(tokenizer)
    final = ck.save_checkpoint(tmp_path, 3, model, tokenizer, {"note": 1}, optimizer=opt)
    assert final == tmp_path / "step_000003" and ck.is_sharded(final)
    assert (final / "dcp" / ".metadata").is_file() and not list(tmp_path.glob("*.tmp"))
    state = ck.load_trainer_state(final)
    assert state == {"note": 1, "step": 3, "format": "dcp"}
    hf = load_file(final / "model.safetensors")
    assert all(torch.equal(hf[k], v) for k, v in model.state_dict().items())

    other, _ = build_tiny_model(seed=1, tokenizer=tokenizer)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    other_opt = torch.optim.AdamW(other.parameters(), lr=5.0, weight_decay=0.0)
    dist.load_sharded_state(other, other_opt, final / ck.DCP_DIR)
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), k
    want, got = opt.state_dict(), other_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]  # lr, weight decay restored too
    for i, s in want["state"].items():
        for key, v in s.items():
            assert torch.equal(got["state"][i][key], v), (i, key)


def test_incomplete_checkpoints_are_never_picked(tmp_path, tokenizer):
    """latest_checkpoint (and evaluate.py's run-folder resolution): a later folder without dcp/.metadata, without
    HF weights or without trainer_state.pt is skipped, as are *.tmp folders; a previous-format folder
    (trainer_state.pt, no dcp/, no COMPLETE.json) counts."""
    from stapo.evaluation.model_source import resolve_model_source

    def picked(root: Path) -> Path | None:
        latest = ck.latest_checkpoint(root)
        src = resolve_model_source(str(root.parent))  # evaluate.py --model <run dir>: the same rule
        assert src.kind == "checkpoint" and src.path == str(latest.resolve())
        return latest

    model, opt = _model_and_optimizer(tokenizer)
    root = tmp_path / "run" / "checkpoints"
    good = ck.save_checkpoint(root, 1, model, tokenizer, {}, optimizer=opt)
    for step, drop in ((2, "dcp/.metadata"), (3, "model.safetensors"), (4, "trainer_state.pt")):
        broken = root / f"step_{step:06d}"
        shutil.copytree(good, broken)
        (broken / drop).unlink()
        assert picked(root) == good, drop
    shutil.copytree(good, root / "step_000005.tmp")
    assert picked(root) == good
    previous = root / "step_000006"
    shutil.copytree(good, previous)
    shutil.rmtree(previous / "dcp")
    (previous / ck.MARKER).unlink()  # the previous format had no completeness marker
    assert picked(root) == previous and not ck.is_sharded(previous)


def test_a_crash_during_a_save_keeps_the_finished_checkpoints(tmp_path, tokenizer, monkeypatch):
    """A full disk in the HF export (after dcp/ was written): one CheckpointSaveError naming the folder, the OS
    error and the intact latest checkpoint; the partial folder is removed (its space freed), the checkpoints
    written before stay; the next save works and keep_last prunes the oldest."""
    model, opt = _model_and_optimizer(tokenizer)
    ck.save_checkpoint(tmp_path, 1, model, tokenizer, {}, optimizer=opt, keep_last=2)
    ck.save_checkpoint(tmp_path, 2, model, tokenizer, {}, optimizer=opt, keep_last=2)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "export_hf", disk_full)
    with pytest.raises(ck.CheckpointSaveError) as err:
        ck.save_checkpoint(tmp_path, 3, model, tokenizer, {}, optimizer=opt, keep_last=2)
    assert str(err.value) == (f"saving checkpoint {tmp_path / 'step_000003'} failed: [Errno 28] No space left on "
                              f"device; the partial folder was removed and the latest checkpoint "
                              f"{tmp_path / 'step_000002'} is intact")
    assert ck.latest_checkpoint(tmp_path).name == "step_000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]
    monkeypatch.undo()
    ck.save_checkpoint(tmp_path, 3, model, tokenizer, {}, optimizer=opt, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]


def test_a_save_failure_without_an_os_error_names_the_cause_and_the_storage(tmp_path, tokenizer, monkeypatch):
    """torch's C++ writer drops the OS error (``RuntimeError: ... file write failed``), and DCP wraps it in a
    ``CheckpointException`` (a BaseException): the message gives the innermost error's first line and the free
    space of the checkpoint folder's file system."""
    from torch.distributed.checkpoint.api import CheckpointException

    model, opt = _model_and_optimizer(tokenizer)

    def dcp_fails(*args, **kwargs):
        inner = RuntimeError("[enforce fail at inline_container.cc:672] . file write failed\nmore")
        raise CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (inner, None)})

    monkeypatch.setattr(dist, "save_sharded_state", dcp_fails)
    with pytest.raises(ck.CheckpointSaveError) as err:
        ck.save_checkpoint(tmp_path, 1, model, tokenizer, {}, optimizer=opt)
    message = str(err.value)
    assert message.startswith(f"saving checkpoint {tmp_path / 'step_000001'} failed: RuntimeError: [enforce fail "
                              f"at inline_container.cc:672] . file write failed (file system of {tmp_path}: ")
    assert " MiB free" in message and message.endswith("no earlier checkpoint exists (the run restarts from step 0)")
    assert "\n" not in message and list(tmp_path.iterdir()) == []


def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path, tokenizer):
    model, opt = _model_and_optimizer(tokenizer)
    final = ck.save_checkpoint(tmp_path, 1, model, tokenizer, {}, optimizer=opt)
    wider, _ = build_tiny_model(hidden_size=96, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"step_000001/dcp: cannot load the sharded checkpoint .*another model/optimizer.*Size mismatch") as err:
        dist.load_sharded_state(wider, torch.optim.AdamW(wider.parameters()), final / ck.DCP_DIR)
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"nothing/\.metadata not found"):
        dist.load_sharded_state(model, opt, tmp_path / "nothing")
    with pytest.raises(ValueError, match="keep_last"):
        ck.save_checkpoint(tmp_path, 2, model, tokenizer, {}, optimizer=opt, keep_last=0)
    with pytest.raises(FileNotFoundError, match="trainer_state.pt not found"):
        ck.load_trainer_state(tmp_path / "nothing")


def test_export_of_a_model_with_weight_conversions_falls_back_to_save_pretrained(tmp_path, tokenizer, monkeypatch):
    """Models whose transformers class renames / fuses weights on save (``_plain_names`` False) are exported by
    ``save_pretrained`` of the gathered state dict: the same tensors in the requested dtype."""
    from safetensors.torch import load_file

    model, _ = build_tiny_model(tokenizer=tokenizer)
    monkeypatch.setattr(ck, "_plain_names", lambda model, meta: False)
    ck.export_hf(model, tmp_path / "fallback", tokenizer, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "fallback" / "config.json").read_text())["dtype"] == "bfloat16"
    got = load_file(tmp_path / "fallback" / "model.safetensors")
    sd = model.state_dict()
    assert got.keys() == sd.keys()
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, sd[k].to(torch.bfloat16)), k


@pytest.mark.slow  # `pytest -m slow` (keeps the default suite near 10 min)
def test_resume_past_a_damaged_shard_uses_the_previous_checkpoint_and_says_so(tmp_path):
    """train.py --resume when the latest checkpoint lost a dcp/ shard file: COMPLETE.json lists it, so the
    checkpoint is reported in one line naming it and the file, and the run resumes from the previous one
    (the damaged-checkpoint cases: tests/test_resume_guard.py)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(repo)}
    base = [sys.executable, str(repo / "train.py"), "--config", str(repo / "configs" / "tiny_test.yaml"),
            f"trainer.output_dir={tmp_path}", "trainer.run_name=r"]
    first = subprocess.run(base, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    last = tmp_path / "r" / "checkpoints" / "step_000002"
    (last / ck.DCP_DIR / "__0_0.distcp").unlink()
    res = subprocess.run(base + ["trainer.total_steps=3", "--resume"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if "is damaged" in line]
    assert lines == [f"resuming from step_000001: {last} is damaged: dcp/__0_0.distcp is missing"], res.stderr[-2000:]
    assert "Traceback" not in res.stderr

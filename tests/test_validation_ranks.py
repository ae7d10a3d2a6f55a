"""Validation on every rank (stapo/evaluation/validation.py, stapo/evaluation/runner.py::evaluate_problems with
``ctx``): the hook on 2 spawned gloo ranks, each with its own HF engine on the tiny model, against one process.

Setup: the first 5 problems of the generated ``arith_test`` benchmark (no data root needed), N = 2, 8 new tokens,
6 samples per engine call → blocks of 3 and 2 problems. Rank 0 generates positions [0, 2] of the first block and
[0] of the second, rank 1 positions [1] and [1]. Each problem is seeded by its position in the block's call, so the
two ranks produce the one-process records (compared field by field, ``grade_seconds`` aside), files and metrics.

The spawned workers run four cases in one start-up (the cost is the processes' imports): replicated ranks; a resume
into a store that a crash left with the first block, one record of the second and a torn line; FSDP2-sharded ranks
with the HF engine (``lockstep``: rank 1 pads its calls to rank 0's size, ``generate(synced_gpus=True)``); and an
engine that fails on rank 1 (both ranks raise, none hangs); and ranks that loaded different problems (both refuse).
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
HOOK = dict(benchmarks=["arith_test"], limit=5, samples=2, settings=["t1.0_p1.0"], samples_per_call=6, seed=3)
FILE = Path("validation") / "step_000003" / "generations" / "arith_test__t1.0_p1.0.jsonl"
METRICS = Path("validation") / "step_000003" / "metrics.json"

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class RecordingEngine:
    """The HF engine, recording each call's prompt count and ``prompt_indices`` (``backend`` passes through, so the
    hook sees an HF engine); ``fail`` raises instead of generating."""

    def __init__(self, inner, fail: bool = False):
        self.inner, self.fail, self.calls = inner, fail, []
        self.backend = inner.backend

    def generate(self, prompts, n, sampling, progress=None):
        self.calls.append((len(prompts), None if sampling.prompt_indices is None else list(sampling.prompt_indices)))
        if self.fail:
            raise RuntimeError("engine broke")
        return self.inner.generate(prompts, n, sampling)


def _parts():
    """The config, tokenizer, tiny policy (``model.path: tiny``) and validation hook (its grader pool is reused)."""
    from stapo.config import load_config
    from stapo.evaluation import make_validation_hook
    from stapo.model.models import build_tiny_model, load_tokenizer

    tok = load_tokenizer("embedded:smollm2")
    return (load_config(REPO / "configs" / "tiny_test.yaml"), tok, build_tiny_model(seed=0, tokenizer=tok)[0],
            make_validation_hook(**HOOK))


def _trainer(parts, run_dir, ctx=None, fail: bool = False, fsdp2: bool = False):
    """A trainer-like object for the hook: its own copy of the policy (FSDP2: sharded) and a recording HF engine."""
    from stapo.model import distributed as dist
    from stapo.rollout import build_rollout_engine

    cfg, tok, model, _ = parts
    model = copy.deepcopy(model)
    if fsdp2:
        model = dist.wrap_policy(model, ctx)
    engine = RecordingEngine(build_rollout_engine("hf", model, tok), fail=fail)
    return SimpleNamespace(cfg=cfg, model=model.train(), tokenizer=tok, engine=engine, run_dir=Path(run_dir),
                           dist=ctx if ctx is not None else dist.DistContext())


def _worker(rank: int, store: str, out: str) -> None:
    from stapo.model import distributed as dist

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    res: dict = {}
    parts = _parts()
    hook = parts[3]
    try:
        for case, strategy in (("replicate", "replicate"), ("resume", "replicate"), ("fsdp2", "fsdp2")):
            ctx = dist.DistContext(world=2, rank=rank, strategy=strategy)
            trainer = _trainer(parts, Path(out) / case, ctx, fsdp2=strategy == "fsdp2")
            res[case] = {"metrics": hook(trainer, 3), "calls": trainer.engine.calls,
                         "training": trainer.model.training}
        trainer = _trainer(parts, Path(out) / "fail", dist.DistContext(world=2, rank=rank, strategy="replicate"),
                           fail=rank == 1)
        try:
            hook(trainer, 3)
            res["fail"] = None
        except Exception as e:  # noqa: BLE001 - what each rank raised is the assertion
            res["fail"] = f"{type(e).__name__}: {e}"
        # ranks that loaded different problems (rank 1 one fewer): every rank refuses before generating
        from stapo.tasks.data import Record
        from stapo.evaluation.config import DecodingSetting
        from stapo.evaluation.runner import Problem, evaluate_problems

        problems = {"arith_test": [Problem("arith_test", i, Record(f"arith_test/{i}", "1 + 1?", "2", "arith_test"),
                                           [1, 2]) for i in range(5 - rank)]}
        try:
            evaluate_problems(None, None, problems, samples={"arith_test": 2}, out_dir=Path(out) / "mismatch",
                              settings=[DecodingSetting("t1.0_p1.0", 1.0, 1.0)], max_new_tokens=8,
                              samples_per_call=6, ctx=dist.DistContext(world=2, rank=rank, strategy="replicate"))
            res["mismatch"] = None
        except Exception as e:  # noqa: BLE001
            res["mismatch"] = f"{type(e).__name__}: {e}"
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
        torch.distributed.barrier()
    finally:
        hook.close()
        torch.distributed.destroy_process_group()


def _records(path: Path) -> list[dict]:
    """The file's records in file order, without the timing field."""
    return [{k: v for k, v in json.loads(line).items() if k != "grade_seconds"}
            for line in path.read_text().splitlines() if line.strip()]


def _metrics_file(run: Path) -> dict:
    doc = json.loads((run / METRICS).read_text())
    doc["run"] = {k: v for k, v in doc["run"].items() if k not in ("seconds", "tokens_per_s")}
    return doc


def test_two_ranks_validate_like_one_process(tmp_path):
    parts = _parts()
    one = _trainer(parts, tmp_path / "one")
    try:
        ref = parts[3](one, 3)
    finally:
        parts[3].close()
    assert one.engine.calls == [(3, None), (2, None)]  # one process: both blocks whole, seeds by position
    ref_records = _records(tmp_path / "one" / FILE)
    assert len(ref_records) == 10 and len({r["block"] for r in ref_records}) == 2
    # the store a crash left: the first block, the second block's first record, a torn line
    lines = (tmp_path / "one" / FILE).read_text().splitlines(keepends=True)
    (tmp_path / "out" / "resume" / FILE).parent.mkdir(parents=True)
    (tmp_path / "out" / "resume" / FILE).write_text("".join(lines[:7]) + lines[7][:20])

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path / "store"), str(tmp_path / "out"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    res = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    for case in ("replicate", "resume", "fsdp2"):
        run = tmp_path / "out" / case
        assert _records(run / FILE) == ref_records, case  # the same samples, grades and order as one process
        for r in (0, 1):
            assert res[r][case]["metrics"] == ref, (case, r)  # every rank returns the one-process metrics
            assert res[r][case]["training"]  # the hook restores the training mode
        got, want = _metrics_file(run), _metrics_file(tmp_path / "one")
        if case == "resume":  # fewer blocks generated; the metrics of the whole store are the same
            assert (got["run"]["blocks"], got["run"]["generated"], got["run"]["written"]) == (1, 4, 3)
            got["run"], want["run"] = {}, {}
        assert got == want, case
    # each rank generated its share, seeded by the position in the block's call
    assert res[0]["replicate"]["calls"] == [(2, [0, 2]), (1, [0])]
    assert res[1]["replicate"]["calls"] == [(1, [1]), (1, [1])]
    assert res[0]["resume"]["calls"] == [(1, [0])] and res[1]["resume"]["calls"] == [(1, [1])]  # block 2, whole
    # FSDP2 + HF: every rank the same calls with the same number of prompts (rank 1 pads with its first problem)
    assert res[0]["fsdp2"]["calls"] == [(2, [0, 2]), (1, [0])]
    assert res[1]["fsdp2"]["calls"] == [(2, [1, 1]), (1, [1])]
    # a failing engine on rank 1: rank 1 raises its own error, rank 0 one naming rank 1; nothing written
    assert res[1]["fail"] == "RuntimeError: engine broke"
    assert res[0]["fail"] == "EvalError: validation: rank 1 failed (RuntimeError: engine broke)"
    assert not (tmp_path / "out" / "fail" / FILE).exists()
    for r in (0, 1):
        assert res[r]["mismatch"].startswith("EvalError: validation: rank 1 planned other blocks than rank 0"), r


def test_shard_positions_by_hand():
    from stapo.evaluation.runner import shard_positions

    assert shard_positions(5, 2, 0) == [0, 2, 4] and shard_positions(5, 2, 1) == [1, 3]
    assert shard_positions(1, 2, 1) == [] and shard_positions(3, 1, 0) == [0, 1, 2]
    assert sorted(i for r in range(3) for i in shard_positions(7, 3, r)) == list(range(7))


class SeedEchoEngine:
    """A stand-in engine: every response is its prompt's seed (``SamplingParams.seeds``) plus its sample index."""

    backend = "stand-in"

    def generate(self, prompts, n, sampling, progress=None):
        from stapo.rollout import Response

        seeds = sampling.seeds(len(prompts))
        return [Response(group=g, prompt_ids=list(p), response_ids=[1, 2], text=f"\\boxed{{{seeds[g] + j}}}",
                         engine_logprobs=None, finish_reason="eos", index=j)
                for g, p in enumerate(prompts) for j in range(n)]


def test_a_step_folder_of_other_settings_is_not_resumed(tmp_path):
    """A validation restarted on a step folder that holds the samples of another ``validation.seed`` (a crash in
    the step-0 validation, then a changed config) generates them again instead of resuming the old ones."""
    from stapo.config import load_config
    from stapo.evaluation import make_validation_hook
    from stapo.evaluation.validation import MANIFEST
    from stapo.model.models import load_tokenizer

    trainer = SimpleNamespace(cfg=load_config(REPO / "configs" / "tiny_test.yaml"),
                              tokenizer=load_tokenizer("embedded:smollm2"), engine=SeedEchoEngine(), run_dir=tmp_path)
    path = tmp_path / FILE.parent.parent
    seeds = {}
    hook = make_validation_hook(**HOOK)
    try:
        for seed in (3, 4, 4):
            hook.seed = seed
            hook(trainer, 3)
            seeds[seed] = {r["seed"] for r in _records(tmp_path / FILE)}
            assert json.loads((path / MANIFEST).read_text())["seed"] == seed
    finally:
        hook.close()
    assert len(_records(tmp_path / FILE)) == 10 and seeds[3].isdisjoint(seeds[4])  # all regenerated with seed 4


def test_validation_samples_per_call_from_the_config():
    from stapo.config import ConfigError, TrainConfig, load_config, merge_config
    from stapo.evaluation import make_validation_hook_from_config

    base = REPO / "configs" / "tiny_test.yaml"
    keys = ["trainer.val_every=1", "validation.benchmarks=[arith_test]", "data.synthetic.split=train"]
    assert make_validation_hook_from_config(load_config(base, keys)).samples_per_call == 256  # the default
    hook = make_validation_hook_from_config(load_config(base, [*keys, "validation.samples_per_call=4096"]))
    assert hook.samples_per_call == 4096
    with pytest.raises(ConfigError, match=r"'validation.samples_per_call' \(0\)"):
        load_config(base, [*keys, "validation.samples_per_call=0"])
    # the verl preset (paper configs): the whole validation (3,200 responses) in one call, split over the ranks
    assert merge_config(TrainConfig, REPO / "configs" / "validation" / "verl.yaml", None).validation.samples_per_call \
        == 4096


def _train_py(out: Path, ranks: int) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}"]
              if ranks > 1 else [sys.executable])
    cmd = [*launch, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny_test.yaml"),
           f"trainer.output_dir={out}", "trainer.run_name=v", "trainer.total_steps=1", "trainer.save_every=0",
           "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "trainer.val_every=1",
           "trainer.val_before_train=true", "validation.benchmarks=[arith_test]", "data.synthetic.split=train",
           "validation.limit=3", "validation.samples=2", "validation.samples_per_call=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.slow  # two train.py runs (~1 min on 2 idle cores)
def test_train_py_on_two_ranks_validates_like_one_process(tmp_path):
    """train.py's wiring under torchrun: every rank enters the hook at step 0 (trainer.val_before_train) and after
    step 1 (trainer.val_every); the step-0 validation (the same initial weights) gives the one-process records and
    metrics row, and the step-1 one is logged once with the same keys."""
    _train_py(tmp_path / "one", 1)
    _train_py(tmp_path / "two", 2)
    rows = {}
    for name in ("one", "two"):
        run = tmp_path / name / "v"
        rows[name] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
        assert [r["step"] for r in rows[name]] == [0, 1]
    val = lambda row: {k: v for k, v in row.items() if k.startswith("val-")}  # noqa: E731
    assert val(rows["two"][0]) == val(rows["one"][0]) and val(rows["one"][0])
    assert val(rows["two"][1]).keys() == val(rows["one"][1]).keys()
    step0 = Path("validation") / "step_000000" / "generations" / "arith_test__t1.0_p1.0.jsonl"
    assert _records(tmp_path / "two" / "v" / step0) == _records(tmp_path / "one" / "v" / step0)

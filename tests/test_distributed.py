"""Data parallelism in our trainer (stapo/model/distributed.py): CPU, gloo, 2 processes, the tiny model, the toy reward.

The 2-rank runs use torchrun on tests/toy_run.py with 4 prompts per step and 2 per mini-batch (two optimizer steps
per training step, so rank r holds its half of EACH mini-batch) and ``--uneven-reward``: global prompt 1 gets −1
for all its responses (Â = 0), so in the first mini-batch every S2T candidate is on rank 0 and rank 1 has none.
They are compared with a one-process run of the same global batch (in this process).

Subprocesses run with TORCHDYNAMO_DISABLE=1: the token-statistics kernel would otherwise be compiled by inductor
in every new process (5–10 s each); its uncompiled body computes the same values (float rounding aside).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from stapo.core.minibatch import minibatch_loss_denominator
from stapo.model import distributed as dist
from stapo.config import ConfigError, load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COMMON = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "trainer.save_every=1",
          "trainer.save_rollouts=true"]
_NOISY = ("timing_s/", "perf/")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONHASHSEED": "0",
            "PYTHONPATH": str(REPO)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, *overrides: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(REPO / "tests" / "toy_run.py"), str(out), "--uneven-reward", *COMMON, *overrides]
    # ~20 s on 2 idle cores; generous for a loaded machine (a collective hang would otherwise never end)
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]


def _rows(run: Path) -> list[dict]:
    """The run's metrics.jsonl rows, NaN / ±inf as floats (stapo.run.tracking.read_metrics), as train() returns them."""
    from stapo.run.tracking import read_metrics

    return read_metrics(run / "toy" / "metrics.jsonl")


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "toy" / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def _assert_same_metrics(got: list[dict], ref: list[dict], rel: float = 1e-4, abs_: float = 1e-5) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        keys = {k for k in r if not k.startswith(_NOISY)}
        assert keys == {k for k in g if not k.startswith(_NOISY)}
        for k in keys:
            if k.startswith(("actor/s2t/num_", "actor/s2t_random/num_", "actor/num_kept")) or k.endswith("/count"):
                assert g[k] == r[k], (r["step"], k, g[k], r[k])  # token counts: exactly the same mask
            else:  # NaN (e.g. a mean over an empty quadrant) equals NaN
                assert g[k] == pytest.approx(r[k], rel=rel, abs=abs_, nan_ok=True), (r["step"], k, g[k], r[k])


def _assert_same_weights(got: dict, ref: dict, atol: float) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=atol, msg=k)


def _train_one_thread(trainer) -> list[dict]:
    """``trainer.train()`` with 1 torch thread (the one-process reference of the 2-rank runs, which use 1 each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return trainer.train()
    finally:
        torch.set_num_threads(threads)


# --- runs shared by the tests (module scope: each is run once) -------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """One process, the same global batch; records each reward call's rewards."""
    out = tmp_path_factory.mktemp("one_rank")
    trainer = make_trainer(str(out), COMMON, uneven_reward=True)
    calls = []
    inner = trainer.reward_fn

    def recording(texts, golds):
        out = inner(texts, golds)
        calls.append(list(out.rewards))
        return out

    trainer.reward_fn = recording
    _train_one_thread(trainer)
    yield out, calls
    shutil.rmtree(out, ignore_errors=True)  # a module's ~200 MB of checkpoints freed when its tests are done (pytest keeps factory folders to the end)


@pytest.fixture(scope="module")
def replicate_run(tmp_path_factory):
    """2 ranks, replicated policy + explicit gradient all-reduce; share_prompt and fused_forward on (several
    forwards before the backwards)."""
    out = tmp_path_factory.mktemp("replicate")
    _torchrun(out, "trainer.data_parallel=replicate", "actor.share_prompt=true", "actor.fused_forward=true")
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """2 ranks, FSDP2 fully_shard on CPU/gloo, fused_forward on."""
    out = tmp_path_factory.mktemp("fsdp2")
    _torchrun(out, "trainer.data_parallel=fsdp2", "actor.fused_forward=true")
    yield out
    shutil.rmtree(out, ignore_errors=True)


# --- tests -----------------------------------------------------------------------------------------------------
def test_uneven_reward_leaves_rank_1_without_candidates_in_the_first_mini_batch(one_rank):
    """The precondition of the uneven case, on the one-process run: per step, prompt 0's rewards vary (Â ≠ 0, so
    candidates: the tiny model gives every token p < τ_p) and prompt 1's are all −1 (Â = 0: no candidates).
    With 2 ranks, prompt 0 is rank 0's and prompt 1 rank 1's half of mini-batch 0."""
    out, calls = one_rank
    G = 4
    assert len(calls) == 2
    for rewards in calls:
        assert len(set(rewards[:G])) == 2 and set(rewards[G:2 * G]) == {-1.0}
    for row in _rows(out):
        assert row["actor/s2t/num_candidates"] > 0 and 0 < row["actor/s2t/num_masked"] < row["actor/s2t/num_candidates"]


def test_two_replicated_ranks_match_one_process(one_rank, replicate_run):
    """Same S2T masks (counts, τ_h), loss, grad norm and every other logged metric; same weights after 2 steps
    (4 AdamW steps). Weight tolerance: share_prompt's forward rounds differently, and Adam's normalised step
    turns gradient rounding into ~1e-5 weight differences (a one-process run with share_prompt differs by as
    much); a wrong gradient would move weights by O(lr) = 1e-3."""
    ref_dir, _ = one_rank
    _assert_same_metrics(_rows(replicate_run), _rows(ref_dir))
    _assert_same_weights(_weights(replicate_run, 2), _weights(ref_dir, 2), atol=5e-5)


def test_two_ranks_save_the_same_rollouts_and_completions_as_one_process(one_rank, replicate_run):
    """The rollouts files and completions tables hold every rank's responses, ordered by global prompt index: the
    same responses, rewards, advantages and silenced tokens as one process (the same S2T mask)."""
    from stapo.train.samples import read_rollouts, rollouts_path

    ref_dir, _ = one_rank
    for step in (1, 2):
        got, ref = (read_rollouts(rollouts_path(d / "toy", step)) for d in (replicate_run, ref_dir))
        assert len(got) == len(ref) == 16  # 4 prompts × G = 4, both ranks' halves
        for key in ("prompt_index", "sample", "prompt_id", "token_ids", "reward", "silenced", "num_silenced"):
            assert [r[key] for r in got] == [r[key] for r in ref], (step, key)
        assert [r["advantage"] for r in got] == pytest.approx([r["advantage"] for r in ref], abs=1e-6)
    tables = [[json.loads(line) for line in (d / "toy" / "tables.jsonl").read_text().splitlines()]
              for d in (replicate_run, ref_dir)]
    got, ref = ([t for t in ts if t["name"] == "completions"] for ts in tables)
    assert [(t["step"], len(t["rows"])) for t in got] == [(t["step"], len(t["rows"])) for t in ref]
    assert [(t["step"], len(t["rows"])) for t in ref] == [(1, 16), (2, 16)]


def test_two_fsdp2_ranks_match_one_process(one_rank, fsdp2_run):
    ref_dir, _ = one_rank
    _assert_same_metrics(_rows(fsdp2_run), _rows(ref_dir))
    # FSDP2 keeps every row's graph in fused_forward (no data-dependent micro-batch split: its forwards are
    # collectives), the reference splits by advantage sign: another gradient summation order, same tolerance.
    _assert_same_weights(_weights(fsdp2_run, 2), _weights(ref_dir, 2), atol=5e-5)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(fsdp2_run / "toy" / "checkpoints" / "step_000002")
    assert cfg.architectures == ["Qwen3ForCausalLM"]  # rank 0 wrote a plain HF checkpoint


def test_two_fsdp2_ranks_resume_from_a_checkpoint(fsdp2_run, tmp_path):
    """Restart the FSDP2 run from its step-1 checkpoint (every rank loads it; optimizer state via the full
    optimizer state dict; per-rank RNG states): step 2 reproduces the uninterrupted run exactly."""
    run = tmp_path / "resumed"
    shutil.copytree(fsdp2_run, run)
    shutil.rmtree(run / "toy" / "checkpoints" / "step_000002")  # as if killed after the step-1 checkpoint
    _torchrun(run, "trainer.data_parallel=fsdp2", "actor.fused_forward=true", "trainer.resume=auto")
    _assert_same_metrics(_rows(run), _rows(fsdp2_run), rel=1e-6, abs_=1e-7)
    _assert_same_weights(_weights(run, 2), _weights(fsdp2_run, 2), atol=0)


def test_batch_size_not_divisible_by_the_world_size_is_a_start_up_error(tmp_path):
    """train.py on 2 ranks (torchrun's environment) with 3 prompts per step: exit 2 on both ranks, rank 0 prints
    one line naming the key, rank 1 nothing (torchrun then reports the failed children itself)."""
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny_test.yaml"),
             f"trainer.output_dir={tmp_path}", "data.train_batch_size=3", "actor.ppo_mini_batch_size=1"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, p in enumerate(procs):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 2, err[-2000:]
        lines = [line for line in err.splitlines() if line.startswith("train.py:")]
        if rank == 0:
            assert len(lines) == 1 and "'data.train_batch_size' (3)" in lines[0] and "divisible" in lines[0]
        else:
            assert lines == []
        assert "Traceback" not in err


def test_start_up_checks_name_the_key():
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", ["data.train_batch_size=4", "actor.ppo_mini_batch_size=1"])
    replicate = dist.DistContext(world=2, rank=0, strategy="replicate")
    with pytest.raises(ConfigError, match=r"'actor.ppo_mini_batch_size' \(1\).*divisible.*\(2\)"):
        dist.check_dp_config(cfg, replicate)
    cfg.actor.ppo_mini_batch_size = 2
    dist.check_dp_config(cfg, replicate)  # fine
    dist.check_dp_config(cfg, dist.DistContext())  # one process: nothing to check
    cfg.actor.share_prompt = True
    dist.check_dp_config(cfg, replicate)  # share_prompt works with replicated ranks
    with pytest.raises(ConfigError, match="'actor.share_prompt'"):
        dist.check_dp_config(cfg, dist.DistContext(world=2, strategy="fsdp2"))
    cfg.actor.share_prompt = False
    cfg.actor.lm_head = "fused"
    dist.check_dp_config(cfg, replicate)  # the fused LM head works with replicated ranks and with sharded ones
    dist.check_dp_config(cfg, dist.DistContext(world=2, strategy="fsdp2"))  # (inside the root's forward)
    cfg.actor.lm_head = "logits"
    cfg.rollout.backend, cfg.rollout.tensor_parallel_size = "vllm", 2
    with pytest.raises(ConfigError, match="'rollout.tensor_parallel_size'"):
        dist.check_dp_config(cfg, replicate)


def test_shard_prompt_indices_by_hand():
    # 4 prompts, mini-batches of 2, 2 ranks: mini-batch 0 = {0, 1}, 1 = {2, 3}; rank r takes its half of each
    assert dist.shard_prompt_indices(4, 2, 2, 0) == [0, 2]
    assert dist.shard_prompt_indices(4, 2, 2, 1) == [1, 3]
    # one mini-batch per step: a contiguous slice of the step's batch
    assert dist.shard_prompt_indices(4, 4, 2, 1) == [2, 3]
    assert dist.shard_prompt_indices(6, 6, 3, 2) == [4, 5]
    assert dist.shard_prompt_indices(3, 3, 1, 0) == [0, 1, 2]
    with pytest.raises(ValueError):
        dist.shard_prompt_indices(4, 2, 3, 0)


def test_prompt_seeds_follow_the_global_prompt_index():
    from stapo.rollout.base import SamplingParams, group_seeds, prompt_seeds

    assert prompt_seeds(11, range(5)) == group_seeds(11, 5)  # offset 0: today's single-process seeds
    sp = SamplingParams(seed=11, prompt_indices=[1, 3])
    assert sp.seeds(2) == [group_seeds(11, 4)[1], group_seeds(11, 4)[3]]
    assert SamplingParams(seed=11).seeds(3) == group_seeds(11, 3) and SamplingParams().seeds(3) is None
    with pytest.raises(ValueError, match="prompt_indices"):
        sp.seeds(3)


def test_merge_stats_sums_counts():
    from stapo.tasks.rewards import RewardStats

    merged = dist.merge_stats([RewardStats(n=4, correct=1, no_answer=2), None, RewardStats(n=4, correct=3)])
    assert (merged.n, merged.correct, merged.no_answer) == (8, 4, 2)
    assert merged.as_dict()["reward/mean"] == pytest.approx((4 * 1 + 4 * -1) / 8)  # recomputed from the sums
    assert dist.merge_stats([None, None]) is None


# --- helpers on two gloo ranks, expected values by hand -----------------------------------------------------
def _helpers_worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = dist.DistContext(world=2, rank=rank, strategy="replicate")
    res = {}
    try:
        # rank 0: 2 rows, 2 kept tokens in row 0; rank 1: 1 row, 1 kept token
        keep = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool) if rank == 0 else torch.tensor([[1, 0, 0]],
                                                                                                     dtype=torch.bool)
        res["denoms"] = [minibatch_loss_denominator(keep, mode, max_response_length=10)
                         for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")]
        res["empty"] = minibatch_loss_denominator(torch.zeros(1, 2, dtype=torch.bool), "token-mean")
        res["max"] = dist.all_reduce({"a": float(rank), "b": 5.0 - rank}, ctx, op="max")
        res["sum"] = dist.all_reduce({"a": float(rank + 1)}, ctx)
        # rows: rank 0 has B=2, R=1; rank 1 has B=1, R=2
        per_row = {"x": torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([3.0])}
        per_tok = {"t": torch.tensor([[10.0], [20.0]]) if rank == 0 else torch.tensor([[30.0, 31.0]])}
        res["rows"] = dist.all_gather_rows(per_row, per_tok, ctx)
        # gradients: rank r's grad = r + 1 everywhere → average 1.5; a parameter without grad → 0
        lin = torch.nn.Linear(2, 2)
        unused = torch.nn.Parameter(torch.ones(3))
        model = torch.nn.Module()
        model.lin, model.unused = lin, unused
        for p in lin.parameters():
            p.grad = torch.full_like(p, float(rank + 1))
        dist.average_gradients(model, ctx, bucket_mb=1e-5)  # tiny buckets: one collective per tensor
        res["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        # FSDP2 on CPU: the layer-by-layer iterator returns the full tensors of a sharded model
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
        full = {k: v.clone() for k, v in net.state_dict().items()}
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            fully_shard(layer)
        fully_shard(net)
        local = {k: v.to_local().shape for k, v in net.state_dict().items()}
        res["fsdp"] = (full, dict(dist.iter_full_state_dict(net)), local)
        torch.save(res, os.path.join(out_dir, f"helpers{rank}.pt"))
        torch.distributed.barrier()  # no rank tears gloo down while the other still communicates
    finally:
        torch.distributed.destroy_process_group()


def test_distributed_helpers_on_two_gloo_ranks(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_helpers_worker, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0
    for rank in (0, 1):
        res = torch.load(tmp_path / f"helpers{rank}.pt", weights_only=False)
        # N = 2 + 1 kept tokens; S = 1 + 1 sequences with a kept token; S·L = 2·10; all-empty clamps to 1
        assert res["denoms"] == [3.0, 2.0, 20.0] and res["empty"] == 1.0
        assert res["max"] == {"a": 1.0, "b": 5.0} and res["sum"] == {"a": 3.0}
        rows, toks = res["rows"]
        assert rows["x"].tolist() == [1.0, 2.0, 3.0]
        assert toks["t"].tolist() == [[10.0, 0.0], [20.0, 0.0], [30.0, 31.0]]  # R = max R_r, right-padded
        grads = res["grads"]
        for k in ("lin.weight", "lin.bias"):
            assert torch.equal(grads[k], torch.full_like(grads[k], 1.5))
        assert torch.equal(grads["unused"], torch.zeros(3))
        full, gathered, local = res["fsdp"]
        # dim-0 shards of [6, 4] (3 + 3 rows) and [3, 6] (2 + 1 rows)
        assert tuple(local["0.weight"]) == (3, 4) and tuple(local["1.weight"]) == ((2, 6) if rank == 0 else (1, 6))
        assert gathered.keys() == full.keys()
        for k in full:
            assert torch.equal(gathered[k], full[k]), k


def test_two_fsdp2_ranks_resume_a_one_process_checkpoint(one_rank, tmp_path):
    """A one-process checkpoint (optimizer state keyed by parameter index) resumed by 2 FSDP2 ranks (which key
    it by name): step 2 matches the uninterrupted one-process run (tolerance as in the FSDP2 comparison)."""
    ref_dir, _ = one_rank
    run = tmp_path / "from_one"
    shutil.copytree(ref_dir, run)
    shutil.rmtree(run / "toy" / "checkpoints" / "step_000002")  # as if stopped after the step-1 checkpoint
    _torchrun(run, "trainer.data_parallel=fsdp2", "trainer.resume=auto")
    _assert_same_metrics(_rows(run), _rows(ref_dir))
    _assert_same_weights(_weights(run, 2), _weights(ref_dir, 2), atol=5e-5)


@pytest.mark.slow  # `pytest -m slow` (keeps the default suite near 10 min)
def test_two_ranks_with_vllm_engines_match_one_process(tmp_path):
    """vLLM-CPU under torchrun: one in-process engine per rank (distributed_executor_backend="external_launcher"),
    weights synced from the policy after every step. Rollout seeds follow the global prompt index, so 2 ranks
    sample what one process samples: the same rewards, masks, loss and gradient norm; the engine's log-probs agree
    with the trainer's (the sync worked). ~90 s on 2 cores."""
    overrides = ["rollout.backend=vllm", "rollout.kv_cache_gib=1", "data.train_batch_size=4",
                 "actor.ppo_mini_batch_size=2"]
    one = tmp_path / "one"
    res = subprocess.run([sys.executable, str(REPO / "tests" / "toy_run.py"), str(one), *overrides], env=_env(),
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(REPO / "tests" / "toy_run.py"), str(two), *overrides, "trainer.data_parallel=replicate"]
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "Traceback" not in res.stderr  # the engines shut down before the process group is destroyed
    _assert_same_metrics(_rows(two), _rows(one))
    for row in _rows(two):
        assert row["rollout/logprob_diff_max"] < 1e-3


# --- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------------------------
def _train_in_process(run: Path, *overrides: str) -> None:
    """Resume / run the toy trainer in this process (1 thread, as the ``one_rank`` reference)."""
    _train_one_thread(make_trainer(str(run), [*COMMON, *overrides], uneven_reward=True))


@pytest.mark.slow  # `pytest -m slow` (keeps the default suite near 10 min)
def test_fsdp2_sharded_checkpoint_resumes_exactly_on_2_ranks_and_1_process_and_rank_0_saves_in_little_memory(
        tmp_path):
    """tests/sharded_ckpt_run.py: 2 FSDP2 gloo ranks, a 40M-parameter tiny Qwen3 (AdamW state 315 MB), one
    synthetic step, ``Trainer.save()`` (HF export in bf16, 16 MB shards), a second step; then resume from the
    checkpoint on 2 ranks and in 1 process and take the same second step. Every full model / optimizer tensor
    (SHA-1 of its bytes), the lr, the loader position and the RNG draws equal the uninterrupted run's, after
    loading and after the step. Rank 0's peak RSS above its baseline during the save stays below half the full
    optimizer state (it writes only its shards; measured ~70 MB), while the previous path — the full optimizer
    state gathered to rank 0 — exceeds that bound in the same run (measured ~360 MB), so the check can fail.
    The bf16 export loads with transformers (sharded files + index) and equals the fp32 state cast to bf16.
    ~70 s on 2 loaded cores."""
    script = str(REPO / "tests" / "sharded_ckpt_run.py")
    env = {**_env(), "MALLOC_MMAP_THRESHOLD_": "65536"}
    for cmd in ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
                 script, "save", str(tmp_path)],
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
                 script, "resume", str(tmp_path)],
                [sys.executable, script, "resume", str(tmp_path)]):
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        assert res.returncode == 0, (cmd[-2], res.stderr[-4000:])
    saved = json.loads((tmp_path / "save.json").read_text())
    ckpt = tmp_path / "toy" / "checkpoints" / "step_000001"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # sharded HF export
    assert sorted(p.name for p in (ckpt / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert "optimizer" not in state and state["step"] == 1 and len(state["rng_per_rank"]) == 2
    bound = saved["optim_bytes"] / 2
    assert saved["optim_bytes"] > 300e6  # 2 fp32 moments of ~39M parameters
    print(f"\nrank 0 peak above baseline ({saved['method']}): Trainer.save() {saved['save_extra'] / 1e6:.1f} MB, "
          f"full optimizer gather {saved['full_gather_extra'] / 1e6:.1f} MB; full optimizer state "
          f"{saved['optim_bytes'] / 1e6:.1f} MB, model {saved['model_bytes'] / 1e6:.1f} MB")
    assert saved["full_gather_extra"] > bound  # the measurement sees a full optimizer state on rank 0
    assert saved["save_extra"] < bound
    for world in (2, 1):
        got = json.loads((tmp_path / f"resume_{world}.json").read_text())
        assert got["step"] == 1 and got["loader"] == saved["loader1"]
        assert got["loaded"] == saved["step1"], world  # model, AdamW moments and steps, lr: bit-identical
        assert got["draws"][0] == saved["draws"][1], world  # RNG state (rank 0's)
        assert got["step2"] == saved["step2"], world  # exact continuation
    assert len(saved["step1"]) > 300
    one = json.loads((tmp_path / "resume_1.json").read_text())
    assert one["hf_dtype"] == "torch.bfloat16" and one["hf_keys_equal"] and one["hf_mismatches"] == []


def test_one_process_resumes_an_fsdp2_checkpoint(fsdp2_run, tmp_path):
    """The 2-rank FSDP2 run's step-1 checkpoint (DTensor shards in dcp/) resumed by one process: step 2 matches the
    uninterrupted 2-rank run (tolerance of the FSDP2 ↔ one-process comparison: another summation order)."""
    run = tmp_path / "to_one"
    shutil.copytree(fsdp2_run, run)
    shutil.rmtree(run / "toy" / "checkpoints" / "step_000002")
    _train_in_process(run, "actor.fused_forward=true", "trainer.resume=auto")
    _assert_same_metrics(_rows(run), _rows(fsdp2_run))
    _assert_same_weights(_weights(run, 2), _weights(fsdp2_run, 2), atol=5e-5)


def test_one_process_resumes_a_replicate_checkpoint(replicate_run, tmp_path):
    """2 replicated ranks write each tensor once (DCP de-duplicates replicated plain tensors); one process resumes
    it: step 2 matches the uninterrupted replicate run (tolerance as in the replicate comparison)."""
    run = tmp_path / "rep_to_one"
    shutil.copytree(replicate_run, run)
    shutil.rmtree(run / "toy" / "checkpoints" / "step_000002")
    _train_in_process(run, "actor.share_prompt=true", "actor.fused_forward=true", "trainer.resume=auto")
    _assert_same_metrics(_rows(run), _rows(replicate_run))
    _assert_same_weights(_weights(run, 2), _weights(replicate_run, 2), atol=5e-5)


def _to_previous_format(ckpt: Path) -> None:
    """Rewrite a one-process checkpoint in the previous format: the full ``optimizer.state_dict()`` (keyed by
    parameter index) in trainer_state.pt, no dcp/ — what train.py wrote before sharded checkpoints."""
    from stapo.model.checkpoint import load_trainer_state

    trainer = make_trainer(str(ckpt.parents[2]), [*COMMON, "trainer.resume=auto"], uneven_reward=True)
    trainer._maybe_resume()  # through dcp/ (exact: see the sharded test)
    state = load_trainer_state(ckpt)
    state.pop("format")
    state["optimizer"] = trainer.optimizer.state_dict()
    torch.save(state, ckpt / "trainer_state.pt")
    shutil.rmtree(ckpt / "dcp")
    (ckpt / "COMPLETE.json").unlink()  # nor a completeness marker


def test_one_process_resumes_a_checkpoint_of_the_previous_format(one_rank, tmp_path):
    """Checkpoints written before dcp/ existed still resume (weights from the HF files, the optimizer from
    trainer_state.pt): step 2 is the uninterrupted one-process run's, exactly."""
    from stapo.model.checkpoint import is_sharded, latest_checkpoint

    ref_dir, _ = one_rank
    run = tmp_path / "previous"
    shutil.copytree(ref_dir, run)
    shutil.rmtree(run / "toy" / "checkpoints" / "step_000002")
    _to_previous_format(run / "toy" / "checkpoints" / "step_000001")
    ckpt = latest_checkpoint(run / "toy" / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000001" and not is_sharded(ckpt)
    _train_in_process(run, "trainer.resume=auto")
    _assert_same_metrics(_rows(run), _rows(ref_dir), rel=0, abs_=0)
    _assert_same_weights(_weights(run, 2), _weights(ref_dir, 2), atol=0)


@pytest.mark.slow
def test_two_fsdp2_ranks_resume_a_checkpoint_of_the_previous_format(one_rank, tmp_path):
    """The previous format resumed by 2 FSDP2 ranks (full optimizer state memory-mapped by every rank, weights
    broadcast from rank 0): as the one-process → FSDP2 resume. ~40 s."""
    ref_dir, _ = one_rank
    run = tmp_path / "previous_fsdp2"
    shutil.copytree(ref_dir, run)
    shutil.rmtree(run / "toy" / "checkpoints" / "step_000002")
    _to_previous_format(run / "toy" / "checkpoints" / "step_000001")
    _torchrun(run, "trainer.data_parallel=fsdp2", "trainer.resume=auto")
    _assert_same_metrics(_rows(run), _rows(ref_dir))
    _assert_same_weights(_weights(run, 2), _weights(ref_dir, 2), atol=5e-5)


@pytest.mark.slow  # `pytest -m slow` (keeps the default suite near 10 min)
def test_two_fsdp2_ranks_with_bf16_compute_train_fp32_master_weights(tmp_path):
    """The paper's precision under FSDP2 (MixedPrecisionPolicy: bf16 all-gather and compute, fp32 reduce-scatter — the
    layers see bf16 weights in the update's forwards) at
    the paper's lr 1e-6 with warm-up 10 and weight decay 0.1 on 2 gloo ranks. One update: the fp32 master weights in
    the sharded checkpoint changed for ≥ 90 % of the elements that got a gradient (bf16 weights would keep ~0.1 %:
    tests/test_precision.py), the AdamW moments are fp32, the HF export is bf16, and the step's metrics agree with
    one process under autocast (another bf16 rounding: entropy and grad norm within 2 %)."""
    # the first step of the paper's schedule (lr 1e-6, 10 warm-up steps → 1e-7) in a one-step run: a warm-up longer
    # than the run is refused (it would never reach actor.lr), so the step's lr is given directly
    paper = ["model.compute_dtype=bfloat16", "actor.lr=1e-7", "actor.warmup_steps=0", "actor.weight_decay=0.1",
             "trainer.total_steps=1"]
    seen = tmp_path / "weight_dtypes.json"
    _torchrun(tmp_path / "fsdp2_bf16", "trainer.data_parallel=fsdp2", f"--record-weight-dtypes={seen}", *paper)
    # FSDP2's MixedPrecisionPolicy is applied: the layers compute with bf16-unsharded weights (autocast alone
    # would show the fp32 parameter here)
    assert json.loads(seen.read_text()) == ["bfloat16"]
    ref = make_trainer(str(tmp_path / "one_bf16"), COMMON + paper, uneven_reward=True)
    ref_rows = ref.train()
    got = _rows(tmp_path / "fsdp2_bf16")[0]
    for k in ("actor/entropy", "actor/grad_norm"):
        assert got[k] == pytest.approx(ref_rows[0][k], rel=2e-2), k
    # the initial weights (seeded), then the 2-rank checkpoint's fp32 master weights and AdamW state loaded into
    # a one-process trainer (dcp resharding)
    again = make_trainer(str(tmp_path / "fsdp2_bf16"), COMMON + paper + ["trainer.resume=auto"])
    before = {n: p.detach().clone() for n, p in again.model.named_parameters()}
    again._maybe_resume()
    assert again.step == 1
    changed = graded = 0
    for n, p in again.model.named_parameters():
        state = again.optimizer.state[p]
        assert p.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32, n
        g = state["exp_avg"] != 0
        changed += int(((p.detach() != before[n]) & g).sum())
        graded += int(g.sum())
    assert graded > 0 and changed / graded >= 0.90, changed / graded
    from safetensors import safe_open

    ckpt = tmp_path / "fsdp2_bf16" / "toy" / "checkpoints" / "step_000001"
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_two_fsdp2_ranks_with_a_sharded_reference_model_match_one_process(tmp_path):
    """GRPO (β = 0.04, k3 KL to the frozen initial policy): under FSDP2 the reference model is sharded like the policy
    (its no-grad forwards are collectives). 2 ranks give the KL, the loss and the weights of one process."""
    grpo = ["algorithm.objective=grpo", "trainer.total_steps=2"]
    _torchrun(tmp_path / "grpo_fsdp2", "trainer.data_parallel=fsdp2", *grpo)
    _train_in_process(tmp_path / "grpo_one", *grpo)
    got, want = _rows(tmp_path / "grpo_fsdp2"), _rows(tmp_path / "grpo_one")
    assert want[1]["actor/kl_loss"] > 0  # step 2: the policy has moved away from the reference
    _assert_same_metrics(got, want)
    _assert_same_weights(_weights(tmp_path / "grpo_fsdp2", 2), _weights(tmp_path / "grpo_one", 2), atol=5e-5)


@pytest.mark.slow  # `pytest -m slow` (keeps the default suite near 10 min)
def test_two_replicated_ranks_with_random_masking_match_one_process(tmp_path):
    """stapo_random (S2T's count of candidates, chosen by a seeded draw): the 2 ranks draw over the all-gathered
    rank-major candidate sequence ([1, N_resp]), the one process over its [n, R] mini-batch rows — the same tokens
    (exact counts), hence the same loss, metrics and weights. As in the other comparisons, mini-batch 0 has every
    candidate on rank 0 (uneven reward). ~25 s on 2 loaded cores."""
    rand = ["algorithm.objective=stapo_random", "trainer.total_steps=2"]
    _torchrun(tmp_path / "rand_2", "trainer.data_parallel=replicate", *rand)
    _train_in_process(tmp_path / "rand_1", *rand)
    got, want = _rows(tmp_path / "rand_2"), _rows(tmp_path / "rand_1")
    assert all(0 < r["actor/s2t_random/num_masked"] < r["actor/s2t_random/num_candidates"] for r in want)
    _assert_same_metrics(got, want)
    _assert_same_weights(_weights(tmp_path / "rand_2", 2), _weights(tmp_path / "rand_1", 2), atol=5e-5)

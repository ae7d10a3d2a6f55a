"""Forks (``trainer.init_from``, docs/runs.md#forks-trainerinit_from): a fresh run that starts from another run's
checkpoint at step k with its own folder, seed and objective (stapo/train/state.py::plan_fork).

One source run (the tiny model, 4 steps, checkpoints at steps 2 and 4, every step's rollouts saved) is shared by the
module; each fork trains 1-2 steps from its step-2 checkpoint.
"""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stapo.common.checkpoint_files import checkpoint_digest  # noqa: E402
from stapo.config import (FORK_MUTABLE_KEYS, ConfigError, TrainConfig, fork_key_changes, load_config,  # noqa: E402
                          to_dict)
from stapo.run.run_identity import NEUTRAL_KEYS, config_digest  # noqa: E402
from stapo.train.prompts import PromptLoader  # noqa: E402
from stapo.train.samples import read_rollouts  # noqa: E402
from toy_run import REPO, make_trainer  # noqa: E402

FAST = ["trainer.log_examples_every=0", "rollout.response_length=4", "trainer.save_rollouts=true"]
SOURCE = ["trainer.total_steps=4", "trainer.save_every=2", "trainer.keep_last=4", *FAST]
_NOISY = ("timing_s/", "perf/")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _comparable(row):
    """The step's metrics but wall-clock times, as JSON text (so NaN equals NaN: the empty quadrants' metrics)."""
    return json.dumps({k: v for k, v in row.items() if not k.startswith(_NOISY)}, sort_keys=True)


def _rollouts(run_dir, step):
    return read_rollouts(Path(run_dir) / "rollouts" / f"step_{step:06d}.jsonl.gz")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The source run (seed 0, STAPO): its run folder, per-step metrics and final weights."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("source")
    trainer = make_trainer(str(out), SOURCE)
    history = trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    torch.set_num_threads(n)
    return {"run_dir": out / "toy", "history": history, "weights": weights,
            "step2": out / "toy" / "checkpoints" / "step_000002"}


def _spy_generate(trainer):
    """Record every rollout call's (prompt token ids, sampling seed, prompt indices)."""
    calls = []
    generate = trainer.engine.generate

    def spy(prompts, n, sampling, **kw):
        calls.append(([list(p) for p in prompts], sampling.seed, sampling.prompt_indices))
        return generate(prompts, n, sampling, **kw)

    trainer.engine.generate = spy
    return calls


def test_fork_with_the_source_seed_and_objective_reproduces_its_steps(tmp_path, source):
    # same seed, same objective: the fork must be the source's steps 3-4 bit for bit, which needs the weights, AdamW
    # moments, scheduler position, step counter and loader position of step 2 (and its RNG) all restored
    trainer = make_trainer(str(tmp_path), [*SOURCE, f"trainer.init_from={source['step2']}"])
    history = trainer.train()
    assert [_comparable(m) for m in history] == [_comparable(m) for m in source["history"][2:]]
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, source["weights"][k]), k
    run_dir = tmp_path / "toy"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 4]
    (launch,) = json.loads((run_dir / "run_info.json").read_text())["launches"]
    assert launch["start_step"] == 2
    step2 = source["step2"]
    assert launch["init_from"] == {"path": str(step2), "step": 2, "digest": checkpoint_digest(step2), "source_seed": 0,
                                   "differs": [f"trainer.init_from: null → '{step2}'",
                                               f"trainer.output_dir: '{source['run_dir'].parent}' → '{tmp_path}'"]}
    assert len(launch["init_from"]["digest"]) == 64


def test_a_pair_of_forks_shares_prompts_and_rollout_seeds(tmp_path, source):
    # branch seed 7, JustRL and STAPO: at step 3 both sample the same prompts with the same per-request seeds
    # (7 * 1_000_003 + 2 = 7_000_023, the step counter being 2 during step 3) from the same step-2 weights, so their
    # responses are identical too; the seed-0 source sampled other prompts with seed 0 * 1_000_003 + 2 = 2
    arms = {}
    for objective in ("justrl", "stapo"):
        trainer = make_trainer(str(tmp_path / objective), [
            *SOURCE, "trainer.total_steps=3", "trainer.seed=7", f"algorithm.objective={objective}",
            f"trainer.init_from={source['step2']}"])
        calls = _spy_generate(trainer)
        (metrics,) = trainer.train()
        arms[objective] = {"calls": calls, "metrics": metrics, "rollouts": _rollouts(tmp_path / objective / "toy", 3)}
    justrl, stapo = arms["justrl"], arms["stapo"]
    assert justrl["calls"] == stapo["calls"]
    ((prompts, seed, indices),) = justrl["calls"]
    assert seed == 7_000_023 and indices is None  # one process: prompt i gets the seed of index i
    fields = ("prompt_index", "prompt_id", "prompt", "sample", "token_ids", "reward")
    pair = [[{f: r[f] for f in fields} for r in arm["rollouts"]] for arm in (justrl, stapo)]
    assert pair[0] == pair[1] and len(pair[0]) == 2 * 4  # 2 prompts x G = 4
    assert justrl["metrics"]["critic/score/mean"] == stapo["metrics"]["critic/score/mean"]

    original = _rollouts(source["run_dir"], 3)
    branch_ids = {r["prompt_id"] for r in justrl["rollouts"]}
    assert branch_ids != {r["prompt_id"] for r in original}
    # the rest of the source's epoch is reshuffled: no prompt the source drew at steps 1-2 comes again in the epoch
    drawn = {r["prompt_id"] for step in (1, 2) for r in _rollouts(source["run_dir"], step)}
    assert not branch_ids & drawn


def test_a_fork_resumes_from_its_own_checkpoint_and_ignores_init_from(tmp_path, source):
    copy = tmp_path / "copy" / "checkpoints" / "step_000002"
    shutil.copytree(source["step2"], copy)
    overrides = [*SOURCE, "trainer.seed=7", f"trainer.init_from={copy}"]
    make_trainer(str(tmp_path), [*overrides, "trainer.total_steps=3"]).train()
    shutil.rmtree(copy)  # the source checkpoint is gone: a resume must not need it
    trainer = make_trainer(str(tmp_path), [*overrides, "trainer.resume=auto"])
    assert trainer.resume_plan.fork is None and trainer.resume_plan.step == 3
    trainer.train()
    launches = json.loads((tmp_path / "toy" / "run_info.json").read_text())["launches"]
    assert [la["start_step"] for la in launches] == [2, 3]
    assert "init_from" in launches[0] and "init_from" not in launches[1]
    # a resume still refuses a changed config, init_from among its keys
    with pytest.raises(ConfigError, match="trainer.init_from"):
        make_trainer(str(tmp_path), [*SOURCE, "trainer.seed=7", "trainer.init_from=elsewhere", "trainer.resume=auto"])


@pytest.mark.parametrize("override, key, words", [
    (None, "trainer.init_from", "not an intact train.py checkpoint folder"),
    ("actor.lr=0.0005", "trainer.init_from", "actor.lr: 0.001 → 0.0005"),
    ("trainer.total_steps=2", "trainer.total_steps", "the fork starts at step 2"),
    ("data.train_batch_size=4", "trainer.init_from", "data.train_batch_size: 2 → 4"),
])
def test_refusals_are_one_line_config_errors_naming_the_key(tmp_path, source, override, key, words):
    init_from = source["run_dir"] if override is None else source["step2"]  # a run folder is not a checkpoint
    with pytest.raises(ConfigError) as err:
        make_trainer(str(tmp_path), [*SOURCE, f"trainer.init_from={init_from}", *([override] if override else [])])
    msg = str(err.value)
    assert "\n" not in msg and f"'{key}'" in msg and words in msg, msg
    if override is None:  # the hint names the run's latest checkpoint
        assert str(source["run_dir"] / "checkpoints" / "step_000004") in msg


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"'trainer.init_from' \(.*nowhere\): no such folder"):
        make_trainer(str(tmp_path), [f"trainer.init_from={tmp_path / 'nowhere'}"])


def test_init_from_is_part_of_run_identity():
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [])
    fork = load_config(REPO / "configs" / "tiny_test.yaml", ["trainer.init_from=runs/trunk/checkpoints/step_000040"])
    assert config_digest(to_dict(cfg)) != config_digest(to_dict(fork))
    assert not any(k == "trainer.init_from" or k == "trainer" for k in NEUTRAL_KEYS)


def test_fork_key_classification():
    """The objective, mask keys, seed and run length may differ from the checkpoint; the lr (resume-mutable) may not;
    every entry of FORK_MUTABLE_KEYS names a key or section of the schema."""
    saved = to_dict(load_config(REPO / "configs" / "tiny_test.yaml"))
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        "algorithm.objective=justrl", "algorithm.s2t.prob_threshold=0.01", "trainer.seed=7", "trainer.total_steps=9",
        "actor.lr=0.002", "actor.ppo_micro_batch_size=2"])
    refused, allowed = fork_key_changes(saved, cfg)
    assert refused == [("actor.lr", 0.001, 0.002)]
    assert [k for k, _, _ in allowed] == ["actor.ppo_micro_batch_size", "algorithm.objective",
                                          "algorithm.s2t.prob_threshold", "trainer.seed", "trainer.total_steps"]
    for key in FORK_MUTABLE_KEYS:
        node = to_dict(TrainConfig())
        for part in key.split("."):
            assert part in node, key
            node = node[part]


def test_loader_branch_keeps_the_drawn_prompts_and_reshuffles_the_rest():
    prompts = [([i], str(i), f"p{i}") for i in range(6)]
    src = PromptLoader(prompts, 2, seed=0)
    src.next_batch()  # position 2 of epoch 0
    state = src.state_dict()
    assert state == {"epoch": 0, "position": 2}  # a plain run's state: no order stored
    a, b, same = (PromptLoader(prompts, 2, seed=s) for s in (7, 7, 0))
    for loader in (a, b, same):
        loader.branch(state, source_seed=0)
    assert list(same._order) == list(src._order)  # the source's seed: its own order, an exact continuation
    assert list(a._order) == list(b._order)  # one branch seed: one stream
    assert list(a._order[:2]) == list(src._order[:2])  # the drawn prompts keep their places
    assert sorted(a._order[2:]) == sorted(src._order[2:])  # the rest: the same prompts, once each
    # a fork's state stores its epoch's order, so a resumed fork (or a fork of it) continues it
    resumed = PromptLoader(prompts, 2, seed=7)
    resumed.load_state_dict(a.state_dict())
    assert [p[2] for p in resumed.next_batch()] == [p[2] for p in a.next_batch()]

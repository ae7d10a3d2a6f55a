"""The step's samples: the completions table and the saved rollouts (stapo/train/samples.py), on the tiny model."""
import gzip
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from stapo.train.samples import (RolloutFileError, completions_table, read_rollouts, rollouts_path, saved_steps,
                                 write_rollouts)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_run import make_trainer  # noqa: E402


def _tables(run_dir):
    return [json.loads(line) for line in (run_dir / "tables.jsonl").read_text().splitlines() if line]


def _capture_steps(trainer):
    """Record each step's StepBatch as the trainer hands it to _log_examples."""
    seen = []
    log = trainer._log_examples

    def spy(sb):
        seen.append(sb)
        return log(sb)

    trainer._log_examples = spy
    return seen


def test_completions_table_and_rollouts_file_match_the_step(tmp_path):
    trainer = make_trainer(str(tmp_path), ["trainer.save_rollouts=true", "trainer.save_every=0"])
    seen = _capture_steps(trainer)
    history = trainer.train()
    run_dir = tmp_path / "toy"
    assert saved_steps(run_dir) == [1, 2]
    tables = _tables(run_dir)
    assert [(t["step"], t["name"]) for t in tables] == [
        (1, "s2t/examples"), (1, "completions"), (2, "s2t/examples"), (2, "completions")]
    for step, (sb, metrics) in enumerate(zip(seen, history), start=1):
        ro = sb.rollout
        table = next(t for t in tables if t["name"] == "completions" and t["step"] == step)
        rows = [dict(zip(table["columns"], r)) for r in table["rows"]]
        # tiny_test.yaml: 2 prompts × G = 4 responses, W = 1 → rows in rollout order
        assert len(rows) == len(ro.responses) == 8
        silenced = ro.batch.response_mask & ~sb.keep  # [B, R] no gradient under the S2T mask
        assert int(silenced.sum()) == metrics["actor/s2t/num_masked"]
        for b, (row, resp) in enumerate(zip(rows, ro.responses)):
            assert (row["step"], row["prompt_index"], row["sample"]) == (step, resp.group, resp.index)
            assert row["response"] == resp.text
            # the toy reward: +1 for an even number of characters, -1 otherwise
            assert row["reward"] == (1.0 if len(resp.text) % 2 == 0 else -1.0)
            assert row["advantage"] == pytest.approx(ro.advantages[b].item(), abs=1e-6)
            assert row["num_silenced"] == int(silenced[b].sum())
            assert row["response_length"] == len(resp.response_ids)
        # GRPO by hand for group 0: Â = (R − mean) / (std(ddof=1) + 1e-6)
        r0 = [row["reward"] for row in rows[:4]]
        mean = sum(r0) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in r0) / 3)
        assert [row["advantage"] for row in rows[:4]] == pytest.approx([(r - mean) / (std + 1e-6) for r in r0],
                                                                       abs=1e-5)
        assert sum(row["num_silenced"] for row in rows) == metrics["actor/s2t/num_masked"]

        recs = read_rollouts(rollouts_path(run_dir, step))
        assert len(recs) == 8
        assert sum(sum(rec["silenced"]) for rec in recs) == metrics["actor/s2t/num_masked"]
        for b, (rec, resp) in enumerate(zip(recs, ro.responses)):
            n = len(resp.response_ids)
            assert all(len(rec[k]) == n for k in ("token_ids", "tokens", "logprobs", "entropy", "silenced"))
            assert rec["token_ids"] == list(resp.response_ids)
            assert rec["silenced"] == silenced[b, :n].int().tolist()
            assert rec["logprobs"] == pytest.approx(sb.old.logprobs[b, :n].tolist(), rel=1e-6)
            assert rec["entropy"] == pytest.approx(sb.old.entropy[b, :n].tolist(), rel=1e-6)
            assert rec["mean_p"] == pytest.approx(sum(math.exp(x) for x in rec["logprobs"]) / n, rel=1e-5)
            assert rec["mean_entropy"] == pytest.approx(sum(rec["entropy"]) / n, rel=1e-5)
            assert rec["mask"] == "s2t" and rec["prompt_id"] == ro.prompts[resp.group][2]
            assert "".join(rec["tokens"]).startswith(resp.text[:5])
    assert any(m["actor/s2t/num_masked"] > 0 for m in history)  # the check above is not all zeros


def test_extracted_answer_is_the_reward_functions_own(tmp_path):
    from stapo.tasks.rewards import make_reward_fn

    trainer = make_trainer(str(tmp_path), ["trainer.total_steps=1", "trainer.save_every=0",
                                           "trainer.save_rollouts=true"])
    strict = make_reward_fn("dapo_strict_box")
    # the tiny model never writes a box: answer one response in four with a boxed 7 (the synthetic gold may differ)
    trainer.reward_fn = lambda texts, golds: strict([t + ("\\boxed{7}" if i % 4 == 0 else "")
                                                     for i, t in enumerate(texts)], golds)
    trainer.train()
    recs = read_rollouts(rollouts_path(tmp_path / "toy", 1))
    assert [r["extracted_answer"] for r in recs] == ["7", None, None, None] * 2
    assert [r["reward"] for r in recs] == [1.0 if r["gold"] == "7" and i % 4 == 0 else -1.0
                                           for i, r in enumerate(recs)]


def test_a_resumed_run_rewrites_redone_steps_and_duplicates_none(tmp_path):
    run_dir = tmp_path / "toy"
    first = make_trainer(str(tmp_path), ["trainer.save_rollouts=true", "trainer.save_every=1"])
    first.train()
    step2 = read_rollouts(rollouts_path(run_dir, 2))
    # a crash after step 2's rows and rollouts but before its checkpoint, and a torn later file
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "step_000002")
    rollouts_path(run_dir, 3).write_bytes(b"\x1f\x8b torn")
    resumed = make_trainer(str(tmp_path), ["trainer.save_rollouts=true", "trainer.save_every=1",
                                           "trainer.total_steps=3", "trainer.resume=auto"])
    resumed.train()
    assert saved_steps(run_dir) == [1, 2, 3]
    assert [(t["step"], t["name"]) for t in _tables(run_dir) if t["name"] == "completions"] == [
        (1, "completions"), (2, "completions"), (3, "completions")]
    redone = read_rollouts(rollouts_path(run_dir, 2))
    assert [r["token_ids"] for r in redone] == [r["token_ids"] for r in step2]  # the same step, rewritten
    assert len(read_rollouts(rollouts_path(run_dir, 3))) == 8
    assert not list((run_dir / "rollouts").glob("*.tmp"))


def _record(prompt_index, sample, n=2):
    return {"step": 1, "prompt_index": prompt_index, "sample": sample, "reward": 1.0, "advantage": 0.5,
            "token_ids": list(range(n)), "tokens": ["a"] * n, "logprobs": [-1.0] * n, "entropy": [0.5] * n,
            "silenced": [0] * n}


def test_completions_table_keeps_whole_groups_up_to_max_rows():
    recs = [_record(g, s) for g in range(3) for s in range(4)]  # 3 groups × 4
    name, cols, rows = completions_table(7, recs, max_rows=9)  # 2 whole groups (8 rows) fit, the third does not
    assert name == "completions"  # one table name for every step (its rows carry their step)
    assert [(r[cols.index("prompt_index")], r[cols.index("sample")]) for r in rows] == [
        (g, s) for g in range(2) for s in range(4)]
    assert len(completions_table(1, recs, max_rows=2)[2]) == 4  # at least one whole group


def test_write_rollouts_is_atomic_and_read_rollouts_names_a_damaged_file(tmp_path):
    path = write_rollouts(tmp_path, 5, [_record(0, 0)])
    assert path == tmp_path / "rollouts" / "step_000005.jsonl.gz"
    before = path.read_bytes()
    with pytest.raises(TypeError):  # a record that cannot be serialised, midway through the file
        write_rollouts(tmp_path, 5, [_record(0, 0), {"step": 5, "bad": object()}])
    assert path.read_bytes() == before  # the previous file is intact
    assert list((tmp_path / "rollouts").iterdir()) == [path]  # no temporary file left behind
    assert write_rollouts(tmp_path, 5, [_record(0, 0)]).read_bytes() == before  # deterministic bytes
    path.write_bytes(before[:-6])  # truncated gzip
    with pytest.raises(RolloutFileError, match=r"step_000005\.jsonl\.gz: not a complete gzip file"):
        read_rollouts(path)
    path.write_bytes(gzip.compress(b'{"step": 1}\n[1, 2]\n'))
    with pytest.raises(RolloutFileError, match="line 2 is not a response record"):
        read_rollouts(path)

"""The evaluation harness end to end with the tiny model (HF engine): evaluate.py outputs, crash + resume,
clear errors, model-path resolution, prompts, reports, compare.py, the validation hook and verifier wiring.

Configuration: configs/eval/tiny_test.yaml — two problems of AIME24 (N=3) and MATH500 (N=2) under both
decoding settings, 8 new tokens, 4 samples per engine call (so AIME24 problems are one block each and the two
MATH500 problems one block: 3 blocks per setting, 6 in all; 2·3 + 2·2 = 10 samples per setting).
"""
from __future__ import annotations

import copy
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stapo.evaluation import EvalError, load_eval_config, run_evaluation  # noqa: E402
from stapo.evaluation.config import DecodingSetting, EvalPromptConfig, validate_eval_config  # noqa: E402
from stapo.evaluation.model_source import EMBEDDED_NAMES, resolve_model_source  # noqa: E402
from stapo.evaluation.runner import Problem, evaluate_problems, resolve_prompt  # noqa: E402
from stapo.evaluation.store import GenerationStore  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY_CFG = REPO / "configs" / "eval" / "tiny_test.yaml"
FILES = {("aime24", "t1.0_p1.0"): 6, ("aime24", "t0.7_p0.9"): 6, ("math500", "t1.0_p1.0"): 4,
         ("math500", "t0.7_p0.9"): 4}  # lines per JSONL: problems × N


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok():
    from stapo.model.models import load_tokenizer

    return load_tokenizer("embedded:smollm2")


@pytest.fixture(scope="module")
def tiny(tok):
    from stapo.model.models import build_tiny_model

    model, _ = build_tiny_model(seed=0, tokenizer=tok)  # the model `model.path: tiny` builds
    return model


@pytest.fixture(scope="module")
def grader():
    from stapo.tasks.grader import MathGrader

    g = MathGrader(num_workers=1, timeout_s=5.0)
    yield g
    g.close()


def tiny_cfg(root, out, *overrides):
    return load_eval_config(TINY_CFG, [f"data.root={root}", f"output.dir={out}", *overrides])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def generations(run_dir: Path) -> dict[tuple[str, str, str, int], dict]:
    """{(benchmark, setting, problem_id, sample): record without timing fields}; asserts no duplicate keys."""
    out = {}
    for path in sorted((run_dir / "generations").glob("*.jsonl")):
        for rec in read_jsonl(path):
            key = (rec["benchmark"], rec["setting"], rec["problem_id"], rec["sample"])
            assert key not in out, f"duplicated generation {key} in {path}"
            out[key] = {k: v for k, v in rec.items() if k != "grade_seconds"}
    return out


def metrics_only(results: dict) -> dict:
    return json.loads(json.dumps(results["metrics"]))


# --- evaluate.py end to end ---------------------------------------------------------------------------
def evaluate_main(argv: list[str]) -> int:
    """``main`` of the repository's evaluate.py (loaded by path: a PyPI package is also called ``evaluate``)."""
    return runpy.run_path(str(REPO / "evaluate.py"), run_name="evaluate_cli")["main"](argv)


def test_evaluate_cli_writes_all_outputs(shared_data_root, tmp_path):
    out = tmp_path / "run"
    rc = evaluate_main(["--config", str(TINY_CFG), "--data-root", str(shared_data_root), "--output", str(out),
                        "output.plot=true"])
    assert rc == 0
    for name in ("results.json", "results.md", "results.csv", "results.png", "eval_manifest.json",
                 "metrics.jsonl", "tables.jsonl"):
        assert (out / name).is_file(), name
    for (bench, setting), lines in FILES.items():
        recs = read_jsonl(out / "generations" / f"{bench}__{setting}.jsonl")
        assert len(recs) == lines
        assert {r["temperature"] for r in recs} == ({1.0} if setting == "t1.0_p1.0" else {0.7})
        assert {r["top_p"] for r in recs} == ({1.0} if setting == "t1.0_p1.0" else {0.9})
        assert all(r["response_tokens"] <= 8 for r in recs)
        assert all(r["status"] in ("correct", "incorrect", "no_answer", "timeout", "error") for r in recs)
    gens = generations(out)  # also asserts unique keys
    assert len(gens) == 20

    res = json.loads((out / "results.json").read_text())
    assert res["label"] == "tiny" and res["complete"] is False and res["paper_protocol"] is False  # data.limit
    assert res["protocol"]["samples"] == {"aime24": 3, "math500": 2}
    assert [s["name"] for s in res["protocol"]["settings"]] == ["t1.0_p1.0", "t0.7_p0.9"]
    for setting in ("t1.0_p1.0", "t0.7_p0.9"):
        for bench, n in (("aime24", 3), ("math500", 2)):
            m = res["metrics"][setting]["benchmarks"][bench]
            assert (m["N"], m["problems"], m["samples"]) == (n, 2, 2 * n)
            # avg@N recomputed here by plain arithmetic from the JSONL: mean over problems of correct / N
            recs = [g for k, g in gens.items() if k[0] == bench and k[1] == setting]
            by_problem: dict[str, list[bool]] = {}
            for r in recs:
                by_problem.setdefault(r["problem_id"], []).append(r["correct"])
            assert m["avg@N"] == pytest.approx(sum(sum(v) / n for v in by_problem.values()) / 2)
            assert m["mean_response_tokens"] == pytest.approx(sum(r["response_tokens"] for r in recs) / (2 * n))
            assert sum(m["grader"].values()) == 2 * n
        avg = res["metrics"][setting]["average"]
        per = res["metrics"][setting]["benchmarks"]
        assert avg["avg@N"] == pytest.approx((per["aime24"]["avg@N"] + per["math500"]["avg@N"]) / 2)
    md = (out / "results.md").read_text()
    assert "| model | AIME24 | MATH500 | Avg |" in md
    assert "| tiny | " in md and "(T=0.7, top-p=0.9) in parentheses" in md
    csv_lines = (out / "results.csv").read_text().strip().splitlines()
    assert len(csv_lines) == 1 + 2 * 3  # header + 2 settings × (2 benchmarks + average)
    tables = [json.loads(line) for line in (out / "tables.jsonl").read_text().splitlines()]
    assert tables[0]["name"] == "eval/summary" and tables[0]["columns"] == ["model", "AIME24", "MATH500", "Avg"]

    # compare.py merges two results into one table (rows named by LABEL=)
    compare = runpy.run_path(str(REPO / "scripts" / "compare.py"), run_name="compare")
    assert compare["main"]([f"GRPO={out}", f"STAPO={out / 'results.json'}", "--out", str(tmp_path / "cmp")]) == 0
    cmp_md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| GRPO | " in cmp_md and "| STAPO | " in cmp_md
    assert (tmp_path / "cmp" / "comparison.png").is_file()
    assert len((tmp_path / "cmp" / "comparison.csv").read_text().strip().splitlines()) == 1 + 2 * 6
    assert compare["main"]([str(out), str(out), "--out", str(tmp_path / "cmp2")]) == 2  # same label twice


def test_crash_and_resume_gives_the_uninterrupted_results(shared_data_root, tmp_path, tok, tiny, grader):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "crashed"
    ref = run_evaluation(tiny_cfg(shared_data_root, ref_dir), model=tiny, tokenizer=tok, grader=grader)
    assert ref["run"]["blocks"] == 6 and ref["run"]["written"] == 20

    class Crash(RuntimeError):
        pass

    seen = []

    def crash_after_two(info):
        seen.append(info)
        if len(seen) == 2:
            raise Crash("simulated kill after 2 blocks")

    with pytest.raises(Crash):
        run_evaluation(tiny_cfg(shared_data_root, run_dir), model=tiny, tokenizer=tok, grader=grader,
                       on_block=crash_after_two)
    # blocks of setting t1.0_p1.0: aime24/60 (3 samples), aime24/61 (3 samples) -> 6 written before the crash
    assert sum(i["written"] for i in seen) == 6
    aime = run_dir / "generations" / "aime24__t1.0_p1.0.jsonl"
    assert len(read_jsonl(aime)) == 6
    # Worse than a clean kill: the last record of that file lost (a block half written) and a torn last line.
    lines = aime.read_text().splitlines(keepends=True)
    aime.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])

    resumed = run_evaluation(tiny_cfg(shared_data_root, run_dir), model=tiny, tokenizer=tok, grader=grader)
    # the half-written block is generated again whole (same composition and seed), only its missing sample is
    # written; the 4 blocks never started are generated: 1 + (20 - 6) = 15 new lines
    assert resumed["run"]["written"] == 15
    assert generations(run_dir) == generations(ref_dir)  # same samples and grades, no duplicates
    assert metrics_only(resumed) == metrics_only(ref)

    # a finished run: nothing to generate, the model is not even loaded (model=None would load "tiny")
    again = run_evaluation(tiny_cfg(shared_data_root, run_dir), tokenizer=tok, grader=grader)
    assert again["run"]["generated"] == 0 and metrics_only(again) == metrics_only(ref)

    # generation settings that differ from the run directory's are refused, naming the field
    with pytest.raises(EvalError, match="max_new_tokens"):
        run_evaluation(tiny_cfg(shared_data_root, run_dir, "generation.max_new_tokens=9"), model=tiny,
                       tokenizer=tok, grader=grader)


def test_store_skips_duplicates_and_rejects_corrupt_lines(tmp_path):
    path = tmp_path / "g.jsonl"
    store = GenerationStore(path)
    assert store.append([{"problem_id": "p", "sample": 0, "x": 1}, {"problem_id": "p", "sample": 1, "x": 2}]) == 2
    assert store.append([{"problem_id": "p", "sample": 1, "x": 3}]) == 0  # already stored
    assert GenerationStore(path).complete("p", 2) and not GenerationStore(path).complete("p", 3)
    path.write_text(path.read_text() + "not json\n")
    with pytest.raises(EvalError, match="line 3 is not a valid generation record"):
        GenerationStore(path)


# --- clear errors ---------------------------------------------------------------------------------------
def run_cli(capsys, *argv) -> tuple[int, str]:
    rc = evaluate_main(list(argv))
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize("model, message", [
    ("{tmp}/runs/x/checkpoints/step_000001", "does not exist"),
    ("{tmp}/no_weights", "has config.json but no weights"),
    ("{tmp}/empty_run", "has no complete checkpoint"),
    ("{tmp}/a_file.txt", "is a file"),
    ("{tmp}/runs", "neither an HF model folder"),
])
def test_malformed_model_paths_give_one_line_errors(capsys, shared_data_root, tmp_path, model, message):
    (tmp_path / "runs").mkdir()
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text("{}")
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "a_file.txt").write_text("x")
    spec = model.format(tmp=tmp_path)
    rc, err = run_cli(capsys, "--config", str(TINY_CFG), "--data-root", str(shared_data_root), "--model", spec,
                      "--output", str(tmp_path / "out"))
    assert rc == 2
    assert err.startswith("evaluate.py: error:") and message in err and "\n" not in err
    assert str(Path(spec).name) in err  # names the path


def test_unknown_benchmark_and_missing_data_give_one_line_errors(capsys, shared_data_root, tmp_path):
    rc, err = run_cli(capsys, "--config", str(TINY_CFG), "--data-root", str(shared_data_root),
                      "--benchmarks", "aime24", "gsm8k")
    assert rc == 2 and "unknown benchmark 'gsm8k'" in err and "aime24, aime25" in err and "\n" not in err
    rc, err = run_cli(capsys, "--config", str(TINY_CFG), "--data-root", str(tmp_path / "nowhere"))
    assert rc == 2 and "nowhere" in err and "not a directory" in err and "\n" not in err
    (tmp_path / "empty_root").mkdir()
    rc, err = run_cli(capsys, "--config", str(TINY_CFG), "--data-root", str(tmp_path / "empty_root"))
    assert rc == 2 and "aime24" in err and "file not found" in err and "\n" not in err
    rc, err = run_cli(capsys, "--config", str(TINY_CFG), "--settings", "t0.5")
    assert rc == 2 and "unknown decoding setting" in err
    rc, err = run_cli(capsys, "--config", str(TINY_CFG), "data.limt=3")
    assert rc == 2 and "did you mean 'data.limit'" in err


def test_cli_error_in_a_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "evaluate.py"), "--benchmarks", "aime2O"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "unknown benchmark 'aime2O'" in proc.stderr


# --- model paths and prompts ----------------------------------------------------------------------------
def fake_run(tmp_path: Path) -> Path:
    """runs/exp with a complete step_000010, a crashed step_000020.tmp and the run's config.json."""
    run = tmp_path / "runs" / "exp"
    for name, complete in (("step_000010", True), ("step_000020.tmp", False)):
        ck = run / "checkpoints" / name
        ck.mkdir(parents=True)
        (ck / "config.json").write_text("{}")
        (ck / "model.safetensors").write_bytes(b"")
        if complete:
            (ck / "trainer_state.pt").write_bytes(b"")
    (run / "config.json").write_text(json.dumps({"data": {"prompt_style": "chat", "system_prompt": "SYS"}}))
    return run


def test_model_source_resolution(tmp_path):
    from stapo.model.models import EMBEDDED_ALIASES

    assert EMBEDDED_NAMES == EMBEDDED_ALIASES
    run = fake_run(tmp_path)
    for spec in (run, run / "checkpoints", run / "checkpoints" / "step_000010"):
        src = resolve_model_source(str(spec))
        assert (src.kind, src.step, src.label) == ("checkpoint", 10, "exp@step_000010")
        assert src.train_prompt() == {"style": "chat", "system_prompt": "SYS"}
    with pytest.raises(EvalError, match="incomplete checkpoint"):
        resolve_model_source(str(run / "checkpoints" / "step_000020.tmp"))
    assert resolve_model_source("embedded:smollm2").kind == "embedded"
    assert resolve_model_source("Qwen/Qwen3-1.7B-Base").kind == "hub"
    with pytest.raises(EvalError, match="does not exist"):
        resolve_model_source(str(tmp_path / "runs" / "nothing"))


def test_prompt_resolution_order(tmp_path):
    src = resolve_model_source(str(fake_run(tmp_path)))
    p = resolve_prompt(EvalPromptConfig(), src)  # from the checkpoint's run config
    assert (p.style, p.system_prompt) == ("chat", "SYS")
    train_yaml = tmp_path / "train.yaml"
    train_yaml.write_text("data:\n  prompt_style: chat\n  system_prompt: FROM_TRAIN\n")
    p = resolve_prompt(EvalPromptConfig(from_train_config=str(train_yaml)), src)
    assert (p.style, p.system_prompt) == ("chat", "SYS")  # the checkpoint's own run config wins
    p = resolve_prompt(EvalPromptConfig(from_train_config=str(train_yaml), from_checkpoint=False), src)
    assert (p.style, p.system_prompt) == ("chat", "FROM_TRAIN")
    p = resolve_prompt(EvalPromptConfig(from_train_config=str(train_yaml)), resolve_model_source("embedded:smollm2"))
    assert (p.style, p.system_prompt) == ("chat", "FROM_TRAIN")  # no run config: the train YAML
    p = resolve_prompt(EvalPromptConfig(from_train_config=str(train_yaml), system_prompt="", style="plain"), src)
    assert (p.style, p.system_prompt) == ("plain", None)  # explicit values win; "" forces no system prompt
    p = resolve_prompt(EvalPromptConfig(from_checkpoint=False), src)
    assert (p.style, p.system_prompt) == ("auto", None)
    with pytest.raises(EvalError, match="prompt.from_train_config"):
        resolve_prompt(EvalPromptConfig(from_train_config=str(tmp_path / "missing.yaml")), src)


def test_cpu_config_uses_the_training_prompt():
    from stapo.config import load_config

    cfg = load_eval_config(REPO / "configs" / "eval" / "cpu_smollm2.yaml")
    train = load_config(REPO / cfg.prompt.from_train_config)
    p = resolve_prompt(cfg.prompt, resolve_model_source(cfg.model.path))
    assert (p.style, p.system_prompt) == (train.data.prompt_style, train.data.system_prompt)
    paper = load_eval_config(REPO / "configs" / "eval" / "paper.yaml")
    assert paper.data.samples == {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva_math": 4,
                                  "olympiadbench": 4}
    assert [(s.temperature, s.top_p) for s in paper.generation.settings] == [(1.0, 1.0), (0.7, 0.9)]
    assert paper.generation.max_new_tokens == 20480


# --- validation hook and verifier -----------------------------------------------------------------------
def test_validation_hook_on_a_trainer_like_object(shared_data_root, tmp_path, tok, tiny):
    from stapo.config import load_config
    from stapo.evaluation import make_validation_hook, make_validation_hook_from_config
    from stapo.rollout import build_rollout_engine

    cfg = load_config(REPO / "configs" / "tiny_test.yaml",
                      [f"data.root={shared_data_root}", "data.max_prompt_length=512"])
    assert make_validation_hook_from_config(cfg) is None  # trainer.val_every = 0
    future = SimpleNamespace(trainer=SimpleNamespace(val_every=2), validation=SimpleNamespace(
        benchmarks=["minerva"], limit=4, samples=2, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=1))
    h = make_validation_hook_from_config(future)  # the fields proposed for TrainConfig.validation
    assert (h.benchmarks, h.samples, h.limit, h.max_new_tokens) == (["minerva_math"], {"minerva_math": 2}, 4, 16)
    assert [(s.name, s.temperature, s.top_p) for s in h.settings] == [("t0.7_p0.9", 0.7, 0.9)]
    model = copy.deepcopy(tiny).train()
    trainer = SimpleNamespace(cfg=cfg, model=model, tokenizer=tok, engine=build_rollout_engine("hf", model, tok),
                              run_dir=tmp_path / "run")
    hook = make_validation_hook(benchmarks=["MATH500"], limit=2, samples=2, settings=["t0.7_p0.9"],
                                data_root=str(shared_data_root))
    try:
        metrics = hook(trainer, 3)
    finally:
        hook.close()
    assert model.training  # the hook restores the training mode
    recs = read_jsonl(tmp_path / "run" / "validation" / "step_000003" / "generations" / "math500__t0.7_p0.9.jsonl")
    assert len(recs) == 4  # 2 problems × N=2
    assert all(r["response_tokens"] <= cfg.rollout.response_length for r in recs)  # capped by the trainer's limit
    # avg@N by hand from the records: mean over the 2 problems of correct/2
    by_problem: dict[str, int] = {}
    for r in recs:
        by_problem[r["problem_id"]] = by_problem.get(r["problem_id"], 0) + r["correct"]
    # (verl's key layout, docs/metrics.md: mean@N is avg@N)
    assert metrics["val-core/math500/acc/mean@2"] == pytest.approx(sum(c / 2 for c in by_problem.values()) / 2)
    assert metrics["val-core/average/acc/mean@2"] == metrics["val-core/math500/acc/mean@2"]
    assert {"val-aux/response_length/clip_ratio", "val-aux/response_length/mean",
            "val-aux/math500/dropped_long_prompt"} <= set(metrics)
    assert (tmp_path / "run" / "validation" / "step_000003" / "metrics.json").is_file()


def test_verifier_turns_rejected_answers_correct_and_is_counted(tmp_path, grader):
    from stapo.tasks.data import Record
    from stapo.evaluation.verifier import VerifierVerdict

    class OneResponseEngine:
        """Every sample answers "\\boxed{1/2}" or "\\boxed{7}" (alternating): the gold is "0.5"."""

        def generate(self, prompts, n, sampling):
            from stapo.rollout import Response

            texts = ["\\boxed{1/2}", "\\boxed{7}"]
            return [Response(group=g, prompt_ids=p, response_ids=[5, 6], text=texts[j % 2], engine_logprobs=None,
                             finish_reason="eos", index=j) for g, p in enumerate(prompts) for j in range(n)]

    class AcceptHalf:
        def __init__(self):
            self.asked = []

        def verify(self, questions, golds, responses):
            self.asked += list(responses)
            return [VerifierVerdict("A" if "1/2" in r else "B", "1/2" in r, "A") for r in responses]

    problems = {"math500": [Problem("math500", 0, Record("math500/x", "What is half?", "0.7", "math500"), [1, 2])]}
    verifier = AcceptHalf()
    res = evaluate_problems(OneResponseEngine(), grader, problems, samples={"math500": 2},
                            settings=[DecodingSetting("t1.0_p1.0", 1.0, 1.0)], max_new_tokens=4, out_dir=tmp_path,
                            verifier=verifier)
    # gold 0.7: math-verify rejects both 1/2 and 7 -> both go to the verifier, which accepts "1/2" only
    assert verifier.asked == ["\\boxed{1/2}", "\\boxed{7}"]
    m = res["metrics"]["t1.0_p1.0"]["benchmarks"]["math500"]
    assert m["verifier_accepted"] == 1 and m["avg@N"] == pytest.approx(0.5) and m["grader"]["incorrect"] == 2
    recs = read_jsonl(tmp_path / "generations" / "math500__t1.0_p1.0.jsonl")
    assert [(r["status"], r["verifier_verdict"], r["correct"]) for r in recs] == [
        ("incorrect", "A", True), ("incorrect", "B", False)]


def test_verifier_wiring_with_the_tiny_model(tok, tiny):
    from stapo.evaluation.verifier import LLMVerifier, parse_verdict
    from stapo.rollout import build_rollout_engine

    assert [parse_verdict(t) for t in ("A", " B\n", "\\boxed{C} - INVALID", "correct", "Incorrect.", "hmm")] == [
        "A", "B", "C", "A", "B", None]
    verifier = LLMVerifier(build_rollout_engine("hf", tiny, tok), tok, max_new_tokens=3, max_response_chars=50)
    out = verifier.verify(["What is 1+1?", "What is 2+2?"], ["2", "4"], ["x" * 500 + " \\boxed{3}", "\\boxed{4}"])
    assert len(out) == 2 and verifier.calls == 2
    assert all(v.accepted == (v.verdict == "A") for v in out)  # a random model: any verdict, but consistent
    with pytest.raises(ValueError, match="placeholder"):
        LLMVerifier(None, tok, prompt_template="no placeholders")


def test_verifier_from_the_config_with_the_tiny_model(shared_data_root, tmp_path, tok, tiny, grader):
    out = tmp_path / "run"
    run_evaluation(tiny_cfg(shared_data_root, out, "verifier.enabled=true", "verifier.model=tiny",
                            "verifier.max_new_tokens=2", "data.limit=1", "data.benchmarks=[math500]"),
                   model=tiny, tokenizer=tok, grader=grader)
    recs = read_jsonl(out / "generations" / "math500__t1.0_p1.0.jsonl")
    assert len(recs) == 2
    for r in recs:  # exactly the samples the rules reject are shown to the verifier (verdict: any, random model)
        assert (r["verifier_raw"] is not None) == (r["status"] in ("incorrect", "no_answer"))
        assert r["correct"] == (r["status"] == "correct" or r["verifier_accepted"])
    res = json.loads((out / "results.json").read_text())
    assert res["protocol"]["verifier"] == "tiny"


@pytest.mark.slow
def test_wandb_offline_summary_needs_no_api_key(shared_data_root, tmp_path, tok, tiny, grader, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "run"
    run_evaluation(tiny_cfg(shared_data_root, out, "logging.wandb_mode=offline", "data.limit=1"), model=tiny,
                   tokenizer=tok, grader=grader)
    assert any((out / "wandb").glob("offline-run-*"))


# --- a benchmark from the user's own file, by config ----------------------------------------------------------
def test_custom_benchmark_from_a_jsonl_file(shared_data_root, tmp_path, tok, tiny, grader):
    """data.custom_benchmarks.<name> maps a JSONL file's columns; listed in data.benchmarks it is evaluated
    next to a built-in one, with its own N, and gets a column of its own in the paper table."""
    bench = tmp_path / "mine.jsonl"
    bench.write_text("".join(json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1), "k": f"p{i}"}) + "\n"
                             for i in range(3)))
    out = tmp_path / "run"
    cfg = tiny_cfg(shared_data_root, out, "data.benchmarks=[math500,mine]", "data.limit=1", "generation.settings=[{}]",
                   f"data.custom_benchmarks.mine.path={bench}", "data.custom_benchmarks.mine.problem_key=q",
                   "data.custom_benchmarks.mine.answer_key=a", "data.custom_benchmarks.mine.id_key=k",
                   "data.custom_benchmarks.mine.samples=2")
    assert cfg.data.benchmarks == ["math500", "mine"] and cfg.data.samples["mine"] == 2
    run_evaluation(cfg, model=tiny, tokenizer=tok, grader=grader)
    recs = read_jsonl(out / "generations" / "mine__t1.0_p1.0.jsonl")
    assert sorted((r["problem_id"], r["sample"]) for r in recs) == [("mine/p0", 0), ("mine/p0", 1)]  # limit 1, N 2
    assert {r["gold"] for r in recs} == {"1"}
    from stapo.evaluation.report import paper_table

    header, _ = paper_table([json.loads((out / "results.json").read_text())])
    assert header == ["model", "MATH500", "mine", "Avg"]


def test_generated_synthetic_benchmarks_need_no_data_root(tmp_path, tok, tiny, monkeypatch):
    """arith_test / arith_hard (stapo.tasks.synthetic.GENERATED_BENCHMARKS) are benchmarks by name: their default N is
    4, they load without a data root, and grader.require_value grades an echo of the question incorrect."""
    from stapo.evaluation.runner import load_problems
    from stapo.tasks.grader import MathGrader

    missing = tmp_path / "no_data_here"
    cfg = tiny_cfg(missing, tmp_path / "o", "data.benchmarks=[arith_test,Arith_Hard]", "data.limit=2",
                   "generation.settings=[{}]", "grader.require_value=true")
    assert cfg.data.benchmarks == ["arith_test", "arith_hard"] and cfg.data.samples["arith_test"] == 4
    problems = load_problems(cfg.data.root, cfg.data.benchmarks, 2)
    assert [p.record.id for p in problems["arith_test"]] == ["arith_test/0", "arith_test/1"]
    with pytest.raises(EvalError, match=r"did you mean 'arith_test'"):
        tiny_cfg(missing, tmp_path / "o", "data.benchmarks=[arith_tset]")
    # the whole evaluation runs on them, with the grader it builds from grader.require_value
    built = []

    class Recording(MathGrader):
        def __init__(self, *args, **kwargs):
            built.append(kwargs.get("require_value"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr("stapo.tasks.grader.MathGrader", Recording)
    run_evaluation(cfg, model=tiny, tokenizer=tok)
    assert built == [True]
    recs = read_jsonl(tmp_path / "o" / "generations" / "arith_test__t1.0_p1.0.jsonl")
    assert len(recs) == 2 * 4 and {r["gold"] for r in recs} == {p.record.answer for p in problems["arith_test"]}


def test_custom_benchmark_errors_name_the_file_and_key(shared_data_root, tmp_path):
    from stapo.evaluation.runner import load_problems

    bench = tmp_path / "mine.jsonl"
    bench.write_text(json.dumps({"q": "x", "a": "1"}) + "\n")
    cfg = tiny_cfg(shared_data_root, tmp_path / "o", "data.benchmarks=[mine]", f"data.custom_benchmarks.mine.path={bench}")
    with pytest.raises(EvalError) as err:  # problem_key defaults to "problem"
        load_problems(cfg.data.root, cfg.data.benchmarks, None, cfg.data.custom_benchmarks)
    assert str(err.value) == f"{bench}: no column 'problem' (data.custom_benchmarks.mine.problem_key); columns: q, a"
    with pytest.raises(EvalError, match=r"data.custom_benchmarks.aime24.*built-in benchmark"):
        tiny_cfg(shared_data_root, tmp_path / "o", f"data.custom_benchmarks.aime24.path={bench}")
    with pytest.raises(EvalError, match=r"unknown benchmark 'mne' \(did you mean 'mine'\?\)"):
        tiny_cfg(shared_data_root, tmp_path / "o", "data.benchmarks=[mne]", f"data.custom_benchmarks.mine.path={bench}")


def test_custom_benchmark_missing_empty_or_bad_file_is_one_line_naming_it(shared_data_root, tmp_path):
    """A custom benchmark's file missing (the config key, not the data-root hint), empty (no rows) or with a bad JSON
    line (the row and the line number)."""
    from stapo.evaluation.runner import load_problems

    bench = tmp_path / "mine.jsonl"
    cfg = tiny_cfg(shared_data_root, tmp_path / "o", "data.benchmarks=[mine]", f"data.custom_benchmarks.mine.path={bench}")
    for text, expected in [
        (None, f"data.custom_benchmarks.mine.path: file not found: {bench}"),
        ("", f"{bench}: no rows (the file is empty)"),
        ('{"problem": "x", "answer": "1"}\n{"problem": "y", "answer": 2\n',
         f"{bench}: row 1 (line 2): not valid JSON (Expecting ',' delimiter at column 29)"),
    ]:
        if text is not None:
            bench.write_text(text)
        with pytest.raises(EvalError) as err:
            load_problems(cfg.data.root, cfg.data.benchmarks, None, cfg.data.custom_benchmarks)
        assert str(err.value) == expected


def test_a_registered_rollout_backend_evaluates_through_the_backend_table(shared_data_root, tmp_path, tok, tiny, grader):
    """engine.backend is checked against stapo.rollout.BACKENDS (one line for an unknown name); a backend
    registered by user code is built through the same table and argument builder as the trainer's: here an
    alias of the HF engine (model used in place), whose generations equal engine.backend=hf's."""
    from stapo.rollout import BACKENDS, Backend

    with pytest.raises(EvalError) as err:
        tiny_cfg(shared_data_root, tmp_path / "x", "engine.backend=hff")
    assert str(err.value) == ("invalid value for 'engine.backend' ('hff'): unknown rollout backend; did you mean "
                              "'hf'? (registered: hf, vllm)")
    seen = []

    def kwargs(options):
        seen.append(options)
        return BACKENDS["hf"].kwargs(options)

    BACKENDS["test_hf_alias"] = Backend("test_hf_alias", "stapo.rollout.hf:HFRolloutEngine", kwargs,
                                        model_in_place=True)
    try:
        runs = {}
        for backend in ("hf", "test_hf_alias"):
            out = tmp_path / backend
            cfg = tiny_cfg(shared_data_root, out, f"engine.backend={backend}", "data.benchmarks=[math500]",
                           "data.limit=1", "generation.settings=[{}]")
            run_evaluation(cfg, model=tiny, tokenizer=tok, grader=grader)
            runs[backend] = generations(out)
    finally:
        BACKENDS.pop("test_hf_alias", None)
    assert len(seen) == 1 and seen[0].max_model_len is None  # the in-place path: no vLLM sizing
    assert runs["hf"] and runs["hf"] == runs["test_hf_alias"]


def test_a_rollout_backend_from_the_eval_config_import_modules(capsys, shared_data_root, tmp_path, tok, tiny, grader):
    """A user's .py file that registers a rollout backend (an alias of the HF engine), listed in the eval config's
    top-level import_modules: imported before engine.backend (and evaluate.py's --backend, which has no fixed
    choices) is checked; its generations equal engine.backend=hf's. The modules of prompt.from_train_config's
    trainer.import_modules are imported before the check too. Failures are one line naming the key and module."""
    from stapo.rollout import BACKENDS

    module = tmp_path / "eval_user_backend.py"
    module.write_text("from stapo.rollout import BACKENDS, Backend, register_backend\n"
                      "register_backend(Backend('myhf', 'stapo.rollout.hf:HFRolloutEngine', BACKENDS['hf'].kwargs, "
                      "model_in_place=True))\n")
    small = ["data.benchmarks=[math500]", "data.limit=1", "generation.settings=[{}]"]
    try:
        with pytest.raises(EvalError) as err:  # without the module
            tiny_cfg(shared_data_root, tmp_path / "x", "engine.backend=myhf")
        assert str(err.value) == ("invalid value for 'engine.backend' ('myhf'): unknown rollout backend; did you mean "
                                  "'hf'? (registered: hf, vllm)")
        assert "myhf" not in BACKENDS
        # evaluate.py: --backend myhf is checked after the config's modules are imported
        rc = evaluate_main(["--config", str(TINY_CFG), "--data-root", str(shared_data_root), "--output",
                            str(tmp_path / "cli"), "--backend", "myhf", f"import_modules=[{module}]", *small])
        assert rc == 0, capsys.readouterr().err
        assert json.loads((tmp_path / "cli" / "eval_manifest.json").read_text())["backend"] == "myhf"
        rc, err_line = run_cli(capsys, "--config", str(TINY_CFG), "--backend", "sglang", f"import_modules=[{module}]")
        assert (rc, err_line) == (2, "evaluate.py: error: invalid value for 'engine.backend' ('sglang'): unknown "
                                     "rollout backend; (registered: hf, myhf, vllm)")
        runs = {}
        for backend in ("hf", "myhf"):
            cfg = tiny_cfg(shared_data_root, tmp_path / backend, f"engine.backend={backend}",
                           f"import_modules=[{module}]", *small)
            assert cfg.import_modules == [str(module)]
            run_evaluation(cfg, model=tiny, tokenizer=tok, grader=grader)
            runs[backend] = generations(tmp_path / backend)
        assert runs["hf"] and runs["hf"] == runs["myhf"]

        # the train config of prompt.from_train_config brings its own trainer.import_modules
        BACKENDS.pop("myhf")
        sys.modules.pop("eval_user_backend")
        train_yaml = tmp_path / "train.yaml"
        train_yaml.write_text(f"defaults: [{REPO / 'configs' / 'tiny_test.yaml'}]\n"
                              f"trainer:\n  import_modules: [{module}]\n")
        cfg = tiny_cfg(shared_data_root, tmp_path / "x", "engine.backend=myhf",
                       f"prompt.from_train_config={train_yaml}")
        assert cfg.engine.backend == "myhf" and "myhf" in BACKENDS

        with pytest.raises(EvalError) as err:
            tiny_cfg(shared_data_root, tmp_path / "x", "import_modules=[no_such_module_xyz]")
        assert str(err.value) == ("invalid value for 'import_modules' ('no_such_module_xyz'): cannot import it: "
                                  "ModuleNotFoundError: No module named 'no_such_module_xyz'")
        train_yaml.write_text(f"defaults: [{REPO / 'configs' / 'tiny_test.yaml'}]\n"
                              f"trainer:\n  import_modules: [no_such_module_xyz]\n")
        with pytest.raises(EvalError) as err:
            tiny_cfg(shared_data_root, tmp_path / "x", f"prompt.from_train_config={train_yaml}")
        assert str(err.value) == ("prompt.from_train_config: invalid value for 'trainer.import_modules' "
                                  "('no_such_module_xyz'): cannot import it: ModuleNotFoundError: No module named "
                                  "'no_such_module_xyz'")
        from stapo.config import ConfigError

        with pytest.raises(ConfigError) as err:
            tiny_cfg(shared_data_root, tmp_path / "x", f"import_modules={module.name}")
        assert str(err.value) == ("invalid value for 'import_modules' ('eval_user_backend.py'): must be a list, e.g. "
                                  "import_modules=[eval_user_backend.py]")
    finally:
        BACKENDS.pop("myhf", None)
        sys.modules.pop("eval_user_backend", None)


def test_a_run_folder_resolves_to_its_latest_intact_checkpoint(tmp_path):
    """evaluate.py --model <run> uses the rule a resume uses (stapo/common/checkpoint_files.py): a newest checkpoint
    whose files no longer match its COMPLETE.json is passed over for the previous one."""
    from stapo.common.checkpoint_files import _write_marker

    run = tmp_path / "run"
    for step in (1, 2):
        ckpt = run / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text("{}")
        (ckpt / "model.safetensors").write_bytes(b"w" * 100)
        (ckpt / "trainer_state.pt").write_bytes(b"s" * 10)
        _write_marker(ckpt, step)
    assert resolve_model_source(str(run)).step == 2
    (run / "checkpoints" / "step_000002" / "model.safetensors").write_bytes(b"w" * 40)  # truncated after the save
    src = resolve_model_source(str(run))
    assert (src.kind, src.step, src.label) == ("checkpoint", 1, "run@step_000001")


def test_model_dtype_auto_follows_the_training_rule(shared_data_root, tmp_path, monkeypatch):
    # model.dtype=auto resolves at load like training's compute_dtype: bf16 where the CPU has it natively, else fp32
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr("stapo.common.perf.native_bf16", lambda native=native: native)
        assert tiny_cfg(shared_data_root, tmp_path / "o", "model.dtype=auto").model.dtype == expected
    assert tiny_cfg(shared_data_root, tmp_path / "o", "model.dtype=float32").model.dtype == "float32"


def test_the_synthetic_split_a_checkpoint_was_trained_on(tmp_path):
    """A checkpoint of a run with data.synthetic.split=all (the default, and runs from before the key) saw
    arith_test's problems: run_evaluation warns in one line when such a checkpoint is evaluated on a generated
    benchmark (ModelSource.synthetic_split() == "all"); split=train, other training sets and non-checkpoints do not."""
    from stapo.evaluation.model_source import ModelSource

    run = tmp_path / "run"
    run.mkdir()
    for split, expected in (({}, "all"), ({"split": "train"}, "train")):
        (run / "config.json").write_text(json.dumps({"data": {"train_set": "synthetic", "synthetic": split}}))
        src = ModelSource(spec=str(run), kind="checkpoint", path=str(run), label="r", run_dir=str(run), step=2)
        assert src.synthetic_split() == expected
    (run / "config.json").write_text(json.dumps({"data": {"train_set": "dapo_math_17k"}}))
    assert ModelSource(spec="x", kind="checkpoint", path="x", label="r", run_dir=str(run), step=2).synthetic_split() is None
    assert ModelSource(spec="x", kind="hf", path="x", label="r").synthetic_split() is None


def test_validation_on_held_out_benchmarks_needs_the_train_split():
    from stapo.config import ConfigError, load_config

    base = REPO / "configs" / "tiny_test.yaml"
    with pytest.raises(ConfigError, match=r"validation.benchmarks.*arith_test.*set data.synthetic.split=train"):
        load_config(base, ["trainer.val_every=1", "validation.benchmarks=[arith_test]"])
    cfg = load_config(base, ["trainer.val_every=1", "validation.benchmarks=[arith_test]", "data.synthetic.split=train"])
    assert cfg.validation.benchmarks == ["arith_test"]


def test_progress_bar_true_false_or_auto(shared_data_root, tmp_path, monkeypatch):
    from stapo.evaluation.runner import _bars

    class Tty:
        def __init__(self, tty: bool):
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    cfg = tiny_cfg(shared_data_root, tmp_path, "logging.progress_bar=auto")
    validate_eval_config(cfg)
    monkeypatch.setattr("sys.stdout", Tty(False))  # nohup / Slurm: stdout is a file -> no bars
    monkeypatch.setattr("sys.stderr", Tty(True))
    assert _bars(cfg) is False
    monkeypatch.setattr("sys.stdout", Tty(True))  # both terminals -> bars
    assert _bars(cfg) is True
    assert _bars(tiny_cfg(shared_data_root, tmp_path, "logging.progress_bar=false")) is False  # forced off
    with pytest.raises(EvalError, match="logging.progress_bar.*true, false or auto"):
        validate_eval_config(tiny_cfg(shared_data_root, tmp_path, "logging.progress_bar=sometimes"))


def test_completeness_is_about_the_benchmarks_asked_for():
    from stapo.evaluation.runner import completeness
    from stapo.tasks.data import BENCHMARKS, PAPER_BENCHMARKS

    assert PAPER_BENCHMARKS == BENCHMARKS  # today the registry holds the paper's six, in order
    none = {b: 0 for b in BENCHMARKS}
    assert completeness(["aime24"], ["aime24"], None, {"aime24": 0}) == (True, False)  # complete, not the paper's
    assert completeness(list(BENCHMARKS), list(BENCHMARKS), None, none) == (True, True)
    assert completeness(list(BENCHMARKS), list(BENCHMARKS), 5, none) == (False, False)  # --limit
    assert completeness(list(BENCHMARKS), list(BENCHMARKS), None, {**none, "amc23": 1}) == (False, False)  # dropped
    assert completeness(["aime24"], ["aime24", "my_bench"], None, {"aime24": 0}) == (False, False)  # one missing
    # a benchmark added to the registry does not make the paper's six less than the paper's protocol
    six = list(PAPER_BENCHMARKS)
    assert completeness(six, six, None, {b: 0 for b in six}) == (True, True)
    assert completeness([*six, "mine"], [*six, "mine"], None, {b: 0 for b in [*six, "mine"]}) == (True, False)

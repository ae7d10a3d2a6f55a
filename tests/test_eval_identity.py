"""An evaluation knows what it was made from (issue 31): its fingerprint, reuse by content (a model replaced under
the same path, an edited benchmark file), gold answers the grader cannot parse, prompts past the model's context,
greedy decoding with N > 1, and the store's line splitting.

The tiny model (configs/eval/tiny_test.yaml: HF engine, 8 new tokens) generates; each test states the counts it
expects from the problems and N it asks for.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stapo.evaluation import EvalError, load_eval_config, run_evaluation  # noqa: E402
from stapo.evaluation.store import GenerationStore  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY_CFG = REPO / "configs" / "eval" / "tiny_test.yaml"

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok():
    from stapo.model.models import load_tokenizer

    return load_tokenizer("embedded:smollm2")


@pytest.fixture(scope="module")
def tiny(tok):
    from stapo.model.models import build_tiny_model

    return build_tiny_model(seed=0, tokenizer=tok)[0]


@pytest.fixture(scope="module")
def grader():
    from stapo.tasks.grader import MathGrader

    g = MathGrader(num_workers=1, timeout_s=5.0)
    yield g
    g.close()


def tiny_cfg(root, out, *overrides):
    return load_eval_config(TINY_CFG, [f"data.root={root}", f"output.dir={out}", *overrides])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def _save_model(model, tok, folder: Path) -> Path:
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# --- the model's content, not its path ------------------------------------------------------------------------
def test_weights_replaced_at_the_same_path_are_refused_and_a_moved_folder_is_reused(shared_data_root, tmp_path, tok,
                                                                                 tiny, grader):
    """Before: the manifest compared the model by path, so replaced weights were mixed into one results.json with
    the old samples (and a moved copy of the same weights was refused)."""
    import shutil

    from stapo.common.fingerprint import file_sha256, model_digest, read_fingerprint
    from stapo.model.models import build_tiny_model

    # the folders hold small tied models (under the 16-MiB digest cache threshold: nothing written to ~/.cache);
    # the samples come from the model object passed in
    folder = _save_model(build_tiny_model(seed=0, tokenizer=tok, tie_word_embeddings=True)[0], tok, tmp_path / "m")
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)  # the same weights in another folder
    out = tmp_path / "eval"
    first = run_evaluation(tiny_cfg(shared_data_root, out, f"model.path={folder}", "data.limit=1"), model=tiny,
                           tokenizer=tok, grader=grader)
    assert first["run"]["written"] == 3 * 2 + 2 * 2  # aime24 N=3 + math500 N=2, two settings, one problem each
    before = (out / "results.json").read_bytes()

    # other weights written at the same path, and a larger --limit: refused, naming the model's content
    _save_model(build_tiny_model(seed=1, tokenizer=tok, tie_word_embeddings=True)[0], tok, folder)
    with pytest.raises(EvalError) as err:
        run_evaluation(tiny_cfg(shared_data_root, out, f"model.path={folder}", "data.limit=2"), model=tiny,
                       tokenizer=tok, grader=grader)
    msg = str(err.value)
    assert "\n" not in msg and "another model" in msg and "model digest" in msg and "--output" in msg
    assert (out / "results.json").read_bytes() == before  # the finished results are kept as they were

    # the first weights in another folder: the same model by content, its samples reused (nothing generated)
    again = run_evaluation(tiny_cfg(shared_data_root, out, f"model.path={moved}", "data.limit=1"), tokenizer=tok,
                           grader=grader)
    assert again["run"]["generated"] == 0
    fp = read_fingerprint(out)  # what the evaluation was made from, by content
    assert fp["model"] == model_digest(moved) == again["fingerprint"]["model"] != model_digest(folder)
    assert fp["data:aime24"] == file_sha256(shared_data_root / "benchmarks" / "aime24" / "test.jsonl")
    assert {"protocol", "machine", "compute_dtype"} <= set(fp) and fp["compute_dtype"] == "float32"


def test_a_changed_grader_rule_is_refused(shared_data_root, tmp_path, tok, tiny, grader):
    """Before: grader.require_value was not recorded, so a rerun mixed samples graded under two rules."""
    out = tmp_path / "eval"
    run_evaluation(tiny_cfg(shared_data_root, out, "data.limit=1", "data.benchmarks=[aime24]"), model=tiny,
                   tokenizer=tok, grader=grader)
    with pytest.raises(EvalError, match="grader"):
        run_evaluation(tiny_cfg(shared_data_root, out, "data.limit=2", "data.benchmarks=[aime24]",
                                "grader.require_value=true"), model=tiny, tokenizer=tok, grader=grader)


# --- an edited benchmark file: reuse by content -----------------------------------------------------------------
def _write_bench(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n" for q, a in rows))
    return path


def test_an_edited_custom_benchmark_regenerates_the_changed_rows_only(shared_data_root, tmp_path, tok, tiny, grader,
                                                                      capsys):
    """Before: samples were keyed by (problem id, sample) alone, so a corrected gold kept its old grades and a row
    inserted before others left their ids pointing at the samples of other problems."""
    bench = _write_bench(tmp_path / "mine.jsonl", [("What is 1 + 1?", "2"), ("What is 2 + 2?", "5"),
                                                   ("What is 3 + 3?", "6")])
    out = tmp_path / "eval"
    opts = ["data.benchmarks=[mine]", "data.limit=null", "generation.settings=[{}]",
            f"data.custom_benchmarks.mine.path={bench}", "data.custom_benchmarks.mine.samples=2"]
    first = run_evaluation(tiny_cfg(shared_data_root, out, *opts), model=tiny, tokenizer=tok, grader=grader)
    assert first["run"]["written"] == 3 * 2
    gen = out / "generations" / "mine__t1.0_p1.0.jsonl"
    old = {(r["problem_id"], r["sample"]): r for r in read_jsonl(gen)}

    # row 1's gold corrected, a row inserted before the last one (ids are row numbers: the last row moves to mine/3)
    _write_bench(bench, [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4"), ("What is 9 + 9?", "18"),
                         ("What is 3 + 3?", "6")])
    capsys.readouterr()
    second = run_evaluation(tiny_cfg(shared_data_root, out, *opts), model=tiny, tokenizer=tok, grader=grader)
    err = capsys.readouterr().err
    # mine/1 (gold changed) and mine/2 (another problem now) again, mine/3 new: 3 problems × N=2; mine/0 reused
    assert second["run"]["written"] == 3 * 2
    recs = read_jsonl(gen)
    assert len(recs) == 4 * 2
    golds = {"mine/0": "2", "mine/1": "4", "mine/2": "18", "mine/3": "6"}
    assert all(r["gold"] == golds[r["problem_id"]] for r in recs)
    assert [r for r in recs if r["problem_id"] == "mine/0"] == [old[("mine/0", 0)], old[("mine/0", 1)]]
    aside = read_jsonl(out / "generations" / "superseded" / "mine__t1.0_p1.0.jsonl")  # kept, never deleted
    assert sorted((r["problem_id"], r["sample"]) for r in aside) == [("mine/1", 0), ("mine/1", 1), ("mine/2", 0),
                                                                     ("mine/2", 1)]
    assert "4 samples of 2 problems whose text or gold changed" in err and "the file of mine changed" in err
    assert second["metrics"]["t1.0_p1.0"]["benchmarks"]["mine"]["problems"] == 4


def test_a_store_sets_aside_records_of_other_content_and_splits_lines_on_newlines_only(tmp_path):
    """Records from before content keys are matched by their gold; a response holding U+2028 or U+0085 (kept raw in
    the JSON) is one line (before: str.splitlines cut it and the store refused the file as corrupt)."""
    path = tmp_path / "g.jsonl"
    GenerationStore(path).append([
        {"problem_id": "p", "sample": 0, "gold": "1", "response": "a\u2028b\x85c"},  # no content key: old record
        {"problem_id": "q", "sample": 0, "gold": "2", "content": "k-old"},
        {"problem_id": "r", "sample": 0, "gold": "3", "content": "k-r"},
    ])
    assert GenerationStore(path).records[("p", 0)]["response"] == "a\u2028b\x85c"
    store = GenerationStore(path, read_only=True, current={"p": ("k-p", "1"), "q": ("k-new", "2"),
                                                           "r": ("k-r", "3")})
    assert store.superseded == 1 and store.complete("p", 1) and not store.complete("q", 1) and store.complete("r", 1)
    assert len(read_jsonl(path)) == 3  # read-only: nothing moved
    store = GenerationStore(path, current={"p": ("k-p", "9"), "q": ("k-old", "2")})  # p's gold changed
    assert store.superseded == 1 and not store.complete("p", 1)
    assert [r["problem_id"] for r in read_jsonl(path)] == ["q", "r"]
    assert [r["problem_id"] for r in read_jsonl(tmp_path / "superseded" / "g.jsonl")] == ["p"]


# --- gold answers the grader cannot parse ---------------------------------------------------------------------
def test_a_gold_math_verify_cannot_parse_is_an_error_verdict_not_a_wrong_answer():
    """Before: math-verify's text fallback made '\\frac{' a gold, and every response to it 'incorrect'."""
    from stapo.tasks.grader import GradeStatus, grade_answer, gold_parses

    assert [gold_parses(g) for g in ("34", "\\frac{1}{2}", "(1,2)", "x=3", "N/A")] == [True] * 5
    assert [gold_parses(g) for g in ("\\frac{", "\\sqrt", "\\begin{cases} x=1 \\\\ y=2 \\end{cases}", "-1./3",
                                     "")] == [False] * 5
    wrong = grade_answer("\\boxed{4}", "\\frac{")
    assert wrong.status is GradeStatus.ERROR and wrong.error.startswith("GoldUnparseable")
    assert grade_answer("\\boxed{-1./3}", "-1./3").status is GradeStatus.CORRECT  # repeated as text: matched
    assert grade_answer("\\boxed{5}", "4").status is GradeStatus.INCORRECT


def test_check_golds_counts_reports_and_refuses(capsys):
    from stapo.tasks.data import DataError
    from stapo.tasks.golds import check_golds

    golds = ["1", "\\sqrt", "2", "3", "\\frac{"] + ["4"] * 15  # 2 of 20 unparsable: 10 %
    got = check_golds(golds, where="f.jsonl", key="data.max_unparsable_gold_fraction", max_fraction=0.1,
                      rows=list(range(10, 30)))
    assert (got.count, got.rows, got.golds) == (2, [11, 14], ["\\sqrt", "\\frac{"])
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith("f.jsonl: 2 of 20 gold answers cannot be parsed")
    assert "rows 11, 14" in line and "data.max_unparsable_gold_fraction=0.1" in line
    with pytest.raises(DataError) as err:
        check_golds(golds, where="f.jsonl", key="data.max_unparsable_gold_fraction", max_fraction=0.05)
    assert "2 of 20 gold answers (10.0 %)" in str(err.value) and "rows 1, 4" in str(err.value)
    assert check_golds(["1", "2"], where="f", key="k", max_fraction=0.0).count == 0  # all parse: no line
    assert capsys.readouterr().err == ""


def test_unparsable_golds_of_an_evaluation_file_are_reported_counted_or_refused(shared_data_root, tmp_path, tok,
                                                                                tiny, grader, capsys):
    """Before: accepted without a word and graded as wrong answers."""
    rows = [(f"What is {i} + 1?", str(i + 1)) for i in range(9)] + [("Solve it.", "\\begin{cases} 1 \\end{cases}")]
    bench = _write_bench(tmp_path / "mine.jsonl", rows)
    opts = ["data.benchmarks=[mine]", "data.limit=null", "generation.settings=[{}]",
            f"data.custom_benchmarks.mine.path={bench}", "data.custom_benchmarks.mine.samples=1"]
    with pytest.raises(EvalError) as err:  # 1 of 10 = 10 % > the default 5 %
        run_evaluation(tiny_cfg(shared_data_root, tmp_path / "a", *opts), model=tiny, tokenizer=tok, grader=grader)
    assert str(err.value).startswith(f"{bench}: 1 of 10 gold answers (10.0 %) cannot be parsed")
    assert "rows 9" in str(err.value) and "data.max_unparsable_gold_fraction=0.05" in str(err.value)
    capsys.readouterr()
    res = run_evaluation(tiny_cfg(shared_data_root, tmp_path / "b", *opts, "data.max_unparsable_gold_fraction=0.2"),
                         model=tiny, tokenizer=tok, grader=grader)
    line = [x for x in capsys.readouterr().err.splitlines() if "gold answers" in x]
    assert len(line) == 1 and line[0].startswith(f"{bench}: 1 of 10 gold answers cannot be parsed")
    assert res["data"]["mine"]["unparsable_golds"] == ["mine/9"]


def test_the_shipped_benchmarks_load_with_the_default_threshold(shared_data_root):
    """AIME24 has no unparsable gold (the slow test below measures all six and the training sets)."""
    from stapo.evaluation.runner import load_problems

    problems = load_problems(shared_data_root, ["aime24"])
    assert len(problems["aime24"]) == 30 and all(p.gold_parses for p in problems["aime24"])


@pytest.mark.slow
def test_unparsable_golds_of_the_shipped_data(shared_data_root):
    """The counts docs/evaluation.md states (math-verify 0.9.0): all below the default 5 %."""
    from stapo.tasks.data import BENCHMARKS, load_benchmark, load_train_set
    from stapo.tasks.golds import check_golds

    counts = {}
    for name in BENCHMARKS:
        loaded = load_benchmark(name, shared_data_root)
        counts[name] = check_golds([r.answer for r in loaded], where=name, key="k", max_fraction=0.05,
                                   rows=loaded.rows, report=lambda _: None).count
    for name in ("math_train", "dapo_math_17k"):
        loaded = load_train_set(name, shared_data_root)
        counts[name] = check_golds([r.answer for r in loaded], where=name, key="k", max_fraction=0.05,
                                   rows=loaded.rows, report=lambda _: None).count
    assert counts == {"aime24": 0, "aime25": 0, "amc23": 0, "math500": 0, "minerva_math": 6, "olympiadbench": 4,
                      "math_train": 12, "dapo_math_17k": 0}


def test_a_training_file_with_unparsable_golds_is_counted_or_refused(tmp_path, tok, capsys):
    from stapo.config import load_config
    from stapo.tasks.data import DataError
    from stapo.train import load_prompts

    path = tmp_path / "my_set.jsonl"
    path.write_text("".join(json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(19)) + json.dumps({"problem": "Say it.", "answer": "\\sqrt"}) + "\n")
    base = ["data.train_set=file", f"data.train_file.path={path}"]
    _, stats = load_prompts(load_config(None, base), tok)  # 1 of 20 = 5 %: accepted, one line
    assert stats["data/num_unparsable_gold"] == 1.0 and stats["data/num_prompts"] == 20.0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: 1 of 20 gold answers" in err and "rows 19" in err
    with pytest.raises(DataError, match="data.max_unparsable_gold_fraction=0.01"):
        load_prompts(load_config(None, [*base, "data.max_unparsable_gold_fraction=0.01"]), tok)


# --- prompts past the model's context; greedy with N > 1 --------------------------------------------------------
def test_prompts_past_the_context_are_cut_counted_or_refused(shared_data_root, tmp_path, tok, tiny, grader,
                                                             monkeypatch, capsys):
    """Before: the HF engine generated past max_position_embeddings without a word."""
    from stapo.evaluation.runner import encode_problems, load_problems, resolve_prompt

    cfg = tiny_cfg(shared_data_root, tmp_path / "a", "data.benchmarks=[aime24]", "data.limit=2",
                   "generation.settings=[{}]")
    problems = load_problems(shared_data_root, ["aime24"], 2)
    encode_problems(problems, tok, resolve_prompt(cfg.prompt))
    lengths = sorted(len(p.prompt_ids) for p in problems["aime24"])
    context = lengths[-1] + 3  # the longest prompt leaves room for 3 of the 8 new tokens
    monkeypatch.setattr(tiny.config, "max_position_embeddings", context)
    capsys.readouterr()
    res = run_evaluation(cfg, model=tiny, tokenizer=tok, grader=grader)
    err = capsys.readouterr().err
    over = sum(n + 8 > context for n in lengths)
    assert f"{over} problem(s) (aime24: {over}) have prompt + generation.max_new_tokens=8 > the model's context" in err
    assert res["data"]["aime24"]["over_context"] == over and res["context_tokens"] == context
    recs = read_jsonl(tmp_path / "a" / "generations" / "aime24__t1.0_p1.0.jsonl")
    assert all(r["prompt_tokens"] + r["response_tokens"] <= context for r in recs)
    monkeypatch.setattr(tiny.config, "max_position_embeddings", lengths[-1])  # the longest prompt fills it
    with pytest.raises(EvalError) as e:
        run_evaluation(tiny_cfg(shared_data_root, tmp_path / "b", "data.benchmarks=[aime24]", "data.limit=2",
                                "generation.settings=[{}]"), model=tiny, tokenizer=tok, grader=grader)
    assert "\n" not in str(e.value) and f"data.max_prompt_tokens={lengths[-1] - 1}" in str(e.value)


def test_greedy_decoding_with_several_samples_is_refused(shared_data_root, tmp_path):
    """Before: temperature 0 with N = 3 generated 3 identical samples per problem, averaged as if independent."""
    with pytest.raises(EvalError) as err:
        tiny_cfg(shared_data_root, tmp_path, "generation.settings=[{name: greedy, temperature: 0.0}]")
    msg = str(err.value)
    assert "generation.settings[0].temperature" in msg and "aime24=3" in msg and "math500=2" in msg
    cfg = tiny_cfg(shared_data_root, tmp_path, "generation.settings=[{name: greedy, temperature: 0.0}]",
                   "data.samples.aime24=1", "data.samples.math500=1")
    assert cfg.generation.settings[0].temperature == 0.0
    from stapo.evaluation.validation import ValidationHook

    with pytest.raises(EvalError, match="validation.samples"):
        ValidationHook(samples=4, settings=[(0.0, 1.0)])

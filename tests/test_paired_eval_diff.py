"""scripts/paired_eval_diff.py on hand-made evaluate.py generations folders (plain and gzip), and its errors."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "paired_eval_diff.py"
# three graded records of arith_test / t1.0_p1.0, as raw bytes
_OK = b"".join(json.dumps({"problem_id": p, "benchmark": "arith_test", "setting": "t1.0_p1.0", "correct": c}).encode()
               + b"\n" for p, c in [("x", True), ("y", False), ("z", True)])


def _write_run(folder: Path, correct: dict[str, list[bool]], gz: bool = False, torn: bool = False) -> Path:
    gen = folder / "generations"
    gen.mkdir(parents=True)
    lines = [json.dumps({"problem_id": pid, "sample": j, "benchmark": "arith_test", "setting": "t1.0_p1.0",
                         "correct": c}) + "\n" for pid, flags in correct.items() for j, c in enumerate(flags)]
    text = "".join(lines) + ('{"problem_id": "arith_te' if torn else "")  # a torn last line: skipped
    if gz:
        with gzip.open(gen / "arith_test__t1.0_p1.0.jsonl.gz", "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        (gen / "arith_test__t1.0_p1.0.jsonl").write_text(text, encoding="utf-8")
    return folder


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_paired_table_by_hand(tmp_path):
    # reference: problems x, y, z at 4/4, 2/4, 0/4 -> accuracies 1, .5, 0; other: 2/4, 2/4, 0/4 -> .5, .5, 0
    ref = _write_run(tmp_path / "stapo_seed2" / "final_eval",
                     {"x": [True] * 4, "y": [True, True, False, False], "z": [False] * 4}, torn=True)
    other = _write_run(tmp_path / "grpo", {"x": [True, False, True, False], "y": [False, True, False, True],
                                           "z": [False] * 4}, gz=True)
    out = tmp_path / "t.md"
    r = _run(str(ref), f"GRPO={other}", "--out", str(out))
    assert r.returncode == 0, r.stderr
    # d = [.5, 0, 0]: diff +1/6 = +0.1667, SE_paired sqrt(1/12)/sqrt(3) = 0.1667, unpaired 1/3, resolvable 0.3267
    row = "| t1.0_p1.0 | arith_test | GRPO | 3 | +0.1667 | 0.1667 | 0.3333 | 0.3267 |"
    assert row in r.stdout.splitlines()
    assert "diff (stapo_seed2 − run)" in r.stdout  # a study run's final_eval is named after its run
    assert out.read_text(encoding="utf-8") == r.stdout


def test_errors_are_one_line(tmp_path):
    ref = _write_run(tmp_path / "a", {"x": [True], "y": [False]})
    r = _run(str(ref), str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing: no such directory" in r.stderr
    (tmp_path / "empty").mkdir()  # a directory without generations/
    r = _run(str(ref), str(tmp_path / "empty"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no generations" in r.stderr
    bad = tmp_path / "b" / "generations"
    bad.mkdir(parents=True)
    (bad / "arith_test__t1.0_p1.0.jsonl").write_bytes(_OK[:_OK.index(b"\n") + 1] + b"not json\n{}\n")
    r = _run(str(ref), str(tmp_path / "b"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "arith_test__t1.0_p1.0.jsonl:2: not JSON" in r.stderr
    (bad / "arith_test__t1.0_p1.0.jsonl").write_text('{"problem_id": "x"}\n', encoding="utf-8")
    r = _run(str(ref), str(tmp_path / "b"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "arith_test__t1.0_p1.0.jsonl:1: lacks benchmark, setting, correct" in r.stderr
    one = _write_run(tmp_path / "c", {"x": [True]})
    r = _run(str(ref), str(one))
    assert r.returncode == 2 and "share 1 problem" in r.stderr and r.stderr.count("\n") == 1
    r = _run(str(ref))
    assert r.returncode == 2 and "at least one run to compare" in r.stderr



def _raw_run(folder: Path, files: dict[str, bytes]) -> Path:
    """A run folder whose generations files hold exactly the given bytes."""
    gen = folder / "generations"
    gen.mkdir(parents=True)
    for name, data in files.items():
        (gen / name).write_bytes(data)
    return folder


def _one_line_error(r: subprocess.CompletedProcess, *named: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == "", r.stdout  # nothing printed before the error
    for s in named:
        assert s in r.stderr, r.stderr


def test_unreadable_files_are_named(tmp_path):
    ref = _write_run(tmp_path / "ref", {"x": [True], "y": [False], "z": [True]})
    gz = gzip.compress(_OK, mtime=0)
    corrupt = gz[:10] + b"\x07" + gz[11:]  # deflate block type 3 (reserved): zlib.error
    crc = gz[:-8] + bytes([gz[-8] ^ 0xFF]) + gz[-7:]  # CRC check failed
    cases = {"trunc": ("g.jsonl.gz", gz[:-12]), "notgz": ("g.jsonl.gz", b"hello\n"), "zlib": ("g.jsonl.gz", corrupt),
             "crc": ("g.jsonl.gz", crc), "utf8": ("g.jsonl", _OK + b'{"problem_id": "\xff"}\n')}
    for name, (fname, data) in cases.items():
        run = _raw_run(tmp_path / name, {fname: data})
        _one_line_error(_run(str(ref), str(run)), f"{name}/generations/{fname}")
    _one_line_error(_run(str(ref), str(tmp_path / "utf8")), "g.jsonl:4: not UTF-8")


def test_bad_out_is_one_line(tmp_path):
    ref = _write_run(tmp_path / "ref", {"x": [True], "y": [False], "z": [True]})
    other = _write_run(tmp_path / "other", {"x": [False], "y": [False], "z": [True]})
    _one_line_error(_run(str(ref), str(other), "--out", str(tmp_path)), "--out", "Is a directory")
    (tmp_path / "file").write_text("", encoding="utf-8")
    _one_line_error(_run(str(ref), str(other), "--out", str(tmp_path / "file" / "t.md")), "--out")


def test_silently_wrong_input_is_refused(tmp_path):
    ref = _write_run(tmp_path / "ref", {"x": [True], "y": [False], "z": [True]})
    other = _write_run(tmp_path / "other", {"x": [False], "y": [False], "z": [True]})
    # "correct" must be a JSON boolean: the string "false" would count as correct
    rec = {"problem_id": "x", "benchmark": "arith_test", "setting": "t1.0_p1.0", "correct": "false"}
    run = _raw_run(tmp_path / "strbool", {"g.jsonl": _OK + json.dumps(rec).encode() + b"\n"})
    _one_line_error(_run(str(ref), str(run)), "strbool/generations/g.jsonl:4", "correct")
    # the same generations stored plain and gzipped would be pooled twice
    run = _raw_run(tmp_path / "both", {"g.jsonl": _OK, "g.jsonl.gz": gzip.compress(_OK)})
    _one_line_error(_run(str(ref), str(run)), "both/generations/g.jsonl and ", "both/generations/g.jsonl.gz")
    # a run sharing no (benchmark, setting) with the reference would vanish from the table
    run = _raw_run(tmp_path / "elsewhere", {"g.jsonl": _OK.replace(b"t1.0_p1.0", b"t0.7_p0.9")})
    _one_line_error(_run(str(ref), f"OTHER={other}", f"ELSE={run}"), "ELSE: shares no")
    # duplicate labels, and a label that would break the markdown table
    _one_line_error(_run(str(ref), f"A={other}", f"A={other}"), "label 'A' given twice")
    _one_line_error(_run(str(ref), f"A|B={other}"), "label 'A|B'")


def test_bad_records_name_file_and_line(tmp_path):
    ref = _write_run(tmp_path / "ref", {"x": [True], "y": [False], "z": [True]})
    rec = {"problem_id": "w", "benchmark": "arith_test", "setting": "t1.0_p1.0"}  # no "correct"
    run = _raw_run(tmp_path / "lacks", {"a.jsonl": _OK, "b.jsonl": _OK + json.dumps(rec).encode() + b"\n"})
    _one_line_error(_run(str(ref), str(run)), "lacks/generations/b.jsonl:4: lacks correct")
    run = _raw_run(tmp_path / "empty", {"a.jsonl": _OK, "b.jsonl": b""})
    _one_line_error(_run(str(ref), str(run)), "empty/generations/b.jsonl: no records")
    _one_line_error(_run(str(ref), "GRPO="), "GRPO=: empty path")


def test_torn_last_line_warns(tmp_path):
    ref = _write_run(tmp_path / "ref", {"x": [True], "y": [False], "z": [True]})
    run = _raw_run(tmp_path / "torn", {"g.jsonl.gz": gzip.compress(_OK + b'{"problem_id": "w", "bench')})
    r = _run(str(ref), str(run))
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("\n") == 1 and "warning" in r.stderr and "torn/generations/g.jsonl.gz:4" in r.stderr
    assert "| t1.0_p1.0 | arith_test | torn | 3 | +0.0000 |" in r.stdout


def _recs(setting: str, rows: list[tuple[str, int, bool]]) -> bytes:
    """Raw generations lines of arith_test at ``setting``: (problem_id, sample, correct) each."""
    return b"".join(json.dumps({"problem_id": p, "sample": j, "benchmark": "arith_test", "setting": setting,
                                "correct": c}).encode() + b"\n" for p, j, c in rows)


def test_mismatched_duplicated_and_incomplete_input(tmp_path):
    t1, t7 = "arith_test__t1.0_p1.0.jsonl", "arith_test__t0.7_p0.9.jsonl"
    three = [("x", 0, True), ("y", 0, False), ("z", 0, True)]
    ref = _raw_run(tmp_path / "ref", {t1: _recs("t1.0_p1.0", three), t7: _recs("t0.7_p0.9", three)})
    # a record whose setting is not its file's would be pooled into the other setting's pair
    run = _raw_run(tmp_path / "mixed", {t1: _recs("t1.0_p1.0", three[:2]) + _recs("t0.7_p0.9", three[2:])})
    _one_line_error(_run(str(ref), str(run)), f"mixed/generations/{t1}:3: a record of t0.7_p0.9/arith_test")
    # the same sample twice would weigh its problem double
    run = _raw_run(tmp_path / "twice", {t1: _recs("t1.0_p1.0", three + three[1:2])})
    _one_line_error(_run(str(ref), str(run)), f"twice/generations/{t1}:4: sample 0 of y a second time")
    # incomplete but usable: no T = 0.7 file, 2 of the 3 problems, and x with 2 samples where y has 1
    run = _raw_run(tmp_path / "part", {t1: _recs("t1.0_p1.0", [("x", 0, True), ("x", 1, False), ("y", 0, False)])})
    r = _run(str(ref), str(run))
    assert r.returncode == 0, r.stderr
    warnings = r.stderr.splitlines()
    assert len(warnings) == 3 and all(w.startswith("paired_eval_diff.py: warning: ") for w in warnings)
    assert "1 problem(s) have fewer samples than the most (2)" in warnings[0]
    assert "part has no t0.7_p0.9/arith_test: its row is left out" in r.stderr
    assert "t1.0_p1.0/arith_test: ref has 3 problems, part 2; compared on the 2 both answered" in r.stderr
    # x: 1 − 0.5, y: 0 − 0 → d = [0.5, 0], diff +0.25; sd = sqrt(2 · 0.25² / 1) = 0.353553, SE = 0.25
    assert "| t1.0_p1.0 | arith_test | part | 2 | +0.2500 | 0.2500 |" in r.stdout
    assert "t0.7_p0.9" not in r.stdout


# --- pairs that cannot be compared (issue 31) -------------------------------------------------------------------
def _manifest(**changes) -> dict:
    """An eval_manifest.json as evaluate.py writes it (one benchmark, one setting), with ``changes`` applied."""
    m = {"model": {"kind": "hf_folder", "path": "/models/a", "step": None}, "model_digest": "a" * 64,
         "dtype": "float32", "backend": "vllm", "prompt": {"style": "auto", "system_prompt": None},
         "max_new_tokens": 256, "seed": 0, "samples_per_call": 256, "samples": {"arith_test": 1},
         "settings": {"t1.0_p1.0": [1.0, 1.0]}, "grader": {"require_value": False}, "verifier": None,
         "data": {"arith_test": "generated:arith_test:0123456789abcdef"}, "machines": ["cpu:x:avx2"]}
    m.update(changes)
    return m


def _run_with_manifest(folder: Path, correct: dict[str, list[bool]], **changes) -> Path:
    _write_run(folder, correct)
    (folder / "eval_manifest.json").write_text(json.dumps(_manifest(**changes)), encoding="utf-8")
    return folder


def test_evaluations_made_with_different_protocols_are_refused(tmp_path):
    """Before: two evaluations with other new-token limits or N were paired and printed as resolvable."""
    flags = {"x": [True], "y": [False], "z": [True]}
    ref = _run_with_manifest(tmp_path / "ref", flags)
    cases = {"tokens": ({"max_new_tokens": 512}, "max_new_tokens: 256 vs 512"),
             "n": ({"samples": {"arith_test": 4}}, "samples[arith_test] (N): 1 vs 4"),
             "temp": ({"settings": {"t1.0_p1.0": [0.7, 1.0]}}, "settings[t1.0_p1.0] (temperature, top-p)"),
             "prompt": ({"prompt": {"style": "plain", "system_prompt": None}}, "prompt: "),
             "grader": ({"grader": {"require_value": True}}, "grader: "),
             "data": ({"data": {"arith_test": "b" * 64}}, "data[arith_test]")}
    for name, (changes, named) in cases.items():
        other = _run_with_manifest(tmp_path / name, {"x": [False], "y": [False], "z": [True]},
                                   model_digest="c" * 64, **changes)
        _one_line_error(_run(str(ref), str(other)), f"ref and {name} were evaluated with different protocols", named)
    # what is not protocol: another model, dtype, backend, seed, --limit: compared
    other = _run_with_manifest(tmp_path / "fine", {"x": [False], "y": [False], "z": [True]}, model_digest="c" * 64,
                               dtype="bfloat16", backend="hf", seed=3)
    r = _run(str(ref), str(other))
    assert r.returncode == 0 and "| t1.0_p1.0 | arith_test | fine | 3 | +0.3333 |" in r.stdout, r.stderr


def test_one_evaluation_given_twice_is_refused_not_a_tie(tmp_path):
    """Before: the same folder twice (under two labels), or a copy of it, printed a difference of 0 as a tie."""
    import shutil

    from stapo.evaluation.metrics import paired_difference

    ref = _run_with_manifest(tmp_path / "ref", {"x": [True], "y": [False], "z": [True]})
    _one_line_error(_run(f"A={ref}", f"B={ref}"), "A and B are the same folder")
    shutil.copytree(ref, tmp_path / "copy")
    _one_line_error(_run(str(ref), str(tmp_path / "copy")), "ref and copy hold one evaluation twice")
    # no manifests, but the same responses sample for sample
    lines = b"".join(json.dumps({"problem_id": p, "sample": 0, "benchmark": "arith_test", "setting": "t1.0_p1.0",
                                 "correct": c, "response": f"r-{p}"}).encode() + b"\n"
                     for p, c in [("x", True), ("y", False), ("z", True)])
    a = _raw_run(tmp_path / "a", {"arith_test__t1.0_p1.0.jsonl": lines})
    b = _raw_run(tmp_path / "b", {"arith_test__t1.0_p1.0.jsonl": lines})
    _one_line_error(_run(str(a), str(b)), "a and b hold the same responses for all 3 samples")
    # the same setting name sampled at other temperatures (records without a manifest)
    def at(temperature: float) -> bytes:
        return b"".join(json.dumps({"problem_id": p, "sample": 0, "benchmark": "arith_test", "setting": "t1.0_p1.0",
                                    "correct": c, "temperature": temperature, "top_p": 1.0}).encode() + b"\n"
                        for p, c in [("x", True), ("y", False)])

    hot = _raw_run(tmp_path / "hot", {"g.jsonl": at(1.0)})
    cold = _raw_run(tmp_path / "cold", {"g.jsonl": at(0.7)})
    _one_line_error(_run(str(hot), str(cold)), "different decoding settings under the name t1.0_p1.0")
    acc = {"x": 1.0, "y": 0.0}
    with pytest.raises(ValueError, match="the same run given twice"):
        paired_difference(acc, acc)

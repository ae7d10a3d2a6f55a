#!/usr/bin/env python
"""Try bad inputs and faults against train.py / evaluate.py as a new user would, and tabulate what happens.

Run from the repository root (CPU only, tiny random model; all cases take a few minutes on 2 cores)::

    python scripts/check_reliability.py                                   # all cases, table on stdout
    python scripts/check_reliability.py --only yaml --only resume         # cases whose kind contains a substring
    python scripts/check_reliability.py --out results/reliability_table.md
    python scripts/check_reliability.py --list                            # the case kinds, nothing run
    python scripts/check_reliability.py --keep                            # keep each case's temporary folder

Each case runs in its own temporary folder (``{tmp}`` in its command), optionally after a ``setup`` that creates
bad files, with its own environment / resource limits, and optionally sends a signal (SIGTERM, SIGINT, SIGKILL)
once a file appears (e.g. the first row of ``{tmp}/runs/r/metrics.jsonl``) and then runs a follow-up command
(e.g. ``--resume``).  The contract checked is docs/runs.md "Errors": a usage error is ONE informative line on
stderr, exit 2; a runtime failure one line, exit 1; Ctrl-C exit 130; never a Python traceback; never silent data
loss; finished checkpoints / evaluation records survive a crash.

Verdicts:

* GOOD — the exit code is one of the expected ones, stderr has no ``Traceback``, the last stderr line is a single
  informative line (not empty, ≤ 600 characters, not a bare exception repr) containing the expected substring
  (case-insensitive), and the case's extra checks (checkpoint kept, one metrics row per step, ...) pass.
* POOR — as GOOD, but the case declares ``known="POOR: <reason>"``: acceptable behaviour that could be better.
* BAD — anything else, with the reason; a case that runs past its timeout (default 180 s) is BAD.

The script exits 0 when no case is BAD, else 1.  It only reads the repository; everything it writes goes to
temporary folders (and ``--out``).  It never touches the real model cache (``~/.cache/stapo``): the HOME cases point
HOME at a fresh folder and copy nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

SCRIPT_REPO = Path(__file__).resolve().parent.parent
REPO = SCRIPT_REPO  # the tree whose train.py / evaluate.py run (--repo: e.g. a snapshot of a tree being edited)
PY = sys.executable
DATA_ROOT = (SCRIPT_REPO.parent / "shared" / "data").resolve()
TRAIN_CFG = str(REPO / "configs" / "tiny_test.yaml")
EVAL_CFG = str(REPO / "configs" / "eval" / "tiny_test.yaml")

#: Overrides that every training case starts from.
TRAIN = ["train.py", "--config", TRAIN_CFG, "trainer.output_dir={tmp}/runs", "trainer.run_name=r",
         "trainer.total_steps=2"]
#: Options that every evaluation case starts from.
def ev(*extra: str, output: str = "{tmp}/eval", limit: str = "1", data_root: str = str(DATA_ROOT)) -> list[str]:
    """evaluate.py's argv with the tiny config; ``extra`` appended."""
    return ["evaluate.py", "--config", EVAL_CFG, "--output", output, "--limit", limit, "--data-root", data_root,
            "--wandb", "disabled", *extra]


EVAL = ev()


@dataclasses.dataclass
class Result:
    argv: list[str]
    rc: Optional[int]  # None: timed out
    stdout: str
    stderr: str
    seconds: float

    @property
    def last_line(self) -> str:
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        return lines[-1].strip() if lines else ""


@dataclasses.dataclass
class Case:
    """One bad input or fault.

    ``args`` is the argv after the interpreter, with ``{tmp}`` placeholders.  ``expect_rc`` / ``expect`` apply to
    the LAST command run (the follow-up when there is one); ``signal_rc`` (if given) to the signalled process.
    ``check(tmp, results)`` returns None or the reason the data state is wrong.
    """

    kind: str
    args: list[str]
    expect_rc: tuple[int, ...] = (2,)
    expect: str = ""
    setup: Optional[Callable[[Path], None]] = None
    env: Optional[dict[str, str]] = None
    preexec: Optional[Callable[[], None]] = None
    # signal: send `sig` once the file `signal_when` (glob relative to tmp) exists and is non-empty
    sig: Optional[int] = None
    signal_when: str = "runs/r/metrics.jsonl"
    signal_rc: Optional[tuple[int, ...]] = None
    signal_expect: str = ""  # substring of the signalled process's last stderr line
    then: Optional[list[str]] = None  # follow-up command (after the signal, or after the first command ends)
    between: Optional[Callable[[Path], None]] = None  # called after the first command, before `then`
    first_rc: tuple[int, ...] = (0,)  # without a signal: the exit codes the first of two commands may end with
    check: Optional[Callable[[Path, list[Result]], Optional[str]]] = None
    known: Optional[str] = None  # "POOR: <reason>"
    known_when: Optional[Callable[[list[Result]], bool]] = None  # `known` applies only when this holds (default: always)
    long_line_ok: bool = False  # a last line over 600 characters is POOR (declared), not BAD
    soft_lines: str = ""  # regex: extra stderr lines matching it make the case POOR rather than BAD
    expect_on_success: bool = False  # check `expect` on stderr also when the exit code is 0
    timeout: float = 180.0


# --------------------------------------------------------------------------------------------- helpers

def fill(args: Sequence[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in args]


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def jsonl(rows: Sequence[dict | str]) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


GOOD_ROWS = [{"id": i, "problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 7)]


def metrics_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    steps = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.strip():
            try:
                steps.append(json.loads(line)["step"])
            except Exception:  # noqa: BLE001
                steps.append(-1)
    return steps


def checkpoints(tmp: Path, run: str = "runs/r") -> list[str]:
    d = tmp / run / "checkpoints"
    return sorted(p.name for p in d.glob("step_*") if (p / "COMPLETE.json").exists()) if d.exists() else []


def need_checkpoint(*names: str, run: str = "runs/r"):
    def check(tmp: Path, results: list[Result]) -> Optional[str]:
        have = checkpoints(tmp, run)
        missing = [n for n in names if n not in have]
        return f"missing checkpoint(s) {missing} (have {have})" if missing else None
    return check


def steps_exactly(expected: Sequence[int], run: str = "runs/r"):
    def check(tmp: Path, results: list[Result]) -> Optional[str]:
        got = metrics_steps(tmp / run / "metrics.jsonl")
        return None if got == list(expected) else f"metrics.jsonl steps {got}, expected {list(expected)}"
    return check


def all_checks(*fns):
    def check(tmp: Path, results: list[Result]) -> Optional[str]:
        for fn in fns:
            why = fn(tmp, results)
            if why:
                return why
        return None
    return check


# A reference training run, built once and copied into the cases that need a finished run folder.
_REF: dict[str, Path] = {}


def ref_run() -> Path:
    if "train" not in _REF:
        root = Path(tempfile.mkdtemp(prefix="rel_ref_"))
        r = subprocess.run([PY, *fill(TRAIN, root)], cwd=REPO, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"reference training run failed (rc {r.returncode}): {r.stderr[-500:]}")
        _REF["train"] = root / "runs" / "r"
    return _REF["train"]


def copy_ref(tmp: Path) -> Path:
    dst = tmp / "runs" / "r"
    shutil.copytree(ref_run(), dst)
    (dst / "run.lock").unlink(missing_ok=True)
    return dst


def gen_responses(folder: Path) -> dict:
    out = {}
    for f in sorted((folder / "generations").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                out[(row["problem_id"], row["setting"], row["sample"])] = (row["response"], row["correct"])
    return out


def results_metrics(folder: Path) -> Optional[dict]:
    p = folder / "results.json"
    return json.loads(p.read_text(encoding="utf-8")).get("metrics") if p.exists() else None


def limit_memory(gib: float):
    def pre():
        n = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (n, n))
    return pre


def limit_files(n: int):
    def pre():
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return pre


# --------------------------------------------------------------------------------------------- the cases

def _cases() -> list[Case]:
    C: list[Case] = []
    add = C.append
    T, E = TRAIN, EVAL
    bad_cfg = "{tmp}/bad.yaml"

    def cfg_from(text: str | bytes, name: str = "bad.yaml"):
        return lambda tmp: write(tmp / name, text)

    def train_file(rows_text: str | bytes, name: str = "set.jsonl", extra: Sequence[str] = ()):
        args = [*T, "data.train_set=file", f"data.train_file.path={{tmp}}/{name}", *extra]
        return args, (lambda tmp: write(tmp / name, rows_text))

    # ---- config files and overrides
    tiny_text = Path(TRAIN_CFG).read_text(encoding="utf-8")
    add(Case("config: YAML syntax error", ["train.py", "--config", bad_cfg, "trainer.output_dir={tmp}/runs"],
             expect="bad.yaml", setup=cfg_from(tiny_text.replace("  n: 4", "  n: [4")),
             check=lambda tmp, r: "run folder created" if (tmp / "runs").exists() else None))
    add(Case("config: path is a directory", ["train.py", "--config", "{tmp}/cfgdir"], expect="cfgdir",
             known="POOR: a folder is reported as 'config file not found'",
             known_when=lambda r: "not found" in r[-1].last_line,
             setup=lambda tmp: (tmp / "cfgdir").mkdir()))
    add(Case("config: file does not exist", ["train.py", "--config", "{tmp}/nope.yaml"], expect="nope.yaml"))
    add(Case("config: binary / not UTF-8", ["train.py", "--config", bad_cfg], expect="bad.yaml",
             setup=cfg_from(b"\xff\xfe\x00\x01model:\x80\x81\n" + bytes(range(128, 256)))))
    add(Case("config: top level is a list", ["train.py", "--config", bad_cfg], expect="bad.yaml",
             setup=cfg_from("- model\n- data\n")))
    add(Case("config: section is a scalar (actor: 3)", ["train.py", "--config", bad_cfg], expect="actor",
             known="POOR: the message names key 'None' and OmegaConf's 'Merge error', not 'actor'",
             known_when=lambda r: "'None'" in r[-1].last_line,
             setup=cfg_from(tiny_text.replace("actor:\n", "actor: 3\nunused_actor:\n", 1))))
    add(Case("override without '='", [*T, "actor.lr"], expect="actor.lr"))
    add(Case("override wrong type actor.lr=fast", [*T, "actor.lr=fast"], expect="actor.lr"))
    add(Case("override list for int (rollout.n=[4])", [*T, "rollout.n=[4]"], expect="rollout.n"))
    add(Case("trainer.total_steps=-1", [*T, "trainer.total_steps=-1"], expect="trainer.total_steps"))
    add(Case("rollout.n=1 (no group to compare)", [*T, "rollout.n=1"], expect="rollout.n"))
    add(Case("ppo_mini_batch_size > train_batch_size", [*T, "actor.ppo_mini_batch_size=8"],
             expect="ppo_mini_batch_size"))
    add(Case("train_batch_size > number of problems", [*T, "data.synthetic.num_problems=3", "data.train_batch_size=4"], expect_rc=(0, 2),
             expect="train_batch_size"))
    add(Case("rollout.temperature=0", [*T, "rollout.temperature=0"], expect="rollout.temperature"))
    add(Case("rollout.response_length=0", [*T, "rollout.response_length=0"], expect="rollout.response_length"))
    add(Case("actor.lr=0 (a no-op update)", [*T, "actor.lr=0"], expect_rc=(0, 2), expect="actor.lr",
             check=lambda tmp, r: need_checkpoint("step_000002")(tmp, r) if r[-1].rc == 0 else None))

    def no_silent_nan(tmp: Path, results: list[Result]) -> Optional[str]:
        text = (tmp / "runs/r/metrics.jsonl").read_text() if (tmp / "runs/r/metrics.jsonl").exists() else ""
        nonfinite = re.search(r'\bNaN\b|\bInfinity\b|"-?inf"|"nan"|1e\+308', text)  # docs/metrics.md forms
        if results[-1].rc == 0 and nonfinite and "nan" not in results[-1].stderr.lower():
            return "NaN/Inf in metrics.jsonl and exit 0 without a word on stderr"
        return None
    add(Case("actor.lr=1e3 (divergence)", [*T, "actor.lr=1e3", "trainer.total_steps=3"], expect_rc=(0, 1, 2),
             expect="", check=no_silent_nan))
    add(Case("trainer.keep_last=0", [*T, "trainer.keep_last=0"], expect="trainer.keep_last"))
    add(Case("trainer.save_every > total_steps (final checkpoint?)", [*T, "trainer.save_every=5"], expect_rc=(0,),
              check=need_checkpoint("step_000002")))
    add(Case("trainer.total_steps=0", [*T, "trainer.total_steps=0"], expect="trainer.total_steps"))
    add(Case("trainer.device=gpu (not a device)", [*T, "trainer.device=gpu"], expect="trainer.device"))
    add(Case("run_name containing '/'", [*T, "trainer.run_name=a/b"], expect_rc=(0, 2), expect="run_name",
             known="POOR: accepted silently; the run folder is nested (runs/a/b)", known_when=lambda r: r[-1].rc == 0))
    add(Case("run_name '..' (escapes output_dir)", [*T, "trainer.run_name=.."], expect="run_name",
             check=lambda tmp, r: "wrote into the parent of output_dir" if (tmp / "metrics.jsonl").exists() else None))
    add(Case("output_dir with spaces and unicode", [*T, "trainer.output_dir={tmp}/my runs/éxp ü"], expect_rc=(0,),
              check=need_checkpoint("step_000002", run="my runs/éxp ü/r")))

    # ---- import_modules
    add(Case("import_modules: missing file", [*T, "trainer.import_modules=[{tmp}/missing.py]"],
             expect="missing.py"))
    add(Case("import_modules: syntax error", [*T, "trainer.import_modules=[{tmp}/bad_syntax.py]"],
             expect="bad_syntax.py", setup=lambda tmp: write(tmp / "bad_syntax.py", "def f(:\n    pass\n")))
    add(Case("import_modules: module raises at import", [*T, "trainer.import_modules=[{tmp}/boom.py]"],
             expect="boom.py", setup=lambda tmp: write(tmp / "boom.py", "raise RuntimeError('boom at import')\n")))

    # ---- training data from the user's file
    add(Case("train_file: path missing", [*T, "data.train_set=file", "data.train_file.path={tmp}/nope.jsonl"],
             expect="nope.jsonl"))
    add(Case("train_set=file without train_file.path", [*T, "data.train_set=file"], expect="data.train_file.path"))
    a, s = train_file("problem,answer\n1+1,2\n2+2,4\n3+3,6\n", name="set.csv")
    add(Case("train_file: a CSV", a, expect="set.csv", setup=s))
    lines = [json.dumps(r) for r in GOOD_ROWS]
    lines[2] = lines[2][:15]
    a, s = train_file(jsonl(lines))
    add(Case("train_file: JSONL broken middle line", a, expect="set.jsonl", setup=s))
    a, s = train_file(jsonl([{"id": r["id"], "problem": r["problem"]} for r in GOOD_ROWS]))
    add(Case("train_file: rows missing the answer key", a, expect="answer", setup=s))
    a, s = train_file(jsonl([{**r, "problem": 12345} for r in GOOD_ROWS]))
    add(Case("train_file: problem is a number", a, expect="problem", setup=s, soft_lines=r"skipped \d+ of \d+ rows"))
    a, s = train_file(jsonl([{**r, "problem": "", "answer": ""} for r in GOOD_ROWS]))
    add(Case("train_file: empty strings", a, expect="answer", setup=s, soft_lines=r"skipped \d+ of \d+ rows"))
    a, s = train_file(jsonl([{**r, "id": 7} for r in GOOD_ROWS]), extra=["data.train_file.id_key=id"])
    add(Case("train_file: duplicate ids", a, expect_rc=(0, 2), expect="duplicate", setup=s, expect_on_success=True,
             known="POOR: 5 of 6 rows dropped with one warning line, training goes on with 1 problem",
             known_when=lambda r: r[-1].rc == 0))
    a, s = train_file(jsonl(GOOD_ROWS), extra=["data.train_file.answer_key=solution"])
    add(Case("train_file: answer_key names no column", a, expect="solution", setup=s))
    add(Case("train_set=dapo_math_17k, data.root missing",
             [*T, "data.train_set=dapo_math_17k", "data.root={tmp}/no_data"], expect="no_data"))
    add(Case("train_set=dapo (near miss of a name)", [*T, "data.train_set=dapo"], expect="dapo_math_17k"))

    # ---- resume, signals
    def del_state(tmp: Path):
        d = copy_ref(tmp)
        shutil.rmtree(d / "checkpoints" / "step_000001")
        (d / "checkpoints" / "step_000002" / "trainer_state.pt").unlink()
    add(Case("--resume: only checkpoint lacks trainer_state.pt", [*T, "trainer.total_steps=3", "--resume"],
             expect="step_000002", setup=del_state,
             check=lambda tmp, r: None if (tmp / "runs/r/checkpoints/step_000002/model.safetensors").exists()
             else "the damaged checkpoint was deleted"))
    add(Case("--resume with no run folder", [*T, "--resume"], expect="resume"))
    add(Case("--resume a finished run (total_steps reached)", [*T, "--resume"], expect_rc=(0, 2), expect="",
             setup=copy_ref, check=steps_exactly([1, 2])))
    add(Case("SIGTERM during training (cluster scheduler)", [*T, "trainer.total_steps=3"], sig=signal.SIGTERM,
             signal_rc=(1, 130, 143), signal_expect="resume", expect_rc=(1, 130, 143), expect="resume",
             check=need_checkpoint("step_000001")))
    add(Case("SIGKILL during training, then --resume", [*T, "trainer.total_steps=3"], sig=signal.SIGKILL,
             signal_when="runs/r/checkpoints/step_000001/COMPLETE.json", signal_rc=(-9,),
             then=[*T, "trainer.total_steps=3", "--resume"], expect_rc=(0,), expect="",
             check=all_checks(steps_exactly([1, 2, 3]), need_checkpoint("step_000003"))))
    add(Case("SIGTERM during training, then --resume", [*T, "trainer.total_steps=3"], sig=signal.SIGTERM,
             then=[*T, "trainer.total_steps=3", "--resume"], expect_rc=(0,), expect="",
             check=all_checks(steps_exactly([1, 2, 3]), need_checkpoint("step_000003"))))

    # ---- evaluate.py
    add(Case("eval: unknown benchmark", [*E, "--benchmarks", "aime23"], expect="aime23"))
    add(Case("eval: --limit 0", ev(limit="0"), expect="limit"))
    add(Case("eval: --limit -1", ev(limit="-1"), expect="limit"))
    add(Case("eval: --limit abc", ev(limit="abc"), expect="limit"))
    add(Case("eval: --max-new-tokens 0", [*E, "--max-new-tokens", "0"], expect="max_new_tokens"))
    add(Case("eval: --settings unknown name", [*E, "--settings", "t0.5"], expect="t0.5"))
    add(Case("eval: override wrong type", [*E, "generation.max_new_tokens=lots"], expect="max_new_tokens"))
    add(Case("eval: --data-root missing", ev(data_root="{tmp}/no_data"), expect="no_data"))

    def damage_bench(tmp: Path):
        shutil.copytree(DATA_ROOT / "benchmarks", tmp / "data" / "benchmarks")
        f = tmp / "data" / "benchmarks" / "math500" / "test.jsonl"
        lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        lines[3] = lines[3][: len(lines[3]) // 2] + "\n"
        f.write_text("".join(lines), encoding="utf-8")
    add(Case("eval: benchmark file with a corrupt line", ev(data_root="{tmp}/data"), expect="test.jsonl",
             setup=damage_bench))

    def run_without_ckpt(tmp: Path):
        d = copy_ref(tmp)
        shutil.rmtree(d / "checkpoints")
        (d / "checkpoints").mkdir()
    add(Case("eval: --model a run folder with no checkpoint", [*E, "--model", "{tmp}/runs/r"], expect="runs/r",
             setup=run_without_ckpt))
    add(Case("eval: --model nonexistent path", [*E, "--model", "{tmp}/no_model"], expect="no_model"))
    add(Case("eval: --model nonexistent relative path", [*E, "--model", "runs/definitely_not_here"],
             expect="definitely_not_here"))

    def truncate_weights(tmp: Path):
        d = copy_ref(tmp)
        w = d / "checkpoints" / "step_000002" / "model.safetensors"
        data = w.read_bytes()
        w.write_bytes(data[: len(data) // 3])
    add(Case("eval: --model checkpoint with truncated safetensors",
             [*E, "--model", "{tmp}/runs/r/checkpoints/step_000002"], expect_rc=(1, 2), expect="model.safetensors",
             setup=truncate_weights))
    add(Case("eval: --output is a file", ev(output="{tmp}/out.txt"), expect="out.txt",
             setup=lambda tmp: write(tmp / "out.txt", "hello\n"),
             check=lambda tmp, r: None if (tmp / "out.txt").read_text() == "hello\n" else "the file was overwritten"))

    def identical_to_fresh(tmp: Path, results: list[Result]) -> Optional[str]:
        fresh = subprocess.run([PY, *fill(ev(output="{tmp}/fresh", limit="2"), tmp)],
                               cwd=REPO, capture_output=True, text=True, timeout=300)
        if fresh.returncode != 0:
            return f"fresh reference eval failed rc {fresh.returncode}"
        a, b = gen_responses(tmp / "eval"), gen_responses(tmp / "fresh")
        if a != b:
            return f"generations differ from an uninterrupted run ({len(a)} vs {len(b)} samples)"
        if results_metrics(tmp / "eval") != results_metrics(tmp / "fresh"):
            return "results.json metrics differ from an uninterrupted run"
        return None
    eval2 = ev(limit="2")
    add(Case("eval: SIGKILL mid-run, rerun resumes (identical)", eval2, sig=signal.SIGKILL,
             signal_when="eval/generations/*.jsonl", signal_rc=(-9,), then=eval2, expect_rc=(0,),
              check=identical_to_fresh))
    add(Case("eval: Ctrl-C (SIGINT) mid-run", eval2, sig=signal.SIGINT, signal_when="eval/generations/*.jsonl",
             expect_rc=(130,), expect="evaluate.py",
             check=lambda tmp, r: None if list((tmp / "eval/generations").glob("*.jsonl"))
             else "finished generations lost"))

    # ---- environment
    def home_under_file(tmp: Path):
        write(tmp / "afile", "x")
    add(Case("env: HOME unwritable (cache must be created under a file)", T,
             env={"HOME": "{tmp}/afile/home", "XDG_CACHE_HOME": "", "HF_HOME": ""}, expect_rc=(1, 2),
             expect="cache", setup=home_under_file, timeout=240,
             known="POOR: blames model.path; the cause is the cache folder (HOME / STAPO_CACHE_DIR)",
             known_when=lambda r: "model.path" in r[-1].last_line and "STAPO_CACHE_DIR" not in r[-1].last_line, ))
    add(Case("env: HOME nonexistent (cache converted there)", T,
             env={"HOME": "{tmp}/newhome", "XDG_CACHE_HOME": "", "HF_HOME": ""}, expect_rc=(0,),
              check=need_checkpoint("step_000002"), timeout=300))
    add(Case("env: STAPO_CACHE_DIR is a file", T, env={"STAPO_CACHE_DIR": "{tmp}/afile"}, expect_rc=(1, 2),
             expect="afile", setup=home_under_file, timeout=240,
             known="POOR: blames model.path; the cause is the cache folder (HOME / STAPO_CACHE_DIR)",
             known_when=lambda r: "model.path" in r[-1].last_line and "STAPO_CACHE_DIR" not in r[-1].last_line, ))
    add(Case("env: WANDB_MODE=garbage (config disabled)", T, env={"WANDB_MODE": "garbage"}, expect_rc=(0,)))
    add(Case("env: WANDB_MODE=garbage with wandb_mode=offline", [*T, "logging.wandb_mode=offline"],
             env={"WANDB_MODE": "garbage", "WANDB_DIR": "{tmp}/wandb"}, expect_rc=(0, 2), expect="wandb",
             known="POOR: the line does not name the environment variable WANDB_MODE as the cause",
             known_when=lambda r: r[-1].rc != 0 and "WANDB_MODE" not in r[-1].last_line,
             setup=lambda tmp: (tmp / "wandb").mkdir()))
    add(Case("env: wandb offline, WANDB_DIR unwritable", [*T, "logging.wandb_mode=offline"],
             env={"WANDB_DIR": "{tmp}/afile/wandb"}, expect_rc=(0, 1, 2), expect="wandb", setup=home_under_file))
    add(Case("env: open-file limit 64 (RLIMIT_NOFILE)", T, preexec=limit_files(64), expect_rc=(0, 1)))
    add(Case("env: address space 3 GiB (RLIMIT_AS)", T, preexec=limit_memory(3), expect_rc=(0, 1),
             expect=""))
    C.extend(_issue31_cases())
    return C


# --------------------------------------------------------------------------------------------- issue 31 cases
# Results that know what they were made from, runs that cannot learn, verdicts from clean data (issue 31).  Every
# kind starts with "i31 " (``--only i31``).  Studies are built as train.py and the runner leave them (tiny study:
# 2 methods x 2 seeds x 2 steps; no training needed); evaluations and runs use the tiny configs.

STUDY_CFG = str(REPO / "configs" / "study" / "tiny_test.yaml")
STUDY_OVERRIDES = "trainer.total_steps=2,trainer.save_every=1,trainer.log_examples_every=0"
STUDY_RUNS = ("stapo_seed0", "grpo_seed0", "stapo_seed1", "grpo_seed1")

#: A user module registering a loss that returns NaN and a mask that keeps no token (tests/test_cannot_learn.py).
CANNOT_LEARN_PLUGIN = '''
import torch
from stapo.core.masks import TokenMask, register_token_mask
from stapo.core.objectives import get_objective, register_objective, register_policy_loss


@register_policy_loss("rel_nan_loss")
def nan_loss(logprobs, old_logprobs, advantages, keep, objective):
    flags = torch.zeros_like(logprobs)
    return logprobs * float("nan"), {"pg_clipfrac": flags, "pg_clipfrac_lower": flags}


@register_token_mask("rel_silence_all", maskable_rows="all")
def silence_all(logprobs, entropy, advantages, response_mask):
    return TokenMask(keep=torch.zeros_like(response_mask, dtype=torch.bool), stats={})


register_objective(get_objective("justrl").replace(name="rel_nan_objective", policy_loss="rel_nan_loss"))
register_objective(get_objective("justrl").replace(name="rel_silent_objective", token_mask="rel_silence_all"))
'''


def _stapo() -> None:
    """Make the tree's stapo importable in this process (setups that write run folders as train.py does)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def _study_row(step: int, reward: float, entropy: object = 1.0) -> dict:
    return {"step": step, "critic/score/mean": reward, "actor/entropy": entropy, "response_length/total_tokens": 10.0,
            "timing_s/step": 1.0}


def study_cmd(*extra: str) -> list[str]:
    return ["-m", "stapo.study", "--config", STUDY_CFG, "output_dir={tmp}/study", *extra]


def claims_cmd(*extra: str) -> list[str]:
    return ["-m", "stapo.study.claims", "--config", STUDY_CFG, "output_dir={tmp}/study", *extra]


def study_runs(*overrides: str, ckpt: bool = True, rows=None, model: bool = False):
    """setup: the tiny study's four runs finished as train.py and the runner leave them (config.json,
    fingerprint.json, metrics.jsonl, a checkpoint unless ``ckpt=False`` (an exported grid), finished.json);
    ``rows(name)`` gives a run's metrics rows; ``model``: a local model folder ``$TMP/model`` first."""
    def setup(tmp: Path) -> None:
        _stapo()
        from stapo.config import to_dict
        from stapo.common.fingerprint import write_fingerprint
        from stapo.run.run_identity import run_fingerprint
        from stapo.study import load_study_config, run_specs
        from stapo.study.runner import FINISHED

        if model:
            model_folder(tmp)
        cfg = load_study_config(STUDY_CFG, [f"output_dir={tmp}/study", *fill(overrides, tmp)])
        for spec in run_specs(cfg):
            d = spec.run_dir
            d.mkdir(parents=True)
            data = rows(spec.name) if rows else [_study_row(s, 0.25 * s * (spec.seed + 1)) for s in (1, 2)]
            write(d / "metrics.jsonl", jsonl(data))
            if ckpt:
                write(d / "checkpoints" / "step_000002" / "trainer_state.pt", b"x")
            write(d / "config.json", json.dumps(to_dict(spec.train), indent=2))
            write_fingerprint(d, run_fingerprint(spec.train))
            write(d / FINISHED, json.dumps({"steps": 2}) + "\n")
    return setup


def then_also(*fns):
    def setup(tmp: Path) -> None:
        for fn in fns:
            fn(tmp)
    return setup


def study_intact(report: bool = False):
    """check: every run folder still holds its metrics and finished marker; report.md written only if ``report``."""
    def check(tmp: Path, results: list[Result]) -> Optional[str]:
        for name in STUDY_RUNS:
            d = tmp / "study" / "runs" / name
            if not (d / "metrics.jsonl").exists() or not (d / "finished.json").exists():
                return f"run folder {name} lost its metrics or finished marker"
        has = (tmp / "study" / "report.md").exists()
        if has != report:
            return "report.md was written from the old runs" if has else "no report.md"
        return None
    return check


def file_has(rel: str, *words: str):
    def check(tmp: Path, results: list[Result]) -> Optional[str]:
        p = tmp / rel
        if not p.exists():
            return f"{rel} was not written"
        text = p.read_text(encoding="utf-8", errors="replace")
        missing = [w for w in words if w.lower() not in text.lower()]
        return f"{rel} lacks {missing}" if missing else None
    return check


HF_FILES = ("trainer_state.pt", "COMPLETE.json", "optimizer", "rng")


def model_folder(tmp: Path, step: str = "step_000001", dst: str = "model") -> Path:
    """A plain model folder (weights, config, tokenizer) copied from the reference run's checkpoint ``step``."""
    src = ref_run() / "checkpoints" / step
    out = tmp / dst
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(HF_FILES):
            shutil.copy2(f, out / f.name)
    return out


def replace_weights(tmp: Path, dst: str = "model") -> None:
    """The weights at ``$TMP/<dst>`` replaced by those of the reference run's step 2 (same shapes, other values)."""
    shutil.copy2(ref_run() / "checkpoints" / "step_000002" / "model.safetensors", tmp / dst / "model.safetensors")


def edit_json(rel: str, fn):
    def setup(tmp: Path) -> None:
        p = tmp / rel
        data = json.loads(p.read_text(encoding="utf-8"))
        fn(data)
        p.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return setup


def _issue31_cases() -> list[Case]:
    C: list[Case] = []
    add = C.append
    T = TRAIN
    plugin = "trainer.import_modules=[{tmp}/rel_plugin.py]"
    fast = ["trainer.log_examples_every=0", "rollout.response_length=4"]

    def write_plugin(tmp: Path) -> None:
        write(tmp / "rel_plugin.py", CANNOT_LEARN_PLUGIN)

    def nothing_written(tmp: Path, results: list[Result]) -> Optional[str]:
        return "a run folder was created" if (tmp / "runs" / "r").exists() else None

    # ---- config values that make a run that cannot learn: refused before the model loads (exit 2, the key)
    for override, key in (("actor.lr=inf", "actor.lr"), ("actor.lr=nan", "actor.lr"),
                          ("rollout.temperature=inf", "rollout.temperature"),
                          ("algorithm.kl_coef=inf", "algorithm.kl_coef"),
                          ("validation.temperature=-inf", "validation.temperature"),
                          ("actor.betas=[0.9,.nan]", "actor.betas"),
                          ("algorithm.clip_ratio_high=1.2", "clip_ratio_high"),
                          ("algorithm.clip_ratio_low=1.0", "clip_ratio_low"),
                          ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization"),
                          ("trainer.seed=-1", "trainer.seed"),
                          ("trainer.stop_after_nonfinite_steps=0", "trainer.stop_after_nonfinite_steps")):
        add(Case(f"i31 config: {override}", [*T, override], expect=key, check=nothing_written))
    add(Case("i31 config: clip given as ratio bounds 0.8 / 1.2",
             [*T, "algorithm.clip_ratio_low=0.8", "algorithm.clip_ratio_high=1.2"], expect="ratio bound",
             check=nothing_written))
    add(Case("i31 config: warm-up longer than the run", [*T, "actor.warmup_steps=3"], expect="actor.warmup_steps",
             check=nothing_written))

    # ---- runs that cannot learn: stop with one line, exit 1, the valid checkpoint kept
    add(Case("i31 run: policy loss returns NaN (plugin)",
             [*T, plugin, "algorithm.objective=rel_nan_objective", "trainer.total_steps=5", *fast],
             expect_rc=(1,), expect="cannot learn", setup=write_plugin,
             check=lambda tmp, r: None if checkpoints(tmp) else "no checkpoint kept"))
    add(Case("i31 run: token mask keeps no token (plugin)",
             [*T, plugin, "algorithm.objective=rel_silent_objective", "trainer.total_steps=5", *fast],
             expect_rc=(1,), expect="cannot learn", setup=write_plugin,
             check=all_checks(steps_exactly([1, 2, 3]), need_checkpoint("step_000003"))))
    add(Case("i31 run: SIGHUP (terminal closed), then --resume", [*T, "trainer.total_steps=3"], sig=signal.SIGHUP,
             signal_rc=(129,), signal_expect="SIGHUP", then=[*T, "trainer.total_steps=3", "--resume"],
             expect_rc=(0,), expect="", check=all_checks(steps_exactly([1, 2, 3]), need_checkpoint("step_000003"))))

    def bigger_config(key: str, delta: int):
        def setup(tmp: Path) -> None:
            folder = model_folder(tmp)
            def more(c: dict) -> None:
                c[key] += delta
                if key == "num_hidden_layers" and c.get("layer_types"):  # keep the config itself consistent
                    c["layer_types"] = c["layer_types"] + c["layer_types"][-1:] * delta
            edit_json("model/config.json", more)(tmp)
            assert folder.exists()
        return setup
    add(Case("i31 model: config.json of another width than the weights", [*T, "model.path={tmp}/model"],
             expect="model", setup=bigger_config("intermediate_size", 8), check=nothing_written))
    add(Case("i31 model: config.json with one layer more than the weights", [*T, "model.path={tmp}/model"],
             expect="model", setup=bigger_config("num_hidden_layers", 1), check=nothing_written))

    # ---- a run knows what it was made from (fingerprint.json) on --resume
    one = [*T, "model.path={tmp}/model", "trainer.total_steps=1"]
    add(Case("i31 resume: weights replaced under the same model.path", one, setup=model_folder,
             between=replace_weights, then=[*T, "model.path={tmp}/model", "--resume"], expect="model.path",
             check=steps_exactly([1])))
    rows2 = [{**r, "answer": str(int(r["answer"]) + 1)} for r in GOOD_ROWS]
    fileargs = ["data.train_set=file", "data.train_file.path={tmp}/set.jsonl"]
    add(Case("i31 resume: training rows changed under the same file", [*T, *fileargs, "trainer.total_steps=1"],
             setup=lambda tmp: write(tmp / "set.jsonl", jsonl(GOOD_ROWS)),
             between=lambda tmp: write(tmp / "set.jsonl", jsonl(rows2)), then=[*T, *fileargs, "--resume"],
             expect="data.train_file.path", check=steps_exactly([1])))
    add(Case("i31 resume: a run from before fingerprints", [*T, "trainer.total_steps=3", "--resume"], expect_rc=(0,),
             setup=lambda tmp: (copy_ref(tmp) / "fingerprint.json").unlink(),
             check=all_checks(lambda tmp, r: None if "fingerprint" in r[-1].stderr else "no word about it",
                              steps_exactly([1, 2, 3]), file_has("runs/r/fingerprint.json", "machine"))))
    add(Case("i31 resume: on another kind of machine", [*T, "trainer.total_steps=3", "--resume"], expect_rc=(0,),
             setup=then_also(copy_ref, edit_json("runs/r/fingerprint.json",
                                                 lambda f: f.__setitem__("machine", "cuda:NVIDIA H100:sm90"))),
             # the machine line comes before the resume's own lines: looked for anywhere on stderr
             check=all_checks(lambda tmp, r: None if "machine" in r[-1].stderr else "no word about it",
                              steps_exactly([1, 2, 3]),
                              file_has("runs/r/config_changes.jsonl", "fingerprint.machine"))))
    add(Case("i31 resume: override after the flag (--resume key=value)", [*T, "--resume", "trainer.total_steps=3"],
             expect_rc=(0,), setup=copy_ref, check=steps_exactly([1, 2, 3])))

    # ---- gold answers checked at load
    gold_rows = [*GOOD_ROWS[:5], {"id": 6, "problem": "Say it.", "answer": "\\frac{"}]
    fileargs = ["data.train_set=file", "data.train_file.path={tmp}/set.jsonl"]
    add(Case("i31 gold: training file with an unparsable gold (1 of 6)", [*T, *fileargs],
             setup=lambda tmp: write(tmp / "set.jsonl", jsonl(gold_rows)), expect="max_unparsable_gold_fraction",
             check=nothing_written))
    add(Case("i31 gold: the same under a raised threshold", [*T, *fileargs, "data.max_unparsable_gold_fraction=0.5"],
             setup=lambda tmp: write(tmp / "set.jsonl", jsonl(gold_rows)), expect_rc=(0,), expect="gold",
             expect_on_success=True, check=need_checkpoint("step_000002")))

    # ---- evaluations know what they were made from
    ev_model = ["--model", "{tmp}/model"]
    add(Case("i31 eval: weights replaced at the model path, rerun into the same output", ev(*ev_model),
             setup=model_folder, between=replace_weights, then=ev(*ev_model, limit="2"), expect="--output",
             check=lambda tmp, r: None if (tmp / "eval" / "results.json").exists() else "old results.json gone"))

    def snapshot_gens(tmp: Path) -> None:
        model_folder(tmp, dst="moved")
        write(tmp / "gens_before.json", json.dumps(sorted(map(repr, gen_responses(tmp / "eval").items()))))

    def same_gens(tmp: Path, results: list[Result]) -> Optional[str]:
        before = json.loads((tmp / "gens_before.json").read_text())
        after = sorted(map(repr, gen_responses(tmp / "eval").items()))
        return None if before == after and before else "the samples were not reused"
    add(Case("i31 eval: the same weights in another folder, rerun into the same output", ev(*ev_model),
             setup=model_folder, between=snapshot_gens, then=ev("--model", "{tmp}/moved"), expect_rc=(0,),
             check=same_gens))
    add(Case("i31 eval: rerun with another grader.require_value", ev(), then=ev("grader.require_value=true"),
             expect="grader"))
    bench = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 4)]
    mine = ["data.benchmarks=[mine]", "data.custom_benchmarks.mine.path={tmp}/mine.jsonl",
            "data.custom_benchmarks.mine.samples=1", "generation.settings=[{}]"]

    def bench_setup(rows):
        return lambda tmp: write(tmp / "mine.jsonl", jsonl(rows))
    fixed = [bench[0], {**bench[1], "answer": "5"}, bench[2]]
    add(Case("i31 eval: custom benchmark gold corrected, rerun into the same output", ev(*mine, limit="3"),
             setup=bench_setup(bench), between=bench_setup(fixed), then=ev(*mine, limit="3"), expect_rc=(0,),
             expect="", check=lambda tmp, r: None if list((tmp / "eval/generations/superseded").glob("*"))
             else "no superseded samples kept"))
    inserted = [{"problem": "What is 10 + 10?", "answer": "20"}, *bench]
    add(Case("i31 eval: custom benchmark row inserted, rerun into the same output", ev(*mine, limit="4"),
             setup=bench_setup(bench), between=bench_setup(inserted), then=ev(*mine, limit="4"), expect_rc=(0,),
             check=lambda tmp, r: None if len(gen_responses(tmp / "eval")) == 4 else
             f"{len(gen_responses(tmp / 'eval'))} samples, expected 4"))
    bad_gold = [*bench[:2], {"problem": "Solve it.", "answer": "\\begin{cases} 1 \\end{cases}"}]
    add(Case("i31 eval: benchmark gold math-verify cannot parse", ev(*mine, limit="3"), setup=bench_setup(bad_gold),
             expect="max_unparsable_gold_fraction"))
    add(Case("i31 eval: unparsable gold under a raised threshold",
             ev(*mine, "data.max_unparsable_gold_fraction=0.5", limit="3"), setup=bench_setup(bad_gold),
             expect_rc=(0,), expect="gold", expect_on_success=True, check=file_has("eval/results.json",
                                                                                    "unparsable_golds", "mine/2")))
    add(Case("i31 eval: temperature 0 with N > 1", ev("generation.settings=[{name: greedy, temperature: 0.0}]"),
             expect="temperature"))
    add(Case("i31 eval: prompt fills the model's context", ev(*ev_model),
             setup=then_also(model_folder, edit_json("model/config.json",
                                                     lambda c: c.__setitem__("max_position_embeddings", 8))),
             expect="max_prompt_tokens"))

    # ---- paired comparisons (scripts/paired_eval_diff.py) on hand-made evaluation folders
    def eval_folder(name: str, flags: dict, **changes):
        def setup(tmp: Path) -> None:
            folder = tmp / name
            lines = [{"problem_id": p, "sample": j, "benchmark": "arith_test", "setting": "t1.0_p1.0", "correct": c,
                      "response": f"{name}-{p}-{j}"} for p, fl in flags.items() for j, c in enumerate(fl)]
            write(folder / "generations" / "arith_test__t1.0_p1.0.jsonl", jsonl(lines))
            m = {"model": {"kind": "hf_folder", "path": f"/models/{name}", "step": None}, "model_digest": name[0] * 64,
                 "dtype": "float32", "backend": "hf", "prompt": {"style": "auto", "system_prompt": None},
                 "max_new_tokens": 256, "seed": 0, "samples_per_call": 4, "samples": {"arith_test": 2},
                 "settings": {"t1.0_p1.0": [1.0, 1.0]}, "grader": {"require_value": False}, "verifier": None,
                 "data": {"arith_test": "generated:arith_test:0123456789abcdef"}, "machines": ["cpu:x:avx2"]}
            m.update(changes)
            write(folder / "eval_manifest.json", json.dumps(m))
        return setup
    fa = {"x": [True, True], "y": [False, True], "z": [False, False]}
    fb = {"x": [True, False], "y": [False, False], "z": [True, False]}
    paired = [str(SCRIPT_REPO / "scripts" / "paired_eval_diff.py")]
    add(Case("i31 paired: evaluations with different max_new_tokens", [*paired, "{tmp}/ref", "{tmp}/other"],
             setup=then_also(eval_folder("ref", fa), eval_folder("other", fb, max_new_tokens=512)),
             expect="max_new_tokens"))
    add(Case("i31 paired: evaluations with different N", [*paired, "{tmp}/ref", "{tmp}/other"],
             setup=then_also(eval_folder("ref", fa), eval_folder("other", fb, samples={"arith_test": 4})),
             expect="samples"))
    add(Case("i31 paired: one folder given twice", [*paired, "A={tmp}/ref", "B={tmp}/ref"],
             setup=eval_folder("ref", fa), expect="same folder"))
    add(Case("i31 paired: a folder and its copy", [*paired, "{tmp}/ref", "{tmp}/copy"],
             setup=then_also(eval_folder("ref", fa), lambda tmp: shutil.copytree(tmp / "ref", tmp / "copy")),
             expect="one evaluation twice"))
    add(Case("i31 paired: another model, same protocol (compared)", [*paired, "{tmp}/ref", "{tmp}/other"],
             setup=then_also(eval_folder("ref", fa), eval_folder("other", fb)), expect_rc=(0,),
             check=lambda tmp, r: None if "| t1.0_p1.0 | arith_test | other | 3 |" in r[-1].stdout
             else "no paired row for the 3 problems"))

    # ---- a study reuses runs by content
    lr = "methods.stapo.overrides=[algorithm.objective=stapo,actor.lr=0.002]"
    add(Case("i31 study: actor.lr changed after the runs finished", study_cmd(lr), setup=study_runs(),
             expect="actor.lr", check=study_intact(), long_line_ok=True))
    add(Case("i31 study: objective changed after the runs finished",
             study_cmd("methods.grpo.overrides=[algorithm.objective=justrl]"), setup=study_runs(),
             expect="algorithm.objective", check=study_intact(), long_line_ok=True))
    add(Case("i31 study: rollout.n changed after the runs finished",
             study_cmd(f"overrides=[{STUDY_OVERRIDES},rollout.n=2]"), setup=study_runs(), expect="rollout.n",
             check=study_intact(), long_line_ok=True))
    add(Case("i31 study: model.path changed after the runs finished",
             study_cmd(f"overrides=[{STUDY_OVERRIDES},model.path={{tmp}}/model]"),
             setup=then_also(study_runs(), model_folder), expect="model.path", check=study_intact(), long_line_ok=True))
    add(Case("i31 study: only a how-to-compute key changed (micro-batch)",
             study_cmd(f"overrides=[{STUDY_OVERRIDES},actor.ppo_micro_batch_size=1]"), setup=study_runs(),
             expect_rc=(0,), check=study_intact(report=True)))
    add(Case("i31 study: --dry-run of a changed plan", study_cmd(lr, "--dry-run"), setup=study_runs(),
             expect_rc=(0, 2), expect="actor.lr", check=study_intact(), long_line_ok=True))
    add(Case("i31 study: config.json edited by hand (another model)", study_cmd(),
             setup=then_also(study_runs(), edit_json("study/runs/grpo_seed1/config.json",
                                                     lambda c: c["model"].__setitem__("path", "/models/other"))),
             expect="config.json", check=study_intact()))

    def link_seed(tmp: Path) -> None:
        d = tmp / "study" / "runs"
        shutil.rmtree(d / "stapo_seed1")
        (d / "stapo_seed1").symlink_to(d / "stapo_seed0", target_is_directory=True)

    def copy_seed(tmp: Path) -> None:
        d = tmp / "study" / "runs"
        shutil.rmtree(d / "stapo_seed1")
        shutil.copytree(d / "stapo_seed0", d / "stapo_seed1")
    add(Case("i31 study: a run folder symlinked into another seed's place", study_cmd(),
             setup=then_also(study_runs(), link_seed), expect="stapo_seed1", check=study_intact()))
    add(Case("i31 study: a run folder copied into another seed's place", study_cmd(),
             setup=then_also(study_runs(), copy_seed), expect="stapo_seed1", check=study_intact()))
    add(Case("i31 study: total_steps raised on an exported grid", study_cmd(
        "overrides=[trainer.total_steps=3,trainer.save_every=1,trainer.log_examples_every=0]"),
        setup=study_runs(ckpt=False), expect="plans 3 steps", check=study_intact(), long_line_ok=True))
    mp = f"overrides=[{STUDY_OVERRIDES},model.path={{tmp}}/model]"

    def flip_weights(tmp: Path) -> None:
        replace_weights(tmp)
    add(Case("i31 study: model weights replaced under the same path after it finished", study_cmd(mp),
             setup=then_also(study_runs(mp, model=True), flip_weights), expect="model", check=study_intact(),
             long_line_ok=True))

    # ---- verdicts from clean data only (report and claims on hand-written runs)
    def rows_with(bad_run: str, bad_rows):
        def rows(name: str):
            return bad_rows if name == bad_run else [_study_row(s, 0.5 * s) for s in (1, 2, 3, 4)]
        return rows
    four = "overrides=[trainer.total_steps=4,trainer.save_every=1,trainer.log_examples_every=0]"
    nan_rows = [_study_row(1, 0.5), _study_row(2, 1.0), _study_row(3, 1.0), _study_row(4, 1.0, entropy="nan")]
    inf_rows = [_study_row(1, 0.5), _study_row(2, 1.0), _study_row(3, 1.0), _study_row(4, 1e308)]
    gap_rows = [_study_row(1, 0.5), _study_row(4, 1.0)]
    for what, bad in (("NaN entropy in the final window", nan_rows), ("+inf (old 1e308) reward", inf_rows),
                      ("rows of steps 2-3 deleted", gap_rows)):
        add(Case(f"i31 report: a run with {what}", study_cmd(four, "--report-only"),
                 setup=study_runs(four, rows=rows_with("stapo_seed1", bad)), expect_rc=(0,),
                 check=file_has("study/report.md", "excluded", "stapo_seed1")))
    add(Case("i31 claims: a run with NaN entropy in the final window", claims_cmd(four),
             setup=study_runs(four, rows=rows_with("stapo_seed1", nan_rows)), expect_rc=(0,),
             check=file_has("study/claims.md", "excluded", "stapo_seed1")))
    add(Case("i31 claims: --role justrl=grpo (a method of another objective)", claims_cmd(four, "--role",
                                                                                        "justrl=grpo"),
             setup=study_runs(four), expect="--allow-objective",
             check=lambda tmp, r: "claims.md written" if (tmp / "study/claims.md").exists() else None))
    add(Case("i31 claims: --allow-objective with an unknown role", claims_cmd(four, "--allow-objective", "ppo"),
             setup=study_runs(four), expect="ppo"))
    add(Case("i31 claims: the role mapping is recorded", claims_cmd(four, "--role", "justrl=grpo",
                                                                    "--allow-objective", "justrl"),
             setup=study_runs(four), expect_rc=(0,), check=file_has("study/claims.md", "Roles", "justrl → grpo")))
    add(Case("i31 study: --export into the study's own runs/", study_cmd("--export", "{tmp}/study/runs/x"),
             setup=study_runs(), expect="export", check=study_intact()))
    add(Case("i31 study: --report-only then an override (key=value after the option)",
             ["-m", "stapo.study", "--config", STUDY_CFG, "--report-only", "output_dir={tmp}/study"],
             setup=study_runs(), expect_rc=(0,), check=study_intact(report=True)))
    add(Case("i31 study: the same seed listed twice (seeds=[0,0])", study_cmd("seeds=[0,0]", "--dry-run"),
             expect_rc=(0, 2), expect="seeds", expect_on_success=True))
    return C


# --------------------------------------------------------------------------------------------- running

def _child_setup(preexec: Optional[Callable[[], None]]) -> Callable[[], None]:
    """In the child before it runs: SIGINT / SIGTERM / SIGHUP at their defaults (a script started in the background
    of a shell, ``&`` or nohup, passes SIGINT / SIGHUP on as ignored, and the signal cases would test nothing),
    then the case's own ``preexec`` (resource limits)."""
    def setup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # nohup passes SIGHUP on as ignored: the SIGHUP case tests that
        if preexec is not None:
            preexec()
    return setup


_RUNNING: list[subprocess.Popen] = []  # the child in progress, stopped if this script is interrupted


def _spawn(argv: list[str], tmp: Path, case: Case):
    env = dict(os.environ)
    env.pop("STAPO_DEBUG", None)
    for k, v in (case.env or {}).items():
        v = v.replace("{tmp}", str(tmp))
        if v == "":
            env.pop(k, None)
        else:
            env[k] = v
    out_f = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
    err_f = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
    proc = subprocess.Popen([PY, *argv], cwd=REPO, env=env, stdout=out_f, stderr=err_f,
                            preexec_fn=_child_setup(case.preexec), start_new_session=True)
    _RUNNING[:] = [proc]
    return proc, out_f, err_f, time.time()


def _finish(proc, out_f, err_f, t0, argv, timeout: float) -> Result:
    try:
        rc: Optional[int] = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        rc = None
    out_f.seek(0)
    err_f.seek(0)
    res = Result(argv, rc, out_f.read(), err_f.read(), time.time() - t0)
    out_f.close()
    err_f.close()
    return res


def run_case(case: Case, tmp: Path) -> tuple[list[Result], Optional[str]]:
    """Run one case; returns its results and a harness problem (None when the case ran as designed)."""
    deadline = time.time() + case.timeout
    if case.setup:
        case.setup(tmp)
    results: list[Result] = []
    argv = fill(case.args, tmp)
    proc, out_f, err_f, t0 = _spawn(argv, tmp, case)
    if case.sig is not None:
        sent = False
        while proc.poll() is None and time.time() < deadline:
            hits = [p for p in tmp.glob(case.signal_when) if p.is_file() and p.stat().st_size > 0]
            if hits:
                time.sleep(0.05)
                proc.send_signal(case.sig)
                sent = True
                break
            time.sleep(0.05)
        res = _finish(proc, out_f, err_f, t0, argv, deadline - time.time())
        results.append(res)
        if not sent:
            return results, f"no signal sent: {case.signal_when} never appeared (rc {res.rc})"
        if case.then is None:
            return results, None
        if case.between:
            case.between(tmp)
        argv = fill(case.then, tmp)
        proc, out_f, err_f, t0 = _spawn(argv, tmp, case)
    elif case.then is not None:  # two commands: the first runs to its end, `between` changes something, then
        results.append(_finish(proc, out_f, err_f, t0, argv, deadline - time.time()))
        if case.between:
            case.between(tmp)
        argv = fill(case.then, tmp)
        proc, out_f, err_f, t0 = _spawn(argv, tmp, case)
    results.append(_finish(proc, out_f, err_f, t0, argv, deadline - time.time()))
    return results, None


def save_logs(tmp: Path, results: list[Result]) -> None:
    """Each command's stdout / stderr as ``$TMP/cmd<N>.stdout|stderr`` (kept with --keep)."""
    for n, r in enumerate(results, 1):
        (tmp / f"cmd{n}.stdout").write_text(r.stdout, encoding="utf-8")
        (tmp / f"cmd{n}.stderr").write_text(r.stderr, encoding="utf-8")


#: Progress lines that may precede the one error line.
INFO_LINE = re.compile(r"^(run directory:|resuming |wandb: |SIGTERM: |SIGHUP \(|Ctrl-C: |interrupt)", re.I)


def informative(line: str) -> Optional[str]:
    if not line:
        return "stderr is empty"
    if len(line) > 600:
        return f"last stderr line is {len(line)} characters"
    if re.fullmatch(r"[A-Za-z_.]*(Error|Exception)(: .{0,20})?", line):
        return "last stderr line is a bare exception"
    return None


#: Lines that are library noise rather than the error: progress bars, argparse's usage block.  Extra lines of
#: this sort make a case POOR; any other extra line makes it BAD.
NOISE_LINE = re.compile(r"(examples/s\]|it/s\]|\d+%\||^usage: |^\s+\[-|^\s+\[?--?\w|^\s+\[?overrides)")


def judge(case: Case, results: list[Result], harness: Optional[str], check_err: Optional[str]) -> tuple[str, str]:
    if harness:
        return "BAD", harness
    reasons, soft = [], []
    if any(r.rc is None for r in results):
        reasons.append(f"timed out after {case.timeout:.0f} s")
    if case.sig is not None and case.signal_rc is not None and results[0].rc not in case.signal_rc:
        reasons.append(f"signalled process exit {results[0].rc}, expected {'/'.join(map(str, case.signal_rc))}")
    if case.sig is not None and case.signal_expect and case.signal_expect.lower() not in results[0].last_line.lower():
        reasons.append(f"signalled process's last line lacks {case.signal_expect!r}")
    if case.sig is None and case.then is not None and len(results) > 1 and results[0].rc not in case.first_rc:
        reasons.append(f"first command exit {results[0].rc}, expected {'/'.join(map(str, case.first_rc))} "
                       f"({results[0].last_line[:120]!r})")
    last = results[-1]
    if last.rc is not None and last.rc not in case.expect_rc:
        reasons.append(f"exit {last.rc}, expected {'/'.join(map(str, case.expect_rc))}")
    for r in results:
        if "Traceback" in r.stderr:
            reasons.append("Python traceback on stderr")
            break
    for r in results:
        if r.rc in (0, None, -9):
            continue
        why = informative(r.last_line)
        if why and case.long_line_ok and why.endswith(" characters"):
            soft.append(f"{why}: one line naming every changed run with its keys")
        elif why:
            reasons.append(why)
        extra = [ln for ln in r.stderr.replace("\r", "\n").splitlines()[:-1]
                 if ln.strip() and not INFO_LINE.match(ln) and ln.strip() != r.last_line]
        def is_noise(ln: str) -> bool:
            return bool(NOISE_LINE.search(ln) or (case.soft_lines and re.search(case.soft_lines, ln)))
        noise = [ln for ln in extra if is_noise(ln)]
        other = [ln for ln in extra if not is_noise(ln)]
        if other:
            reasons.append(f"{len(other) + 1} lines on stderr, one expected (first: {other[0].strip()[:90]!r})")
        elif noise:
            soft.append(f"{len(noise)} extra line(s) (progress bar / usage / warning) before the error line")
    if case.expect and (last.rc != 0 or case.expect_on_success) and case.expect.lower() not in last.last_line.lower():
        reasons.append(f"last line lacks {case.expect!r}")
    if check_err:
        reasons.append(check_err)
    if reasons:
        return "BAD", "; ".join(reasons)
    if case.known and (case.known_when is None or case.known_when(results)):
        soft.insert(0, case.known.removeprefix("POOR:").strip())
    if soft:
        return "POOR", "; ".join(soft)
    return "GOOD", ""


def md(s: str, n: int = 200) -> str:
    s = " ".join(s.split())
    if len(s) > n:
        s = s[: n - 1] + "…"
    return s.replace("|", "\\|").replace("`", "'")


def pretty_cmd(argv: list[str], tmp: Path) -> str:
    s = " ".join(shlex.quote(a) for a in argv)
    return s.replace(str(tmp), "$TMP").replace(TRAIN_CFG, "configs/tiny_test.yaml") \
        .replace(EVAL_CFG, "configs/eval/tiny_test.yaml").replace(str(DATA_ROOT), "../shared/data") \
        .replace(str(REPO) + "/", "")


def header() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=SCRIPT_REPO, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=SCRIPT_REPO,
                               capture_output=True, text=True).stdout.strip()
        commit += " (+ uncommitted changes)" if dirty else ""
        if REPO != SCRIPT_REPO:
            commit += f"; cases run in a copy of that working tree: {REPO}"
    except OSError:
        commit = "unknown"
    return (f"# Reliability check (scripts/check_reliability.py)\n\n"
            f"- machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, uid {os.getuid()}\n"
            f"- git commit: {commit}\n- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
            f"- `$TMP` is each case's own temporary folder; commands run from the repository root.\n"
            f"- verdict: GOOD (the docs/runs.md contract holds), POOR (holds, but known to be weak), BAD (why).\n")


def use_repo(repo: Path, data_root: Optional[Path]) -> None:
    """Point the cases at another tree (its train.py, evaluate.py, configs/, and its stapo/ first on sys.path)."""
    global REPO, TRAIN_CFG, EVAL_CFG, TRAIN, EVAL, DATA_ROOT
    REPO = repo.resolve()
    if data_root is not None:
        DATA_ROOT = data_root.resolve()
    TRAIN_CFG = str(REPO / "configs" / "tiny_test.yaml")
    EVAL_CFG = str(REPO / "configs" / "eval" / "tiny_test.yaml")
    TRAIN = ["train.py", "--config", TRAIN_CFG, *TRAIN[3:]]
    EVAL = ev()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], help="run the cases whose kind contains SUBSTR "
                    "(case-insensitive; repeatable)")
    ap.add_argument("--out", help="write the Markdown table here (default: stdout)")
    ap.add_argument("--list", action="store_true", help="list the case kinds and exit")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folders (their paths go to stderr)")
    ap.add_argument("--repo", type=Path, help="run train.py / evaluate.py of this tree instead (e.g. a copy of a "
                    "working tree that someone is editing: cp the tracked files; the venv's editable stapo is "
                    "shadowed by the copy's stapo/ because the scripts run from its root)")
    ap.add_argument("--data-root", type=Path, help=f"benchmarks / train data (default {DATA_ROOT})")
    args = ap.parse_args(argv)
    if args.repo or args.data_root:
        use_repo(args.repo or REPO, args.data_root)
    cases = [c for c in _cases() if not args.only or any(s.lower() in c.kind.lower() for s in args.only)]
    if args.list:
        for c in cases:
            print(c.kind)
        return 0
    if not cases:
        print(f"check_reliability.py: no case matches --only {args.only}", file=sys.stderr)
        return 2
    head = header()  # the commit as the run starts
    rows, counts = [], {"GOOD": 0, "POOR": 0, "BAD": 0}
    t_all = time.time()
    try:
        for i, case in enumerate(cases, 1):
            tmp = Path(tempfile.mkdtemp(prefix=f"rel_{i:02d}_"))
            print(f"[{i}/{len(cases)}] {case.kind} ...", end="", file=sys.stderr, flush=True)
            check_err = None
            try:
                results, harness = run_case(case, tmp)
                save_logs(tmp, results)
                if not harness and case.check:
                    check_err = case.check(tmp, results)
            except Exception as exc:  # noqa: BLE001 - the harness itself failed; report, go on
                results, harness = [], f"harness error: {type(exc).__name__}: {exc}"
            verdict, why = judge(case, results, harness, check_err)
            counts[verdict] += 1
            cmd = " ; then ".join(pretty_cmd(r.argv, tmp) for r in results) or pretty_cmd(fill(case.args, tmp), tmp)
            if case.env:  # the environment the case sets, in front
                cmd = " ".join(f"{k}={shlex.quote(v.replace('{tmp}', '$TMP')) or '(unset)'}"
                               for k, v in case.env.items()) + " " + cmd
            if case.preexec:
                cmd = f"[{getattr(case.preexec, '__qualname__', 'preexec').split('.')[0]}] " + cmd
            if case.sig is not None and results:
                cmd = cmd.replace(" ; then ", f" ; {signal.Signals(case.sig).name} ; then ", 1) \
                    if case.then else cmd + f" ; {signal.Signals(case.sig).name}"
            res = " / ".join(f"exit {r.rc if r.rc is not None else 'TIMEOUT'}: {md(r.last_line, 200) or '(no stderr)'}"
                             for r in results)
            rows.append(f"| {md(case.kind, 80)} | `{md(cmd, 400)}` | {md(res, 420)} | "
                        f"**{verdict}**{(': ' + md(why, 300)) if why else ''} |")
            secs = sum(r.seconds for r in results)
            print(f" {verdict} ({secs:.0f} s){': ' + why if why else ''}", file=sys.stderr, flush=True)
            if args.keep:
                print(f"    kept {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
    except KeyboardInterrupt:
        for proc in _RUNNING:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        print("\ncheck_reliability.py: interrupted; the table has the cases finished so far", file=sys.stderr)
    finally:
        if "train" in _REF and not args.keep:
            shutil.rmtree(_REF["train"].parent.parent, ignore_errors=True)
    table = (head + f"- {len(rows)} cases in {time.time() - t_all:.0f} s: {counts['GOOD']} GOOD, "
             f"{counts['POOR']} POOR, {counts['BAD']} BAD\n\n"
             "| kind | command | result (exit code: last stderr line) | verdict |\n|---|---|---|---|\n"
             + "\n".join(rows) + "\n")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table, encoding="utf-8")
        print(f"table written to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(table)
    return 1 if counts["BAD"] else 0


if __name__ == "__main__":
    sys.exit(main())

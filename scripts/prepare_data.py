#!/usr/bin/env python
"""Build the data root (``data/`` by default) used by training and evaluation.

Layout written (the same as ``../shared/data``; see ``data/README.md``)::

    <out>/benchmarks/<name>/test.jsonl     aime24 aime25 amc23 math500 minerva_math olympiadbench
    <out>/train/dapo_math_17k.parquet      DAPO-Math-17k, deduplicated, verl format
    <out>/train/math_train_7474.json       MATH train with final answers
    <out>/train/synthetic_arithmetic.jsonl (only with --synthetic N)
    <out>/MANIFEST.json                    rows read/loaded/skipped and sha256 per file

Two modes:

``--from-local DIR``
    Copy a folder laid out like ``../shared/data`` into ``<out>``.  Every file is first loaded with
    :mod:`stapo.tasks.data` (benchmarks must load without a bad row; training sets report skipped rows),
    then copied byte for byte; the raw fields stay as they are and :mod:`stapo.tasks.data` normalises
    them when loading.  Tested (``tests/test_data.py``).

default: from the Hugging Face hub with ``datasets.load_dataset``
    **Untested**: the development sandbox has no hub access, so this code path has never been run.
    Dataset ids chosen (each converted to the raw layout above):

    ==============  ===============================================  ==================================
    name            hub id (config, split)                           notes
    ==============  ===============================================  ==================================
    aime24          HuggingFaceH4/aime_2024 (train)                  id, problem, solution, answer
    aime25          opencompass/AIME2025 (AIME2025-I + -II, test)    question, answer (OpenCompass copy,
                                                                     as the G-KV file in SOURCES.md)
    amc23           math-ai/amc23 (test)                             id, problem, answer (float), url
    math500         HuggingFaceH4/MATH-500 (test)                    problem, solution, answer, ...
    minerva_math    math-ai/minervamath (test)                       question, answer -> written as
                                                                     problem + solution "\\boxed{answer}"
    olympiadbench   Hothan/OlympiadBench (OE_TO_maths_en_COMP,        675 rows, final_answer list
                    train)
    dapo_math_17k   BytedTsinghua-SIA/DAPO-Math-17k (train)          1.79M rows = 17,917 problems x 100;
                                                                     deduplicated on extra_info.index,
                                                                     DAPO "Answer:" template stripped
    math_train      EleutherAI/hendrycks_math (7 subjects, train)    answer = last \\boxed{} of the
                                                                     solution; rows without one skipped
                                                                     (7,500 minus those; the reference
                                                                     file has 7,474)
    ==============  ===============================================  ==================================

Usage::

    python scripts/prepare_data.py --from-local ../shared/data --out data
    python scripts/prepare_data.py --out data                  # hub (needs network; untested)
    python scripts/prepare_data.py --from-local ../shared/data --synthetic 2048

Exit codes: 0 ok; 1 row counts differ from the reference counts and ``--check-counts`` was given;
2 a file is missing or unreadable, a benchmark has a bad row, or a data set name is unknown.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from stapo.tasks.boxed import last_boxed_content  # noqa: E402
from stapo.tasks.data import (  # noqa: E402
    BENCHMARKS,
    EXPECTED_ROWS,
    TRAIN_FILES,
    DataError,
    LoadedSet,
    benchmark_path,
    load_benchmark,
    load_dapo_math_17k,
    load_math_train,
    save_records_jsonl,
    train_path,
)

#: The training sets this script can validate and fetch (each needs a loader here and a hub recipe below).
_TRAIN_LOADERS: dict[str, Callable[..., LoadedSet]] = {"dapo_math_17k": load_dapo_math_17k,
                                                       "math_train": load_math_train}
ALL_SETS = BENCHMARKS + tuple(name for name in TRAIN_FILES if name in _TRAIN_LOADERS)

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _relpath(name: str) -> Path:
    """Path of ``name``'s file relative to a data root."""
    if name in BENCHMARKS:
        return benchmark_path(Path("."), name)
    return train_path(Path("."), name)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _refuse_unknown(names: Iterable[str]) -> list[str]:
    """``names`` as a list; a name that is not one of :data:`ALL_SETS` is refused (before anything is read or
    downloaded): ``ValueError("unknown data set 'x'; known: ...")``, one line."""
    names = list(names)
    unknown = [name for name in names if name not in ALL_SETS]
    if unknown:
        raise ValueError(f"unknown data set {', '.join(map(repr, unknown))}; known: {', '.join(ALL_SETS)}")
    return names


def _load_any(name: str, path: Path) -> LoadedSet:
    """Load ``path`` as dataset ``name`` (benchmarks strictly, training sets skipping bad rows).

    Raises:
        ValueError: ``name`` is not one of :data:`ALL_SETS` (never read as another set's file)."""
    _refuse_unknown([name])
    if name in BENCHMARKS:
        return load_benchmark(name, path.parents[2], on_bad_row="raise")
    return _TRAIN_LOADERS[name](path, on_bad_row="skip")


def _write_jsonl(rows: Iterable[dict], path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


# --------------------------------------------------------------------------------------------
# --from-local
# --------------------------------------------------------------------------------------------


def copy_local(src_root: Path, out_root: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Validate and copy each dataset file from ``src_root`` to ``out_root``.

    Returns:
        ``{name: manifest entry}`` (``file``, ``sha256``, ``rows_read``, ``rows_loaded``,
        ``skipped``, ``skipped_by_reason``, ``expected_rows``).

    Raises:
        DataError (incl. DataFileNotFoundError): a missing/unreadable file or a bad benchmark row.
        ValueError: source and destination are the same file, or an unknown name (before anything is copied).
    """
    manifest: dict[str, dict[str, Any]] = {}
    for name in _refuse_unknown(names):
        rel = _relpath(name)
        src = src_root / rel
        dst = out_root / rel
        loaded = _load_any(name, src)  # raises DataFileNotFoundError naming src if missing
        if dst.exists() and dst.resolve() == src.resolve():
            raise ValueError(f"{name}: source and destination are the same file ({src})")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        entry = loaded.stats.as_dict()
        entry.pop("path", None)
        entry.pop("source", None)
        entry.update(file=str(rel), sha256=_sha256(dst), expected_rows=EXPECTED_ROWS[name], origin=str(src))
        manifest[name] = entry
    return manifest


# --------------------------------------------------------------------------------------------
# Hugging Face hub (untested offline; see the module docstring)
# --------------------------------------------------------------------------------------------

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
HENDRYCKS_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


def _hub_aime24(load: Callable) -> list[dict]:
    ds = load("HuggingFaceH4/aime_2024", split="train")
    return [
        {"id": r["id"], "problem": r["problem"], "solution": r.get("solution", ""), "answer": str(r["answer"]), "url": r.get("url", "")}
        for r in ds
    ]


def _hub_aime25(load: Callable) -> list[dict]:
    rows = []
    for config in ("AIME2025-I", "AIME2025-II"):
        rows += [{"question": r["question"], "answer": str(r["answer"])} for r in load("opencompass/AIME2025", config, split="test")]
    return rows


def _hub_amc23(load: Callable) -> list[dict]:
    ds = load("math-ai/amc23", split="test")
    return [{"id": r.get("id", i), "problem": r["problem"], "answer": r["answer"], "url": r.get("url", "")} for i, r in enumerate(ds)]


def _hub_math500(load: Callable) -> list[dict]:
    keys = ("problem", "solution", "answer", "subject", "level", "unique_id")
    return [{k: r[k] for k in keys} for r in load("HuggingFaceH4/MATH-500", split="test")]


def _hub_minerva(load: Callable) -> list[dict]:
    ds = load("math-ai/minervamath", split="test")
    # No worked solutions in this copy: store the answer as a boxed "solution" so the loader's
    # rule (gold = last \boxed{} of the solution) applies unchanged.
    return [{"problem": r["question"], "solution": "\\boxed{" + str(r["answer"]) + "}", "idx": i} for i, r in enumerate(ds)]


def _hub_olympiad(load: Callable) -> list[dict]:
    ds = load("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", split="train")
    keys = ("id", "subfield", "context", "question", "solution", "final_answer", "is_multiple_answer", "unit", "answer_type", "error")
    return [{k: r.get(k) for k in keys} for r in ds]


def _strip_dapo_template(content: str) -> tuple[str, bool]:
    """Remove DAPO's "Answer:" instruction around a problem; returns (problem, template_found)."""
    found = content.startswith(DAPO_PREFIX) and content.endswith(DAPO_SUFFIX)
    if found:
        content = content[len(DAPO_PREFIX) : len(content) - len(DAPO_SUFFIX)]
    return content, found


def _hub_dapo(load: Callable) -> tuple[list[dict], dict[str, int]]:
    ds = load("BytedTsinghua-SIA/DAPO-Math-17k", split="train")
    seen: set[str] = set()
    rows, counts = [], {"duplicates_dropped": 0, "template_not_found": 0}
    for r in ds:
        key = str((r.get("extra_info") or {}).get("index"))
        if key in seen:
            counts["duplicates_dropped"] += 1
            continue
        seen.add(key)
        problem, found = _strip_dapo_template(r["prompt"][0]["content"])
        counts["template_not_found"] += not found
        rows.append(
            {
                "data_source": "DAPO-17k",
                "prompt": [{"content": problem, "role": "user"}],
                "ability": "math",
                "reward_model": {"ground_truth": str(r["reward_model"]["ground_truth"]), "style": "rule"},
                "extra_info": {"answer": "", "index": len(rows), "split": "train"},
            }
        )
    return rows, counts


def _hub_math_train(load: Callable) -> tuple[list[dict], dict[str, int]]:
    rows, counts = [], {"no_boxed_answer": 0}
    for subject in HENDRYCKS_SUBJECTS:
        for r in load("EleutherAI/hendrycks_math", subject, split="train"):
            answer = last_boxed_content(r["solution"])
            if answer is None:
                counts["no_boxed_answer"] += 1
                continue
            level = str(r.get("level", "")).replace("Level", "").strip()
            rows.append(
                {"problem": r["problem"], "answer": answer, "difficulty": float(level) if level.isdigit() else None, "type": r.get("type")}
            )
    return rows, counts


def download_hub(out_root: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Download each dataset from the hub into ``out_root`` in the raw layout, then load it back
    with :mod:`stapo.tasks.data` for the manifest.  Untested offline (see the module docstring).

    Raises:
        ValueError: an unknown name, before anything is downloaded (it is never fetched as another set)."""
    names = _refuse_unknown(names)
    from datasets import Dataset, load_dataset

    manifest: dict[str, dict[str, Any]] = {}
    bench_fns = {
        "aime24": _hub_aime24,
        "aime25": _hub_aime25,
        "amc23": _hub_amc23,
        "math500": _hub_math500,
        "minerva_math": _hub_minerva,
        "olympiadbench": _hub_olympiad,
    }
    for name in names:
        path = out_root / _relpath(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        notes: dict[str, int] = {}
        if name in bench_fns:
            _write_jsonl(bench_fns[name](load_dataset), path)
        elif name == "dapo_math_17k":
            rows, notes = _hub_dapo(load_dataset)
            Dataset.from_list(rows).to_parquet(str(path))
        elif name == "math_train":
            rows, notes = _hub_math_train(load_dataset)
            path.write_text(json.dumps(rows, ensure_ascii=False, indent=2), encoding="utf-8")
        else:  # in ALL_SETS but no hub recipe: a set registered in stapo.tasks.data without one here
            raise ValueError(f"{name}: no hub recipe in scripts/prepare_data.py; use --from-local")
        loaded = _load_any(name, path)
        entry = loaded.stats.as_dict()
        entry.pop("path", None)
        entry.pop("source", None)
        entry.update(file=str(_relpath(name)), sha256=_sha256(path), expected_rows=EXPECTED_ROWS[name], origin="hub", hub_notes=notes)
        manifest[name] = entry
    return manifest


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data", help="data root to write (default: data/)")
    parser.add_argument("--from-local", type=Path, default=None, metavar="DIR", help="copy from a folder laid out like ../shared/data")
    parser.add_argument("--only", nargs="+", choices=ALL_SETS, default=list(ALL_SETS), help="datasets to prepare (default: all)")
    parser.add_argument("--synthetic", type=int, default=0, metavar="N", help="also write N synthetic arithmetic problems")
    parser.add_argument("--synthetic-seed", type=int, default=0)
    parser.add_argument("--check-counts", action="store_true", help="exit 1 when a row count differs from the reference count")
    args = parser.parse_args(argv)

    out_root: Path = args.out
    try:
        if args.from_local is not None:
            if not args.from_local.is_dir():
                raise DataError(f"--from-local {args.from_local}: not a directory")
            manifest = copy_local(args.from_local, out_root, args.only)
        else:
            manifest = download_hub(out_root, args.only)
    except (DataError, ValueError) as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 2

    out_root.mkdir(parents=True, exist_ok=True)
    if args.synthetic:
        from stapo.tasks.synthetic import generate_arithmetic

        rel = Path("train") / "synthetic_arithmetic.jsonl"
        count = save_records_jsonl(generate_arithmetic(n=args.synthetic, seed=args.synthetic_seed), out_root / rel)
        manifest["synthetic_arithmetic"] = {"file": str(rel), "rows_read": count, "rows_loaded": count, "skipped": 0, "seed": args.synthetic_seed}

    (out_root / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    mismatched = []
    print(f"{'dataset':<22}{'rows read':>10}{'loaded':>9}{'skipped':>9}{'expected':>10}")
    for name, entry in manifest.items():
        expected = entry.get("expected_rows")
        flag = ""
        if expected is not None and entry["rows_read"] != expected:
            mismatched.append(name)
            flag = "  <- differs from the reference count"
        print(f"{name:<22}{entry['rows_read']:>10}{entry['rows_loaded']:>9}{entry['skipped']:>9}{expected if expected is not None else '-':>10}{flag}")
        if entry.get("skipped"):
            print(f"{'':<22}skipped: {entry['skipped_by_reason']}")
    print(f"wrote {out_root}/MANIFEST.json")
    if mismatched and args.check_counts:
        print(f"prepare_data: row counts differ from the reference for: {', '.join(mismatched)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

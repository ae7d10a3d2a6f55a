"""Paired differences of evaluate.py runs on the same problems, with their standard errors.

    python scripts/paired_eval_diff.py STAPO=runs/study/cpu_reproduction/runs/stapo_seed2/final_eval \\
        GRPO=runs/study/cpu_reproduction/runs/grpo_seed2/final_eval --out results/paired.md

The first run is the reference; every other run is compared with it per (decoding setting, benchmark) on the
problems both answered: diff = avg@N(reference) − avg@N(run), its paired standard error sd(d_i) / √P over the
per-problem accuracy differences d_i, the unpaired one √(SE_ref² + SE_run²) for comparison, and the difference
resolvable at 95 % (1.96 · paired SE; stapo.evaluation.metrics.paired_difference). Runs evaluated with the same
protocol answer the same problems (evaluate.py takes the first ``--limit`` problems of each benchmark), so the
paired error is the one that applies to their comparison.

Each argument is ``[LABEL=]DIR`` where DIR is an evaluate.py run directory (or a study run's ``final_eval``)
holding ``generations/<benchmark>__<setting>.jsonl`` (``.jsonl.gz`` is read too, but not both for one name); each
record needs ``benchmark``, ``setting``, ``problem_id`` and a boolean ``correct``. Labels must be distinct and free of
``|``, and every run must share a (benchmark, setting) with the reference. Prints a markdown table; ``--out`` also
writes it to a file. Bad input is a one-line error on stderr and exit code 2; a torn last line of a generations file
(an interrupted write) is skipped with a warning, and a warning names a (benchmark, setting) a run lacks (its row is
left out), runs compared on fewer problems than one of them answered, and problems with fewer samples than the rest.

Pairs that cannot be compared are refused in one line (exit 2) instead of printing a table: two runs evaluated with
different protocols on what they share (``eval_manifest.json``: new-token limit, prompt, a shared decoding setting's
temperature / top-p, a shared benchmark's N, grader, verifier, or another file for a shared benchmark;
stapo.evaluation.identity.protocol_differences), and two identical inputs — the same folder twice, two folders whose
manifests describe one evaluation (the same model content, data, protocol, seed and dtype), or generations whose
responses are the same sample for sample — whose difference is 0 by construction, not a tie. Folders without a
manifest (made by hand) are checked on what their records hold (each setting's temperature / top-p).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stapo.evaluation.identity import protocol_differences, same_inputs  # noqa: E402
from stapo.evaluation.metrics import SAMPLE_KEYS, paired_difference, per_problem_accuracy  # noqa: E402


class InputError(Exception):
    """A run directory or generations file that cannot be read; the message is one line."""


def read_generations(run_dir: Path) -> list[dict]:
    """All graded sample records of an evaluate.py run directory (``generations/*.jsonl`` and ``*.jsonl.gz``).

    A torn last line (no newline, not JSON: an interrupted write) is skipped with a warning on stderr, and so is
    said (a warning) when some problems of a file have fewer samples than the others (an incomplete evaluation).

    Raises:
        InputError: no such directory, no generations folder or file, a stem stored both plain and gzipped, an
            unreadable or corrupt file, an empty file, or a line that is not a UTF-8 JSON object with ``benchmark``,
            ``setting``, ``problem_id`` and a boolean ``correct``, a record of another benchmark or setting than its
            file's name ``<benchmark>__<setting>``, or a sample of a problem twice (file and line named).
    """
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such directory (an evaluate.py run directory is expected)")
    gen = run_dir / "generations"
    files = sorted(gen.glob("*.jsonl")) + sorted(gen.glob("*.jsonl.gz")) if gen.is_dir() else []
    if not files:
        raise InputError(f"{run_dir}: no generations/*.jsonl (an evaluate.py run directory is expected)")
    for f in files:
        if f.suffix == ".gz" and f.with_suffix("") in files:
            raise InputError(f"{f.with_suffix('')} and {f}: the same generations stored twice; keep one")
    records: list[dict] = []
    for f in files:
        n_before, lineno = len(records), 0
        opener = gzip.open if f.suffix == ".gz" else open
        # evaluate.py names a file <benchmark>__<setting>.jsonl: its records must say the same
        stem = f.name.removesuffix(".gz").removesuffix(".jsonl")
        named = tuple(stem.split("__", 1)) if "__" in stem else None
        seen: set[tuple[str, object]] = set()
        counts: dict[str, int] = {}
        try:
            with opener(f, "rb") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    rec = _parse(line, f"{f}:{lineno}")
                    if rec is None:
                        continue
                    if named and (rec["benchmark"], rec["setting"]) != named:
                        raise InputError(f"{f}:{lineno}: a record of {rec['setting']}/{rec['benchmark']} in the file "
                                         f"of {named[1]}/{named[0]}")
                    key = (str(rec["problem_id"]), rec.get("sample"))
                    if key[1] is not None and key in seen:
                        raise InputError(f"{f}:{lineno}: sample {key[1]} of {key[0]} a second time")
                    seen.add(key)
                    counts[key[0]] = counts.get(key[0], 0) + 1
                    records.append(rec)
        except (OSError, EOFError, zlib.error) as e:  # unreadable, not gzip, truncated or corrupt gzip
            raise InputError(f"{f}: cannot read{f' after line {lineno}' if lineno else ''} ({e})") from None
        if len(records) == n_before:
            raise InputError(f"{f}: no records")
        short = sum(c < max(counts.values()) for c in counts.values())
        if short:
            _warn(f"{f}: {short} problem(s) have fewer samples than the most ({max(counts.values())}): an "
                  f"incomplete evaluation; their accuracy is over the samples present")
    return records


def _warn(text: str) -> None:
    print(f"paired_eval_diff.py: warning: {text}", file=sys.stderr)


def _parse(line: bytes, where: str) -> dict | None:
    """One generations line as a checked record; None for a torn last line (a warning is printed)."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError or JSONDecodeError
        # a torn last line (an interrupted evaluation) is not a graded sample: skip it, as the store does
        if not line.endswith(b"\n"):
            _warn(f"{where}: torn last line skipped")
            return None
        why = "not UTF-8" if isinstance(e, UnicodeDecodeError) else f"not JSON ({e.msg})"
        raise InputError(f"{where}: {why}") from None
    if not isinstance(rec, dict):
        raise InputError(f"{where}: not a JSON object")
    missing = [k for k in SAMPLE_KEYS if k not in rec]
    if missing:
        raise InputError(f"{where}: lacks {', '.join(missing)}")
    if not isinstance(rec["correct"], bool):
        raise InputError(f"{where}: correct is {json.dumps(rec['correct'])}, not true or false")
    return rec


def read_manifest(run_dir: Path) -> dict | None:
    """``run_dir/eval_manifest.json`` (what evaluate.py made the generations with), or None when absent.

    Raises:
        InputError: the file exists but is not a JSON object.
    """
    path = run_dir / "eval_manifest.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a JSON object")
    return data


def _record_protocol(records: list[dict]) -> dict[str, tuple]:
    """``{setting: (temperature, top_p)}`` from the records that carry them (hand-made folders may not)."""
    out: dict[str, tuple] = {}
    for rec in records:
        if "temperature" in rec and "top_p" in rec:
            out.setdefault(str(rec["setting"]), (rec["temperature"], rec["top_p"]))
    return out


def _responses(records: list[dict]) -> dict[tuple, object] | None:
    """``{(benchmark, setting, problem_id, sample): response}``, or None when some record has no response."""
    out = {}
    for rec in records:
        if "response" not in rec:
            return None
        out[(rec["benchmark"], rec["setting"], str(rec["problem_id"]), rec.get("sample"))] = rec["response"]
    return out


def check_pair(ref: tuple[str, Path, dict | None, list[dict]], run: tuple[str, Path, dict | None, list[dict]]) -> None:
    """Refuse a pair of runs that cannot be compared (module docstring).

    Args:
        ref, run: ``(label, folder, manifest or None, records)``.

    Raises:
        InputError: one line naming the two labels and what makes them incomparable or identical.
    """
    (la, da, ma, ra), (lb, db, mb, rb) = ref, run
    if da.resolve() == db.resolve():
        raise InputError(f"{la} and {lb} are the same folder ({da.resolve()}): its difference with itself is 0 by "
                         f"construction, not a tie; give two evaluations")
    if ma is not None and mb is not None:
        diffs = protocol_differences(ma, mb)
        if diffs:
            raise InputError(f"{la} and {lb} were evaluated with different protocols ({'; '.join(diffs)}): their "
                             f"paired difference would mix the protocol into the models' difference; evaluate both "
                             f"with the same settings")
        if same_inputs(ma, mb):
            raise InputError(f"{la} and {lb} hold one evaluation twice (the same model content, data, protocol, seed "
                             f"and dtype in their eval_manifest.json): their difference is 0 by construction, not a "
                             f"tie; give two evaluations")
    pa, pb = _record_protocol(ra), _record_protocol(rb)
    for setting in sorted(set(pa) & set(pb)):
        if pa[setting] != pb[setting]:
            raise InputError(f"{la} and {lb} were sampled with different decoding settings under the name {setting} "
                             f"(temperature, top-p {pa[setting]} vs {pb[setting]}); compare runs of the same setting")
    xa, xb = _responses(ra), _responses(rb)
    if xa is not None and xb is not None:
        shared = set(xa) & set(xb)
        if shared and all(xa[k] == xb[k] for k in shared):
            raise InputError(f"{la} and {lb} hold the same responses for all {len(shared)} samples they share: one "
                             f"evaluation twice (a copied folder?), whose difference is 0 by construction, not a tie")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="[LABEL=]DIR: the reference first, then the runs compared with it")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        print("paired_eval_diff.py: error: give a reference run and at least one run to compare", file=sys.stderr)
        return 2

    try:
        runs: list[tuple[str, dict]] = []
        inputs: list[tuple[str, Path, dict | None, list[dict]]] = []
        for item in args.runs:
            label, sep, path = item.partition("=")
            if not sep or not label or Path(item).exists():
                label, path = Path(item).resolve().name, item
                if label == "final_eval":  # a study run's final_eval: name it after its run
                    label = Path(item).resolve().parent.name
            elif not path:
                raise InputError(f"{item}: empty path")
            if "|" in label:
                raise InputError(f"label {label!r}: '|' would break the markdown table")
            if label in [seen for seen, _ in runs]:
                raise InputError(f"label {label!r} given twice")
            records = read_generations(Path(path))
            inputs.append((label, Path(path), read_manifest(Path(path)), records))
            runs.append((label, per_problem_accuracy(records)))
        for other in inputs[1:]:
            check_pair(inputs[0], other)
        (ref_label, ref), others = runs[0], runs[1:]
        for label, acc in others:
            if not set(acc) & set(ref):
                raise InputError(f"{label}: shares no (benchmark, setting) with the reference {ref_label}")
        rows = ["| setting | benchmark | run | problems | diff (" + ref_label + " − run) | paired SE | unpaired SE | "
                "resolvable (95 %, paired) |", "|---|---|---|---|---|---|---|---|"]
        for bench, setting in sorted(ref, key=lambda k: (k[1], k[0])):
            for label, acc in others:
                if (bench, setting) not in acc:
                    _warn(f"{label} has no {setting}/{bench}: its row is left out")
                    continue
                try:
                    r = paired_difference(ref[(bench, setting)], acc[(bench, setting)])
                except ValueError as e:
                    raise InputError(f"{setting}/{bench}, {ref_label} vs {label}: {e}") from None
                sizes = (len(ref[(bench, setting)]), len(acc[(bench, setting)]))
                if int(r["problems"]) < max(sizes):
                    _warn(f"{setting}/{bench}: {ref_label} has {sizes[0]} problems, {label} {sizes[1]}; compared on "
                          f"the {int(r['problems'])} both answered")
                rows.append(f"| {setting} | {bench} | {label} | {int(r['problems'])} | {r['diff']:+.4f} | "
                            f"{r['se_paired']:.4f} | {r['se_unpaired']:.4f} | {r['resolvable']:.4f} |")
        table = "\n".join(rows) + "\n"
        if args.out:  # written before the table is printed, so that a bad --out fails alone
            try:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(table, encoding="utf-8")
            except OSError as e:
                raise InputError(f"--out {args.out}: {e}") from None
    except (InputError, OSError) as e:
        print(f"paired_eval_diff.py: error: {e}", file=sys.stderr)
        return 2
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Exact behaviour check for refactors of the training loop: the tiny model on one thread, several update paths.

    python scripts/check_refactor_exact.py OUT.json            # in the checkout under test
    python scripts/check_refactor_exact.py --compare A.json B.json

Each case trains 3 steps of ``configs/tiny_test.yaml`` with the toy parity reward of ``tests/toy_run.py`` (varied
rewards, so the masks and the update are exercised) on ONE thread (no thread-count-dependent summation order) and
records every metric of every step (wall-clock keys excepted) and the SHA-256 of the final weights. Two checkouts
agree exactly or not at all: ``--compare`` prints every differing value and exits 1 if any differs.

Cases: STAPO plain / fused / mask statistics from the old policy, 20-Entropy fused, GRPO (k3 KL to a reference
model), JustRL without length sorting, and the three S2T ablations.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "stapo_plain": ["algorithm.objective=stapo", "actor.fused_forward=false"],
    "stapo_fused": ["algorithm.objective=stapo", "actor.fused_forward=true"],
    "stapo_old_stats": ["algorithm.objective=stapo", "algorithm.mask_stats_source=old"],
    "entropy20_fused": ["algorithm.objective=entropy20", "actor.fused_forward=true"],
    "grpo_kl": ["algorithm.objective=grpo"],
    "justrl_unsorted": ["algorithm.objective=justrl", "actor.sort_by_length=false"],
    "stapo_high_entropy": ["algorithm.objective=stapo_high_entropy"],
    "stapo_random": ["algorithm.objective=stapo_random", "actor.fused_forward=true"],
    "justrl_fullmask": ["algorithm.objective=justrl_fullmask"],
}
WALL_CLOCK = ("timing_s/", "perf/", "reward/grader/seconds")


def run_cases(out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "tests"))
    from toy_run import make_trainer

    results = {}
    for name, overrides in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            trainer = make_trainer(tmp, ["trainer.total_steps=3", "trainer.save_every=0", *overrides])
            history = trainer.train()
            digest = hashlib.sha256()
            for k, v in sorted(trainer.model.state_dict().items()):
                digest.update(k.encode())
                digest.update(v.detach().float().cpu().numpy().tobytes())
            trainer.close()
        results[name] = {"metrics": [{k: v for k, v in m.items() if not k.startswith(WALL_CLOCK)} for m in history],
                         "weights_sha256": digest.hexdigest()}
        print(f"{name}: {len(history)} steps, weights {results[name]['weights_sha256'][:12]}", flush=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True))


def _same(x, y) -> bool:
    """Equal values, NaN equal to NaN (an empty quadrant's mean is NaN in both runs)."""
    return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)


def compare(a_path: Path, b_path: Path) -> int:
    """Print every differing value; keys of a checkout before the one metric vocabulary are read under their current
    names (:func:`stapo.core.metric_names.rename_legacy`), so a rename alone is not a difference."""
    sys.path.insert(0, str(REPO))
    from stapo.core.metric_names import rename_legacy

    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'B' if name not in a else 'A'}")
            bad += 1
            continue
        ra, rb = a[name], b[name]
        for step, (ma, mb) in enumerate(zip(ra["metrics"], rb["metrics"]), start=1):
            ma, mb = rename_legacy(ma), rename_legacy(mb)
            for k in sorted(set(ma) | set(mb)):
                if not _same(ma.get(k, "<absent>"), mb.get(k, "<absent>")):
                    print(f"{name} step {step} {k}: {ma.get(k, '<absent>')} vs {mb.get(k, '<absent>')}")
                    bad += 1
        same_w = ra["weights_sha256"] == rb["weights_sha256"]
        bad += not same_w
        n = sum(len(m) for m in ra["metrics"])
        print(f"{name}: {len(ra['metrics'])} steps, {n} values, weights {'identical' if same_w else 'DIFFER'}")
    print("all identical" if bad == 0 else f"{bad} differences")
    return int(bad > 0)


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    run_cases(Path(sys.argv[1]))

#!/usr/bin/env python
"""Probe: resident memory of our trainer through one warm-up step and one step of the CPU benchmark workload.

    .venv/bin/python scripts/probe_memory.py [KEY=VALUE ...]        # e.g. actor.deferred_graphs=recompute

A thread samples VmRSS every 0.1 s, labelled by the phase the trainer is in (init, generate<k>, scored, update);
the script prints the peak per phase (GiB), the last sample, and the update / step times. The workload is
scripts/bench_train_step.py's (8 prompts × G = 8, ≤ 128 new tokens, micro-batches of 16). Not a test and not a
benchmark table: it shows where the memory goes (results/README.md#speed-vs-trl).
"""
import collections
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_train_step (the workload)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_gib() -> float:
    """This process's resident memory now (VmRSS) in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20  # kB → GiB
    return float("nan")


def main() -> None:
    import bench_train_step as bench
    from stapo.train import Trainer

    samples: list[tuple[str, float]] = []  # (phase, RSS GiB) every 0.1 s
    phase = ["init"]

    def sampler() -> None:
        while True:
            samples.append((phase[0], _rss_gib()))
            time.sleep(0.1)

    threading.Thread(target=sampler, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench._load_cfg([f"trainer.output_dir={tmp}", "trainer.run_name=bench", "logging.wandb_mode=disabled",
                               "trainer.progress_bar=false", "trainer.save_every=0", "trainer.log_examples_every=0",
                               "trainer.total_steps=2", *sys.argv[1:]])
        trainer = Trainer(cfg)
        trainer.save = lambda: None  # no checkpoint writes
        phase[0] = "ready"

        def entering(name_of, fn):  # the wrapped call marks the phase it starts
            def wrapper(*a, **kw):
                phase[0] = name_of()
                return fn(*a, **kw)
            return wrapper

        generations = iter(range(10**6))
        trainer.engine.generate = entering(lambda: f"generate{next(generations)}", trainer.engine.generate)
        trainer._score = entering(lambda: "scored", trainer._score)
        trainer.updater.forward = entering(lambda: "update", trainer.updater.forward)
        history = trainer.train()
    peak: dict[str, float] = collections.defaultdict(float)
    for name, rss in samples:
        peak[name] = max(peak[name], rss)
    print(json.dumps(peak, indent=1))
    print("final", samples[-1])
    print("update_s", [round(m["timing_s/update"], 1) for m in history],
          "step_s", [round(m["timing_s/step"], 1) for m in history])


if __name__ == "__main__":
    main()

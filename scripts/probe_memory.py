#!/usr/bin/env python
"""Probe: resident memory of our trainer through one warm-up step and one step of the CPU benchmark workload.

    .venv/bin/python scripts/probe_memory.py [KEY=VALUE ...]        # e.g. actor.deferred_graphs=recompute

A thread samples VmRSS every 0.1 s, labelled by the phase the trainer is in (init, generate<k>, scored, update);
the script prints the peak per phase (GiB), the last sample, and the update / step times. The workload is
scripts/bench_train_step.py's (8 prompts × G = 8, ≤ 128 new tokens, micro-batches of 16). Not a test and not a
benchmark table: it shows where the memory goes (results/README.md#speed-vs-trl).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import threading, time, json
import bench_train_step as b
from pathlib import Path
def main():
    global samples
    samples = []; phase = ["init"]
    def rss():
        for l in Path("/proc/self/status").read_text().splitlines():
            if l.startswith("VmRSS:"): return int(l.split()[1]) / 2**20
    def sampler():
        while True:
            samples.append((time.time(), phase[0], rss())); time.sleep(0.1)
    threading.Thread(target=sampler, daemon=True).start()
    from stapo.train import Trainer
    import tempfile
    extra = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = b._load_cfg([f"trainer.output_dir={tmp}", "trainer.run_name=bench", "logging.wandb_mode=disabled",
                           "trainer.progress_bar=false", "trainer.save_every=0", "trainer.log_examples_every=0",
                           "trainer.total_steps=2", *extra])
        tr = Trainer(cfg); tr.save = lambda: None
        phase[0] = "ready"

        sc = tr._score
        g = tr.engine.generate
        def gen2(*a, **k):
            phase[0] = 'generate%d' % len(seen); seen.append(1); return g(*a, **k)
        seen = []
        tr.engine.generate = gen2
        sy = getattr(tr, '_sync_weights', None)
        def score(p, r):
            phase[0] = "scored"; return sc(p, r)
        tr._score = score
        up = tr.updater; f = up.forward
        def fwd(*a, **k):
            phase[0] = "update"; return f(*a, **k)
        up.forward = fwd
        h = tr.train()
    import collections
    peak = collections.defaultdict(float)
    for t, p, r in samples: peak[p] = max(peak[p], r)
    print(json.dumps(peak, indent=1))
    print("final", samples[-1]); print("update_s", [round(m["timing_s/update"],1) for m in h], "step_s", [round(m["timing_s/step"],1) for m in h])
if __name__ == '__main__':
    main()

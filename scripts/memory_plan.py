"""GPU memory per phase of the paper configs (Qwen3-1.7B / 8B / 14B) on 1 and 8 GPUs of 80 GB (H100) and 141 GB (H200).

    python scripts/memory_plan.py --out results/memory_plan.md

Arithmetic, not a measurement: the phases and every term with its formula are stapo/run/memory_plan.py's (the same
plan ``train.py`` checks at start-up and ``train.py --dry-run`` prints); the settings are read from
configs/paper/qwen3_<size>_<method>.yaml (STAPO for β = 0 — JustRL and 20-Entropy are the same there — and GRPO,
whose reference model adds a term and a phase); the shapes are the models' public config.json
(stapo.run.memory_plan.PAPER_SHAPES). No hub access, no GPU needed. Rerunning the command reproduces the committed file
byte for byte (tests/test_memory_plan.py checks it).
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stapo.config import load_config  # noqa: E402
from stapo.run.memory_plan import GPUS, PAPER_SHAPES, TARGET_FRACTION, MemoryPlan, plan_memory  # noqa: E402

SIZES = ("1.7b", "8b", "14b")
METHODS = (("stapo", "β = 0"), ("grpo", "GRPO"))
WORLDS = (1, 8)
PHASES = ("rollout", "old pass", "reference pass", "update", "sync", "validation")


@functools.lru_cache(maxsize=None)
def paper_config(size: str, method: str):
    return load_config(REPO / "configs" / "paper" / f"qwen3_{size}_{method}.yaml")


def plan(size: str, method: str, world: int, gpu: str) -> MemoryPlan:
    cfg = paper_config(size, method)
    return plan_memory(cfg, PAPER_SHAPES[cfg.model.path], world, GPUS[gpu], device=f"{gpu}, {GPUS[gpu]} GiB")


def cell(p: MemoryPlan, name: str) -> str:
    """``total (engine)`` GiB of a phase, ✗ over the device; ``–`` when the step has no such phase."""
    try:
        ph = p.phase(name)
    except KeyError:
        return "–"
    return f"{ph.gib:.1f} ({ph.engine_gib:.1f})" + (" ✗" if ph.gib > p.device_gib else "")


def settings_line(size: str) -> str:
    cfg = paper_config(size, "stapo")
    ac, rc = cfg.actor, cfg.rollout
    micro = (f"token budget `actor.ppo_max_token_len_per_gpu` {ac.ppo_max_token_len_per_gpu:,}"
             if getattr(ac, "use_dynamic_bsz", False) else f"`actor.ppo_micro_batch_size` {ac.ppo_micro_batch_size}")
    return (f"| {PAPER_SHAPES[cfg.model.path].name} | {rc.gpu_memory_utilization:g} | {micro} | "
            f"{getattr(ac, 'lm_head', 'logits')} | {getattr(ac, 'use_remove_padding', False)} | "
            f"{cfg.model.attn_implementation} | {rc.sleep_during_update} (level {getattr(rc, 'sleep_level', 2)}) |")


def main() -> str:
    lines = ["# GPU memory per phase of the paper configs", "",
             "`python scripts/memory_plan.py --out results/memory_plan.md` (arithmetic, not measured: "
             "[stapo/run/memory_plan.py](../stapo/run/memory_plan.py) has every term and its formula; `train.py` refuses at "
             "start-up a config whose largest phase exceeds the GPU, and `train.py --dry-run` prints this plan for the "
             "run's own config, ranks and GPU). GiB per GPU; H100 = 80 GB, 79.2 GiB visible; H200 = 141 GB, "
             "139.8 GiB visible. Each cell: the phase's total (the vLLM engine's share of it); ✗: over the GPU's "
             "memory; – : no such phase (the reference pass is GRPO's).", "",
             "Settings read from `configs/paper/qwen3_<size>_<method>.yaml`, fitted so that every phase stays "
             f"≤ {100 * TARGET_FRACTION:.0f} % of an 80-GB GPU on 8 GPUs (FSDP2); the engine sleeps whenever the "
             "trainer computes and wakes in stages (weights → sync → KV cache):", "",
             "| model | `rollout.gpu_memory_utilization` | micro-batches | `actor.lm_head` | "
             "`actor.use_remove_padding` | attention | engine asleep (`rollout.sleep_during_update`) |",
             "|---|---|---|---|---|---|---|"]
    lines += [settings_line(size) for size in SIZES]
    lines += ["", "## Per phase", "",
              "| model | method | GPUs | GPU | " + " | ".join(PHASES) + " | peak |",
              "|---|---|---|---|" + "---|" * len(PHASES) + "---|"]
    for size in SIZES:
        for method, label in METHODS:
            for world in WORLDS:
                for gpu in GPUS:
                    p = plan(size, method, world, gpu)
                    pk = p.peak
                    lines.append(f"| {p.shape.name} | {label} | {world} | {gpu} | "
                                 + " | ".join(cell(p, n) for n in PHASES)
                                 + f" | {pk.name} {100 * pk.gib / p.device_gib:.0f} %"
                                 + (" ✗" if pk.gib > p.device_gib else "") + " |")
    lines += ["", f"## The fit: 8 × H100, every phase ≤ {100 * TARGET_FRACTION:.0f} %", "",
              "The rollout phase (engine share + the resident training state + context) sets how high "
              "`rollout.gpu_memory_utilization` can go; more KV cache is faster rollouts. The trainer's phases set "
              "the micro-batch token budget.", "",
              "| model | method | util | largest util ≤ 90 % | KV cache tokens per GPU | rollout | old pass | "
              "update | sync | peak |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for size in SIZES:
        for method, label in METHODS:
            p = plan(size, method, 8, "H100")
            u = p.settings["rollout.gpu_memory_utilization"]
            ro = p.phase("rollout")
            rest = ro.gib - ro.engine_gib
            u_max = int(100 * (TARGET_FRACTION * p.device_gib - rest) / p.device_gib) / 100
            pct = {n: f"{100 * p.phase(n).gib / p.device_gib:.0f} %" for n in ("rollout", "old pass", "update",
                                                                                "sync")}
            lines.append(f"| {p.shape.name} | {label} | {u:g} | {u_max:.2f} | {p.kv_tokens / 1e3:,.0f}k | "
                         f"{pct['rollout']} | {pct['old pass']} | {pct['update']} | {pct['sync']} | "
                         f"{p.peak.name} {100 * p.peak.gib / p.device_gib:.0f} % |")
    lines += ["", "Qwen3-1.7B takes 0.8 rather than the largest 0.84: the KV cache is 5 % smaller, and a single "
              "H200 still holds the GRPO config (its rollout phase at 96 % of the device; 0.84 would exceed it).", "",
              "## One GPU", "",
              "A config's engine share is sized for 8 GPUs; on one GPU the whole training state (16 B per parameter "
              "with the gradients) stays on the device, so the largest share is lower. `train.py` refuses a phase "
              "over the device and names the largest `rollout.gpu_memory_utilization` that keeps the rollout within "
              f"{100 * TARGET_FRACTION:.0f} %: set it on the command line "
              "(e.g. `rollout.gpu_memory_utilization=0.6`).", "",
              "| model | method | GPU | training state (update, GiB) | largest util ≤ 90 % | phases over the GPU "
              "at the config's util |",
              "|---|---|---|---|---|---|"]
    for size in SIZES:
        for method, label in METHODS:
            for gpu in GPUS:
                p = plan(size, method, 1, gpu)
                up = p.phase("update")
                state = sum(t.gib for t in up.terms if t.name == "AdamW moments"
                            or t.name.startswith(("parameters", "gradients", "GRPO reference")))
                ro = p.phase("rollout")
                u_max = int(100 * (TARGET_FRACTION * p.device_gib - (ro.gib - ro.engine_gib)) / p.device_gib) / 100
                trainer = max((ph for ph in p.phases if ph.engine_gib < ro.engine_gib), key=lambda ph: ph.gib)
                fits = (f"{u_max:.2f}" if u_max > 0 and trainer.gib <= TARGET_FRACTION * p.device_gib else
                        f"none ({trainer.name} {trainer.gib:.0f} GiB)")
                over = ", ".join(ph.name for ph in p.over()) or "none"
                lines.append(f"| {p.shape.name} | {label} | {gpu} | {state:.1f} | {fits} | {over} |")
    lines += ["",
              "## Every term (8 × H100, GRPO)", ""]
    for size in SIZES:
        p = plan(size, "grpo", 8, "H100")
        lines += [f"{p.shape.name} ({p.shape.params / 1e9:.2f} B parameters):", ""]
        for ph in p.phases:
            if ph.name == "validation":
                lines.append("- validation: as rollout (the same engine, awake)")
                continue
            lines.append(f"- {ph.name} ({ph.gib:.1f} GiB; {ph.note}): " + "; ".join(
                f"{t.name} {t.gib:.2f} = {t.formula}" for t in ph.terms))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown here too (results/memory_plan.md)")
    a = ap.parse_args()
    text = main()
    print(text, end="")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)

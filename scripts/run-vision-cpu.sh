#!/usr/bin/env bash
# The vision demo: a tiny vision-language model (Qwen3-VL's architecture; ARCH=qwen3_5_vl for
# Qwen3.5's) learns to count the dots in small generated images with GRPO, on a CPU-only machine.
#
#   bash scripts/run-vision-cpu.sh [OUT_DIR [TRAIN FLAGS...]]   (default: runs/vision-cpu)
#
# Flags after OUT_DIR go to train_async.py after the ones below, so they override them.
#
# 1. builds a tiny model of $ARCH (a 2-block vision tower, frozen; a 4-layer language model) and
#    the task (64 x 64 images with 1 to 4 dots; prompt "<image>How many dots?", label "3"; a
#    held-out set of other images),
# 2. warm-starts it with a short SFT phase (the answer's format, a little counting),
# 3. runs GRPO with train_async.py: the torch engine generates from the images, the FSDP trainer
#    learns, the weights are pushed after every step; held-out accuracy is evaluated (greedy)
#    before the first rollout and every EVAL_INTERVAL rollouts,
# 4. prints the first and the last held-out accuracy and writes OUT_DIR/logs/reward_accuracy.png.
#
# Every setting below can be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-runs/vision-cpu}
shift || true
NUM_ROLLOUT=${NUM_ROLLOUT:-60}
EVAL_INTERVAL=${EVAL_INTERVAL:-10}
SFT_EPOCHS=${SFT_EPOCHS:-4}
SEED=${SEED:-1234}
ARCH=${ARCH:-qwen3_vl}
PYTHON=${PYTHON:-python}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export SLIME_LOG_DIR="$OUT/logs"
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)

"$PYTHON" -m slime.tools.make_tiny_model --arch "$ARCH" --out "$OUT/base" --hidden-size 128 --num-layers 4 \
    --num-heads 4 --num-kv-heads 2 --seed "$SEED"
"$PYTHON" -m slime.tools.make_vision_task --out "$OUT/task" --train-size 2000 --eval-size 200 --sft-size 200 --seed 0

OMP_NUM_THREADS=2 "$PYTHON" -m slime.tools.sft --hf-checkpoint "$OUT/base" --data "$OUT/task/sft.jsonl" \
    --multimodal-keys '{"image": "images"}' --apply-chat-template \
    --save-hf "$OUT/sft" --num-epoch "$SFT_EPOCHS" --lr 2e-3 --global-batch-size 20 --micro-batch-size 20 \
    --seed "$SEED"

# One-step-off GRPO (train_async.py), as the text demo: the engine generates rollout k+1 while
# the trainer learns from rollout k. The answer is one digit and the end of the turn.
"$PYTHON" train_async.py \
    --hf-checkpoint "$OUT/sft" --device cpu \
    --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \
    --prompt-data "$OUT/task/train.jsonl" --input-key prompt --label-key label --rollout-shuffle \
    --multimodal-keys '{"image": "images"}' --apply-chat-template \
    --rm-type exact \
    --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 16 --n-samples-per-prompt 8 \
    --rollout-max-response-len 2 --rollout-temperature 1.0 \
    --advantage-estimator grpo --global-batch-size 64 --micro-batch-size 64 \
    --lr 3e-4 --lr-warmup-iters 5 --lr-decay-style cosine --lr-decay-iters $((NUM_ROLLOUT * 2)) --min-lr 3e-5 \
    --eval-interval "$EVAL_INTERVAL" --eval-prompt-data "$OUT/task/eval.jsonl" --eval-temperature 0 \
    --save-hf "$OUT/final" --seed "$SEED" \
    --update-weight-transport tensor "$@"

"$PYTHON" -m slime.tools.plot_metrics "$SLIME_LOG_DIR/metrics.jsonl" --since "$start" --title "${TITLE:-tiny $ARCH, count the dots, GRPO on CPU}"

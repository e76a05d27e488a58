#!/usr/bin/env bash
# The agent example: a tiny model learns to use a python tool through the OpenAI adapter, on a
# CPU-only machine (docs/agents.md).
#
#   bash scripts/run-agent-cpu.sh [OUT_DIR [TRAIN FLAGS...]]   (default: runs/agent-cpu)
#
# 1. builds a tiny Qwen3 model and the task (questions "compute 37*4", labels "148"; a held-out
#    set), and warm-starts the model on correct runs (the tool-call format),
# 2. runs GRPO with train_async.py: every sample is a run of slime_plugins/examples/agent_tool/agent.py,
#    an ordinary OpenAI client program, against the adapter; its python tool runs in a
#    LocalSandbox; the trainer learns from exactly the tokens the engine produced,
# 3. prints the first and the last held-out success rate and writes OUT_DIR/logs/reward_accuracy.png.
#
# Every setting below can be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-runs/agent-cpu}
shift || true
NUM_ROLLOUT=${NUM_ROLLOUT:-60}
EVAL_INTERVAL=${EVAL_INTERVAL:-10}
SFT_EPOCHS=${SFT_EPOCHS:-21}
NUM_SFT=${NUM_SFT:-200}
SEED=${SEED:-1234}
PYTHON=${PYTHON:-python}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export SLIME_LOG_DIR="$OUT/logs"
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)

"$PYTHON" -m slime.tools.make_tiny_model --out "$OUT/base" --hidden-size 128 --num-layers 4 \
    --num-heads 4 --num-kv-heads 2 --seed "$SEED"
"$PYTHON" -m slime_plugins.examples.agent_tool.task --out "$OUT/task" --hf-checkpoint "$OUT/base" \
    --num-sft "$NUM_SFT" --seed 0

OMP_NUM_THREADS=2 "$PYTHON" -m slime.tools.sft --hf-checkpoint "$OUT/base" --data "$OUT/task/sft.jsonl" \
    --save-hf "$OUT/sft" --num-epoch "$SFT_EPOCHS" --lr 2e-3 --global-batch-size 20 --micro-batch-size 20 \
    --seed "$SEED"

"$PYTHON" train_async.py \
    --hf-checkpoint "$OUT/sft" --device cpu \
    --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \
    --prompt-data "$OUT/task/train.jsonl" --input-key prompt --label-key label --rollout-shuffle \
    --custom-generate-function-path slime_plugins.examples.agent_tool.rollout.generate \
    --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 8 --n-samples-per-prompt 8 \
    --rollout-max-response-len 96 --rollout-temperature 1.0 \
    --advantage-estimator grpo --global-batch-size 64 --micro-batch-size 16 \
    --lr 5e-4 --lr-warmup-iters 5 --lr-decay-style cosine --lr-decay-iters "$NUM_ROLLOUT" --min-lr 5e-5 \
    --eval-interval "$EVAL_INTERVAL" --eval-prompt-data "$OUT/task/eval.jsonl" --eval-temperature 0 \
    --save-hf "$OUT/final" --seed "$SEED" --update-weight-transport tensor "$@"

"$PYTHON" -m slime.tools.plot_metrics "$SLIME_LOG_DIR/metrics.jsonl" --title "${TITLE:-tiny model, agent with a python tool, GRPO on CPU}"
"$PYTHON" - "$SLIME_LOG_DIR/metrics.jsonl" "$start" <<'PY'
import json, sys, time
records = list(map(json.loads, open(sys.argv[1])))
evals = [r for r in records if "eval/accuracy" in r]
first, last = evals[0], evals[-1]
print(f"held-out success: {first['eval/accuracy']:.3f} at step {first['step']} (before RL) -> "
      f"{last['eval/accuracy']:.3f} at step {last['step']} "
      f"({100 * (last['eval/accuracy'] - first['eval/accuracy']):+.1f} points); "
      f"whole run {time.time() - float(sys.argv[2]):.0f} s")
PY

#!/usr/bin/env bash
# The agent example: a tiny model learns to use a python tool through the OpenAI adapter, on a
# CPU-only machine (docs/agents.md).
#
#   bash scripts/run-agent-cpu.sh [OUT_DIR [TRAIN FLAGS...]]   (default: runs/agent-cpu)
#
# 1. builds a tiny Qwen3 model and the task (questions "compute 37*4", labels "148"; a held-out
#    set), and warm-starts the model on runs that call the tool and on answers given from memory,
#    about half each (the SFT loss per token, so that the first token's choice is an even split),
# 2. runs GRPO with train_async.py: every sample is a run of slime_plugins/examples/agent_tool/agent.py,
#    an ordinary OpenAI client program, against the adapter; its python tool runs in a
#    LocalSandbox; the trainer learns from exactly the tokens the engine produced. Answers from
#    memory are mostly wrong on problems the model has not seen, so the policy learns to call
#    the tool. Held-out success is sampled at the rollout temperature (2 runs per problem).
# 3. prints the first and the last held-out success rate, how many samples forked or realigned,
#    and writes OUT_DIR/logs/reward_accuracy.png.
#
# Every setting below can be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-runs/agent-cpu}
shift || true
NUM_ROLLOUT=${NUM_ROLLOUT:-40}
EVAL_INTERVAL=${EVAL_INTERVAL:-10}
SFT_EPOCHS=${SFT_EPOCHS:-20}
NUM_SFT=${NUM_SFT:-300}
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
    --save-hf "$OUT/sft" --num-epoch "$SFT_EPOCHS" --lr 2e-3 --global-batch-size 30 --micro-batch-size 30 \
    --calculate-per-token-loss --seed "$SEED"

"$PYTHON" train_async.py \
    --hf-checkpoint "$OUT/sft" --device cpu \
    --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \
    --prompt-data "$OUT/task/train.jsonl" --input-key prompt --label-key label --rollout-shuffle \
    --custom-generate-function-path slime_plugins.examples.agent_tool.rollout.generate \
    --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 8 --n-samples-per-prompt 8 \
    --rollout-max-response-len 96 --rollout-temperature 1.0 \
    --advantage-estimator grpo --global-batch-size 64 --micro-batch-size 16 \
    --lr 2e-4 --lr-warmup-iters 3 --lr-decay-style cosine --lr-decay-iters "$NUM_ROLLOUT" --min-lr 2e-5 \
    --eval-interval "$EVAL_INTERVAL" --eval-prompt-data "$OUT/task/eval.jsonl" --eval-temperature 1.0 \
    --n-samples-per-eval-prompt 2 --save-debug-rollout-data "$OUT/dumps/rollout_{rollout_id}.pt" \
    --save-hf "$OUT/final" --seed "$SEED" --update-weight-transport tensor "$@"

"$PYTHON" -m slime.tools.plot_metrics "$SLIME_LOG_DIR/metrics.jsonl" --title "${TITLE:-tiny model, agent with a python tool, GRPO on CPU}"
"$PYTHON" - "$SLIME_LOG_DIR/metrics.jsonl" "$start" "$OUT/dumps" <<'PY'
import glob, json, sys, time
import torch
samples = [s for f in glob.glob(sys.argv[3] + "/rollout_*.pt") for s in torch.load(f, weights_only=True)["samples"]]
agent = [s["metadata"] for s in samples if "rendered_in_full" in s["metadata"]]
drift = sum(1 for m in agent if m["forked_turns"] or m["realigned_turns"] or m["rendered_in_full"])
print(f"agent samples: {len(agent)}; forked, realigned or rendered in full: {drift}; "
      f"tool used: {sum(m['use_tool'] for m in agent) / max(1, len(agent)):.2f}")
records = list(map(json.loads, open(sys.argv[1])))
evals = [r for r in records if "eval/accuracy" in r]
first, last = evals[0], evals[-1]
print(f"held-out success: {first['eval/accuracy']:.3f} at step {first['step']} (before RL) -> "
      f"{last['eval/accuracy']:.3f} at step {last['step']} "
      f"({100 * (last['eval/accuracy'] - first['eval/accuracy']):+.1f} points); "
      f"whole run {time.time() - float(sys.argv[2]):.0f} s")
PY

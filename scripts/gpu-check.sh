#!/usr/bin/env bash
# One command for a GPU machine without network (torch with CUDA and the project's dependencies
# installed; source .gpu/setup.sh first where Ray/transformers/megatron-core come from there):
#
#   bash scripts/gpu-check.sh [PART...]    parts: gpu-tests grpo-fsdp grpo-megatron bench-engine bench-step
#                                          (default: all)
#
#   gpu-tests      pytest -m gpu on every tests/test_*gpu*.py (the output is also shown)
#   grpo-fsdp      train.py: 2 GRPO rollouts, colocated, FSDP + torch engine, CUDA-IPC push,
#                  --offload --check-precision --check-weight-sync, on a tiny model built here
#   grpo-megatron  the same with --train-backend megatron --transformer-impl local
#   bench-engine   benchmarks/bench_engine.py --device cuda
#   bench-step     benchmarks/bench_grpo_step.py --device cuda --preset qwen3-0.6b --profile: a whole
#                  GRPO step, 512 samples x up to 512 tokens, colocated on the one GPU, against its
#                  limits; one more rollout profiled (operator tables in the log, traces in
#                  $GPU_CHECK_OUT/bench-step/profile)
#
# Prints PASS / FAIL / SKIP per part with its figure, then a summary; exits 1 if a part failed,
# else 0. A part whose dependency is missing is SKIP with the reason, never PASS; without a CUDA
# GPU every part is SKIP (exit 0). Environment: PYTHON (python3); GPU_CHECK_OUT, the folder for
# the logs (default: a new mktemp folder); each part's limit in seconds, GPU_CHECK_TIMEOUT_TESTS
# (480), GPU_CHECK_TIMEOUT_JOB (60, each job), GPU_CHECK_TIMEOUT_BENCH (360), GPU_CHECK_TIMEOUT_STEP
# (540) (a part still running
# at its limit gets SIGINT, which lets pytest print its summary and train.py shut Ray down, then
# SIGKILL 10 s later). On an H100 the model-family and Megatron GPU tests alone took 345 s, so
# the parts no longer fit one 10-minute command: run `gpu-tests` in one, `bench-step` in another,
# the rest in a third.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PY=${PYTHON:-python3}
ALL=(gpu-tests grpo-fsdp grpo-megatron bench-engine bench-step)
PARTS=("$@")
[ $# -gt 0 ] || PARTS=("${ALL[@]}")
for p in "${PARTS[@]}"; do
    [[ " ${ALL[*]} " == *" $p "* ]] || { echo "unknown part '$p'; parts: ${ALL[*]}" >&2; exit 2; }
done
T_TESTS=${GPU_CHECK_TIMEOUT_TESTS:-480} T_JOB=${GPU_CHECK_TIMEOUT_JOB:-60} T_BENCH=${GPU_CHECK_TIMEOUT_BENCH:-360}
T_STEP=${GPU_CHECK_TIMEOUT_STEP:-540}
# Hidden: GPU_CHECK_DEVICE=cpu exists only to rehearse the command lines on a machine without a
# GPU (the jobs and the benchmark get --device cpu, the CUDA check is not made). Every flag below
# is accepted on CPU too, so the rehearsal runs the GPU command lines with only the device changed.
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled

OUT=${GPU_CHECK_OUT:-$(mktemp -d -t gpu-check.XXXXXX)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
echo "gpu-check: logs in $OUT"

have() { "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$1') is None)" 2>/dev/null; }
NOTES=()
have transformer_engine || NOTES+=("Transformer Engine not installed: Megatron runs here use --transformer-impl local only")
have sglang || SGLANG_MISSING="SGLang not installed"
have sglang_router || SGLANG_MISSING=${SGLANG_MISSING:-sglang-router not installed}
have ray || NO_RAY="Ray not installed"
have megatron.core || NO_MCORE="megatron-core not installed"
NO_GPU=""
if [ "$DEVICE" = cuda ]; then
    if ! "$PY" -c 'import torch' 2>/dev/null; then NO_GPU="torch not importable with $PY"
    elif ! "$PY" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
        NO_GPU="no CUDA GPU (torch.cuda.is_available() is false)"; fi
fi

SUMMARY=() FAILED=0
report() {  # STATUS PART FIGURE...
    local line
    line=$(printf '%-5s %-14s %s' "$1" "$2" "${*:3}")
    echo "$line"; SUMMARY+=("$line")
    [ "$1" != FAIL ] || FAILED=1
}
limited() {  # SECONDS CMD...: the command under its time limit (SIGINT first, then SIGKILL)
    local t=$1; shift
    timeout -s INT -k 10 "$t" "$@"
}
count() { grep -oE "[0-9]+ $1" <<<"$last" | grep -oE '^[0-9]+' || echo 0; }  # N of "N passed" in $last
# "exit N" or "timed out after T s", for a FAIL line
why() { if [ "$1" = 124 ] || [ "$1" = 137 ]; then echo "timed out after $2 s"; else echo "exit $1"; fi; }

# The two jobs' command line (test_loop_e2e.run_job's sizes: 4 prompts x 2 samples, one optimizer
# step per rollout, 2 rollouts; --rm-type exact scores the tiny prompt file's labels).
JOB=(train.py --hf-checkpoint "$OUT/model" --prompt-data "$OUT/prompts.jsonl" --rm-type exact
     --advantage-estimator grpo --rollout-batch-size 4 --n-samples-per-prompt 2 --num-rollout 2
     --rollout-max-response-len 3 --global-batch-size 8 --micro-batch-size 4
     --device "$DEVICE" --colocate --rollout-backend torch --update-weight-transport tensor
     --offload --check-precision --check-weight-sync)
MODEL_OK=""
make_inputs() {  # once, for the first job part: the tiny model and a 10-prompt file
    [ -z "$MODEL_OK" ] || return "$MODEL_OK"
    "$PY" -m slime.tools.make_tiny_model --out "$OUT/model" >"$OUT/make-model.log" 2>&1 &&
        "$PY" -c 'import json, sys; open(sys.argv[1], "w").writelines(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(10))' "$OUT/prompts.jsonl"
    MODEL_OK=$?
    return "$MODEL_OK"
}
run_job() {  # PART BACKEND-FLAGS...: PASS only on exit 0 with the gates' success lines in the log
    local part=$1 log="$OUT/$1.log" start rc secs gate syncs via; shift
    make_inputs || { report FAIL "$part" "could not build the tiny model (see $OUT/make-model.log)"; return; }
    start=$SECONDS
    SLIME_LOG_DIR="$OUT/$part-logs" limited "$T_JOB" "$PY" "${JOB[@]}" "$@" >"$log" 2>&1
    rc=$? secs=$((SECONDS - start))
    [ "$rc" = 0 ] || { report FAIL "$part" "$(why "$rc" "$T_JOB") (see $log)"; return; }
    gate=$(grep -m1 -o -- '--check-precision: passed at rollout 0.*' "$log")
    syncs=$(grep -c -- '--check-weight-sync: [0-9]* tensors match on every engine' "$log")
    via=$(grep -o 'weight_version [0-9]* via [a-z_]*' "$log" | awk '{print $4}' | sort -u | paste -sd, -)
    if [ -z "$gate" ] || [ "$syncs" = 0 ]; then report FAIL "$part" "exit 0 but a gate's success line is missing (see $log)"
    elif [ "$DEVICE" = cuda ] && [ "$via" != cuda_ipc ]; then report FAIL "$part" "pushed via '$via', not cuda_ipc (see $log)"
    else
        report PASS "$part" "2 rollouts in $secs s; precision gate passed at rollout 0; weight sync matched on $syncs pushes (via $via)"
        echo "      $gate"; grep -m1 -o -- '--check-weight-sync: [0-9]* tensors match on every engine' "$log" | sed 's/^/      /'
    fi
}

for part in "${PARTS[@]}"; do
    [ -z "$NO_GPU" ] || { report SKIP "$part" "$NO_GPU"; continue; }
    log="$OUT/$part.log" start=$SECONDS
    case $part in
    gpu-tests)
        notes=""
        [ -z "${SGLANG_MISSING:-}" ] || notes+="; test_sglang_gpu skipped: $SGLANG_MISSING"
        [ -z "${NO_MCORE:-}" ] || notes+="; test_megatron_gpu skipped: $NO_MCORE"
        [ -z "${NO_RAY:-}" ] || notes+="; $NO_RAY: the tests that run train.py jobs fail or skip"
        # Shown as it runs (-s: the tests print their measured differences) and kept in the log.
        limited "$T_TESTS" "$PY" -m pytest -m gpu -s -q -p no:cacheprovider tests/test_*gpu*.py 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]} secs=$((SECONDS - start))
        # pytest's last summary line, e.g. "12 passed, 1 skipped, 2 deselected in 95.31s"
        last=$(grep -E '[0-9]+ (passed|failed|skipped|errors?)' "$log" | tail -1)
        passed=$(count passed) failed=$(count failed) skipped=$(count skipped) errors=$(count 'errors?')
        figure="$passed passed, $failed failed, $skipped skipped"
        [ "$errors" = 0 ] || figure+=", $errors errors"
        if [ "$rc" = 0 ] && [ "$passed" = 0 ]; then report SKIP "$part" "every test skipped: $figure ($secs s)$notes"
        elif [ "$rc" = 0 ]; then report PASS "$part" "$figure ($secs s)$notes"
        else report FAIL "$part" "$figure, $(why "$rc" "$T_TESTS") (see $log)$notes"; fi
        ;;
    grpo-fsdp)
        if [ -n "${NO_RAY:-}" ]; then report SKIP "$part" "$NO_RAY"; else run_job "$part" --train-backend fsdp; fi
        ;;
    grpo-megatron)
        if [ -n "${NO_RAY:-}${NO_MCORE:-}" ]; then report SKIP "$part" "${NO_RAY:-$NO_MCORE}"
        else run_job "$part" --train-backend megatron --transformer-impl local; fi
        ;;
    bench-engine)
        # The benchmark's own exit code decides (1: a target missed); its two result lines are the figure.
        limited "$T_BENCH" "$PY" benchmarks/bench_engine.py --device "$DEVICE" >"$log" 2>&1
        rc=$? secs=$((SECONDS - start))
        figure=$(grep -E '^(ratio torch engine / HF generate:|GPU busy)' "$log" | awk 'NR > 1 {printf "; "} {printf "%s", $0}')
        if [ "$rc" != 0 ]; then report FAIL "$part" "$(why "$rc" "$T_BENCH")${figure:+: $figure} (see $log)"
        elif [ "$(grep -cE '^(ratio torch engine / HF generate:|GPU busy)' "$log")" -lt 2 ]; then
            report FAIL "$part" "exit 0 but the 'ratio torch engine / HF generate:' or 'GPU busy' line is missing (see $log)"
        else report PASS "$part" "$figure ($secs s)"; fi
        ;;
    bench-step)
        # Exit 1 from the benchmark: a target missed (its "target ..." lines say which).
        if [ -n "${NO_RAY:-}" ]; then report SKIP "$part" "$NO_RAY"; continue; fi
        preset=(--preset qwen3-0.6b)
        [ "$DEVICE" = cuda ] || preset=()  # the CPU rehearsal runs the demo model
        limited "$T_STEP" "$PY" benchmarks/bench_grpo_step.py --device "$DEVICE" ${preset[@]+"${preset[@]}"} \
            --profile --out "$OUT/bench-step" >"$log" 2>&1
        rc=$? secs=$((SECONDS - start))
        figure=$(grep -E '^(ratio engine / HF generate:|target )' "$log" | awk 'NR > 1 {printf "; "} {printf "%s", $0}')
        if [ "$rc" != 0 ]; then report FAIL "$part" "$(why "$rc" "$T_STEP")${figure:+: $figure} (see $log)"
        elif [ -z "$figure" ]; then report FAIL "$part" "exit 0 but the 'ratio engine / HF generate:' line is missing (see $log)"
        else report PASS "$part" "$figure ($secs s)"; fi
        ;;
    esac
done

tally() { printf '%s\n' "${SUMMARY[@]}" | grep -c "^$1 "; }
echo; echo "summary: $(tally PASS) passed, $(tally FAIL) failed, $(tally SKIP) skipped (logs in $OUT)"
printf '  %s\n' "${SUMMARY[@]}"
for n in "${NOTES[@]}"; do echo "  note: $n"; done
exit "$FAILED"

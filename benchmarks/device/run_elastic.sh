#!/usr/bin/env bash
# On the device (issue 66's GPU goals), from the project's root, after vLLM's pieces (`make_vllm_cuda_carry.sh`, in
# /root/vcparts), the test wheels (`.vt`, carried) and the real model's pieces (`make_model_carry.sh`, in
# /root/vmparts) are there. Each of STEPS runs under `timeout STEP_S` (default 540 s); a failed step is said and the
# next runs:
#   gpu-tests  the GPU tests of joining from a vLLM peer (`tests/consumers/test_join.py -k gpu`), log in $OUT
#   join       benchmarks/probes/join_from_peer.py on vLLM, SmolLM2-135M: a joiner from a vLLM peer on the same GPU
#              (host copies over gloo), JOINERS (8) at once, one from the store; $OUT/join-135m.json (SHAPE=1: at
#              SmolLM2-135M's shape with zero weights, built here, where the model's pieces were not carried)
#   join-1.5b  the same at Qwen2.5-1.5B's shape (zero weights, built here); $OUT/join-1.5b.json
#   delta      bench-sync --deltas into vLLM on real AdamW steps of SmolLM2-135M, redis and fs; $OUT/delta-stall.json
#   OUT=$OUT STEPS="gpu-tests join" bash benchmarks/device/run_elastic.sh
set -uo pipefail
OUT="${OUT:-$(mktemp -d)}"
source benchmarks/device/vllm_cuda_env.sh
if [ -z "${SHAPE:-}" ] || [[ " ${STEPS:-} " == *" delta "* ]]; then source benchmarks/device/real_model_env.sh || exit 1; fi
shaped() {  # shaped NAME DIR: a model folder of bench-sync's shape NAME, zero weights
  python3 -c 'import sys; from pathlib import Path; from benchmarks.bench_sync import SHAPES, build_shaped_model
build_shaped_model(Path(sys.argv[2]), SHAPES[sys.argv[1]])' "$1" "$2"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p "$OUT/logs"
engine='{"gpu_memory_utilization": '"${UTIL:-0.07}"', "enforce_eager": true}'
probe() {  # probe MODEL NAME: the join probe on vLLM, ROUNDS rounds
  timeout -k 30 "${STEP_S:-540}" python3 benchmarks/probes/join_from_peer.py --engine vllm --device cuda:0 --model "$1" --rounds "${ROUNDS:-1}" \
    --joiners "${JOINERS:-8}" --paths "${PATHS:-peer,at-once,store}" --engine-args "$engine" --stagger-s "${STAGGER_S:-0}" \
    > "$OUT/join-$2.json" 2> "$OUT/logs/join-$2.err"
}
for step in ${STEPS:-gpu-tests join}; do
  started=$(date +%s)
  case "$step" in
    gpu-tests) OUT=$OUT timeout -k 30 "${STEP_S:-540}" bash benchmarks/device/run_gpu_tests.sh \
                 tests/consumers/test_join.py -k gpu > /dev/null ;;
    join)
      if [ -n "${SHAPE:-}" ]; then shaped smollm2-135m /root/shape-135m && probe /root/shape-135m 135m-shape
      else probe "$model" 135m; fi ;;
    join-1.5b) shaped qwen2.5-1.5b /root/qwen-1.5b && probe /root/qwen-1.5b 1.5b ;;
    delta)
      timeout -k 30 "${STEP_S:-540}" python3 -m benchmarks bench-sync --engine vllm --model "$model" --device cuda:0 \
        --trainer-device cuda:0 --dtype bfloat16 --transports redis,fs --deltas --rounds "${DELTA_ROUNDS:-6}" \
        --kv-cache-bytes 4000000000 --engine-args '{"gpu_memory_utilization": 0.3}' --logs "$OUT/logs/delta" \
        > "$OUT/delta-stall.json" 2> "$OUT/logs/delta.err"
      ;;
    *) echo "unknown step $step"; continue ;;
  esac
  echo "$step: exit $? in $(( $(date +%s) - started )) s"
done
tail -5 "$OUT/pytest-gpu.log" 2>/dev/null
for f in "$OUT"/join-*.json; do [ -s "$f" ] && python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); print(sys.argv[1], json.dumps(r["median_join_s"]))' "$f"; done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"

#!/usr/bin/env bash
# On the device machine, from the project's root: `rollouts bench-rl ARGS...` on vLLM's CUDA build (0.26, installed
# from the pieces of `make_vllm_cuda_carry.sh`: the call that carries the last piece joins them first, see README.md).
# The report to $OUT/bench_rl.json, its figure to $OUT/bench_rl.png, stderr and the processes' logs to
# $OUT/bench_rl.err and $OUT/logs/, and one line per mode on stdout.
#   OUT=$OUT bash benchmarks/device/run_bench_rl.sh --engine vllm --trainer-device cuda:0 --worker-device cuda:1
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
source benchmarks/device/vllm_cuda_env.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
mkdir -p "$OUT/logs"
python3 -m benchmarks bench-rl --logs "$OUT/logs" --plot "$OUT/bench_rl.png" "$@" > "$OUT/bench_rl.json" \
  2> "$OUT/bench_rl.err" || { tail -60 "$OUT/bench_rl.err"; tail -40 "$OUT"/logs/*.log; exit 1; }
python3 benchmarks/device/bench_rl_summary.py "$OUT/bench_rl.json"

#!/usr/bin/env bash
# On the device machine, from the project's root: run a command with vLLM's CUDA build 0.26 set up
# (`vllm_cuda_env.sh`: the carried pieces joined and installed once a machine), e.g. the lab's bench-sync:
#   bash benchmarks/device/with_vllm_cuda.sh python3 -m benchmarks bench-sync --engine vllm ... > $OUT/sync.json
set -euo pipefail
source benchmarks/device/vllm_cuda_env.sh
exec "$@"

#!/usr/bin/env bash
# On the device machine, from the project's root: the tests that need a GPU (and vLLM's CUDA build 0.26), which CI skips
# or cannot run, with the carried test wheels and Redis 7 (.vt/, make_test_carry.sh) and vLLM's carry
# (vllm_cuda_env.sh). Args are pytest's: the tests to run. One process (no xdist); the log to $OUT/pytest-gpu.log.
#   OUT=$OUT bash benchmarks/device/run_gpu_tests.sh tests/staleness/test_ipc.py
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
source benchmarks/device/vllm_cuda_env.sh
[ -d /tmp/vt-site/_pytest ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vt-site .vt/*.whl
export PYTHONPATH="$PYTHONPATH:/tmp/vt-site" ROLLOUTS_REDIS_SERVER="$PWD/.vt/bin/redis-server" \
  LD_LIBRARY_PATH="$PWD/.vt/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader
python3 -m pytest -o addopts="-ra --durations=10" -p no:cacheprovider -v "$@" 2>&1 | tee "$OUT/pytest-gpu.log"
exit "${PIPESTATUS[0]}"

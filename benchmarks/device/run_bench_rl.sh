#!/usr/bin/env bash
# On the device machine, from the project's root: `rollouts bench-rl ARGS...` on vLLM's CUDA build (0.26, installed
# from the pieces of `make_vllm_cuda_carry.sh`: the call that carries the last piece joins them first, see README.md).
# The report to $OUT/bench_rl.json, its figure to $OUT/bench_rl.png, stderr and the processes' logs to
# $OUT/bench_rl.err and $OUT/logs/, and one line per mode on stdout.
#   OUT=$OUT bash benchmarks/device/run_bench_rl.sh --engine vllm --trainer-device cuda:0 --worker-device cuda:1
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
if [ ! -d /tmp/vc-site/vllm ]; then
  mkdir -p /root/vc && cat /root/vcparts/part.* | tar -xf - -C /root/vc && bash /root/vc/install.sh
fi
export PYTHONPATH="$PWD/benchmarks/device/vllm026:$PWD:/tmp/vc-site" PATH="/root/vc/bin:$PATH" \
  ROLLOUTS_REDIS_SERVER=/root/vc/bin/redis-server VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
mkdir -p "$OUT/logs"
python3 -m benchmarks bench-rl --logs "$OUT/logs" --plot "$OUT/bench_rl.png" "$@" > "$OUT/bench_rl.json" \
  2> "$OUT/bench_rl.err" || { tail -60 "$OUT/bench_rl.err"; tail -40 "$OUT"/logs/*.log; exit 1; }
python3 benchmarks/device/bench_rl_summary.py "$OUT/bench_rl.json"

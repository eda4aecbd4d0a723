#!/usr/bin/env bash
# On the device machine, from the project's root: the colocated loop (benchmarks/probes/colocated_cycle.py) on one GPU,
# trainer and worker sharing it, for each engine and sleep level in SETTINGS ("engine:level ..."; level 0: no sleep,
# the baseline), publishing by TRANSPORT (default redis://; ipc:// hands the trainer's GPU memory over by CUDA IPC).
# One JSON per setting to $OUT/colocated-ENGINE-LEVEL[-ipc].json, stderr to $OUT/colocated.err, a line each.
#   OUT=$OUT HIDDEN=2048 LAYERS=16 bash benchmarks/device/run_colocated.sh --rounds 6 --prompts 16 --n 8
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
source benchmarks/device/vllm_cuda_env.sh
SETTINGS="${SETTINGS:-torch:0 torch:1 vllm:0 vllm:1 vllm:2}"
KV='{"kv_cache_memory_bytes": 8000000000, "gpu_memory_utilization": 0.5}'  # the trainer shares the GPU
for setting in $SETTINGS; do
  engine="${setting%%:*}" level="${setting##*:}" transport="${TRANSPORT:-redis://}"
  name="colocated-$engine-$level"; if [ "$transport" = ipc:// ]; then name="$name-ipc"; fi
  python3 benchmarks/probes/colocated_cycle.py --engine "$engine" --level "$level" --device cuda:0 --dtype bfloat16 \
    --hidden "${HIDDEN:-2048}" --layers "${LAYERS:-16}" --engine-args "$KV" --transport "$transport" "$@" \
    > "$OUT/$name.json" 2>> "$OUT/colocated.err" || { tail -60 "$OUT/colocated.err"; exit 1; }
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['medians'])" \
    "$OUT/$name.json" "$setting $transport"
done

#!/usr/bin/env bash
# On the device machine, from the project's root: FP8 rollouts against bf16 ones on vLLM's CUDA build
# (benchmarks/probes/rollout_mismatch.py): a random Qwen2 of HIDDEN x LAYERS in bf16, sampled by vLLM without and with
# `quantization: fp8`, scored by the trainer's bf16 forward pass on the same GPU, before and after a sync. SCALE is the
# model's init scale (`build_tiny_model(init_scale=)`, default 1.0: at the tiny model's 4.0 a model this size is
# chaotic, and bf16 alone moves its logprobs by ~1 nat). SETTINGS picks among "bf16 fp8".
# One JSON per setting to $OUT/mismatch-{bf16,fp8}.json, stderr to $OUT/mismatch.err, a summary line each on stdout.
#   OUT=$OUT HIDDEN=2048 LAYERS=16 bash benchmarks/device/run_mismatch.sh --prompts 256 --max-tokens 256
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
source benchmarks/device/vllm_cuda_env.sh
HIDDEN="${HIDDEN:-2048}" LAYERS="${LAYERS:-16}" SCALE="${SCALE:-1.0}" MODEL="/tmp/mismatch-model-$SCALE"
KV='"kv_cache_memory_bytes": 8000000000, "gpu_memory_utilization": 0.5'  # the trainer shares the GPU
[ -f "$MODEL/model.safetensors" ] || python3 -c "from pathlib import Path; from consumers.engines.tiny_model import \
build_tiny_model; build_tiny_model(Path('$MODEL'), hidden_size=$HIDDEN, num_layers=$LAYERS, init_scale=$SCALE)"
for setting in ${SETTINGS:-bf16 fp8}; do
  args="{$KV}"; [ "$setting" = fp8 ] && args="{$KV, \"quantization\": \"fp8\"}"
  python3 benchmarks/probes/rollout_mismatch.py "$MODEL" --engine vllm --dtype bfloat16 --engine-args "$args" \
    --trainer-dtype bfloat16 --trainer-device cuda "$@" > "$OUT/mismatch-$setting.json" 2>> "$OUT/mismatch.err" \
    || { tail -60 "$OUT/mismatch.err"; exit 1; }
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], [{k: round(v, 5) for k, v in row.items()}
for row in r['versions']])" "$OUT/mismatch-$setting.json" "$setting"
done

#!/usr/bin/env bash
# On the device machine, from the project's root (issue 63, item 5): `bench-sync` into vLLM's CUDA build 0.26 on one
# GPU by ipc:// (colocated) and redis://, at the real model (SmolLM2-135M-Instruct) and at random bf16 Qwen2 models of
# Qwen2.5-1.5B's and Qwen2.5-7B's configurations. Needs vLLM's five pieces in /root/vcparts (make_vllm_cuda_carry.sh)
# and, for the real model, the model's two in /root/vmparts (make_model_carry.sh), each copied there by a call of its
# own; the model is converted once a machine.
#   OUT=$OUT STEPS="smollm2 1.5b" bash benchmarks/device/run_sync_real_shapes.sh
#   OUT=$OUT STEPS=7b bash benchmarks/device/run_sync_real_shapes.sh
# STEPS among smollm2, 1.5b, 7b; TRANSPORTS (ipc,redis), ROUNDS (6: the first on its own, the medians of the rest),
# STEP_S (each step's timeout, 300 s), KV (the KV cache's bytes, 4e9), UTIL (vLLM's gpu_memory_utilization, 0.3: the
# share of the GPU it asks to find free at its start; the trainer holds its versions by then). Each step: one worker,
# synced by each transport in turn (--one-worker); $OUT/sync-STEP.json, one summary line a transport on stdout, the
# stderr and the worker's log in $OUT/logs.tar.gz. LOADS (auto): how vLLM's workers load a version, each in turn
# ($OUT/sync-STEP-LOAD.json when LOADS names several): auto (the engine's choice: direct into the parameters where no
# layer processes its weights after loading), layerwise (vLLM's reload_weights, as every load before 2026-12-06).
set -uo pipefail
OUT="${OUT:-$(mktemp -d)}"
source benchmarks/device/vllm_cuda_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ " ${STEPS:-} " == *" smollm2 "* ]]; then source benchmarks/device/real_model_env.sh; fi
mkdir -p "$OUT/logs"
for step in ${STEPS:-}; do
  case "$step" in
    smollm2) what=(--model "$model") ;;
    1.5b) what=(--sizes qwen2.5-1.5b) ;;
    7b) what=(--sizes qwen2.5-7b) ;;
    *) echo "unknown step $step"; continue ;;
  esac
  loads=(${LOADS:-auto})
  for load in "${loads[@]}"; do
  name=$step; [ "${#loads[@]}" -gt 1 ] && name=$step-$load
  extension=""
  [ "$load" = layerwise ] && extension=', "worker_extension_cls": "benchmarks.bench_sync.TimedLayerwiseExtension"'
  started=$(date +%s)
  timeout -k 60 "${STEP_S:-300}" python3 -m benchmarks bench-sync "${what[@]}" --engine vllm --device cuda:0 \
    --trainer-device cuda:0 --dtype bfloat16 --transports "${TRANSPORTS:-ipc,redis}" --one-worker \
    --rounds "${ROUNDS:-6}" --kv-cache-bytes "${KV:-4000000000}" \
    --engine-args "{\"gpu_memory_utilization\": ${UTIL:-0.3}$extension}" --logs "$OUT/logs/$name" \
    > "$OUT/sync-$name.json" 2> "$OUT/logs/sync-$name.err"
  echo "$name: exit $? in $(( $(date +%s) - started )) s; $(grep -ho 'versions load [^;]*$' "$OUT/logs/$name"/*.log | head -1)"
  python3 - "$OUT/sync-$name.json" <<'PY' || tail -30 "$OUT/logs/sync-$name.err"
import json, sys
report = json.load(open(sys.argv[1]))
print(f"  {report['gpu']}: copy {report['copy_tb_per_s']} TB/s (read + write)")
keys = ("stall_s", "stall_p90_s", "floor_s", "stall_over_floor", "per_tensor_copy_s", "pause_s", "load_s",
        "engine_open_s", "engine_reload_s", "engine_wait_s", "engine_rest_s", "resume_s", "fetch_s", "publish_s",
        "first_stall_s", "trainer_copies", "trainer_held_mib", "error", "skipped")
for row in report["results"]:
    print(f"  {row['size']} {row['transport']} {row['bytes'] / 2**30:.3f} GiB:",
          ", ".join(f"{k} {row[k]}" for k in keys if k in row))
PY
  done
done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"

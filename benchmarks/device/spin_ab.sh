#!/usr/bin/env bash
# Is the tail a halted vCPU's wake-up? `rollouts scale` with and without a SCHED_IDLE spinner on Redis's core and on
# the measuring core (a spinning vCPU never halts; any real task preempts it at once). PAIRS pairs, alternating; each
# run's files in $OUT/SIDE-K/, a summary line per run on stdout.
#   OUT=/tmp/out bash benchmarks/device/spin_ab.sh 2 --workers 1000 --procs 60 ...
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
pairs="$1"; shift
cat /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor 2>/dev/null || true
# The last two allowed cores: where `rollouts scale --redis-cores 1` puts the measuring processes and Redis
# (`split_cores`).
cores=$(python -c 'import os; print(*sorted(os.sched_getaffinity(0))[-2:])')
spin='import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True: pass'
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT  # a failed run must not leave its spinners spinning
for k in $(seq 1 "$pairs"); do
  sides="off on"; [ $((k % 2)) -eq 0 ] && sides="on off"
  for side in $sides; do
    pids=()
    if [ "$side" = on ]; then for c in $cores; do python -c "$spin" "$c" & pids+=($!); done; fi
    mkdir -p "$OUT/$side-$k"
    OUT="$OUT/$side-$k" bash benchmarks/device/run_scale.sh "$@" 2>&1 | tail -1 | sed "s/^/$side-$k /"
    kill "${pids[@]}" 2>/dev/null || true
  done
done

#!/usr/bin/env bash
# `rollouts scale` under several Redis set-ups alternately, on the device machine (as run_scale.sh: carried wheels and
# redis-server). Each variant is NAME=DIR:CORES: the redis-server first on PATH (DIR) and `--redis-cores CORES`.
# ROUNDS rounds, each running every variant once, the order rotated a round; each run's JSON to $OUT/NAME-K.json and
# a summary line per run on stdout.
#   OUT=/tmp/out VARIANTS="plain=.carry/redis7:1 io4=.carry/redis7io:4" bash benchmarks/device/run_redis_ab.sh 2 \
#       --workers 1000 --procs 60 --warmup-s 5 --measure-s 30 --sync-every-s 5 --lengths uniform:256-1536
# `make_carry.sh --redis7` builds .carry/redis7; .carry/redis7io is a wrapper that adds `--io-threads
# ${REDIS_IO_THREADS:-4} --io-threads-do-reads yes` (README, *Redis I/O threads*).
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
rounds="$1"; shift
read -r -a variants <<< "${VARIANTS:?NAME=DIR:CORES ...}"
python -c "import numpy" 2>/dev/null && extra="" || extra=numpy
python -m pip install -q --upgrade --no-index --find-links .carry/wheels --target /tmp/rs-lib redis hiredis pydantic typer rich prometheus_client psutil $extra
for k in $(seq 1 "$rounds"); do
  n=${#variants[@]}; shift_by=$(( (k - 1) % n ))
  for i in $(seq 0 $((n - 1))); do
    spec="${variants[$(( (i + shift_by) % n ))]}"
    name="${spec%%=*}"; rest="${spec#*=}"; dir="${rest%%:*}"; cores="${rest##*:}"
    (PATH="$PWD/$dir:$PWD/.carry/bin:$PATH" PYTHONPATH="$PWD:/tmp/rs-lib" \
      python -m benchmarks scale --redis-cores "$cores" "$@" > "$OUT/$name-$k.json" 2> "$OUT/$name-$k.err") \
      || { echo "$name-$k failed"; tail -20 "$OUT/$name-$k.err"; continue; }
    python benchmarks/device/scale_summary.py "$OUT/$name-$k.json" "$name-$k"
  done
done

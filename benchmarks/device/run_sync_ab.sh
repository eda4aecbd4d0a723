#!/usr/bin/env bash
# `rollouts bench-sync` on two trees alternately, on the device machine (carried wheels and redis-server, as
# run_scale_ab.sh): this checkout (`after`, or the tree in $AFTER) and a copy of another commit in `.before/`
# (`git archive COMMIT | tar -x -C .before`, carried with `.carry/`). PAIRS pairs, the first before then after, the
# next after then before; each run's JSON to $OUT/SIDE-K.json, the worker's logs under $OUT/SIDE-K-logs/, and a
# summary line per size on stdout. SIDES=after (or before) runs one side only.
#   OUT=/tmp/out bash benchmarks/device/run_sync_ab.sh 1 --sizes tiny,xl --transports nccl --rounds 4 \
#     --device cuda:1 --trainer-device cuda:0
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
pairs="$1"; shift
python -c "import numpy" 2>/dev/null && extra="" || extra=numpy
python -m pip install -q --upgrade --no-index --find-links .carry/wheels --target /tmp/rs-lib redis hiredis pydantic typer rich prometheus_client psutil $extra
export PATH="$PWD/.carry/bin:$PATH" NCCL_NVLS_ENABLE=0
root="$PWD"
after="$(cd "${AFTER:-$root}" && pwd)"
for k in $(seq 1 "$pairs"); do
  sides="before after"; [ $((k % 2)) -eq 0 ] && sides="after before"
  [ -n "${SIDES:-}" ] && sides="$SIDES"
  for side in $sides; do
    tree="$after"; [ "$side" = before ] && tree="$root/.before"
    lab=benchmarks; [ -f "$tree/benchmarks/__main__.py" ] || lab=pipeline.cli  # a tree from before `python -m benchmarks`
    (cd "$tree" && PYTHONPATH="$tree:/tmp/rs-lib" python -m "$lab" bench-sync --logs "$OUT/$side-$k-logs" "$@" \
      > "$OUT/$side-$k.json" 2> "$OUT/$side-$k.err") || { echo "$side-$k failed"; tail -20 "$OUT/$side-$k.err"; continue; }
    python - "$OUT/$side-$k.json" "$side-$k" <<'PY'
import json, sys
keys = ("stall_s", "stall_s_rounds", "first_stall_s", "first_setup_s", "ready_s", "first_ready_s", "broadcast_s",
        "first_broadcast_s", "gb_per_s", "bare_gb_per_s", "ratio", "publish_to_serving_s", "skipped")
for r in json.load(open(sys.argv[1]))["results"]:
    print(sys.argv[2], r["size"], r["transport"], json.dumps({k: r[k] for k in keys if k in r}), flush=True)
PY
  done
done

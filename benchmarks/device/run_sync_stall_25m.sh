#!/usr/bin/env bash
# Carried: .carry/s54 (the wheels of make_ipc_carry.sh in wheels/, Debian redis-server in bin/, liblzf + libjemalloc in lib/)
# and .before (git archive COMMIT | tar -x -C .before). Results: benchmarks/results/2026-12-01-sync-stall-25m.md
# issue 54 part 4 on the device: the trainer's step and the 25M sync stall, before (.before = git archive HEAD) and after.
set -uo pipefail
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/rs-lib .carry/s54/wheels/*.whl
export PATH="$PWD/.carry/s54/bin:$PATH" LD_LIBRARY_PATH="$PWD/.carry/s54/lib" \
  ROLLOUTS_REDIS_SERVER="$PWD/.carry/s54/bin/redis-server" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
A="$PWD"; B="$PWD/.before"; G="--device cuda:0 --trainer-device cuda:0"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch; print(torch.__version__)"; nproc
step() { timeout 120 python -P "$A/benchmarks/bench_step.py" --device cuda:0 "$@" 2>>"$OUT/run.log" | tail -1 >> "$OUT/step.jsonl"; }
PYTHONPATH="$A:/tmp/rs-lib" step
PYTHONPATH="$A:/tmp/rs-lib" step --dtype bfloat16
PYTHONPATH="$B:/tmp/rs-lib" step
echo "steps done $SECONDS"; cat "$OUT/step.jsonl"
(cd "$A" && PYTHONPATH="$A:/tmp/rs-lib" timeout 150 python -m benchmarks bench-sync --sizes medium --transports redis,ipc --rounds 5 $G --logs "$OUT/logs-after" > "$OUT/sync-after.json" 2>>"$OUT/run.log")
echo "after done $SECONDS"
(cd "$B" && PYTHONPATH="$B:/tmp/rs-lib" timeout 150 python -m benchmarks bench-sync --sizes medium --transports redis,ipc --rounds 5 $G > "$OUT/sync-before.json" 2>>"$OUT/run.log")
echo "before done $SECONDS"
for W in 1 4 8; do
  (cd "$A" && PYTHONPATH="$A:/tmp/rs-lib" timeout 100 python -m benchmarks bench-sync --sizes medium,large --transports redis --rounds 3 --workers $W $G 2>>"$OUT/run.log" | python -c "import json,sys; print(json.dumps(json.load(sys.stdin)))" >> "$OUT/sync-w.jsonl")
  echo "W=$W done $SECONDS"
done
grep -h -A2 "fetched or joined" "$OUT"/logs-after/*.log | tr -s ' ' | head -40 > "$OUT/worker-lines.txt"
rm -rf "$OUT/logs-after"
python - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("sync-after.json", "sync-before.json"):
    try:
        for r in json.loads((out / name).read_text())["results"]:
            print(name, json.dumps({k: v for k, v in r.items() if not k.endswith("_rounds")}))
    except Exception as exc:
        print(name, "failed", exc)
for line in (out / "sync-w.jsonl").read_text().splitlines() if (out / "sync-w.jsonl").exists() else []:
    r = json.loads(line)
    for row in r["results"]:
        print("W", r.get("workers"), row["size"], row.get("publish_s"), row.get("sync_s"), row.get("stall_s"), row.get("stall_max_s"))
PY

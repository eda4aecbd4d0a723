#!/usr/bin/env bash
# On the device machine (one GPU): install the wheels of `.carry-ipc/` (make_ipc_carry.sh) beside its torch, put the
# carried Redis 7 first, then run `tests/staleness/test_ipc.py` (its GPU tests included) and/or `rollouts bench-sync ARGS...`.
#   bash benchmarks/device/run_ipc.sh tests
#   bash benchmarks/device/run_ipc.sh bench --sizes tiny,medium --transports ipc,fs,nccl --device cuda:0 --trainer-device cuda:0
# Output to $OUT: pytest-ipc.log, bench-sync.json and bench-sync.err.
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
what="$1"; shift
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/rs-lib .carry-ipc/wheels/*.whl
export PATH="$PWD/.carry-ipc/bin:$PATH" PYTHONPATH="$PWD:/tmp/rs-lib" LD_LIBRARY_PATH="$PWD/.carry-ipc/lib" \
  ROLLOUTS_REDIS_SERVER="$PWD/.carry-ipc/bin/redis-server" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader; python -c "import torch; print(torch.__version__)"
if [ "$what" = tests ]; then
  python -m pytest tests/staleness/test_ipc.py -v -rs -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest-ipc.log"
else
  python -m benchmarks bench-sync "$@" > "$OUT/bench-sync.json" 2> "$OUT/bench-sync.err" || { tail -40 "$OUT/bench-sync.err"; exit 1; }
  python - "$OUT/bench-sync.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    shown = {k: v for k, v in r.items() if not k.endswith("_rounds")}
    print(json.dumps(shown))
PY
fi

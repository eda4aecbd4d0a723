#!/usr/bin/env bash
# Build `.carry-ipc/` (add `/.carry-ipc/` to .git/info/exclude) for `run_ipc.sh` on a device machine that has Python
# 3.12 and torch but no Redis and no package index: the wheels the tests and `bench-sync` need beyond what it has
# (redis-py, hiredis, pydantic, fakeredis for tests/fixtures.py) and this machine's Redis 7 (Debian's, the tests'
# `installed_redis` wants a 7.x) with the two libraries it needs that the device lacks (liblzf, libjemalloc).
#   bash benchmarks/device/make_ipc_carry.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .carry-ipc/wheels .carry-ipc/bin .carry-ipc/lib
pins=$(python - <<'PY'
from importlib.metadata import version
names = ["redis", "hiredis", "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions",
         "fakeredis", "sortedcontainers"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .carry-ipc/wheels $pins
cp "$(readlink -f /usr/bin/redis-server)" .carry-ipc/bin/redis-server
cp -L /lib/x86_64-linux-gnu/liblzf.so.1 /lib/x86_64-linux-gnu/libjemalloc.so.2 .carry-ipc/lib/
du -sh .carry-ipc

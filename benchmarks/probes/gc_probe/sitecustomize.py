"""A probe for `benchmarks/probes/gc_pauses.py`: every collection of Python's two older generations, in each process.

Put this folder on `PYTHONPATH` and `GC_PROBE=DIR` in the environment. Nothing happens without `GC_PROBE`. Each
process that starts then appends to `DIR/PID.txt`: its command line first, then `generation milliseconds wall_time`
for each collection of generation 1 or 2, as it ends (lines, not a dump at exit: vLLM's processes are killed). A
measuring tool, not part of the product.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any

if os.environ.get("GC_PROBE"):
    _out = open(os.path.join(os.environ["GC_PROBE"], f"{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115
    _out.write(" ".join(sys.argv) + "\n")
    _started: dict[int, float] = {}

    def _timed(phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            _started[generation] = time.perf_counter()
        elif generation >= 1 and generation in _started:
            took = (time.perf_counter() - _started[generation]) * 1000
            _out.write(f"{generation} {took:.3f} {time.time():.3f}\n")

    gc.callbacks.append(_timed)

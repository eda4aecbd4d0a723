"""Time each part of a weight sync inside the vLLM engine, with generations in flight: where a worker's stall goes.

A worker's sync is `engine.pause(mode)` → `engine.load_tensors(...)` (a safetensors blob to every vLLM worker by
`collective_rpc`, the weight-version label, a prefix-cache reset) → `engine.resume()`. This runs our `VllmEngine` in
process on MODEL, keeps `--busy` requests generating, and `--rounds` times pauses, loads the model's own weights as a
new version and resumes, timing each call the engine makes on vLLM's `AsyncLLM` (wrapped for the probe) and each of
the engine's own steps. JSON of the medians (milliseconds) on stdout.

    python benchmarks/probes/vllm_sync_probe.py MODEL --rounds 8 --busy 64 --mode abort
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file

from consumers.engines.vllm_engine import VllmEngine
from pipeline.wire import Sampling

WRAPPED = ("pause_generation", "resume_generation", "collective_rpc", "update_weight_version", "reset_prefix_cache")


def timed(took: dict[str, list[float]], name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            took[name].append((time.perf_counter() - started) * 1000)

    return wrapper


async def probe(
    model: Path, rounds: int, busy: int, mode: str, dtype: str, engine_args: dict[str, Any]
) -> dict[str, Any]:
    engine = VllmEngine(str(model), dtype=dtype, engine_args=engine_args)
    started = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - started
    took: dict[str, list[float]] = defaultdict(list)
    llm = engine._llm
    for name in WRAPPED:
        setattr(llm, name, timed(took, name, getattr(llm, name)))
    for owner, name in ((llm.engine_core, "pause_scheduler_async"), (llm.renderer, "clear_mm_cache_async")):
        if hasattr(owner, name):  # the parts of `pause_generation`
            setattr(owner, name, timed(took, name, getattr(owner, name)))
    tensors = load_file(str(model / "model.safetensors"))
    stop = asyncio.Event()

    async def keep_busy(row: int) -> None:
        i = 0
        while not stop.is_set():
            prompt = np.array([300 + row % 100, 16, 17], dtype=np.int64)
            await engine.generate(f"r{row}-{i}", prompt, Sampling(max_tokens=200, seed=row * 1000 + i))
            i += 1

    clients = [asyncio.create_task(keep_busy(row)) for row in range(busy)]
    await asyncio.sleep(2.0)  # every row decoding
    for version in range(1, rounds + 1):
        t0 = time.perf_counter()
        await engine.pause(mode)  # type: ignore[arg-type]  # the probe's --mode is checked by argparse
        t1 = time.perf_counter()
        await engine.load_tensors(tensors, version)
        t2 = time.perf_counter()
        await engine.resume()
        t3 = time.perf_counter()
        took["engine.pause"].append((t1 - t0) * 1000)
        took["engine.load_tensors"].append((t2 - t1) * 1000)
        took["engine.resume"].append((t3 - t2) * 1000)
        took["stall"].append((t3 - t0) * 1000)
        await asyncio.sleep(0.5)
    stop.set()
    await engine.pause("abort")
    await engine.resume()
    await asyncio.gather(*clients, return_exceptions=True)
    await engine.shutdown()
    medians = {name: round(statistics.median(values), 2) for name, values in took.items()}
    return {"start_s": round(start_s, 1), "rounds": rounds, "busy": busy, "mode": mode, "median_ms": medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--busy", type=int, default=64)
    parser.add_argument("--mode", default="abort", choices=["abort", "keep"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engine-args", default="{}", help="More AsyncEngineArgs, as JSON.")
    args = parser.parse_args()
    engine_args = json.loads(args.engine_args)
    report = asyncio.run(probe(args.model, args.rounds, args.busy, args.mode, args.dtype, engine_args))
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""Where a `rollouts bench` round goes: the torch engine called directly vs the same engine behind a worker.

    python benchmarks/probes/bench_anatomy.py --rounds 6

One process, one private redis-server, two torch engines on one thread each: one called directly, one served by a
`Worker` on an event loop of its own thread, fed by a `RolloutClient`. Rounds alternate as in `rollouts bench`
(64 prompts x 4 samples x 64 tokens). For each round it counts the engine's steps and prefills (a wrapper around
its `_step`: an experiment's probe, not an API) and how long they took, and for pipeline rounds also: the time
from the submit to the engine's first `generate` (start) and from its last answer to `collect` returning (tail),
and the CPU time of every thread of this process and of redis-server. It prints one JSON line per round, then
the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.bench import _direct_round, make_prompts, pipeline_round
from benchmarks.cpu import cpu_seconds
from consumers.engines.tiny_model import build_tiny_model
from consumers.engines.torch_engine import TorchEngine
from consumers.worker import Worker, WorkerSettings
from pipeline.connections import connect
from pipeline.local import RedisServer
from pipeline.streams import Streams
from producers.client import RolloutClient


def threads_cpu() -> dict[str, float]:
    """CPU seconds of every thread of this process, by name and thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[f"{f.read().strip()}-{tid}"] = cpu_seconds("self", int(tid))
        except OSError:
            continue  # a thread that ended meanwhile
    return out


class Probe:
    """Counts an engine's steps, prefills and time in steps, and when its generate calls start and end."""

    def __init__(self, engine: TorchEngine) -> None:
        self.steps = self.prefills = 0
        self.step_s = 0.0
        self.first_start: float | None = None
        self.last_end = 0.0
        step, generate = engine._step, engine.generate

        def timed_step(admitted: list[Any]) -> None:
            started = time.perf_counter()
            self.steps += 1
            self.prefills += bool(admitted)
            try:
                step(admitted)
            finally:
                self.step_s += time.perf_counter() - started

        async def marked_generate(*args: Any, **kwargs: Any) -> Any:
            if self.first_start is None:
                self.first_start = time.perf_counter()
            out = await generate(*args, **kwargs)
            self.last_end = time.perf_counter()
            return out

        engine._step = timed_step  # type: ignore[method-assign]  # the probe wraps this engine's own
        engine.generate = marked_generate  # type: ignore[method-assign]  # the probe wraps this engine's own

    def snapshot(self) -> tuple[int, int, float]:
        return self.steps, self.prefills, self.step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    model = build_tiny_model(Path(tempfile.mkdtemp(prefix="anatomy-")) / "model", seed=0)
    direct, served = TorchEngine(model, num_threads=1), TorchEngine(model, num_threads=1)
    probes = {"direct": Probe(direct), "pipeline": Probe(served)}
    times: dict[str, list[float]] = {"direct": [], "pipeline": []}
    with RedisServer() as server:
        assert server.process is not None
        loop = asyncio.new_event_loop()
        loop.run_until_complete(direct.start())
        worker = Worker(Streams(connect(server.url), "anatomy"), served, "anatomy-worker", WorkerSettings())
        worker_loop = asyncio.new_event_loop()
        thread = threading.Thread(target=worker_loop.run_until_complete, args=(worker.run(),), daemon=True)
        thread.start()
        client = RolloutClient(server.url, "anatomy")
        heartbeat = client.streams.keys.worker("anatomy-worker")
        deadline = time.monotonic() + 120
        while client.streams.redis.hget(heartbeat, "status") != b"serving":
            if time.monotonic() > deadline or not thread.is_alive():
                raise SystemExit("the worker did not start serving within 120 s")
            time.sleep(0.05)
        for r in range(args.rounds + 1):  # round 0 warms both up
            batch = make_prompts(64, 4, 64, direct.vocab_size, tag=f"r{r}")
            for side in ("direct", "pipeline") if r % 2 == 0 else ("pipeline", "direct"):
                probe = probes[side]
                before, probe.first_start = probe.snapshot(), None
                cpu0, redis0 = threads_cpu(), cpu_seconds(server.process.pid)
                submitted = time.perf_counter()
                if side == "direct":
                    took, _ = loop.run_until_complete(_direct_round(direct, batch))
                else:
                    took, _ = pipeline_round(client, batch)
                done = time.perf_counter()
                cpu1, redis1 = threads_cpu(), cpu_seconds(server.process.pid)
                steps, prefills, step_s = (a - b for a, b in zip(probe.snapshot(), before, strict=True))
                row: dict[str, Any] = {"round": r, "side": side, "seconds": round(took, 4), "steps": steps}
                row |= {"prefills": prefills, "in_steps_s": round(step_s, 4)}
                if side == "pipeline":
                    row["start_s"] = round((probe.first_start or submitted) - submitted, 4)
                    row["tail_s"] = round(done - probe.last_end, 4)
                    used = {k: round(v - cpu0.get(k, 0.0), 3) for k, v in cpu1.items()}
                    row["threads_cpu_s"] = {k: v for k, v in used.items() if v > 0.005}
                    row["redis_cpu_s"] = round(redis1 - redis0, 3)
                print(json.dumps(row), flush=True)
                if r > 0:
                    times[side].append(took)
        worker.stop(drain=False)
        thread.join(30)
        loop.run_until_complete(direct.shutdown())
    medians = {side: statistics.median(t) for side, t in times.items()}
    ratio = medians["direct"] / medians["pipeline"]
    print(json.dumps({"median_s": {k: round(v, 4) for k, v in medians.items()}, "ratio": round(ratio, 4)}))


if __name__ == "__main__":
    main()

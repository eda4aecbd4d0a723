"""`rollouts scale-fleet`: many real workers in one process, for `rollouts scale`.

A thousand worker processes do not fit on a small machine, yet what one Redis sees from a thousand workers
is a thousand of everything: connections, heartbeats, registry entries, consumer names, blocking reads,
control readers, claims and publishes. So this process runs `consumers.worker.Worker` itself, K times in one
event loop, each on the synthetic engine and with its own Redis client (its own connections): every command a
worker process would send, this process sends, through the same code. The only addition is a clock around
each publish (`Publisher.timings`): client-side latency, which includes this process's own queueing.

It runs until SIGTERM, then stops its workers (no drain) and writes `--out`: JSON with every publish as
`[wall time, milliseconds]`.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.connections import connect
from pipeline.streams import Streams
from rollouts.app import setup_logging

THREADS_PER_WORKER = 4
"""Worker calls into redis-py run on threads (`asyncio.to_thread`); a worker may have four at once (its blocking
read of work, its blocking read of control, upkeep, a publish), so the pool must not make them wait for each other."""
STOP_S = 15.0
"""How long the workers get to stop (no drain) before the rest are cancelled and the publishes written."""
THREAD_STACK = 256 * 1024
"""Bytes of stack per thread: thousands of threads with the default 8 MB would reserve tens of GB."""


async def run_fleet(url: str, ns: str, names: list[str], engine_args: dict[str, Any], max_inflight: int) -> list:
    """Run a worker per name until SIGTERM; returns every worker's publishes."""
    from consumers.engines import create_engine
    from consumers.worker import Worker, WorkerSettings

    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=THREADS_PER_WORKER * len(names)))
    settings = WorkerSettings(max_inflight=max_inflight)
    streams = [Streams(connect(url, ns=ns), ns) for _ in names]
    workers = [
        Worker(s, create_engine("synthetic", "synthetic", **engine_args), name, settings)
        for s, name in zip(streams, names, strict=True)
    ]
    for worker in workers:
        worker.publisher.timings = []
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    runs = [asyncio.create_task(w.run()) for w in workers]
    await stopping.wait()
    for worker in workers:
        worker.stop(drain=False)
    _, stuck = await asyncio.wait(runs, timeout=STOP_S)
    for run in stuck:  # the publishes are what this process is for: they are written whatever hangs
        run.cancel()
    for s in streams:
        s.redis.close()
    return [p for worker in workers for p in worker.publisher.timings or ()]


def scale_fleet(
    redis_url: Annotated[str, typer.Option("--redis")],
    ns: Annotated[str, typer.Option("--ns")],
    first: Annotated[int, typer.Option(help="Index of this process's first worker.")],
    count: Annotated[int, typer.Option(help="Workers in this process.")],
    engine_args: Annotated[str, typer.Option(help="The synthetic engine's options (JSON).")],
    max_inflight: Annotated[int, typer.Option()],
    out: Annotated[Path, typer.Option(help="Where to write the publishes (JSON) once stopped.")],
) -> None:
    """Run `count` workers (`scale-w{first}`...) in this process until SIGTERM (see `rollouts scale`)."""
    setup_logging("warning")
    threading.stack_size(THREAD_STACK)
    names = [f"scale-w{k}" for k in range(first, first + count)]
    publishes = asyncio.run(run_fleet(redis_url, ns, names, json.loads(engine_args), max_inflight))
    out.write_text(json.dumps({"publishes": publishes}))

"""`rollouts worker --lazy --release-after-s S`: no engine until work arrives, released when idle, and weight syncs
while there is no engine acked at once and loaded at the next start (real worker processes, real engines)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from pipeline.codec import as_fields
from pipeline.local import RedisServer, free_port
from pipeline.top import render, snapshot
from producers.client import RolloutClient
from tests.cli.test_metrics import scrape, value
from tests.fixtures import StartWorker, wait_until
from tests.reference import check_spans_and_logprobs


def heartbeat(client: RolloutClient, name: str) -> dict[str, str]:
    beat = as_fields(client.streams.redis.hgetall(client.streams.keys.worker(name)))
    return {k.decode(): v.decode() for k, v in beat.items()}


def engine_processes(pid: int) -> list[str]:
    """The worker's live vLLM processes (`VLLM::EngineCore`, `VLLM::Worker`): none while it holds no engine.

    An exited engine core stays a zombie until reaped (it holds no memory), and multiprocessing's resource tracker
    stays for the worker's life: neither counts."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.name().startswith("VLLM") and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.name())
        except psutil.NoSuchProcess:
            continue  # it exited meanwhile
    return found


def top_row(client: RolloutClient, name: str) -> list[str]:
    """The cells of the worker's row of `rollouts top`, as drawn: worker, status, engine, starts, version, ..."""
    drawn = io.StringIO()
    Console(width=200, file=drawn).print(render(snapshot(client.streams)))
    rows = [line.split("│")[1:-1] for line in drawn.getvalue().splitlines() if f" {name} " in line]
    return [cell.strip() for cell in rows[0]]


def serve_one(client: RolloutClient, prompt_id: str, version: int, weights: dict[int, Path]) -> None:
    """Submit one prompt, collect its group, and check it is all of `version`, with that version's logprobs."""
    client.submit(tokens=[7, 8, 9, len(prompt_id)], n=2, max_tokens=16, id=prompt_id, seed=1)
    (group,) = client.collect(1, timeout=240)
    for rollout in group.rollouts:
        assert rollout.spans == [(version, 0, rollout.n_tokens)]
        check_spans_and_logprobs(rollout, weights)


@pytest.mark.parametrize(
    "engine",
    ["torch", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.long("the same with the torch engine")])],
)
def test_a_lazy_worker_starts_on_the_first_prompt_releases_when_idle_and_serves_a_sync_made_while_released(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    engine: str,
    one_thread: None,
) -> None:
    port = free_port()
    flags = ("--engine", engine, "--lazy", "--release-after-s", "2", "--metrics-port", str(port))
    process = workers("lazy", *flags, until="idle")
    client = RolloutClient(redis_server.url, ns)
    metrics = lambda: scrape(port)  # noqa: E731

    # Registered, beating, and no engine: no model loaded, no engine process.
    assert heartbeat(client, "lazy")["engine_starts"] == "0"
    assert value(metrics(), "rollouts_engine_up") == 0 and value(metrics(), "rollouts_engine_starts_total") == 0
    assert engine_processes(process.pid) == []

    # The first prompt starts it; what it serves is the model's own version 0.
    serve_one(client, "first", 0, {0: tiny_model_dir})
    beat = heartbeat(client, "lazy")
    assert beat["engine_starts"] == "1" and float(beat["cold_start_s"]) > 0
    assert value(metrics(), "rollouts_engine_starts_total", why="demand") == 1
    assert bool(engine_processes(process.pid)) == (engine == "vllm")

    # Two seconds without work: released, its processes gone.
    status = lambda: heartbeat(client, "lazy")["status"]  # noqa: E731
    wait_until(lambda: status() == "released", 60, "the idle engine to be released")
    wait_until(lambda: engine_processes(process.pid) == [], 60, "the engine's processes to exit")
    assert value(metrics(), "rollouts_engine_up") == 0 and value(metrics(), "rollouts_engine_releases_total") == 1

    # A sync while released is acked at once, with nothing started for it.
    assert client.publish_weights(tiny_model_dir_v1, transport="redis://") == 1
    assert client.last_sync is not None
    assert client.last_sync.acked == ["lazy"] and client.last_sync.evicted == []
    beat = heartbeat(client, "lazy")
    assert (beat["status"], beat["engine_starts"], beat["version"]) == ("released", "1", "1")

    # The next prompt starts it again, at the new version.
    serve_one(client, "second", 1, {1: tiny_model_dir_v1})
    assert value(metrics(), "rollouts_engine_starts_total", why="demand") == 2

    # Released again, it stops cleanly (SIGTERM), as a serving worker does.
    wait_until(lambda: status() == "released", 60, "the second release")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert not client.streams.redis.exists(client.streams.keys.worker("lazy"))


def test_a_lazy_worker_receives_an_nccl_broadcast_without_an_engine_and_serves_it_at_start(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    one_thread: None,
) -> None:
    workers("lazy", "--lazy", until="idle")
    client = RolloutClient(redis_server.url, ns)
    nccl = f"nccl://127.0.0.1:{free_port()}"
    assert client.publish_weights(tiny_model_dir_v1, transport=nccl) == 1
    assert client.last_sync is not None
    assert client.last_sync.acked == ["lazy"] and client.last_broadcast is not None
    assert client.last_broadcast.workers == 1  # it joined (one rank of its own) and kept a CPU copy
    beat = heartbeat(client, "lazy")
    assert (beat["status"], beat["engine_starts"], beat["version"]) == ("idle", "0", "1")
    assert top_row(client, "lazy")[:5] == ["lazy", "idle", "torch", "0", "1"]

    serve_one(client, "after", 1, {1: tiny_model_dir_v1})
    assert top_row(client, "lazy")[:3] == ["lazy", "serving", "torch"]
    assert top_row(client, "lazy")[3].startswith("1 (")  # one start, and how long it took
    # Its version came by broadcast, and the copy is kept: the next one works as well, engine and all.
    assert client.publish_weights(tiny_model_dir, transport=nccl) == 2
    assert client.last_sync is not None
    assert client.last_sync.acked == ["lazy"]
    serve_one(client, "later", 2, {2: tiny_model_dir})


FREEZES = """
import asyncio, gc, json, sys, time, weakref
from consumers.lifecycle import WorkerStatus
from consumers.engines.synthetic_engine import SyntheticEngine
from consumers.worker import Worker, WorkerSettings
from pipeline.connections import connect
from pipeline.streams import Streams
from producers.client import RolloutClient

async def until(condition, what, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)

async def main(url, ns):
    built = []
    def factory():
        engine = SyntheticEngine(steps_per_s=1000)
        engine.itself = engine  # a cycle: once dropped, only the collector frees it
        built.append(weakref.ref(engine))
        return engine
    settings = WorkerSettings(lazy=True, release_after_s=0.3, heartbeat_s=0.1, freeze_heap=True)
    worker = Worker(Streams(connect(url, ns=ns), ns), factory(), "w", settings, factory=factory)
    task = asyncio.create_task(worker.run())
    client = RolloutClient(url, ns)
    seen = {"idle": gc.get_freeze_count()}
    for round in range(2):
        await asyncio.to_thread(client.submit, tokens=[1, 2, 3], n=1, max_tokens=4, id=f"p{round}")
        await asyncio.to_thread(client.collect, 1, 60)
        seen[f"serving {round}"] = gc.get_freeze_count()
        await until(lambda: worker.state.status is WorkerStatus.RELEASED, "a release")
        await until(lambda: worker._slot._stopped.done(), "the released engine's shutdown")
        gc.collect()
        seen[f"released {round}"] = gc.get_freeze_count()
    seen["engines built"], seen["engines alive"] = len(built), sum(ref() is not None for ref in built)
    worker.stop()
    await task
    print(json.dumps(seen))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_worker_of_its_own_process_freezes_the_heap_while_its_engine_is_up_and_frees_each_released_engine(
    redis_server: RedisServer, ns: str
) -> None:
    """`freeze_heap` (what `rollouts worker` sets): once the engine is up, Python's full collections skip what exists
    then (`gc.freeze`: with vLLM loaded one took ~0.5 s, the worker's loop standing still); a release unfreezes, so a
    released engine, even one held in a reference cycle, is freed. In a process of its own: freezing is process-wide."""
    done = subprocess.run(
        [sys.executable, "-c", FREEZES, redis_server.url, ns], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["idle"] == 0, seen  # no engine yet: nothing frozen
    assert seen["serving 0"] > 0 and seen["serving 1"] > 0, seen
    assert seen["released 0"] == 0 and seen["released 1"] == 0, seen
    assert seen["engines built"] == 3 and seen["engines alive"] == 1, seen  # only the fresh, unstarted one is left

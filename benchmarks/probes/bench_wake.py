"""How long one control command holds Redis up when a fleet is blocked waiting for it: one stream, or bells in waves.

    python benchmarks/probes/bench_wake.py --readers 1000 --trials 7        # JSON on stdout

`readers` connections stand for a fleet's workers, each blocked in an `XREAD BLOCK` as a worker waits for control:
- `control`: all of them on `{ns}:control` (how workers waited until 2026-11-25); the command is one `XADD` there;
- `bells`: each on its doorbell (`{ns}:bell:K` of its name, `pipeline.control.bell_index`), registered as a worker;
  the command is `ControlStream.send`: the `XADD` to `control`, then `ControlStream.ring`, a wave of bells at a time.
Meanwhile a probe connection sends `PING`s one after another, as any other client (a publishing worker) would send
its commands, and every reader's reply is timestamped as it arrives. Per trial: the probe's slowest and p99 round
trip in the window (from the command until every reader was answered, plus 20 ms), and when the first and the last
reader was answered. The two modes alternate; medians of the trials, and their ratios, are printed.
"""

from __future__ import annotations

import argparse
import json
import selectors
import statistics
import threading
import time
import uuid
from typing import Any

import redis
from rich.console import Console
from rich.progress import Progress

from pipeline.control import bell_index
from pipeline.local import RedisServer
from pipeline.streams import Streams
from pipeline.wire import Control

MODES = ("control", "bells")
TAIL_S = 0.02
"""The probe keeps timing for this long after the last reader was answered."""


class Fleet:
    """`n` blocked readers on connections of their own (no thread each), standing for a fleet of workers."""

    def __init__(self, url: str, streams: Streams, n: int) -> None:
        self.streams = streams
        self.names = [f"worker-{i}" for i in range(n)]
        pool = redis.ConnectionPool.from_url(url, max_connections=n)
        self.connections: list[redis.connection.AbstractConnection] = [pool.get_connection() for _ in range(n)]
        self.arrived: list[float] = []

    def block(self, mode: str) -> None:
        keys, last_ids = self.streams.keys, {}
        for name, connection in zip(self.names, self.connections, strict=True):
            key = keys.control if mode == "control" else keys.bell(bell_index(name))
            if key not in last_ids:  # one look per stream, not per reader
                last = self.streams.redis.xrevrange(key, count=1)
                last_ids[key] = last[0][0] if last else "0-0"
            connection.send_command("XREAD", "BLOCK", 0, "STREAMS", key, last_ids[key])

    def watch(self, done: threading.Event) -> threading.Thread:
        """Timestamp each reader's reply as its socket becomes readable (on a thread); the replies are read after."""
        self.arrived = []

        def run() -> None:
            selector = selectors.DefaultSelector()
            for index, connection in enumerate(self.connections):
                assert connection._sock is not None  # connected: `block` sent its XREAD
                selector.register(connection._sock, selectors.EVENT_READ, index)  # redis-py's socket: a benchmark may
            pending = len(self.connections)
            while pending and not done.is_set():
                for key, _ in selector.select(timeout=0.5):
                    self.arrived.append(time.perf_counter())
                    selector.unregister(key.fileobj)
                    pending -= 1
            selector.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def read_replies(self) -> None:
        for connection in self.connections:
            connection.read_response()

    def close(self) -> None:
        for connection in self.connections:
            connection.disconnect()


def trial(fleet: Fleet, probe: redis.Redis, mode: str, readers: int) -> dict[str, float]:
    """One command to a blocked fleet, timed from the probe's side and the readers'."""
    fleet.block(mode)
    wait_blocked(probe, readers)
    done = threading.Event()
    watcher = fleet.watch(done)
    command = Control(cmd="resume", epoch=1, version=1)
    sender = threading.Thread(target=fleet.streams.control.send, args=(command, mode == "bells"))
    pings: list[float] = []
    started = time.perf_counter()
    sender.start()
    while len(fleet.arrived) < readers or time.perf_counter() - fleet.arrived[-1] < TAIL_S:
        sent = time.perf_counter()
        probe.ping()
        pings.append(time.perf_counter() - sent)
        if time.perf_counter() - started > 30:
            break
    sender.join()
    done.set()
    watcher.join()
    fleet.read_replies()
    pings.sort()
    return {
        "probe_max_ms": pings[-1] * 1e3,
        "probe_p99_ms": pings[int(0.99 * (len(pings) - 1))] * 1e3,
        "probe_p50_ms": pings[len(pings) // 2] * 1e3,
        "pings": len(pings),
        "first_answered_ms": (min(fleet.arrived) - started) * 1e3,
        "last_answered_ms": (max(fleet.arrived) - started) * 1e3,
        "answered": len(fleet.arrived),
    }


def wait_blocked(client: redis.Redis, readers: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while int(client.info("clients")["blocked_clients"]) < readers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {client.info('clients')['blocked_clients']} of {readers} readers blocked")
        time.sleep(0.01)  # the poll interval of this deadline wait


def idle_probe(probe: redis.Redis, n: int = 2000) -> dict[str, float]:
    """The probe's round trips with nothing else happening: the floor the trials compare with."""
    pings = []
    for _ in range(n):
        sent = time.perf_counter()
        probe.ping()
        pings.append(time.perf_counter() - sent)
    pings.sort()
    return {"probe_max_ms": pings[-1] * 1e3, "probe_p99_ms": pings[int(0.99 * (n - 1))] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readers", type=int, default=1000, help="blocked readers: the fleet's workers")
    parser.add_argument("--trials", type=int, default=7, help="trials per mode, alternated")
    args = parser.parse_args()
    console = Console(stderr=True)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        streams = Streams(client, f"wake{uuid.uuid4().hex[:6]}")
        client.sadd(streams.keys.workers, *[f"worker-{i}" for i in range(args.readers)])  # the fleet `ring` sees
        fleet = Fleet(server.url, streams, args.readers)
        probe = redis.Redis.from_url(server.url)
        rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"{args.readers} readers", total=args.trials * len(MODES))
            for index in range(args.trials):
                for mode in MODES if index % 2 == 0 else MODES[::-1]:
                    rows[mode].append(trial(fleet, probe, mode, args.readers))
                    print(json.dumps({"mode": mode, "trial": index, **rows[mode][-1]}), flush=True)
                    progress.advance(task)
        result: dict[str, Any] = {"readers": args.readers, "trials": args.trials, "redis": server.version}
        result["idle"] = idle_probe(probe)
        for mode in MODES:
            result[mode] = {key: statistics.median(row[key] for row in rows[mode]) for key in rows[mode][0]}
        result["probe_max_ratio"] = result["control"]["probe_max_ms"] / result["bells"]["probe_max_ms"]
        result["last_answered_ratio"] = result["bells"]["last_answered_ms"] / result["control"]["last_answered_ms"]
        fleet.close()
        print(json.dumps(result))


if __name__ == "__main__":
    main()

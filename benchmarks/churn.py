"""`rollouts-bench churn`: an elastic fleet under churn (issue 66 item 6), against a steady fleet of the same size.

Two phases of `duration_s` each on a private `redis-server`, a backlog of prompts kept waiting (synthetic workers,
each `rollouts worker` a process of its own, samples of a few seconds) and a reader that takes every group:

1. **steady**: `workers` workers, nothing happens to them;
2. **churn**: the same start, then every `every_s` one event: a stop **notice** (SIGTERM to a worker started with
   `--grace-s`: it must exit inside it, handing what would not finish to `{ns}:partials`), a **kill** (`kill -9`), or,
   to move the fleet between `min_workers` and `max_workers`, a **join** (a worker more) or a **leave** (a notice with
   no replacement). A worker that got a notice or was killed is replaced after `rejoin_s` by a new one (a join).

Then both drain: every submitted prompt must arrive. Reported (JSON on stdout, progress on stderr): samples lost and
delivered twice (both 0), each notice's time to exit against its deadline (`over_deadline`: 0), join to serving
(process start to its heartbeat's `serving`) and the path each join took (`join_paths`: `peer`, `store`, `sync`, or
`none` where there was no version to load, as with these synthetic workers and no trainer), the tokens the leaving
workers generated beside what they published and handed off (a notice throws nothing away:
`notice_tokens_thrown_away` 0), and the delivered tokens a second of each phase, with the mean number of live
workers, and their ratio (issue 66's goal: >= 0.85).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.codec import as_text
from pipeline.processes import start_command, stop_process
from rollouts.app import console, fail, user_errors

NS = "churn"
EVENTS = ("notice", "kill", "join", "leave")
EXITED = re.compile(r"worker (\S+) stopped after publishing \d+ rollouts and generating (\d+) tokens")


@dataclass
class Incarnation:
    name: str
    process: Any
    started: float
    serving_at: float | None = None
    noticed_at: float | None = None
    exited_at: float | None = None
    killed: bool = False
    joined_from: str = ""
    """Where its version came from (its heartbeat's `joined_from`: `peer:NAME`, `store`, `sync`; "": none to load)."""


@dataclass
class Phase:
    name: str
    tokens: int = 0
    samples: int = 0
    sizes: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


class Fleet:
    """The workers of one phase, the backlog, and the reader."""

    def __init__(self, url: str, tmp: Path, o: dict[str, Any], phase: Phase) -> None:
        from producers.client import RolloutClient

        self.url, self.tmp, self.o, self.phase = url, tmp, o, phase
        self.ns = f"{NS}-{phase.name}"
        self.client = RolloutClient(url, self.ns)
        self.reader = RolloutClient(url, self.ns)
        self.rng = random.Random(o["seed"])
        self.live: dict[str, Incarnation] = {}
        self.gone: list[Incarnation] = []
        self.rejoins: list[float] = []
        self.submitted: set[str] = set()
        self.received: dict[str, int] = {}
        self.duplicates = 0
        self.count = 0
        self.lock = threading.Lock()
        self.reading = threading.Thread(target=self._read, daemon=True)
        self.stopped = threading.Event()

    def spawn(self) -> None:
        self.count += 1
        name = f"{self.phase.name}-w{self.count}"
        engine = json.dumps({"steps_per_s": self.o["steps_per_s"], "lengths": f"uniform:{self.o['tokens'] // 2}-"
                             f"{self.o['tokens']}"})  # fmt: skip
        args = ["worker", "--redis", self.url, "--ns", self.ns, "--model", "synthetic", "--engine", "synthetic",
                "--engine-args", engine, "--name", name, "--grace-s", str(self.o["grace_s"]), "--heartbeat-s", "0.5",
                "--claim-idle-ms", "3000", "--max-inflight", str(self.o["max_inflight"])]  # fmt: skip
        process = start_command(*args, log_file=self.tmp / f"{name}.log")
        self.live[name] = Incarnation(name, process, time.monotonic())

    def _read(self) -> None:
        for group in self.reader.groups(timeout=None):
            with self.lock:
                for rollout in group.rollouts:
                    self.received[rollout.id] = self.received.get(rollout.id, 0) + 1
                    if self.received[rollout.id] > 1:
                        self.duplicates += 1
                    self.phase.tokens += len(rollout.tokens)
                    self.phase.samples += 1
            if self.stopped.is_set():
                return

    def top_up(self) -> None:
        """Keep `backlog` prompts submitted and not yet whole."""
        with self.lock:
            done = {rid.rsplit(":", 1)[0] for rid in self.received}
        waiting = len(self.submitted - done)
        for _ in range(max(0, self.o["backlog"] - waiting)):
            prompt_id = self.client.submit(tokens=[5, 9, self.rng.randrange(10, 60)], n=self.o["n"],
                                           max_tokens=self.o["tokens"], seed=self.rng.randrange(1 << 30))  # fmt: skip
            self.submitted.add(prompt_id)

    def watch(self) -> None:
        """Note who serves, who exited; start the replacements that are due."""
        now = time.monotonic()
        for name, inc in list(self.live.items()):
            key = self.reader.streams.keys.worker(name)
            status, joined = self.reader.streams.redis.hmget(key, ["status", "joined_from"])
            if inc.serving_at is None and status == b"serving":
                inc.serving_at = now
                inc.joined_from = as_text(joined or b"").split(":")[0]
            if inc.process.poll() is not None:
                inc.exited_at = inc.exited_at or now
                self.gone.append(self.live.pop(name))
        for due in [t for t in self.rejoins if t <= now]:
            self.rejoins.remove(due)
            self.spawn()
        self.phase.sizes.append(sum(inc.serving_at is not None for inc in self.live.values()))

    def event(self, t: float) -> None:
        serving = [inc for inc in self.live.values() if inc.serving_at is not None and inc.noticed_at is None]
        size = len(self.live) + len(self.rejoins)
        kinds = ["notice", "kill"] + (["join"] if size < self.o["max_workers"] else [])
        kinds += ["leave"] if size > self.o["min_workers"] else []
        kind = self.rng.choice(kinds)
        if kind == "join":
            self.spawn()
        elif serving:
            inc = self.rng.choice(serving)
            if kind == "kill":
                inc.killed = True
                inc.process.kill()
            else:
                inc.noticed_at = time.monotonic()
                inc.process.send_signal(signal.SIGTERM)
            if kind != "leave":
                self.rejoins.append(time.monotonic() + self.o["rejoin_s"])
        self.phase.events.append({"t": round(t, 2), "kind": kind})

    def run(self, churn: bool, progress: Any) -> None:
        for _ in range(self.o["workers"]):
            self.spawn()
        self.reading.start()
        began = time.monotonic()
        while sum(inc.serving_at is not None for inc in self.live.values()) < self.o["workers"]:
            self.watch()
            if time.monotonic() - began > 240:
                raise TimeoutError("the fleet did not start within 240 s")
            time.sleep(0.1)
        with self.lock:
            self.phase.tokens = self.phase.samples = 0
        self.phase.sizes = []
        began = time.monotonic()
        next_event = began + self.o["every_s"]
        while (t := time.monotonic() - began) < self.o["duration_s"]:
            self.top_up()
            self.watch()
            if churn and time.monotonic() >= next_event:
                self.event(t)
                next_event += self.o["every_s"]
            progress(f"{self.phase.name} {t:5.1f} s · {len(self.live)} workers · {self.phase.samples} samples")
            time.sleep(0.1)
        self.phase.sizes = self.phase.sizes or [0]
        self.elapsed = time.monotonic() - began
        self.rate = self.phase.tokens / self.elapsed

    def drain(self, timeout_s: float, progress: Any) -> None:
        """Every submitted prompt whole, or `TimeoutError`."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.watch()
            with self.lock:
                missing = {f"{p}:{k}" for p in self.submitted for k in range(self.o["n"])} - set(self.received)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(missing)} samples of phase {self.phase.name} never arrived")
            progress(f"{self.phase.name} draining · {len(missing)} samples to come")
            time.sleep(0.2)

    def stop(self) -> None:
        self.stopped.set()
        for inc in self.live.values():
            stop_process(inc.process, timeout_s=30)
            self.gone.append(inc)
        self.live.clear()

    def report(self) -> dict[str, Any]:
        exits = [inc.exited_at - inc.noticed_at for inc in self.gone if inc.noticed_at and inc.exited_at]
        served = [inc for inc in [*self.gone, *self.live.values()] if inc.serving_at]
        joins = [inc.serving_at - inc.started for inc in served if inc.serving_at]
        generated = 0
        for inc in self.gone:
            if inc.noticed_at is not None:
                log = (self.tmp / f"{inc.name}.log").read_text(errors="replace")
                generated += sum(int(m.group(2)) for m in EXITED.finditer(log))
        handed = self.client.streams.redis.xinfo_stream(self.client.streams.keys.partials)["entries-added"]
        return {
            "tokens_per_s": round(self.rate, 1),
            "mean_live_workers": round(statistics.fmean(self.phase.sizes), 2),
            "samples": self.phase.samples,
            "lost": sum(1 for p in self.submitted for k in range(self.o["n"]) if f"{p}:{k}" not in self.received),
            "duplicates": self.duplicates,
            "events": {k: sum(e["kind"] == k for e in self.phase.events) for k in EVENTS},
            "notice_exit_s": _spread(exits),
            "over_deadline": sum(s > self.o["grace_s"] for s in exits),
            "join_to_serving_s": _spread(joins),
            "join_paths": dict(Counter(inc.joined_from or "none" for inc in served)),
            "partials_handed_off": int(handed),
            "noticed_generated_tokens": generated,
        }


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def churn(
    duration_s: Annotated[float, typer.Option(help="Seconds of each phase (steady, then churn).")] = 60.0,
    workers: Annotated[int, typer.Option(help="Workers at the start of each phase.")] = 4,
    min_workers: Annotated[int, typer.Option(help="The churn never leaves fewer.")] = 3,
    max_workers: Annotated[int, typer.Option(help="The churn never starts more.")] = 6,
    every_s: Annotated[float, typer.Option(help="Seconds between events.")] = 10.0,
    grace_s: Annotated[float, typer.Option(help="A notice's deadline (the workers' --grace-s).")] = 5.0,
    rejoin_s: Annotated[float, typer.Option(help="A replacement starts this long after a notice or a kill.")] = 1.0,
    n: Annotated[int, typer.Option(help="Samples per prompt.")] = 4,
    tokens: Annotated[int, typer.Option(help="Tokens per sample, at most (uniform from half of it).")] = 200,
    steps_per_s: Annotated[float, typer.Option(help="Synthetic engine pace: tokens a second per sample.")] = 50.0,
    max_inflight: Annotated[int, typer.Option(help="Samples a worker holds at once.")] = 32,
    backlog: Annotated[int, typer.Option(help="Prompts kept submitted and not yet whole.")] = 64,
    drain_timeout_s: Annotated[float, typer.Option(help="After a phase: stalled if not all arrived within.")] = 120.0,
    seed: Annotated[int, typer.Option(help="The events' seed.")] = 0,
) -> None:
    """An elastic fleet under notices, kills, joins and leaves, against a steady one: samples lost or delivered twice,
    notice-to-exit against the deadline, join-to-serving, and the throughput ratio; JSON out, exit 1 unless nothing
    was lost, duplicated or late."""
    o = dict(locals())
    if not 1 <= min_workers <= workers <= max_workers:
        fail(f"need 1 <= --min-workers ({min_workers}) <= --workers ({workers}) <= --max-workers ({max_workers})")
    from rich.live import Live

    from pipeline.local import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="rollouts-churn-"))
    server = RedisServer()
    with user_errors():
        server.start()
    result: dict[str, Any] = {"options": o}
    try:
        with Live(console=console, transient=True) as live:
            for name, churning in (("steady", False), ("churn", True)):
                phase = Fleet(server.url, tmp, o, Phase(name))
                try:
                    phase.run(churning, live.update)
                    phase.drain(drain_timeout_s, live.update)
                finally:
                    phase.stop()
                result[name] = phase.report()
    except TimeoutError as exc:
        fail(str(exc))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    steady, churned = result["steady"], result["churn"]
    result["throughput_ratio"] = round(churned["tokens_per_s"] / max(steady["tokens_per_s"], 1e-9), 3)
    per_worker = churned["tokens_per_s"] / max(churned["mean_live_workers"], 1e-9)
    result["per_worker_ratio"] = round(per_worker / max(steady["tokens_per_s"] / steady["mean_live_workers"], 1e-9), 3)
    result["ok"] = all(result[p]["lost"] == 0 and result[p]["duplicates"] == 0 for p in ("steady", "churn")) and (
        churned["over_deadline"] == 0
    )
    print(json.dumps(result, indent=2))
    if not result["ok"]:
        raise typer.Exit(1)

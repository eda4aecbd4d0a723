"""`rollouts scale`: how many workers one Redis carries, at realistic per-worker rates.

For each fleet size in `--workers` (side by side, one run, one Redis, the namespace emptied between sizes) it
starts the fleet as `--procs` processes of `rollouts scale-fleet` (real `Worker`s on the synthetic engine, each
with its own connections, heartbeat, registry entry and consumer name), and in this process the producer and
the trainer of `rollouts soak` (prompts kept `window` samples ahead of what was received; whole batches taken
and acked) and a thread that publishes weights every `--sync-every-s` (the `fs://` transport with a one-number
state dict: the synthetic engine reads nothing, so the stall is the protocol's: pause, ack, resume).

Per size, over the `--measure-s` after a `--warmup-s` (Redis's statistics are reset when it begins):
- publish latency: the client's p50/p99 of the publish script call (`scale_fleet.TimedStreams`) over every worker
  (it includes queueing in the crowded fleet processes), of the probe (one worker alone in its process, as
  deployed: Redis's queueing and the loopback) and, on Redis >= 7, the server's (`INFO latencystats`, EVALSHA);
- sync stall p50/max (`SyncReport.stall_s`: from the `weights` command to the `resume`), and evictions;
- Redis CPU in cores (`INFO cpu` user+sys deltas over wall time: median and max of the readings), its
  connected clients and `used_memory`; the fleet's and this process's CPU, since they share the machine;
- rollouts/s received against the rate asked for (`workers x --rate`).

A size whose fleet did not come up (every worker heartbeating within 60 s + 0.1 s a worker) is reported with
`failed` and the reason, and the run goes on. `saturated` marks such a size, or one where Redis used >= 0.9 of
a core or the probe's p99 passed 5 ms (`P99_GOAL_MS`).
One JSON object on stdout, `--plot` a PNG; progress on stderr.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import numpy as np
import redis
import typer

from benchmarks import PROGRAM
from benchmarks.cpu import cpu_seconds, pin
from benchmarks.soak import Producer, Tally, rss_bytes
from pipeline.lua import register_all
from pipeline.processes import start_command, stop_process
from pipeline.streams import SCRIPTS as STREAM_SCRIPTS
from pipeline.wire import PauseMode, is_pause_mode
from rollouts.app import console, fail, user_errors

if TYPE_CHECKING:
    from rich.console import Console

    from producers.client import RolloutClient

PING_EVERY_S = 0.02
"""How often the pinger publishes (`Pinger`): 50 groups a second, ~1,000 timed publishes in a 20 s window."""
SLOWLOG_OVER_US = 2000
"""`rollouts scale` lists the commands that ran longer than this on its Redis (`redis_slow_commands`)."""
P99_GOAL_MS = 5.0
"""The issue's goal for the publish p99 at 1,000 workers; a size above it counts as saturated."""
WORKERS_PER_PROC = 16
"""`--procs 0` (the default) spreads a fleet at about this many workers a process: with ~67 a process the fleet's own
queueing made the abort-mode tail at 1,000 workers, with ~17 it did not (README, *Fewer workers to a process*)."""
PROCS_PER_CORE = 4
"""...and at most this many fleet processes a core, so that a small machine is not asked for 63 interpreters."""


def fleet_procs(workers: int, procs: int, cores: int) -> int:
    """How many fleet processes `workers` are spread over: `procs`, or with 0 about `WORKERS_PER_PROC` workers each
    (at most `PROCS_PER_CORE` a core); never more than there are workers."""
    if procs <= 0:
        procs = min(math.ceil(workers / WORKERS_PER_PROC), PROCS_PER_CORE * cores)
    return max(1, min(procs, workers))


class Cores(NamedTuple):
    """Where `rollouts scale --redis-cores` puts its processes."""

    redis: set[int]
    measure: set[int]
    """One core for the probe and the pinger: their latency is Redis's and the loopback's, not a crowded core's."""
    rest: set[int]
    """The fleet, this process (the trainer, the producer, the syncs) and everything they start."""


def split_cores(allowed: set[int], redis_cores: int) -> Cores | None:
    """Redis's cores (the last `redis_cores` of `allowed`), the one before them for the measuring processes, and the
    rest; None when `redis_cores` is 0 or fewer than 2 cores would be left for the rest."""
    ordered = sorted(allowed)
    if redis_cores < 1 or len(ordered) < redis_cores + 3:
        return None
    return Cores(set(ordered[-redis_cores:]), {ordered[-redis_cores - 1]}, set(ordered[: -redis_cores - 1]))


@dataclass
class Load:
    """What one fleet size asks for."""

    workers: int
    rate: float
    """Rollouts per second per worker."""
    tokens: int
    n: int
    max_inflight: int
    procs: int
    warmup_s: float
    measure_s: float
    sync_every_s: float
    sample_s: float = 1.0
    batch_groups: int = 16
    pause_mode: PauseMode = "abort"
    """How workers pause for a sync: `abort` (in-flight samples go back as partials) or `keep`."""
    lengths: str = "max"
    """The synthetic engine's lengths (`max`: every sample `tokens` long, so a fleet finishes in lockstep;
    `uniform:LOW-HIGH`, `pareto:ALPHA`: varied, capped at `tokens`)."""

    @property
    def engine_args(self) -> dict[str, Any]:
        """A synthetic engine that finishes `rate` rollouts/s: `max_inflight` samples, `tokens` each, at once."""
        return {"steps_per_s": self.rate * self.tokens / self.max_inflight, "lengths": self.lengths,
                "max_batch": self.max_inflight}  # fmt: skip


@dataclass
class Readings:
    """Redis and process CPU, sampled beside the run."""

    t: list[float] = field(default_factory=list)
    redis_cpu_s: list[float] = field(default_factory=list)
    fleet_cpu_s: list[float] = field(default_factory=list)
    used_memory: list[int] = field(default_factory=list)
    clients: list[int] = field(default_factory=list)


class Sampler(threading.Thread):
    """Every `every_s`: Redis's CPU, memory and clients (`INFO`), and the fleet processes' CPU."""

    def __init__(self, url: str, fleet: list[int], every_s: float) -> None:
        super().__init__(name="scale-sampler", daemon=True)
        self.client = redis.Redis.from_url(url)
        self.fleet, self.every_s = fleet, every_s
        self.readings = Readings()
        self._halt = threading.Event()

    def read(self) -> None:
        info = self.client.info()
        r = self.readings
        r.t.append(time.monotonic())
        r.redis_cpu_s.append(redis_cpu_s(info))
        r.fleet_cpu_s.append(sum(cpu_seconds(pid) for pid in self.fleet))
        r.used_memory.append(int(info["used_memory"]))
        r.clients.append(int(info["connected_clients"]))

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            with contextlib.suppress(redis.RedisError):
                self.read()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
        self.client.close()


class Syncer(threading.Thread):
    """Publishes weights every `every_s` through its own client, as a trainer's step would, and keeps the reports."""

    def __init__(self, url: str, ns: str, every_s: float, weights_dir: Path, mode: PauseMode = "abort") -> None:
        super().__init__(name="scale-syncer", daemon=True)
        self.url, self.ns, self.every_s, self.weights_dir, self.mode = url, ns, every_s, weights_dir, mode
        self.reports: list[tuple[float, float, int, int]] = []
        """(monotonic time it began, stall seconds, workers acked, workers evicted)."""
        self.windows: list[tuple[float, float]] = []
        """(wall time it began, wall time its resume was rung to every worker) of every sync: to tell publishes made
        during one apart."""
        self.costs: list[SyncCost] = []
        """What Redis did during every sync (`server_during_syncs`), read by `INFO` before and after each."""
        self.failure: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        import torch

        from producers.client import RolloutClient

        client = RolloutClient(self.url, self.ns)
        weights = {"w": torch.zeros(1)}
        try:
            due = time.monotonic() + self.every_s
            while not self._halt.wait(max(0.0, due - time.monotonic())):  # every `every_s` from start to start
                before = server_counters(client.streams.redis)
                began, began_wall = time.monotonic(), time.time()
                due = began + self.every_s
                client.publish_weights(weights, transport=f"fs://{self.weights_dir}", mode=self.mode)
                client.settle()  # the window of a sync ends once its resume has been rung to the whole fleet
                ended = time.monotonic()
                sync = client.last_sync
                if sync is not None:
                    self.reports.append((began, sync.stall_s, len(sync.acked), len(sync.evicted)))
                    self.windows.append((began_wall, time.time()))
                    spent = counters_since(before, server_counters(client.streams.redis))
                    self.costs.append(SyncCost(began, ended - began, spent))
        except Exception as exc:  # reported in the result
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            client.streams.redis.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=120)


class Pinger(threading.Thread):
    """A publish every `every_s` on a namespace of its own beside the fleet's (`{ns}ping`): a group of `n` rollouts
    of `tokens` through the publish script with its prompt's ack, timed. What Redis makes a publish wait under the
    fleet's load, over hundreds of publishes a window (the probe worker makes 15-20). Its rollouts are trimmed away
    as it goes, so it adds little to Redis's memory. `rollouts scale` runs it in a process of its own
    (`rollouts scale-ping`), so that no GIL of the trainer's decoding or the fleet's workers is in its figures."""

    def __init__(self, url: str, ns: str, n: int, tokens: int, every_s: float = PING_EVERY_S) -> None:
        super().__init__(name="scale-pinger", daemon=True)
        self.url, self.ns, self.n, self.tokens, self.every_s = url, f"{ns}ping", n, tokens, every_s
        self.publishes: list[tuple[float, float]] = []
        """(wall time, milliseconds) of every publish."""
        self._halt = threading.Event()

    def run(self) -> None:
        from benchmarks.bench_broker import Shape, build_rollout, make_samples, take_prompts
        from producers.client import RolloutClient

        streams = RolloutClient(self.url, self.ns).streams
        shape = Shape(rollouts=self.n * 256, n=self.n, tokens=self.tokens, batch_groups=1)
        samples = make_samples(shape)
        work: list[Any] = []
        try:
            while not self._halt.wait(self.every_s):
                if not work:  # 256 prompts queued and read as a worker reads them, untimed
                    work = take_prompts(streams, shape, samples, f"ping{len(self.publishes)}")
                    streams.redis.xtrim(streams.keys.rollouts, maxlen=0)
                entry, prompt = work.pop()
                rollouts = [build_rollout(prompt, i, samples[i], "pinger") for i in range(self.n)]
                started = time.perf_counter()
                streams.writer.publish_rollouts(rollouts, entry)
                self.publishes.append((time.time(), (time.perf_counter() - started) * 1000))
        finally:
            streams.redis.close()

    def halt(self) -> None:
        """Make `run` return after the publish under way (safe from a signal handler)."""
        self._halt.set()

    def stop(self) -> None:
        self.halt()
        self.join(timeout=30)


def scale_ping(
    redis_url: Annotated[str, typer.Option("--redis")],
    ns: Annotated[str, typer.Option()],
    out: Annotated[Path, typer.Option()],
    n: Annotated[int, typer.Option()] = 4,
    tokens: Annotated[int, typer.Option()] = 1024,
    every_s: Annotated[float, typer.Option()] = PING_EVERY_S,
) -> None:
    """Run a `Pinger` until SIGTERM, then write its publishes to `--out` as JSON (see `rollouts scale`)."""
    pinger = Pinger(redis_url, ns, n, tokens, every_s)
    signal.signal(signal.SIGTERM, lambda *_: pinger.halt())
    pinger.run()  # in this thread: returns once SIGTERM sets the halt
    out.write_text(json.dumps({"publishes": pinger.publishes}))


def start_pinger(url: str, ns: str, load: Load, tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp / f"ping{load.workers}.json"
    args = ["scale-ping", "--redis", url, "--ns", ns, "--out", str(out), "--n", str(load.n)]
    log = tmp / f"ping{load.workers}.log"
    return start_command(*args, "--tokens", str(load.tokens), log_file=log, module=PROGRAM), out


def stop_pinger(pinger: tuple[subprocess.Popen[bytes], Path]) -> list[tuple[float, float]]:
    process, out = pinger
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    stop_process(process, timeout_s=30)
    return [(float(t), float(ms)) for t, ms in json.loads(out.read_text())["publishes"]] if out.exists() else []


def start_fleet(url: str, ns: str, load: Load, tmp: Path) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """`load.procs` processes of `rollouts scale-fleet` for all workers but one, split evenly, and the probe: the last
    worker alone in a process, as workers are deployed, so that its publish latency is Redis's and the loopback's,
    not the crowded fleet processes' own queueing. Each process comes with its result file."""
    fleet = []
    crowd = np.array_split(np.arange(load.workers - 1), load.procs)
    for k, share in enumerate([*(s for s in crowd if len(s)), np.array([load.workers - 1])]):
        out = tmp / f"fleet{k}.json"
        args = ["scale-fleet", "--redis", url, "--ns", ns, "--first", str(int(share[0])), "--count", str(len(share))]
        args += ["--engine-args", json.dumps(load.engine_args), "--max-inflight", str(load.max_inflight)]
        fleet.append((start_command(*args, "--out", str(out), log_file=tmp / f"fleet{k}.log", module=PROGRAM), out))
    return fleet


def wait_for_fleet(client: RolloutClient, load: Load, fleet: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    """Until every worker heartbeats `serving` (a fleet process that dies fails the run with its log)."""
    budget_s = 60 + load.workers * 0.1
    deadline = time.monotonic() + budget_s
    while True:
        live = client.streams.registry.live_workers()
        if sum(1 for beat in live.values() if beat.get("status") == "serving") >= load.workers:
            return
        for process, out in fleet:
            if process.poll() is not None:
                log = out.with_suffix(".log")
                raise RuntimeError(f"a fleet process exited ({process.returncode}):\n{log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(live)} of {load.workers} workers came up within {budget_s:.0f} s")
        time.sleep(0.2)


def stop_fleet(fleet: list[tuple[subprocess.Popen[bytes], Path]]) -> list[list[tuple[float, float]]]:
    """SIGTERM every fleet process, wait, and gather each process's publishes (the probe's last)."""
    for process, _ in fleet:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    publishes = []
    for process, out in fleet:
        stop_process(process, timeout_s=60)
        found = json.loads(out.read_text())["publishes"] if out.exists() else []
        publishes.append([(float(t), float(ms)) for t, ms in found])
    return publishes


def server_latency(client: redis.Redis) -> dict[str, float] | None:
    """The server's EVALSHA (publish script) latency percentiles in ms (Redis >= 7: `INFO latencystats`)."""
    stats = client.info("latencystats")
    found = stats.get("latency_percentiles_usec_evalsha")
    if not found:
        return None
    if isinstance(found, str):
        found = dict(part.split("=") for part in found.split(","))
    return {key: round(float(value) / 1000, 3) for key, value in found.items()}


class Counters(NamedTuple):
    """Redis's CPU seconds and, per command, its calls and µs (`INFO cpu`, `INFO commandstats`): so far, or between two
    readings (`counters_since`)."""

    cpu_s: float
    commands: dict[str, tuple[int, int]]


def redis_cpu_s(info: dict[str, Any]) -> float:
    """Redis's CPU seconds so far, user and system, from `INFO` (or `INFO cpu`)."""
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def server_counters(client: redis.Redis) -> Counters:
    stats = client.info("commandstats")
    commands = {  # Redis 7 lists a command that was only rejected, with no calls
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats.items() if int(v["calls"])
    }
    return Counters(redis_cpu_s(client.info("cpu")), commands)


def counters_since(before: Counters, after: Counters) -> Counters:
    """What Redis did between two readings of `server_counters`."""
    old = before.commands
    return Counters(after.cpu_s - before.cpu_s, {
        name: (calls - old.get(name, (0, 0))[0], usec - old.get(name, (0, 0))[1])
        for name, (calls, usec) in after.commands.items()
        if calls > old.get(name, (0, 0))[0]
    })  # fmt: skip


def top_commands(commands: dict[str, tuple[int, int]], top: int) -> list[tuple[str, int, int]]:
    """The `top` commands by CPU, as (name, calls, µs)."""
    return sorted(((name, calls, usec) for name, (calls, usec) in commands.items()), key=lambda c: -c[2])[:top]


def server_commands(client: redis.Redis, wall_s: float, top: int = 8) -> list[dict[str, Any]]:
    """Where Redis spent its time over the window (`INFO commandstats`, reset when measuring began): the `top`
    commands by CPU, with calls per second and microseconds a call. Says what a fleet costs Redis, per kind."""
    return [
        {"command": name, "calls_per_s": round(calls / wall_s, 1), "usec_per_call": round(usec / calls, 1),
         "cores": round(usec / 1e6 / wall_s, 4)}
        for name, calls, usec in top_commands(server_counters(client).commands, top)
    ]  # fmt: skip


class SyncCost(NamedTuple):
    """What Redis did during one sync: when it began (monotonic), how long it lasted, and the counters' deltas."""

    began: float
    seconds: float
    counters: Counters


def server_during_syncs(costs: list[SyncCost], start: float, end: float, top: int = 8) -> dict[str, Any]:
    """What Redis did while the syncs begun in the window were under way: its CPU (cores, over their summed time)
    and the `top` commands by CPU, as calls a sync and µs a call, beside a sync's mean length (from its publish to its
    resume rung to the whole fleet). Says what a sync costs Redis, apart from the rest of the load (a publish made
    meanwhile waits behind it)."""
    rows = [cost for cost in costs if start <= cost.began <= end]
    seconds = sum(cost.seconds for cost in rows)
    if not rows or seconds <= 0:
        return {"syncs": 0}
    totals: dict[str, tuple[int, int]] = {}
    for cost in rows:
        for name, (calls, usec) in cost.counters.commands.items():
            had = totals.get(name, (0, 0))
            totals[name] = (had[0] + calls, had[1] + usec)
    return {
        "syncs": len(rows),
        "seconds_per_sync": round(seconds / len(rows), 3),
        "cpu_cores": round(sum(cost.counters.cpu_s for cost in rows) / seconds, 3),
        "commands": [
            {"command": name, "calls_per_sync": round(calls / len(rows), 1), "usec_per_call": round(usec / calls, 1),
             "cores": round(usec / 1e6 / seconds, 4)}
            for name, calls, usec in top_commands(totals, top)
        ],
    }  # fmt: skip


def server_slow_commands(client: redis.Redis) -> dict[str, Any]:
    """Commands that ran longer than `SLOWLOG_OVER_US` in the window (`SLOWLOG`, reset when measuring began): how
    many, and the slowest few as `[name, µs]`. A command that holds Redis that long holds every other client too."""
    entries = client.slowlog_get(128)
    slowest = sorted(entries, key=lambda e: -int(e["duration"]))[:10]
    scripts = script_names(client)
    return {
        "over_us": SLOWLOG_OVER_US,
        "count": len(entries),
        "slowest": [[command_name(e["command"], scripts), int(e["duration"])] for e in slowest],
    }


def command_name(command: bytes | str, scripts: dict[str, str]) -> str:
    """A SLOWLOG entry's command name; a script's as `evalsha:NAME` (its file's stem, from `scripts`: SHA-1 → name)."""
    words = (command.decode(errors="replace") if isinstance(command, bytes) else str(command)).split(" ", 2)
    name = words[0].lower()
    if name == "evalsha" and len(words) > 1:
        return f"evalsha:{scripts.get(words[1], words[1][:8])}"
    return name


def script_names(client: redis.Redis) -> dict[str, str]:
    """SHA-1 → file stem of every Lua script a fleet runs (redis-py's `Script.sha`, computed without a round trip)."""
    from producers.gateway.sessions import SCRIPTS as GATEWAY_SCRIPTS
    from staleness.admission import SCRIPTS as STALENESS_SCRIPTS

    folders = (STREAM_SCRIPTS, STALENESS_SCRIPTS, GATEWAY_SCRIPTS)
    return {script.sha: name for folder in folders for name, script in register_all(client, folder).items()}


def run_size(console: Console, url: str, load: Load, tmp: Path, cores: Cores | None = None) -> dict[str, Any]:
    """One fleet size: start it, feed and train through warmup and measure, stop it by PID, summarise. With `cores`,
    the probe (the fleet's last process) and the pinger go to `cores.measure` as they start."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from producers.client import RolloutClient

    ns = f"scale{load.workers}"
    window = load.workers * load.max_inflight * 2
    budget = load.workers * load.rate * (load.warmup_s + load.measure_s + 60)
    prompts = int(budget / load.n) + window
    fleet = start_fleet(url, ns, load, tmp)
    if cores:
        pin(fleet[-1][0].pid, cores.measure)
    sampler: Sampler | None = None
    syncer: Syncer | None = None
    pinger: tuple[subprocess.Popen[bytes], Path] | None = None
    pings: list[tuple[float, float]] = []
    try:
        client = RolloutClient(url, ns)
        wait_for_fleet(client, load, fleet)
        producer = Producer(client, prompts, load.n, load.tokens, window)
        tally = Tally(prompts, load.n, load.tokens, exact=load.lengths == "max")
        syncer = Syncer(url, ns, load.sync_every_s, tmp / f"weights{load.workers}", load.pause_mode)
        sampler = Sampler(url, [p.pid for p, _ in fleet], load.sample_s)
        syncer.start()
        pinger = start_pinger(url, ns, load, tmp)
        if cores:
            pin(pinger[0].pid, cores.measure)
        began = time.monotonic()
        measuring = began + load.warmup_s
        end = float("inf")
        marks: dict[str, Any] = {}
        own_cpu = 0.0
        producer.top_up(0)
        progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console)
        task = progress.add_task(f"{load.workers} workers: warming up", total=load.warmup_s + load.measure_s)
        with progress, contextlib.closing(client.batches(load.batch_groups, timeout=60)) as batches:
            for batch in batches:
                for group in batch.groups:
                    tally.add(group)
                producer.top_up(client.stats["received"])
                now = time.monotonic()
                if "start" not in marks and now >= measuring:
                    client.streams.redis.config_resetstat()
                    client.streams.redis.config_set("slowlog-log-slower-than", SLOWLOG_OVER_US)
                    client.streams.redis.slowlog_reset()
                    sampler.read()
                    sampler.start()
                    own_cpu = sum(os.times()[:2])
                    marks |= {"start": now, "wall": time.time(), "received": client.stats["received"]}
                    end = now + load.measure_s
                if now >= end:
                    break
                phase = "measuring" if "start" in marks else "warming up"
                progress.update(task, completed=now - began, description=f"{load.workers} workers: {phase}, "
                                f"{client.stats['received']} rollouts, {len(syncer.reports)} syncs")  # fmt: skip
        sampler.read()
        marks |= {"end": time.monotonic(), "end_wall": time.time(), "end_received": client.stats["received"]}
        own_cpu = sum(os.times()[:2]) - own_cpu
        latency = server_latency(client.streams.redis)
        commands = server_commands(client.streams.redis, marks["end"] - marks["start"])
        slow_commands = server_slow_commands(client.streams.redis)
        stats = dict(client.stats)
        client.streams.redis.close()
    finally:
        if syncer is not None:
            syncer.stop()
        if pinger is not None:
            pings = stop_pinger(pinger)
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        publishes = stop_fleet(fleet)
    return summarise(load, marks, sampler.readings, syncer, publishes, latency, stats, tally, own_cpu) | {
        "redis_top_commands": commands,
        "redis_slow_commands": slow_commands,
        "redis_during_syncs": server_during_syncs(syncer.costs, marks["start"], marks["end"]),
        **ping_latency(pings, syncer.windows, marks["wall"], marks["end_wall"]),
    }


def ping_latency(
    pings: list[tuple[float, float]], syncs: list[tuple[float, float]], start: float, end: float
) -> dict[str, Any]:
    """The pinger's publishes in the window: all of them, and those made while a weight sync was under way (from its
    `publish_weights` call to its return) apart from the rest, which says how much of the tail the syncs make."""
    timed = [(t, ms) for t, ms in pings if start <= t <= end]
    during = [ms for t, ms in timed if any(a <= t <= b for a, b in syncs)]
    outside = [ms for t, ms in timed if not any(a <= t <= b for a, b in syncs)]
    return {
        "publish_ms_ping": _percentiles([ms for _, ms in timed]),
        "publish_ms_ping_during_syncs": _percentiles(during),
        "publish_ms_ping_between_syncs": _percentiles(outside),
        "slow_pings": slow_pings(timed, syncs),
    }


def slow_pings(
    timed: list[tuple[float, float]], syncs: list[tuple[float, float]], over_ms: float = 5.0
) -> list[list[float | None]]:
    """The pinger's publishes slower than `over_ms`, slowest first (at most 40), each as `[ms, since_sync_ms]`: how
    long after the start of the last weight sync begun before it the publish was made (None: before any), which
    places a slow publish in a sync's course (its `weights`, its acks, its `resume`, the fleet's restart after)."""
    rows: list[tuple[float, float | None]] = []
    for t, ms in timed:
        ms = round(ms, 2)
        if ms > over_ms:
            began = [a for a, _ in syncs if a <= t]
            rows.append((ms, round((t - began[-1]) * 1000, 1) if began else None))
    return [list(row) for row in sorted(rows, key=lambda row: -row[0])[:40]]


def _percentiles(values: list[float], digits: int = 3) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None, "count": 0}
    a = np.array(values)
    return {"p50": round(float(np.percentile(a, 50)), digits), "p99": round(float(np.percentile(a, 99)), digits),
            "max": round(float(a.max()), digits), "count": len(values)}  # fmt: skip


def _cores(samples: list[float]) -> dict[str, float] | None:
    return {"median": round(statistics.median(samples), 3), "max": round(max(samples), 3)} if samples else None


def summarise(
    load: Load,
    marks: dict[str, Any],
    readings: Readings,
    syncer: Syncer,
    publishes: list[list[tuple[float, float]]],
    server: dict[str, float] | None,
    stats: dict[str, int],
    tally: Tally,
    own_cpu_s: float,
) -> dict[str, Any]:
    """The numbers of one size, over the measured window only."""
    wall = marks["end"] - marks["start"]

    def in_window(found: list[tuple[float, float]]) -> list[float]:
        return [ms for t, ms in found if marks["wall"] <= t <= marks["end_wall"]]

    stalls = [stall for t, stall, _, _ in syncer.reports if marks["start"] <= t <= marks["end"]]
    cpu, t = readings.redis_cpu_s, readings.t
    cores = [(b - a) / (t1 - t0) for a, b, t0, t1 in zip(cpu, cpu[1:], t, t[1:], strict=False) if t1 > t0]
    span = readings.t[-1] - readings.t[0]
    received = marks["end_received"] - marks["received"]
    return {
        "workers": load.workers,
        "asked_rollouts_per_s": round(load.workers * load.rate, 1),
        "rollouts_per_s": round(received / wall, 1),
        "publish_ms_client": _percentiles([ms for found in publishes for ms in in_window(found)]),
        "publish_ms_probe": _percentiles(in_window(publishes[-1])),
        "publish_ms_server": server,
        "sync_stall_s": _percentiles(stalls),
        "syncs_evicted": sum(e for t, _, _, e in syncer.reports if marks["start"] <= t <= marks["end"]),
        "sync_failure": syncer.failure,
        "redis_cpu_cores": _cores(cores),
        "redis_used_memory_mb": round(max(readings.used_memory) / 2**20, 1),
        "redis_clients": max(readings.clients),
        "fleet_cpu_cores": round((readings.fleet_cpu_s[-1] - readings.fleet_cpu_s[0]) / span, 3) if span else None,
        "trainer_cpu_cores": round(own_cpu_s / wall, 3),
        "delivery": {
            "duplicates": stats["duplicates"] + tally.repeated,
            "dead": stats["dead"],
            "malformed_groups": tally.malformed,
        },
        "measured_s": round(wall, 1),
    }


def run_scale(console: Console, sizes: list[int], base: Load, redis_cores: int = 0) -> dict[str, Any]:
    """Every size on one private Redis, one after the other; everything started is stopped by PID.

    With `redis_cores`, Redis runs on cores of its own, the probe and the pinger on one more, and this process (and
    so the fleet it starts) on the others, as a fleet's workers run on other hosts than its Redis: otherwise the
    simulated fleet's own load, not Redis, makes the tail (README, *Redis on a core of its own*)."""
    from dataclasses import replace

    from pipeline.local import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="rollouts-scale-"))
    rows = []
    allowed = os.sched_getaffinity(0)
    cores = split_cores(allowed, redis_cores)
    try:
        if cores:
            pin(os.getpid(), cores.rest)
        with RedisServer() as server:
            if cores and server.process:
                pin(server.process.pid, cores.redis)
            for size in sizes:
                procs = fleet_procs(size, base.procs, len(cores.rest) if cores else len(allowed))
                console.print(f"scale: {size} workers in {procs} processes")
                try:
                    row = run_size(console, server.url, replace(base, workers=size, procs=procs), tmp, cores)
                except (RuntimeError, TimeoutError) as exc:  # a fleet that never came up is a result too
                    row = {"workers": size, "failed": str(exc)[-1000:]}
                row["procs"] = procs
                row["saturated"] = "failed" in row or bool(
                    (row["redis_cpu_cores"] and row["redis_cpu_cores"]["median"] >= 0.9)
                    or (row["publish_ms_probe"]["p99"] or 0) > P99_GOAL_MS
                )
                rows.append(row)
                with contextlib.closing(redis.Redis.from_url(server.url)) as flush:
                    flush.flushall()
            served_by = server.binary.describe()
            peak_rss = rss_bytes(server.process.pid) if server.process else None
    finally:
        if cores:
            pin(os.getpid(), allowed)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "redis": served_by,
        "cores": {name: sorted(cpus) for name, cpus in cores._asdict().items()} if cores else None,
        "redis_rss_mb_at_end": round(peak_rss / 2**20, 1) if peak_rss else None,
        "cpus": os.cpu_count(),
        "load": {k: v for k, v in vars(base).items() if k != "workers"} | {"engine_args": base.engine_args},
        "sizes": rows,
    }


def plot_scale(result: dict[str, Any], path: Path) -> None:
    """Publish latency, sync stall and Redis CPU against fleet size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["sizes"] if "failed" not in r]
    x = [r["workers"] for r in rows]
    fig, (lat, stall, cpu) = plt.subplots(1, 3, figsize=(13, 4))
    lat.plot(x, [r["publish_ms_client"]["p50"] for r in rows], "o-", label="client p50")
    lat.plot(x, [r["publish_ms_client"]["p99"] for r in rows], "o-", label="client p99")
    lat.plot(x, [r["publish_ms_probe"]["p99"] for r in rows], "o-", label="probe p99 (a worker alone)")
    if all(r["publish_ms_server"] for r in rows):
        lat.plot(x, [r["publish_ms_server"]["p99"] for r in rows], "s--", label="server p99 (EVALSHA)")
    lat.axhline(P99_GOAL_MS, color="grey", ls=":", label="goal p99")
    lat.set(xlabel="workers", ylabel="publish ms (log)", title="publish latency", yscale="log")
    lat.legend(fontsize=8)
    stall.plot(x, [r["sync_stall_s"]["p50"] for r in rows], "o-", label="p50")
    stall.plot(x, [r["sync_stall_s"]["max"] for r in rows], "o-", label="max")
    stall.set(xlabel="workers", ylabel="seconds", title="weight-sync stall")
    stall.legend(fontsize=8)
    cpu.plot(x, [r["redis_cpu_cores"]["median"] for r in rows], "o-", label="Redis (median)")
    cpu.plot(x, [r["fleet_cpu_cores"] for r in rows], "o-", label="worker fleet")
    cpu.axhline(1.0, color="grey", ls=":", label="one core")
    cpu.set(xlabel="workers", ylabel="CPU cores", title=f"CPU ({result['cpus']} cores in all)")
    cpu.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scale(
    workers: Annotated[str, typer.Option(help="Fleet sizes to run, side by side: comma-separated.")] = "100,300,1000",
    rate: Annotated[float, typer.Option(min=0.01, help="Rollouts per second per worker.")] = 2.0,
    tokens: Annotated[int, typer.Option(min=1, help="Tokens per rollout.")] = 1024,
    n: Annotated[int, typer.Option(min=1, help="Samples per prompt.")] = 4,
    max_inflight: Annotated[int, typer.Option(min=1, help="Samples in flight per worker.")] = 4,
    procs: Annotated[
        int,
        typer.Option(
            min=0,
            help="Processes the workers are spread over (0: about 16 workers a process, at most 4 a core). Workers are "
            "deployed one to a process: with more than ~20 to a process, the process's own queue shows in the figures.",
        ),
    ] = 0,
    warmup_s: Annotated[float, typer.Option(min=0, help="Seconds before measuring, per size.")] = 10.0,
    measure_s: Annotated[float, typer.Option(min=1, help="Seconds measured, per size.")] = 30.0,
    sync_every_s: Annotated[float, typer.Option(min=0.5, help="Seconds between weight syncs.")] = 5.0,
    lengths: Annotated[
        str, typer.Option(help="Sample lengths: max (all --tokens long), uniform:LOW-HIGH or pareto:ALPHA (capped).")
    ] = "max",
    pause_mode: Annotated[str, typer.Option(help="How workers pause for a sync: abort or keep.")] = "abort",
    redis_cores: Annotated[
        int,
        typer.Option(
            min=0,
            help="Cores of its own for Redis, and one more for the probe and the pinger, the rest for the fleet and "
            "this process, as on a cluster where the workers run on hosts of their own (0: all share every core; "
            "ignored with fewer than 2 cores left for the rest).",
        ),
    ] = 1,
    plot: Annotated[Path | None, typer.Option(help="Draw latency, stall and CPU against fleet size here.")] = None,
) -> None:
    """Many workers on one Redis at realistic rates: publish latency, sync stall, Redis CPU and memory; JSON out."""
    try:
        sizes = [int(s) for s in workers.split(",")]
    except ValueError:
        fail(f"--workers must be comma-separated integers, not {workers!r}")
    if any(s < 1 for s in sizes):
        fail("every fleet size must be at least 1")
    from consumers.engines.synthetic_engine import parse_lengths

    if not is_pause_mode(pause_mode) or pause_mode == "inflight":  # abort or keep: the two this measures
        fail(f"--pause-mode must be abort or keep, not {pause_mode!r}")

    try:
        parse_lengths(lengths, 1)
    except ValueError as exc:
        fail(f"--lengths: {exc}")
    base = Load(
        0,
        rate,
        tokens,
        n,
        max_inflight,
        procs,
        warmup_s,
        measure_s,
        sync_every_s,
        pause_mode=pause_mode,
        lengths=lengths,
    )
    with user_errors():
        try:
            result = run_scale(console, sizes, base, redis_cores)
        except (RuntimeError, TimeoutError) as exc:
            fail(str(exc))
        if plot is not None:
            plot_scale(result, plot)
            console.print(f"plot written to {plot}")
    print(json.dumps(result, indent=2))

"""`rollouts failover-chaos`: the pipeline behind Sentinel while its primary keeps failing, once per durability mode.

For each mode of `--modes` (`pipeline.durability`: `default`, `replica`, ...) it starts a `SentinelTopology` (a primary,
`--replicas` replicas, three Sentinels that call a primary down after `--down-after-ms`; every server with the AOF
fsynced every second, `min-replicas-to-write 1`, `min-replicas-max-lag 1`), K synthetic workers, `rollouts manager` and
the chaos trainer (`chaos_trainer`: admission, a staleness bound, an fsynced ledger of every group trained, weights
published every few seconds), each given only the Sentinels' URL with `?durability=MODE`. For `--duration-s` it
fails the primary every `--every-s` seconds, one of:

- `primary-kill`: `kill -9`; once Sentinel has promoted a replica, the old primary comes back as a replica;
- `primary-stop`: SIGSTOP past `down-after` (Sentinel promotes a replica), then SIGCONT: a stale primary that still
  takes itself for the primary, with clients still connected to it, until Sentinel makes it a replica;
- `primary-crash`: `kill -9` and the last `--crash-tail-bytes` of its AOF cut off (what a host crash loses with the
  page cache under `appendfsync everysec`), back once a replica was promoted, as a replica;
- `primary-partition` (root only; not in the default `--kinds`): the primary and one worker (`w0`) cut off from the
  replicas, the Sentinels and every other client, past a replica's promotion and `--partition-hold-s` more, then
  joined again: `w0` keeps its open connections to a primary that the majority has replaced. For it the run moves
  into a network namespace of its own and gives each server and `w0` one of their own (`benchmarks.netns`).

Then the producer stops and the run waits until the trainer has accounted for every prompt. From the ledger and
Redis it reports, per mode: the faults and failovers; prompts acknowledged and lost (submitted, never trained on,
parked or dead-lettered: the run stalls on them until `--drain-timeout-s`); rollout ids trained twice; versions
reused (two syncs that reported one number); how long each failover took (fault to a new primary named) and each
recovery (fault to the first group trained after it), p50/p99. `goals` checks issue 56's for the `replica` mode.

"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import redis
import typer

from benchmarks import PROGRAM, netns
from benchmarks.chaos import Ledger, Member, percentiles
from benchmarks.chaos_trainer import parked_and_dead, prompt_ids
from pipeline.durability import MODES
from pipeline.local import LOOPBACK, RedisServer, SentinelTopology
from pipeline.streams import Streams
from rollouts.app import console, fail

NS = "failover"
KINDS = ("primary-kill", "primary-stop", "primary-crash", "primary-partition")
DEFAULT_KINDS = KINDS[:3]
"""A partition needs root: it is asked for by name."""
MINORITY = "w0"
"""The client a partition leaves with the old primary."""


@dataclass
class Failover:
    kind: str
    t: float
    """Seconds since the run began."""
    old_port: int
    promoted_after_s: float | None = None
    recovered_after_s: float | None = None
    """Until the first group trained after the fault."""


@dataclass
class Run:
    """One mode's run."""

    mode: str
    topology: SentinelTopology
    tmp: Path
    o: dict[str, Any]
    network: netns.Network | None = None
    """The namespaces of the servers and of `MINORITY` (a run with partitions), else None: all on loopback."""
    members: dict[str, Member] = field(default_factory=dict)
    faults: list[Failover] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.tmp / "ledger.jsonl")
        self.rng = random.Random(self.o["seed"])
        url = f"{self.topology.url}?durability={self.mode}"
        engine = json.dumps({"steps_per_s": self.o["steps_per_s"], "lengths": f"uniform:8-{self.o['tokens']}"})
        for k in range(self.o["workers"]):
            args = ["worker", "--redis", url, "--ns", NS, "--model", "synthetic", "--engine", "synthetic"]
            args += ["--engine-args", engine, "--name", f"w{k}", "--heartbeat-s", str(self.o["heartbeat_s"])]
            args += ["--claim-idle-ms", str(int(self.o["heartbeat_s"] * 2500)), "--log-level", self.o["log_level"]]
            place = self.network.node(MINORITY) if self.network is not None and k == 0 else LOOPBACK
            self.members[f"w{k}"] = Member(f"w{k}", args, self.tmp / f"w{k}.log", launcher=place.launcher)
        manager = ["manager", "--redis", url, "--ns", NS, "--ack-timeout-s", str(self.o["ack_timeout_s"])]
        manager += ["--abandoned-after-s", str(self.o["ack_timeout_s"] + 3), "--interval", "0.5"]
        manager += ["--log-level", self.o["log_level"]]
        self.members["manager"] = Member("manager", manager, self.tmp / "manager.log")
        trainer = ["chaos-trainer", "--redis", url, "--ns", NS, "--ledger", str(self.ledger.path)]
        trainer += ["--chunk", str(self.o["chunk"]), "--n", str(self.o["n"]), "--tokens", str(self.o["tokens"])]
        trainer += ["--max-staleness", "4", "--batch-groups", str(self.o["batch_groups"])]
        trainer += ["--sync-every-s", str(self.o["sync_every_s"]), "--ack-timeout-s", str(self.o["ack_timeout_s"])]
        trainer += ["--stop-file", str(self.tmp / "stop")]
        self.members["trainer"] = Member("trainer", trainer, self.tmp / "trainer.log", module=PROGRAM)

    def now(self) -> float:
        return time.monotonic() - self.started

    def run(self, progress: Callable[[str], None]) -> float:
        for member in self.members.values():
            member.start()
        next_at, kinds = self.o["warmup_s"], [k for k in KINDS if k in self.o["kinds"]]
        schedule = kinds + self.rng.choices(kinds, k=10_000)
        while self.now() < self.o["duration_s"]:
            self._tick()
            if self.now() >= next_at:
                self._fail(schedule.pop(0))
                next_at = self.now() + self.o["every_s"]
            progress(self._line("faults"))
        (self.tmp / "stop").touch()
        deadline = time.monotonic() + self.o["drain_timeout_s"]
        trainer = self.members["trainer"]
        while (trainer.process is None or trainer.process.poll() != 0) and time.monotonic() < deadline:
            self._tick()
            progress(self._line("draining"))
        self._tick()
        return self.now()

    def _tick(self) -> None:
        """Restart what exited (an evicted worker, a trainer that gave up); read the ledger; time recoveries."""
        for member in self.members.values():
            done = member.name == "trainer" and member.process is not None and member.process.poll() == 0
            if not member.alive() and not done:
                member.start()
        self.ledger.poll()
        for fault in self.faults:
            if fault.recovered_after_s is None:
                after = [r["t"] for r in self.ledger.records if r["kind"] == "group" and r["t"] > self.wall(fault.t)]
                if after:
                    fault.recovered_after_s = round(min(after) - self.wall(fault.t), 3)
        time.sleep(0.05)

    def wall(self, t: float) -> float:
        """The wall-clock time (the ledger's) of `t` seconds into the run."""
        return time.time() - (self.now() - t)

    def _fail(self, kind: str) -> None:
        """Fail the primary the Sentinels name now, wait for a replica's promotion, bring the old one back."""
        port = self.topology.primary_port()
        server = self.topology.server(port)
        fault = Failover(kind, self.now(), port)
        self.faults.append(fault)
        assert server.process is not None
        if kind == "primary-partition":
            assert self.network is not None
            self.network.partition([server_node(port, self.topology), MINORITY])
        elif kind == "primary-stop":
            os.kill(server.process.pid, signal.SIGSTOP)
        else:
            server.kill()
            if kind == "primary-crash":
                cut_aof_tail(server, self.o["crash_tail_bytes"])
        try:
            self.topology.wait_for_failover(port, timeout_s=60)
            fault.promoted_after_s = round(self.now() - fault.t, 3)
            if kind == "primary-partition":  # the old primary serves the minority alone for a while
                time.sleep(self.o["partition_hold_s"])
        finally:
            if kind == "primary-partition":
                assert self.network is not None
                self.network.heal()  # back, stale, until Sentinel makes it a replica
            elif kind == "primary-stop":
                os.kill(server.process.pid, signal.SIGCONT)  # back, stale, until Sentinel makes it a replica
            else:
                self.topology.restart(server)

    def _line(self, phase: str) -> str:
        trained = sum(1 for r in self.ledger.records if r["kind"] == "group")
        return f"{self.mode}: {phase} {self.now():.0f}s, {len(self.faults)} failovers, {trained} groups trained"

    def stop(self) -> None:
        for member in self.members.values():
            if member.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.process.pid, signal.SIGCONT)
                member.process.kill()
                member.process.wait()


def server_node(port: int, topology: SentinelTopology) -> str:
    """The network node of the server on `port` (a run with partitions names them `s0`, `s1`, ...)."""
    return f"s{topology.servers.index(topology.server(port))}"


def cut_aof_tail(server: RedisServer, size: int) -> None:
    """Cut the last `size` bytes off the server's newest AOF file (Redis 7's `appendonlydir`, or 6.2's one file)."""
    files = sorted(server.data_dir.rglob("*.aof"), key=lambda p: p.stat().st_mtime)
    if files:
        newest = files[-1]
        os.truncate(newest, max(0, newest.stat().st_size - size))


def report(run: Run, wall_s: float) -> dict[str, Any]:
    """What the run lost, duplicated and reused, from the ledger and from Redis."""
    records = run.ledger.records
    groups = [r for r in records if r["kind"] == "group"]
    chunks = 1 + max((r["chunk"] for r in records if r["kind"] == "submit"), default=-1)
    submitted = {p for c in range(chunks) for p in prompt_ids(c, run.o["chunk"])}
    trained = {r["prompt"] for r in groups}
    client = redis.Redis.from_url(run.topology.server(run.topology.primary_port()).url)
    parked, dead = parked_and_dead(Streams(client, NS))
    ids = Counter(i for r in groups for i in r["ids"])
    versions = Counter(r["version"] for r in records if r["kind"] == "sync")
    return {
        "mode": run.mode,
        "wall_s": round(wall_s, 1),
        "faults": dict(Counter(f.kind for f in run.faults)),
        "failovers": sum(1 for f in run.faults if f.promoted_after_s is not None),
        "prompts_submitted": len(submitted),
        "groups_trained": len(groups),
        "acknowledged_lost": sorted(submitted - trained - parked - set(dead)),
        "duplicates_trained": sum(c - 1 for c in ids.values() if c > 1),
        "versions_reused": sorted(v for v, c in versions.items() if c > 1),
        "syncs": sum(versions.values()),
        "dead_letters": dead,
        "promotion_s": percentiles([f.promoted_after_s for f in run.faults if f.promoted_after_s is not None]),
        "recovery_s": percentiles([f.recovered_after_s for f in run.faults if f.recovered_after_s is not None]),
        "unrecovered": sum(1 for f in run.faults if f.recovered_after_s is None),
        "each_fault": [asdict(f) | {"t": round(f.t, 3)} for f in run.faults],
        "started_at": round(run.wall(0.0), 3),
    }


def goals(result: dict[str, Any]) -> dict[str, bool]:
    """Issue 56's goals for the replica-acked mode: nothing acknowledged lost, no duplicate trained, no version
    reused over at least 20 failovers, recovery p99 at most 10 s."""
    recovery = result["recovery_s"]
    return {
        "failovers_at_least_20": result["failovers"] >= 20,
        "none_lost": not result["acknowledged_lost"],
        "no_duplicate_trained": result["duplicates_trained"] == 0,
        "no_version_reused": not result["versions_reused"],
        "recovery_p99_at_most_10_s": recovery.get("n", 0) > 0 and recovery["p99"] <= 10.0,
    }


def failover_chaos(
    modes: Annotated[str, typer.Option(help="Durability modes, comma-separated: one run each.")] = "default,replica",
    duration_s: Annotated[float, typer.Option(help="Seconds of faults per mode (then it drains).")] = 240.0,
    every_s: Annotated[float, typer.Option(help="Seconds between failovers.")] = 10.0,
    kinds: Annotated[
        str, typer.Option(help=f"Fault kinds, comma-separated, of {', '.join(KINDS)} (a partition needs root).")
    ] = ",".join(DEFAULT_KINDS),
    partition_hold_s: Annotated[float, typer.Option(help="A partition lasts this long past the promotion.")] = 3.0,
    replicas: Annotated[int, typer.Option(min=2, help="Replicas of the primary (a replica mode needs one left).")] = 2,
    down_after_ms: Annotated[int, typer.Option(help="Sentinel's down-after-milliseconds.")] = 1000,
    workers: Annotated[int, typer.Option(min=1, help="Synthetic workers.")] = 3,
    heartbeat_s: Annotated[float, typer.Option(help="Workers' heartbeat (dead after 2.5 of them).")] = 2.0,
    n: Annotated[int, typer.Option(help="Samples per prompt.")] = 4,
    tokens: Annotated[int, typer.Option(help="Tokens per sample, at most.")] = 64,
    steps_per_s: Annotated[float, typer.Option(help="Synthetic engine pace.")] = 100.0,
    chunk: Annotated[int, typer.Option(help="Prompts per submission.")] = 16,
    batch_groups: Annotated[int, typer.Option(help="Groups per training step.")] = 16,
    sync_every_s: Annotated[float, typer.Option(help="Seconds between weight publishes.")] = 3.0,
    ack_timeout_s: Annotated[float, typer.Option(help="A sync's ack deadline.")] = 10.0,
    crash_tail_bytes: Annotated[int, typer.Option(help="AOF bytes a `primary-crash` loses.")] = 4096,
    warmup_s: Annotated[float, typer.Option(help="Seconds before the first fault.")] = 5.0,
    drain_timeout_s: Annotated[float, typer.Option(help="After the faults: stalled if not done within.")] = 120.0,
    seed: Annotated[int, typer.Option(help="The schedule's seed.")] = 0,
    keep_logs: Annotated[Path | None, typer.Option(help="Copy every process's log and the ledger here.")] = None,
    log_level: Annotated[str, typer.Option(help="Workers' and manager's log level: info to diagnose.")] = "warning",
) -> None:
    """Fail the primary behind Sentinel over and over (kill -9, SIGSTOP past down-after, a crash that loses the AOF's
    tail, a partition of it and one worker: root) under a running pipeline, once per durability mode; report
    acknowledged-then-lost, duplicates trained, versions reused and recovery times; JSON out."""
    options = {k: v for k, v in locals().items() if k not in ("keep_logs", "modes")}
    options["kinds"] = kinds.split(",")
    if unknown := [k for k in options["kinds"] if k not in KINDS]:
        fail(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    partitions = "primary-partition" in options["kinds"]
    if partitions and (why := netns.why_not()):
        fail(why)
    if unknown := [m for m in modes.split(",") if m not in MODES]:
        fail(f"unknown durability modes {unknown}; choose from {', '.join(MODES)}")
    if partitions:
        netns.enter_private_network()
    results = [run_mode(mode, options, keep_logs, partitions) for mode in modes.split(",")]
    print(json.dumps({"runs": results}, indent=2))


def run_mode(mode: str, options: dict[str, Any], keep_logs: Path | None, partitions: bool) -> dict[str, Any]:
    """One durability mode's run, from a topology of its own to its report."""
    from rich.live import Live

    settings = {"min-replicas-to-write": "1", "min-replicas-max-lag": "1", "appendfsync": "everysec"}
    replicas = options["replicas"]
    tmp = Path(tempfile.mkdtemp(prefix=f"rollouts-failover-{mode}-"))
    with contextlib.ExitStack() as cleanup:
        network = netns.Network() if partitions else None
        if network is not None:
            cleanup.callback(network.close)  # last: once the servers are stopped
        places = [network.node(f"s{i}") for i in range(1 + replicas)] if network is not None else None
        topology = SentinelTopology(
            replicas=replicas, down_after_ms=options["down_after_ms"], settings=settings, appendonly=True,
            places=places, sentinel_host=netns.HOST if network is not None else LOOPBACK.host,
        )  # fmt: skip
        cleanup.enter_context(topology)
        run = Run(mode, topology, tmp, options, network)
        try:
            with Live(console=console, transient=True) as live:
                wall_s = run.run(lambda line: live.update(line))
            result = report(run, wall_s)
        finally:
            run.stop()
            if keep_logs is not None:
                shutil.copytree(tmp, keep_logs / mode, dirs_exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
    if mode == "replica":
        result["goals"] = goals(result)
    console.print(
        f"{mode}: {result['failovers']} failovers, {len(result['acknowledged_lost'])} lost, "
        f"{result['duplicates_trained']} duplicates, versions reused {result['versions_reused']}, "
        f"recovery p50 {result['recovery_s'].get('p50')} s p99 {result['recovery_s'].get('p99')} s"
    )
    return result

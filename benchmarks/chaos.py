"""`rollouts chaos`: the whole pipeline under faults on a schedule, and what it lost.

It starts a private `redis-server` with `appendonly yes, appendfsync everysec`, a TCP proxy
(`chaos_proxy`) in front of it for every other worker, K synthetic workers, `rollouts manager`,
`rollouts scorer` and the chaos trainer (`chaos_trainer`: a producer under admission with a staleness
bound, a trainer that writes each group it takes to an fsynced ledger, weights published every few
seconds), each a process of its own as a user runs them. For `duration_s` it injects one fault every
`every_s` seconds, each kind at least once, then by weight:

- `worker-kill`: `kill -9` of a random worker, restarted (same name) after `restart_s`;
- `worker-stop`: SIGSTOP of a worker for 1-8 s (past its heartbeat: it is evicted from a sync, its work
  claimed), then SIGCONT;
- `proxy-cut`: every connection through the proxy reset at once;
- `redis-kill`: `kill -9` of redis-server, restarted on the same port and data after `redis_down_s`;
- `trainer-kill` and `manager-kill`: `kill -9` while a weight sync is under way, restarted;
- `scorer-kill`: `kill -9` of the scoring stage (every prompt names a reward function), restarted.

A process that exits on its own (an evicted worker) is restarted too, as a supervisor would. Then the
producer stops and the run waits until every prompt is accounted for. From the ledger and Redis it
reports the faults by kind, samples lost (submitted but neither trained on, parked as stale nor a dead
letter), duplicates handed to the trainer, groups that were not whole, spans that do not cover their
tokens, batches over the staleness bound, and the recovery time of each fault: until every entry that
the faulted worker held was handed out again (claimed by a live worker) or finished (worker faults; none
held: not counted; `takeover_first_s`: until the first of them was), until the first group trained after
the fault (redis, trainer), until the sync was concluded (manager). Each dead letter is listed with its reason
and the worker faults whose worker held its prompt, and whether it was poison: with `--poison-every N`, the first
prompt of every N-th chunk holds a token that kills the synthetic worker that starts it (`poison_token`). `goals`
checks issue 54's for this run: a worker kill's recovery at most 10 s median; no dead letter but the poison prompts,
and every poison prompt a dead letter.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import redis
import typer

from benchmarks import PROGRAM
from benchmarks.chaos_proxy import Proxy
from benchmarks.chaos_trainer import POISON_TOKEN, is_poison, parked_and_dead
from pipeline.processes import start_command, stop_process
from pipeline.wire import GENERATORS, Keys
from rollouts.app import console, fail, user_errors

if TYPE_CHECKING:
    from pipeline.local import RedisServer

NS = "chaos"
KINDS = ("worker-kill", "worker-stop", "proxy-cut", "redis-kill", "trainer-kill", "manager-kill", "scorer-kill")
WEIGHTS = (0.6, 0.15, 0.1, 0.04, 0.04, 0.04, 0.03)
REWARD = "producers.tasks:token_set_reward"
"""Every prompt names it: the scoring stage (`rollouts scorer`) is part of the run."""
"""How often each kind comes after the first round (one of each)."""


@dataclass
class Fault:
    kind: str
    t: float
    """Seconds since the run began."""
    target: str = ""
    held: dict[tuple[str, bytes], int] = field(default_factory=dict)
    """What the faulted worker(s) held: (stream, entry id) -> times delivered. Recovered once every one was
    handed out again (claimed by a live worker) or is no longer pending (finished)."""
    held_prompts: set[str] = field(default_factory=set)
    """The prompt ids of the prompt entries in `held` (to tell whether a dead letter sat with a faulted worker)."""
    recovery_s: float | None = None
    first_s: float | None = None
    """Worker faults: until the first entry it held was handed out again or finished (a live worker started on it)."""


@dataclass
class Member:
    """One supervised process: how to start it, the running one, and how often it was started."""

    name: str
    args: list[str]
    log: Path
    module: str = "rollouts"
    """The program it is a command of: `rollouts`, or the lab's own (`benchmarks.PROGRAM`)."""
    launcher: tuple[str, ...] = ()
    """What its command line starts with (`ip netns exec NS`: a network namespace of its own)."""
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    stopped_until: float = 0.0
    """While SIGSTOPped: when to SIGCONT (monotonic)."""
    down_until: float = 0.0
    """While killed: when to start again (monotonic)."""

    def start(self) -> None:
        self.process = start_command(*self.args, log_file=self.log, module=self.module, launcher=self.launcher)
        self.starts += 1

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self, restart_after_s: float) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)  # a stopped process dies of SIGKILL too, but tidy up
            self.process.kill()
            self.process.wait()
        self.stopped_until = 0.0
        self.down_until = time.monotonic() + restart_after_s


class Ledger:
    """What the trainer wrote, read as it grows: prompts trained on and when."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.records: list[dict[str, Any]] = []
        self.trained_at: dict[str, float] = {}

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as ledger:
            ledger.seek(self.offset)
            data = ledger.read()
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self.offset += end
        for line in data[:end].splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                self.records.append(record)
                if record["kind"] == "group":
                    self.trained_at.setdefault(record["prompt"], record["t"])


class Chaos:
    def __init__(self, server: RedisServer, tmp: Path, options: dict[str, Any]) -> None:
        self.server, self.tmp, self.o = server, tmp, options
        self.keys = Keys(NS)
        self.rng = random.Random(options["seed"])
        self.proxy = Proxy(("127.0.0.1", server.port))
        self.redis = redis.Redis.from_url(server.url, socket_timeout=5)
        self.ledger = Ledger(tmp / "ledger.jsonl")
        self.faults: list[Fault] = []
        self.began = time.monotonic()
        self.began_wall = time.time()
        self.members = self._cast()
        self.redis_down_until = 0.0

    def _cast(self) -> dict[str, Member]:
        o, url = self.o, self.server.url
        members: dict[str, Member] = {}
        engine = json.dumps(
            {"steps_per_s": o["steps_per_s"], "lengths": "uniform:8-" + str(o["tokens"]), "poison_token": POISON_TOKEN}
        )
        for k in range(o["workers"]):
            name = f"w{k}"
            via = self.proxy.url() if k % 2 else url
            args = ["worker", "--redis", via, "--ns", NS, "--model", "synthetic", "--engine", "synthetic"]
            args += ["--engine-args", engine, "--name", name, "--claim-idle-ms", "3000", "--heartbeat-s", "0.5"]
            args += ["--max-inflight", "64", "--log-level", "warning"]
            members[name] = Member(name, args, self.tmp / f"{name}.log")
        manager = ["manager", "--redis", url, "--ns", NS, "--ack-timeout-s", str(o["ack_timeout_s"])]
        manager += ["--abandoned-after-s", str(o["ack_timeout_s"] + 3), "--interval", "0.5"]
        members["manager"] = Member("manager", manager, self.tmp / "manager.log")
        scorer = ["scorer", "--redis", url, "--ns", NS, "--lease-s", "2", "--log-level", "warning"]
        members["scorer"] = Member("scorer", scorer, self.tmp / "scorer.log")
        trainer = ["chaos-trainer", "--redis", url, "--ns", NS, "--ledger", str(self.ledger.path)]
        trainer += ["--chunk", str(o["chunk"]), "--n", str(o["n"]), "--tokens", str(o["tokens"])]
        trainer += ["--max-staleness", str(o["max_staleness"]), "--batch-groups", str(o["batch_groups"])]
        trainer += ["--sync-every-s", str(o["sync_every_s"]), "--ack-timeout-s", str(o["ack_timeout_s"])]
        trainer += ["--stop-file", str(self.tmp / "stop"), "--reward-fn", REWARD]
        trainer += ["--poison-every", str(o["poison_every"])]
        members["trainer"] = Member("trainer", trainer, self.tmp / "trainer.log", module=PROGRAM)
        return members

    @property
    def workers(self) -> list[Member]:
        return [m for name, m in self.members.items() if name.startswith("w")]

    def now(self) -> float:
        return time.monotonic() - self.began

    # -- the run -------------------------------------------------------------------------------

    def run(self, progress: Callable[[str], None]) -> float:
        """Inject faults for `duration_s`, then wait for the trainer to account for every prompt."""
        for member in self.members.values():
            member.start()
        schedule = self._schedule()
        next_at = self.o["warmup_s"]
        while self.now() < self.o["duration_s"]:
            self._supervise()
            self.ledger.poll()
            self._measure()
            if self.now() >= next_at and schedule:
                self._inject(schedule.pop(0))
                next_at = self.now() + self.o["every_s"]
            progress(self._line())
            time.sleep(0.05)  # the supervisor's tick
        (self.tmp / "stop").touch()  # the producer stops; the trainer finishes what was submitted
        deadline = time.monotonic() + self.o["drain_timeout_s"]
        trainer = self.members["trainer"]
        while trainer.process is None or trainer.process.poll() != 0:
            if time.monotonic() > deadline:
                self._dump(self.tmp / "stall.json")
                raise TimeoutError(
                    f"the trainer did not account for every prompt within {self.o['drain_timeout_s']:.0f} s after "
                    f"the faults stopped: the pipeline stalled (what Redis held: stall.json beside the logs)"
                )
            self._supervise()
            self.ledger.poll()
            self._measure()
            progress(self._line("draining"))
            time.sleep(0.05)
        self.ledger.poll()
        self._measure()
        return self.now()

    def _dump(self, path: Path) -> None:
        """What Redis holds when the run stalled: `top`'s snapshot and who holds what is pending."""
        from pipeline.streams import Streams
        from pipeline.top import snapshot

        with contextlib.suppress(redis.RedisError):
            state = snapshot(Streams(self.redis, NS))
            for stream in (self.keys.prompts, self.keys.partials, self.keys.rollouts):
                for group in self.redis.xinfo_groups(stream):
                    summary = self.redis.xpending(stream, group["name"])
                    state.setdefault("pending", {})[f"{stream}/{group['name'].decode()}"] = summary
            path.write_text(json.dumps(state, indent=2, default=repr))

    def _schedule(self) -> list[str]:
        count = max(len(KINDS), int((self.o["duration_s"] - self.o["warmup_s"]) / self.o["every_s"]))
        first = [k for k in KINDS if k in self.o["kinds"]]
        weights = [w if k in self.o["kinds"] else 0.0 for k, w in zip(KINDS, WEIGHTS, strict=True)]
        return first + self.rng.choices(KINDS, weights, k=count - len(first))

    def _supervise(self) -> None:
        """Restart what is down and due, SIGCONT what is stopped and due, bring Redis back."""
        now = time.monotonic()
        if self.server.process is None and now >= self.redis_down_until:
            self.server.start(timeout_s=60)
        for member in self.members.values():
            if member.stopped_until and now >= member.stopped_until and member.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.process.pid, signal.SIGCONT)
                member.stopped_until = 0.0
            finished_ok = member.name == "trainer" and member.process is not None and member.process.poll() == 0
            if not member.alive() and not finished_ok and now >= member.down_until:
                member.start()

    # -- faults --------------------------------------------------------------------------------

    def _inject(self, kind: str) -> None:
        fault = Fault(kind, self.now())
        if kind in ("worker-kill", "worker-stop"):
            live = [m for m in self.workers if m.alive() and not m.stopped_until]
            if not live:
                return
            member = self.rng.choice(live)
            fault.target = member.name
            fault.held = self._held([member.name])
            fault.held_prompts = self._prompt_ids([key for key in fault.held if key[0] == self.keys.prompts])
            if kind == "worker-kill":
                member.kill(self.o["restart_s"])
            else:
                assert member.process is not None
                os.kill(member.process.pid, signal.SIGSTOP)
                member.stopped_until = time.monotonic() + self.rng.uniform(1.0, 8.0)
        elif kind == "proxy-cut":
            fault.target = f"{self.proxy.cut()} connections"
        elif kind == "redis-kill":
            self.server.kill()
            self.redis_down_until = time.monotonic() + self.o["redis_down_s"]
        elif kind == "scorer-kill":
            self.members["scorer"].kill(self.o["restart_s"])
        else:  # trainer-kill, manager-kill: mid-sync
            if not self._wait_for_sync():
                fault.target = "no sync came; killed anyway"
            member = self.members[kind.removesuffix("-kill")]
            member.kill(self.o["restart_s"])
            fault.target = fault.target or "mid-sync"
        self.faults.append(fault)

    def _wait_for_sync(self) -> bool:
        """Wait (supervising meanwhile) until a weight sync is under way; False after two sync periods."""
        deadline = time.monotonic() + 2 * self.o["sync_every_s"] + self.o["ack_timeout_s"]
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if self.redis.hget(self.keys.state, "paused") == b"1":
                    return True
            self._supervise()
            time.sleep(0.01)
        return False

    def _held(self, workers: list[str]) -> dict[tuple[str, bytes], int]:
        """Entries pending for these workers on the work streams (read before the fault), and their deliveries."""
        held: dict[tuple[str, bytes], int] = {}
        with contextlib.suppress(redis.RedisError):
            for stream in (self.keys.prompts, self.keys.partials):
                for worker in workers:
                    pending = cast(  # redis-py's dicts: message_id (bytes), times_delivered (int), ...
                        "list[dict[str, Any]]",
                        self.redis.xpending_range(stream, GENERATORS, "-", "+", 10_000, consumername=worker),
                    )
                    held |= {(stream, item["message_id"]): item["times_delivered"] for item in pending}
        return held

    def _prompt_ids(self, entries: list[tuple[str, bytes]]) -> set[str]:
        """The `id` field of these prompt entries (those still in the stream)."""
        ids: set[str] = set()
        with contextlib.suppress(redis.RedisError):
            pipe = self.redis.pipeline(transaction=False)
            for stream, entry_id in entries:
                pipe.xrange(stream, entry_id, entry_id)
            for reply in pipe.execute():
                ids |= {fields[b"id"].decode() for _, fields in reply if b"id" in fields}
        return ids

    def _taken_over(self, fault: Fault) -> tuple[bool, bool]:
        """Whether any, and whether every, entry the fault left behind was claimed by a live worker or finished."""
        pipe = self.redis.pipeline(transaction=False)
        for stream, entry_id in fault.held:
            pipe.xpending_range(stream, GENERATORS, entry_id, entry_id, 1)
        moved = [
            not replies or replies[0]["times_delivered"] > fault.held[stream, entry_id]
            for (stream, entry_id), replies in zip(fault.held, pipe.execute(), strict=True)
        ]
        return any(moved), all(moved)

    def _beating_since(self, workers: list[str], since: float) -> bool:
        """Whether each of these workers (unless down or stopped) wrote a heartbeat after `since` (wall clock)."""
        expected = [w for w in workers if self.members[w].alive() and not self.members[w].stopped_until]
        pipe = self.redis.pipeline(transaction=False)
        for worker in expected:
            pipe.hget(self.keys.worker(worker), "ts")
        return all(ts is not None and float(ts) > since for ts in pipe.execute())

    def _measure(self) -> None:
        """Fill in the recovery of every fault whose condition now holds."""
        for fault in self.faults:
            if fault.recovery_s is not None:
                continue
            began = self.began_wall + fault.t
            if fault.kind in ("worker-kill", "worker-stop"):
                with contextlib.suppress(redis.RedisError):
                    if fault.held:
                        some, every = self._taken_over(fault)
                        if some and fault.first_s is None:
                            fault.first_s = self.now() - fault.t
                        if every:
                            fault.recovery_s = self.now() - fault.t
            elif fault.kind == "proxy-cut":
                with contextlib.suppress(redis.RedisError):
                    if self._beating_since([m.name for k, m in enumerate(self.workers) if k % 2], began):
                        fault.recovery_s = self.now() - fault.t
            elif fault.kind == "manager-kill":
                with contextlib.suppress(redis.RedisError):
                    if self.redis.hget(self.keys.state, "paused") != b"1" and self.members["manager"].alive():
                        fault.recovery_s = self.now() - fault.t
            else:
                after = [r["t"] for r in self.ledger.records if r["kind"] == "group" and r["t"] > began]
                if after:
                    fault.recovery_s = min(after) - began

    def _line(self, phase: str = "faults") -> str:
        trained = len(self.ledger.trained_at)
        kinds = Counter(f.kind for f in self.faults)
        return f"{phase} {self.now():6.1f} s · {trained} groups trained · " + ", ".join(
            f"{k} {kinds[k]}" for k in KINDS if kinds[k]
        )

    def stop(self) -> None:
        for member in self.members.values():
            if member.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.process.pid, signal.SIGCONT)
                stop_process(member.process, timeout_s=10)
        self.proxy.close()


# -- the report --------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "n": len(values),
        "p50": round(statistics.median(ordered), 3),
        "p90": round(p90, 3),
        "p99": round(p99, 3),
        "max": round(ordered[-1], 3),
    }


def report(chaos: Chaos, wall_s: float) -> dict[str, Any]:
    """Everything checked at the end, from the trainer's ledger and Redis."""
    o, records = chaos.o, chaos.ledger.records
    client = redis.Redis.from_url(chaos.server.url)
    from pipeline.streams import Streams

    stale, dead = parked_and_dead(Streams(client, NS))
    chunks = max((r["chunk"] for r in records if r["kind"] == "submit"), default=-1) + 1
    submitted = {f"c{c}-{i}" for c in range(chunks) for i in range(o["chunk"])}
    poison = {f"c{c}-0" for c in range(chunks) if is_poison(c, 0, o["poison_every"])}
    groups = [r for r in records if r["kind"] == "group"]
    handed = Counter(rid for g in groups for rid in g["ids"])
    trained = {g["prompt"] for g in groups}
    lost = submitted - trained - stale - set(dead)
    syncs = [r for r in records if r["kind"] == "sync"]
    over = [g for g in groups if g["trainer_version"] - min(g["versions"]) > o["max_staleness"]]
    recoveries = {kind: [f.recovery_s for f in chaos.faults if f.kind == kind and f.recovery_s is not None]
                  for kind in KINDS}  # fmt: skip
    trained_times = sorted(chaos.ledger.trained_at.values())
    gaps = [b - a for a, b in pairwise(trained_times)]
    result: dict[str, Any] = {
        "workers": o["workers"],
        "duration_s": o["duration_s"],
        "wall_s": round(wall_s, 1),
        "redis": chaos.server.binary.describe() + ", appendonly yes, appendfsync everysec",
        "faults": {kind: sum(f.kind == kind for f in chaos.faults) for kind in KINDS},
        "starts": {name: m.starts for name, m in chaos.members.items()},
        "prompts": len(submitted),
        "samples": len(submitted) * o["n"],
        "trained_samples": sum(len(g["ids"]) for g in groups),
        "stale_samples": len(stale) * o["n"],
        "dead_letters": dict(Counter(dead.values())),
        "poison_prompts": len(poison),
        "poison_dead_lettered": len(poison & set(dead)),
        "innocent_dead_lettered": sorted(set(dead) - poison),
        "lost_samples": len(lost) * o["n"],
        "lost_prompts": sorted(lost)[:20],
        "duplicates": sum(count - 1 for count in handed.values()),
        "groups_not_whole": sum(g["samples"] != list(range(o["n"])) for g in groups),
        "spans_not_covering": sum(not g["spans_ok"] for g in groups),
        "groups_unscored": sum(not g["scored"] or g["reward_error"] is not None for g in groups),
        "over_staleness_bound": len(over),
        "max_staleness_seen": max((g["trainer_version"] - min(g["versions"]) for g in groups), default=0),
        "syncs": {
            "done": len(syncs),
            "refused": sum(r["kind"] == "sync-refused" for r in records),
            "evicted": sum(len(r["evicted"]) for r in syncs),
            "stall_s": percentiles([r["stall_s"] for r in syncs]),
        },
        "faults_holding_work": {kind: sum(bool(f.held) for f in chaos.faults if f.kind == kind) for kind in KINDS[:2]},
        "recovery_s": {kind: percentiles(values) for kind, values in recoveries.items()}
        | {"all": percentiles([v for values in recoveries.values() for v in values])},
        "takeover_first_s": {
            kind: percentiles([f.first_s for f in chaos.faults if f.kind == kind and f.first_s is not None])
            for kind in KINDS[:2]
        },
        "worker_faults_not_recovered": {
            kind: sum(f.held != {} and f.recovery_s is None for f in chaos.faults if f.kind == kind)
            for kind in KINDS[:2]
        },
        "dead_letter_details": [
            {
                "prompt": prompt,
                "poison": prompt in poison,
                "error": error,
                "held_by": [f"{f.kind} {f.target} at {f.t:.1f} s" for f in chaos.faults if prompt in f.held_prompts],
            }
            for prompt, error in sorted(dead.items())
        ],
        "longest_gap_between_groups_s": round(max(gaps, default=0.0), 2),
        "timeline": [
            {
                "t": round(f.t, 2),
                "kind": f.kind,
                "target": f.target,
                "held": len(f.held),
                "held_partials": sum(stream == chaos.keys.partials for stream, _ in f.held),
                "first_s": None if f.first_s is None else round(f.first_s, 3),
                "recovery_s": f.recovery_s,
            }
            for f in chaos.faults
        ],
    }
    result["ok"] = (
        result["lost_samples"] == 0
        and result["duplicates"] == 0
        and result["groups_not_whole"] == 0
        and result["spans_not_covering"] == 0
        and result["groups_unscored"] == 0
        and result["over_staleness_bound"] == 0
    )
    kill = result["recovery_s"]["worker-kill"]
    result["goals"] = {  # issue 54's: no prompt is a dead letter unless it is poison, and every poison one is
        "worker_kill_recovery_p50_le_10s": bool(kill["n"]) and kill["p50"] <= 10.0,
        "no_dead_letter_but_poison": not set(dead) - poison,
        "every_poison_dead_lettered": poison <= set(dead),
    }
    client.close()
    return result


def plot_chaos(result: dict[str, Any], chaos: Chaos, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = sorted(t - chaos.began_wall for t in chaos.ledger.trained_at.values())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), gridspec_kw={"height_ratios": [2, 1]})
    top.plot(times, range(1, len(times) + 1), color="black", lw=1.2, label="groups trained")
    palette = ("tab:red", "tab:orange", "tab:purple", "tab:blue", "tab:green", "tab:brown", "tab:pink")
    colors = dict(zip(KINDS, palette, strict=True))
    for kind in KINDS:
        marks = [f.t for f in chaos.faults if f.kind == kind]
        for k, t in enumerate(marks):
            top.axvline(t, color=colors[kind], alpha=0.35, lw=0.8, label=kind if k == 0 else None)
    top.set_xlabel("seconds")
    top.set_ylabel("groups trained")
    top.set_title(
        f"chaos: {result['workers']} workers, {sum(result['faults'].values())} faults; "
        f"lost {result['lost_samples']}, duplicates {result['duplicates']}, "
        f"over the bound {result['over_staleness_bound']}"
    )
    top.legend(loc="upper left", fontsize=8)
    data = [[f.recovery_s for f in chaos.faults if f.kind == kind and f.recovery_s is not None] for kind in KINDS]
    for k, values in enumerate(data):
        bottom.scatter([k + 1] * len(values), values, color=colors[KINDS[k]], alpha=0.6, s=12)
    bottom.set_xticks(range(1, len(KINDS) + 1), KINDS, fontsize=8)
    bottom.set_ylabel("recovery (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chaos_command(
    duration_s: Annotated[float, typer.Option(help="Seconds of faults (then the run drains).")] = 120.0,
    workers: Annotated[int, typer.Option(help="Synthetic workers (every other one behind the proxy).")] = 6,
    every_s: Annotated[float, typer.Option(help="Seconds between faults.")] = 2.0,
    kinds: Annotated[str, typer.Option(help="Fault kinds, comma-separated.")] = ",".join(KINDS),
    n: Annotated[int, typer.Option(help="Samples per prompt.")] = 4,
    tokens: Annotated[int, typer.Option(help="Tokens per sample, at most (uniform from 8).")] = 256,
    steps_per_s: Annotated[float, typer.Option(help="Synthetic engine pace: tokens a second per sample.")] = 100.0,
    chunk: Annotated[int, typer.Option(help="Prompts per submission.")] = 16,
    max_staleness: Annotated[int, typer.Option(help="The staleness bound (versions).")] = 4,
    batch_groups: Annotated[int, typer.Option(help="Groups per training step.")] = 64,
    sync_every_s: Annotated[float, typer.Option(help="Seconds between weight publishes.")] = 2.0,
    ack_timeout_s: Annotated[float, typer.Option(help="A sync's ack deadline (then eviction).")] = 4.0,
    restart_s: Annotated[float, typer.Option(help="A killed process is restarted after this.")] = 1.0,
    redis_down_s: Annotated[float, typer.Option(help="Redis stays down this long after its kill.")] = 1.0,
    warmup_s: Annotated[float, typer.Option(help="Seconds before the first fault.")] = 5.0,
    drain_timeout_s: Annotated[float, typer.Option(help="After the faults: stalled if not done within.")] = 180.0,
    seed: Annotated[int, typer.Option(help="The schedule's seed.")] = 0,
    poison_every: Annotated[
        int, typer.Option(min=0, help="A poison prompt (it kills the worker that starts it) every this many chunks.")
    ] = 0,
    plot: Annotated[Path | None, typer.Option(help="Draw groups trained, faults and recoveries to this PNG.")] = None,
    keep_logs: Annotated[Path | None, typer.Option(help="Copy every process's log and the ledger here.")] = None,
) -> None:
    """Run the pipeline under faults (kill -9 of workers, Redis, trainer, manager; hangs; cut connections) and
    report what was lost, duplicated or over the staleness bound; JSON out, exit 1 unless nothing was."""
    options = {k: v for k, v in locals().items() if k not in ("plot", "keep_logs")}
    options["kinds"] = kinds.split(",")
    if unknown := [k for k in options["kinds"] if k not in KINDS]:
        fail(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    if workers < 2:
        fail("--workers must be at least 2 (one direct, one behind the proxy)")
    from rich.live import Live

    from pipeline.local import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="rollouts-chaos-"))
    server = RedisServer(appendonly=True, data_dir=tmp / "redis")
    (tmp / "redis").mkdir()
    with user_errors():
        server.start()
    chaos = Chaos(server, tmp, options)
    try:
        with Live(console=console, transient=True) as live:
            wall_s = chaos.run(lambda line: live.update(line))
        chaos.stop()
        result = report(chaos, wall_s)
    except TimeoutError as exc:
        chaos.stop()
        fail(str(exc))
    finally:
        chaos.stop()
        if keep_logs is not None:
            shutil.copytree(tmp, keep_logs, dirs_exist_ok=True, ignore=shutil.ignore_patterns("redis"))
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if plot is not None:
        plot_chaos(result, chaos, plot)
        console.print(f"plot written to {plot}")
    print(json.dumps(result, indent=2))
    if not result["ok"]:
        raise typer.Exit(1)

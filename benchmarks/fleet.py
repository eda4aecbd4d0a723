"""`rollouts-bench fleet`: how a fleet of worker processes shares a step, and how fast a dead worker's work moves.

Two parts (issue 54's goals on spread and takeover), each on a private `redis-server`, each worker a `rollouts
worker` process with the synthetic engine, as a user runs them:

- `spread`: W workers (`--workers`, and always W = 1 first, the baseline), each with room for a whole step
  (`--max-inflight`, default 64) but an engine that runs `--max-batch` samples at once (default 8): one worker
  alone runs a step of 64 samples in 64 / 8 = 8 waves, W workers that share it in 8 / W. Steps of `--prompts`
  prompts x `--n` samples, every sample `--max-tokens` long at `--steps-per-s` tokens a second, are submitted one
  step at a time (submit the step's prompts, collect every group, next step) after `--warmup-steps` steps that are
  not counted. Per step: the samples each worker served (the rollouts' `worker` field) and the wall time from the
  first submit to the last group collected. The ideal step of W workers is the baseline's median step / W;
  `measured_over_ideal` is the median over steps of step / ideal.
- `takeover`: `--rounds` rounds for each of SIGKILL and SIGSTOP: a victim worker takes `--victim-prompts` prompts
  of long samples (minutes at its pace) alone; then `--live` live workers start (fast, with room); the victim is
  killed or stopped, and XPENDING's owners are polled every `--poll-ms` until a live worker has claimed the first
  and the last of the victim's entries. Then the victim is SIGKILLed (a stopped one too), every prompt is collected
  once through `RolloutClient.collect`, and lost prompts, duplicates and dead letters are counted.

Workers keep their defaults (heartbeat 1 s, `dead_after` 2.5 s, `--claim-idle-ms` 10 s) unless the flags say.
One JSON object on stdout; progress lines on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, cast

import redis
import typer

from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_processes, wait_for_worker
from pipeline.wire import GENERATORS, Keys, Prompt, Sampling
from rollouts.app import fail, user_errors

PARTS = ("spread", "takeover")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
SPREAD_GOAL_MAX = 24
"""Issue 54: with four workers, no worker serves more than 24 of a step's 64 samples."""
SPREAD_GOAL_RATIO = 1.25
"""Issue 54: a step of W = 2, 4, 8 workers takes at most 1.25 x the ideal (one worker's step / W)."""
TAKEOVER_GOAL_S = 3.0
"""Issue 54: at most 3 s (median) from kill -9 or SIGSTOP to a live worker starting the work."""
SYNTHETIC = Path("synthetic")


@dataclass(frozen=True)
class Settings:
    workers: tuple[int, ...] = (2, 4, 8)
    steps: int = 6
    warmup_steps: int = 1
    prompts: int = 16
    n: int = 4
    max_tokens: int = 100
    steps_per_s: float = 200.0
    max_batch: int = 8
    max_inflight: int = 64
    submit: str = "each"
    rounds: int = 10
    signals: tuple[str, ...] = ("kill", "stop")
    live: int = 2
    victim_prompts: int = 8
    victim_n: int = 2
    victim_steps_per_s: float = 10.0
    victim_max_tokens: int = 1000
    live_steps_per_s: float = 2000.0
    poll_ms: int = 20
    takeover_timeout_s: float = 30.0
    worker_flags: tuple[str, ...] = ()
    logs: Path | None = None


class Progress:
    """Where the benchmark is: one plain line on stderr a stage (a terminal or not), with the seconds since start."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def line(self, text: str) -> None:
        print(f"fleet [{time.monotonic() - self.started:7.1f} s] {text}", file=sys.stderr, flush=True)


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank (p90 of 10 values: the 9th)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 3),
        "p90": round(quantile(values, 0.9), 3),
        "max": round(max(values), 3),
        "min": round(min(values), 3),
    }


class Fleet:
    """Worker processes on one namespace, each with its log; stopped by PID at the end."""

    def __init__(self, server: RedisServer, ns: str, logs: Path) -> None:
        self.server, self.ns, self.logs = server, ns, logs
        self.redis = redis.Redis.from_url(server.url)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, names: Sequence[str], *flags: str, timeout_s: float = 180.0) -> None:
        """Start these workers at once and wait until each serves."""
        started = {
            name: start_worker(
                self.server.url, self.ns, SYNTHETIC, name, *flags, log_file=self.logs / f"{self.ns}-{name}.log"
            )
            for name in names
        }
        self.processes |= started
        for name, process in started.items():
            try:
                wait_for_worker(self.redis, self.ns, name, process, timeout_s)
            except (RuntimeError, TimeoutError) as exc:
                log = self.logs / f"{self.ns}-{name}.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"{exc}; its log ends:\n{tail}") from exc

    def kill(self, name: str) -> None:
        """SIGKILL (a stopped process dies of it too) and reap."""
        process = self.processes[name]
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait()

    def stop(self) -> None:
        stop_processes(list(self.processes.values()), timeout_s=20)
        self.redis.close()


def engine_flags(steps_per_s: float, max_batch: int, max_inflight: int, extra: Sequence[str]) -> tuple[str, ...]:
    engine = json.dumps({"steps_per_s": steps_per_s, "lengths": "max"})
    return (
        "--engine", "synthetic", "--engine-args", engine, "--max-batch", str(max_batch),
        "--max-inflight", str(max_inflight), "--log-level", "warning", *extra,
    )  # fmt: skip


# -- spread ---------------------------------------------------------------------------------------


def run_steps(server: RedisServer, workers: int, s: Settings, logs: Path, progress: Progress) -> dict[str, Any]:
    """One fleet of `workers`: its warm-up and measured steps, each submitted and collected whole."""
    from producers.client import RolloutClient  # the lab composes the packages; a trainer's client is one of them

    ns = f"spread-w{workers}"
    fleet = Fleet(server, ns, logs)
    names = [f"w{k}" for k in range(workers)]
    try:
        progress.line(f"spread: starting {workers} worker(s)")
        fleet.start(names, *engine_flags(s.steps_per_s, s.max_batch, s.max_inflight, s.worker_flags))
        client = RolloutClient(server.url, ns)
        steps: list[dict[str, Any]] = []
        for step in range(s.warmup_steps + s.steps):
            began = time.perf_counter()
            if s.submit == "each":  # one `submit` a prompt, as a trainer's loop does
                ids = [
                    client.submit(tokens=[4, 5, step % 200, k], n=s.n, max_tokens=s.max_tokens, seed=k)
                    for k in range(s.prompts)
                ]
            else:  # the whole step in one round trip
                prompts = [
                    Prompt(
                        id=f"s{step}-{k}",
                        n=s.n,
                        tokens=[4, 5, step % 200, k],
                        sampling=Sampling(max_tokens=s.max_tokens, seed=k),
                    )
                    for k in range(s.prompts)
                ]
                client.submit_prompts(prompts)
                ids = [p.id for p in prompts]
            groups = client.collect(len(ids), timeout=max(120.0, 20 * s.max_tokens / s.steps_per_s))
            wall = time.perf_counter() - began
            served = Counter(r.worker for g in groups for r in g.rollouts)
            if sorted(g.prompt_id for g in groups) != sorted(ids):
                raise RuntimeError(f"spread, W {workers}, step {step}: collected other prompts than submitted")
            if step < s.warmup_steps:
                continue
            row = {
                "wall_s": round(wall, 4),
                "served": {name: served.get(name, 0) for name in names},
                "max_served": max(served.values()),
                "samples": sum(served.values()),
            }
            steps.append(row)
            progress.line(f"spread W {workers}: step {len(steps)}/{s.steps}: {wall:.2f} s, served {row['served']}")
        dead = int(fleet.redis.xlen(Keys(ns).dead))
        result = {
            "workers": workers,
            "steps": steps,
            "median_step_s": round(statistics.median(r["wall_s"] for r in steps), 4),
            "max_served_max": max(r["max_served"] for r in steps),
            "workers_serving_min": min(sum(c > 0 for c in r["served"].values()) for r in steps),
            "duplicates": client.stats["duplicates"],
            "dead_letters": dead,
        }
        client.streams.redis.close()
        return result
    finally:
        fleet.stop()


def run_spread(server: RedisServer, s: Settings, logs: Path, progress: Progress) -> dict[str, Any]:
    wave_s = s.max_tokens / s.steps_per_s
    step_samples = s.prompts * s.n
    fleets: dict[str, dict[str, Any]] = {}
    for workers in (1, *[w for w in s.workers if w != 1]):
        fleets[str(workers)] = run_steps(server, workers, s, logs, progress)
    one = fleets["1"]["median_step_s"]
    for size, row in fleets.items():
        ideal = one / int(size)
        row["ideal_step_s"] = round(ideal, 4)
        row["measured_over_ideal"] = round(statistics.median(r["wall_s"] / ideal for r in row["steps"]), 3)
        row["engine_bound_step_s"] = round(wave_s * -(-step_samples // (s.max_batch * int(size))), 4)
    goals: dict[str, Any] = {}
    if "4" in fleets:
        goals["w4_max_served_le_24"] = fleets["4"]["max_served_max"] <= SPREAD_GOAL_MAX
    for workers in (2, 4, 8):
        if str(workers) in fleets:
            goals[f"w{workers}_step_le_1.25x_ideal"] = fleets[str(workers)]["measured_over_ideal"] <= SPREAD_GOAL_RATIO
    return {
        "settings": {
            "prompts": s.prompts,
            "n": s.n,
            "step_samples": step_samples,
            "max_tokens": s.max_tokens,
            "steps_per_s": s.steps_per_s,
            "engine_max_batch": s.max_batch,
            "max_inflight": s.max_inflight,
            "steps": s.steps,
            "warmup_steps": s.warmup_steps,
            "submit": s.submit,
            "wave_s": round(wave_s, 4),
            "worker_flags": list(s.worker_flags),
        },
        "fleets": fleets,
        "table": [
            {
                "workers": int(w),
                "median_step_s": r["median_step_s"],
                "ideal_step_s": r["ideal_step_s"],
                "measured_over_ideal": r["measured_over_ideal"],
                "max_served_max": r["max_served_max"],
            }
            for w, r in fleets.items()
        ],
        "goals": goals,
    }


# -- takeover -------------------------------------------------------------------------------------


def owners(r: redis.Redis, stream: str) -> dict[bytes, bytes]:
    """Every pending entry of the generators' group on `stream` and the consumer that holds it."""
    pending = cast("list[dict[str, Any]]", r.xpending_range(stream, GENERATORS, "-", "+", 10_000))
    return {p["message_id"]: p["consumer"] for p in pending}


def takeover_round(
    server: RedisServer, how: str, round_: int, s: Settings, logs: Path, progress: Progress
) -> dict[str, Any]:
    """One victim killed or stopped with prompts in flight; seconds until live workers hold the first and the last."""
    from producers.client import RolloutClient

    ns = f"takeover-{how}-{round_}"
    keys = Keys(ns)
    fleet = Fleet(server, ns, logs)
    live = [f"live{k}" for k in range(s.live)]
    try:
        room = s.victim_prompts * s.victim_n  # exactly its prompts: full, it asks for no more
        fleet.start(["victim"], *engine_flags(s.victim_steps_per_s, room, room, s.worker_flags))
        client = RolloutClient(server.url, ns)
        ids = [
            client.submit(tokens=[4, 5, round_ % 200, k], n=s.victim_n, max_tokens=s.victim_max_tokens, seed=k)
            for k in range(s.victim_prompts)
        ]
        deadline = time.monotonic() + 60
        while sum(o == b"victim" for o in owners(fleet.redis, keys.prompts).values()) < len(ids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"takeover {how} {round_}: the victim did not take all {len(ids)} prompts")
            time.sleep(0.02)
        fleet.start(live, *engine_flags(s.live_steps_per_s, 256, 256, s.worker_flags))
        held = {e for e, o in owners(fleet.redis, keys.prompts).items() if o == b"victim"}
        if len(held) != len(ids):
            raise RuntimeError(f"takeover {how} {round_}: the victim holds {len(held)} of {len(ids)} prompts")
        live_names = {name.encode() for name in live}
        os.kill(fleet.processes["victim"].pid, SIGNALS[how])
        began = time.monotonic()
        first = last = None
        claimed: dict[bytes, str] = {}
        # each of the victim's entries, once a live worker holds it: which one
        while time.monotonic() - began < s.takeover_timeout_s:
            now_owners = owners(fleet.redis, keys.prompts)
            elapsed = time.monotonic() - began
            for e in held - set(claimed):
                if now_owners.get(e) in live_names:
                    claimed[e] = now_owners[e].decode()
                elif e not in now_owners:
                    claimed[e] = "(finished)"  # claimed and finished between two polls
            if claimed and first is None:
                first = elapsed
            if len(claimed) == len(held):
                last = elapsed
                break
            time.sleep(s.poll_ms / 1000)
        fleet.kill("victim")  # a stopped victim too: it must not come back and publish
        groups = client.collect(len(ids), timeout=120)
        got = Counter(g.prompt_id for g in groups)
        lost = sorted(set(ids) - set(got))
        result = {
            "round": round_,
            "signal": how,
            "first_s": None if first is None else round(first, 3),
            "last_s": None if last is None else round(last, 3),
            "claimed_by": dict(Counter(claimed.values())),
            "lost": len(lost),
            "duplicates": client.stats["duplicates"] + sum(c - 1 for c in got.values()),
            "dead_letters": int(fleet.redis.xlen(keys.dead)),
        }
        client.streams.redis.close()
        progress.line(
            f"takeover {how} {round_ + 1}/{s.rounds}: first {result['first_s']} s, last {result['last_s']} s, "
            f"by {result['claimed_by']}, lost {result['lost']}, duplicates {result['duplicates']}"
        )
        return result
    finally:
        fleet.stop()


def run_takeover(server: RedisServer, s: Settings, logs: Path, progress: Progress) -> dict[str, Any]:
    by_signal: dict[str, Any] = {}
    for how in s.signals:
        rounds = [takeover_round(server, how, k, s, logs, progress) for k in range(s.rounds)]
        firsts = [r["first_s"] for r in rounds if r["first_s"] is not None]
        lasts = [r["last_s"] for r in rounds if r["last_s"] is not None]
        by_signal[how] = {
            "first_s": summary(firsts),
            "last_s": summary(lasts),
            "not_taken_over": sum(r["last_s"] is None for r in rounds),
            "lost": sum(r["lost"] for r in rounds),
            "duplicates": sum(r["duplicates"] for r in rounds),
            "dead_letters": sum(r["dead_letters"] for r in rounds),
            "rounds": rounds,
        }
    goals = {
        f"{how}_median_first_le_3s": bool(r["first_s"]["n"]) and r["first_s"]["median"] <= TAKEOVER_GOAL_S
        for how, r in by_signal.items()
    }
    goals["none_lost_or_duplicated"] = all(
        r["lost"] == 0 and r["duplicates"] == 0 and r["not_taken_over"] == 0 for r in by_signal.values()
    )
    return {
        "settings": {
            "rounds": s.rounds,
            "live_workers": s.live,
            "victim_prompts": s.victim_prompts,
            "victim_n": s.victim_n,
            "victim_sample_s": round(s.victim_max_tokens / s.victim_steps_per_s, 1),
            "poll_ms": s.poll_ms,
            "worker_flags": list(s.worker_flags),
        },
        "signals": by_signal,
        "goals": goals,
    }


def code_fingerprint() -> dict[str, str]:
    """Short hashes of the files that decide how work is taken and taken over, so that a result names what it ran."""
    root = Path(__file__).resolve().parent.parent
    files = [
        root / "consumers" / "worker.py",
        root / "pipeline" / "streams" / "work.py",
        *sorted((root / "pipeline" / "lua").glob("*.lua")),
    ]
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in files if f.is_file()}


def run_fleet(parts: Sequence[str], s: Settings, progress: Progress) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-fleet-"))
    logs = s.logs or tmp
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_before": [round(x, 2) for x in os.getloadavg()]},
        "code": code_fingerprint(),
    }
    with RedisServer() as server:
        report["redis"] = server.binary.describe()
        if "spread" in parts:
            report["spread"] = run_spread(server, s, logs, progress)
        if "takeover" in parts:
            report["takeover"] = run_takeover(server, s, logs, progress)
    report["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    report["ok"] = all(all(report[p]["goals"].values()) for p in parts)
    return report


def fleet(
    part: Annotated[str, typer.Option(help="spread, takeover or all.")] = "all",
    workers: Annotated[str, typer.Option(help="Spread: fleet sizes, comma-separated (W = 1 always runs first).")] = (
        "2,4,8"
    ),
    steps: Annotated[int, typer.Option(help="Spread: measured steps per fleet.")] = 6,
    warmup_steps: Annotated[int, typer.Option(help="Spread: steps before them, not counted.")] = 1,
    prompts: Annotated[int, typer.Option(help="Spread: prompts a step.")] = 16,
    n: Annotated[int, typer.Option(help="Spread: samples a prompt.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Spread: tokens every sample runs to.")] = 100,
    steps_per_s: Annotated[
        float, typer.Option(help="Spread: the synthetic engine's tokens a second a sample.")
    ] = 200.0,
    max_batch: Annotated[int, typer.Option(help="Spread: samples a worker's engine runs at once.")] = 8,
    max_inflight: Annotated[int, typer.Option(help="Spread: samples a worker may take (room for a whole step).")] = 64,
    submit: Annotated[
        str, typer.Option(help="Spread: each (one submit a prompt, as a trainer's loop) or batch (a step at once).")
    ] = "each",
    rounds: Annotated[int, typer.Option(help="Takeover: rounds per signal.")] = 10,
    signals: Annotated[str, typer.Option(help="Takeover: kill (SIGKILL), stop (SIGSTOP), comma-separated.")] = (
        "kill,stop"
    ),
    live: Annotated[int, typer.Option(help="Takeover: live workers with room.")] = 2,
    victim_prompts: Annotated[int, typer.Option(help="Takeover: prompts the victim holds.")] = 8,
    victim_n: Annotated[int, typer.Option(help="Takeover: samples a victim's prompt.")] = 2,
    poll_ms: Annotated[int, typer.Option(help="Takeover: how often XPENDING's owners are read.")] = 20,
    worker_flags: Annotated[
        str, typer.Option(help="More flags for every worker, space-separated (--heartbeat-s 0.5).")
    ] = "",
    logs: Annotated[Path | None, typer.Option(help="Keep the workers' logs in this folder.")] = None,
) -> None:
    """A fleet of synthetic workers: how a step spreads over W workers against the ideal, and how fast a killed or
    stopped worker's work is taken over; JSON out, exit 1 unless every goal of issue 54 it measures holds."""
    parts = PARTS if part == "all" else (part,)
    if part != "all" and part not in PARTS:
        fail(f"--part must be spread, takeover or all, not {part!r}")
    fleets = [int(w) if w.strip().isdigit() else 0 for w in workers.split(",") if w.strip()]
    if not fleets or min(fleets) < 1:
        fail(f"--workers takes worker counts >= 1, comma-separated (2,4,8), not {workers!r}")
    if submit not in ("each", "batch"):
        fail(f"--submit must be each or batch, not {submit!r}")
    chosen = tuple(x for x in signals.split(",") if x)
    if not chosen or any(x not in SIGNALS for x in chosen):
        fail(f"--signals takes kill and/or stop, comma-separated, not {signals!r}")
    if min(steps, rounds, prompts, n, max_tokens, max_batch, max_inflight, live, victim_prompts, victim_n) < 1:
        fail("--steps, --rounds, --prompts, --n, --max-tokens, --max-batch, --max-inflight, --live, --victim-* >= 1")
    settings = Settings(
        workers=tuple(dict.fromkeys(fleets)), steps=steps, warmup_steps=max(0, warmup_steps), prompts=prompts, n=n,
        max_tokens=max_tokens, steps_per_s=steps_per_s, max_batch=max_batch, max_inflight=max_inflight,
        submit=submit, rounds=rounds, signals=chosen, live=live, victim_prompts=victim_prompts, victim_n=victim_n,
        poll_ms=poll_ms, worker_flags=tuple(worker_flags.split()), logs=logs,
    )  # fmt: skip
    with user_errors():
        report = run_fleet(parts, settings, Progress())
    print(json.dumps(report, indent=2))
    if not report["ok"]:
        raise typer.Exit(1)

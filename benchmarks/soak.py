"""`rollouts soak`: a long run of the whole pipeline on the synthetic engine, watching for what grows.

A benchmark answers "how fast"; a soak answers "does it stay that way". It starts a private Redis and
K synthetic workers (processes, as a user runs them), and in this process a producer and a trainer
(`RolloutClient.batches()`, acking every batch) until N rollouts arrived. The producer keeps at most
`window` samples outstanding (submitted, not yet received), so the prompt backlog is bounded by
construction and whatever else grows is the pipeline's. The synthetic engine costs almost no CPU, so
what is measured is Redis, the worker loop and the trainer client.

Every `sample_s` seconds a thread records Redis `used_memory` and key count, the length of every
stream (`pipeline.top.snapshot`), the rollouts received so far, and the RSS of every process
(`/proc/PID/status` `VmRSS`: the workers, Redis, and this process as "trainer"). At the end:

- `exactly_once`: every submitted sample received once (`stats` duplicates 0, every group whole, no dead
  letters);
- Redis memory: min / median / max, the last quarter's median over the first's, the growth per rollout
  (least squares over the run), and the keys by kind (`{ns}:KIND...`), to tell what grew;
- stream lengths: median / max per stream, and whether the second half's maximum stays within 1.5x of
  the first half's (trimming keeps up);
- throughput: the median rollouts/s of each quarter of the run, and the last over the first;
- RSS per process: median of the first and the last quarter, their difference (MB) and the maximum.

One JSON object on stdout; `--plot` draws memory and stream lengths, throughput and RSS over time.
Exits 1 (after the JSON) when a rollout was lost or came twice.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
import redis
import typer

from pipeline.processes import start_worker, stop_processes, wait_for_worker
from pipeline.streams import Streams
from pipeline.top import snapshot
from rollouts.app import console, fail, user_errors
from rollouts.engine_spec import EngineSpec
from rollouts.worker_flags import DedupeTtlOpt

if TYPE_CHECKING:
    from rich.console import Console

    from pipeline.wire import Rollout
    from producers.client import Group, RolloutClient

NS = "soak"
STREAMS = ("prompts", "partials", "rollouts")
"""The streams that carry work; their lengths are sampled (the others stay empty in a soak)."""
TRAINER = "trainer"
"""This process's label in the RSS readings: the producer and the trainer client."""
REDIS = "redis-server"
PROMPT_TOKENS = 8
"""Tokens per prompt: small, since the soak is about the pipeline, not prefill."""


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process (Linux `/proc`), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


@dataclass
class Reading:
    """One sample of everything that could grow."""

    t: float
    """Seconds since the trainer started."""
    received: int
    used_memory: int
    stream_bytes: int
    """`MEMORY USAGE` of the work streams together (an estimate from samples of their nodes)."""
    keys: int
    lengths: dict[str, int]
    rss: dict[str, int]


class Sampler(threading.Thread):
    """Reads Redis and /proc every `every_s` seconds on its own connection, beside the trainer's loop."""

    def __init__(self, url: str, pids: dict[str, int], every_s: float, received: Callable[[], int]) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.streams = Streams(redis.Redis.from_url(url), NS)
        self.pids, self.every_s, self.received = pids, every_s, received
        self.readings: list[Reading] = []
        self.started = time.monotonic()
        self.failure: str | None = None
        self._halt = threading.Event()

    def read(self) -> Reading:
        client = self.streams.redis
        snap = snapshot(self.streams)
        lengths = {name: int(snap["streams"].get(name, {}).get("length") or 0) for name in STREAMS}
        rss = {label: size for label, pid in self.pids.items() if (size := rss_bytes(pid)) is not None}
        pipe = client.pipeline(transaction=False)
        for name in STREAMS:
            pipe.memory_usage(getattr(self.streams.keys, name))
        stream_bytes = sum(size or 0 for size in pipe.execute())
        reading = Reading(
            t=round(time.monotonic() - self.started, 3),
            received=int(self.received()),
            used_memory=int(client.info("memory")["used_memory"]),
            stream_bytes=stream_bytes,
            keys=int(client.dbsize()),
            lengths=lengths,
            rss=rss,
        )
        self.readings.append(reading)
        return reading

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            try:
                self.read()
            except redis.RedisError as exc:  # Redis stopping under us at the end: the run decides what it means
                self.failure = f"{type(exc).__name__}: {exc}"
                return

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


@dataclass
class Producer:
    """Submits `total` prompts of `n` samples, keeping at most `window` samples outstanding."""

    client: RolloutClient
    total: int
    n: int
    tokens: int
    window: int
    chunk: int = 64
    submitted: int = 0
    """Prompts submitted so far; prompt `i` has id `soak-{i}`."""
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def top_up(self, received: int) -> None:
        """Submit chunks while they fit under the window (one round trip per chunk)."""
        from pipeline.wire import Sampling

        while self.submitted < self.total:
            room = (self.window - (self.submitted * self.n - received)) // self.n
            count = min(self.chunk, room, self.total - self.submitted)
            if count <= 0:
                return
            prompts = [
                self.client.make_prompt(
                    tokens=[self.rng.randrange(3, 32_000) for _ in range(PROMPT_TOKENS)],
                    n=self.n,
                    sampling=Sampling(max_tokens=self.tokens, seed=i),
                    id=f"soak-{i}",
                )
                for i in range(self.submitted, self.submitted + count)
            ]
            self.client.submit_prompts(prompts)
            self.submitted += count


@dataclass
class Tally:
    """What the trainer was handed: each prompt's group once, whole, with the tokens asked for (`exact`: every
    sample `tokens` long; otherwise at most that, ended by its length or by an eos)."""

    prompts: int
    n: int
    tokens: int
    exact: bool = True
    seen: bytearray = field(init=False)
    """One byte per prompt (no growing set: this process's RSS is one of the things measured)."""
    groups: int = 0
    repeated: int = 0
    malformed: int = 0

    def __post_init__(self) -> None:
        self.seen = bytearray(self.prompts)

    def add(self, group: Group) -> None:
        index = int(group.prompt_id.removeprefix("soak-"))
        if self.seen[index]:
            self.repeated += 1
        self.seen[index] = 1
        self.groups += 1
        whole = [r.sample for r in group.rollouts] == list(range(self.n))
        if not whole or not all(self._as_asked(r) for r in group.rollouts):
            self.malformed += 1

    def _as_asked(self, rollout: Rollout) -> bool:
        if self.exact:
            return rollout.n_tokens == self.tokens and rollout.finish_reason == "length"
        full = rollout.finish_reason == "length" and rollout.n_tokens == self.tokens
        return 0 < rollout.n_tokens <= self.tokens and (full or rollout.finish_reason == "stop")


# -- the run ---------------------------------------------------------------------------------------


def run_soak(
    console: Console,
    *,
    rollouts: int,
    n: int,
    tokens: int,
    workers: int,
    steps_per_s: float,
    max_batch: int,
    max_inflight: int,
    window: int,
    batch_groups: int,
    sample_s: float,
    timeout_s: float,
    remember_ids: int | None,
    dedupe_ttl_s: int = 86_400,
) -> tuple[dict[str, Any], list[Reading]]:
    """Start Redis and the workers, produce and train until `rollouts` arrived, stop everything by PID."""
    from pipeline.local import RedisServer
    from producers.client import RolloutClient

    per_batch = n * batch_groups
    prompts = math.ceil(rollouts / per_batch) * batch_groups  # whole batches: the last one is handed over too
    expected = prompts * n
    spec = EngineSpec(
        kind="synthetic",
        model=Path("synthetic"),
        max_batch=max_batch,
        engine_args={"steps_per_s": steps_per_s, "lengths": "max"},
    )
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-soak-"))
    names = [f"soak-w{k}" for k in range(workers)]
    processes: list[subprocess.Popen[bytes]] = []
    sampler: Sampler | None = None
    try:
        with RedisServer() as server:
            served_by = server.binary.describe()
            try:  # the workers stop before their Redis does
                for name in names:
                    extra = ["--max-inflight", str(max_inflight), "--log-level", "warning"]
                    extra += ["--dedupe-ttl-s", str(dedupe_ttl_s)]
                    log_file = tmp / f"{name}.log"
                    worker = start_worker(
                        server.url, NS, spec.model, name, *spec.worker_args(), *extra, log_file=log_file
                    )
                    processes.append(worker)
                client = (
                    RolloutClient(server.url, NS)
                    if remember_ids is None
                    else RolloutClient(server.url, NS, remember_ids=remember_ids)
                )
                for name, process in zip(names, processes, strict=True):
                    try:
                        wait_for_worker(client.streams.redis, NS, name, process, timeout_s=120)
                    except (RuntimeError, TimeoutError) as exc:
                        raise RuntimeError(f"{exc}; its log ends:\n{_tail(tmp / f'{name}.log')}") from None
                pids = {TRAINER: os.getpid(), REDIS: server.process.pid if server.process else 0}
                pids |= {name: p.pid for name, p in zip(names, processes, strict=True)}
                producer = Producer(client, prompts, n, tokens, window)
                tally = Tally(prompts, n, tokens)
                sampler = Sampler(server.url, pids, sample_s, lambda: client.stats["received"])
                sampler.read()  # t = 0: before the first prompt
                sampler.start()
                _train(console, client, producer, tally, sampler, batch_groups, timeout_s, names, processes, tmp)
                wall_s = time.monotonic() - sampler.started
                sampler.stop()
                if sampler.failure:
                    raise RuntimeError(f"reading Redis failed during the run: {sampler.failure}")
                sampler.read()  # the end, with every batch acked
                keys_by_kind = _keys_by_kind(client.streams.redis)
                stats = dict(client.stats)
                client.streams.redis.close()
                sampler.streams.redis.close()
            finally:
                if sampler is not None and sampler.is_alive():
                    sampler.stop()
                stop_processes(processes)  # one already stopped is skipped
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    readings = sampler.readings
    exactly_once = (
        stats["received"] == expected
        and stats["duplicates"] == 0
        and stats["dead"] == 0
        and tally.groups == prompts
        and tally.repeated == 0
        and tally.malformed == 0
        and all(tally.seen)
    )
    result: dict[str, Any] = {
        "rollouts": expected,
        "prompts": prompts,
        "n": n,
        "tokens": tokens,
        "workers": workers,
        "steps_per_s": steps_per_s,
        "max_batch": max_batch,
        "max_inflight": max_inflight,
        "window": window,
        "batch_groups": batch_groups,
        "remember_ids": remember_ids,
        "dedupe_ttl_s": dedupe_ttl_s,
        "redis": served_by,
        "wall_s": round(wall_s, 1),
        "rollouts_per_s": round(expected / wall_s, 1),
        "samples": len(readings),
        "delivery": {
            "exactly_once": exactly_once,
            "received": stats["received"],
            "duplicates": stats["duplicates"],
            "dead": stats["dead"],
            "groups": tally.groups,
            "groups_repeated": tally.repeated,
            "groups_malformed": tally.malformed,
        },
        "redis_memory": _memory(readings, keys_by_kind),
        "streams": _streams(readings),
        "throughput": _throughput(readings),
        "rss_mb": _rss(readings),
    }
    return result, readings


def _train(
    console: Console,
    client: RolloutClient,
    producer: Producer,
    tally: Tally,
    sampler: Sampler,
    batch_groups: int,
    timeout_s: float,
    names: list[str],
    processes: list[subprocess.Popen[bytes]],
    tmp: Path,
) -> None:
    """The trainer's loop: take whole batches (acked when the next is asked for), top the producer up after each."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("soak: rollouts received", total=producer.total * producer.n)
        producer.top_up(0)
        with contextlib.closing(client.batches(batch_groups, timeout=timeout_s)) as batches:
            for batch in batches:
                for group in batch.groups:
                    tally.add(group)
                received = client.stats["received"]
                producer.top_up(received)
                progress.update(task, completed=received, description=_describe(sampler))
                if tally.groups >= producer.total:
                    return
                if gone := [name for name, p in zip(names, processes, strict=True) if p.poll() is not None]:
                    raise RuntimeError(f"worker {gone[0]} exited; its log ends:\n{_tail(tmp / f'{gone[0]}.log')}")


def _describe(sampler: Sampler) -> str:
    if not sampler.readings:
        return "soak: rollouts received"
    last = sampler.readings[-1]
    return f"soak: redis {last.used_memory / 2**20:.0f} MB, rollouts stream {last.lengths['rollouts']}"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _keys_by_kind(client: redis.Redis) -> dict[str, int]:
    """Keys per kind, `{ns}:KIND[:...]` -> KIND: tells which keys make up the memory at the end."""
    kinds: dict[str, int] = {}
    for key in client.scan_iter(count=10_000):
        text = key.decode(errors="replace")
        kind = text.partition(":")[2].partition(":")[0] if text.startswith("{") else text
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


# -- the summary -----------------------------------------------------------------------------------


def _quarters(readings: list[Reading]) -> list[list[Reading]]:
    """The readings in each quarter of the run's time (a reading belongs where its time falls)."""
    start, end = readings[0].t, readings[-1].t
    span = max(end - start, 1e-9)
    parts: list[list[Reading]] = [[], [], [], []]
    for r in readings:
        parts[min(3, int(4 * (r.t - start) / span))].append(r)
    return parts


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _mb(value: float) -> float:
    return round(value / 2**20, 2)


def _memory(readings: list[Reading], keys_by_kind: dict[str, int]) -> dict[str, Any]:
    used = [r.used_memory for r in readings]
    quarters = _quarters(readings)
    first, last = _median([r.used_memory for r in quarters[0]]), _median([r.used_memory for r in quarters[3]])
    in_streams = [r.stream_bytes for r in readings]
    received = np.array([r.received for r in readings], dtype=float)

    def per_rollout(values: list[int]) -> float:
        """Least-squares growth in bytes per rollout received."""
        return round(float(np.polyfit(received, np.array(values, dtype=float), 1)[0]), 1) if np.ptp(received) else 0.0

    return {
        "min_mb": _mb(min(used)),
        "median_mb": _mb(statistics.median(used)),
        "max_mb": _mb(max(used)),
        "first_quarter_mb": _mb(first),
        "last_quarter_mb": _mb(last),
        "last_vs_first": round(last / first, 3),
        "growth_bytes_per_rollout": per_rollout(used),
        "streams_max_mb": _mb(max(in_streams)),
        "streams_first_quarter_mb": _mb(_median([r.stream_bytes for r in quarters[0]])),
        "streams_last_quarter_mb": _mb(_median([r.stream_bytes for r in quarters[3]])),
        "outside_streams_growth_bytes_per_rollout": per_rollout([u - b for u, b in zip(used, in_streams, strict=True)]),
        "keys_first": readings[0].keys,
        "keys_last": readings[-1].keys,
        "keys_by_kind": keys_by_kind,
    }


def _streams(readings: list[Reading]) -> dict[str, Any]:
    """Per stream: median and max length, and whether the second half stays within 1.5x of the first half's max."""
    half = len(readings) // 2
    out: dict[str, Any] = {}
    for name in STREAMS:
        lengths = [r.lengths[name] for r in readings]
        early, late = max(lengths[: max(half, 1)]), max(lengths[half:])
        out[name] = {
            "median": statistics.median(lengths),
            "max": max(lengths),
            "last": lengths[-1],
            "bounded": late <= 1.5 * early + 1,
        }
    return out


def _rates(readings: list[Reading]) -> list[tuple[float, float]]:
    """(time, rollouts/s over the interval that ends then) between consecutive readings."""
    return [(b.t, (b.received - a.received) / (b.t - a.t)) for a, b in pairwise(readings) if b.t > a.t]


def _throughput(readings: list[Reading]) -> dict[str, Any]:
    rates = _rates(readings)
    start, end = readings[0].t, readings[-1].t
    span = max(end - start, 1e-9)
    quarters: list[list[float]] = [[], [], [], []]
    for t, rate in rates:
        quarters[min(3, int(4 * (t - start - 1e-9) / span))].append(rate)
    medians = [round(_median(q), 1) for q in quarters]
    return {
        "quarters_median_per_s": medians,
        "last_vs_first": round(medians[3] / medians[0], 3) if medians[0] else None,
        "min_quarter_per_s": min(medians),
        "interval_s": round(span / max(len(rates), 1), 3),
    }


def _rss(readings: list[Reading]) -> dict[str, Any]:
    quarters = _quarters(readings)
    labels = sorted({label for r in readings for label in r.rss}, key=lambda s: (s != TRAINER, s != REDIS, s))
    out: dict[str, Any] = {}
    for label in labels:
        first = _median([r.rss[label] for r in quarters[0] if label in r.rss])
        last = _median([r.rss[label] for r in quarters[3] if label in r.rss])
        out[label] = {
            "first_quarter": _mb(first),
            "last_quarter": _mb(last),
            "growth": _mb(last - first),
            "max": _mb(max(r.rss[label] for r in readings if label in r.rss)),
        }
    return out


def plot_soak(result: dict[str, Any], readings: list[Reading], path: Path) -> None:
    """Three panels over time: Redis memory with stream lengths, throughput, and RSS per process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r.t for r in readings]
    fig, (mem, rate, rss) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    mem.plot(t, [r.used_memory / 2**20 for r in readings], color="black", label="Redis used_memory (MB)")
    mem.plot(t, [r.stream_bytes / 2**20 for r in readings], color="grey", ls="--", label="of it: streams (MB)")
    mem.set_ylabel("Redis used_memory (MB)")
    mem.set_ylim(bottom=0)
    lengths = mem.twinx()
    for name, color in zip(STREAMS, ("tab:blue", "tab:orange", "tab:green"), strict=True):
        lengths.plot(t, [r.lengths[name] for r in readings], color=color, alpha=0.7, lw=1, label=f"{name} length")
    lengths.set_ylabel("stream length (entries)")
    lengths.set_ylim(bottom=0)
    handles = mem.get_legend_handles_labels()[0] + lengths.get_legend_handles_labels()[0]
    mem.legend(handles, [str(h.get_label()) for h in handles], loc="upper left", fontsize=8)
    memory = result["redis_memory"]
    mem.set_title(
        f"{result['rollouts']:,} rollouts of {result['tokens']} tokens, {result['workers']} synthetic workers: "
        f"Redis {memory['first_quarter_mb']:.0f} → {memory['last_quarter_mb']:.0f} MB, "
        f"{memory['growth_bytes_per_rollout']:.0f} B/rollout",
        fontsize=10,
    )

    rates = _rates(readings)
    rate.plot([x for x, _ in rates], [y for _, y in rates], lw=1, label="rollouts/s per interval")
    start, end = t[0], t[-1]
    for k, median in enumerate(result["throughput"]["quarters_median_per_s"]):
        lo, hi = start + k * (end - start) / 4, start + (k + 1) * (end - start) / 4
        rate.hlines(median, lo, hi, colors="tab:red", lw=2, label="quarter median" if k == 0 else None)
    rate.set_ylabel("rollouts/s")
    rate.set_ylim(bottom=0)
    rate.legend(loc="lower right", fontsize=8)

    for label in result["rss_mb"]:
        rss.plot(t, [r.rss.get(label, float("nan")) / 2**20 for r in readings], lw=1, label=label)
    rss.set_ylabel("RSS (MB)")
    rss.set_xlabel("seconds")
    rss.set_ylim(bottom=0)
    rss.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def soak(
    rollouts: Annotated[
        int, typer.Option(min=1, help="Rollouts to receive (rounded up to whole batches).")
    ] = 1_000_000,
    n: Annotated[int, typer.Option(min=1, help="Samples per prompt.")] = 4,
    tokens: Annotated[int, typer.Option(min=1, help="Tokens per rollout (every sample runs to it).")] = 16,
    workers: Annotated[int, typer.Option(min=1, help="Synthetic worker processes.")] = 2,
    steps_per_s: Annotated[
        float, typer.Option(min=0.01, help="The synthetic engine's decode steps per second.")
    ] = 1000.0,
    max_batch: Annotated[int, typer.Option(min=1, help="Requests each synthetic engine decodes at once.")] = 256,
    max_inflight: Annotated[int, typer.Option(min=1, help="Samples in flight per worker.")] = 256,
    window: Annotated[
        int, typer.Option(min=1, help="Samples outstanding at most (submitted, not yet received).")
    ] = 4096,
    batch_groups: Annotated[int, typer.Option(min=1, help="Groups per trainer batch.")] = 50,
    sample_s: Annotated[float, typer.Option(min=0.05, help="Seconds between readings.")] = 1.0,
    timeout_s: Annotated[float, typer.Option(help="Fail when no rollout arrives for this long.")] = 60.0,
    remember_ids: Annotated[
        int | None, typer.Option(help="The trainer client's dedupe window in rollout ids (default: the client's).")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Draw memory, stream lengths, throughput and RSS to this PNG.")
    ] = None,
    dedupe_ttl_s: DedupeTtlOpt = 86_400,
) -> None:
    """A long run on synthetic workers: Redis memory, stream lengths, throughput and every process's RSS over time;
    checks that every rollout arrived exactly once; JSON out."""
    if window < n:
        fail(f"--window ({window}) must hold at least one prompt's {n} samples")
    with user_errors():
        try:
            result, readings = run_soak(
                console,
                rollouts=rollouts,
                n=n,
                tokens=tokens,
                workers=workers,
                steps_per_s=steps_per_s,
                max_batch=max_batch,
                max_inflight=max_inflight,
                window=window,
                batch_groups=batch_groups,
                sample_s=sample_s,
                timeout_s=timeout_s,
                remember_ids=remember_ids,
                dedupe_ttl_s=dedupe_ttl_s,
            )
        except (RuntimeError, TimeoutError) as exc:
            fail(str(exc))
        if plot is not None:
            plot_soak(result, readings, plot)
            console.print(f"plot written to {plot}")
    print(json.dumps(result, indent=2))
    if not result["delivery"]["exactly_once"]:
        raise typer.Exit(1)

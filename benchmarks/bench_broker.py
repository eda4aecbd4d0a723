"""`rollouts bench-broker`: our publish and consume paths against raw XADD and PipelineRL's streams, in one run.

What a worker does after generation, and what a trainer does to receive, with nothing else around them: on one
private `redis-server`, each round

1. `raw`: pipelined `XADD`s of exactly the bytes our rollouts carry (their wire fields, encoded beforehand), and a
   pipelined `XREADGROUP` + `XACK` of them, undecoded: the ceiling of any client of this Redis on this machine;
2. `ours`: `--rollouts` rollouts of `--tokens` tokens in groups of `--n`, built as the worker builds them and
   published as the worker publishes them (`pipeline.publisher.Publisher`: the dedupe check and the prompt
   entry's ack in one atomic script a prompt; what is ready together goes in one pipeline), from prompt entries a
   worker read, as many in flight as a worker holds; then received through `RolloutClient.groups()`
   (decode, dedupe, whole groups, acks), every rollout checked to arrive exactly once;
3. `pipelinerl` (with `--pipelinerl-src DIR`): PipelineRL's own `RedisStreamWriter`/`RedisStreamReader`
   (`pipelinerl/streams.py`, imported from DIR as it is) with what its actor writes: one entry a group, the
   group's `TrainingText.model_dump()`s, pickled; its reader reads them back.

Sides run one after the other inside each round (the server flushed between them), so that noise on a shared
machine hits every side; rates are medians over the rounds, ratios are medians of the per-round ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, cast

import numpy as np
import redis
import typer
from rich.console import Console

from pipeline.codec import RawFields, for_redis
from pipeline.connections import connect
from pipeline.durability import MODES
from pipeline.local import RedisServer, SentinelTopology
from pipeline.publisher import Publisher
from pipeline.streams import Entry, Streams
from pipeline.wire import GENERATORS, TRAINER, Prompt, Rollout, Sampling
from rollouts.app import console, fail, user_errors
from rollouts.worker_flags import MaxInflightOpt

NS = "bench"
PROMPT_TOKENS = 64
RAW_CHUNK = 256
"""Commands per pipeline round trip on the raw side."""


@dataclass(frozen=True)
class Shape:
    rollouts: int
    n: int
    tokens: int
    batch_groups: int
    """Groups in a trainer's batch."""

    @property
    def groups(self) -> int:
        return self.rollouts // self.n


@dataclass(frozen=True)
class Sample:
    """What an engine hands the worker for one sample: the arrays a rollout carries (the same on every side)."""

    prompt_tokens: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray


def make_samples(shape: Shape, seed: int = 0) -> list[Sample]:
    """One sample per position in a group: random token ids and logprobs (every group carries the same arrays)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 32_000, PROMPT_TOKENS, dtype=np.int32)
    return [
        Sample(prompt, rng.integers(3, 32_000, shape.tokens, dtype=np.int32), -rng.random(shape.tokens, np.float32) * 4)
        for _ in range(shape.n)
    ]


def build_rollout(prompt: Prompt, sample: int, arrays: Sample, worker: str) -> Rollout:
    """A rollout as the worker builds it from a finished generation (`consumers.worker._generate_sample`)."""
    finished = time.time()
    spans = [(0, 0, len(arrays.tokens))]
    return Rollout(
        prompt_id=prompt.id,
        sample=sample,
        n=prompt.n,
        version=0,
        version_end=0,
        finish_reason="length",
        worker=worker,
        prompt_tokens=prompt.tokens,
        tokens=arrays.tokens,
        logprobs=arrays.logprobs,
        spans=spans,
        meta=prompt.meta,
        timing={"queued_s": 0.0, "generate_s": 0.0, "finished": finished},
        reward_fn=prompt.reward_fn,
    )


# -- our side ----------------------------------------------------------------------------------


def take_prompts(streams: Streams, shape: Shape, samples: list[Sample], tag: str) -> list[tuple[Entry, Prompt]]:
    """Queue a group's prompt per `n` rollouts and read them back as a worker does (untimed: the work to publish)."""
    prompts = [
        Prompt(id=f"{tag}-{i}", n=shape.n, tokens=samples[0].prompt_tokens, sampling=Sampling(max_tokens=shape.tokens))
        for i in range(shape.groups)
    ]
    for at in range(0, len(prompts), 1024):
        streams.writer.add_prompts(prompts[at : at + 1024])
    taken: list[tuple[Entry, Prompt]] = []
    while len(taken) < len(prompts):
        entries = streams.work.read_work("bench-worker", 1024, None)
        taken += [(e, Prompt.from_fields(e.fields)) for e in entries]
    return taken


def publish_ours(streams: Streams, work: list[tuple[Entry, Prompt]], samples: list[Sample], in_flight: int) -> float:
    """Build each group's rollouts and publish them with their prompt entry's ack, as the worker does: from asyncio,
    through its `Publisher`, with as many prompts in flight as a worker's default `--max-inflight` holds."""
    publisher = Publisher(streams.writer)

    async def one(room: asyncio.Semaphore, entry: Entry, prompt: Prompt) -> None:
        async with room:
            rollouts = [build_rollout(prompt, k, samples[k], "bench-worker") for k in range(prompt.n)]
            if await publisher.publish(rollouts, entry) != prompt.n:
                raise RuntimeError(f"the publish of {prompt.id} did not add its {prompt.n} rollouts")

    async def publish_all() -> None:
        room = asyncio.Semaphore(max(1, in_flight // len(samples)))
        try:
            await asyncio.gather(*(one(room, entry, prompt) for entry, prompt in work))
        finally:
            await publisher.close()

    started = time.perf_counter()
    asyncio.run(publish_all())
    return time.perf_counter() - started


def consume_ours(url: str, shape: Shape) -> tuple[float, Counter[str]]:
    """Receive every group through the trainer client, in batches as a trainer takes them (each batch acked when the
    trainer comes back for the next); count each rollout id (exactly once is the contract)."""
    from producers.client import RolloutClient  # the CLI composes the packages; a producer is one of them

    client = RolloutClient(url, NS, consumer="bench-trainer")
    seen: Counter[str] = Counter()
    started = time.perf_counter()
    for count, batch in enumerate(client.batches(shape.batch_groups, timeout=60), start=1):
        seen.update(r.id for r in batch.rollouts)
        if count * shape.batch_groups == shape.groups:
            break
    elapsed = time.perf_counter() - started
    client.streams.redis.close()
    return elapsed, seen


def round_ours(
    client: redis.Redis, url: str, shape: Shape, samples: list[Sample], tag: str, in_flight: int
) -> dict[str, Any]:
    streams = Streams(client, NS)
    streams.ensure_groups()
    work = take_prompts(streams, shape, samples, tag)
    publish_s = publish_ours(streams, work, samples, in_flight)
    pending = streams.redis.xpending(streams.keys.prompts, GENERATORS)["pending"]
    consume_s, seen = consume_ours(url, shape)
    wanted = {f"{tag}-{i}:{k}" for i in range(shape.groups) for k in range(shape.n)}
    return {
        "publish_s": publish_s,
        "consume_s": consume_s,
        "exactly_once": set(seen) == wanted and all(c == 1 for c in seen.values()),
        "consumed": sum(seen.values()),
        "prompts_left_pending": pending,
    }


# -- the ceiling: raw commands of the same bytes --------------------------------------------------


def round_raw(client: redis.Redis, shape: Shape, samples: list[Sample]) -> dict[str, Any]:
    """Pipelined XADD of our rollouts' wire fields, encoded beforehand; then pipelined XREADGROUP + XACK."""
    prompt = Prompt(id="raw", n=shape.n, tokens=samples[0].prompt_tokens)
    fields = [build_rollout(prompt, k, samples[k], "bench-worker").to_fields() for k in range(shape.n)]
    stream = f"{{{NS}}}:raw"
    client.xgroup_create(stream, TRAINER, id="0", mkstream=True)
    started = time.perf_counter()
    for at in range(0, shape.rollouts, RAW_CHUNK):
        pipe = client.pipeline(transaction=False)
        for i in range(at, min(at + RAW_CHUNK, shape.rollouts)):
            pipe.xadd(stream, for_redis(fields[i % shape.n]))
        pipe.execute()
    publish_s = time.perf_counter() - started
    started, read = time.perf_counter(), 0
    while read < shape.rollouts:
        # RESP2's reply, in bytes: [[stream, [(id, fields), ...]]] (cast, not parsed: this side measures redis-py)
        reply = cast(
            "list[tuple[bytes, list[tuple[bytes, RawFields]]]]",
            client.xreadgroup(TRAINER, "raw", {stream: ">"}, count=512),
        )
        ids = [entry_id for entry_id, _fields in reply[0][1]]
        client.xack(stream, TRAINER, *ids)
        read += len(ids)
    return {"publish_s": publish_s, "consume_s": time.perf_counter() - started, "consumed": read}


# -- PipelineRL's side ----------------------------------------------------------------------------


def load_pipelinerl(src: Path) -> tuple[ModuleType, ModuleType]:
    """PipelineRL's `streams` and `rollouts` modules from a checkout, as they are (not its package `__init__`,
    which pulls in its whole training stack)."""
    modules = []
    for name in ("streams", "rollouts"):
        path = src / "pipelinerl" / f"{name}.py"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: --pipelinerl-src must be a checkout of ServiceNow/PipelineRL")
        spec = importlib.util.spec_from_file_location(f"pipelinerl_bench_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[0], modules[1]


def round_pipelinerl(
    streams_mod: ModuleType, rollouts_mod: ModuleType, shape: Shape, samples: list[Sample], tag: str
) -> dict[str, Any]:
    """Their actor's publish (a group's `TrainingText` dumps, one pickled entry) and their trainer's reader."""
    spec = streams_mod.SingleStreamSpec(exp_path=Path("bench"), topic=f"actor-{tag}")
    started = time.perf_counter()
    with streams_mod.RedisStreamWriter(spec, mode="w") as writer:
        for g in range(shape.groups):
            texts = [_training_text(rollouts_mod, samples[k], f"{tag}-{g}") for k in range(shape.n)]
            writer.write([text.model_dump() for text in texts])
    publish_s = time.perf_counter() - started
    started, read = time.perf_counter(), 0
    with streams_mod.RedisStreamReader(spec) as reader:
        for group in reader.read():
            read += len(group)
            if read >= shape.rollouts:
                break
    return {"publish_s": publish_s, "consume_s": time.perf_counter() - started, "consumed": read}


def _training_text(rollouts_mod: ModuleType, sample: Sample, group_id: str) -> Any:
    """Their rollout record with our sample's tokens (its `text` left empty: we carry no text either)."""
    prompt, completion = sample.prompt_tokens.tolist(), sample.tokens.tolist()
    return rollouts_mod.TrainingText(
        text="",
        n_predicted=len(completion),
        logprobs=sample.logprobs.tolist(),
        input_ids=prompt + completion,
        labels=[-100] * len(prompt) + completion,
        group_id=group_id,
        finished=True,
        prompt_tokens=len(prompt),
        output_tokens=len(completion),
    )


# -- the run ------------------------------------------------------------------------------------


def with_replica(stack: contextlib.ExitStack, primary: RedisServer, aof: bool, fsync: str = "everysec") -> RedisServer:
    """A replica of `primary`, in sync before it returns (and both with an AOF fsynced as `fsync` says, for `aof`)."""
    replica = stack.enter_context(RedisServer())
    for server in (primary, replica):
        with contextlib.closing(redis.Redis.from_url(server.url)) as admin:
            admin.config_set("repl-diskless-sync-delay", 0)
            if aof:
                admin.config_set("appendonly", "yes")
                admin.config_set("appendfsync", fsync)
    with contextlib.closing(redis.Redis.from_url(replica.url, decode_responses=True)) as admin:
        admin.replicaof("127.0.0.1", primary.port)
        deadline = time.monotonic() + 30
        while admin.info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not sync with the primary within 30 s")
            time.sleep(0.05)
    return replica


def run_bench_broker(
    out: Console,
    shape: Shape,
    rounds: int,
    pipelinerl_src: Path | None,
    in_flight: int = 256,
    durability: Sequence[str] = (),
    sentinel: bool = False,
    fsync: str = "everysec",
) -> dict[str, Any]:
    """With `sentinel`, the server is the primary of a `SentinelTopology` (one replica, three Sentinels), `ours` goes
    to it directly and `ours-sentinel` and `ours-sentinel-MODE` through the Sentinels (whose every durable write also
    asks them whether its server is still the primary)."""
    samples = make_samples(shape)
    theirs = load_pipelinerl(pipelinerl_src) if pipelinerl_src is not None else None
    results: dict[str, list[dict[str, Any]]] = {"raw": [], "ours": []}
    if theirs:
        results["pipelinerl"] = []
    aof = any("aof" in mode for mode in durability)
    with contextlib.ExitStack() as stack:
        if sentinel:
            fsyncing = {"appendfsync": fsync} if aof else {}
            topology = stack.enter_context(SentinelTopology(replicas=1, appendonly=aof, settings=fsyncing))
            server = topology.servers[0]
            durable = {"sentinel": topology.url}
            durable |= {f"sentinel-{mode}": f"{topology.url}?durability={mode}" for mode in durability}
        else:
            server = stack.enter_context(RedisServer())
            if durability:  # every side then runs with the replica attached: only the waiting differs
                with_replica(stack, server, aof=aof, fsync=fsync)
            durable = {mode: f"{server.url}?durability={mode}" for mode in durability}
        for side in durable:
            results[f"ours-{side}"] = []
        client = redis.Redis.from_url(server.url)
        if theirs is not None:
            theirs[0].set_streams_backend("redis", host="127.0.0.1", port=server.port)
        for r in range(rounds):
            sides: dict[str, Callable[[], dict[str, Any]]] = {
                "raw": lambda: round_raw(client, shape, samples),
                "ours": partial(round_ours, client, server.url, shape, samples, f"r{r}", in_flight),
            }
            for mode, url in durable.items():
                sides[f"ours-{mode}"] = partial(round_ours, connect(url), url, shape, samples, f"r{r}", in_flight)
            if theirs is not None:
                sides["pipelinerl"] = partial(round_pipelinerl, *theirs, shape, samples, f"r{r}")
            for side, run in sides.items():
                client.flushall()
                results[side].append(run())
                row = results[side][-1]
                out.print(
                    f"round {r + 1}/{rounds} {side}: publish {shape.rollouts / row['publish_s']:,.0f}/s, "
                    f"consume {shape.rollouts / row['consume_s']:,.0f}/s"
                )
        client.flushall()
        redis_text = server.binary.describe() + (" with a replica" if durability or sentinel else "")
        redis_text += " and three Sentinels" if sentinel else ""
        redis_text += f", AOF fsynced {'every write' if fsync == 'always' else 'every second'}" if aof else ""
    return summarize(shape, rounds, results, redis_text)


def summarize(shape: Shape, rounds: int, results: dict[str, list[dict[str, Any]]], redis_text: str) -> dict[str, Any]:
    """Medians per side; for ours against each other side, the median of the per-round ratios."""

    def rates(side: str, phase: str) -> list[float]:
        return [shape.rollouts / row[f"{phase}_s"] for row in results[side]]

    report: dict[str, Any] = {
        "rollouts": shape.rollouts,
        "n": shape.n,
        "tokens": shape.tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "batch_groups": shape.batch_groups,
        "rounds": rounds,
        "redis": redis_text,
    }
    for side in results:
        report[side] = {
            f"{phase}_per_s": round(statistics.median(rates(side, phase)), 1) for phase in ("publish", "consume")
        } | {f"{phase}_rounds": [round(v, 1) for v in rates(side, phase)] for phase in ("publish", "consume")}
    ours = results["ours"]
    report["ours"]["exactly_once"] = all(row["exactly_once"] for row in ours)
    report["ours"]["consumed"] = [row["consumed"] for row in ours]
    report["ours"]["prompts_left_pending"] = max(row["prompts_left_pending"] for row in ours)
    report["ratios"] = {}
    for side in (side for side in results if side.startswith("ours-")):  # a durability mode against the default
        report[side]["exactly_once"] = all(row["exactly_once"] for row in results[side])
        report["ratios"][f"{side}_over_ours"] = {
            phase: round(
                statistics.median(a / b for a, b in zip(rates(side, phase), rates("ours", phase), strict=True)), 3
            )
            for phase in ("publish", "consume")
        }
    for other in (side for side in results if side != "ours" and not side.startswith("ours-")):
        report["ratios"][f"ours_over_{other}"] = {
            phase: round(
                statistics.median(a / b for a, b in zip(rates("ours", phase), rates(other, phase), strict=True)), 3
            )
            for phase in ("publish", "consume")
        }
    return report


def bench_broker(
    rollouts: Annotated[int, typer.Option(min=1, help="Rollouts per round and side.")] = 20_480,
    n: Annotated[int, typer.Option(min=1, help="Samples per prompt (group size).")] = 4,
    tokens: Annotated[int, typer.Option(min=1, help="Generated tokens per rollout.")] = 1024,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds of each side; medians are reported.")] = 5,
    batch_groups: Annotated[int, typer.Option(min=1, help="Groups in each batch the trainer client hands over.")] = 64,
    max_inflight: MaxInflightOpt = 256,
    pipelinerl_src: Annotated[
        Path | None,
        typer.Option(help="A checkout of ServiceNow/PipelineRL: also run its Redis stream writer and reader."),
    ] = None,
    durability: Annotated[
        str,
        typer.Option(
            help="Durability modes to run beside the default, comma-separated (replica, aof, replica-aof): every "
            "side then runs with a replica attached."
        ),
    ] = "",
    sentinel: Annotated[
        bool, typer.Option(help="Behind three Sentinels: ours through them beside ours direct, each mode through them.")
    ] = False,
    appendfsync: Annotated[
        str, typer.Option(help="The servers' AOF fsync policy in the aof modes: everysec or always.")
    ] = "everysec",
) -> None:
    """Publish and consume rollouts/s of our broker path, raw pipelined XADD of the same bytes beside it, and with
    --pipelinerl-src PipelineRL's own streams and the ratios; JSON out."""
    if rollouts % (n * batch_groups):
        fail(f"--rollouts {rollouts} is not a whole number of batches of {batch_groups} groups of {n}")
    assert max_inflight is not None  # the option's default here is 256: only a caller in Python could pass None
    if appendfsync not in ("everysec", "always"):
        fail(f"--appendfsync {appendfsync}: everysec or always")
    modes = [mode for mode in durability.split(",") if mode]
    if unknown := [mode for mode in modes if mode not in MODES or mode == "default"]:
        fail(f"--durability {','.join(unknown)}: name modes among {', '.join(m for m in MODES if m != 'default')}")
    with user_errors():
        result = run_bench_broker(
            console, Shape(rollouts, n, tokens, batch_groups), rounds, pipelinerl_src, max_inflight, modes, sentinel,
            appendfsync,
        )  # fmt: skip
    print(json.dumps(result, indent=2))

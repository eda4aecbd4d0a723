"""`rollouts chaos-trainer`: the trainer of a chaos run, a process the run kills and restarts.

It does what an RL trainer does with the pipeline, and writes down what it did in a ledger (JSON lines,
flushed and fsynced before it comes back for more, the way a trainer's checkpoint is written before
its next step):

- a producer thread submits prompts `c{chunk}-{i}` in chunks through admission (`max_staleness`,
  `batch_size`); each chunk is written down (`submit`) before it is submitted, and submitted again on
  restart: the same prompt ids are the same submission, which admission queues once;
- the main loop takes whole groups under the staleness bound and writes each down (`group`: its rollout
  ids, their versions, the trainer version it was checked against, whether the spans cover every token);
- every `sync_every_s` it publishes new weights (`sync`), which pauses every worker.

On restart it reads the ledger, tells the client what it already trained on (`mark_seen`), submits the
last chunk again and goes on. It exits 0 once every prompt of the run is accounted for: trained on here,
parked as stale, or a dead letter.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from pipeline.codec import as_entries
from pipeline.wire import Partial, Prompt, Rollout, WireError
from rollouts.app import user_errors

if TYPE_CHECKING:
    from pipeline.streams import Streams
    from producers.client import Group, RolloutClient


POISON_TOKEN = 2000
"""A token no other prompt of the run holds: the chaos run's synthetic workers die starting a prompt that holds it
(`poison_token`)."""


def prompt_ids(chunk: int, size: int) -> list[str]:
    return [f"c{chunk}-{i}" for i in range(size)]


def is_poison(chunk: int, index: int, every: int) -> bool:
    """With a poison prompt every `every` chunks (0: none), whether prompt `index` of `chunk` is one: the first of
    chunks every-1, 2*every-1, ..."""
    return every > 0 and index == 0 and chunk % every == every - 1


@dataclass
class Ledger:
    """The trainer's durable record: one JSON object a line, fsynced before the next step."""

    path: Path
    chunks_begun: int = 0
    trained: set[str] = field(default_factory=set)
    """Rollout ids trained on so far (by every incarnation)."""
    prompts_trained: set[str] = field(default_factory=set)

    @classmethod
    def open(cls, path: Path) -> Ledger:
        ledger = cls(path)
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line, cut short by a kill -9: never fsynced, never acted on
                continue
            if record["kind"] == "submit":
                ledger.chunks_begun = max(ledger.chunks_begun, record["chunk"] + 1)
            elif record["kind"] == "group":
                ledger.trained.update(record["ids"])
                ledger.prompts_trained.add(record["prompt"])
        return ledger

    def write(self, record: dict[str, Any]) -> None:
        record["t"] = round(time.time(), 3)
        record["pid"] = os.getpid()
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
            out.flush()
            os.fsync(out.fileno())


def spans_cover(rollout: Rollout) -> bool:
    """Spans tile the tokens from 0 to the end, in order, with versions that never go back."""
    at, last = 0, -1
    for version, start, end in rollout.spans:
        if start != at or end < start or version < last:
            return False
        at, last = end, version
    return at == len(rollout.tokens)


def parked_and_dead(streams: Streams) -> tuple[set[str], dict[str, str]]:
    """Prompt ids parked on `{ns}:stale`, and prompt ids dead-lettered on `{ns}:dead` with their reasons."""
    keys, client = streams.keys, streams.redis
    stale = {dead_prompt_id(fields) for _, fields in as_entries(client.xrange(keys.stale))}
    dead = {
        dead_prompt_id(fields): fields.get(b"error", b"").decode(errors="replace")
        for _, fields in as_entries(client.xrange(keys.dead))
    }
    return stale, dead


def dead_prompt_id(fields: dict[bytes, bytes]) -> str:
    """The prompt id of a rollout, partial or prompt (a dead letter, a parked rollout), or `?` for junk.

    Tried in that order: a rollout's fields would also read as a prompt (its `id` is the rollout's)."""
    for decode in (Rollout.from_fields, Partial.from_fields, Prompt.from_fields):
        try:
            item = decode(fields)
        except (WireError, ValueError, KeyError):
            continue
        if isinstance(item, Rollout):
            return item.prompt_id
        return item.prompt.id if isinstance(item, Partial) else item.id
    return "?"


class Run:
    """One incarnation of the chaos trainer."""

    def __init__(self, url: str, ns: str, ledger: Ledger, settings: dict[str, Any]) -> None:
        from producers.client import ParkingBound, RolloutClient

        self.ledger, self.s = ledger, settings
        limits = {"max_staleness": settings["max_staleness"], "batch_size": settings["batch_groups"] * settings["n"]}
        park = ParkingBound(settings["max_staleness"])  # the bound the chaos run checks is held through a fault
        self.client = RolloutClient(url, ns, consumer="trainer", submit_timeout_s=3600, park=park, **limits)
        self.producer_client = RolloutClient(url, ns, consumer="producer", submit_timeout_s=3600, **limits)
        self.client.mark_seen(ledger.trained)
        self.stop_file: Path | None = settings["stop_file"]
        self.produced = False
        self.failure: str | None = None

    def produce(self) -> None:
        """Submit the last chunk begun again (a no-op if it went in), then new ones until the stop file appears."""
        try:
            chunk = max(0, self.ledger.chunks_begun - 1)
            while chunk < self.s["chunks"]:
                if chunk >= self.ledger.chunks_begun:
                    if self.stop_file is not None and self.stop_file.exists():
                        break
                    self.ledger.write({"kind": "submit", "chunk": chunk})
                    self.ledger.chunks_begun = chunk + 1
                self.producer_client.submit_prompts(self.chunk_prompts(self.producer_client, chunk))
                chunk += 1
            self.produced = True
        except Exception as exc:  # the run reports it; the trainer loop stops on it
            self.failure = f"producer: {type(exc).__name__}: {exc}"

    def chunk_prompts(self, client: RolloutClient, chunk: int) -> list[Prompt]:
        from pipeline.wire import Sampling

        size, n, tokens, poison = self.s["chunk"], self.s["n"], self.s["tokens"], self.s["poison_every"]
        return [
            client.make_prompt(
                tokens=[3 + (chunk * size + i) % 1000, 7, 11] + ([POISON_TOKEN] if is_poison(chunk, i, poison) else []),
                n=n,
                sampling=Sampling(max_tokens=tokens, seed=i),
                id=pid,
                meta={"ids": list(range(3, 3 + 1000))},  # what `token_set_reward` counts
                reward_fn=self.s["reward_fn"],
            )
            for i, pid in enumerate(prompt_ids(chunk, size))
        ]

    def submitted(self) -> set[str]:
        return {p for c in range(self.ledger.chunks_begun) for p in prompt_ids(c, self.s["chunk"])}

    def done(self) -> bool:
        if not self.produced:
            return False
        stale, dead = parked_and_dead(self.client.streams)
        return self.submitted() <= (self.ledger.prompts_trained | stale | set(dead))

    def train(self) -> None:
        threading.Thread(target=self.produce, name="producer", daemon=True).start()
        last_sync = time.monotonic()
        while not self.done():
            if self.failure:
                raise RuntimeError(self.failure)
            try:
                for group in self.client.groups(timeout=2.0):
                    self.step(group)
                    if time.monotonic() - last_sync >= self.s["sync_every_s"]:
                        self.sync()
                        last_sync = time.monotonic()
                    if self.produced and len(self.ledger.prompts_trained) >= len(self.submitted()):
                        break
            except TimeoutError:
                if time.monotonic() - last_sync >= self.s["sync_every_s"]:  # nothing came: the version still moves
                    self.sync()
                    last_sync = time.monotonic()

    def step(self, group: Group) -> None:
        """Train on one group: write it down (fsync) before coming back for the next, which acks it."""
        assert group.trainer_version is not None
        self.ledger.write({
            "kind": "group",
            "prompt": group.prompt_id,
            "ids": [r.id for r in group.rollouts],
            "versions": [r.version for r in group.rollouts],
            "trainer_version": group.trainer_version,
            "spans_ok": all(spans_cover(r) for r in group.rollouts),
            "scored": self.s["reward_fn"] is None or all(r.reward is not None for r in group.rollouts),
            "reward_error": group.reward_error,
            "samples": sorted(r.sample for r in group.rollouts),
        })  # fmt: skip
        self.ledger.trained.update(r.id for r in group.rollouts)
        self.ledger.prompts_trained.add(group.prompt_id)

    def sync(self) -> None:
        import torch

        from staleness.manager import SyncError

        begun = time.monotonic()
        self.ledger.write({"kind": "sync-begin"})
        try:
            version = self.client.publish_weights(
                {"w": torch.zeros(4)}, transport="redis://", mode=self.s["mode"], ack_timeout_s=self.s["ack_timeout_s"]
            )
        except SyncError as exc:  # a sync of an earlier incarnation is still being finished by the manager
            self.ledger.write({"kind": "sync-refused", "why": str(exc)})
            return
        report = self.client.last_sync
        assert report is not None
        self.ledger.write({
            "kind": "sync", "version": version, "stall_s": round(report.stall_s, 4),
            "evicted": report.evicted, "took_s": round(time.monotonic() - begun, 4),
        })  # fmt: skip


def chaos_trainer(
    redis_url: Annotated[str, typer.Option("--redis")],
    ns: Annotated[str, typer.Option("--ns")],
    ledger: Annotated[Path, typer.Option(help="The trainer's record (JSON lines); read back on restart.")],
    chunks: Annotated[int, typer.Option(help="Submit at most this many chunks.")] = 1_000_000,
    stop_file: Annotated[Path | None, typer.Option(help="Submit no new chunk once this file exists.")] = None,
    chunk: Annotated[int, typer.Option(help="Prompts per submission.")] = 16,
    n: Annotated[int, typer.Option()] = 4,
    tokens: Annotated[int, typer.Option()] = 32,
    max_staleness: Annotated[int, typer.Option()] = 2,
    batch_groups: Annotated[int, typer.Option(help="Groups per training step (B = this x n samples).")] = 8,
    sync_every_s: Annotated[float, typer.Option()] = 3.0,
    ack_timeout_s: Annotated[float, typer.Option()] = 5.0,
    mode: Annotated[str, typer.Option()] = "abort",
    reward_fn: Annotated[
        str | None, typer.Option(help="Prompts name this reward (scored by `rollouts scorer`).")
    ] = None,
    poison_every: Annotated[int, typer.Option(help="A poison prompt every this many chunks (0: none).")] = 0,
) -> None:
    """Train through a chaos run until every prompt is accounted for (see `rollouts chaos`)."""
    settings = dict(
        chunks=chunks, stop_file=stop_file, chunk=chunk, n=n, tokens=tokens, max_staleness=max_staleness,
        batch_groups=batch_groups, sync_every_s=sync_every_s, ack_timeout_s=ack_timeout_s, mode=mode,
        reward_fn=reward_fn, poison_every=poison_every,
    )  # fmt: skip
    with user_errors(redis_url):
        run = Run(redis_url, ns, Ledger.open(ledger), settings)
        run.ledger.write({"kind": "start", "trained": len(run.ledger.trained)})
        run.train()
        run.ledger.write({"kind": "done"})

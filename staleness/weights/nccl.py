"""`nccl://HOST:PORT`: the trainer broadcasts a version's tensors to every engine worker in one collective group.

Nothing is stored: the trainer (rank 0) hosts a `torch.distributed.TCPStore` at HOST:PORT for the
rendezvous, and during each sync, between the manager's `weights` command and its wait for acks:
1. the trainer writes `e{epoch}/meta` (JSON: version, backend, bucket size, `[name, dtype, shape]`s,
   and `group`: the generation of the group it holds, or null);
2. each worker checks the names and shapes against its model (if they do not fit it declines),
   counts itself in `e{epoch}/workers` (its index i) and writes `e{epoch}/w{i}` (JSON: its name, the
   ranks it needs, 1 for `torch`, the tensor-parallel size for `vllm`, and the generation it holds);
   joined or declined, it then counts itself in `e{epoch}/answered`, the one counter the trainer polls;
3. once every live worker (the manager's count, from the Redis heartbeats) joined or declined, or the
   join deadline passed, the trainer agrees the membership and sets `e{epoch}/world` (JSON:
   generation, world size, each member's first rank, in the order they joined). The group is
   **kept** when the workers that joined are exactly its members (same names, same rank counts) and
   each still holds it; otherwise
   (someone joined, left, died, failed a load, or the trainer restarted) a new one is built, its
   generation the sync's epoch. A worker not in the world failed to join in time, and says so;
4. a new group is built over `PrefixStore(g{generation}/pg)` (NCCL when the trainer's tensors are on a
   GPU; gloo otherwise, which is how the same protocol runs, and is tested, on CPUs) and warmed up
   with a one-byte broadcast. Each receiver then posts, without waiting, a one-element all-reduce (the
   "ready" barrier) and a receive for every bucket, and counts itself in `e{epoch}/posted`; the trainer
   waits for that count and the barrier, then sends the tensors from rank 0 as raw bytes in buckets of
   `bucket_bytes`, 16-byte aligned, in meta order. Over NCCL a bucket goes as its parts in one NCCL
   group (`bucket_parts`: each tensor of `copy_from` bytes or more from its own memory, runs of smaller
   ones packed); over gloo whole. Packing is double buffered: bucket k+1 is packed while bucket k is on
   the wire. A worker posts its receives before it pauses its engine (`prepare_receiver`), so the bytes
   cross while it still generates and it stands still only to load them;
5. the trainer deletes the epoch's keys. A replaced group is freed on a thread of its own, off the
   stall (NCCL takes about half a second to destroy a communicator); a failed broadcast drops it.

Only raw bytes and JSON cross the store and the group (no pickle). A worker that starts between
syncs cannot fetch the current version from the trainer: a live peer that holds it pushes it, as a one-off trainer
(`PeerPush`, `push_from_peer`, run where the peer's weights are: `consumers.peer`), else it waits, paused, for the
next sync.
The receiving side runs in whatever process holds the engine's weights (the worker for `torch`,
vLLM's worker processes for `vllm`), so GPU weights go from GPU to GPU; each such process keeps its
group between syncs, as the trainer does.

A LoRA adapter's version goes the same way (its config in the meta, `adapter_config`), received by the worker
process itself (one rank a worker, whatever the engine: an adapter is a few MB), which keeps a CPU copy so that it
can load the adapter later on demand. Give adapters a port of their own: a group is kept while its membership
(ranks per worker) stays the same, and a vLLM worker with tensor parallelism takes more ranks for the base model.

This module is the transport (the trainer's publish and send, and the worker's calls into the protocol); the group
both sides build is `staleness.weights.nccl_group`, the receiving ranks `staleness.weights.nccl_receive`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from staleness.weights import nccl_group
from staleness.weights.base import Opening, PublishStats, Receiving, Transport, WeightsUri, check_version, uri_version
from staleness.weights.buckets import (
    ALIGN,
    COPY_FROM,
    Part,
    TensorMeta,
    bucket_parts,
    bucket_size,
    dtype_name,
    pack_bucket,
    plan_buckets,
    raw_bytes,
)
from staleness.weights.handover import Handover, LoadsWeights
from staleness.weights.nccl_group import NO_GROUP, KeptGroup
from staleness.weights.nccl_receive import (
    BroadcastLink,
    drop_link,
    forget_group,
    join_broadcast,
    prepare_receiver,
    receive_broadcast,
)
from staleness.weights.sources import WeightSource, named_tensors

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BroadcastLink",
    "BroadcastStats",
    "NcclTransport",
    "PeerPush",
    "drop_link",
    "forget_group",
    "join_broadcast",
    "prepare_receiver",
    "push_from_peer",
    "receive_broadcast",
]
"""The transport, and the receiving side's calls (`staleness.weights.nccl_receive`) that tests and probes make here."""

DEFAULT_BUCKET_BYTES = 256 << 20
"""Bytes per broadcast: big enough to run near link speed, small enough for two buffers on the GPU."""

_SERVERS: dict[int, dist.TCPStore] = {}
"""The trainer's rendezvous stores, by port: one per process, kept across syncs."""
_TRAINER_GROUPS: dict[int, KeptGroup] = {}
"""The trainer's group, by rendezvous port: a fresh `NcclTransport` per publish finds it here."""


@dataclass
class BroadcastStats:
    """What one broadcast moved and how long it took (the trainer's view)."""

    version: int
    epoch: int
    workers: int
    ranks: int
    backend: str
    bytes: int = 0
    join_s: float = 0.0
    """Waiting for the workers to join (after the `weights` command)."""
    setup_s: float = 0.0
    """Building a new group, up to a first one-byte broadcast (NCCL makes its communicator then); 0 when kept."""
    ready_s: float = 0.0
    """Waiting, group built, until every receiver posted its receives (their count in the store, then the ready
    barrier)."""
    transfer_s: float = 0.0
    """Every bucket's broadcast, from the ready barrier until the last completed: what `gb_per_s` divides by."""
    generation: int = NO_GROUP
    """The group's generation (the epoch of the sync that built it)."""
    reused: bool = False
    """Whether the group of an earlier sync carried this one (no setup)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


@dataclass(frozen=True)
class _Outgoing:
    """A staged version laid out for the wire once, when it is published (while the workers still generate), not in
    the sync: each bucket's parts, an alone part with its tensor's bytes (a view: nothing is copied). The first bucket
    waits for whatever the host does first, so the host's work is done before the sync starts."""

    metas: list[TensorMeta]
    tensors: list[torch.Tensor]
    buckets: list[list[tuple[Part, torch.Tensor | None]]]
    nbytes: int
    device: torch.device
    backend: str

    @classmethod
    def of(cls, named: Mapping[str, torch.Tensor], bucket_bytes: int, backend: str | None = None) -> _Outgoing:
        """`named` laid out in buckets of `bucket_bytes`, for the backend of their device (or `backend`)."""
        metas = [TensorMeta(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in named.items()]
        tensors = list(named.values())
        device = next((t.device for t in tensors), torch.device("cpu"))
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        buckets, nbytes = [], 0
        for bucket in plan_buckets(metas, bucket_bytes):
            parts = bucket_parts(metas, bucket, nccl_group.grouped(backend), COPY_FROM)
            buckets.append([(p, raw_bytes(tensors[p.members[0][0]]) if p.alone else None) for p in parts])
            nbytes += bucket_size(metas, bucket)
        return cls(metas, tensors, buckets, nbytes, device, backend)




# -- the trainer's side --------------------------------------------------------------------------


class NcclTransport(Transport):
    """`nccl://HOST:PORT`: `publish` stages a version, `broadcast` sends it during the manager's sync (`push`).

    HOST:PORT is where the workers reach this process (the rendezvous store listens on PORT). Tensors
    on a GPU go over NCCL; CPU tensors over gloo. Keep the module unchanged until the sync returns:
    tensors on a GPU are not copied. The group of one sync is kept for the next while its members
    stay the same (per PORT, in this process: `publish_weights` opens a transport per call).

    Pushed, not stored: a worker joins the broadcast before it pauses (`join`: its engine's receivers find or build
    their group and post their receives) and receives paused; one that missed it awaits the next sync.
    """

    scheme = "nccl"
    stores = False
    pushes = True

    def __init__(
        self, host: str, port: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0
    ) -> None:
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
        self.host, self.port = host, port
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._staged: tuple[int, _Outgoing] | None = None
        self._adapter_config: dict[str, Any] | None = None
        """The staged version's LoRA config when it is an adapter's (it travels in the meta)."""
        self.last: BroadcastStats | None = None
        """What the last broadcast moved, and how fast."""

    @classmethod
    def parse(cls, uri: str, rest: str) -> WeightsUri:
        """`nccl://HOST:PORT` (the trainer's rendezvous), `nccl://HOST:PORT/v{n}` for a version."""
        location, _, tail = rest.partition("/")
        version = uri_version(uri, "nccl", location, tail.strip("/"))
        host, colon, port = location.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"weights uri {uri!r}: expected nccl://HOST:PORT")
        return WeightsUri("nccl", location, version)

    @classmethod
    def open(cls, spec: str, parsed: WeightsUri, opening: Opening) -> NcclTransport:
        """This process hosts the rendezvous on PORT, waiting up to `join_timeout_s` for the workers to join a sync;
        `bucket_bytes` is a broadcast's size (at least `ALIGN`)."""
        buckets = {} if opening.bucket_bytes is None else {"bucket_bytes": max(opening.bucket_bytes, ALIGN)}
        host, _, port = parsed.location.rpartition(":")
        return cls(host, int(port), timeout_s=opening.join_timeout_s, **buckets)

    def uri_of(self, version: int) -> str:
        return f"nccl://{self.host}:{self.port}/v{check_version(version)}"

    def put(self, tensors: WeightSource, version: int, adapter_config: Mapping[str, Any] | None) -> PublishStats:
        """Stage `version` for the next `broadcast` (on the tensors' GPU, if any). With
        `adapter_config`, the tensors are a LoRA adapter's (PEFT names) and the config travels in the meta.

        An iterable of `(name, tensor)` pairs is consumed here, before the sync (every name and shape must be in the
        meta that the workers check before they pause), and its tensors are kept where they are until the broadcast:
        yield them on the GPU and the host holds none of them; CPU tensors (gloo) are held in host memory, the whole
        version (`last_publish.peak_buffered_bytes`)."""
        stats = PublishStats()
        named: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors(tensors, keep_device=True):
            named[name] = tensor
            stats.tensors += 1
            stats.bytes += tensor.nbytes
            if tensor.device.type == "cpu":
                stats.hold(stats.peak_buffered_bytes + tensor.nbytes)
            del tensor
        devices = {t.device for t in named.values() if t.device.type != "cpu"}
        if len(devices) > 1:
            raise ValueError(f"the tensors lie on several devices ({sorted(map(str, devices))}): put them on one")
        if devices:
            device = devices.pop()
            named = {k: t.to(device) for k, t in named.items()}
        self._staged = (version, _Outgoing.of(named, self.bucket_bytes))
        self._adapter_config = None if adapter_config is None else dict(adapter_config)
        self._server()  # listening before the workers hear of the version
        return stats

    def _server(self) -> dist.TCPStore:
        store = _SERVERS.get(self.port)
        if store is None:
            store = _SERVERS[self.port] = nccl_group.open_store(self.host, self.port, self.timeout_s, server=True)
        return store

    def broadcast(self, epoch: int, workers: int) -> BroadcastStats:
        """Send the staged version to the `workers` live workers of sync `epoch` (the manager's transfer step).

        Waits up to `timeout_s` for them to join; goes on with those that did (the others fail to load,
        do not ack, and are evicted). Raises `RuntimeError` if nothing is staged.
        """
        if self._staged is None:
            raise RuntimeError("nothing to broadcast: publish() a version first")
        version, outgoing = self._staged
        metas, device, backend = outgoing.metas, outgoing.device, outgoing.backend
        kept = _TRAINER_GROUPS.get(self.port)
        if kept is not None and (kept.backend, kept.device) != (backend, str(device)):
            self._drop()  # the tensors moved: a group on the old device cannot send them
            kept = None
        stats = BroadcastStats(version, epoch, 0, 0, backend)
        store = self._server()
        prefix = f"e{epoch}/"
        meta = {
            "v": nccl_group.META_V,
            "version": version,
            "backend": backend,
            "bucket_bytes": self.bucket_bytes,
            "copy_from": COPY_FROM,
            "group": kept.generation if kept else None,
            "tensors": [[m.name, m.dtype, list(m.shape)] for m in metas],
        }
        if self._adapter_config is not None:
            meta["adapter_config"] = self._adapter_config
        store.set(prefix + "meta", json.dumps(meta, separators=(",", ":")))
        started = time.monotonic()
        deadline = started + self.timeout_s
        while store.add(prefix + "answered", 0) < workers and time.monotonic() < deadline:
            time.sleep(0.002)
        stats.workers = store.add(prefix + "workers", 0)
        joined = [json.loads(store.get(f"{prefix}w{i}")) for i in range(1, stats.workers + 1)]
        plan = self._agree(kept, joined, epoch)
        stats.generation, stats.reused = plan.generation, plan is kept
        stats.ranks = plan.world - 1
        ranks = {m: first for m, (first, _) in plan.members.items()}
        world = {"generation": plan.generation, "world": plan.world, "ranks": ranks}
        store.set(prefix + "world", json.dumps(world, separators=(",", ":")))
        stats.join_s = time.monotonic() - started
        try:
            if stats.ranks:
                self._send(store, stats, plan, outgoing)
        except BaseException:
            self._drop()  # a member may be gone mid-broadcast: the next sync builds a new group
            raise
        finally:
            keys = ["meta", "answered", "workers", "world", "posted"] + [f"w{i}" for i in range(1, stats.workers + 1)]
            for key in keys:
                store.delete_key(prefix + key)
        self.last = stats
        return stats

    def _agree(self, kept: KeptGroup | None, joined: list[dict[str, Any]], epoch: int) -> KeptGroup:
        """The group of this sync: `kept` when the workers that joined are its members and still hold it, else a
        new membership (not yet built: `_send` builds it), its generation this epoch."""
        asked = {str(j["member"]): int(j["ranks"]) for j in joined}
        if (
            kept is not None
            and asked == {m: count for m, (_, count) in kept.members.items()}
            and all(int(j["holds"]) == kept.generation for j in joined)
        ):
            return kept
        members: dict[str, tuple[int, int]] = {}
        for name, count in asked.items():  # in the order they joined, rank 0 being the trainer
            members[name] = (1 + sum(c for _, c in members.values()), count)
        return KeptGroup(epoch, 1 + sum(asked.values()), members=members)

    def close(self) -> None:
        """Free this port's group and stop hosting its rendezvous: a one-off sender (a peer that shared its version,
        `consumers.peer`) keeps nothing for a next sync."""
        self._drop()
        self._staged = None
        _SERVERS.pop(self.port, None)  # the store's server stops listening once its last reference goes

    def _drop(self) -> None:
        kept = _TRAINER_GROUPS.pop(self.port, None)
        if kept is not None:
            nccl_group.close_later(kept.group)

    def _send(
        self,
        store: dist.Store,
        stats: BroadcastStats,
        plan: KeptGroup,
        outgoing: _Outgoing,
    ) -> None:
        device = outgoing.device
        started = time.monotonic()
        # The trainer's current device is left as it was: only this block works on the tensors' GPU.
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            if plan.group is None:
                self._drop()
                plan.group = nccl_group.build_group(
                    store, plan.generation, 0, plan.world, stats.backend, self.timeout_s
                )
                plan.backend, plan.device = stats.backend, str(device)
                nccl_group.GROUPS_BUILT["trainer"] += 1
                _TRAINER_GROUPS[self.port] = plan
                nccl_group.warm_up(plan.group, device)
                stats.setup_s = time.monotonic() - started
            started = time.monotonic()
            self._wait_posted(store, stats)
            nccl_group.barrier(plan.group, device).wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stats.ready_s = time.monotonic() - started
            started = time.monotonic()
            stats.bytes = self._send_buckets(plan.group, outgoing)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stats.transfer_s = time.monotonic() - started

    def _wait_posted(self, store: dist.Store, stats: BroadcastStats) -> None:
        """Until every receiving rank has posted all its receives (`prepare_receiver` counts them in `posted`), or the
        timeout: a rank that posts its receives (a call a part) while the bytes already flow, in a worker whose engine
        holds the GIL, holds the wire to its pace. The ready barrier that follows is posted before the receives, so it
        alone cannot tell."""
        deadline = time.monotonic() + self.timeout_s
        key = f"e{stats.epoch}/posted"
        while store.add(key, 0) < stats.ranks and time.monotonic() < deadline:
            time.sleep(0.0005)

    def _send_buckets(self, group: dist.ProcessGroup, outgoing: _Outgoing) -> int:
        """Broadcast every bucket, double buffered: bucket k+1 is packed into one buffer while bucket k goes from
        the other. A buffer is packed again only after its last broadcast completed (`wait`: on the CPU for gloo,
        on the current CUDA stream for NCCL, so the GPU copies overlap the transfer without blocking the host).
        Over NCCL a bucket goes as its parts (`bucket_parts`) in one group: big tensors from their own memory, only
        runs of small ones packed (one `torch.cat` a run: copied one by one, many small tensors keep the host, and so
        the wire, waiting on launches)."""
        buffers: list[torch.Tensor | None] = [None, None]
        in_flight: list[list[dist.Work]] = [[], []]
        device = outgoing.device
        padding = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
        for k, parts in enumerate(outgoing.buckets):
            slot = k % 2
            payloads = []
            for part, alone in parts:
                if alone is not None:  # one tensor: its own bytes, no copy
                    payloads.append(alone)
                    continue
                buffer = buffers[slot]
                if buffer is None:
                    buffer = buffers[slot] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
                for work in in_flight[slot]:
                    work.wait()  # the buffer of bucket k-2 is free again
                in_flight[slot] = []
                pack_bucket(part.members, outgoing.tensors, buffer, padding, start=part.start)
                payloads.append(buffer[part.start : part.end])
            in_flight[slot] += nccl_group.broadcast_parts(group, payloads)
        for works in in_flight:
            for work in works:
                work.wait()
        return outgoing.nbytes

    def push(self, epoch: int, workers: int) -> BroadcastStats:
        """The manager's transfer step: `broadcast`."""
        return self.broadcast(epoch, workers)

    @property
    def last_push(self) -> BroadcastStats | None:
        return self.last

    # -- the worker's side

    @classmethod
    async def join(cls, engine: LoadsWeights, uri: WeightsUri, version: int, receiving: Receiving) -> _Joined:
        """Join sync `receiving.epoch`'s broadcast as `receiving.member` with the engine's receivers (the worker's name;
        the group is kept across syncs while its members stay), and have them find or build their group and post
        their receives (`engine.prepare_handover`), while generation goes on; `load` receives, paused. An engine that
        cannot take a rank (`check_placement`) or whose model does not take the tensors declines, so that nobody waits
        for it. A failure after the join forgets the group (the trainer's next sync must not count on a group this
        worker may not hold)."""
        epoch = _epoch_of(uri, receiving)

        def check(shapes: dict[str, tuple[int, ...]], source: str) -> None:
            cls.check_placement(engine, Handover(cls.scheme, version))
            engine.check_fits(shapes, source)

        link = await asyncio.to_thread(
            join_broadcast, str(uri), epoch, version, engine.weight_receivers, receiving.timeout_s, check,
            receiving.member,
        )  # fmt: skip
        joined = _Joined(link)
        try:
            await engine.prepare_handover(joined.handover)
        except BaseException:
            link.forget()
            raise
        return joined

    @classmethod
    async def join_here(cls, uri: WeightsUri, version: int, receiving: Receiving) -> _Joined:
        """Join sync `receiving.epoch`'s broadcast as one rank of this process (an adapter's, or a version sent while
        the worker has no engine), and post its receives, while generation goes on."""
        epoch = _epoch_of(uri, receiving)
        link = await asyncio.to_thread(
            join_broadcast, str(uri), epoch, version, 1, receiving.timeout_s, None, receiving.member
        )
        try:
            await asyncio.to_thread(prepare_receiver, link, 0, "cuda")  # gloo receives on the CPU whatever is asked
        except BaseException:
            link.forget()
            raise
        return _Joined(link)

    @classmethod
    def leave(cls, uri: str, member: str) -> None:
        forget_group(uri, member)

    @classmethod
    def check_placement(cls, engine: LoadsWeights, handover: Handover) -> None:
        """A rank in each process that holds the weights: anywhere but in a server reached over HTTP."""
        if engine.placement.where == "server":
            raise ValueError(NO_BROADCAST)

    @classmethod
    def prepare_handover(cls, handover: Handover, rank: int, device: torch.device) -> None:
        """Find or build receiver `rank`'s group and post its receives (`prepare_receiver`)."""
        prepare_receiver(BroadcastLink.from_dict(handover.data), rank, device)

    @classmethod
    def open_handover(
        cls, handover: Handover, rank: int, device: torch.device
    ) -> AbstractContextManager[Iterable[tuple[str, torch.Tensor]]]:
        """The tensors as receiver `rank` takes them (`receive_broadcast`): every rank must drain them."""
        return contextlib.nullcontext(receive_broadcast(BroadcastLink.from_dict(handover.data), rank, device))


# -- a peer's one-off push ------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerPush:
    """One push of the version a peer holds to the workers that joined mid-run and asked it (`consumers.peer`): the
    peer acts as a one-off trainer, its rendezvous on `host:port`. Plain data: it crosses to vLLM's worker processes."""

    host: str
    port: int
    version: int
    epoch: int
    members: int
    """Joiners expected in the broadcast."""
    timeout_s: float
    on_host: bool
    """Send host copies of the tensors over gloo, not the tensors on their GPU over NCCL: a joiner has no GPU, or
    shares one with the peer or another joiner (NCCL puts no two ranks of a group on one GPU)."""

    @property
    def uri(self) -> str:
        return f"nccl://{self.host}:{self.port}/v{check_version(self.version)}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PeerPush:
        return cls(str(data["host"]), int(data["port"]), int(data["version"]), int(data["epoch"]),
                   int(data["members"]), float(data["timeout_s"]), bool(data["on_host"]))  # fmt: skip


def push_from_peer(
    push: PeerPush, tensors: Iterable[tuple[str, torch.Tensor]], staged: Callable[[], None]
) -> BroadcastStats:
    """The sending side of a peer's push, on the caller's thread, in the process that holds `tensors` (checkpoint
    names, on one device): stage them (host copies when `push.on_host`), listen on the rendezvous, call `staged()`
    (the peer tells its joiners where to join), broadcast to `push.members`, then free the group and stop listening.
    The tensors are only read."""
    transport = NcclTransport(push.host, push.port, timeout_s=push.timeout_s)
    try:
        named = ((name, t.to("cpu")) for name, t in tensors) if push.on_host else tensors
        transport.put(named, push.version, None)
        staged()
        return transport.broadcast(push.epoch, push.members)
    finally:
        transport.close()


NO_BROADCAST = (
    "the remote engine loads weights by path, from fs:// or redis:// syncs; an nccl:// broadcast would need a rank in "
    "each of the server's worker processes (vLLM's own NCCL weight transfer, not wired here): publish with fs:// "
    "(a directory the server sees) or redis://"
)


def _epoch_of(uri: WeightsUri, receiving: Receiving) -> int:
    if receiving.epoch is None:
        raise ValueError(f"weights {uri}: an nccl version is received during its sync: give its epoch")
    return receiving.epoch


@dataclass(frozen=True)
class _Joined:
    """A broadcast joined before the pause: the engine's receivers (`load`), or one rank of this process (`receive`)."""

    link: BroadcastLink

    @property
    def handover(self) -> Handover:
        """The broadcast as the engine's receiving processes open it: its link."""
        link = self.link
        return Handover("nccl", link.version, link.to_dict(), f"the broadcast from {link.host}:{link.port}")

    async def load(self, engine: LoadsWeights) -> None:
        """Receive and load it into the engine (paused meanwhile, or not: its choice)."""
        try:
            await engine.load_handover(self.handover)
        except BaseException:
            self.link.forget()  # the receivers may have lost the group: the next sync builds anew
            raise

    async def receive(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """CPU copies of the tensors (kept to load later) and the adapter config of the meta, if any."""
        link = self.link

        def receive() -> dict[str, torch.Tensor]:
            return {name: tensor.to("cpu", copy=True) for name, tensor in receive_broadcast(link, 0, "cuda")}

        try:
            tensors = await asyncio.to_thread(receive)
        except BaseException:
            link.forget()
            raise
        config = json.loads(link.meta).get("adapter_config")
        return tensors, config if isinstance(config, dict) else None

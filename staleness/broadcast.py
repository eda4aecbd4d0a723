"""`nccl://HOST:PORT`: the trainer broadcasts a version's tensors to every engine worker in one collective group.

Nothing is stored: the trainer (rank 0) hosts a `torch.distributed.TCPStore` at HOST:PORT for the
rendezvous, and during each sync, between the manager's `weights` command and its wait for acks:
1. the trainer writes `e{epoch}/meta` (JSON: version, backend, bucket size, `[name, dtype, shape]`s);
2. each worker checks the names and shapes against its model (if they do not fit it declines),
   takes a block of ranks with `ADD e{epoch}/ranks k` (k = the engine's receiving processes: 1 for
   `torch`, the tensor-parallel size for `vllm`) and counts itself in `e{epoch}/workers`; joined or
   declined, it then counts itself in `e{epoch}/answered`, the one counter the trainer polls;
3. once every live worker joined or declined (or the join deadline passed) the trainer sets `e{epoch}/world`;
   a worker whose ranks fall outside it failed to join in time, and says so;
4. everyone builds one process group over `PrefixStore(e{epoch}/pg)` (NCCL when the trainer's tensors
   are on a GPU; gloo otherwise, which is how the same protocol runs, and is tested, on CPUs), and the
   tensors go from rank 0 as raw bytes in buckets of `bucket_bytes`, 16-byte aligned, in meta order;
5. the trainer deletes the epoch's keys; every side frees the group on a thread of its own, off the
   stall (NCCL takes about half a second to destroy a communicator).

Only raw bytes and JSON cross the store and the group (no pickle). A worker that starts between
syncs cannot fetch the current version from anywhere: it waits, paused, for the next sync.
The receiving side runs in whatever process holds the engine's weights (the worker for `torch`,
vLLM's worker processes for `vllm`), so GPU weights go from GPU to GPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from staleness.transports import NamedTensors, Scheme, check_version, parse_uri, state_dict_of

META_V = 1
DEFAULT_BUCKET_BYTES = 256 << 20
"""Bytes per broadcast: big enough to run near link speed, small enough for a second buffer on the GPU."""
ALIGN = 16
"""Every tensor starts at a multiple of this in its bucket, so that a byte slice views as any dtype."""

_SERVERS: dict[int, dist.TCPStore] = {}
"""The trainer's rendezvous stores, by port: one per process, kept across syncs."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize


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
    """Building the group, up to a first one-byte broadcast (NCCL makes its communicator then)."""
    transfer_s: float = 0.0
    """Every bucket's broadcast, until the last completed: what `gb_per_s` divides by."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


@dataclass(frozen=True)
class BroadcastLink:
    """What a receiving process needs to join one epoch's group: plain data, so that it crosses to vLLM's workers."""

    host: str
    port: int
    epoch: int
    version: int
    first_rank: int
    world: int
    timeout_s: float
    meta: str
    """The trainer's JSON meta: version, backend, bucket size, tensors."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BroadcastLink:
        return cls(**data)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in the broadcast's meta")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_buckets(tensors: list[TensorMeta], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """Split tensors (in order) into buckets: per bucket, `(tensor index, byte offset)`; a big tensor gets its own."""
    buckets: list[list[tuple[int, int]]] = []
    used = bucket_bytes  # forces a new bucket for the first tensor
    for index, meta in enumerate(tensors):
        if meta.nbytes == 0:
            continue
        offset = -(-used // ALIGN) * ALIGN
        if offset + meta.nbytes > bucket_bytes:
            buckets.append([])
            offset = 0
        buckets[-1].append((index, offset))
        used = offset + meta.nbytes
    return buckets


def _bucket_size(tensors: list[TensorMeta], bucket: list[tuple[int, int]]) -> int:
    index, offset = bucket[-1]
    return offset + tensors[index].nbytes


def _store(host: str, port: int, timeout_s: float, server: bool) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, server, timedelta(seconds=timeout_s), wait_for_workers=False, use_libuv=True)


def _group(store: dist.Store, epoch: int, rank: int, world: int, backend: str, timeout_s: float) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(f"e{epoch}/pg/", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    return dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=timeout_s))


def _close_later(group: dist.ProcessGroup) -> None:
    """Free the group on a thread of its own: NCCL takes ~0.5 s to destroy a communicator, and
    nobody need wait for it (the workers resume, the trainer goes back to training)."""
    shutdown = getattr(group, "shutdown", None)  # NCCL: free the communicator now, not at exit
    if callable(shutdown):
        threading.Thread(target=shutdown, name="broadcast-teardown", daemon=True).start()


def _broadcast(group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    group.broadcast([buffer], dist.BroadcastOptions()).wait()


def _warm_up(group: dist.ProcessGroup, device: torch.device) -> None:
    """One byte from rank 0, so that setup (NCCL's communicator is built lazily) is not counted as transfer."""
    _broadcast(group, torch.zeros(1, dtype=torch.uint8, device=device))


# -- the trainer's side --------------------------------------------------------------------------


class NcclTransport:
    """`nccl://HOST:PORT`: `publish` stages a version, `broadcast` sends it during the manager's sync.

    HOST:PORT is where the workers reach this process (the rendezvous store listens on PORT). Tensors
    on a GPU go over NCCL; CPU tensors over gloo. Keep the module unchanged until the sync returns:
    tensors on a GPU are not copied.
    """

    scheme: Scheme = "nccl"

    def __init__(
        self, host: str, port: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0
    ) -> None:
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
        self.host, self.port = host, port
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self.last: BroadcastStats | None = None
        """What the last broadcast moved, and how fast."""

    @classmethod
    def from_uri(cls, uri: str, **kwargs: Any) -> NcclTransport:
        host, _, port = parse_uri(uri).location.rpartition(":")
        return cls(host, int(port), **kwargs)

    def uri_of(self, version: int) -> str:
        return f"nccl://{self.host}:{self.port}/v{check_version(version)}"

    def publish(self, tensors: NamedTensors | torch.nn.Module, version: int) -> str:
        """Stage `version` for the next `broadcast` (on the tensors' GPU, if any); returns its uri."""
        named = state_dict_of(tensors, keep_device=True)
        devices = {t.device for t in named.values() if t.device.type != "cpu"}
        if len(devices) > 1:
            raise ValueError(f"the tensors lie on several devices ({sorted(map(str, devices))}): put them on one")
        if devices:
            device = devices.pop()
            named = {k: t.to(device) for k, t in named.items()}
        self._staged = (check_version(version), named)
        self._server()  # listening before the workers hear of the version
        return self.uri_of(version)

    def _server(self) -> dist.TCPStore:
        store = _SERVERS.get(self.port)
        if store is None:
            store = _SERVERS[self.port] = _store(self.host, self.port, self.timeout_s, server=True)
        return store

    def broadcast(self, epoch: int, workers: int) -> BroadcastStats:
        """Send the staged version to the `workers` live workers of sync `epoch` (the manager's transfer step).

        Waits up to `timeout_s` for them to join; goes on with those that did (the others fail to load,
        do not ack, and are evicted). Raises `RuntimeError` if nothing is staged.
        """
        if self._staged is None:
            raise RuntimeError("nothing to broadcast: publish() a version first")
        version, named = self._staged
        metas = [TensorMeta(k, _dtype_name(t.dtype), tuple(t.shape)) for k, t in named.items()]
        device = next((t.device for t in named.values()), torch.device("cpu"))
        backend = "nccl" if device.type == "cuda" else "gloo"
        stats = BroadcastStats(version, epoch, 0, 0, backend)
        store = self._server()
        prefix = f"e{epoch}/"
        meta = {
            "v": META_V,
            "version": version,
            "backend": backend,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[m.name, m.dtype, list(m.shape)] for m in metas],
        }
        store.set(prefix + "meta", json.dumps(meta, separators=(",", ":")))
        started = time.monotonic()
        deadline = started + self.timeout_s
        while store.add(prefix + "answered", 0) < workers and time.monotonic() < deadline:
            time.sleep(0.005)
        stats.workers = store.add(prefix + "workers", 0)
        stats.ranks = store.add(prefix + "ranks", 0)
        store.set(prefix + "world", str(1 + stats.ranks))
        stats.join_s = time.monotonic() - started
        try:
            if stats.ranks:
                self._send(store, stats, metas, named, device)
        finally:
            for key in ("meta", "answered", "workers", "ranks", "world"):
                store.delete_key(prefix + key)
        self.last = stats
        return stats

    def _send(
        self,
        store: dist.Store,
        stats: BroadcastStats,
        metas: list[TensorMeta],
        named: dict[str, torch.Tensor],
        device: torch.device,
    ) -> None:
        started = time.monotonic()
        # The trainer's current device is left as it was: only this block works on the tensors' GPU.
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            group = _group(store, stats.epoch, 0, 1 + stats.ranks, stats.backend, self.timeout_s)
            try:
                _warm_up(group, device)
                stats.setup_s = time.monotonic() - started
                started = time.monotonic()
                stats.bytes = self._send_buckets(group, metas, list(named.values()), device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                stats.transfer_s = time.monotonic() - started
            finally:
                _close_later(group)

    def _send_buckets(
        self, group: dist.ProcessGroup, metas: list[TensorMeta], tensors: list[torch.Tensor], device: torch.device
    ) -> int:
        sent = 0
        buffer: torch.Tensor | None = None
        for bucket in plan_buckets(metas, self.bucket_bytes):
            size = _bucket_size(metas, bucket)
            if len(bucket) == 1:  # one tensor: send its own bytes, no copy
                payload = tensors[bucket[0][0]].reshape(-1).view(torch.uint8)
            else:
                if buffer is None:
                    buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
                payload = buffer[:size]
                for index, offset in bucket:
                    raw = tensors[index].reshape(-1).view(torch.uint8)
                    payload[offset : offset + raw.numel()].copy_(raw)
            _broadcast(group, payload)
            sent += size
        return sent

    def versions(self) -> list[int]:
        return []  # nothing is stored: a version lives only while it is broadcast

    def remove(self, version: int) -> bool:
        return False

    def release(self, keep: Any) -> list[int]:
        return []


# -- the worker's side ---------------------------------------------------------------------------


def join_broadcast(
    uri: str,
    epoch: int,
    version: int,
    ranks: int = 1,
    timeout_s: float = 60.0,
    check: Callable[[dict[str, tuple[int, ...]], str], None] | None = None,
) -> BroadcastLink:
    """Take `ranks` ranks in sync `epoch`'s group and wait until the trainer fixed its size.

    Run in the worker process (blocking); the engine then receives with `receive_broadcast`. `check`
    sees the names and shapes first: if it raises, this worker declines (the others go on without
    waiting for it) and the error propagates. Raises `TimeoutError` when the trainer does not answer
    and `RuntimeError` when this worker joined too late.
    """
    parsed = parse_uri(uri)
    if parsed.version is not None and parsed.version != version:
        raise ValueError(f"weights uri {uri!r} names version {parsed.version}, not {version}")
    host, _, port = parsed.location.rpartition(":")
    prefix = f"e{epoch}/"
    try:
        store = _store(host, int(port), timeout_s, server=False)
        store.wait([prefix + "meta"])
        raw_meta = store.get(prefix + "meta").decode()
    except (dist.DistStoreError, RuntimeError) as exc:  # refused, timed out, or the trainer went away
        raise TimeoutError(f"weights {uri}: no answer from the trainer's rendezvous at {host}:{port}: {exc}") from None
    meta = json.loads(raw_meta)
    try:
        if meta.get("v") != META_V or meta.get("version") != version:
            raise ValueError(
                f"weights {uri}: the trainer broadcasts version {meta.get('version')!r} (meta v={meta.get('v')!r}), "
                f"this worker expected version {version} (meta v={META_V})"
            )
        if check is not None:
            check({m.name: m.shape for m in _metas(meta)}, uri)
    except Exception:
        store.add(prefix + "answered", 1)  # declined: the trainer need not wait for us
        raise
    try:
        last = store.add(prefix + "ranks", ranks)
        store.add(prefix + "workers", 1)
        store.add(prefix + "answered", 1)
        store.wait([prefix + "world"])
        world = int(store.get(prefix + "world"))
    except (dist.DistStoreError, RuntimeError) as exc:
        raise TimeoutError(f"weights {uri}: the trainer at {host}:{port} did not start its broadcast: {exc}") from None
    if last >= world:
        raise RuntimeError(
            f"weights {uri}: joined sync {epoch} after the trainer started its broadcast "
            f"(rank {last} >= world size {world})"
        )
    return BroadcastLink(host, int(port), epoch, version, last - ranks + 1, world, timeout_s, raw_meta)


def receive_broadcast(
    link: BroadcastLink, rank_offset: int = 0, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Join the group as rank `link.first_rank + rank_offset` and yield the trainer's tensors as they arrive.

    NCCL receives on `device` (a GPU); gloo on the CPU. Every rank must drain the iterator: the
    broadcasts are collective. The tensors are views of the receive buffers (no copy).
    """
    meta = json.loads(link.meta)
    metas = _metas(meta)
    backend = meta["backend"]
    target = torch.device(device) if backend == "nccl" else torch.device("cpu")
    if target.type == "cuda":
        torch.cuda.set_device(target)
    store = _store(link.host, link.port, link.timeout_s, server=False)
    group = _group(store, link.epoch, link.first_rank + rank_offset, link.world, backend, link.timeout_s)
    try:
        _warm_up(group, target)
        for bucket in plan_buckets(metas, int(meta["bucket_bytes"])):
            buffer = torch.empty(_bucket_size(metas, bucket), dtype=torch.uint8, device=target)
            _broadcast(group, buffer)
            for index, offset in bucket:
                m = metas[index]
                yield m.name, buffer[offset : offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape)
        for m in metas:
            if m.nbytes == 0:
                yield m.name, torch.empty(m.shape, dtype=_dtype(m.dtype), device=target)
        if target.type == "cuda":
            torch.cuda.synchronize(target)  # every broadcast landed before the group goes
    finally:
        _close_later(group)


def _metas(meta: Mapping[str, Any]) -> list[TensorMeta]:
    try:
        return [
            TensorMeta(str(name), str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in meta["tensors"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the broadcast's meta is malformed: {exc}") from None

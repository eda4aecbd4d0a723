"""`ipc://`: colocated handoff, for a trainer and torch workers that share one GPU.

No byte of the weights crosses the network or the disk. The trainer copies a version's tensors into one
flat GPU buffer that it owns (each tensor 16-byte aligned, in the layout of `staleness.weights.buckets`),
exports one CUDA IPC handle of that buffer (`storage._share_cuda_()`, what `torch.multiprocessing` sends)
and stores a small JSON manifest in Redis, `{ns}:weights:ipc:{v}`: the handle's fields (bytes as base64),
the GPU's UUID, the trainer's host and pid, and `[name, dtype, shape, offset]` per tensor. The uri is
`ipc://NS/v{n}`, and the sync protocol is the same as for the other transports: the worker reads the manifest,
checks that its engine runs on that very GPU, opens the handle (`rebuild_cuda_tensor`), copies device to device
into its weights, waits for the copy, drops the mapping and acks.

Who frees the buffer: the trainer, through the protocol, not torch's cross-process reference count. That count
pairs one export with one consumer's release; here one export serves every worker, and workers that start
later open it too, so it could not balance. The manifest therefore carries no counter, a worker rebuilds with
none (torch's release then finds nothing to decrement), and the trainer returns its own count when it releases
a version. It releases a version only once every live worker acked a newer one (`publish_weights` releases all
but the version it just synced), so the current version stays open for workers that start late. The buffers
live in this process (`_HELD`: `publish_weights` opens a transport per call), and a version lives only as long
as the trainer process that published it.

The engine opens the version where its weights live, handed the manifest as a `Handover` (`Engine.load_handover`,
which opens it through `IpcTransport.open_handover`, that is `opened`): the torch engine in the worker's process,
vLLM in each of its worker processes (`RolloutsWorkerExtension.rollouts_load_handover`), each process checking first
that it runs on the trainer's GPU. Where it cannot work the transport says so before anything is opened
(`IpcTransport.check_placement`, from the engine's `Placement`): a worker on another GPU or host, on the CPU, in a
process of its own or behind a server, and vLLM on the CPU or over several GPUs. No pickle: handles go as base64
strings in JSON, to vLLM's processes too.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import redis
import torch

from pipeline.wire import Keys
from staleness.weights.base import Fetched, Opening, PublishStats, Receiving, Transport, WeightsUri, check_version
from staleness.weights.buckets import ALIGN, TensorMeta, dtype_from_name, dtype_name, plan_buckets
from staleness.weights.handover import Handover, LoadsWeights
from staleness.weights.sources import WeightSource, named_tensors

MANIFEST_V = 1
FORMAT = "cuda-ipc"
SAME_GPU = "ipc:// needs the trainer and the worker on the same GPU"


@dataclass(frozen=True)
class Handle:
    """The fields of one CUDA IPC export of a storage (`storage._share_cuda_()`), minus torch's reference counter."""

    device: int
    """The trainer's device index (a worker opens it on its own index of the same GPU)."""
    handle: bytes
    """The cudaIpcMemHandle of the allocation that holds the storage (opaque to us)."""
    size: int
    """Bytes of the storage."""
    offset: int
    """Where the storage starts in that allocation, in bytes."""
    event: bytes | None
    """An IPC event the worker waits on before reading (torch records it at the export), or None."""
    event_sync: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "handle": _b64(self.handle),
            "size": self.size,
            "offset": self.offset,
            "event": None if self.event is None else _b64(self.event),
            "event_sync": self.event_sync,
        }

    @classmethod
    def from_json(cls, data: Any) -> Handle:
        """`ValueError` naming the field that is missing or of the wrong type."""
        if not isinstance(data, Mapping):
            raise ValueError(f"the handle is not a JSON object: {data!r}")
        for name in ("device", "size", "offset"):
            if not isinstance(data.get(name), int) or isinstance(data[name], bool) or data[name] < 0:
                raise ValueError(f"handle field {name!r} must be an integer >= 0, got {data.get(name)!r}")
        if not isinstance(data.get("event_sync"), bool):
            raise ValueError(f"handle field 'event_sync' must be true or false, got {data.get('event_sync')!r}")
        event = data.get("event")
        return cls(
            device=data["device"],
            handle=_unb64(data.get("handle"), "handle"),
            size=data["size"],
            offset=data["offset"],
            event=None if event is None else _unb64(event, "event"),
            event_sync=data["event_sync"],
        )

    def rebuild_args(self, device_index: int) -> tuple[Any, ...]:
        """The arguments of `torch.multiprocessing.reductions.rebuild_cuda_tensor` for a flat uint8 tensor over the
        whole storage on `device_index`. The reference counter is empty: the trainer keeps the buffer (see above)."""
        return (
            torch.Tensor, (self.size,), (1,), 0, torch.UntypedStorage, torch.uint8, device_index,
            self.handle, self.size, self.offset, False, b"", 0, self.event, self.event_sync,
        )  # fmt: skip


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, field: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"handle field {field!r} must be a base64 string, got {text!r}")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise ValueError(f"handle field {field!r} is not base64: {exc}") from None


@dataclass(frozen=True)
class Manifest:
    """What a worker reads to open one version: `{ns}:weights:ipc:{v}`, JSON."""

    version: int
    gpu: str
    """The UUID of the trainer's GPU (`torch.cuda.get_device_properties(i).uuid`)."""
    host: str
    pid: int
    handle: Handle
    tensors: list[tuple[TensorMeta, int]]
    """Each tensor and its byte offset in the buffer (-1: empty, not in the buffer)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": MANIFEST_V,
            "format": FORMAT,
            "version": self.version,
            "gpu": self.gpu,
            "host": self.host,
            "pid": self.pid,
            "bytes": self.handle.size,
            "handle": self.handle.to_json(),
            "tensors": [[m.name, m.dtype, list(m.shape), offset] for m, offset in self.tensors],
            "ts": time.time(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str, key: str, version: int) -> Manifest:
        """Parse and check a manifest; `ValueError` says what is wrong with it (and which key it came from)."""
        try:
            data = json.loads(raw)
        except ValueError as exc:  # json.JSONDecodeError
            raise ValueError(f"ipc manifest {key} is malformed: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"ipc manifest {key} is malformed: not a JSON object: {str(raw)[:100]!r}")
        return cls.from_dict(data, key, version)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], key: str, version: int) -> Manifest:
        """Check a manifest's fields (`from_json`, or a `Handover`'s data); `ValueError` says what is wrong."""
        try:
            if data.get("v") != MANIFEST_V or data.get("format") != FORMAT:
                raise ValueError(
                    f"v={data.get('v')!r}, format={data.get('format')!r}; this reader knows v={MANIFEST_V}, "
                    f"format={FORMAT!r}"
                )
            if data.get("version") != version:
                raise ValueError(f"it is of version {data.get('version')!r}, not {version}")
            if not isinstance(data.get("gpu"), str) or not isinstance(data.get("pid"), int):
                raise ValueError("it names no GPU (gpu) or no trainer process (pid)")
            return cls(
                version=version,
                gpu=data["gpu"],
                host=str(data.get("host", "?")),
                pid=data["pid"],
                handle=Handle.from_json(data.get("handle")),
                tensors=[_tensor_entry(entry) for entry in data.get("tensors", ())],
            )
        except ValueError as exc:
            raise ValueError(f"ipc manifest {key} is malformed: {exc}") from None


def _tensor_entry(entry: Any) -> tuple[TensorMeta, int]:
    try:
        name, dtype, shape, offset = entry
        meta = TensorMeta(str(name), str(dtype), tuple(int(d) for d in shape))
        dtype_from_name(meta.dtype)  # raises ValueError for a dtype torch does not know
        return meta, int(offset)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad tensor entry {entry!r}: {exc}") from None


def manifest_key(keys: Keys, version: int) -> str:
    """`{ns}:weights:ipc:{v}`: under `weights:*`, so a worker's ACL role may read it and nothing else changes."""
    return f"{keys.weights_prefix}ipc:{check_version(version)}"


# -- the trainer's side --------------------------------------------------------------------------


@dataclass
class Export:
    """One version's buffer and its export: alive until `close`, which lets torch free the buffer."""

    buffer: torch.Tensor
    manifest: Manifest
    ref_counter: tuple[bytes, int]
    """Torch's reference counter of the export (shared-memory name, slot): the trainer's own count."""

    def close(self) -> None:
        """Return the trainer's count (the only one: workers open without one), so the buffer is freed with it."""
        handle, slot = self.ref_counter
        torch.UntypedStorage._release_ipc_counter(handle, slot, device=self.buffer.device)  # type: ignore[no-untyped-call]  # torch's CUDA IPC internals are unannotated
        del self.buffer
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # torch's CUDA IPC internals are unannotated


_HELD: dict[tuple[str, int], Export] = {}
"""The exports this process holds, by (namespace, version): what workers may open."""


def export_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int) -> Export:
    """Copy the tensors into one new buffer on their GPU (they must all be on the same one) and export it. Pairs are
    taken as they come: one off the GPU is refused before the next is asked for (nothing piles up on the host)."""
    named: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items() if isinstance(tensors, Mapping) else tensors:
        if tensor.device.type != "cuda":
            _source_device({name: tensor})  # raises: says where the tensors must be
        named[name] = tensor
    device = _source_device(named)
    metas = [TensorMeta(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in named.items()]
    placed = dict(next(iter(plan_buckets(metas, sys.maxsize)), []))  # one bucket: tensor index -> byte offset
    size = max((offset + metas[i].nbytes for i, offset in placed.items()), default=0)
    buffer = torch.empty(max(size, ALIGN), dtype=torch.uint8, device=device)
    for i, tensor in enumerate(named.values()):
        if i in placed:
            buffer[placed[i] : placed[i] + metas[i].nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
    torch.cuda.synchronize(device)  # the worker reads what is there when it opens the handle
    _, handle, storage_size, storage_offset, counter, slot, event, event_sync = buffer.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]  # torch's CUDA IPC internals are unannotated
    manifest = Manifest(
        version=version,
        gpu=gpu_uuid(device),
        host=socket.gethostname(),
        pid=os.getpid(),
        handle=Handle(device.index or 0, handle, storage_size, storage_offset, event, bool(event_sync)),
        tensors=[(meta, placed.get(i, -1)) for i, meta in enumerate(metas)],
    )
    return Export(buffer, manifest, (counter, slot))


def _source_device(named: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in named.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        shown = ", ".join(sorted(str(d) for d in devices)) or "none"
        raise ValueError(
            f"ipc:// hands over GPU memory, so the trainer's tensors must all be on one GPU, the workers' (they are on "
            f"{shown}): move the model there (model.to('cuda:0')), or publish by fs:// or redis://"
        )
    device = next(iter(devices))
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class IpcTransport(Transport):
    """`ipc://NS`: versions are this process's exports, each with its manifest in Redis (the trainer's side); a worker
    has its engine open one where its weights live and copy from it (`load_stored`). Stored while the trainer that
    exported it lives; no adapters."""

    scheme = "ipc"
    carries_adapters = False
    from_host = False

    def __init__(self, client: redis.Redis, ns: str) -> None:
        self.client = client
        self.keys = Keys(ns)  # raises ValueError for a bad namespace

    @property
    def ns(self) -> str:
        return self.keys.ns

    @classmethod
    def open(cls, spec: str, parsed: WeightsUri, opening: Opening) -> IpcTransport:
        return cls(*opening.namespace(spec, parsed))

    def uri_of(self, version: int) -> str:
        return str(WeightsUri("ipc", self.ns, check_version(version)))

    def put(self, tensors: WeightSource, version: int, adapter_config: Mapping[str, Any] | None) -> PublishStats:
        """Export the tensors (copied into a buffer of this process on their GPU) and store the manifest last.

        An iterable of `(name, tensor)` pairs must yield CUDA tensors on the workers' GPU (a CPU tensor is refused as
        it comes, before more are gathered); they are kept until the copy, so the GPU holds the version twice for a
        moment (what was yielded, and the buffer), the host none of it.

        A manifest left by a trainer process that is gone is replaced: its handles opened nothing any more."""
        if (self.ns, version) in _HELD:
            raise FileExistsError(f"weights version {version} is exported by this process already: remove it first")
        stats = PublishStats()

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors(tensors, keep_device=True):
                stats.tensors += 1
                stats.bytes += tensor.nbytes
                yield name, tensor
                del tensor

        export = export_tensors(counted(), version)
        _HELD[(self.ns, version)] = export
        try:
            self.client.set(manifest_key(self.keys, version), export.manifest.to_json())
        except BaseException:
            _HELD.pop((self.ns, version)).close()
            raise
        return stats

    def versions(self) -> list[int]:
        """The versions this process exports (others' manifests name handles of no use to it)."""
        return sorted(self.stored())

    def stored(self) -> set[int]:
        return {version for ns, version in _HELD if ns == self.ns}

    def remove(self, version: int) -> bool:
        """Delete the manifest (workers stop finding the version), then free the buffer if this process holds it."""
        deleted = bool(self.client.delete(manifest_key(self.keys, version)))
        export = _HELD.pop((self.ns, check_version(version)), None)
        if export is not None:
            export.close()
        return deleted or export is not None

    # -- the worker's side

    @classmethod
    def fetch_stored(cls, uri: WeightsUri, version: int, redis_client: redis.Redis | None) -> Fetched:
        raise ValueError(f"weights {uri}: ipc versions are opened on the worker's GPU by its engine (load_version)")

    @classmethod
    async def load_stored(cls, engine: LoadsWeights, uri: WeightsUri, version: int, receiving: Receiving) -> None:
        """Read the version's manifest and have the engine open and load it where its weights live
        (`engine.load_handover`: in the worker's process, or in the engine's own processes, vLLM's).
        `FileNotFoundError`: no such version; `ValueError` before anything is opened: a bad manifest, an engine that
        cannot reach the trainer's GPU (saying what to use instead), or tensors the model does not take."""
        if receiving.redis_client is None:
            raise ValueError(f"loading {uri} needs the worker's Redis client")
        manifest = await asyncio.to_thread(read_manifest, receiving.redis_client, uri.location, check_version(version))
        source = f"the GPU memory of the trainer {manifest.host}:{manifest.pid} (ipc://)"
        handover = Handover(cls.scheme, manifest.version, manifest.to_dict(), source)
        cls.check_placement(engine, handover)
        await engine.load_handover(handover)

    @classmethod
    def check_placement(cls, engine: LoadsWeights, handover: Handover) -> None:
        """One GPU's buffer, opened where the weights live: refused (`ipc_device`) for an engine on the CPU, on no GPU,
        in a process of its own, over several GPUs or behind a server; then for tensors its model does not take."""
        ipc_device(engine)
        check_fits(engine, _manifest_of(handover))

    @classmethod
    def open_handover(
        cls, handover: Handover, rank: int, device: torch.device
    ) -> AbstractContextManager[Iterable[tuple[str, torch.Tensor]]]:
        """Views of the trainer's buffer on `device`, after the same-GPU check (`opened`); on leaving, the copies out
        of them are waited for and the views dropped."""
        return _items(opened(_manifest_of(handover), _indexed(device)))


# -- the worker's side ---------------------------------------------------------------------------


def ipc_device(engine: LoadsWeights) -> torch.device | None:
    """The GPU whose memory an engine's weights live in when they live in the worker's process (None: in the engine's
    own processes, which check their GPU themselves), or `ValueError` saying why ipc:// cannot reach them."""
    placement = engine.placement
    name = placement.engine
    if placement.where == "server":
        raise ValueError(NO_IPC)
    if placement.where == "apart":
        raise ValueError(
            f"{SAME_GPU}, and it opens that buffer in the worker's process, but this {name} worker's engine runs "
            "in a process of its own (--engine-process): use nccl:// or fs://"
        )
    if placement.where == "processes":
        if placement.on_cpu:
            raise ValueError(f"{SAME_GPU}, but this {name} worker runs on the CPU: use nccl:// or fs://")
        if engine.weight_receivers > 1:
            raise ValueError(
                f"{SAME_GPU}, and hands over that one GPU's buffer, but this {name} worker holds its weights on "
                f"{engine.weight_receivers} GPUs (tensor or pipeline parallel): use nccl://, which reaches every one"
            )
        return None
    device = None if placement.device is None else torch.device(placement.device)
    if device is None or device.type != "cuda":
        raise ValueError(f"{SAME_GPU}, but this {name} worker runs on {device or 'no GPU'}: use nccl:// or fs://")
    if not torch.cuda.is_available():
        raise ValueError(f"{SAME_GPU}, but this worker's torch sees no GPU: use nccl:// or fs://")
    return _indexed(device)


def _indexed(device: torch.device) -> torch.device:
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


NO_IPC = (
    "ipc:// needs the trainer and the worker on the same GPU, and opens that buffer where the weights live, but a "
    "remote engine's weights live in a server this worker reaches over HTTP: publish with fs:// (a directory the "
    "server sees) or redis://"
)


def read_manifest(client: redis.Redis, ns: str, version: int) -> Manifest:
    """The manifest of a version (`FileNotFoundError` if none: removed, or never published)."""
    key = manifest_key(Keys(ns), version)
    raw = client.get(key)
    if raw is None:
        raise FileNotFoundError(f"weights version {version} is not exported: no {key} (removed, or never published)")
    return Manifest.from_json(raw, key, version)


def check_same_gpu(manifest: Manifest, device: torch.device) -> None:
    here = gpu_uuid(device)
    if here != manifest.gpu:
        raise ValueError(
            f"{SAME_GPU}: version {manifest.version} lies on GPU {manifest.gpu} of {manifest.host}, this worker's "
            f"{device} is {here} on {socket.gethostname()}; use nccl:// or fs://"
        )


def open_tensors(manifest: Manifest, device: torch.device) -> dict[str, torch.Tensor]:
    """Views of the trainer's buffer, opened on `device` (the same GPU, maybe under another index), by name.
    `ValueError` if the handle cannot be opened (its trainer is gone) or a tensor lies outside the buffer."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        flat = rebuild_cuda_tensor(*manifest.handle.rebuild_args(device.index or 0))  # type: ignore[no-untyped-call]  # torch's CUDA IPC internals are unannotated
    except RuntimeError as exc:
        raise ValueError(
            f"could not open the CUDA IPC handle of version {manifest.version} (exported by pid {manifest.pid} on "
            f"{manifest.host}): {exc}; an ipc:// version lives only as long as the trainer process that published it"
        ) from None
    tensors = {}
    for meta, offset in manifest.tensors:
        dtype = dtype_from_name(meta.dtype)
        if offset < 0:
            tensors[meta.name] = torch.empty(meta.shape, dtype=dtype, device=device)
            continue
        if offset + meta.nbytes > flat.numel():
            raise ValueError(f"ipc manifest of version {manifest.version}: {meta.name} lies outside the buffer")
        tensors[meta.name] = flat[offset : offset + meta.nbytes].view(dtype).view(meta.shape)
    return tensors


@contextmanager
def opened(manifest: Manifest, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """The version's tensors opened on `device` after the same-GPU check; on leaving, the copies out of them are
    waited for and the views dropped, so that the caller acks only once it no longer reads the trainer's buffer."""
    check_same_gpu(manifest, device)
    tensors = open_tensors(manifest, device)
    try:
        yield tensors
    finally:
        torch.cuda.synchronize(device)
        tensors.clear()


def _manifest_of(handover: Handover) -> Manifest:
    return Manifest.from_dict(handover.data, "handed over", handover.version)


@contextmanager
def _items(opening: AbstractContextManager[dict[str, torch.Tensor]]) -> Iterator[Iterable[tuple[str, torch.Tensor]]]:
    with opening as tensors:
        yield tensors.items()


def check_fits(engine: LoadsWeights, manifest: Manifest) -> None:
    """`engine.check_fits` for the tensors the manifest names (`IpcTransport.check_placement`, before anything is
    opened)."""
    engine.check_fits({m.name: m.shape for m, _ in manifest.tensors}, f"ipc:// version {manifest.version}")

"""Weight transports: how a trainer hands a new policy version to the workers. Each transport is one class in a module
of its own that owns both sides (`fs`, `redis_store`, `nccl`, `ipc`), registered by its uri's scheme
(`base.register_transport`); this module is what the trainer and the workers call, and it finds the transport of a
uri in that registry (`transport_of`): no scheme is named here, nor by any caller.

A transport moves one version's tensors (checkpoint names, safetensors bytes: no pickle) from the
trainer to every worker. The trainer side `publish`es a version and gets back a uri that names it;
the staleness manager sends that uri in the `weights` command and records it as `weights_uri` in
`{ns}:state`; each worker calls `begin_load` before it pauses and `Incoming.load` paused (`load_version` does both).
Versions are immutable: publishing one that exists is an error, and `release`/`remove` delete what no worker
needs any more.

What a transport can do, as its class says (`base.Transport`), is what its callers ask:
- `stores`: a version stays where a worker can load it at any time: a worker that starts late, an engine started on
  demand, an adapter loaded on demand (fs, redis, ipc while its trainer lives; not nccl, whose late workers await the
  next sync);
- `fetches_ahead`: the worker fetches the version before it pauses and, paused, only loads it (redis);
- `pushes`: the trainer sends the version during the sync (`Transport.push`, the manager's transfer step), and each
  worker joins before it pauses (nccl);
- `carries_adapters`: LoRA adapters travel by it (fs, redis, nccl; not ipc).

- `fs:///DIR/v{n}`: `DIR/v{n}/model.safetensors` (or Hugging Face's shards and index, for a version bigger than a
  shard) on storage that every machine mounts at the same path; the worker calls `engine.load_weights(dir, n)`.
- `redis://NS/v{n}`: the tensors' raw bytes in chunks under `{NS}:weights:{n}:{i}` plus a JSON manifest
  `{NS}:weights:{n}:manifest` (names, dtypes, shapes, offsets; written last), and the hash `{NS}:weights:index`
  (version -> chunks written, kept ahead of the chunks, so that a write that crashed can be cleaned up without
  SCAN); the worker reads them through its own Redis connection, checks the sha256, and calls
  `engine.load_tensors(tensors, n)`.
- `nccl://HOST:PORT`: nothing stored; the trainer broadcasts to every worker during the sync
  (`staleness.weights.nccl`); the worker hands its engine the broadcast's link (`engine.load_handover`), and each
  process that holds the weights receives its part.
- `ipc://NS/v{n}`: colocated handoff on one GPU; the trainer keeps the tensors in a GPU buffer of its own and
  stores a JSON manifest of its CUDA IPC handle under `{NS}:weights:ipc:{n}` (`staleness.weights.ipc`); the worker hands
  its engine the manifest (`engine.load_handover`), which opens it on the same GPU and copies from views of the
  trainer's memory.

LoRA adapters travel by the transports that carry them, each adapter in a place of its own, in PEFT's layout (what
vLLM loads): `fs:///DIR/adapters/NAME/v{n}/` holds `adapter_model.safetensors` and `adapter_config.json`;
`redis://NS/adapters/NAME/v{n}` keeps the blob under `{NS}:adapter:NAME:weights:{n}:{i}` with the config in its
manifest. The worker calls `fetch_adapter(uri, n)` and `engine.load_adapter(name, tensors, config, n)`; a pushed
adapter it receives itself (`join_pushed`, `receive_adapter`) and keeps a CPU copy of.

Every transport takes what a trainer holds (`base.WeightSource`): a module, a state dict, a checkpoint, or an
iterable of `(name, tensor)` pairs that is consumed once, as it comes. fs and redis stream it a bucket at a time
(`bucket_bytes`: a shard, a pipeline of chunks), so a generator that gathers one tensor at a time is never held whole
on the host; nccl and ipc keep the version where its tensors are until the sync (on the GPU for GPU tensors).
`SyncDriver.publish` checks the names and shapes against the live workers' models as they pass (`layout`).

The engine is duck-typed (`LoadsWeights`, `staleness.weights.handover`): it loads files, named tensors or a `Handover`
(a version each of its processes opens where its weights live), and says where its weights are (`Placement`); it
never sees a scheme. This package imports no engine, as the design asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from pipeline.wire import ADAPTER_PATTERN
from staleness.weights.base import (
    DEFAULT_CHUNK_BYTES,
    Fetched,
    Incoming,
    Joined,
    Opening,
    Receiving,
    Transport,
    WeightsUri,
    adapter_schemes,
    check_version,
    parse_uri,
    transport_class,
    transport_of,
)
from staleness.weights.handover import LoadsWeights

if TYPE_CHECKING:
    import redis
    import torch

    from staleness.weights.delta import HeldWeights

__all__ = [
    "Incoming",
    "Joined",
    "LoadOptions",
    "Transport",
    "begin_load",
    "fetch_adapter",
    "fetch_weights",
    "import_transport",
    "join_pushed",
    "load_version",
    "open_transport",
    "receive_adapter",
    "remove_published",
    "transport_of",
]


def open_transport(
    spec: str,
    *,
    redis_client: redis.Redis | None = None,
    ns: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    join_timeout_s: float = 60.0,
    adapter: str | None = None,
    bucket_bytes: int | None = None,
    held: HeldWeights | None = None,
) -> Transport:
    """The trainer's transport from a spec: `fs://DIR`, `redis://` (or `redis://NS`) with the pipeline's client,
    `nccl://HOST:PORT` (this process hosts the rendezvous on PORT and broadcasts during each sync,
    waiting up to `join_timeout_s` for the workers to join), or `ipc://` (`ipc://NS`: this process keeps each
    version in a buffer on its GPU for workers on that GPU, the handles' manifest in the pipeline's Redis), or any
    other registered scheme (`Transport.open`). With `adapter`, the place of that LoRA adapter's versions
    (`DIR/adapters/NAME`, `{ns}:adapter:NAME:weights:...`; nccl: the broadcast carries its config), for a transport
    that carries adapters.

    `bucket_bytes`: the most a publish handles at once (None: each transport's default): fs, the tensors of one shard
    file (2 GiB); redis, one chunk (`chunk_bytes`, 32 MiB: the one being filled, and redis-py's copy of the one being
    sent); nccl, one broadcast (256 MiB); ipc takes the version whole, in one GPU buffer.

    `held`: the trainer's last published version, kept across publishes, for a transport that sends deltas
    (`redis`: the delta from it beside each version, `staleness.weights.delta`)."""
    parsed = parse_uri(spec)
    if bucket_bytes is not None and bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if adapter is not None and not re.match(ADAPTER_PATTERN, adapter):
        raise ValueError(f"adapter name {adapter!r} must match {ADAPTER_PATTERN}")
    transport = transport_class(parsed.scheme)
    if (adapter is not None or parsed.adapter is not None) and not transport.carries_adapters:
        raise ValueError(f"LoRA adapters travel by {adapter_schemes()}, not {parsed.scheme}://")
    opening = Opening(redis_client, ns, chunk_bytes, join_timeout_s, adapter, bucket_bytes, held)
    return transport.open(spec, parsed, opening)


def remove_published(uri: str, redis_client: redis.Redis | None = None, ns: str | None = None) -> bool:
    """Delete the stored version a published uri names (`fs:///DIR/v3`, `redis://NS/v3`, `ipc://NS/v3`: its
    manifest, and its buffer if this process exports it); a transport that does not store keeps nothing to delete."""
    parsed = parse_uri(uri)
    transport = transport_class(parsed.scheme)
    if parsed.version is None or not transport.stores:
        return False
    return transport.remove_published(parsed, redis_client, ns)


# -- the worker's side ---------------------------------------------------------------------------


async def import_transport(uri: str) -> None:
    """Import the module of `uri`'s transport on a thread: the first uri of a scheme brings it, and torch with it
    (seconds, where nothing imported torch yet: a synthetic worker), which the event loop (heartbeats, generation) must
    not stand still for. A worker calls it before anything of a sync asks `transport_of`; a bad uri is left for that
    call to refuse."""
    with contextlib.suppress(ValueError):
        await asyncio.to_thread(transport_of, uri)


def _named(uri: str, version: int) -> tuple[type[Transport], WeightsUri, int]:
    """The transport of `uri`, the uri parsed, and `version` checked against the one it names (a mismatch is a
    protocol bug, refused with `ValueError`)."""
    version = check_version(version)
    parsed = parse_uri(uri)
    if parsed.version is not None and parsed.version != version:
        raise ValueError(f"weights uri {uri!r} names version {parsed.version}, not {version}")
    return transport_class(parsed.scheme), parsed, version


def fetch_weights(uri: str, version: int, redis_client: redis.Redis | None = None) -> Fetched:
    """What a worker loads for a stored version: a local checkpoint directory (fs) or named CPU tensors (redis).

    Blocking (disk or network): call it off the event loop, or use `load_version`. `version` must agree
    with the version the uri names (a mismatch is a protocol bug, refused with `ValueError`).
    """
    transport, parsed, version = _named(uri, version)
    return transport.fetch_stored(parsed, version, redis_client)


def fetch_adapter(
    uri: str, version: int, redis_client: redis.Redis | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA adapter's tensors and config (`adapter_config.json`'s fields) from a stored version. Blocking."""
    transport, parsed, version = _named(uri, version)
    return transport.fetch_adapter(parsed, version, redis_client)


async def join_pushed(uri: str, version: int, epoch: int, *, member: str, timeout_s: float = 60.0) -> Joined:
    """Join sync `epoch`'s push of `version` (a transport that `pushes`) as one rank of this process, while generation
    goes on: an adapter's version (a worker does this before it pauses the adapter), or a version pushed while the
    worker has no engine. `Joined.receive` then takes CPU copies. Raises as `load_version` does."""
    transport, parsed, version = _named(uri, version)
    return await transport.join_here(parsed, version, Receiving(epoch=epoch, member=member, timeout_s=timeout_s))


async def receive_adapter(joined: Joined, version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Receive the adapter `join_pushed` joined: CPU copies of its tensors (kept to load it later on demand) and
    its config, which the push carries."""
    tensors, config = await joined.receive()
    if config is None:
        raise ValueError(f"the push of version {version} carries no adapter config (not an adapter's?)")
    return tensors, config


async def begin_load(
    engine: LoadsWeights,
    uri: str,
    version: int,
    redis_client: redis.Redis | None = None,
    *,
    epoch: int | None = None,
    timeout_s: float = 60.0,
    member: str | None = None,
    held: HeldWeights | None = None,
) -> Incoming:
    """The part of loading `version` from `uri` that need not stop generation (`Transport.begin_load`): a worker calls
    this before it pauses, then `Incoming.load` paused. A transport that pushes is joined now, as `member` (the
    worker's name) in sync `epoch`; one that fetches ahead is fetched and checked now; the others load whole, later.
    Raises as `load_version` does."""
    transport, parsed, version = _named(uri, version)
    receiving = Receiving(redis_client, epoch, member, timeout_s, held)
    return await transport.begin_load(engine, parsed, version, receiving)


class LoadOptions(TypedDict, total=False):
    """How a worker receives a version (`begin_load`'s keywords, and its defaults when left out)."""

    epoch: int | None
    timeout_s: float
    member: str | None
    held: HeldWeights | None


async def load_version(
    engine: LoadsWeights,
    uri: str,
    version: int,
    redis_client: redis.Redis | None = None,
    **options: Unpack[LoadOptions],
) -> None:
    """Fetch version `version` from wherever `uri` says (off the event loop) and load it into `engine`: `begin_load`
    (whose keywords `options` are), then `Incoming.load`.

    fs: `engine.load_weights(dir, version)` (vLLM reloads the files in place); redis: the chunks are read
    and checked here, then `engine.load_tensors(tensors, version)`; nccl: join sync `epoch`'s group as
    `member` (the worker's name; the group is kept across syncs while its members stay) and receive it;
    ipc: open the trainer's buffer on the engine's GPU and copy from it (`engine.load_handover`). Errors leave the
    engine's weights as they were: `FileNotFoundError` (version not there), `ValueError` (bad uri, checksum, manifest;
    ipc: not the same GPU), `TimeoutError` (no trainer).
    """
    incoming = await begin_load(engine, uri, version, redis_client, **options)
    await incoming.load(engine)

"""Weight transports: how a trainer hands a new policy version to the workers. This module is the scheme
dispatcher for both sides (`open_transport`, `fetch_weights`, `load_version`, ...); each transport lives in a module
of its own (`fs`, `redis_store`, `nccl`, `ipc`) on the shared vocabulary of `base`, and tensor layout in `buckets`.

A transport moves one version's tensors (checkpoint names, safetensors bytes: no pickle) from the
trainer to every worker. The trainer side `publish`es a version and gets back a uri that names it;
the staleness manager sends that uri in the `weights` command and records it as `weights_uri` in
`{ns}:state`; each worker calls `load_version(engine, uri, version, redis_client)`. Versions are
immutable: publishing one that exists is an error, and `release`/`remove` delete what no worker
needs any more.

- `fs:///DIR/v{n}`: `DIR/v{n}/model.safetensors` (or Hugging Face's shards and index, for a version bigger than a
  shard) on storage that every machine mounts at the same path; the worker calls `engine.load_weights(dir, n)`.
- `redis://NS/v{n}`: the tensors' raw bytes in chunks under `{NS}:weights:{n}:{i}` plus a JSON manifest
  `{NS}:weights:{n}:manifest` (names, dtypes, shapes, offsets; written last), and the hash `{NS}:weights:index`
  (version -> chunks written, kept ahead of the chunks, so that a write that crashed can be cleaned up without
  SCAN); the worker reads them through its own Redis connection, checks the sha256, and calls
  `engine.load_tensors(tensors, n)`.
- `nccl://HOST:PORT`: nothing stored; the trainer broadcasts to every worker during the sync
  (`staleness.weights.nccl`); the worker calls `engine.load_broadcast(link, n)`.
- `ipc://NS/v{n}`: colocated handoff on one GPU; the trainer keeps the tensors in a GPU buffer of its own and
  stores a JSON manifest of its CUDA IPC handle under `{NS}:weights:ipc:{n}` (`staleness.weights.ipc`); the worker opens
  it on the same GPU and calls `engine.load_tensors(tensors, n)` with views of the trainer's memory.

LoRA adapters travel by the stored transports, each adapter in a place of its own, in PEFT's layout (what vLLM
loads): `fs:///DIR/adapters/NAME/v{n}/` holds `adapter_model.safetensors` and `adapter_config.json`;
`redis://NS/adapters/NAME/v{n}` keeps the blob under `{NS}:adapter:NAME:weights:{n}:{i}` with the config in its
manifest. The worker calls `fetch_adapter(uri, n)` and `engine.load_adapter(name, tensors, config, n)`.

Every transport takes what a trainer holds (`base.WeightSource`): a module, a state dict, a checkpoint, or an
iterable of `(name, tensor)` pairs that is consumed once, as it comes. fs and redis stream it a bucket at a time
(`bucket_bytes`: a shard, a pipeline of chunks), so a generator that gathers one tensor at a time is never held whole
on the host; nccl and ipc keep the version where its tensors are until the sync (on the GPU for GPU tensors).
`publish_weights` checks the names and shapes against the live workers' models as they pass (`layout`).

The engine is duck-typed (`LoadsWeights`): this package imports no engine, as the design asks.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import redis
import torch

from pipeline.wire import ADAPTER_PATTERN
from staleness.weights.base import (
    ADAPTERS_DIR,
    LoadsWeights,
    WeightTransport,
    check_version,
    parse_uri,
    read_adapter,
)
from staleness.weights.buckets import ALIGN
from staleness.weights.fs import FsTransport, version_dir
from staleness.weights.ipc import IpcTransport, load_ipc
from staleness.weights.nccl import BroadcastLink, NcclTransport, join_broadcast, prepare_receiver, receive_broadcast
from staleness.weights.redis_store import DEFAULT_CHUNK_BYTES, RedisTransport


def open_transport(
    spec: str,
    *,
    redis_client: redis.Redis | None = None,
    ns: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    join_timeout_s: float = 60.0,
    adapter: str | None = None,
    bucket_bytes: int | None = None,
) -> WeightTransport:
    """The trainer's transport from a spec: `fs://DIR`, `redis://` (or `redis://NS`) with the pipeline's client,
    `nccl://HOST:PORT` (this process hosts the rendezvous on PORT and broadcasts during each sync,
    waiting up to `join_timeout_s` for the workers to join), or `ipc://` (`ipc://NS`: this process keeps each
    version in a buffer on its GPU for workers on that GPU, the handles' manifest in the pipeline's Redis). With
    `adapter`, the place of that LoRA adapter's versions (`DIR/adapters/NAME`, `{ns}:adapter:NAME:weights:...`;
    nccl: the broadcast carries its config; ipc carries none).

    `bucket_bytes`: the most a publish handles at once (None: each transport's default): fs, the tensors of one shard
    file (2 GiB); redis, one chunk (`chunk_bytes`, 32 MiB: the one being filled, and redis-py's copy of the one being
    sent); nccl, one broadcast (256 MiB); ipc takes the version whole, in one GPU buffer."""
    parsed = parse_uri(spec)
    if bucket_bytes is not None and bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if adapter is not None and not re.match(ADAPTER_PATTERN, adapter):
        raise ValueError(f"adapter name {adapter!r} must match {ADAPTER_PATTERN}")
    if parsed.scheme == "fs":
        root = Path(parsed.location)
        shards = {} if bucket_bytes is None else {"shard_bytes": bucket_bytes}
        return FsTransport(root if adapter is None else root / ADAPTERS_DIR / adapter, **shards)
    if parsed.scheme == "nccl":
        buckets = {} if bucket_bytes is None else {"bucket_bytes": max(bucket_bytes, ALIGN)}
        return NcclTransport.from_uri(spec, timeout_s=join_timeout_s, **buckets)
    if redis_client is None:
        raise ValueError(f"{spec}: the {parsed.scheme} weight transport needs a Redis client (the pipeline's own)")
    if ns is not None and parsed.location and parsed.location != ns:
        raise ValueError(f"{spec} names namespace {parsed.location!r}, but the pipeline's is {ns!r}")
    name = parsed.location or ns
    if not name:
        raise ValueError(f"{spec}: name the namespace ({parsed.scheme}://NS) or pass ns=")
    if parsed.scheme == "ipc":
        if adapter is not None or parsed.adapter is not None:
            raise ValueError("LoRA adapters travel by fs://, redis:// or nccl://, not ipc://")
        return IpcTransport(redis_client, name)
    chunk_bytes = chunk_bytes if bucket_bytes is None else bucket_bytes
    return RedisTransport(redis_client, name, chunk_bytes=chunk_bytes, adapter=adapter or parsed.adapter)


def remove_published(uri: str, redis_client: redis.Redis | None = None, ns: str | None = None) -> bool:
    """Delete the stored version a published uri names (`fs:///DIR/v3`, `redis://NS/v3`, `ipc://NS/v3`: its
    manifest, and its buffer if this process exports it); nccl stores nothing."""
    parsed = parse_uri(uri)
    if parsed.version is None or parsed.scheme == "nccl":
        return False
    if parsed.scheme == "fs":
        return FsTransport(Path(parsed.location).parent).remove(parsed.version)
    return open_transport(uri, redis_client=redis_client, ns=ns, adapter=parsed.adapter).remove(parsed.version)


# -- the worker's side ---------------------------------------------------------------------------


def fetch_weights(uri: str, version: int, redis_client: redis.Redis | None = None) -> Path | dict[str, torch.Tensor]:
    """What a worker loads for a stored version: a local checkpoint directory (fs) or named CPU tensors (redis).

    Blocking (disk or network): call it off the event loop, or use `load_version`. `version` must agree
    with the version the uri names (a mismatch is a protocol bug, refused with `ValueError`).
    """
    version = check_version(version)
    parsed = parse_uri(uri)
    if parsed.version is not None and parsed.version != version:
        raise ValueError(f"weights uri {uri!r} names version {parsed.version}, not {version}")
    if parsed.scheme == "nccl":
        raise ValueError(f"weights {uri}: nccl versions are not stored; they arrive only during a sync")
    if parsed.scheme == "ipc":
        raise ValueError(f"weights {uri}: ipc versions are opened on the worker's GPU by its engine (load_version)")
    if parsed.scheme == "fs":
        return version_dir(Path(parsed.location), version)
    if parsed.version is None:
        raise ValueError(f"weights uri {uri!r} names no version (redis://NS/v<version>)")
    if redis_client is None:
        raise ValueError(f"loading {uri} needs the worker's Redis client")
    return RedisTransport(redis_client, parsed.location, adapter=parsed.adapter).fetch(version)


def fetch_adapter(
    uri: str, version: int, redis_client: redis.Redis | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA adapter's tensors and config (`adapter_config.json`'s fields) from a stored version. Blocking."""
    fetched = fetch_weights(uri, version, redis_client)
    if isinstance(fetched, Path):
        return read_adapter(fetched)
    parsed = parse_uri(uri)
    assert redis_client is not None  # fetch_weights needed it
    config = RedisTransport(redis_client, parsed.location, adapter=parsed.adapter).manifest(version).get("config")
    if not isinstance(config, dict):
        raise ValueError(f"adapter {uri}: no adapter config (r, lora_alpha, target_modules) stored with it")
    return fetched, config


async def join_adapter(uri: str, version: int, epoch: int, *, member: str, timeout_s: float = 60.0) -> BroadcastLink:
    """Join sync `epoch`'s broadcast of a LoRA adapter (`nccl://`) as one rank of this process, and build or find
    its group, while generation goes on (a worker does this before it pauses the adapter). Raises as
    `join_version` does."""
    link = await asyncio.to_thread(join_broadcast, uri, epoch, version, 1, timeout_s, None, member)
    try:
        await asyncio.to_thread(prepare_receiver, link, 0, "cuda")  # gloo receives on the CPU whatever is asked
    except BaseException:
        link.forget()
        raise
    return link


async def receive_adapter(link: BroadcastLink) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Receive the adapter `join_adapter` joined: CPU copies of its tensors (kept to load it later on demand) and
    its config, from the broadcast's meta."""

    def receive() -> dict[str, torch.Tensor]:
        return {name: tensor.to("cpu", copy=True) for name, tensor in receive_broadcast(link, 0, "cuda")}

    try:
        tensors = await asyncio.to_thread(receive)
    except BaseException:
        link.forget()
        raise
    config = json.loads(link.meta).get("adapter_config")
    if not isinstance(config, dict):
        raise ValueError(f"the broadcast of version {link.version} carries no adapter config (not an adapter's?)")
    return tensors, config


def fetches_ahead(uri: str) -> bool:
    """Whether `prefetch_version` fetches anything for `uri` (a `redis://` version): the others it need not be called
    for, nor a thread woken."""
    return parse_uri(uri).scheme == "redis"


def prefetch_version(uri: str, version: int, redis_client: redis.Redis | None = None) -> dict[str, torch.Tensor] | None:
    """The part of a `redis://` load that need not stop generation: fetch and check the version's tensors (host
    memory, one buffer), for `load_prefetched` once the engine is paused. A worker does this before it pauses, as it
    joins an nccl broadcast before: the transfer is then time the trainer waits for, not time the worker stands
    still. None for the other schemes (fs and ipc load in place from where they are; nccl arrives during the sync).
    Blocking: call it off the event loop. Raises as `fetch_weights` does."""
    if not fetches_ahead(uri):
        return None
    fetched = fetch_weights(uri, version, redis_client)
    assert isinstance(fetched, dict)  # redis: named tensors
    return fetched


async def load_prefetched(engine: LoadsWeights, tensors: dict[str, torch.Tensor], version: int) -> None:
    """Load what `prefetch_version` fetched into `engine` (paused meanwhile): a copy into the model's tensors."""
    await engine.load_tensors(tensors, version)


def is_stored(uri: str) -> bool:
    """Whether a version under `uri` can be fetched at any time (fs, redis; ipc while the trainer that exported it
    lives), not only during its sync (nccl)."""
    return parse_uri(uri).scheme != "nccl"


async def join_version(
    engine: LoadsWeights, uri: str, version: int, epoch: int, *, timeout_s: float = 60.0, member: str | None = None
) -> BroadcastLink:
    """The part of an nccl load that need not stop generation: join sync `epoch`'s broadcast as `member` and have
    the engine's receivers find or build their group (`engine.prepare_broadcast`). A worker does this before it
    pauses, so the wait for the other workers and a new group's setup are not time it stands still; then it
    pauses and calls `load_joined`. Raises as `load_version` does; a failure forgets the group."""
    link = await asyncio.to_thread(
        join_broadcast, uri, epoch, version, engine.weight_receivers, timeout_s, engine.check_fits, member
    )
    try:
        await engine.prepare_broadcast(link)
    except BaseException:
        link.forget()  # the trainer's next sync must not count on a group we may not hold
        raise
    return link


async def load_joined(engine: LoadsWeights, link: BroadcastLink) -> None:
    """Receive and load the broadcast `join_version` joined (the engine paused meanwhile, or not: its choice)."""
    try:
        await engine.load_broadcast(link)
    except BaseException:
        link.forget()  # the receivers may have lost the group: the next sync builds anew
        raise


async def load_version(
    engine: LoadsWeights,
    uri: str,
    version: int,
    redis_client: redis.Redis | None = None,
    *,
    epoch: int | None = None,
    timeout_s: float = 60.0,
    member: str | None = None,
) -> None:
    """Fetch version `version` from wherever `uri` says (off the event loop) and load it into `engine`.

    fs: `engine.load_weights(dir, version)` (vLLM reloads the files in place); redis: the chunks are read
    and checked here, then `engine.load_tensors(tensors, version)`; nccl: join sync `epoch`'s group as
    `member` (the worker's name; the group is kept across syncs while its members stay) and receive it
    (`join_version`, then `load_joined`); ipc: open the trainer's buffer on the engine's GPU and copy from it
    (`staleness.weights.ipc.load_ipc`). Errors leave the engine's weights as they were: `FileNotFoundError` (version
    not there), `ValueError` (bad uri, checksum, manifest; ipc: not the same GPU), `TimeoutError` (no trainer).
    """
    scheme = parse_uri(uri).scheme
    if scheme == "ipc":
        await load_ipc(engine, uri, version, redis_client)
        return
    if scheme == "nccl":
        if epoch is None:
            raise ValueError(f"weights {uri}: an nccl version is received during its sync: give its epoch")
        link = await join_version(engine, uri, version, epoch, timeout_s=timeout_s, member=member)
        await load_joined(engine, link)
        return
    fetched = await asyncio.to_thread(fetch_weights, uri, version, redis_client)
    if isinstance(fetched, Path):
        await engine.load_weights(str(fetched), version)
    else:
        await engine.load_tensors(fetched, version)

"""`redis://NS`: a version as raw tensor bytes in chunks under `{NS}:weights:{n}:{i}`, a JSON manifest written last,
and an index written first (`RedisTransport`, both sides: the trainer writes the chunks, a worker reads them into one
buffer before it pauses): for one machine and small models, through the Redis every worker already talks to.

Layout (manifest `v: 2`, `format: "raw"`): the tensors' bytes one after another, each starting at a multiple of 16
(`buckets.ALIGN`; zeros between), cut into chunks of `chunk_bytes`; the manifest lists `[name, dtype, shape, offset]`
per tensor, the total `bytes` and their `sha256`. So a version is written as it is produced, a chunk at a time, without
knowing its tensors in advance (a safetensors blob starts with a header of every tensor), and read into one buffer
that the tensors are views of. Versions written as one safetensors blob (`v: 1`, `format: "safetensors"`, by
Rollout Streams before 2026-11-29) are still read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import redis
import torch
from redis.connection import PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE
from safetensors import SafetensorError
from safetensors.torch import load as load_blob

from pipeline.wire import ADAPTER_PATTERN, Keys
from staleness.weights.base import (
    DEFAULT_CHUNK_BYTES,
    Fetched,
    Opening,
    PublishStats,
    Receiving,
    Transport,
    WeightsUri,
    check_version,
)
from staleness.weights.buckets import ALIGN, dtype_name, raw_bytes, tensor_entries, tensor_view
from staleness.weights.delta import Delta, DeltaError, HeldWeights, Whole
from staleness.weights.delta import apply as apply_delta
from staleness.weights.sources import WeightSource, named_tensors

log = logging.getLogger(__name__)

DEFAULT_BATCH_BYTES = 256 << 20
"""Bytes of chunks read per pipeline round trip: bounds the reader's buffered copies."""
MANIFEST_V = 2
"""Version of the manifest's layout written (a reader refuses one it does not know). 1: one safetensors blob."""
READABLE = {1: "safetensors", 2: "raw"}
"""Manifest versions this reader knows, and the format of each."""


class RedisTransport(Transport):
    """`redis://`: a version's tensors as raw bytes in chunks under `{ns}:weights:{v}:{i}`, then a manifest.

    For one machine and small models (the embedded default): the bytes go through the Redis every worker
    already talks to. Each chunk is written as soon as it is full, and the manifest last, so a reader that finds the
    manifest finds every chunk; the manifest's sha256 catches anything else. Reads are pipelined, `batch_bytes` a
    round trip. The client must be a synchronous `redis.Redis` with `decode_responses=False`.

    Host memory while publishing: the one chunk being filled, `chunk_bytes` (the bucket; `last_publish` counts it;
    sent from its own memory, see `_zero_copy_client`), plus whatever the source holds (nothing more than the tensor
    it is on, for a generator).

    Stored, and fetched ahead: a worker reads and checks a version (`fetch`) while it still generates, and, paused,
    only copies it into its model (`engine.load_tensors`).

    Deltas (`held`, the trainer's last published version: `publish_weights(..., deltas=True)`): beside each version,
    what changed since the one before (`staleness.weights.delta`) under `{ns}:weights:{v}:delta` and its chunks; a
    worker that holds the version before (the buffer it last fetched) reads only that, applies it and checks the
    result against the manifest's sha256; any other reads the version whole.
    """

    scheme = "redis"
    fetches_ahead = True
    sends_deltas = True

    def __init__(
        self,
        client: redis.Redis,
        ns: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        adapter: str | None = None,
        held: HeldWeights | None = None,
    ) -> None:
        if chunk_bytes < 1 or batch_bytes < 1:
            raise ValueError(f"chunk_bytes and batch_bytes must be >= 1, got {chunk_bytes}, {batch_bytes}")
        if adapter is not None and not re.match(ADAPTER_PATTERN, adapter):
            raise ValueError(f"adapter name {adapter!r} must match {ADAPTER_PATTERN}")
        self.client = client
        self.keys = Keys(ns).weights_of(adapter)  # raises ValueError for a bad namespace
        self.adapter = adapter
        """The LoRA adapter whose versions this transport keeps (`{ns}:adapter:NAME:weights:...`); None: the base."""
        self.chunk_bytes = chunk_bytes
        self.batch_bytes = batch_bytes
        self.held = held if adapter is None else None
        """The last version this trainer published, whole, to send the next as a delta from; None: no deltas."""

    @property
    def ns(self) -> str:
        return self.keys.ns

    @classmethod
    def open(cls, spec: str, parsed: WeightsUri, opening: Opening) -> RedisTransport:
        """The pipeline's namespace (or the uri's: they must agree); `bucket_bytes` is the chunk size."""
        client, ns = opening.namespace(spec, parsed)
        chunk_bytes = opening.bucket_bytes if opening.bucket_bytes is not None else opening.chunk_bytes
        if chunk_bytes is None:
            chunk_bytes = DEFAULT_CHUNK_BYTES
        adapter = opening.adapter or parsed.adapter
        return cls(client, ns, chunk_bytes=chunk_bytes, adapter=adapter, held=opening.held)

    @classmethod
    def fetch_stored(cls, uri: WeightsUri, version: int, redis_client: redis.Redis | None) -> Fetched:
        """The version's tensors, read through the worker's own connection and checked (`fetch`)."""
        return cls._reader(uri, redis_client).fetch(version)

    @classmethod
    def fetch_received(cls, uri: WeightsUri, version: int, receiving: Receiving) -> Fetched:
        """The version as `fetch_stored` reads it, or, where the worker holds the version its delta is from, that
        delta applied (the base model's; `held` then holds this version)."""
        if receiving.held is None or uri.adapter is not None:
            return cls.fetch_stored(uri, version, receiving.redis_client)
        return cls._reader(uri, receiving.redis_client).fetch(version, receiving.held)

    @classmethod
    def fetch_adapter(
        cls, uri: WeightsUri, version: int, redis_client: redis.Redis | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The adapter's tensors, and its config from the manifest."""
        reader = cls._reader(uri, redis_client)
        tensors = reader.fetch(version)
        config = reader.manifest(version).get("config")
        if not isinstance(config, dict):
            raise ValueError(f"adapter {uri}: no adapter config (r, lora_alpha, target_modules) stored with it")
        return tensors, config

    @classmethod
    def _reader(cls, uri: WeightsUri, redis_client: redis.Redis | None) -> RedisTransport:
        if uri.version is None:
            raise ValueError(f"weights uri {str(uri)!r} names no version (redis://NS/v<version>)")
        if redis_client is None:
            raise ValueError(f"loading {uri} needs the worker's Redis client")
        return cls(redis_client, uri.location, adapter=uri.adapter)

    def uri_of(self, version: int) -> str:
        return str(WeightsUri("redis", self.ns, check_version(version), self.adapter))

    def put(self, tensors: WeightSource, version: int, adapter_config: Mapping[str, Any] | None) -> PublishStats:
        """Store the chunks as the tensors come, then the manifest: its uri is `redis://{ns}/v{version}` (an adapter's:
        `redis://{ns}/adapters/NAME/v{version}`, its `adapter_config` in the manifest). If the source raises, the
        chunks written so far are deleted and the error propagates."""
        keys = self.keys
        if self.client.exists(keys.weights_manifest(version)):
            raise FileExistsError(
                f"weights version {version} exists in Redis ({keys.weights_manifest(version)}): remove it first"
            )
        self.remove(version)  # leftovers of a write that crashed before its manifest
        sender = _zero_copy_client(self.client)
        copies = 0 if sender is not self.client or not HIREDIS_AVAILABLE else 2
        writer = _ChunkWriter(sender, keys, version, self.chunk_bytes, copies)
        entries: list[list[Any]] = []
        whole = Whole() if self.held is not None else None
        """The version whole, with deltas: the base of the next."""
        sent: Delta | None = None
        delta: dict[str, Any] | None = None
        sums: list[str] = []

        def manifest(chunks: int, sha256: str) -> tuple[str, str]:
            sums.append(sha256)
            fields = {
                "v": MANIFEST_V,
                "format": READABLE[MANIFEST_V],
                "version": version,
                "chunks": chunks,
                "chunk_bytes": self.chunk_bytes,
                "bytes": writer.offset,
                "sha256": sha256,
                "align": ALIGN,
                "tensors": entries,
                "ts": time.time(),
            }
            if adapter_config is not None:
                fields["config"] = dict(adapter_config)
            if whole is not None:
                fields["deltas"] = True  # a worker holds what it fetches: the base of the next delta
            if delta is not None:
                fields["delta"] = delta
            return keys.weights_manifest(version), json.dumps(fields, separators=(",", ":"))

        try:
            for name, tensor in named_tensors(tensors):
                offset = writer.align()
                entries.append([name, dtype_name(tensor.dtype), list(tensor.shape), offset])
                data = raw_bytes(tensor).numpy()
                writer.write(data)
                if whole is not None:
                    whole.add(data)  # at `offset`: both pad to `ALIGN`
                writer.stats.tensors += 1
                writer.stats.bytes += tensor.nbytes
                del tensor, data  # the source's next tensor is produced without this one held
            if whole is not None:
                delta, sent = self._put_delta(version, whole.array(), writer.stats)
            writer.close(manifest)  # the manifest last, with the last chunk
        except BaseException:
            with contextlib.suppress(redis.RedisError):
                self.remove(version)
            raise
        finally:
            writer.shutdown()
            if sender is not self.client:
                sender.close()
                sender.connection_pool.disconnect()
        if self.held is not None and whole is not None:
            self.held.published(version, whole.array(), sums[-1], sent)
        return writer.stats

    def _delta_key(self, version: int, index: int | None = None) -> str:
        """`{ns}:weights:{v}:delta` (its header, JSON) and `...:delta:{i}` (its payload's chunks)."""
        return f"{self.keys.weights_prefix}{version}:delta" + ("" if index is None else f":{index}")

    def _put_delta(
        self, version: int, whole: np.ndarray, stats: PublishStats
    ) -> tuple[dict[str, Any] | None, Delta | None]:
        """Store the delta from the held version to `whole` (the header, then the payload's chunks: all before the
        manifest, which names it); its manifest entry and itself, or Nones where the version goes whole only
        (`HeldWeights.delta_to`)."""
        held = self.held
        delta = held.delta_to(whole, version) if held is not None else None
        if held is None or delta is None:
            return None, None
        payload = memoryview(delta.payload())
        chunks = -(-len(payload) // self.chunk_bytes)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self._delta_key(version), delta.header())
        for i in range(chunks):
            pipe.set(self._delta_key(version, i), payload[i * self.chunk_bytes : (i + 1) * self.chunk_bytes])
        pipe.execute()
        stats.delta_bytes = len(payload)
        return held.entry(delta) | {"chunks": chunks}, delta

    def manifest(self, version: int) -> dict[str, Any]:
        """The manifest of a complete version (`FileNotFoundError` if none, `ValueError` if malformed)."""
        version = check_version(version)
        key = self.keys.weights_manifest(version)
        raw = self.client.get(key)
        if raw is None:
            raise FileNotFoundError(
                f"weights version {version} is not in Redis: no {key} (removed, or never published)"
            )
        try:
            manifest = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"weights manifest {key} is not JSON: {exc}") from None
        if not isinstance(manifest, dict):
            raise ValueError(f"weights manifest {key} is not a JSON object: {raw[:100]!r}")
        v = manifest.get("v")
        known = READABLE.get(v) if isinstance(v, int) and not isinstance(v, bool) else None
        if known is None or manifest.get("format") != known:
            raise ValueError(
                f"weights manifest {key} has v={manifest.get('v')!r}, format={manifest.get('format')!r}; "
                f"this reader knows {', '.join(f'v={v}, format={f!r}' for v, f in READABLE.items())}"
            )
        counts = ("chunks", "bytes", "tensors") if manifest["v"] == 1 else ("chunks", "bytes")
        for field in counts:
            if not isinstance(manifest.get(field), int) or isinstance(manifest[field], bool) or manifest[field] < 0:
                raise ValueError(
                    f"weights manifest {key}: {field!r} must be an integer >= 0, got {manifest.get(field)!r}"
                )
        if not isinstance(manifest.get("sha256"), str):
            raise ValueError(f"weights manifest {key} has no sha256 checksum")
        if manifest.get("version") != version:
            raise ValueError(f"weights manifest {key} is of version {manifest.get('version')!r}, not {version}")
        if manifest["chunks"] == 0:
            raise ValueError(f"weights manifest {key} lists no chunks: nothing to load")
        if manifest["v"] == 2:
            tensor_entries(manifest.get("tensors"), manifest["bytes"], key)  # raises for a bad one
        return manifest

    def fetch(self, version: int, held: HeldWeights | None = None) -> dict[str, torch.Tensor]:
        """Read a complete version's chunks (pipelined), check size and sha256, and return its tensors (v2: views of
        one buffer, which the chunks are read into straight from the socket where the client allows it, a batch of
        chunks at a time; the sha256 is taken on a thread as they land).

        `held`: the worker's last version, whole. Where it is the base of this version's delta, the delta is read and
        applied instead (and checked); `held` then holds this version, if the trainer sends deltas."""
        manifest = self.manifest(version)
        if manifest["v"] == 1:
            return self._fetch_blob(version, manifest)
        key = self.keys.weights_manifest(version)
        entries = tensor_entries(manifest["tensors"], manifest["bytes"], key)
        info = manifest.get("delta")
        info = info if isinstance(info, dict) else {}
        base = None
        if held is not None and info:
            base = held.base_for(str(info.get("base_sha256")), manifest["bytes"])
        if held is not None and base is not None:
            try:
                applied = torch.from_numpy(self._fetch_delta(version, manifest, base))
                held.received(version, applied.numpy(), manifest["sha256"], manifest)
                log.info("weights version %d: its delta from version %s applied (%d bytes read of %d)", version,
                         info.get("base"), info.get("bytes"), manifest["bytes"])  # fmt: skip
                return {meta.name: tensor_view(applied, meta, offset) for meta, offset in entries}
            except (DeltaError, ValueError) as exc:
                log.warning("weights version %d: its delta did not apply (%s); reading it whole", version, exc)
        buffer = self._fetch_whole(version, manifest)
        if held is not None and manifest.get("deltas"):
            held.received(version, buffer.numpy(), manifest["sha256"], manifest)
        return {meta.name: tensor_view(buffer, meta, offset) for meta, offset in entries}

    def _fetch_delta(self, version: int, manifest: Mapping[str, Any], base: np.ndarray) -> np.ndarray:
        """The version's buffer from `base` and its delta (read whole: a few percent of the version)."""
        info = manifest["delta"]
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self._delta_key(version))
        for i in range(int(info["chunks"])):
            pipe.get(self._delta_key(version, i))
        header, *parts = pipe.execute()
        if header is None or any(part is None for part in parts):
            raise DeltaError(f"its delta's keys are gone ({self._delta_key(version)}...)")
        delta = Delta.read(header, b"".join(parts))
        if delta.sha256 != manifest["sha256"] or delta.version != version:
            raise DeltaError("the delta is of another version than the manifest's")
        return apply_delta(base, delta)

    def _fetch_whole(self, version: int, manifest: Mapping[str, Any]) -> torch.Tensor:
        """A v2 version's bytes, read into one buffer and checked."""
        buffer = torch.empty(manifest["bytes"], dtype=torch.uint8)
        flat = memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs lack __buffer__
        digest = hashlib.sha256()
        with ThreadPoolExecutor(1, thread_name_prefix="weights-sha256") as hasher:  # in order: one thread
            hashed: list[Future[None]] = []
            position = 0
            for start, end in self._read_into(version, manifest, flat):
                if end <= len(flat):  # more is a size mismatch, said below
                    hashed.append(hasher.submit(digest.update, flat[start:end]))
                position = end
            for done in hashed:
                done.result()
        self._check_size_and_sum(version, manifest, position, digest.hexdigest())
        return buffer

    def _read_into(self, version: int, manifest: Mapping[str, Any], flat: memoryview) -> Iterator[tuple[int, int]]:
        """Read the chunks in order into `flat` (what fits of them), yielding each one's `[start, end)` once it is
        there; `ValueError` naming the missing ones. From the socket straight into `flat` (`_RawGets`) where the
        client is a plain one; otherwise through the client's pipeline (`_chunks`) and one copy."""
        raw = _RawGets.open(self.client)
        if raw is None:
            position = 0
            for chunk in self._chunks(version, manifest):
                end = position + len(chunk)
                if end <= len(flat):
                    flat[position:end] = chunk
                yield position, end
                position = end
            return
        n_chunks = manifest["chunks"]
        per_batch = self._per_batch(manifest)
        missing: list[int] = []
        position = 0
        try:
            for first in range(0, n_chunks, per_batch):
                batch = range(first, min(first + per_batch, n_chunks))
                raw.send([self.keys.weights_chunk(version, i) for i in batch])
                for i in batch:
                    size = raw.read_bulk(flat, position, skip=bool(missing))
                    if size is None:
                        missing.append(i)
                    elif not missing:
                        yield position, position + size
                        position += size
        finally:
            raw.close()
        if missing:
            self._missing(version, n_chunks, missing)

    def _per_batch(self, manifest: Mapping[str, Any]) -> int:
        return max(1, self.batch_bytes // max(1, int(manifest.get("chunk_bytes") or self.chunk_bytes)))

    def _missing(self, version: int, n_chunks: int, missing: list[int]) -> None:
        shown = f"{missing[:10]}{'...' if len(missing) > 10 else ''}"
        raise ValueError(
            f"weights version {version}: {len(missing)} of {n_chunks} chunks are missing ({shown}, keys "
            f"{self.keys.weights_chunk(version, missing[0])} ...); was it removed while being read?"
        )

    def _chunks(self, version: int, manifest: Mapping[str, Any]) -> Iterable[bytes]:
        """The chunks in order, a pipelined batch of `batch_bytes` at a time; `ValueError` naming the missing ones."""
        n_chunks = manifest["chunks"]
        per_batch = self._per_batch(manifest)
        missing: list[int] = []
        for start in range(0, n_chunks, per_batch):
            pipe = self.client.pipeline(transaction=False)
            for i in range(start, min(start + per_batch, n_chunks)):
                pipe.get(self.keys.weights_chunk(version, i))
            for i, chunk in enumerate(pipe.execute(), start):
                if chunk is None:
                    missing.append(i)
                elif not missing:
                    yield chunk
        if missing:
            self._missing(version, n_chunks, missing)

    @staticmethod
    def _check_size_and_sum(version: int, manifest: Mapping[str, Any], size: int, digest: str) -> None:
        if size != manifest["bytes"]:
            raise ValueError(
                f"weights version {version}: chunks hold {size} bytes, the manifest says {manifest['bytes']}"
            )
        if digest != manifest["sha256"]:
            raise ValueError(
                f"weights version {version}: checksum mismatch (sha256 {digest} != {manifest['sha256']} in the "
                "manifest): a chunk was corrupted or overwritten"
            )

    def _fetch_blob(self, version: int, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """A `v: 1` version: one safetensors blob."""
        blob = b"".join(self._chunks(version, manifest))
        self._check_size_and_sum(version, manifest, len(blob), hashlib.sha256(blob).hexdigest())
        try:
            tensors = load_blob(blob)
        except (SafetensorError, ValueError) as exc:
            raise ValueError(f"weights version {version}: not a safetensors blob: {exc}") from None
        if len(tensors) != manifest["tensors"]:
            raise ValueError(
                f"weights version {version}: {len(tensors)} tensors, the manifest says {manifest['tensors']}"
            )
        return tensors

    def versions(self) -> list[int]:
        stored = sorted(self.stored())
        pipe = self.client.pipeline(transaction=False)
        for v in stored:
            pipe.exists(self.keys.weights_manifest(v))
        return [v for v, present in zip(stored, pipe.execute(), strict=True) if present]

    def stored(self) -> set[int]:
        return {int(v) for v in self.client.hkeys(self.keys.weights_index) if v.isdigit()}

    def remove(self, version: int) -> bool:
        """DEL the manifest first (readers stop seeing the version), then every chunk, then its index entry."""
        version = check_version(version)
        keys = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(keys.weights_index, str(version))
        pipe.get(keys.weights_manifest(version))
        pipe.get(self._delta_key(version))
        counted, raw, delta_header = pipe.execute()
        n_chunks = int(counted or 0)
        if raw is not None:
            with contextlib.suppress(ValueError, AttributeError, TypeError):  # a malformed manifest still goes
                n_chunks = max(n_chunks, int(json.loads(raw).get("chunks", 0)))
        delta_chunks = 0
        if delta_header is not None:  # written before its chunks: a write that died midway leaves it to find them by
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                delta_chunks = len(json.loads(delta_header).get("chunks", []))
        pipe = self.client.pipeline(transaction=True)  # one slot ({ns}), so MULTI is legal on a cluster too
        pipe.delete(keys.weights_manifest(version))
        for start in range(0, n_chunks, 1000):
            pipe.delete(*(keys.weights_chunk(version, i) for i in range(start, min(start + 1000, n_chunks))))
        pipe.delete(self._delta_key(version), *(self._delta_key(version, i) for i in range(delta_chunks + 1)))
        pipe.hdel(keys.weights_index, str(version))
        return any(pipe.execute())


class _ChunkWriter:
    """Cuts a stream of bytes into chunks of `chunk_bytes` and SETs each as soon as it is full, from one buffer that is
    filled again after each SET (no chunk is queued). The index entry (version -> chunks written) goes in the same
    pipeline as each chunk, before it, so a write that dies midway leaves nothing `remove` cannot find.

    Host memory: the buffer, and whatever copies the client makes to send it (none from `_zero_copy_client`; two by
    hiredis's packer otherwise): `stats.peak_buffered_bytes` counts them. Chunks are not queued to send several a
    round trip: each queued chunk would be a copy, for a round trip that costs little beside a chunk's bytes."""

    def __init__(self, client: redis.Redis, keys: Keys, version: int, chunk_bytes: int, copies: int) -> None:
        self.client, self.keys, self.version = client, keys, version
        self.chunk_bytes = chunk_bytes
        self.copies = copies
        """Copies of a chunk the client makes to send it (0 from `_zero_copy_client`; 2 by hiredis's packer)."""
        self.chunk = bytearray(chunk_bytes)
        self.fill = 0
        self.chunks = 0
        self.offset = 0
        """Bytes of the stream so far (padding included)."""
        self.sha256 = hashlib.sha256()
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="weights-sha256")
        """Takes each chunk's sha256 while it is sent (hashlib lets go of the GIL)."""
        self.stats = PublishStats()

    def align(self) -> int:
        """Pad with zeros to the next multiple of `ALIGN`; returns that offset (where the next tensor starts)."""
        pad = -self.offset % ALIGN
        if pad:
            self.write(bytes(pad))
        return self.offset

    def write(self, data: Any) -> None:
        """Append bytes (anything with the buffer protocol: a numpy array's bytes are copied only into the chunk)."""
        view = memoryview(data).cast("B")
        position = 0
        while position < len(view):
            take = min(self.chunk_bytes - self.fill, len(view) - position)
            self.chunk[self.fill : self.fill + take] = view[position : position + take]
            self.fill += take
            position += take
            if self.fill == self.chunk_bytes:
                self.send()
        self.offset += len(view)

    def send(self, last: tuple[str, str] | None = None) -> None:
        """SET the chunk being filled (the index entry first), and `last` (key, value) after it; then fill it again."""
        piece = memoryview(self.chunk)[: self.fill]
        hashed = self.hasher.submit(self.sha256.update, piece)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.weights_index, str(self.version), self.chunks + 1)
        pipe.set(self.keys.weights_chunk(self.version, self.chunks), piece)
        if last is not None:
            pipe.set(*last)
        try:
            pipe.execute()
        finally:
            hashed.result()  # the chunk is filled again only once hashed
        self.stats.hold(self.chunk_bytes + self.copies * self.fill)  # the buffer, and the client's copies of it
        self.chunks += 1
        self.fill = 0

    def close(self, last: Callable[[int, str], tuple[str, str]]) -> None:
        """Send the last chunk (what is being filled, even nothing when no chunk went yet, so that a version has one),
        with `last(chunks, sha256)` (the manifest: key, value) after it in the same round trip; else just that."""
        if self.fill or not self.chunks:
            digest = self.sha256.copy()
            digest.update(memoryview(self.chunk)[: self.fill])
            self.send(last(self.chunks + 1, digest.hexdigest()))
        else:
            self.client.set(*last(self.chunks, self.sha256.hexdigest()))

    def shutdown(self) -> None:
        self.hasher.shutdown()


def _zero_copy_client(client: redis.Redis) -> redis.Redis:
    """A client of the same server (same address, credentials, TLS, timeouts) whose connection sends a big value from
    its own memory: with hiredis installed, redis-py packs each command into one new bytes object (after a `bytes()`
    of a memoryview: two copies of a chunk; a 16 MiB SET raised the peak resident memory by 64 MiB), where its pure
    Python packer hands a memoryview to the socket as it is. `client` itself when it is not a plain `redis.Redis` over
    a `ConnectionPool` (fakeredis, a cluster client) or hiredis is not in use."""
    pool = getattr(client, "connection_pool", None)
    if (
        not HIREDIS_AVAILABLE
        or type(client) is not redis.Redis
        or type(pool) is not redis.ConnectionPool
        or not issubclass(pool.connection_class, redis.connection.AbstractConnection)
    ):
        return client
    encoder = pool.get_encoder()
    packer = PythonRespSerializer(6000, encoder.encode)  # redis-py's own cutoff: bigger values go by reference
    kwargs = {**pool.connection_kwargs, "command_packer": packer}
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))


class _RawGets:
    """Pipelined GETs whose bulk replies are read from the socket straight into the caller's buffer: no parser's
    buffer, no `bytes` of each chunk, no copy of those into the tensors' buffer (redis-py with hiredis copies a chunk
    three times on its way: into its read buffer, hiredis's, then a new `bytes`).

    On a connection of its own (the client's address, credentials, TLS and timeouts: redis-py's own handshake), closed
    after the read, so that nothing half-read is ever left on a connection of the client's pool. `open` returns None
    where the client is not a plain `redis.Redis` over a `ConnectionPool` (fakeredis, a cluster or sentinel client):
    the caller then reads through the client."""

    def __init__(self, connection: redis.connection.AbstractConnection, sock: socket.socket) -> None:
        self.connection = connection
        self.sock = sock
        self.pending = bytearray()
        """Bytes received and not consumed yet (a reply's header line read ahead of its payload)."""

    @classmethod
    def open(cls, client: redis.Redis) -> _RawGets | None:
        pool = getattr(client, "connection_pool", None)
        if (
            type(client) is not redis.Redis
            or type(pool) is not redis.ConnectionPool
            or not issubclass(pool.connection_class, redis.connection.AbstractConnection)
        ):
            return None
        connection = pool.connection_class(**pool.connection_kwargs)
        connection.connect()
        sock = getattr(connection, "_sock", None)
        if not isinstance(sock, socket.socket) or connection.can_read(timeout=0):  # not a plain, quiet socket
            connection.disconnect()
            return None
        return cls(connection, sock)

    def send(self, keys: list[str]) -> None:
        self.connection.send_packed_command(self.connection.pack_commands([("GET", key) for key in keys]))

    def read_bulk(self, flat: memoryview, position: int, skip: bool = False) -> int | None:
        """The next reply: a bulk string read into `flat` at `position` (what fits; `skip`: none of it), its size; None
        for a nil (a missing key). A Redis error is raised as redis-py raises it, and so is a socket's."""
        try:
            return self._read_bulk(flat, position, skip)
        except TimeoutError as exc:  # socket.timeout
            raise redis.TimeoutError(f"Timeout reading weights from Redis: {exc}") from None
        except OSError as exc:
            raise redis.ConnectionError(f"Error reading weights from Redis: {exc}") from None

    def _read_bulk(self, flat: memoryview, position: int, skip: bool) -> int | None:
        line = self._line()
        if line[:1] == b"$" and line != b"$-1":
            size = int(line[1:])
            end = min(position + size, len(flat)) if not skip else position
            self._into(flat[position:end])
            self._discard(size - (end - position) + 2)  # what did not fit, and the CRLF
            return size
        if line in (b"$-1", b"_"):  # nil: RESP2, RESP3
            return None
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        raise redis.ConnectionError(f"unexpected reply to GET from Redis: {line[:80]!r}")

    def close(self) -> None:
        self.connection.disconnect()

    def _line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            self._receive()
        line = bytes(self.pending[:end])
        del self.pending[: end + 2]
        return line

    def _receive(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise redis.ConnectionError("Redis closed the connection while weights were read")
        self.pending += data

    def _into(self, view: memoryview) -> None:
        take = min(len(self.pending), len(view))
        view[:take] = self.pending[:take]
        del self.pending[:take]
        while take < len(view):
            got = self.sock.recv_into(view[take:])
            if not got:
                raise redis.ConnectionError("Redis closed the connection while weights were read")
            take += got

    def _discard(self, size: int) -> None:
        while len(self.pending) < size:
            self._receive()
        del self.pending[:size]

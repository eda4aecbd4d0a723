"""`redis://NS`: a version as one safetensors blob in chunks under `{NS}:weights:{n}:{i}`, a JSON manifest written
last, and an index written first (`RedisTransport`): for one machine and small models, through the Redis every
worker already talks to."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

import redis
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_blob
from safetensors.torch import save

from pipeline.wire import ADAPTER_PATTERN, Keys
from staleness.weights.base import NamedTensors, Scheme, WeightsUri, check_version, release_older, state_dict_of

DEFAULT_CHUNK_BYTES = 32 << 20
"""Size of one Redis value holding weights: far below Redis's 512 MiB limit, small enough not to stall it."""
DEFAULT_BATCH_BYTES = 256 << 20
"""Bytes of chunks sent or read per pipeline round trip: bounds the client's buffered copies."""
MANIFEST_V = 1
"""Version of the manifest's layout (a reader refuses one it does not know)."""


class RedisTransport:
    """`redis://`: one safetensors blob in chunks under `{ns}:weights:{v}:{i}`, then a manifest.

    For one machine and small models (the embedded default): the bytes go through the Redis every worker
    already talks to. Chunks are written with pipelines (`batch_bytes` a round trip) and the manifest last,
    so a reader that finds the manifest finds every chunk; the manifest's sha256 catches anything else.
    The client must be a synchronous `redis.Redis` with `decode_responses=False`.
    """

    scheme: Scheme = "redis"

    def __init__(
        self,
        client: redis.Redis,
        ns: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        adapter: str | None = None,
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

    @property
    def ns(self) -> str:
        return self.keys.ns

    def uri_of(self, version: int) -> str:
        return str(WeightsUri("redis", self.ns, check_version(version), self.adapter))

    def publish(
        self,
        tensors: NamedTensors | torch.nn.Module,
        version: int,
        *,
        adapter_config: Mapping[str, Any] | None = None,
    ) -> str:
        """Store the chunks, then the manifest; return `redis://{ns}/v{version}` (an adapter's:
        `redis://{ns}/adapters/NAME/v{version}`, its `adapter_config` in the manifest)."""
        version = check_version(version)
        keys = self.keys
        if self.client.exists(keys.weights_manifest(version)):
            raise FileExistsError(
                f"weights version {version} exists in Redis ({keys.weights_manifest(version)}): remove it first"
            )
        named = state_dict_of(tensors)
        blob = save(named, metadata={"format": "pt", "version": str(version)})
        n_chunks = max(1, math.ceil(len(blob) / self.chunk_bytes))
        manifest = {
            "v": MANIFEST_V,
            "format": "safetensors",
            "version": version,
            "chunks": n_chunks,
            "chunk_bytes": self.chunk_bytes,
            "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
            "tensors": len(named),
            "ts": time.time(),
        }
        if adapter_config is not None:
            manifest["config"] = dict(adapter_config)
        self.remove(version)  # leftovers of a write that crashed before its manifest
        self.client.hset(keys.weights_index, str(version), n_chunks)
        view = memoryview(blob)
        pipe = self.client.pipeline(transaction=False)
        pending = 0
        for i in range(n_chunks):
            piece = view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]
            pipe.set(keys.weights_chunk(version, i), piece)
            pending += len(piece)
            if pending >= self.batch_bytes:
                pipe.execute()
                pending = 0
        pipe.set(keys.weights_manifest(version), json.dumps(manifest, separators=(",", ":")))
        pipe.execute()
        return self.uri_of(version)

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
        if manifest.get("v") != MANIFEST_V or manifest.get("format") != "safetensors":
            raise ValueError(
                f"weights manifest {key} has v={manifest.get('v')!r}, format={manifest.get('format')!r}; "
                f"this reader knows v={MANIFEST_V}, format='safetensors'"
            )
        for field in ("chunks", "bytes", "tensors"):
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
        return manifest

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """Read a complete version's chunks (pipelined), check size and sha256, and return its tensors."""
        manifest = self.manifest(version)
        n_chunks = manifest["chunks"]
        per_batch = max(1, self.batch_bytes // max(1, int(manifest.get("chunk_bytes") or self.chunk_bytes)))
        chunks: list[bytes | None] = []
        for start in range(0, n_chunks, per_batch):
            pipe = self.client.pipeline(transaction=False)
            for i in range(start, min(start + per_batch, n_chunks)):
                pipe.get(self.keys.weights_chunk(version, i))
            chunks += pipe.execute()
        missing = [i for i, chunk in enumerate(chunks) if chunk is None]
        if missing:
            shown = f"{missing[:10]}{'...' if len(missing) > 10 else ''}"
            raise ValueError(
                f"weights version {version}: {len(missing)} of {n_chunks} chunks are missing ({shown}, keys "
                f"{self.keys.weights_chunk(version, missing[0])} ...); was it removed while being read?"
            )
        blob = b"".join(cast("list[bytes]", chunks))  # none is None: `missing` is empty
        if len(blob) != manifest["bytes"]:
            raise ValueError(
                f"weights version {version}: chunks hold {len(blob)} bytes, the manifest says {manifest['bytes']}"
            )
        digest = hashlib.sha256(blob).hexdigest()
        if digest != manifest["sha256"]:
            raise ValueError(
                f"weights version {version}: checksum mismatch (sha256 {digest} != {manifest['sha256']} in the "
                "manifest): a chunk was corrupted or overwritten"
            )
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
        counted, raw = pipe.execute()
        n_chunks = int(counted or 0)
        if raw is not None:
            with contextlib.suppress(ValueError, AttributeError, TypeError):  # a malformed manifest still goes
                n_chunks = max(n_chunks, int(json.loads(raw).get("chunks", 0)))
        pipe = self.client.pipeline(transaction=True)  # one slot ({ns}), so MULTI is legal on a cluster too
        pipe.delete(keys.weights_manifest(version))
        for start in range(0, n_chunks, 1000):
            pipe.delete(*(keys.weights_chunk(version, i) for i in range(start, min(start + 1000, n_chunks))))
        pipe.hdel(keys.weights_index, str(version))
        return any(pipe.execute())

    def release(self, keep: Iterable[int]) -> list[int]:
        return release_older(self, keep)

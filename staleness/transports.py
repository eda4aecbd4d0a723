"""Weight transports: how a trainer hands a new policy version to the workers.

A transport moves one version's tensors (checkpoint names, safetensors bytes: no pickle) from the
trainer to every worker. The trainer side `publish`es a version and gets back a uri that names it;
the staleness manager sends that uri in the `weights` command and records it as `weights_uri` in
`{ns}:state`; each worker calls `load_version(engine, uri, version, redis_client)`. Versions are
immutable: publishing one that exists is an error, and `release`/`remove` delete what no worker
needs any more.

- `fs:///DIR/v{n}`: `DIR/v{n}/model.safetensors` on storage that every machine mounts at the same path;
  the worker calls `engine.load_weights(dir, n)`.
- `redis://NS/v{n}`: one safetensors blob in chunks under `{NS}:weights:{n}:{i}` plus a JSON manifest
  `{NS}:weights:{n}:manifest` (written last), and the hash `{NS}:weights:index` (version -> chunk count,
  written first, so that a write that crashed can be cleaned up without SCAN); the worker reads them
  through its own Redis connection, checks the sha256, and calls `engine.load_tensors(tensors, n)`.
- `nccl://HOST:PORT`: nothing stored; the trainer broadcasts to every worker during the sync
  (`staleness.broadcast`); the worker calls `engine.load_broadcast(link, n)`.
- `ipc://NS/v{n}`: colocated handoff on one GPU; the trainer keeps the tensors in a GPU buffer of its own and
  stores a JSON manifest of its CUDA IPC handle under `{NS}:weights:ipc:{n}` (`staleness.ipc`); the worker opens
  it on the same GPU and calls `engine.load_tensors(tensors, n)` with views of the trainer's memory.

LoRA adapters travel by the stored transports, each adapter in a place of its own, in PEFT's layout (what vLLM
loads): `fs:///DIR/adapters/NAME/v{n}/` holds `adapter_model.safetensors` and `adapter_config.json`;
`redis://NS/adapters/NAME/v{n}` keeps the blob under `{NS}:adapter:NAME:weights:{n}:{i}` with the config in its
manifest. The worker calls `fetch_adapter(uri, n)` and `engine.load_adapter(name, tensors, config, n)`.

The engine is duck-typed (`LoadsWeights`): this module imports no engine, as the design asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import redis
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_blob
from safetensors.torch import load_file, save, save_file

from pipeline.files import fsync_path
from pipeline.wire import ADAPTER_PATTERN, Keys

if TYPE_CHECKING:
    from staleness.broadcast import BroadcastLink

Scheme = Literal["fs", "redis", "nccl", "ipc"]
TensorLike = torch.Tensor | np.ndarray
NamedTensors = Mapping[str, TensorLike]

SCHEMES: tuple[Scheme, ...] = ("fs", "redis", "nccl", "ipc")
DEFAULT_CHUNK_BYTES = 32 << 20
"""Size of one Redis value holding weights: far below Redis's 512 MiB limit, small enough not to stall it."""
DEFAULT_BATCH_BYTES = 256 << 20
"""Bytes of chunks sent or read per pipeline round trip: bounds the client's buffered copies."""
MANIFEST_V = 1
"""Version of the manifest's layout (a reader refuses one it does not know)."""
WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
"""An adapter's files, as PEFT's `save_pretrained` writes them (and vLLM's LoRA loader reads them)."""
ADAPTERS_DIR = "adapters"
"""Under a transport's root (fs) or namespace (redis): one place per adapter name."""
PARTIAL_PREFIX = ".partial-"
"""A directory being written (`fs`); never a version until renamed."""
REMOVING_PREFIX = ".removing-"
"""A directory being deleted (`fs`): renamed first, so that no reader sees half a version."""

_VERSION_DIR = re.compile(r"v(\d+)")


class LoadsWeights(Protocol):
    """What a transport needs of an engine (`consumers.engine.Engine` has it all)."""

    weight_receivers: int
    """Processes that hold the weights and take a rank in an nccl broadcast (vLLM: one per GPU)."""

    async def load_weights(self, path: str, version: int) -> None: ...

    async def load_tensors(self, named_tensors: Mapping[str, Any], version: int) -> None: ...

    async def prepare_broadcast(self, link: BroadcastLink) -> None: ...

    async def load_broadcast(self, link: BroadcastLink) -> None: ...

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes cannot be loaded into the model."""
        ...


# -- uris ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsUri:
    """A parsed weights uri: `location` is a directory (fs), a namespace (redis, ipc) or HOST:PORT (nccl)."""

    scheme: Scheme
    location: str
    version: int | None
    """The version the uri names (`v{n}` as its last part), None for a transport's root."""
    adapter: str | None = None
    """The LoRA adapter a `redis://NS/adapters/NAME/v{n}` uri names (fs paths need no such field)."""

    def __str__(self) -> str:
        if self.scheme == "fs":
            return f"fs://{self.location}"
        adapter = "" if self.adapter is None else f"/{ADAPTERS_DIR}/{self.adapter}"
        suffix = "" if self.version is None else f"/v{self.version}"
        return f"{self.scheme}://{self.location}{adapter}{suffix}"


def parse_uri(uri: str) -> WeightsUri:
    """Split a weights uri into scheme, location and version; `ValueError` says what is wrong with a bad one.

    `fs://` + a path (absolute: `fs:///shared/ckpt/v3`); `redis://NS/v3` and `ipc://NS/v3` (braces around NS
    are allowed, the server is the worker's own connection); `nccl://HOST:PORT/v3`.
    """
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"unknown weights uri {uri!r}: expected one of {', '.join(s + '://' for s in SCHEMES)}")
    if scheme == "fs":
        if not rest:
            raise ValueError(f"weights uri {uri!r} names no directory (fs:///path/to/dir)")
        path = rest.rstrip("/") or "/"
        match = _VERSION_DIR.fullmatch(Path(path).name)
        return WeightsUri("fs", path, int(match.group(1)) if match else None)
    location, _, tail = rest.partition("/")
    tail = tail.strip("/")
    version = None
    adapter = None
    if scheme == "redis" and tail.startswith(ADAPTERS_DIR + "/"):  # redis://NS/adapters/NAME[/v{n}]
        adapter, _, tail = tail.removeprefix(ADAPTERS_DIR + "/").partition("/")
        if not re.match(ADAPTER_PATTERN, adapter):
            raise ValueError(f"weights uri {uri!r}: adapter name {adapter!r} must match {ADAPTER_PATTERN}")
    if tail:
        match = _VERSION_DIR.fullmatch(tail)
        if not match:
            raise ValueError(f"weights uri {uri!r}: expected {scheme}://{location or '...'}/v<version>, got /{tail}")
        version = int(match.group(1))
    if scheme in ("redis", "ipc"):
        ns = location.removeprefix("{").removesuffix("}")
        if ns:  # empty: `redis://`, the transport of the pipeline's own namespace
            Keys(ns)  # raises ValueError for a bad namespace
        return WeightsUri(scheme, ns, version, adapter)
    host, colon, port = location.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"weights uri {uri!r}: expected nccl://HOST:PORT")
    return WeightsUri("nccl", location, version)


# -- tensors -------------------------------------------------------------------------------------


def state_dict_of(
    source: torch.nn.Module | Mapping[str, TensorLike] | str | os.PathLike[str],
    *,
    keep_device: bool = False,
) -> dict[str, torch.Tensor]:
    """Name -> contiguous tensor, in checkpoint names, from a module, a state dict or a safetensors checkpoint.

    Tensors are moved to the CPU unless `keep_device` (a GPU broadcast sends them from where they are).

    A module wrapped by `torch.compile` or (Distributed)DataParallel is unwrapped, so names carry no
    `_orig_mod.`/`module.` prefix. A name whose tensor is another name's (tied weights, e.g. `lm_head.weight`
    = `model.embed_tokens.weight`) is left out, as `save_pretrained` does: the first name in order stays, and
    an engine loads the tied ones through it. Other tensors that overlap in memory are copied, since
    safetensors refuses shared storage. Tensors already in place are not copied otherwise: do not train while
    publishing.
    """
    if isinstance(source, torch.nn.Module):
        module = source
        while True:
            inner = getattr(module, "_orig_mod", None)  # torch.compile
            if inner is None and type(module).__name__ in ("DistributedDataParallel", "DataParallel"):
                inner = module.module
            if not isinstance(inner, torch.nn.Module):
                break
            module = inner
        items: Iterable[tuple[str, Any]] = module.state_dict().items()
    elif isinstance(source, Mapping):
        items = source.items()
    elif isinstance(source, (str, os.PathLike)):
        items = read_checkpoint(Path(source)).items()
    else:
        raise TypeError(
            f"state_dict_of takes a torch module, a mapping of tensors or a checkpoint path, got {source!r}"
        )
    out: dict[str, torch.Tensor] = {}
    kept: dict[int, list[torch.Tensor]] = {}  # storage address -> tensors kept on it
    for name, value in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        tensor = _as_tensor(name, value).detach()
        tensor = (tensor if keep_device else tensor.to("cpu")).contiguous()
        if tensor.numel() == 0:
            out[name] = tensor
            continue
        address = tensor.untyped_storage().data_ptr()
        others = kept.setdefault(address, [])
        if any(_same_view(tensor, other) for other in others):
            continue  # tied: an alias of a tensor already kept
        if others:
            tensor = tensor.clone()
            kept.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
        else:
            others.append(tensor)
        out[name] = tensor
    return out


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return torch.from_numpy(array if array.flags.writeable else array.copy())
    raise TypeError(f"tensor {name!r} is a {type(value).__name__}, not a torch tensor or numpy array")


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint (a directory of `*.safetensors`, or one file)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"a weights version is an integer >= 0, got {version!r}")
    return int(version)


# -- the trainer's side --------------------------------------------------------------------------


class WeightTransport(Protocol):
    """What the trainer (and the manager, to free space) sees of a transport."""

    scheme: Scheme

    def publish(
        self,
        tensors: NamedTensors | torch.nn.Module,
        version: int,
        *,
        adapter_config: Mapping[str, Any] | None = None,
    ) -> str:
        """Store one version completely, then return the uri that names it (`FileExistsError` if stored). With
        `adapter_config`, the tensors are a LoRA adapter's (PEFT names) and the config goes with them."""
        ...

    def versions(self) -> list[int]:
        """Versions stored completely, in order."""
        ...

    def remove(self, version: int) -> bool:
        """Delete a version (and any half-written leftover of it); False if there was nothing."""
        ...

    def release(self, keep: Iterable[int]) -> list[int]:
        """Delete every version below `max(keep)` that is not in `keep`; returns those deleted."""
        ...


def _release(transport: _Stored, keep: Iterable[int]) -> list[int]:
    """Versions above every kept one are left alone: they may be published but not yet announced."""
    wanted = {check_version(v) for v in keep}
    if not wanted:
        raise ValueError("release needs the versions to keep (at least the current one)")
    doomed = sorted(v for v in transport._stored() if v < max(wanted) and v not in wanted)
    return [v for v in doomed if transport.remove(v)]


class _Stored(Protocol):
    def _stored(self) -> set[int]: ...

    def remove(self, version: int) -> bool: ...


class FsTransport:
    """`fs://DIR`: one directory per version, `DIR/v{n}/model.safetensors`, made visible by one `rename`.

    For clusters with shared storage: DIR must be mounted at the same path on the trainer and every
    worker (the uri carries the absolute path). A reader never sees a half-written version: the file is
    written and fsynced in `DIR/.partial-v{n}-*`, which is then renamed to `DIR/v{n}`.
    """

    scheme: Scheme = "fs"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()

    @classmethod
    def from_uri(cls, uri: str) -> FsTransport:
        return cls(parse_uri(uri).location)

    def path_of(self, version: int) -> Path:
        return self.root / f"v{check_version(version)}"

    def uri_of(self, version: int) -> str:
        return f"fs://{self.path_of(version)}"

    def publish(
        self,
        tensors: NamedTensors | torch.nn.Module,
        version: int,
        *,
        adapter_config: Mapping[str, Any] | None = None,
    ) -> str:
        """Write `DIR/v{version}` atomically (temp dir, fsync, rename) and return `fs:///DIR/v{version}`.

        With `adapter_config`, the tensors are a LoRA adapter's: PEFT's two files are written instead."""
        final = self.path_of(version)
        if final.exists():
            raise FileExistsError(
                f"weights version {version} exists at {final}: versions are immutable, remove it first"
            )
        named = state_dict_of(tensors)
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{PARTIAL_PREFIX}v{version}-*"):  # an earlier attempt that crashed
            shutil.rmtree(stale, ignore_errors=True)
        partial = self.root / f"{PARTIAL_PREFIX}v{version}-{uuid.uuid4().hex[:12]}"
        partial.mkdir()  # mode from the umask (mkdtemp's 0700 would lock out workers running as another user)
        try:
            file = partial / (WEIGHTS_FILE if adapter_config is None else ADAPTER_FILE)
            save_file(named, str(file), metadata={"format": "pt", "version": str(version)})
            fsync_path(file)
            if adapter_config is not None:
                config = partial / ADAPTER_CONFIG
                config.write_text(json.dumps(dict(adapter_config), indent=2))
                fsync_path(config)
            fsync_path(partial)
            os.rename(partial, final)  # atomic: `v{n}` appears complete or not at all
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        fsync_path(self.root)
        return self.uri_of(version)

    def fetch(self, version: int) -> Path:
        """The directory of a complete version, for `engine.load_weights` (`FileNotFoundError` if none)."""
        return _fs_version_dir(self.path_of(version), version)

    def versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _VERSION_DIR.fullmatch(p.name)))

    def _stored(self) -> set[int]:
        stored = set(self.versions())
        if self.root.is_dir():
            pattern = re.compile(re.escape(PARTIAL_PREFIX) + r"v(\d+)-")
            stored |= {int(m.group(1)) for p in self.root.iterdir() if (m := pattern.match(p.name))}
        return stored

    def remove(self, version: int) -> bool:
        """Delete `v{version}` (renamed away first, so it vanishes at once) and any partial write of it."""
        final = self.path_of(version)
        doomed = list(self.root.glob(f"{PARTIAL_PREFIX}v{version}-*")) if self.root.is_dir() else []
        if final.exists():
            away = self.root / f"{REMOVING_PREFIX}v{version}-{uuid.uuid4().hex[:12]}"
            os.rename(final, away)
            doomed.append(away)
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        return bool(doomed)

    def release(self, keep: Iterable[int]) -> list[int]:
        return _release(self, keep)


def _fs_version_dir(path: Path, version: int) -> Path:
    if not path.is_dir():
        raise FileNotFoundError(
            f"weights version {version} not found: no directory {path} (removed, or never published)"
        )
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"weights version {version}: {path} holds no *.safetensors file")
    return path


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
        blob = b"".join(chunks)  # type: ignore[arg-type]
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
        stored = sorted(self._stored())
        pipe = self.client.pipeline(transaction=False)
        for v in stored:
            pipe.exists(self.keys.weights_manifest(v))
        return [v for v, present in zip(stored, pipe.execute(), strict=True) if present]

    def _stored(self) -> set[int]:
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
        return _release(self, keep)


def open_transport(
    spec: str,
    *,
    redis_client: redis.Redis | None = None,
    ns: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    join_timeout_s: float = 60.0,
    adapter: str | None = None,
) -> WeightTransport:
    """The trainer's transport from a spec: `fs://DIR`, `redis://` (or `redis://NS`) with the pipeline's client,
    `nccl://HOST:PORT` (this process hosts the rendezvous on PORT and broadcasts during each sync,
    waiting up to `join_timeout_s` for the workers to join), or `ipc://` (`ipc://NS`: this process keeps each
    version in a buffer on its GPU for workers on that GPU, the handles' manifest in the pipeline's Redis). With
    `adapter`, the place of that LoRA adapter's versions (`DIR/adapters/NAME`, `{ns}:adapter:NAME:weights:...`;
    nccl: the broadcast carries its config; ipc carries none)."""
    parsed = parse_uri(spec)
    if adapter is not None and not re.match(ADAPTER_PATTERN, adapter):
        raise ValueError(f"adapter name {adapter!r} must match {ADAPTER_PATTERN}")
    if parsed.scheme == "fs":
        root = Path(parsed.location)
        return FsTransport(root if adapter is None else root / ADAPTERS_DIR / adapter)
    if parsed.scheme == "nccl":
        from staleness.broadcast import NcclTransport  # it builds on this module

        return NcclTransport.from_uri(spec, timeout_s=join_timeout_s)
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
        from staleness.ipc import IpcTransport  # it builds on this module

        return IpcTransport(redis_client, name)
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
        return _fs_version_dir(Path(parsed.location), version)
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


def read_adapter(
    source: NamedTensors | torch.nn.Module | str | os.PathLike[str], config: Mapping[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An adapter's tensors and config: from a PEFT directory (`adapter_model.safetensors` + `adapter_config.json`;
    `config`, if given, overrides the file's), or from tensors and `config`. `ValueError` says what is missing."""
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        directory = Path(source)
        if config is None:
            config_file = directory / ADAPTER_CONFIG
            if not config_file.is_file():
                raise FileNotFoundError(f"adapter {directory}: no {ADAPTER_CONFIG} (PEFT's save_pretrained writes it)")
            try:
                config = json.loads(config_file.read_text())
            except ValueError as exc:
                raise ValueError(f"adapter {directory}: {config_file.name} is not JSON: {exc}") from None
        source = read_checkpoint(directory)
    if not isinstance(config, Mapping):
        raise ValueError("an adapter needs its config (adapter_config: r, lora_alpha, target_modules)")
    return state_dict_of(source), dict(config)


async def join_adapter(uri: str, version: int, epoch: int, *, member: str, timeout_s: float = 60.0) -> BroadcastLink:
    """Join sync `epoch`'s broadcast of a LoRA adapter (`nccl://`) as one rank of this process, and build or find
    its group, while generation goes on (a worker does this before it pauses the adapter). Raises as
    `join_version` does."""
    from staleness.broadcast import join_broadcast, prepare_receiver  # it builds on this module

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
    from staleness.broadcast import receive_broadcast

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
    from staleness.broadcast import join_broadcast  # it builds on this module

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
    (`staleness.ipc.load_ipc`). Errors leave the engine's weights as they were: `FileNotFoundError` (version
    not there), `ValueError` (bad uri, checksum, manifest; ipc: not the same GPU), `TimeoutError` (no trainer).
    """
    scheme = parse_uri(uri).scheme
    if scheme == "ipc":
        from staleness.ipc import load_ipc  # it builds on this module

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

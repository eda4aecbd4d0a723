"""The contract of the weight transports: uris (`WeightsUri`, `parse_uri`), the registry of transports by scheme
(`register_transport`, `transport_class`, `transport_of`: vLLM's `WeightTransferEngineFactory`), the `Transport`
class every transport is (both sides: the trainer's publish and push, the worker's fetch and load, and the
capabilities the trainer, the worker's sync and its adapters ask instead of the scheme), tensors in checkpoint names
(what a trainer publishes, `WeightSource`, streamed one tensor at a time by `named_tensors`; `state_dict_of`,
`read_checkpoint`, `read_adapter`), versions (`check_version`, `release_older`), and what a transport needs of an
engine (`LoadsWeights`) and what a publish held (`PublishStats`). The engine is duck-typed: this package imports no
engine, as the design asks.

Nor does this module (or the package's `__init__`) import torch: a worker whose work moves no tensors (the synthetic
engine's, between syncs) never loads it; the transports' modules, imported when their scheme is first asked for, and
the functions here that open tensors, do."""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias

import numpy as np

from pipeline.wire import ADAPTER_PATTERN, Keys
from staleness.weights.handover import Handover, LoadsWeights

if TYPE_CHECKING:
    import redis
    import torch

    from staleness.weights.delta import HeldWeights
    from staleness.weights.sources import WeightSource

log = logging.getLogger(__name__)

ADAPTERS_DIR = "adapters"
"""Under a transport's root (fs) or namespace (redis): one place per adapter name."""

VERSION_DIR = re.compile(r"v(\d+)")
"""A version's name in a uri or a directory: `v{n}`."""
DEFAULT_CHUNK_BYTES = 32 << 20
"""Size of one Redis value holding weights (`redis://`'s bucket: the writer holds one, and redis-py's copy of it on the
wire): far below Redis's 512 MiB limit, small enough not to stall it."""


# -- uris ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsUri:
    """A parsed weights uri: `location` is what its transport names there: a directory (fs), a namespace (redis, ipc),
    HOST:PORT (nccl)."""

    scheme: str
    location: str
    version: int | None
    """The version the uri names (`v{n}` as its last part), None for a transport's root."""
    adapter: str | None = None
    """The LoRA adapter a `redis://NS/adapters/NAME/v{n}` uri names (fs paths need no such field)."""

    def __str__(self) -> str:
        return transport_class(self.scheme).format_uri(self)


def parse_uri(uri: str) -> WeightsUri:
    """Split a weights uri into scheme, location and version, as the transport registered for its scheme reads it;
    `ValueError` says what is wrong with a bad one.

    `fs://` + a path (absolute: `fs:///shared/ckpt/v3`); `redis://NS/v3` and `ipc://NS/v3` (braces around NS
    are allowed, the server is the worker's own connection); `nccl://HOST:PORT/v3`.
    """
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in _REGISTRY:
        raise ValueError(f"unknown weights uri {uri!r}: expected one of {', '.join(s + '://' for s in schemes())}")
    return transport_class(scheme).parse(uri, rest)


def uri_version(uri: str, scheme: str, location: str, tail: str) -> int | None:
    """The version a uri's last part names (`v{n}`), None when there is none; `ValueError` for anything else."""
    if not tail:
        return None
    match = VERSION_DIR.fullmatch(tail)
    if not match:
        raise ValueError(f"weights uri {uri!r}: expected {scheme}://{location or '...'}/v<version>, got /{tail}")
    return int(match.group(1))


# -- the registry --------------------------------------------------------------------------------


_REGISTRY: dict[str, type[Transport] | str] = {
    "fs": "staleness.weights.fs:FsTransport",
    "redis": "staleness.weights.redis_store:RedisTransport",
    "nccl": "staleness.weights.nccl:NcclTransport",
    "ipc": "staleness.weights.ipc:IpcTransport",
}
"""Scheme -> its transport: the class, or where it lives (`module:Class`), imported when the scheme is first asked
for, so that a trainer that publishes by `fs://` never imports `torch.distributed`."""


def register_transport(transport: type[Transport] | str, scheme: str | None = None) -> None:
    """Add a transport to the registry under its scheme: a `Transport` subclass (its `scheme`), or where one lives
    (`"package.module:Class"`, imported when first asked for; give its `scheme` then). From then on every uri of that
    scheme goes to it, on the trainer's side and the worker's. A scheme taken by another transport is refused."""
    if isinstance(transport, str):
        if scheme is None or ":" not in transport:
            raise ValueError(f"register a transport by path as ('module:Class', scheme), got {transport!r}, {scheme!r}")
    else:
        own = getattr(transport, "scheme", None)
        if not isinstance(own, str) or scheme not in (None, own):
            raise ValueError(f"{transport.__name__} registers under its `scheme` class attribute, got {own!r}")
        scheme = own
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ValueError(f"a transport's scheme is lower-case letters, digits, '+', '.' or '-', got {scheme!r}")
    held = _REGISTRY.get(scheme)
    if held is not None and held != transport and not (isinstance(held, type) and _path_of(held) == transport):
        raise ValueError(f"{scheme}:// is the transport {_name_of(held)}'s already")
    _REGISTRY[scheme] = transport


def transport_class(scheme: str) -> type[Transport]:
    """The transport registered for `scheme` (`KeyError` if none: `parse_uri` says which there are)."""
    held = _REGISTRY[scheme]
    if isinstance(held, str):
        module, _, name = held.partition(":")
        loaded = getattr(importlib.import_module(module), name)
        if not (isinstance(loaded, type) and issubclass(loaded, Transport)) or loaded.scheme != scheme:
            raise TypeError(f"{held} is not a Transport of scheme {scheme!r}")
        held = _REGISTRY[scheme] = loaded
    return held


def takes_host_tensors(uri: str) -> bool:
    """Whether `uri`'s scheme names a registered transport that publishes from host memory (`Transport.from_host`)."""
    try:
        return transport_class(uri.split("://")[0]).from_host
    except KeyError:
        return False


def transport_of(uri: str | WeightsUri) -> type[Transport]:
    """The transport of a uri (`ValueError` for a bad one): what the trainer, the worker's sync and its adapters ask
    its capabilities (`Transport.stores`, `fetches_ahead`, `pushes`, `carries_adapters`)."""
    return transport_class((uri if isinstance(uri, WeightsUri) else parse_uri(uri)).scheme)


def schemes() -> tuple[str, ...]:
    """The schemes registered, in the order they were."""
    return tuple(_REGISTRY)


def adapter_schemes() -> str:
    """The schemes whose transports carry LoRA adapters, as a message names them: `fs://, redis:// or nccl://`."""
    return _or([f"{s}://" for s in schemes() if transport_class(s).carries_adapters])


def delta_schemes() -> str:
    """The schemes whose transports send deltas, as a message names them: `fs:// or redis://`."""
    return _or([f"{s}://" for s in schemes() if transport_class(s).sends_deltas])


def _or(names: list[str]) -> str:
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _path_of(transport: type) -> str:
    return f"{transport.__module__}:{transport.__qualname__}"


def _name_of(held: type | str) -> str:
    return held if isinstance(held, str) else _path_of(held)


def check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"a weights version is an integer >= 0, got {version!r}")
    return int(version)


# -- the trainer's side --------------------------------------------------------------------------


@dataclass
class PublishStats:
    """What one `publish` moved, and the most of it the transport held in host memory at once."""

    tensors: int = 0
    bytes: int = 0
    """Bytes of the tensors (alignment padding excluded)."""
    peak_buffered_bytes: int = 0
    """The most bytes of the version this transport held at once on the host: what it copied and had not sent yet
    (redis: chunks queued and the one being filled; fs: the tensors of the shard being gathered), never more than
    about one bucket (`bucket_bytes`) plus the tensor being taken. nccl and ipc hold the whole version where its
    tensors are (on their GPU; on the host for CPU tensors over gloo): they count it here."""
    seconds: float = 0.0
    delta_bytes: int | None = None
    """What a worker that holds the version before reads instead of `bytes` (redis, fs with deltas); None: no delta."""

    def hold(self, nbytes: int) -> None:
        self.peak_buffered_bytes = max(self.peak_buffered_bytes, nbytes)


@dataclass(frozen=True)
class Opening:
    """What `staleness.weights.open_transport` hands a transport's `Transport.open`: the pipeline's Redis and namespace,
    and the caller's sizes and adapter (checked already: `bucket_bytes` >= 1, the adapter's name, that the transport
    carries adapters)."""

    redis_client: redis.Redis | None = None
    ns: str | None = None
    chunk_bytes: int | None = None
    """redis: the size of a chunk (None: its default)."""
    join_timeout_s: float = 60.0
    """A pushing transport's wait for the workers to join its push."""
    adapter: str | None = None
    bucket_bytes: int | None = None
    """The most a publish handles at once (None: the transport's default)."""
    held: HeldWeights | None = None
    """The trainer's last published version as one buffer: a transport that sends deltas sends the next from it."""

    def namespace(self, spec: str, parsed: WeightsUri) -> tuple[redis.Redis, str]:
        """The client and namespace of a transport that keeps its versions (or their manifests) in the pipeline's
        Redis: the uri's namespace (`SCHEME://NS`) or the pipeline's (`SCHEME://` with `ns`), which must agree."""
        if self.redis_client is None:
            raise ValueError(f"{spec}: the {parsed.scheme} weight transport needs a Redis client (the pipeline's own)")
        if self.ns is not None and parsed.location and parsed.location != self.ns:
            raise ValueError(f"{spec} names namespace {parsed.location!r}, but the pipeline's is {self.ns!r}")
        name = parsed.location or self.ns
        if not name:
            raise ValueError(f"{spec}: name the namespace ({parsed.scheme}://NS) or pass ns=")
        return self.redis_client, name


@dataclass(frozen=True)
class Receiving:
    """Who receives a version on the worker's side: its Redis (where stored versions or their manifests are), the
    sync's epoch (a pushed version arrives during its sync only), its name (a push's member), how long to wait."""

    redis_client: redis.Redis | None = None
    epoch: int | None = None
    member: str | None = None
    timeout_s: float = 60.0
    held: HeldWeights | None = None
    """The worker's last version as one buffer, for a transport that sends deltas (`staleness.weights.delta`)."""


Fetched: TypeAlias = Path | dict[str, "torch.Tensor"]
"""A stored version as a worker fetches it (`Transport.fetch_stored`): a checkpoint directory (the engine reloads its
files) or named CPU tensors (the engine copies them in)."""


async def load_fetched(engine: LoadsWeights, fetched: Fetched, version: int) -> None:
    """Load what `Transport.fetch_stored` gave: a checkpoint directory by `engine.load_weights`, tensors by
    `engine.load_tensors`."""
    if isinstance(fetched, Path):
        await engine.load_weights(str(fetched), version)
    else:
        await engine.load_tensors(fetched, version)


class Incoming(Protocol):
    """One version on its way into an engine: what `Transport.begin_load` did before the worker paused (a fetch, a
    push joined, or nothing), and the rest of the load, which the worker runs paused."""

    async def load(self, engine: LoadsWeights) -> None: ...


class Joined(Protocol):
    """A pushed version that this process receives itself, one rank, no engine (`Transport.join_here`): a LoRA
    adapter's, or a version pushed while the worker has no engine."""

    async def receive(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Its tensors, as CPU copies, and the adapter config that came with them (None: not an adapter's)."""
        ...


@dataclass(frozen=True)
class _Ready:
    """A version fetched before the pause (`Transport.fetches_ahead`): loading it is all that is left."""

    fetched: Fetched
    version: int

    async def load(self, engine: LoadsWeights) -> None:
        await load_fetched(engine, self.fetched, self.version)


@dataclass(frozen=True)
class _Later:
    """A stored version that is loaded whole once the worker paused (`Transport.load_stored`)."""

    transport: type[Transport]
    uri: WeightsUri
    version: int
    receiving: Receiving

    async def load(self, engine: LoadsWeights) -> None:
        await self.transport.load_stored(engine, self.uri, self.version, self.receiving)


class Transport:
    """A weight transport: how one version's tensors go from the trainer to every worker. One class owns both sides
    (vLLM's `WeightTransferEngine`), lives in one module, and is found by its uri's scheme in the registry
    (`register_transport`). It says what it can do in four capabilities, which the trainer (`SyncDriver`), the
    worker's sync and its adapters ask instead of the scheme.

    The trainer's side is an instance, opened per publish (`open`): `publish` a version and get its uri, `push` it
    during the sync (`pushes`), `versions`, `remove` and `release` what it stores. The worker's side is class methods
    of the uri: `begin_load` (before the pause) and the `Incoming.load` it returns (paused), `fetch_stored` (stored
    versions), `join_here` (pushed versions, into this process), `leave`."""

    scheme: ClassVar[str]
    """Its uris' scheme, as registered: `fs`, `redis`, `nccl`, `ipc`."""
    stores: ClassVar[bool] = True
    """A version stays where a worker can load it at any time after its sync: a worker that starts late, an engine
    started on demand, an adapter loaded on demand. False: it arrives only during its sync (`pushes`), and a worker
    that missed it awaits the next."""
    fetches_ahead: ClassVar[bool] = False
    """The worker fetches a version (`fetch_stored`, off the event loop) before it pauses, and stands still only to
    load it: the transfer is time the trainer waits for, not time the worker generates nothing."""
    pushes: ClassVar[bool] = False
    """The trainer sends a version during its sync (`push`: the manager's transfer step, between the `weights` command
    and the wait for acks); each worker joins before it pauses (`begin_load`) and receives paused."""
    carries_adapters: ClassVar[bool] = True
    """It carries LoRA adapters (`publish(..., adapter_config=...)`)."""
    sends_deltas: ClassVar[bool] = False
    """A publish with `deltas` also stores what changed since the trainer's last version (`staleness.weights.delta`),
    which a worker that holds that one reads instead."""
    from_host: ClassVar[bool] = True
    """It publishes tensors held in the host's memory (what the gateway's weight-transfer routes receive over HTTP);
    False: only tensors on the trainer's GPU (`ipc://`)."""

    last_publish: PublishStats | None = None
    """What the last `publish` moved and held."""

    # -- uris

    @classmethod
    def parse(cls, uri: str, rest: str) -> WeightsUri:
        """The uri `uri` (`rest`: what follows `SCHEME://`), read the way most transports name a version:
        `SCHEME://NS/v{n}` in the pipeline's namespace NS (braces allowed; empty: the pipeline's own), and for a
        transport that carries adapters `SCHEME://NS/adapters/NAME/v{n}`."""
        location, _, tail = rest.partition("/")
        tail = tail.strip("/")
        adapter = None
        if cls.carries_adapters and tail.startswith(ADAPTERS_DIR + "/"):  # SCHEME://NS/adapters/NAME[/v{n}]
            adapter, _, tail = tail.removeprefix(ADAPTERS_DIR + "/").partition("/")
            if not re.match(ADAPTER_PATTERN, adapter):
                raise ValueError(f"weights uri {uri!r}: adapter name {adapter!r} must match {ADAPTER_PATTERN}")
        version = uri_version(uri, cls.scheme, location, tail)
        ns = location.removeprefix("{").removesuffix("}")
        if ns:  # empty: `SCHEME://`, the transport of the pipeline's own namespace
            Keys(ns)  # raises ValueError for a bad namespace
        return WeightsUri(cls.scheme, ns, version, adapter)

    @classmethod
    def format_uri(cls, uri: WeightsUri) -> str:
        """A parsed uri written back (`parse` reads it as it was)."""
        adapter = "" if uri.adapter is None else f"/{ADAPTERS_DIR}/{uri.adapter}"
        suffix = "" if uri.version is None else f"/v{uri.version}"
        return f"{uri.scheme}://{uri.location}{adapter}{suffix}"

    # -- the trainer's side

    @classmethod
    def open(cls, spec: str, parsed: WeightsUri, opening: Opening) -> Transport:
        """The trainer's side of `spec` (parsed: `parsed`), opened for one publish (`staleness.weights.open_transport`
        checks what every transport shares first)."""
        raise NotImplementedError(f"{cls.__name__} opens no trainer's side")

    def publish(
        self,
        tensors: WeightSource,
        version: int,
        *,
        adapter_config: Mapping[str, Any] | None = None,
    ) -> str:
        """Store (or stage, for a transport that pushes) one version completely, then return the uri that names it
        (`FileExistsError` if stored). With `adapter_config`, the tensors are a LoRA adapter's (PEFT names) and the
        config goes with them. An iterable of `(name, tensor)` pairs is consumed once, a bucket at a time (see each
        transport); if it raises, nothing of the version is left stored and the error propagates. An adapter's version
        is refused (`ValueError`) by a transport that carries no adapters. The transport's own part is `put`; this
        times it and keeps what it moved (`last_publish`)."""
        version = check_version(version)
        if adapter_config is not None and not self.carries_adapters:
            raise ValueError(f"LoRA adapters travel by {adapter_schemes()}, not {self.scheme}://")
        started = time.monotonic()
        stats = self.put(tensors, version, adapter_config)
        stats.seconds = time.monotonic() - started
        self.last_publish = stats
        return self.uri_of(version)

    def put(self, tensors: WeightSource, version: int, adapter_config: Mapping[str, Any] | None) -> PublishStats:
        """`publish`'s own part, of a checked `version`: store (or stage) it, counting what passed."""
        raise NotImplementedError(f"{type(self).__name__} publishes nothing")

    def uri_of(self, version: int) -> str:
        """The uri of `version` in this transport."""
        raise NotImplementedError(f"{type(self).__name__} names no versions")

    def push(self, epoch: int, workers: int) -> object:
        """Send the version published last to the `workers` live workers of sync `epoch` (`pushes`); returns what
        it moved (`last_push`)."""
        raise NotImplementedError(f"{self.scheme}:// stores its versions: it has nothing to push")

    @property
    def last_push(self) -> Any:
        """What the last `push` moved, and how fast (nccl: `BroadcastStats`); None for a transport that stores."""
        return None

    def versions(self) -> list[int]:
        """Versions stored completely, in order."""
        return []

    def stored(self) -> set[int]:
        """Every version with anything stored, complete or not: what `release` looks through."""
        return set(self.versions())

    def remove(self, version: int) -> bool:
        """Delete a version (and any half-written leftover of it); False if there was nothing."""
        return False

    def release(self, keep: Iterable[int]) -> list[int]:
        """Delete every version below `max(keep)` that is not in `keep` (`release_older`); returns those deleted. A
        transport that does not store (`stores` False) holds none: nothing to release."""
        return release_older(self, keep) if self.stores else []

    @classmethod
    def remove_published(cls, parsed: WeightsUri, redis_client: redis.Redis | None, ns: str | None) -> bool:
        """Delete the stored version a published uri names (`parsed.version`, not None); False if none was there."""
        assert parsed.version is not None
        opening = Opening(redis_client, ns, adapter=parsed.adapter)
        return cls.open(str(parsed), parsed, opening).remove(parsed.version)

    # -- the worker's side

    @classmethod
    async def begin_load(cls, engine: LoadsWeights, uri: WeightsUri, version: int, receiving: Receiving) -> Incoming:
        """The part of loading `version` that need not stop generation, done before the worker pauses: join the
        push (`pushes`), fetch the version (`fetches_ahead`), or nothing; the returned `Incoming.load` does the
        rest, paused. Raises as `staleness.weights.load_version` does."""
        if cls.pushes:
            return await cls.join(engine, uri, version, receiving)
        if cls.fetches_ahead or cls.ahead_of_pause(uri, receiving):
            fetched = await asyncio.to_thread(cls.fetch_received, uri, version, receiving)
            return _Ready(fetched, version)
        return _Later(cls, uri, version, receiving)

    @classmethod
    def ahead_of_pause(cls, uri: WeightsUri, receiving: Receiving) -> bool:
        """Whether this version is fetched before the pause though the transport does not fetch ahead (`fs://`: one
        published with deltas, which a worker reads into the buffer it holds). False by default."""
        return False

    @classmethod
    def fetch_stored(cls, uri: WeightsUri, version: int, redis_client: redis.Redis | None) -> Fetched:
        """A stored version as the worker loads it: a local checkpoint directory, or named CPU tensors. Blocking."""
        raise ValueError(f"weights {uri}: {cls.scheme} versions are not stored; they arrive only during a sync")

    @classmethod
    def fetch_received(cls, uri: WeightsUri, version: int, receiving: Receiving) -> Fetched:
        """`fetch_stored`, as a worker receives a version in a sync or at a start: what it holds (`receiving.held`)
        may make it shorter (a delta). Blocking."""
        return cls.fetch_stored(uri, version, receiving.redis_client)

    @classmethod
    def fetch_adapter(
        cls, uri: WeightsUri, version: int, redis_client: redis.Redis | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A stored LoRA adapter's tensors and config (`adapter_config.json`'s fields). Blocking."""
        fetched = cls.fetch_stored(uri, version, redis_client)
        if not isinstance(fetched, Path):
            raise ValueError(f"adapter {uri}: no adapter config (r, lora_alpha, target_modules) stored with it")
        from staleness.weights.sources import read_adapter  # torch and safetensors: an adapter's tensors

        return read_adapter(fetched)

    @classmethod
    async def load_stored(cls, engine: LoadsWeights, uri: WeightsUri, version: int, receiving: Receiving) -> None:
        """Load a stored version into `engine` (paused): what `fetch_stored` gives, fetched off the event loop."""
        fetched = await asyncio.to_thread(cls.fetch_received, uri, version, receiving)
        await load_fetched(engine, fetched, version)

    @classmethod
    async def join(cls, engine: LoadsWeights, uri: WeightsUri, version: int, receiving: Receiving) -> Incoming:
        """A transport that pushes: join sync `receiving.epoch`'s push with the engine's receivers, while the engine
        still generates; `Incoming.load` receives and loads it, paused."""
        raise NotImplementedError(f"{cls.__name__} pushes nothing to join")

    @classmethod
    async def join_here(cls, uri: WeightsUri, version: int, receiving: Receiving) -> Joined:
        """A transport that pushes: join sync `receiving.epoch`'s push as one rank of this process (no engine), for
        `Joined.receive` to take CPU copies of the version."""
        raise NotImplementedError(f"{cls.__name__} pushes nothing to join")

    @classmethod
    def leave(cls, uri: str, member: str) -> None:
        """The processes that held `member`'s part of the pushes from `uri` are gone (its engine restarted or
        stopped): report nothing held at the next push. Nothing to do for a transport that stores."""

    # -- a version opened where the weights live (`Handover`), in the processes that hold them

    @classmethod
    def check_placement(cls, engine: LoadsWeights, handover: Handover) -> None:
        """Before anything is opened: `ValueError`, worded by the transport, where `engine.placement` cannot open
        `handover` (and for tensors the model does not take, where the transport did not check them yet)."""

    @classmethod
    def prepare_handover(cls, handover: Handover, rank: int, device: torch.device) -> None:
        """In a process that holds the weights, before the pause (`LoadsWeights.prepare_handover`): get ready to open
        it as receiver `rank` (of `LoadsWeights.weight_receivers`) on `device`. Nothing by default."""

    @classmethod
    def open_handover(
        cls, handover: Handover, rank: int, device: torch.device
    ) -> AbstractContextManager[Iterable[tuple[str, torch.Tensor]]]:
        """In a process that holds the weights: the version's `(name, tensor)` pairs as receiver `rank` on `device`,
        each read once (a collective's are drained by the caller); on leaving, whatever was opened is let go, the
        copies out of it waited for."""
        raise NotImplementedError(f"{cls.__name__} hands nothing over in place")


def prepare_handover(handover: Handover, rank: int, device: str | torch.device) -> None:
    """`Transport.prepare_handover` of the handover's transport: what an engine's receiving process calls."""
    import torch

    transport_class(handover.scheme).prepare_handover(handover, rank, torch.device(device))


def opened_handover(
    handover: Handover, rank: int, device: str | torch.device
) -> AbstractContextManager[Iterable[tuple[str, torch.Tensor]]]:
    """`Transport.open_handover` of the handover's transport: what an engine's receiving process calls."""
    import torch

    return transport_class(handover.scheme).open_handover(handover, rank, torch.device(device))


async def load_handover_here(engine: LoadsWeights, handover: Handover, device: str | torch.device) -> None:
    """`LoadsWeights.load_handover` of an engine whose weights live in this process (torch, synthetic): open the
    handover on `device` (off the event loop), load its tensors with `engine.load_tensors`, let go of it."""
    started = time.monotonic()
    opened = opened_handover(handover, 0, device)
    tensors = await asyncio.to_thread(lambda: dict(opened.__enter__()))  # the CUDA calls off the event loop
    received = time.monotonic()
    try:
        await engine.load_tensors(tensors, handover.version)
    finally:
        tensors.clear()  # nothing of the handover held once it is let go (an ipc buffer's views)
        await asyncio.to_thread(opened.__exit__, None, None, None)
    log.info(
        "version %d from %s: received in %.3f s, loaded in %.3f s",
        handover.version, handover.source or f"{handover.scheme}://", received - started, time.monotonic() - received,
    )  # fmt: skip


def release_older(transport: Stored, keep: Iterable[int]) -> list[int]:
    """Delete every stored version below `max(keep)` that is not in `keep` (`Transport.release`). Versions
    above every kept one are left alone: they may be published but not yet announced."""
    wanted = {check_version(v) for v in keep}
    if not wanted:
        raise ValueError("release needs the versions to keep (at least the current one)")
    doomed = sorted(v for v in transport.stored() if v < max(wanted) and v not in wanted)
    return [v for v in doomed if transport.remove(v)]


class Stored(Protocol):
    """A transport that stores versions (fs, redis, ipc): what `release_older` needs of it."""

    def stored(self) -> set[int]:
        """Every version with anything stored, complete or not."""
        ...

    def remove(self, version: int) -> bool: ...

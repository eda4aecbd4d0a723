"""The worker's side of an `nccl://` broadcast (`staleness.weights.nccl` says the protocol): join a sync's group in
the trainer's rendezvous (`join_broadcast`, which gives the `BroadcastLink` a receiving process needs), find or build
a rank's group and post its receives before the pause (`prepare_receiver`), take the tensors as they land
(`receive_broadcast`), and forget a group after a failed load (`forget_group`). It runs in whatever process holds the
engine's weights (the worker for `torch`, vLLM's worker processes for `vllm`), each of which keeps its group between
syncs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from staleness.weights.base import parse_uri
from staleness.weights.buckets import bucket_parts, bucket_size, dtype_from_name, plan_buckets, tensor_view
from staleness.weights.nccl_group import (
    GROUPS_BUILT,
    LOCK,
    META_V,
    NO_GROUP,
    KeptGroup,
    barrier,
    broadcast_parts,
    build_group,
    close_later,
    default_member,
    grouped,
    open_store,
    tensor_metas,
    warm_up,
)


@dataclass(frozen=True)
class BroadcastLink:
    """What a receiving process needs to take its rank in one sync: plain data, so that it crosses to vLLM's workers."""

    host: str
    port: int
    epoch: int
    version: int
    first_rank: int
    world: int
    timeout_s: float
    meta: str
    """The trainer's JSON meta: version, backend, bucket size, tensors."""
    member: str = ""
    """The worker's name in the group."""
    generation: int = NO_GROUP
    """The group to receive in: kept from an earlier sync when it equals the one the receiver holds."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BroadcastLink:
        return cls(**data)

    def forget(self) -> None:
        """After a failed load: report no group at the next sync (`forget_group`), in the worker process."""
        _forget(self.host, self.port, self.member)


_RECEIVER_GROUPS: dict[tuple[str, int, str, int], KeptGroup] = {}
"""A receiving process's groups, by (host, port, member, rank offset)."""
_HELD: dict[tuple[str, int, str], int] = {}
"""The generation a worker's receivers hold, by (host, port, member): what it reports when it joins."""


def join_broadcast(
    uri: str,
    epoch: int,
    version: int,
    ranks: int = 1,
    timeout_s: float = 60.0,
    check: Callable[[dict[str, tuple[int, ...]], str], None] | None = None,
    member: str | None = None,
) -> BroadcastLink:
    """Take `ranks` ranks in sync `epoch`'s group as `member` (the worker's name) and wait until the trainer fixed it.

    Run in the worker process (blocking); the engine then receives with `receive_broadcast`. `check`
    sees the names and shapes first: if it raises, this worker declines (the others go on without
    waiting for it) and the error propagates. Raises `TimeoutError` when the trainer does not answer
    and `RuntimeError` when this worker joined too late. If the load that follows fails, call
    `forget_group` so that the next sync does not count on this worker's group.
    """
    member = member or default_member()
    parsed = parse_uri(uri)
    if parsed.version is not None and parsed.version != version:
        raise ValueError(f"weights uri {uri!r} names version {parsed.version}, not {version}")
    host, _, port = parsed.location.rpartition(":")
    prefix = f"e{epoch}/"
    try:
        store = open_store(host, int(port), timeout_s, server=False)
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
            check({m.name: m.shape for m in tensor_metas(meta)}, uri)
    except Exception:
        store.add(prefix + "answered", 1)  # declined: the trainer need not wait for us
        raise
    key = (host, int(port), member)
    try:
        joined = {"member": member, "ranks": ranks, "holds": _HELD.get(key, NO_GROUP)}
        index = store.add(prefix + "workers", 1)
        store.set(f"{prefix}w{index}", json.dumps(joined, separators=(",", ":")))
        store.add(prefix + "answered", 1)
        store.wait([prefix + "world"])
        world = json.loads(store.get(prefix + "world"))
    except (dist.DistStoreError, RuntimeError) as exc:
        raise TimeoutError(f"weights {uri}: the trainer at {host}:{port} did not start its broadcast: {exc}") from None
    if member not in world["ranks"]:
        forget_group(uri, member)
        raise RuntimeError(
            f"weights {uri}: joined sync {epoch} after the trainer started its broadcast (world size {world['world']})"
        )
    _HELD[key] = int(world["generation"])
    return BroadcastLink(
        host,
        int(port),
        epoch,
        version,
        int(world["ranks"][member]),
        int(world["world"]),
        timeout_s,
        raw_meta,
        member,
        int(world["generation"]),
    )


def forget_group(uri: str, member: str | None = None) -> None:
    """After a failed load: report no group at the next sync, so that the trainer builds a new one with everyone."""
    host, _, port = parse_uri(uri).location.rpartition(":")
    _forget(host, int(port), member or default_member())


def _forget(host: str, port: int, member: str) -> None:
    """Report no group at the next sync, and free receives posted but never taken (their buffers are a model)."""
    with LOCK:
        _HELD.pop((host, port, member), None)
        for key in [k for k in _POSTED if k[:3] == (host, port, member)]:
            del _POSTED[key]


def receive_broadcast(
    link: BroadcastLink, rank_offset: int = 0, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Take rank `link.first_rank + rank_offset` in the link's group and yield the trainer's tensors as they arrive.

    NCCL receives on `device` (a GPU); gloo on the CPU. Every rank must drain the iterator: the
    broadcasts are collective. The tensors are views of the receive buffers (no copy). Every bucket's
    receive is posted up front: by `prepare_receiver` for this sync if it ran (the bytes may have landed
    already), else here. The group is kept for the next sync.
    """
    meta = json.loads(link.meta)
    metas = tensor_metas(meta)
    target = _target(meta["backend"], device)
    try:
        with LOCK:
            posted = _POSTED.pop(_key(link, rank_offset), None)
        if posted is None or posted.epoch != link.epoch:
            prepare_receiver(link, rank_offset, device)
            with LOCK:
                posted = _POSTED.pop(_key(link, rank_offset))
        posted.ready.wait()
        for works, views in posted.buckets:
            for work in works:
                work.wait()
            yield from views
        for m in metas:
            if m.nbytes == 0:
                yield m.name, torch.empty(m.shape, dtype=dtype_from_name(m.dtype), device=target)
        if target.type == "cuda":
            torch.cuda.synchronize(target)  # every broadcast landed before the tensors are used elsewhere
    except BaseException:
        _drop_receiver_group(link, rank_offset)
        raise


@dataclass
class _Posted:
    """One sync's receives of one rank, posted without waiting: the ready barrier, then per bucket its broadcast
    and the tensors it carries (named views of its buffer, made before the bytes land: off the stall)."""

    epoch: int
    ready: dist.Work
    buckets: list[tuple[list[dist.Work], list[tuple[str, torch.Tensor]]]]


_POSTED: dict[tuple[str, int, str, int], _Posted] = {}
"""Receives posted by `prepare_receiver`, by (host, port, member, rank offset), until `receive_broadcast` takes them."""


def _key(link: BroadcastLink, rank_offset: int) -> tuple[str, int, str, int]:
    return (link.host, link.port, link.member, rank_offset)


def prepare_receiver(
    link: BroadcastLink, rank_offset: int = 0, device: str | torch.device = "cpu"
) -> dist.ProcessGroup:
    """Find or build rank `link.first_rank + rank_offset`'s group of the link (collective: every rank, the trainer
    included, builds it at once) and post its receives, without waiting for them.

    A worker runs this before it pauses its engine (`join_version` has the engine do it), so that neither
    the wait for the other workers to join, nor a new communicator's setup, nor the bytes on the wire are time it
    stands still (the receives run beside generation, on the communicator's stream); `receive_broadcast`
    then finds them posted and waits only for what has not landed yet. The buffers take the model's size on
    `device` until the receiver has loaded the tensors, as they would when received after the pause."""
    meta = json.loads(link.meta)
    backend = meta["backend"]
    target = _target(backend, device)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    kept = _receiver_group(link, rank_offset, backend, target)
    group = kept.group
    assert group is not None  # a receiver's group is built with it
    try:
        metas = tensor_metas(meta)
        as_parts, copy_from = grouped(backend), int(meta["copy_from"])
        ready = barrier(group, target)
        buckets = []
        for bucket in plan_buckets(metas, int(meta["bucket_bytes"])):
            buffer = torch.empty(bucket_size(metas, bucket), dtype=torch.uint8, device=target)
            views = [(metas[i].name, tensor_view(buffer, metas[i], offset)) for i, offset in bucket]
            parts = bucket_parts(metas, bucket, as_parts, copy_from)
            buckets.append((broadcast_parts(group, [buffer[p.start : p.end] for p in parts]), views))
    except BaseException:
        _drop_receiver_group(link, rank_offset)
        raise
    with LOCK:
        _POSTED[_key(link, rank_offset)] = _Posted(link.epoch, ready, buckets)
    assert kept.store is not None  # a receiver's group is built with its store
    kept.store.add(f"e{link.epoch}/posted", 1)
    return group


def _target(backend: str, device: str | torch.device) -> torch.device:
    """Where a rank receives: its GPU over NCCL, the CPU over gloo."""
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


def _receiver_group(link: BroadcastLink, rank_offset: int, backend: str, target: torch.device) -> KeptGroup:
    """This rank's group of `link.generation`: the one kept from an earlier sync, or a new one (warmed up)."""
    key = _key(link, rank_offset)
    rank = link.first_rank + rank_offset
    with LOCK:
        kept = _RECEIVER_GROUPS.get(key)
        if kept is not None and kept.group is not None and (kept.generation, kept.rank) == (link.generation, rank):
            return kept
        if kept is not None:
            close_later(kept.group)
            del _RECEIVER_GROUPS[key]
    store = open_store(link.host, link.port, link.timeout_s, server=False)
    group = build_group(store, link.generation, rank, link.world, backend, link.timeout_s)
    warm_up(group, target)
    with LOCK:
        GROUPS_BUILT["receiver"] += 1
        built = _RECEIVER_GROUPS[key] = KeptGroup(
            link.generation, link.world, group, rank=rank, backend=backend, device=str(target), store=store
        )
    return built


def _drop_receiver_group(link: BroadcastLink, rank_offset: int) -> None:
    with LOCK:
        _POSTED.pop(_key(link, rank_offset), None)
        kept = _RECEIVER_GROUPS.pop(_key(link, rank_offset), None)
    if kept is not None:
        close_later(kept.group)


def drop_link(uri: str, member: str) -> None:
    """Free every group and posted receive that `member` keeps for the rendezvous of `uri`, and forget it: a one-off
    broadcast (a peer's share, `consumers.peer`) is not kept for a next sync."""
    host, _, port = parse_uri(uri).location.rpartition(":")
    prefix = (host, int(port), member)
    with LOCK:
        _HELD.pop(prefix, None)
        for key in [k for k in _POSTED if k[:3] == prefix]:
            del _POSTED[key]
        dropped = [_RECEIVER_GROUPS.pop(k) for k in [k for k in _RECEIVER_GROUPS if k[:3] == prefix]]
    for kept in dropped:
        close_later(kept.group)


def drop_receivers() -> None:
    """Free every group this process's receivers keep, and the receives they posted: the next sync builds afresh."""
    with LOCK:
        for kept in _RECEIVER_GROUPS.values():
            close_later(kept.group)
        _RECEIVER_GROUPS.clear()
        _POSTED.clear()
        _HELD.clear()

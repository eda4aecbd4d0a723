"""The collective group of an `nccl://` broadcast, as both sides build it (`staleness.weights.nccl`, the trainer's
publish and send; `staleness.weights.nccl_receive`, a worker's ranks): the meta's version, the rendezvous store, a
group kept across syncs and its building, warm-up and ready barrier, a bucket's parts broadcast as one NCCL group, and
the tensors a meta names. Raw bytes and JSON only cross it (no pickle)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from staleness.weights.buckets import TensorMeta

META_V = 4
"""2 -> 3: receivers post a ready barrier (a one-element all-reduce) before the buckets. 3 -> 4: over NCCL a bucket
goes as its parts (`bucket_parts`) in one NCCL group, the meta names `copy_from`."""
NO_GROUP = -1
"""The generation a worker that holds no group reports."""
LOCK = threading.Lock()
"""Guards the groups a process keeps (the trainer's and its receivers') and the receives it posted."""
GROUPS_BUILT = {"trainer": 0, "receiver": 0}
"""Process groups built in this process, per side: a kept group builds none."""


@dataclass
class KeptGroup:
    """A process group kept across syncs, and who is in it (the trainer's members; a receiver's own rank)."""

    generation: int
    world: int
    group: dist.ProcessGroup | None = None
    """None until built (the trainer agrees a membership first, then builds it)."""
    members: dict[str, tuple[int, int]] = field(default_factory=dict)
    """The trainer's view: worker name -> (first rank, ranks)."""
    rank: int = 0
    backend: str = "gloo"
    device: str = "cpu"
    store: dist.Store | None = None
    """A receiver's client of the trainer's rendezvous store, kept with its group (it counts itself `posted` there)."""


def open_store(host: str, port: int, timeout_s: float, server: bool) -> dist.TCPStore:
    """The rendezvous store at HOST:PORT: its server (the trainer) or a client of it (a worker's rank)."""
    return dist.TCPStore(host, port, None, server, timedelta(seconds=timeout_s), wait_for_workers=False, use_libuv=True)


def build_group(
    store: dist.Store, generation: int, rank: int, world: int, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """Rank `rank` of generation `generation`'s group over `PrefixStore(g{generation}/pg)`: NCCL or gloo."""
    prefixed = dist.PrefixStore(f"g{generation}/pg/", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return cast(dist.ProcessGroup, dist.ProcessGroupNCCL(prefixed, rank, world, options))  # stubs: a Backend
    return cast(dist.ProcessGroup, dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=timeout_s)))


def close_later(group: dist.ProcessGroup | None) -> None:
    """Free the group on a thread of its own: NCCL takes ~0.5 s to destroy a communicator, and
    nobody need wait for it (the workers resume, the trainer goes back to training)."""
    shutdown = getattr(group, "shutdown", None)  # NCCL: free the communicator now, not at exit
    if callable(shutdown):
        threading.Thread(target=shutdown, name="broadcast-teardown", daemon=True).start()


def _broadcast_async(group: dist.ProcessGroup, buffer: torch.Tensor) -> dist.Work:
    """Start a broadcast from rank 0; `wait()` on the result blocks (gloo) or orders the current CUDA stream (NCCL)."""
    return group.broadcast([buffer], dist.BroadcastOptions())


def grouped(backend: str) -> bool:
    """Whether a bucket goes as its parts in one group (NCCL), or whole (gloo, which has no groups)."""
    return backend == "nccl"


def broadcast_parts(group: dist.ProcessGroup, buffers: list[torch.Tensor]) -> list[dist.Work]:
    """Broadcast a bucket's parts from rank 0, as one NCCL group (one launch, one work) where the backend has groups:
    closer to one bare broadcast of the same bytes than packing them, or a broadcast a tensor
    (`benchmarks/device/probe_strategies.py` compares the three)."""
    if len(buffers) == 1 or not getattr(group, "supports_coalescing", False):
        return [_broadcast_async(group, b) for b in buffers]
    group._start_coalescing()  # type: ignore[call-arg]  # the stub wants a device; the backend's own is used
    for buffer in buffers:
        _broadcast_async(group, buffer)
    return [group._end_coalescing()]  # type: ignore[call-arg]  # as _start_coalescing


def warm_up(group: dist.ProcessGroup, device: torch.device) -> None:
    """One byte from rank 0, so that setup (NCCL's communicator is built lazily) is done before any real bucket."""
    _broadcast_async(group, torch.zeros(1, dtype=torch.uint8, device=device)).wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(group: dist.ProcessGroup, device: torch.device) -> dist.Work:
    """The ready barrier: a one-element all-reduce completes only once every rank posted it (a broadcast's
    root may finish a small send before the receivers are there)."""
    return group.allreduce([torch.zeros(1, dtype=torch.int32, device=device)])


def default_member() -> str:
    """This process's name in a group when the worker gives none (its default worker name)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def tensor_metas(meta: Mapping[str, Any]) -> list[TensorMeta]:
    """The tensors a broadcast's meta names, in its order; `ValueError` for a malformed one."""
    try:
        return [
            TensorMeta(str(name), str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in meta["tensors"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the broadcast's meta is malformed: {exc}") from None

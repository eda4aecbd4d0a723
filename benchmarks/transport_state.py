"""What the weight transports keep in a process, read and dropped from outside: the GPU bytes the trainer holds for
`ipc://` workers to open, and the process groups `nccl://` builds and keeps. The tests and the probes use it; the
product never asks."""

from __future__ import annotations

from staleness.weights import ipc, nccl, nccl_group, nccl_receive


def held_bytes() -> int:
    """GPU bytes this process holds for workers to open (every namespace): what `ipc://` costs the trainer."""
    return sum(export.buffer.numel() for export in ipc._HELD.values())


def groups_built() -> dict[str, int]:
    """How many process groups this process built so far, per side (a kept group builds none)."""
    return dict(nccl_group.GROUPS_BUILT)


def drop_groups() -> None:
    """Free every group this process keeps (the trainer's and the receivers'): the next sync builds afresh."""
    with nccl_group.LOCK:
        for kept in nccl._TRAINER_GROUPS.values():
            nccl_group.close_later(kept.group)
        nccl._TRAINER_GROUPS.clear()
    nccl_receive.drop_receivers()

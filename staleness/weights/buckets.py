"""How a version's tensors are laid out as raw bytes: `TensorMeta` (name, dtype, shape), buckets of aligned tensors
(`plan_buckets`), the parts a bucket goes on the wire as (`bucket_parts`), packing them (`pack_bucket`), and views of
them on the other side (`tensor_view`). Pure layout, shared by `nccl` (buckets on the wire) and `ipc` (one bucket in
a GPU buffer)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ALIGN = 16
"""Every tensor starts at a multiple of this in its bucket, so that a byte slice views as any dtype."""
COPY_FROM = 8 << 20
"""A tensor of at least this many bytes travels on its own (over NCCL, from its own memory; packed by its own copy
where a bucket goes whole); smaller ones are packed by a `torch.cat` a run, since launching a copy costs the host
about what the wire takes for a tensor of a few MB."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a name in a meta or manifest (`float32`, `bfloat16`); `ValueError` for one torch lacks."""
    import torch  # here: `ALIGN` and the plans are read where torch is not (a synthetic worker's `delta`)

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in the broadcast's meta")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as metas and manifests carry it (`torch.float32` -> `float32`)."""
    return str(dtype).removeprefix("torch.")


def plan_buckets(tensors: list[TensorMeta], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """Split tensors (in order) into buckets: per bucket, `(tensor index, byte offset)`; a big tensor gets its own."""
    buckets: list[list[tuple[int, int]]] = []
    used = bucket_bytes  # forces a new bucket for the first tensor
    for index, meta in enumerate(tensors):
        if meta.nbytes == 0:
            continue
        offset = -(-used // ALIGN) * ALIGN
        if offset + meta.nbytes > bucket_bytes:
            buckets.append([])
            offset = 0
        buckets[-1].append((index, offset))
        used = offset + meta.nbytes
    return buckets


@dataclass(frozen=True)
class Part:
    """A byte range `[start, end)` of a bucket that goes as one broadcast, and the tensors it carries (`(index, byte
    offset)`). `alone`: one tensor sent from its own memory (never packed): one of `copy_from` bytes or more, or
    the only one in its bucket."""

    start: int
    end: int
    members: tuple[tuple[int, int], ...]
    alone: bool


def bucket_parts(
    tensors: list[TensorMeta], bucket: list[tuple[int, int]], grouped: bool, copy_from: int = COPY_FROM
) -> list[Part]:
    """How a bucket goes on the wire, the same on both sides. `grouped` (NCCL, whose group runs all of a bucket's
    broadcasts as one launch): each tensor of `copy_from` bytes or more on its own, from its own memory, and each
    run of smaller ones packed with the zeros that align them (a run of one goes alone: a copy would not save a
    call); nothing big is copied. Otherwise (gloo: a call each) the whole bucket as one part. A bucket of one tensor
    (one bigger than a bucket has its own) is that tensor."""
    if len(bucket) == 1:
        return [_alone(tensors, bucket[0])]
    if not grouped:
        return [Part(0, bucket_size(tensors, bucket), tuple(bucket), False)]
    parts: list[Part] = []
    run: list[tuple[int, int]] = []
    run_start = end = 0

    def close_run() -> None:
        parts.append(_alone(tensors, run[0]) if len(run) == 1 else Part(run_start, end, tuple(run), False))
        run.clear()

    for index, offset in bucket:
        nbytes = tensors[index].nbytes
        if nbytes >= copy_from:
            if run:
                close_run()
            parts.append(_alone(tensors, (index, offset)))
        else:
            if not run:
                run_start = end
            run.append((index, offset))
        end = offset + nbytes
    if run:
        close_run()
    return parts


def _alone(tensors: list[TensorMeta], member: tuple[int, int]) -> Part:
    index, offset = member
    return Part(offset, offset + tensors[index].nbytes, (member,), True)


def pack_bucket(
    bucket: list[tuple[int, int]] | tuple[tuple[int, int], ...],
    tensors: list[torch.Tensor],
    payload: torch.Tensor,
    padding: torch.Tensor,
    copy_from: int = COPY_FROM,
    start: int = 0,
) -> None:
    """Write the bytes of `bucket`'s tensors (`(index, offset)`; a bucket's or a part's, from byte `start`) into
    `payload` at their offsets: a tensor of `copy_from` bytes or more by its own copy (at memcpy speed), each run
    of smaller ones, with the zeros that align them, by one `torch.cat` (a copy a tensor costs the host more than
    the wire takes for a small one)."""
    import torch

    run: list[torch.Tensor] = []
    run_start = end = start
    for index, offset in bucket:
        raw = raw_bytes(tensors[index])
        if raw.numel() >= copy_from:
            if run:
                torch.cat(run, out=payload[run_start:end])
                run = []
            payload[offset : offset + raw.numel()].copy_(raw)
        else:
            if not run:
                run_start = end
            if offset > end:
                run.append(padding[: offset - end])
            run.append(raw)
        end = offset + raw.numel()
    if run:
        torch.cat(run, out=payload[run_start:end])


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, as a flat uint8 view."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def tensor_view(buffer: torch.Tensor, meta: TensorMeta, offset: int) -> torch.Tensor:
    """The tensor `meta` at `offset` in a bucket's bytes."""
    return buffer[offset : offset + meta.nbytes].view(dtype_from_name(meta.dtype)).view(meta.shape)


def bucket_size(tensors: list[TensorMeta], bucket: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> int:
    """The bytes a bucket takes: up to the end of its last tensor."""
    index, offset = bucket[-1]
    return offset + tensors[index].nbytes


def tensor_entries(entries: Any, size: int, key: str) -> list[tuple[TensorMeta, int]]:
    """A manifest's `[name, dtype, shape, offset]`s of one buffer of `size` bytes (redis's, an fs version's deltas'),
    checked: known dtypes, each inside the buffer; `ValueError` naming `key` (where the manifest is) for a bad one."""
    if not isinstance(entries, list):
        raise ValueError(f"weights manifest {key}: 'tensors' must be a list of [name, dtype, shape, offset]")
    out = []
    for entry in entries:
        try:
            name, dtype, shape, offset = entry
            meta = TensorMeta(str(name), str(dtype), tuple(int(d) for d in shape))
            dtype_from_name(meta.dtype)
            offset = int(offset)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"weights manifest {key}: bad tensor entry {entry!r}: {exc}") from None
        if offset < 0 or offset + meta.nbytes > size:
            raise ValueError(f"weights manifest {key}: tensor {meta.name!r} lies outside the {size} bytes listed")
        out.append((meta, offset))
    return out

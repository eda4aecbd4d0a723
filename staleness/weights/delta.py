"""Delta syncs: a version sent as what changed since a version the worker already holds, bit-exact.

A version's tensors, laid out as the stored transports lay them out (the raw bytes of each tensor one after another,
each at a multiple of 16: `buckets.ALIGN`), form one buffer; two versions of one model have buffers of the same
layout. The delta from `base` to `version` is that buffer's XOR with the base's, taken as 16-bit words (a bf16 or
fp16 element; an fp32 element is two words), cut into chunks of `CHUNK_WORDS`, each sent in whichever of two
encodings is smaller for it:

- `sparse`: the positions of the words that changed (the gaps between them as `uint32`, compressed) and their new
  values: small where few change;
- `xor`: the chunk's XOR, compressed (zlib): runs of zeros, and high bits that seldom change. After a small AdamW step
  of a bf16 policy, ~4 % of the words change and this is ~6 % of the version (`benchmarks/probes/delta_sync.py`).

The chunks are encoded and applied on threads (numpy and zlib let go of the GIL). Applying a delta to the base's
buffer gives the version's, checked against the version's SHA-256: a delta applied to another base, or corrupted, is
refused rather than loaded. `encode` says `None` where the delta would cost more than `full_ratio` of the version:
send it whole then. No pickle: a delta is a JSON header and byte strings.

The chain is cut every `full_every` versions (`HeldWeights.full_every`, `DEFAULT_FULL_EVERY`): that version goes whole
only, so a worker applies at most `full_every - 1` deltas in a row. A worker applies a delta only to the version it
was made from (its base, named by its SHA-256): one that missed a sync, or started late, loads the version whole,
which the trainer always writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from staleness.weights.buckets import ALIGN

Encoding = Literal["sparse", "xor"]
WORD = np.dtype("<u2")
"""The unit compared: 16 bits, a bf16 or fp16 element (an fp32 element counts as two)."""
GAP = np.dtype("<u4")
CHUNK_WORDS = 1 << 22
"""Words a chunk holds (8 MiB): what one thread encodes or applies at a time."""
LEVEL = 1
"""zlib's level: the fastest; the payloads are mostly zeros or small gaps, which it compresses well at any level."""
DEFAULT_FULL_RATIO = 0.5
"""A delta larger than this share of the full buffer is not worth it: send the whole version."""
DEFAULT_FULL_EVERY = 8
"""Every this many versions one goes whole only (no delta): the chain of deltas a worker applies in a row is cut."""


@dataclass
class HeldWeights:
    """The last version's buffer one side holds, the base of the next delta: the trainer's last published (it sends
    the delta from it), a worker's last fetched (it applies the delta to it). Empty until a first full version."""

    version: int | None = None
    buffer: np.ndarray | None = None
    sha256: str = ""
    chain: int = 0
    """Deltas in a row that led to the held version since one that went whole only (0: it went whole only)."""
    full_every: int = DEFAULT_FULL_EVERY
    """The trainer's setting: every `full_every`-th version goes whole only (the chain is cut); 1: no deltas."""

    def __post_init__(self) -> None:
        check_full_every(self.full_every)

    def hold(self, version: int, buffer: np.ndarray, sha256: str, chain: int = 0) -> None:
        self.version, self.buffer, self.sha256, self.chain = version, buffer, sha256, chain

    def base_for(self, sha256: str, size: int) -> np.ndarray | None:
        """The held buffer if it is the one with `sha256` and `size` bytes (a delta's base); else None."""
        if self.buffer is None or self.sha256 != sha256 or self.buffer.nbytes != size:
            return None
        return self.buffer

    def delta_to(self, whole: np.ndarray, version: int) -> Delta | None:
        """The trainer's: the delta from the held version to `whole` (version `version`'s buffer); None where the
        version goes whole only: no base held, another layout, the chain cut here (`full_every`), or not worth it."""
        if self.buffer is None or self.version is None or self.buffer.nbytes != whole.nbytes:
            return None
        if self.chain + 1 >= self.full_every:
            return None
        return encode(self.buffer, whole, self.version, version)

    def entry(self, delta: Delta) -> dict[str, Any]:
        """What a version's manifest says of its delta from the held version (before `published` moves on)."""
        return {"base": self.version, "base_sha256": self.sha256, "bytes": delta.nbytes, "changed": delta.changed,
                "chain": self.chain + 1, "full_every": self.full_every}  # fmt: skip

    def published(self, version: int, whole: np.ndarray, sha256: str, delta: Delta | None) -> None:
        """The trainer published `version` (`whole`), with `delta` from the held one or whole only: hold it."""
        self.hold(version, whole, sha256, self.chain + 1 if delta is not None else 0)

    def received(self, version: int, whole: np.ndarray, sha256: str, manifest: dict[str, Any]) -> None:
        """A worker has `version` (`whole`, checked against `sha256`), whose manifest says where it is in its chain."""
        info = manifest.get("delta")
        self.hold(version, whole, sha256, int(info.get("chain", 1)) if isinstance(info, dict) else 0)


class Whole:
    """A version gathered into one buffer as it passes, laid out as the stored transports lay it out: each tensor's
    raw bytes at the next multiple of `ALIGN` (zeros between). What the trainer holds to send the next delta from."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def add(self, data: np.ndarray) -> int:
        """Append a tensor's raw bytes; returns the offset they start at."""
        self.buffer.extend(bytes(-len(self.buffer) % ALIGN))
        offset = len(self.buffer)
        self.buffer.extend(data.data.cast("B"))
        return offset

    def array(self) -> np.ndarray:
        return np.frombuffer(self.buffer, dtype=np.uint8)


def check_full_every(full_every: int) -> int:
    """`full_every`, an integer >= 1 (`ValueError` otherwise)."""
    if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
        raise ValueError(f"full_every must be an integer >= 1, got {full_every!r}")
    return full_every


class DeltaError(ValueError):
    """A delta that does not apply: another base, another layout, or bytes that do not check."""


@dataclass(frozen=True)
class Chunk:
    """One chunk's encoding and its payload's parts (`sparse`: gaps, values; `xor`: the XOR)."""

    encoding: Encoding
    changed: int
    parts: tuple[bytes, ...]


@dataclass(frozen=True)
class Delta:
    """What changed from version `base` to `version`; `sha256` and `size` are the new buffer's."""

    base: int
    version: int
    size: int
    sha256: str
    chunks: tuple[Chunk, ...]
    chunk_words: int = CHUNK_WORDS

    @property
    def changed(self) -> int:
        """Words that changed."""
        return sum(chunk.changed for chunk in self.chunks)

    @property
    def nbytes(self) -> int:
        """What the delta costs to send: its payload (the header is small beside it)."""
        return sum(len(part) for chunk in self.chunks for part in chunk.parts)

    @property
    def encodings(self) -> dict[str, int]:
        """Chunks by encoding."""
        return {e: sum(c.encoding == e for c in self.chunks) for e in ("sparse", "xor")}

    def header(self) -> bytes:
        """The delta but its payload, as JSON (what a store writes beside `payload()`)."""
        chunks = [[c.encoding, c.changed, [len(p) for p in c.parts]] for c in self.chunks]
        fields = {"base": self.base, "version": self.version, "size": self.size, "sha256": self.sha256,
                  "chunk_words": self.chunk_words, "chunks": chunks}  # fmt: skip
        return json.dumps(fields).encode()

    def payload(self) -> bytes:
        return b"".join(part for chunk in self.chunks for part in chunk.parts)

    @classmethod
    def read(cls, header: bytes, payload: bytes | memoryview) -> Delta:
        """A delta from its `header()` and `payload()`."""
        try:
            fields = json.loads(header)
            chunk_words = int(fields["chunk_words"])
            if chunk_words <= 0:
                raise DeltaError(f"chunks of {chunk_words} words")
            view, at, chunks = memoryview(payload), 0, []
            for encoding, changed, sizes in fields["chunks"]:
                if encoding not in ("sparse", "xor"):
                    raise DeltaError(f"unknown encoding {encoding!r}")
                parts = []
                for size in sizes:
                    parts.append(bytes(view[at : at + int(size)]))
                    at += int(size)
                chunks.append(Chunk(encoding, int(changed), tuple(parts)))
            if at != len(view):
                raise DeltaError(f"the payload is {len(view)} bytes; the header says {at}")
            return cls(int(fields["base"]), int(fields["version"]), int(fields["size"]), str(fields["sha256"]),
                       tuple(chunks), chunk_words)  # fmt: skip
        except DeltaError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise DeltaError(f"not a delta header: {exc!r}") from None


def words(buffer: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A buffer as 16-bit words (a view: no copy)."""
    array = buffer.view(np.uint8) if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, dtype=np.uint8)
    if array.size % WORD.itemsize:
        raise DeltaError(f"a buffer of {array.size} bytes is not whole 16-bit words")
    return array.reshape(-1).view(WORD)


def _bounds(n: int, chunk_words: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk_words, n)) for a in range(0, n, chunk_words)]


def _encode_chunk(old: np.ndarray, new: np.ndarray) -> Chunk:
    xor = np.bitwise_xor(old, new)
    positions = np.flatnonzero(xor)
    if not positions.size:
        return Chunk("sparse", 0, (b"", b""))
    candidates = [Chunk("xor", int(positions.size), (zlib.compress(xor.tobytes(), LEVEL),))]
    if positions.size * 16 < new.size:  # few changed: their values and gaps may be smaller than the whole XOR
        gaps = np.diff(positions, prepend=0).astype(GAP)
        sparse = (zlib.compress(gaps.tobytes(), LEVEL), new[positions].tobytes())
        candidates.append(Chunk("sparse", int(positions.size), sparse))
    return min(candidates, key=lambda c: sum(len(p) for p in c.parts))


def _apply_chunk(out: np.ndarray, chunk: Chunk) -> None:
    if chunk.encoding == "sparse":
        if not chunk.changed:
            return
        positions = np.cumsum(np.frombuffer(zlib.decompress(chunk.parts[0]), dtype=GAP), dtype=np.int64)
        values = np.frombuffer(chunk.parts[1], dtype=WORD)
        if positions.size != values.size or positions.size != chunk.changed or positions[-1] >= out.size:
            raise DeltaError(f"a sparse chunk of {chunk.changed} words does not fit its buffer")
        out[positions] = values
    else:
        xor = np.frombuffer(zlib.decompress(chunk.parts[0]), dtype=WORD)
        if xor.size != out.size:
            raise DeltaError(f"an XOR of {xor.size} words for a chunk of {out.size}")
        np.bitwise_xor(out, xor, out=out)


def _threads(threads: int | None) -> int:
    return threads or min(16, os.cpu_count() or 1)


def encode(
    base: bytes | np.ndarray, new: bytes | np.ndarray, base_version: int, version: int,
    full_ratio: float = DEFAULT_FULL_RATIO, threads: int | None = None, chunk_words: int = CHUNK_WORDS,
) -> Delta | None:  # fmt: skip
    """The delta from `base` (version `base_version`'s buffer) to `new`; None where it would cost more than
    `full_ratio` of `new` (send it whole)."""
    old_words, new_words = words(base), words(new)
    if old_words.size != new_words.size:
        raise DeltaError(f"the buffers differ ({old_words.nbytes} and {new_words.nbytes} bytes): another layout")
    bounds = _bounds(new_words.size, chunk_words)
    with ThreadPoolExecutor(_threads(threads)) as pool:
        chunks = tuple(pool.map(lambda b: _encode_chunk(old_words[b[0] : b[1]], new_words[b[0] : b[1]]), bounds))
        sha256 = hashlib.sha256(new_words.view(np.uint8).data).hexdigest()  # it lets go of the GIL too
    delta = Delta(base_version, version, new_words.nbytes, sha256, chunks, chunk_words)
    return delta if delta.nbytes <= full_ratio * new_words.nbytes else None


def apply(base: bytes | np.ndarray, delta: Delta, threads: int | None = None) -> np.ndarray:
    """Version `delta.version`'s buffer (a new array of bytes) from its base's, checked against its SHA-256."""
    old_words = words(base)
    if old_words.nbytes != delta.size:
        raise DeltaError(f"the base is {old_words.nbytes} bytes; the delta is for {delta.size}: another layout")
    bounds = _bounds(old_words.size, delta.chunk_words)
    if len(bounds) != len(delta.chunks):
        raise DeltaError(f"{len(delta.chunks)} chunks for a buffer of {len(bounds)}")
    out = old_words.copy()
    try:
        with ThreadPoolExecutor(_threads(threads)) as pool:
            pairs = zip(bounds, delta.chunks, strict=True)
            list(pool.map(lambda bc: _apply_chunk(out[bc[0][0] : bc[0][1]], bc[1]), pairs))
    except zlib.error as exc:
        raise DeltaError(f"the payload does not decompress: {exc}") from None
    got = out.view(np.uint8)
    if hashlib.sha256(got.data).hexdigest() != delta.sha256:
        raise DeltaError(f"the delta to version {delta.version} does not check on the buffer held: not version "
                         f"{delta.base}'s")  # fmt: skip
    return got


def chain(base: bytes | np.ndarray, deltas: Sequence[Delta], threads: int | None = None) -> np.ndarray:
    """`base` with `deltas` applied in turn, each on the one before (a worker several versions behind)."""
    buffer = words(base).view(np.uint8)
    for before, delta in zip([None, *deltas], deltas, strict=False):
        if before is not None and delta.base != before.version:
            raise DeltaError(f"a chain breaks: version {before.version}, then a delta from {delta.base}")
        buffer = apply(buffer, delta, threads)
    return buffer

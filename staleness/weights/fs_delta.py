"""`fs://` deltas: an `fs://DIR/v{n}` version's delta from the version before, in its own directory beside its shards
(`Gathering`, the trainer's side), and a worker's read of it (`receive`).

With `deltas`, the trainer writes every version whole (its safetensors shards: what a worker that holds nothing, or
another version, loads), and beside them, in the same directory (so the one `rename` that publishes the version
publishes them too, and removing it removes them):

- `rollouts-deltas.json`: the version laid out as one buffer as `redis://` lays it out (each tensor's raw bytes at a
  multiple of 16: `[name, dtype, shape, offset]`, the total `bytes`, their `sha256`), and, where a delta is sent, its
  entry: its base (version and SHA-256), its place in the chain (`chain`, `full_every`) and its header
  (`staleness.weights.delta.Delta.header`);
- `rollouts-delta.payload`: the delta's payload, the same bytes `redis://` stores in its chunks.

No pickle: JSON and raw bytes. A worker that holds the delta's base reads only the payload, applies it, checks the
result against the version's SHA-256 and loads the tensors (`engine.load_tensors`); any other reads the shards into
its held buffer (checked the same way, the base of the next delta) and loads the directory as without deltas
(`engine.load_weights`). Either is done before the worker pauses (`FsTransport.ahead_of_pause`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from staleness.weights.base import Fetched, PublishStats
from staleness.weights.buckets import ALIGN, dtype_name, raw_bytes, tensor_entries, tensor_view
from staleness.weights.delta import Delta, DeltaError, HeldWeights, Whole, apply

log = logging.getLogger(__name__)

MANIFEST = "rollouts-deltas.json"
"""A version's layout as one buffer, its sha256, and its delta's entry (where one is sent)."""
PAYLOAD = "rollouts-delta.payload"
"""The delta's payload (`Delta.payload`)."""


class Gathering:
    """The trainer's side of one publish with deltas: the version gathered into one buffer as its tensors pass to the
    shards (`passing`), then its manifest and delta written into the version's directory (`write`), then, once the
    version is published, held as the base of the next (`published`)."""

    def __init__(self, held: HeldWeights, version: int) -> None:
        self.held, self.version = held, version
        self.whole = Whole()
        self.entries: list[list[Any]] = []
        self.delta: Delta | None = None
        self.sha256 = ""

    def passing(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream as it was, each tensor's bytes copied into the buffer as it passes."""
        for name, tensor in stream:
            offset = self.whole.add(raw_bytes(tensor).numpy())
            self.entries.append([name, dtype_name(tensor.dtype), list(tensor.shape), offset])
            yield name, tensor

    def write(self, directory: Path, stats: PublishStats) -> list[Path]:
        """Write the manifest and, where one is sent (`HeldWeights.delta_to`), the delta's payload into `directory`
        (the version's, not yet renamed); returns the files written."""
        buffer = self.whole.array()
        self.delta = self.held.delta_to(buffer, self.version)
        self.sha256 = self.delta.sha256 if self.delta is not None else hashlib.sha256(buffer.data).hexdigest()
        manifest: dict[str, Any] = {"version": self.version, "bytes": buffer.nbytes, "sha256": self.sha256,
                                    "align": ALIGN, "tensors": self.entries}  # fmt: skip
        files = [directory / MANIFEST]
        if self.delta is not None:
            files.append(directory / PAYLOAD)
            files[-1].write_bytes(self.delta.payload())
            manifest["delta"] = self.held.entry(self.delta) | {"header": json.loads(self.delta.header())}
            stats.delta_bytes = self.delta.nbytes
        files[0].write_text(json.dumps(manifest, separators=(",", ":")))
        return files

    def published(self) -> None:
        self.held.published(self.version, self.whole.array(), self.sha256, self.delta)


def has_deltas(directory: Path) -> bool:
    """Whether the version in `directory` was published with deltas (a worker then holds what it reads of it)."""
    return (directory / MANIFEST).is_file()


def receive(directory: Path, version: int, held: HeldWeights) -> Fetched:
    """Version `version` in `directory`, as a worker that holds `held` loads it: its delta applied to the held
    buffer (the tensors), where that is its base; else the directory, its shards read into `held` first. `held`
    holds this version after either. A directory without deltas is returned as it is, `held` untouched. `ValueError`
    for a manifest or shards that do not check."""
    path = directory / MANIFEST
    if not path.is_file():
        return directory
    manifest = _manifest(path, version)
    size, sha256 = manifest["bytes"], manifest["sha256"]
    entries = tensor_entries(manifest.get("tensors"), size, str(path))
    info = manifest.get("delta")
    base = held.base_for(str(info.get("base_sha256")), size) if isinstance(info, dict) else None
    if isinstance(info, dict) and base is not None:
        try:
            delta = Delta.read(json.dumps(info.get("header")).encode(), (directory / PAYLOAD).read_bytes())
            if delta.sha256 != sha256 or delta.version != version:
                raise DeltaError("the delta is of another version than the manifest's")
            buffer = torch.from_numpy(apply(base, delta))
            held.received(version, buffer.numpy(), sha256, manifest)
            log.info("weights version %d: its delta from version %s applied (%d bytes read of %d)", version,
                     info.get("base"), delta.nbytes, size)  # fmt: skip
            return {meta.name: tensor_view(buffer, meta, offset) for meta, offset in entries}
        except (DeltaError, OSError) as exc:
            log.warning("weights version %d: its delta did not apply (%s); reading it whole", version, exc)
    whole = _read_whole(directory, entries, size, version)
    digest = hashlib.sha256(whole.data).hexdigest()
    if digest != sha256:
        raise ValueError(f"weights version {version}: checksum mismatch (sha256 {digest} of its shards != {sha256} in "
                         f"{path}): a file was corrupted or overwritten")  # fmt: skip
    held.received(version, whole, sha256, manifest)
    return directory


def _manifest(path: Path, version: int) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("version") != version:
        raise ValueError(f"{path} is not version {version}'s deltas manifest")
    if not isinstance(manifest.get("bytes"), int) or not isinstance(manifest.get("sha256"), str):
        raise ValueError(f"{path}: 'bytes' (an integer) and 'sha256' (a string) are missing")
    return manifest


def _read_whole(directory: Path, entries: list[tuple[Any, int]], size: int, version: int) -> np.ndarray:
    """The version's shards read into one buffer of `size` bytes at the manifest's offsets (zeros between)."""
    buffer = np.zeros(size, dtype=np.uint8)
    view = memoryview(buffer)  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs lack __buffer__
    wanted = {meta.name: (meta, offset) for meta, offset in entries}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
            for name, spec in header.items():
                if name == "__metadata__":
                    continue
                meta, offset = wanted.pop(name, (None, 0))
                start, end = spec["data_offsets"]
                if meta is None or end - start != meta.nbytes:
                    raise ValueError(f"weights version {version}: {file.name}'s {name!r} is not in its deltas "
                                     f"manifest as it is in the file")  # fmt: skip
                f.seek(8 + length + start)
                if f.readinto(view[offset : offset + meta.nbytes]) != meta.nbytes:
                    raise ValueError(f"weights version {version}: {file.name} ends inside {name!r}")
    if wanted:
        raise ValueError(f"weights version {version}: no shard holds {sorted(wanted)[:5]}, which its manifest lists")
    return buffer

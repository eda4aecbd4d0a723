"""`fs://DIR`: one directory per version on storage every machine mounts at the same path, made visible by one
`rename` (`FsTransport`, both sides: the trainer writes it, a worker reloads its files), and a stored version's
directory as a worker finds it (`version_dir`).

A version is Hugging Face's checkpoint layout, so that vLLM, transformers and our engines load it as it is: one
`model.safetensors`, or, when it is bigger than a shard (`shard_bytes`, the transport's bucket), shards
`model-00001-of-0000N.safetensors` and the index `model.safetensors.index.json`. Shards are written as the tensors
come (each is a plain safetensors file, written here without copying the tensors' bytes), so the trainer never holds
more than one shard's tensors."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.files import fsync_path
from staleness.weights.base import (
    ADAPTERS_DIR,
    VERSION_DIR,
    Fetched,
    Opening,
    PublishStats,
    Receiving,
    Transport,
    WeightsUri,
    check_version,
)
from staleness.weights.buckets import raw_bytes
from staleness.weights.fs_delta import Gathering, has_deltas, receive
from staleness.weights.sources import ADAPTER_CONFIG, WeightSource, named_tensors

if TYPE_CHECKING:
    import redis

    from staleness.weights.delta import HeldWeights

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
"""An adapter's tensors, as PEFT's `save_pretrained` writes them (and vLLM's LoRA loader reads them)."""
PARTIAL_PREFIX = ".partial-"
"""A directory being written; never a version until renamed."""
REMOVING_PREFIX = ".removing-"
"""A directory being deleted: renamed first, so that no reader sees half a version."""
DEFAULT_SHARD_BYTES = 2 << 30
"""Bytes of tensors per shard file (a tensor bigger than that gets a shard of its own): the most a publish holds."""
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
"""safetensors' dtype names."""


class FsTransport(Transport):
    """`fs://DIR`: a directory per version, `DIR/v{n}/model.safetensors` (or its shards), made visible by one `rename`.

    For clusters with shared storage: DIR must be mounted at the same path on the trainer and every
    worker (the uri carries the absolute path). A reader never sees a half-written version: the files are
    written and fsynced in `DIR/.partial-v{n}-*`, which is then renamed to `DIR/v{n}`. Stored: a worker reloads the
    directory's files (`engine.load_weights`) after it paused, or whenever it starts.

    Deltas (`held`, the trainer's last published version: `publish_weights(..., deltas=True)`): each version is
    still written whole, and beside its shards, in its directory, what changed since the one before
    (`staleness.weights.fs_delta`); a worker that holds that one reads only the delta, before it pauses.
    """

    scheme = "fs"
    sends_deltas = True

    def __init__(
        self, root: str | os.PathLike[str], *, shard_bytes: int = DEFAULT_SHARD_BYTES, held: HeldWeights | None = None
    ) -> None:
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        self.root = Path(root).absolute()
        self.shard_bytes = shard_bytes
        self.held = held
        """The last version this trainer published, whole, to send the next as a delta from; None: no deltas."""

    @classmethod
    def parse(cls, uri: str, rest: str) -> WeightsUri:
        """`fs://` + a directory (absolute: `fs:///shared/ckpt`), a version's when its last part is `v{n}`."""
        if not rest:
            raise ValueError(f"weights uri {uri!r} names no directory (fs:///path/to/dir)")
        path = rest.rstrip("/") or "/"
        match = VERSION_DIR.fullmatch(Path(path).name)
        return WeightsUri("fs", path, int(match.group(1)) if match else None)

    @classmethod
    def format_uri(cls, uri: WeightsUri) -> str:
        return f"fs://{uri.location}"

    @classmethod
    def open(cls, spec: str, parsed: WeightsUri, opening: Opening) -> FsTransport:
        """`DIR`, or with an adapter `DIR/adapters/NAME`; `bucket_bytes` is the shard size."""
        root = Path(parsed.location)
        shard_bytes = DEFAULT_SHARD_BYTES if opening.bucket_bytes is None else opening.bucket_bytes
        if opening.adapter is not None:
            return cls(root / ADAPTERS_DIR / opening.adapter, shard_bytes=shard_bytes)
        return cls(root, shard_bytes=shard_bytes, held=opening.held)

    @classmethod
    def remove_published(cls, parsed: WeightsUri, redis_client: redis.Redis | None, ns: str | None) -> bool:
        assert parsed.version is not None
        return cls(Path(parsed.location).parent).remove(parsed.version)

    @classmethod
    def fetch_stored(cls, uri: WeightsUri, version: int, redis_client: redis.Redis | None) -> Fetched:
        """The version's directory, for `engine.load_weights` (`FileNotFoundError` if it is not there)."""
        return version_dir(Path(uri.location), version)

    @classmethod
    def ahead_of_pause(cls, uri: WeightsUri, receiving: Receiving) -> bool:
        """A version published with deltas, by a worker that holds what it reads: read (its delta, or its shards
        into the held buffer) before the pause."""
        return receiving.held is not None and has_deltas(Path(uri.location))

    @classmethod
    def fetch_received(cls, uri: WeightsUri, version: int, receiving: Receiving) -> Fetched:
        """The version's directory, or, where the worker holds the version its delta is from, that delta applied
        (`staleness.weights.fs_delta.receive`: the held buffer then holds this version)."""
        directory = version_dir(Path(uri.location), version)
        return directory if receiving.held is None else receive(directory, version, receiving.held)

    def path_of(self, version: int) -> Path:
        return self.root / f"v{check_version(version)}"

    def uri_of(self, version: int) -> str:
        return f"fs://{self.path_of(version)}"

    def put(self, tensors: WeightSource, version: int, adapter_config: Mapping[str, Any] | None) -> PublishStats:
        """Write `DIR/v{version}` atomically (temp dir, shards as the tensors come, fsync, rename): its uri is
        `fs:///DIR/v{version}`. If the source raises, the temp dir goes and the error propagates.

        With `adapter_config`, the tensors are a LoRA adapter's: PEFT's two files are written instead (one
        `adapter_model.safetensors`, whatever its size: adapters are small)."""
        final = self.path_of(version)
        if final.exists():
            raise FileExistsError(
                f"weights version {version} exists at {final}: versions are immutable, remove it first"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{PARTIAL_PREFIX}v{version}-*"):  # an earlier attempt that crashed
            shutil.rmtree(stale, ignore_errors=True)
        partial = self.root / f"{PARTIAL_PREFIX}v{version}-{uuid.uuid4().hex[:12]}"
        partial.mkdir()  # mode from the umask (mkdtemp's 0700 would lock out workers running as another user)
        metadata = {"format": "pt", "version": str(version)}
        stats = PublishStats()
        gathering = Gathering(self.held, version) if self.held is not None and adapter_config is None else None
        try:
            shard_bytes = self.shard_bytes if adapter_config is None else None
            stream = named_tensors(tensors)
            written = _write_shards(stream if gathering is None else gathering.passing(stream), partial, shard_bytes,
                                    metadata, stats)  # fmt: skip
            single = ADAPTER_FILE if adapter_config is not None else WEIGHTS_FILE
            files = _name_shards(partial, written, single, stats.bytes)
            if gathering is not None:
                files += gathering.write(partial, stats)
            if adapter_config is not None:
                config = partial / ADAPTER_CONFIG
                config.write_text(json.dumps(dict(adapter_config), indent=2))
                files.append(config)
            for file in files:
                fsync_path(file)
            fsync_path(partial)
            os.rename(partial, final)  # atomic: `v{n}` appears complete or not at all
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        fsync_path(self.root)
        if gathering is not None:
            gathering.published()
        return stats

    def fetch(self, version: int) -> Path:
        """The directory of a complete version, for `engine.load_weights` (`FileNotFoundError` if none)."""
        return version_dir(self.path_of(version), version)

    def versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := VERSION_DIR.fullmatch(p.name)))

    def stored(self) -> set[int]:
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


def version_dir(path: Path, version: int) -> Path:
    if not path.is_dir():
        raise FileNotFoundError(
            f"weights version {version} not found: no directory {path} (removed, or never published)"
        )
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"weights version {version}: {path} holds no *.safetensors file")
    return path


def _write_shards(
    stream: Iterable[tuple[str, torch.Tensor]],
    directory: Path,
    shard_bytes: int | None,
    metadata: dict[str, str],
    stats: PublishStats,
) -> list[tuple[Path, list[str]]]:
    """Write the stream as shard files `directory/shard-{k}.safetensors` of up to `shard_bytes` of tensors each (None:
    one file), holding only the tensors of the shard being gathered; returns each file and its tensors' names."""
    written: list[tuple[Path, list[str]]] = []
    shard: list[tuple[str, torch.Tensor]] = []
    held = 0

    def flush() -> None:
        nonlocal held
        file = directory / f"shard-{len(written) + 1:05d}.safetensors"
        write_shard(shard, file, metadata)
        written.append((file, [name for name, _ in shard]))
        shard.clear()
        held = 0

    for name, tensor in stream:
        if shard and shard_bytes is not None and held + tensor.nbytes > shard_bytes:
            flush()
        shard.append((name, tensor))
        held += tensor.nbytes
        stats.tensors += 1
        stats.bytes += tensor.nbytes
        stats.hold(held)
        del tensor
        if shard_bytes is not None and held >= shard_bytes:
            flush()  # full: written before the next tensor is asked for
    if shard or not written:
        flush()
    return written


def _name_shards(directory: Path, written: list[tuple[Path, list[str]]], single: str, total: int) -> list[Path]:
    """Give the shards their final names: `single` when there is one, else Hugging Face's
    `model-0000k-of-0000N.safetensors` and the index that maps each tensor to its shard (`total`: tensor bytes)."""
    if len(written) == 1:
        target = directory / single
        os.replace(written[0][0], target)
        return [target]
    stem = single.removesuffix(".safetensors")
    files, weight_map = [], {}
    for k, (file, names) in enumerate(written, 1):
        target = directory / f"{stem}-{k:05d}-of-{len(written):05d}.safetensors"
        os.replace(file, target)
        files.append(target)
        weight_map.update(dict.fromkeys(names, target.name))
    index = directory / f"{single}.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [*files, index]


def write_shard(tensors: list[tuple[str, torch.Tensor]], file: Path, metadata: Mapping[str, str]) -> None:
    """One safetensors file: the header, then each tensor's bytes straight from its memory (no copy). Contiguous
    CPU tensors, in the order given (safetensors wants their bytes back to back, no gaps)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, tensor in tensors:
        dtype = _ST_DTYPES.get(tensor.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r} is {tensor.dtype}, which safetensors cannot store: convert it")
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for _, tensor in tensors:
            if tensor.nbytes:
                out.write(raw_bytes(tensor).numpy().data)  # a buffer over the tensor's own memory

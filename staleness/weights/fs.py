"""`fs://DIR`: one directory per version on storage every machine mounts at the same path, made visible by one
`rename` (`FsTransport`), and a stored version's directory as a worker finds it (`version_dir`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipeline.files import fsync_path
from staleness.weights.base import (
    ADAPTER_CONFIG,
    VERSION_DIR,
    NamedTensors,
    Scheme,
    check_version,
    parse_uri,
    release_older,
    state_dict_of,
)

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
"""An adapter's tensors, as PEFT's `save_pretrained` writes them (and vLLM's LoRA loader reads them)."""
PARTIAL_PREFIX = ".partial-"
"""A directory being written; never a version until renamed."""
REMOVING_PREFIX = ".removing-"
"""A directory being deleted: renamed first, so that no reader sees half a version."""


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

    def release(self, keep: Iterable[int]) -> list[int]:
        return release_older(self, keep)


def version_dir(path: Path, version: int) -> Path:
    if not path.is_dir():
        raise FileNotFoundError(
            f"weights version {version} not found: no directory {path} (removed, or never published)"
        )
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"weights version {version}: {path} holds no *.safetensors file")
    return path

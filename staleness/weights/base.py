"""The vocabulary every weight transport shares: uris (`WeightsUri`, `parse_uri`), tensors in checkpoint names
(`state_dict_of`, `read_checkpoint`, `read_adapter`), versions (`check_version`, `release_older`), and the two sides'
protocols: what a transport needs of an engine (`LoadsWeights`) and what the trainer sees of a transport
(`WeightTransport`). The engine is duck-typed: this package imports no engine, as the design asks."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch
from safetensors.torch import load_file

from pipeline.wire import ADAPTER_PATTERN, Keys

if TYPE_CHECKING:
    from staleness.weights.nccl import BroadcastLink

Scheme = Literal["fs", "redis", "nccl", "ipc"]
TensorLike = torch.Tensor | np.ndarray
NamedTensors = Mapping[str, TensorLike]

SCHEMES: tuple[Scheme, ...] = ("fs", "redis", "nccl", "ipc")
ADAPTER_CONFIG = "adapter_config.json"
"""An adapter's config file, as PEFT's `save_pretrained` writes it (and vLLM's LoRA loader reads it)."""
ADAPTERS_DIR = "adapters"
"""Under a transport's root (fs) or namespace (redis): one place per adapter name."""

VERSION_DIR = re.compile(r"v(\d+)")
"""A version's name in a uri or a directory: `v{n}`."""


class LoadsWeights(Protocol):
    """What a transport needs of an engine (`consumers.engines.base.Engine` has it all)."""

    @property
    def weight_receivers(self) -> int:
        """Processes that hold the weights and take a rank in an nccl broadcast (vLLM: one per GPU)."""
        ...

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
        match = VERSION_DIR.fullmatch(Path(path).name)
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
        match = VERSION_DIR.fullmatch(tail)
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


def release_older(transport: Stored, keep: Iterable[int]) -> list[int]:
    """Delete every stored version below `max(keep)` that is not in `keep` (`WeightTransport.release`). Versions
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

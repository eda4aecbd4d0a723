"""Where a version's tensors come from: a module, a state dict, `(name, tensor)` pairs (a stream that gathers one at a
time), or a checkpoint directory (`named_tensors`); an adapter's tensors and config (`read_adapter`). Every transport
reads its source through these."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file

from staleness.weights.fused import to_checkpoint

TensorLike = torch.Tensor | np.ndarray

ADAPTER_CONFIG = "adapter_config.json"
"""An adapter's config file, as PEFT's `save_pretrained` writes it (and vLLM's LoRA loader reads it)."""


WeightSource = torch.nn.Module | Mapping[str, TensorLike] | Iterable[tuple[str, TensorLike]] | str | os.PathLike[str]
"""What a trainer publishes: a torch module, a state dict, an iterable of `(name, tensor)` pairs (a generator that
gathers one tensor at a time: FSDP, Megatron), or a safetensors checkpoint (a directory or one file)."""


def is_stream(source: object) -> bool:
    """Whether `source` is an iterable of `(name, tensor)` pairs rather than a module, a mapping or a path."""
    return not isinstance(source, (torch.nn.Module, Mapping, str, os.PathLike, bytes)) and isinstance(source, Iterable)


def named_tensors(source: WeightSource, *, keep_device: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Name -> contiguous, detached tensor, in checkpoint names, one at a time, from any `WeightSource`.

    Tensors are moved to the CPU unless `keep_device` (a GPU broadcast sends them from where they are).

    A module, a state dict or a checkpoint is walked as `state_dict_of` describes (wrappers unwrapped, tied names
    left out, overlapping tensors copied; a checkpoint is read a tensor at a time). A transformers module's fused
    parameters (a MoE's experts) go out split, in the checkpoint's names (`staleness.weights.fused`). An iterable is
    consumed lazily: each pair is checked and passed on at once, and nothing here keeps a reference to it, so a
    generator that gathers one tensor at a time is never held whole. Its tied names are not detected (addresses of
    freed tensors are reused): yield both, or only the one the model loads. A name yielded twice is refused.
    """
    if isinstance(source, (str, os.PathLike)):
        yield from _checkpoint_tensors(Path(source))
        return
    if is_stream(source):
        try:
            yield from _checked_pairs(cast(Iterable[Any], source), keep_device)
        finally:  # stopped early (an error downstream): let the source clean up (a gather's context) and let go
            close = getattr(source, "close", None)
            if callable(close):
                close()
        return
    if isinstance(source, torch.nn.Module):
        module = source
        while True:
            inner = getattr(module, "_orig_mod", None)  # torch.compile
            if inner is None and type(module).__name__ in ("DistributedDataParallel", "DataParallel"):
                inner = module.module
            if not isinstance(inner, torch.nn.Module):
                break
            module = inner
        items: Iterable[tuple[str, Any]] = to_checkpoint(module, module.state_dict()).items()
    elif isinstance(source, Mapping):
        items = source.items()
    else:
        raise TypeError(
            f"weights must be a torch module, a mapping of tensors, an iterable of (name, tensor) pairs or a "
            f"checkpoint path, got {type(source).__name__}"
        )
    kept: dict[int, list[torch.Tensor]] = {}  # storage address -> tensors passed on from it
    for name, value in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        tensor = _as_tensor(name, value).detach()
        tensor = (tensor if keep_device else tensor.to("cpu")).contiguous()
        if tensor.numel() == 0:
            yield name, tensor
            continue
        address = tensor.untyped_storage().data_ptr()
        others = kept.setdefault(address, [])
        if any(_same_view(tensor, other) for other in others):
            continue  # tied: an alias of a tensor already passed on
        if others:
            tensor = tensor.clone()
            kept.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
        else:
            others.append(tensor)
        yield name, tensor


def _checked_pairs(source: Iterable[Any], keep_device: bool) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    index = -1  # not enumerate(): it keeps its last (index, item) until the next item has been produced
    for item in source:
        index += 1
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(
                f"item {index} of the weights iterator is {type(item).__name__}, not a (name, tensor) pair: "
                "yield (name, tensor) tuples (e.g. from model.named_parameters() or state_dict().items())"
            )
        name, value = item
        if not isinstance(name, str):
            raise TypeError(f"item {index} of the weights iterator is named {name!r}: names must be strings")
        if name in seen:
            raise ValueError(f"tensor {name!r} was yielded twice by the weights iterator: yield each name once")
        seen.add(name)
        tensor = _as_tensor(name, value).detach()
        del item, value
        yield name, (tensor if keep_device else tensor.to("cpu")).contiguous()
        del tensor  # hold nothing of it while the consumer works on the next one


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A safetensors checkpoint's tensors (a directory of `*.safetensors`, or one file), read one at a time."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, reader.get_tensor(name).contiguous()


def checkpoint_files(path: Path) -> list[Path]:
    """The `*.safetensors` files of a checkpoint (a directory, or one file); `FileNotFoundError` if none."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    return files


def state_dict_of(source: WeightSource, *, keep_device: bool = False) -> dict[str, torch.Tensor]:
    """Name -> contiguous tensor, in checkpoint names, from a module, a state dict, a safetensors checkpoint or an
    iterable of `(name, tensor)` pairs (collected whole: stream it with `named_tensors` instead).

    Tensors are moved to the CPU unless `keep_device` (a GPU broadcast sends them from where they are).

    A module wrapped by `torch.compile` or (Distributed)DataParallel is unwrapped, so names carry no
    `_orig_mod.`/`module.` prefix. A name whose tensor is another name's (tied weights, e.g. `lm_head.weight`
    = `model.embed_tokens.weight`) is left out, as `save_pretrained` does: the first name in order stays, and
    an engine loads the tied ones through it. Other tensors that overlap in memory are copied, since
    safetensors refuses shared storage. Tensors already in place are not copied otherwise: do not train while
    publishing.
    """
    return dict(named_tensors(source, keep_device=keep_device))


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
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        tensors.update(load_file(f))
    return tensors


def read_adapter(
    source: WeightSource, config: Mapping[str, Any] | None = None
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

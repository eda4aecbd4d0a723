"""What an engine reads of a model's files before and while it loads them: its limits from the config files alone
(`read_model_limits`), the names and shapes of a safetensors checkpoint (`checkpoint_shapes`), the check that a
checkpoint fits a model (`check_checkpoint_fits`, `WeightLayout`), and tensors as a safetensors blob takes them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ModelLimits:
    """What an engine must know of a model before loading it: read from its config files alone."""

    max_model_len: int
    vocab_size: int
    eos_ids: frozenset[int]
    """The config's and generation config's `eos_token_id`: both engines stop on exactly these."""
    pad_id: int
    experts: int = 0
    """Experts per mixture-of-experts layer (`num_experts`, `num_local_experts` or `n_routed_experts`); 0: dense."""


def read_model_limits(model_dir: Path, max_model_len: int | None) -> ModelLimits:
    """Context length (the model's, or the smaller `max_model_len` asked for), vocabulary and stop tokens."""
    config = _plain_text_config(model_dir) or _transformers_text_config(model_dir)
    context = int(config.get("max_position_embeddings") or 0)
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if not context and max_model_len is None:
        raise ValueError(f"{model_dir} has no max_position_embeddings; pass max_model_len")
    eos = _as_ids(config.get("eos_token_id"))
    with contextlib.suppress(OSError, ValueError):  # no generation_config.json, or not one transformers reads
        eos += _as_ids(json.loads((Path(model_dir) / "generation_config.json").read_text()).get("eos_token_id"))
    return ModelLimits(
        max_model_len=min(v for v in (context, max_model_len) if v),  # the smaller of those given (one is: above)
        vocab_size=int(config["vocab_size"]),
        eos_ids=frozenset(eos),
        pad_id=int(config.get("pad_token_id") or 0),
        experts=int(next((config[k] for k in EXPERT_FIELDS if config.get(k)), 0)),
    )


LIMIT_FIELDS = ("max_position_embeddings", "vocab_size", "eos_token_id", "pad_token_id")
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where a config says how many experts a mixture-of-experts layer has (transformers' names differ by model)."""


def _plain_text_config(model_dir: Path) -> dict[str, Any] | None:
    """`config.json` as written, when it states every field the limits need and holds no sub-model's config: then
    it says what transformers would (a written value, null included, overrides a config class's default). Reading
    it takes milliseconds, where importing transformers for it took ~5 s of each worker's start on 2 cores (a
    synthetic or remote worker needs nothing else of transformers). None: ask transformers."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # transformers says what is wrong with it
    if not isinstance(config, dict) or not all(k in config for k in LIMIT_FIELDS):
        return None  # an alias (GPT-2's `n_positions`) or a class default stands in for a field
    if any(isinstance(v, dict) and "model_type" in v for v in config.values()):
        return None  # a composite model (a `text_config`): its text decoder's config is transformers' to find
    return config


def _transformers_text_config(model_dir: Path) -> dict[str, Any]:
    """The text decoder's config as transformers reads it: attribute aliases, class defaults, sub-configs."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir).get_text_config(decoder=True)
    return {k: getattr(config, k, None) for k in LIMIT_FIELDS}


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def check_checkpoint_fits(
    shapes: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    source: object,
    missing: list[str] | None = None,
) -> None:
    """Refuse, before anything is loaded, weights whose names or shapes do not match the model's.

    `missing` overrides the names counted as missing (tied parameters load through one name).
    """
    unknown = sorted(set(shapes) - set(expected))
    missing = sorted(set(expected) - set(shapes)) if missing is None else missing
    bad = [f"{k}: {shapes[k]} != {expected[k]}" for k in shapes if k in expected and shapes[k] != expected[k]]
    problems = []
    if unknown:
        problems.append(f"unknown tensors {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
    if missing:
        problems.append(f"missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
    if bad:
        problems.append(f"shape mismatches {bad[:5]}")
    if problems:
        raise ValueError(f"checkpoint {source} does not fit the model: " + "; ".join(problems))


@dataclass(frozen=True)
class WeightLayout:
    """The tensors a model takes, as plain data: what `check_fits` needs, where the model itself is not at hand
    (an engine in a process of its own, `consumers.engines.process_engine`)."""

    shapes: dict[str, tuple[int, ...]]
    """Each parameter and buffer name, and its shape."""
    storage: dict[str, int]
    """Each name's storage: names of one storage are tied, and loading one of them loads them all."""

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> WeightLayout:
        """From a torch `state_dict()`."""
        return cls({k: tuple(t.shape) for k, t in state.items()}, {k: t.data_ptr() for k, t in state.items()})

    def check(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes cannot be loaded into the model."""
        loaded = {self.storage[k] for k in shapes if k in self.storage}
        missing = sorted(k for k, s in self.storage.items() if k not in shapes and s not in loaded)
        check_checkpoint_fits(shapes, self.shapes, source, missing)

    def to_dict(self) -> dict[str, Any]:
        return {"shapes": {k: list(v) for k, v in self.shapes.items()}, "storage": self.storage}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeightLayout:
        return cls({k: tuple(v) for k, v in data["shapes"].items()}, dict(data["storage"]))


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors checkpoint (a directory or one file), from the headers only."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def checkpoint_layout(model_dir: Path) -> WeightLayout | None:
    """The tensors a model directory's checkpoint takes, from its safetensors headers (None: it has none, so nothing
    to compare with): what an engine that loads by name checks weights against (vLLM, a remote vLLM server). With
    `tie_word_embeddings` set in its `config.json` and no `lm_head.weight` of its own, `lm_head.weight` is taken as
    the input embedding's tied name (a torch module's `state_dict()` has both; vLLM skips it)."""
    try:
        shapes = checkpoint_shapes(model_dir)
    except FileNotFoundError:
        return None
    storage = {name: i for i, name in enumerate(shapes)}
    config: Any = None
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((model_dir / "config.json").read_text())
    embeddings = [name for name in shapes if name.endswith("embed_tokens.weight")]
    tied = isinstance(config, dict) and config.get("tie_word_embeddings") is True
    if tied and "lm_head.weight" not in shapes and len(embeddings) == 1:
        shapes["lm_head.weight"] = shapes[embeddings[0]]
        storage["lm_head.weight"] = storage[embeddings[0]]
    return WeightLayout(shapes, storage)


def as_cpu_tensors(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Named torch tensors or numpy arrays as contiguous CPU torch tensors: what a safetensors blob is made of."""
    import torch

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return {
        name: (torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t.detach())
        .to("cpu")
        .contiguous()
        for name, t in items
    }

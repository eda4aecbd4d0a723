"""The one protocol every generation engine implements: `torch`, `vllm`, `synthetic` (no model), and `remote`
(a vLLM server someone else runs).

The worker only ever talks to an engine through `Engine`; an engine knows nothing of
Redis, versions policy or staleness. Like vLLM's v1 engine client/core split, the seam
is narrow: token ids in, token ids + per-token logprobs + version spans out.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

import numpy as np

from pipeline.wire import FinishReason, Sampling, Span
from pipeline.wire import PauseMode as PauseMode  # re-exported: the engines take it from here

if TYPE_CHECKING:
    from staleness.broadcast import BroadcastLink


class EngineInputError(ValueError):
    """The engine cannot serve this request (too long, bad sampling values, unknown tokens).

    The worker turns it into rollouts with `finish_reason=error`, so the trainer is never
    left waiting for a prompt that will not generate.
    """


class EngineClosedError(RuntimeError):
    """The engine was shut down or died: it serves nothing more, and the worker must stop."""


@dataclass
class Generation:
    """What an engine produced for one request (one sample)."""

    tokens: np.ndarray
    """Generated token ids, int32."""
    logprobs: np.ndarray
    """Log-probability of each generated token under the raw model distribution, float32."""
    finish_reason: FinishReason
    spans: list[Span] = field(default_factory=list)
    """`[(version, start, end), ...]` covering `[0, len(tokens))` in order."""
    cached_tokens: int | None = None
    """Prompt tokens found in the engine's prefix cache (vLLM reports it; None: the engine does not say)."""


class Engine(Protocol):
    name: str
    version: int
    """Policy version of the weights loaded now."""
    max_model_len: int
    """Longest prompt + generation the engine accepts, in tokens."""
    vocab_size: int
    weight_receivers: int
    """Processes that hold the weights and each take a rank in an nccl broadcast."""
    max_loras: int
    """LoRA adapters it holds at once (0: it serves the base model only)."""

    async def start(self) -> None: ...

    async def generate(
        self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling, adapter: str | None = None
    ) -> Generation:
        """Generate one sample, under LoRA `adapter` if given (it must be loaded: `load_adapter`); its spans are
        then in that adapter's versions. A request of a paused adapter waits until `resume_adapter`. Raises
        `EngineInputError` for a request it cannot serve (an adapter that is not loaded among them)."""
        ...

    def adapters(self) -> dict[str, int]:
        """The adapters loaded now, name -> version."""
        ...

    async def load_adapter(
        self, name: str, tensors: Mapping[str, Any], config: Mapping[str, Any], version: int
    ) -> None:
        """Load LoRA adapter `name` at `version` (PEFT tensor names and `adapter_config.json` fields: `r`,
        `lora_alpha`, `target_modules`), or replace the one of that name in place. Raises `ValueError` saying
        what is wrong (tensors that do not fit the model, every one of `max_loras` slots taken), loading nothing."""
        ...

    async def remove_adapter(self, name: str) -> None:
        """Free adapter `name`'s slot; `ValueError` while requests of it are in flight."""
        ...

    async def pause_adapter(self, name: str, mode: PauseMode) -> None:
        """Stop generating for adapter `name` only; returns once no step runs with it. `abort`: its requests end
        now with the tokens so far (`finish_reason="abort"`); `keep`: they stay, frozen, and go on after
        `resume_adapter`. Either way new requests of it wait. Other adapters and the base model go on."""
        ...

    async def resume_adapter(self, name: str) -> None: ...

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now; their `generate` calls return the tokens so far with `abort`."""
        ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors checkpoint directory in place and tag what follows with `version`."""
        ...

    async def load_tensors(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Load weights from memory (torch tensors or numpy arrays, in checkpoint names) in place and tag
        what follows with `version`: for transports that deliver tensors, not files (`redis://`)."""
        ...

    async def prepare_broadcast(self, link: BroadcastLink) -> None:
        """Find or build the group of `link` in every receiving process while generation goes on (the worker calls
        it before it pauses: `staleness.broadcast.prepare_receiver`)."""
        ...

    async def load_broadcast(self, link: BroadcastLink) -> None:
        """Receive a version the trainer broadcasts (`nccl://`, `staleness.broadcast`) and load it in place."""
        ...

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes cannot be loaded into the model."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def shutdown(self) -> None: ...


class EngineLifecycle:
    """`async with engine:` starts it and shuts it down: the one copy every engine inherits."""

    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


class ServesNoAdapters:
    """The adapter half of `Engine` for an engine without LoRA support (`max_loras = 0`): the one copy.

    Such an engine's `generate` refuses a request that names an adapter (`refuse_adapter`), so the worker turns it
    into an error rollout that says so."""

    name: str
    max_loras = 0

    def adapters(self) -> dict[str, int]:
        return {}

    async def load_adapter(
        self, name: str, tensors: Mapping[str, Any], config: Mapping[str, Any], version: int
    ) -> None:
        raise ValueError(f"the {self.name} engine serves no LoRA adapters")

    async def remove_adapter(self, name: str) -> None:
        return None

    async def pause_adapter(self, name: str, mode: PauseMode) -> None:
        return None  # it runs no request of any adapter

    async def resume_adapter(self, name: str) -> None:
        return None


def refuse_adapter(engine: str, adapter: str | None) -> None:
    """`EngineInputError` for a request under an adapter on an engine that serves none."""
    if adapter is not None:
        raise EngineInputError(f"the {engine} engine serves no LoRA adapters (asked for adapter {adapter!r})")


@dataclass(frozen=True)
class ModelLimits:
    """What an engine must know of a model before loading it: read from its config files alone."""

    max_model_len: int
    vocab_size: int
    eos_ids: frozenset[int]
    """The config's and generation config's `eos_token_id`: both engines stop on exactly these."""
    pad_id: int


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
        max_model_len=min(context or max_model_len, max_model_len or context),  # type: ignore[type-var]
        vocab_size=int(config["vocab_size"]),
        eos_ids=frozenset(eos),
        pad_id=int(config.get("pad_token_id") or 0),
    )


LIMIT_FIELDS = ("max_position_embeddings", "vocab_size", "eos_token_id", "pad_token_id")


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
    (an engine in a process of its own, `consumers.process_engine`)."""

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


VLLM_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "repetition": "stop",
}
"""vLLM's finish reasons as ours, for both vLLM engines (in process and `remote`); "error" is an engine failure."""


def vllm_spans(labelled: Iterable[tuple[str, int, int]], n_tokens: int, version: int) -> list[tuple[int, int, int]]:
    """vLLM's per-token weight-version labels `(label, start, end)` as spans covering `[0, n_tokens)`; none reported:
    all of `version`. A label that is not a policy version, or spans with a gap, raise `RuntimeError`."""
    if not n_tokens:
        return []
    labelled = list(labelled)
    if not labelled:
        return [(version, 0, n_tokens)]
    try:
        spans = [(int(label), int(start), int(end)) for label, start, end in labelled if end > start]
    except ValueError:
        raise RuntimeError(
            f"vLLM labels its weights {[label for label, _, _ in labelled]}, not with policy versions "
            "(another client relabelled it: /update_weight_version)"
        ) from None
    if spans[0][1] != 0 or spans[-1][2] != n_tokens or any(a[2] != b[1] for a, b in itertools.pairwise(spans)):
        raise RuntimeError(f"vLLM weight-version spans {spans} do not cover {n_tokens} tokens")
    return spans


def check_request(prompt_tokens: np.ndarray, sampling: Sampling, max_model_len: int, vocab_size: int) -> None:
    """The checks every engine makes before it accepts a request, with messages that say what to fix."""
    if prompt_tokens.ndim != 1 or (prompt_tokens.size and prompt_tokens.dtype.kind not in "iu"):
        raise EngineInputError(
            f"prompt must be a 1-D array of integer token ids, got {prompt_tokens.dtype}{prompt_tokens.shape}"
        )
    problems = sampling.problems()
    if len(prompt_tokens) == 0:
        problems.append("prompt has no tokens")
    elif len(prompt_tokens) >= max_model_len:
        problems.append(
            f"prompt has {len(prompt_tokens)} tokens; the model's context is {max_model_len}, "
            f"so at most {max_model_len - 1} prompt tokens leave room to generate"
        )
    if len(prompt_tokens) and (prompt_tokens.min() < 0 or prompt_tokens.max() >= vocab_size):
        problems.append(f"token ids must be in [0, {vocab_size}), got [{prompt_tokens.min()}, {prompt_tokens.max()}]")
    bad_stops = [t for t in sampling.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stops:
        problems.append(f"stop_token_ids {bad_stops} are outside the vocabulary [0, {vocab_size})")
    if problems:
        raise EngineInputError("; ".join(problems))


ENGINES = ("torch", "vllm", "synthetic", "remote")


IN_PROCESS_ONLY = ("vllm", "remote")
"""Engines whose compute already runs outside the worker's process (vLLM's `EngineCore`, a server)."""


def create_engine(kind: str, model: str, *, process: bool = False, **options: object) -> Engine:
    """Build an engine by name; heavy imports happen only for the engine asked for. `process`: run it in a process
    of its own (`consumers.process_engine`), so that the worker's Python never holds the GIL its steps need."""
    if process:
        if kind in IN_PROCESS_ONLY:
            raise ValueError(f"the {kind} engine already runs its compute outside the worker: drop --engine-process")
        from consumers.process_engine import ProcessEngine

        return ProcessEngine(kind, model, options)
    if kind == "torch":
        from consumers.torch_engine import TorchEngine

        return TorchEngine(model, **options)  # type: ignore[arg-type]
    if kind == "vllm":
        from consumers.vllm_engine import VllmEngine

        return VllmEngine(model, **options)  # type: ignore[arg-type]
    if kind == "synthetic":
        from consumers.synthetic_engine import SyntheticEngine

        return SyntheticEngine(model, **options)  # type: ignore[arg-type]
    if kind == "remote":
        from consumers.remote_engine import RemoteVllmEngine

        return RemoteVllmEngine(model, **options)  # type: ignore[arg-type]
    raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")

"""The one protocol every generation engine implements (`torch` now, `vllm` next).

The worker only ever talks to an engine through `Engine`; an engine knows nothing of
Redis, versions policy or staleness. Like vLLM's v1 engine client/core split, the seam
is narrow: token ids in, token ids + per-token logprobs + version spans out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from pipeline.wire import FinishReason, Sampling

PauseMode = Literal["abort", "keep"]


class EngineInputError(ValueError):
    """The engine cannot serve this request (too long, bad sampling values, unknown tokens).

    The worker turns it into rollouts with `finish_reason=error`, so the trainer is never
    left waiting for a prompt that will not generate.
    """


@dataclass
class Generation:
    """What an engine produced for one request (one sample)."""

    tokens: np.ndarray
    """Generated token ids, int32."""
    logprobs: np.ndarray
    """Log-probability of each generated token under the raw model distribution, float32."""
    finish_reason: FinishReason
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    """`[(version, start, end), ...]` covering `[0, len(tokens))` in order."""


class Engine(Protocol):
    name: str
    version: int
    """Policy version of the weights loaded now."""
    max_model_len: int
    """Longest prompt + generation the engine accepts, in tokens."""
    vocab_size: int

    async def start(self) -> None: ...

    async def generate(self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling) -> Generation:
        """Generate one sample. Raises `EngineInputError` for a request it cannot serve."""
        ...

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now; their `generate` calls return the tokens so far with `abort`."""
        ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors checkpoint directory in place and tag what follows with `version`."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def shutdown(self) -> None: ...


def check_request(prompt_tokens: np.ndarray, sampling: Sampling, max_model_len: int, vocab_size: int) -> None:
    """The checks every engine makes before it accepts a request, with messages that say what to fix."""
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


ENGINES = ("torch",)


def create_engine(kind: str, model: str, **options: object) -> Engine:
    """Build an engine by name; heavy imports happen only for the engine asked for."""
    if kind == "torch":
        from consumers.torch_engine import TorchEngine

        return TorchEngine(model, **options)  # type: ignore[arg-type]
    raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")

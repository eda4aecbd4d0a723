"""The one protocol every generation engine implements (`Engine`), its errors, what it returns (`Generation`), the
mixins the engines share, and the checks every engine makes before it accepts a request (`check_request`).

The worker only ever talks to an engine through `Engine`; an engine knows nothing of
Redis, versions policy or staleness. Like vLLM's v1 engine client/core split, the seam
is narrow: token ids in, token ids + per-token logprobs + version spans out. Weights come in by what they are, never
by the transport that brought them: a checkpoint's files (`load_weights`), named tensors (`load_tensors`), or a
version its weight-holding processes open where they are (`load_handover`, `staleness.weights.handover`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self

import numpy as np

from pipeline.wire import LOGPROBS_MODES, MAX_SAMPLES, FinishReason, LogprobsMode, PauseMode, Sampling, Span

if TYPE_CHECKING:
    import torch

    from staleness.weights.handover import Handover, Placement
    from staleness.weights.nccl import BroadcastStats, PeerPush


WakePart = Literal["weights", "kv_cache"]
"""What `Engine.wake_up` takes back (vLLM's sleep tags)."""
WAKE_ALL: tuple[WakePart, ...] = ("weights", "kv_cache")


class EngineInputError(ValueError):
    """The engine cannot serve this request (too long, bad sampling values, unknown tokens).

    The worker turns it into rollouts with `finish_reason=error`, so the trainer is never
    left waiting for a prompt that will not generate.
    """


class EngineClosedError(RuntimeError):
    """The engine was shut down or died: it serves nothing more, and the worker must stop."""


class SleepNotSupported(RuntimeError):
    """`Engine.sleep` of an engine that cannot free its memory this way: the message says why, and what to start the
    worker with instead. The worker then stays paused, awake, and acks the sleep as such."""


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
    routed_experts: np.ndarray | None = None
    """When the request asked (`Sampling.routed_experts`): the experts each position of prompt + tokens but the last
    was routed to, int16 `[positions, layers, top_k]` (`pipeline.wire.Rollout.routed_experts`)."""
    top_token_ids: np.ndarray | None = None
    """When the request asked (`Sampling.top_logprobs` = k): the k most likely tokens of each generated position, int32
    `[len(tokens), k]`, most likely first (`pipeline.wire.Rollout.top_token_ids`); None with no tokens."""
    top_logprobs: np.ndarray | None = None
    """Their logprobs, float32 `[len(tokens), k]`, of the same distribution as `logprobs` (raw or processed)."""


class Engine(Protocol):
    name: str
    version: int
    """Policy version of the weights loaded now."""
    max_model_len: int
    """Longest prompt + generation the engine accepts, in tokens."""
    vocab_size: int
    max_loras: int
    """LoRA adapters it holds at once (0: it serves the base model only)."""

    @property
    def weight_receivers(self) -> int:
        """Processes that hold the weights, each of which opens a handover (and takes a rank in an nccl broadcast)."""
        ...

    @property
    def placement(self) -> Placement:
        """Where it holds its weights (the worker's process, processes of its own, a server): what a transport that
        opens a version there asks before it opens anything (`staleness.weights.base.Transport.check_placement`)."""
        ...

    @property
    def max_batch(self) -> int | None:
        """Samples it decodes at once (torch and synthetic: their rows; vLLM: its `max_num_seqs`); None: it does not
        say. A worker takes no more samples than this unless told otherwise (`WorkerSettings.max_inflight`)."""
        ...

    @property
    def max_batch_tokens(self) -> int | None:
        """Tokens the samples it runs may hold at once (vLLM: its KV cache, once started); None: no limit it knows.
        A worker counts each sample it takes as its prompt + `max_tokens` against it (`max_inflight_tokens`)."""
        ...

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
        `resume_adapter`; `inflight`: as `keep` (no engine keeps an adapter's KV cache across its versions). Either
        way new requests of it wait. Other adapters and the base model go on."""
        ...

    async def resume_adapter(self, name: str) -> None: ...

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now; their `generate` calls return the tokens so far with `abort`."""
        ...

    async def pause(self, mode: PauseMode) -> None:
        """Stop generating between two steps; returns once none runs. `abort`: every request ends now with its tokens
        so far; `keep`: requests freeze, and after a load go on with their KV cache recomputed by the new weights;
        `inflight`: requests freeze, and after a load go on with the KV cache they have (no recompute)."""
        ...

    async def resume(self) -> None: ...

    async def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors checkpoint directory in place and tag what follows with `version`."""
        ...

    async def load_tensors(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Load weights from memory (torch tensors or numpy arrays, in checkpoint names) in place and tag
        what follows with `version`: for transports that deliver tensors, not files (`redis://`)."""
        ...

    async def prepare_handover(self, handover: Handover) -> None:
        """Before the pause, while generation goes on: have each process that holds the weights get ready to open the
        handover (`staleness.weights.base.prepare_handover`; nccl: its group built and its receives posted)."""
        ...

    async def load_handover(self, handover: Handover) -> None:
        """Have each process that holds the weights open the handover where it is
        (`staleness.weights.base.opened_handover`: the trainer's GPU buffer, a broadcast's receives) and load from it in
        place, then tag what follows with `handover.version`. The engine never looks inside: what a transport needs is
        its own (`staleness.weights.handover`)."""
        ...

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes cannot be loaded into the model."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def sleep(self, level: int) -> None:
        """Free what the engine holds on its device, paused (a colocated trainer's step is next): its KV cache, and
        its weights, offloaded to host memory (`level` 1) or dropped (2: the next load fills fresh memory). Requests
        kept by `pause("keep")` have their cache recomputed after `wake_up`. Raises `SleepNotSupported`."""
        ...

    async def wake_up(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        """Take back the memory `sleep` freed, the `parts` named; a part awake already is left as it is. A sync wakes
        the weights before its load and the KV cache at its resume, so that the load runs without the cache in
        memory (vLLM's staged wake); an engine that builds its cache as it generates (torch) has no `kv_cache` part
        to take back. After level 2 the weights are undefined until the next load."""
        ...

    async def shutdown(self) -> None: ...


class SharesWeights(Protocol):
    """An engine that can push the version it holds to workers that join mid-run (`consumers.peer`): the peer asks it
    to push, and the push runs where the weights are (the worker's process for torch, vLLM's worker process for
    vLLM). Optional: an engine says so with `shares_weights`, True only while what it holds are the checkpoint's
    values exactly, in checkpoint names (started; vLLM: on a GPU, loading directly, one rank)."""

    @property
    def shares_weights(self) -> bool:
        """Whether it can push the version it holds now."""
        ...

    async def push_weights(self, push: PeerPush, staged: Callable[[], None]) -> BroadcastStats:
        """Push the version it holds, as `push` says (`staleness.weights.nccl.push_from_peer`): its tensors staged and
        the rendezvous listening, it calls `staged()` off the event loop (a blocking call: the peer answers its
        joiners), then broadcasts; returns the broadcast's stats. The weights are only read meanwhile, and generation
        goes on: the caller keeps loads out until it returns."""
        ...


def weights_sharer(engine: object) -> SharesWeights | None:
    """`engine` as a `SharesWeights` if it can push the version it holds now, else None."""
    if getattr(engine, "shares_weights", False) is True and callable(getattr(engine, "push_weights", None)):
        return engine  # type: ignore[return-value]  # checked above: the protocol's two members
    return None


def weights_gpu(engine: object) -> str:
    """The CUDA UUID of the GPU where `engine` holds its weights (its `weights_gpu`), "" for none or not known (an
    engine that does not say): a peer then pushes to it from host copies, which reach any engine."""
    gpu = getattr(engine, "weights_gpu", "")
    return gpu if isinstance(gpu, str) else ""


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


class HandsOverInProcess:
    """The handover half of `Engine` for an engine whose weights live in the worker's own process (torch, synthetic):
    the one copy. The handover is opened on `receiving_device` and its tensors loaded by `load_tensors`."""

    @property
    def receiving_device(self) -> torch.device:
        """Where this engine receives a handover (its weights' device)."""
        raise NotImplementedError

    async def prepare_handover(self, handover: Handover) -> None:
        from staleness.weights.base import prepare_handover  # torch: only a worker that syncs needs it

        await asyncio.to_thread(prepare_handover, handover, 0, self.receiving_device)

    async def load_handover(self, handover: Handover) -> None:
        from staleness.weights.base import load_handover_here

        await load_handover_here(self, handover, self.receiving_device)  # type: ignore[arg-type]  # the engine that mixes this in is one


class ServesNoAdapters:
    """The adapter half of `Engine` for an engine without LoRA support (`max_loras = 0`): the one copy.

    Such an engine's `generate` refuses a request that names an adapter (`refuse_adapter`), so the worker turns it
    into an error rollout that says so."""

    name: str
    max_loras = 0
    # What the engine provides, declared for the type checker only (annotations define no class attribute).
    max_model_len: int
    vocab_size: int

    def adapters(self) -> dict[str, int]:
        return {}

    def _checked_prompt(
        self, prompt_tokens: np.ndarray, sampling: Sampling, adapter: str | None, no_routes: str, no_alternatives: str
    ) -> np.ndarray:
        """The prompt of a request this engine serves, as an array: `EngineInputError` for one under an adapter
        (`refuse_adapter`) or that fails `check_request` (`no_routes`, `no_alternatives`: why it returns neither)."""
        refuse_adapter(self.name, adapter)
        prompt = np.asarray(prompt_tokens)
        check_request(
            prompt, sampling, self.max_model_len, self.vocab_size, no_routes=no_routes, no_alternatives=no_alternatives
        )
        return prompt

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


SEED_MIX = 0x9E3779B97F4A7C15
"""Mixes a seed with a token count into the seed of a continuation (`continuation_seed`)."""


def continuation_seed(seed: int | None, done: int) -> int | None:
    """The seed of a sample's continuation after `done` tokens: a pure function of both, so a seeded sample cut at the
    same point continues the same way, and never with the draws of its first tokens (an engine restarts a seed's
    random stream at a request's first token). `done == 0` keeps the seed: nothing was drawn yet."""
    if seed is None or done == 0:
        return seed
    return (seed * SEED_MIX + done + 1) % ((1 << 63) - MAX_SAMPLES)  # a seed any request takes (`Sampling`)


def continued(sampling: Sampling, done: int) -> Sampling:
    """The sampling of a sample's continuation after `done` tokens (prompt + those tokens, in a new request): the
    `max_tokens` and `min_tokens` left. Its penalties see the tokens so far as prompt: `repetition_penalty` is the
    same, `presence_penalty` and `frequency_penalty` count only what the continuation generates (vLLM's requests know
    no tokens generated before them). A copy, even when nothing was done."""
    left = {"max_tokens": sampling.max_tokens - done, "min_tokens": max(0, sampling.min_tokens - done)}
    return sampling.model_copy(update=left)


def top_k_within(sampling: Sampling, vocab_size: int) -> int:
    """A request's `top_k` as an engine takes it: 0 (off) when it keeps the whole vocabulary anyway, so that no value
    past the vocabulary (an int64 the wire took) reaches vLLM's int32 tensors."""
    return sampling.top_k if sampling.top_k < vocab_size else 0


def refuse_adapter(engine: str, adapter: str | None) -> None:
    """`EngineInputError` for a request under an adapter on an engine that serves none."""
    if adapter is not None:
        raise EngineInputError(f"the {engine} engine serves no LoRA adapters (asked for adapter {adapter!r})")


def engine_logprobs_mode(value: str, engine: str) -> LogprobsMode:
    """An engine's logprobs mode from how it was configured: ours (`raw`, `processed`) or vLLM's own name of it
    (`raw_logprobs`, `processed_logprobs`); `ValueError` for vLLM's logits modes (rollouts carry log-probabilities)."""
    mode = value.removesuffix("_logprobs")
    if mode not in LOGPROBS_MODES:
        raise ValueError(
            f"the {engine} engine's logprobs_mode is {value!r}: rollouts carry log-probabilities, so give raw or "
            "processed (vLLM's raw_logprobs or processed_logprobs)"
        )
    return mode


def refuse_logprobs_mode(engine: str, mode: LogprobsMode, sampling: Sampling) -> None:
    """`EngineInputError` for a request whose `logprobs_mode` is not the one an engine reports for every request (vLLM
    sets it per engine, not per request)."""
    if sampling.logprobs_mode != mode:
        raise EngineInputError(
            f"this {engine} worker reports {mode} logprobs and cannot report {sampling.logprobs_mode} ones (vLLM "
            f"sets logprobs_mode per engine, not per request): submit with logprobs_mode={mode!r}, or serve these "
            f'prompts with workers started with --engine-args \'{{"logprobs_mode": '
            f'"{sampling.logprobs_mode}_logprobs"}}\''
        )


def check_request(
    prompt_tokens: np.ndarray,
    sampling: Sampling,
    max_model_len: int,
    vocab_size: int,
    *,
    no_routes: str | None,
    no_alternatives: str | None = None,
) -> None:
    """The checks every engine makes before it accepts a request, with messages that say what to fix. `no_routes`:
    why this engine cannot return routed experts (`Sampling.routed_experts`), None when it can; `no_alternatives`:
    why it cannot report each token's most likely alternatives (`Sampling.top_logprobs`), None when it can."""
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
    if sampling.routed_experts and no_routes is not None:
        problems.append(f"routed_experts were asked for, but {no_routes}")
    if sampling.top_logprobs > 0 and no_alternatives is not None:
        problems.append(f"top_logprobs={sampling.top_logprobs} alternatives were asked for, but {no_alternatives}")
    elif sampling.top_logprobs > vocab_size:
        problems.append(f"top_logprobs={sampling.top_logprobs} is more than the vocabulary's {vocab_size} tokens")
    if problems:
        raise EngineInputError("; ".join(problems))

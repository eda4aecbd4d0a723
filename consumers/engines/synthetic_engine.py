"""The `synthetic` engine: tokens and logprobs from a seeded generator, at a set pace, with no model.

Soak, chaos and scale runs should measure the pipeline (Redis, the worker loop, the trainer client,
weight syncs), not a model: this engine speaks the whole engine protocol (abort, every pause mode,
loading a version from any transport, per-token version spans) and costs almost no CPU.

How it paces: like a batched engine, it makes one token per running request per step, at
`steps_per_s` steps a second, for up to `max_batch` requests at once (the rest wait). A request's
tokens, logprobs and length are drawn at admission from its seed (`sampling.seed`, else the engine's
own generator), so a seeded request gives the same sample on any worker. Lengths (`lengths`):
`max` (every request runs to `max_tokens`), `pareto:ALPHA` (`min_tokens` times a Pareto draw, the
long tail of reasoning traces) or `uniform:LOW-HIGH`; a request that ends before `max_tokens` ends
with an eos token (`finish_reason=stop`).

Its logprobs are made up, so a prompt's `logprobs_mode` (raw or processed) changes nothing here.

A prompt that holds `poison_token` kills the process that runs it (SIGKILL, as a prompt that crashes a real engine
does: a kernel fault, an out-of-memory kill) once it starts: chaos runs and tests use it to tell poison from bad luck.

Options come through `--engine-args` (JSON): `{"steps_per_s": 100, "lengths": "pareto:1.5", "poison_token": 7}`.
`--model` may name a model directory, whose context, vocabulary and eos it then takes; any other
value (say `synthetic`) gives the defaults below.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from consumers.engines.base import (
    WAKE_ALL,
    EngineClosedError,
    EngineInputError,
    EngineLifecycle,
    Generation,
    HandsOverInProcess,
    ServesNoAdapters,
    WakePart,
)
from consumers.engines.model_files import read_model_limits
from pipeline.wire import PAUSE_MODES, FinishReason, PauseMode, Sampling, Span

if TYPE_CHECKING:
    import torch

    from staleness.weights.handover import Placement

NO_ROUTES = "the synthetic engine runs no model, so it routes nothing: serve these prompts with torch or vllm workers"
NO_ALTERNATIVES = (
    "the synthetic engine runs no model, so it has no distribution to rank: serve these prompts with torch or vllm "
    "workers"
)


@dataclass(eq=False)
class _Run:
    """One request: its whole sample is drawn up front; `done` says how much of it exists yet."""

    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: FinishReason
    done: int = 0
    spans: list[list[int]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    since: float | None = None
    """When the current stretch of generation began (None: frozen or waiting); `done` counts up to it."""

    def made(self, steps_per_s: float) -> int:
        """Tokens that exist now: those accounted, plus the current stretch's so far."""
        running = 0 if self.since is None else int((time.monotonic() - self.since) * steps_per_s)
        return min(len(self.tokens), self.done + running)


class SyntheticEngine(ServesNoAdapters, HandsOverInProcess, EngineLifecycle):
    name = "synthetic"
    weight_receivers = 1
    max_batch_tokens: int | None = None
    """It holds no cache: only `max_batch` bounds what it runs."""

    def __init__(
        self,
        model: str = "synthetic",
        *,
        steps_per_s: float = 200.0,
        lengths: str = "max",
        min_tokens: int = 1,
        max_batch: int = 256,
        vocab_size: int = 32_000,
        max_model_len: int | None = None,
        eos_id: int = 2,
        seed: int | None = None,
        poison_token: int | None = None,
    ) -> None:
        if steps_per_s <= 0:
            raise ValueError(f"steps_per_s must be > 0, got {steps_per_s}")
        self._draw_length = parse_lengths(lengths, min_tokens)
        self.steps_per_s = float(steps_per_s)
        self.max_batch = max_batch
        self.version = 0
        self.generated_tokens = 0
        model_dir = Path(model)
        if (model_dir / "config.json").is_file():
            limits = read_model_limits(model_dir, max_model_len)
            self.vocab_size, self.max_model_len = limits.vocab_size, limits.max_model_len
            self.eos_id = min(limits.eos_ids) if limits.eos_ids else eos_id
        else:
            self.vocab_size, self.max_model_len, self.eos_id = vocab_size, max_model_len or 4096, eos_id
        self._seeds = random.Random(seed)
        self.poison_token = poison_token
        self._runs: dict[str, _Run] = {}
        self._slots: asyncio.Semaphore | None = None
        self._serving = asyncio.Event()
        self.asleep = 0
        """The level of the `sleep` it was put in (it frees nothing); 0: awake."""
        self._asleep_parts: set[WakePart] = set()
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.max_batch)
        self._serving.set()

    async def shutdown(self) -> None:
        self._closed = True
        await self.abort(list(self._runs))

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling, adapter: str | None = None
    ) -> Generation:
        prompt = self._checked_prompt(prompt_tokens, sampling, adapter, NO_ROUTES, NO_ALTERNATIVES)
        if self._closed:
            raise EngineClosedError("the engine was shut down")
        if request_id in self._runs:
            raise EngineInputError(f"request id {request_id!r} is already in flight on this engine")
        if self._slots is None:
            await self.start()
        assert self._slots is not None  # start() made them
        run = self._draw(sampling, room=self.max_model_len - len(prompt))
        self._runs[request_id] = run
        try:
            async with self._slots:
                if self.poison_token is not None and self.poison_token in prompt:
                    os.kill(os.getpid(), signal.SIGKILL)
                await self._advance(run)
        finally:
            del self._runs[request_id]
        n = run.done
        reason: FinishReason = "abort" if run.aborted and n < len(run.tokens) else run.finish_reason
        spans: list[Span] = [(v, s, e) for v, s, e in run.spans]
        self.generated_tokens += n
        return Generation(run.tokens[:n].copy(), run.logprobs[:n].copy(), reason, spans)

    def _draw(self, sampling: Sampling, room: int) -> _Run:
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        rng = np.random.default_rng(seed)
        limit = min(sampling.max_tokens, room)
        length = max(1, min(limit, max(self._draw_length(rng, limit), sampling.min_tokens + 1)))  # eos after min_tokens
        stops = {self.eos_id, *sampling.stop_token_ids}
        tokens = rng.integers(0, self.vocab_size, size=length, dtype=np.int32)
        while stops and (hit := np.isin(tokens, list(stops))).any():  # no early stop token by chance
            tokens[hit] = rng.integers(0, self.vocab_size, size=int(hit.sum()), dtype=np.int32)
        finish: FinishReason = "length"
        if length < limit:
            tokens[-1], finish = self.eos_id, "stop"
        logprobs = -rng.exponential(1.0, size=length).astype(np.float32)
        return _Run(tokens=tokens, logprobs=logprobs, finish_reason=finish)

    async def _advance(self, run: _Run) -> None:
        """Let the run's tokens appear at the engine's pace, under whatever version is loaded meanwhile."""
        while run.done < len(run.tokens) and not run.aborted:
            await self._serving.wait()  # a `keep` pause freezes the run here
            if run.aborted:
                return
            run.since, version = time.monotonic(), self.version
            run.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.wake.wait(), (len(run.tokens) - run.done) / self.steps_per_s)
            made = run.made(self.steps_per_s) - run.done
            run.since = None
            if made > 0:
                self._extend(run, version, made)

    @staticmethod
    def _extend(run: _Run, version: int, made: int) -> None:
        if run.spans and run.spans[-1][0] == version:
            run.spans[-1][2] += made
        else:
            run.spans.append([version, run.done, run.done + made])
        run.done += made

    def tokens_so_far(self, request_id: str) -> int:
        """How many tokens of an in-flight request exist now (0 for one not in flight)."""
        run = self._runs.get(request_id)
        return run.made(self.steps_per_s) if run is not None else 0

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            run = self._runs.get(request_id)
            if run is not None:
                run.aborted = True
                run.wake.set()

    async def pause(self, mode: PauseMode) -> None:
        """`abort`: every request in flight ends now with its tokens so far. `keep` and `inflight`: they freeze in
        place (there is no cache to keep or recompute: both continue alike, each token tagged with its version)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        self._serving.clear()
        for run in self._runs.values():
            run.aborted = run.aborted or mode == "abort"
            run.wake.set()  # account the tokens made so far under the version they were made with
        await asyncio.sleep(0)

    async def resume(self) -> None:
        self._serving.set()

    async def sleep(self, level: int) -> None:
        """Nothing to free (it holds no weights or cache): the level is kept, for the tests of the protocol."""
        self.asleep = level
        self._asleep_parts = set(WAKE_ALL)

    async def wake_up(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        """Awake once both parts are (`asleep` stays the level until then, as a staged wake leaves vLLM half asleep)."""
        self._asleep_parts.difference_update(parts)
        if not self._asleep_parts:
            self.asleep = 0

    # -- weights: nothing to load, but every path is followed and the version is tagged ----------

    async def load_weights(self, path: str, version: int) -> None:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {path}")
        self.version = version

    async def load_tensors(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        for _ in named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors:
            pass
        self.version = version

    @property
    def placement(self) -> Placement:
        """In the worker's process, on no device: a handover is received on the CPU and dropped."""
        from staleness.weights.handover import Placement

        return Placement(self.name, "worker")

    @property
    def receiving_device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Any weights fit: there is no model."""

    def weight_layout(self) -> None:
        """None: there is no model, so any weights fit."""

    async def reset_prefix_cache(self) -> None:
        """No cache."""


def parse_lengths(spec: str, min_tokens: int) -> Any:
    """`max`, `pareto:ALPHA` or `uniform:LOW-HIGH` to a function (rng, max_tokens) -> length."""
    kind, _, arg = spec.partition(":")
    try:
        if kind == "max" and not arg:
            return lambda rng, limit: limit
        if kind == "pareto":
            alpha = float(arg)
            if alpha > 0:
                return lambda rng, limit: round(min_tokens * (1 + rng.pareto(alpha)))
        if kind == "uniform":
            low, high = (int(x) for x in arg.split("-"))
            if 1 <= low <= high:
                return lambda rng, limit: int(rng.integers(low, high + 1))
    except ValueError:
        pass
    raise ValueError(f"lengths {spec!r}: use max, pareto:ALPHA (ALPHA > 0) or uniform:LOW-HIGH (1 <= LOW <= HIGH)")

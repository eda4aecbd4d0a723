"""One sample on a worker's engine, and the rest of one that a pause interrupted.

`SampleGenerator.generate` runs one sample of a prompt, or the rest of one (a `Partial`: what an earlier worker, or
this one before an `abort` pause, generated of it). An `abort` pause ends it early: unless the worker hands its
interrupted samples off (`hand_off_partials`) or stops, it waits for the resume and continues the sample here from
its tokens so far, nothing of it crossing Redis; otherwise the `Partial` goes to `{ns}:partials` with the entry's ack,
for another worker. A continuation draws with a seed of its own (`continuation_seed`), and the pieces' tokens,
logprobs, version spans and alternatives are joined into one sample.
"""

from __future__ import annotations

import time

import numpy as np

from consumers.adapters import Stopping, WorkerAdapters
from consumers.engines.base import EngineInputError, Generation, continuation_seed, continued
from consumers.house import House
from pipeline.streams import Entry
from pipeline.wire import Partial, Prompt, Rollout, join_spans

EMPTY_TOKENS = np.zeros(0, dtype=np.int32)
EMPTY_LOGPROBS = np.zeros(0, dtype=np.float32)


def untouched(prompt: Prompt, sample: int) -> Partial:
    """A sample of `prompt` nothing has been generated of yet: a partial that another worker starts from scratch."""
    return Partial(prompt=prompt, sample=sample, generated=EMPTY_TOKENS, logprobs=EMPTY_LOGPROBS, spans=[])


def join_alternatives(
    done: Partial | None, generation: Generation, n_tokens: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The alternatives of a whole sample (`Rollout.top_token_ids`, `top_logprobs`): those of its tokens before a
    pause (`done`), then the engine's of the rest. None, None unless every part with tokens has them, with one k."""
    parts = []
    if done is not None and len(done.generated):
        parts.append((done.top_token_ids, done.top_logprobs))
    if len(generation.tokens):
        parts.append((generation.top_token_ids, generation.top_logprobs))
    ids = [p[0] for p in parts if p[0] is not None and p[1] is not None]
    logprobs = [p[1] for p in parts if p[0] is not None and p[1] is not None]
    if not n_tokens or len(ids) != len(parts) or len({a.shape[1] for a in ids}) != 1:
        return None, None
    return np.concatenate(ids), np.concatenate(logprobs)


class SampleGenerator:
    """Generates a worker's samples on its engine (the slot's engine now), continuing those a pause interrupted."""

    def __init__(self, house: House, adapters: WorkerAdapters) -> None:
        self._name, self._slot, self._state, self._metrics = house.name, house.slot, house.state, house.metrics
        self._adapters = adapters
        self._hand_off_partials = house.settings.hand_off_partials
        self._running: set[str] = set()
        """The engine requests of this worker's samples now running (what a deadline's hand-off ends)."""

    async def end_running(self) -> int:
        """End every sample now running on the engine with its tokens so far (each `generate` returns a `Partial`
        once the worker stops); returns how many were asked to end."""
        running = list(self._running)
        if running:
            await self._slot.engine.abort(running)
        return len(running)

    async def generate(self, prompt: Prompt, sample: int, entry: Entry, done: Partial | None) -> Rollout | Partial:
        """One sample, or the rest of one (`done`: what an earlier worker generated before a pause).

        An `abort` pause ends it early. Unless the worker hands its interrupted samples off (`hand_off_partials`) or
        stops, it waits for the resume and continues it here from the tokens so far: nothing of it crosses Redis."""
        while True:
            result = await self.rest(prompt, sample, entry, done)
            if isinstance(result, Rollout) or self._hand_off_partials:
                return result
            await self._state.serving.wait()  # the sync's resume, or a stop (which sets it too)
            if self._state.stopping.is_set():
                return result  # published to `{ns}:partials` with the entry's ack: another worker continues it
            done = result

    async def rest(self, prompt: Prompt, sample: int, entry: Entry, done: Partial | None) -> Rollout | Partial:
        """Generate one sample, or the rest of `done`: a Rollout, or a Partial if a pause aborted it."""
        so_far = done.generated if done is not None else np.zeros(0, dtype=np.int32)
        sampling = continued(prompt.sampling, len(so_far))
        if sampling.seed is not None:  # a continuation's own: the engine draws from the seed's start again
            sampling.seed = continuation_seed(sampling.seed + sample, len(so_far))
        started = time.time()
        version = self._slot.engine.version
        error = None
        if done is not None and len(prompt.tokens) + len(so_far) >= self._slot.engine.max_model_len:
            generation = Generation(EMPTY_TOKENS, EMPTY_LOGPROBS, "length", [])  # the context is full already
        else:
            try:
                # Keyed by entry, not prompt id: a resubmitted prompt id may be in flight here twice.
                request_id = f"{prompt.id}@{entry.id.decode()}:{sample}"
                tokens = np.concatenate([prompt.tokens, so_far])
                self._running.add(request_id)
                try:
                    if prompt.adapter is None:
                        generation = await self._slot.engine.generate(request_id, tokens, sampling)
                    else:
                        async with self._adapters.using(prompt.adapter) as version:
                            generation = await self._slot.engine.generate(
                                request_id, tokens, sampling, prompt.adapter
                            )
                finally:
                    self._running.discard(request_id)
            except Stopping:  # it waited for its adapter: it goes on elsewhere, from its tokens so far
                generation = Generation(EMPTY_TOKENS, EMPTY_LOGPROBS, "abort", [])
            except EngineInputError as exc:
                error = str(exc)
                generation = Generation(EMPTY_TOKENS, EMPTY_LOGPROBS, "error", [])
        self._state.generated_tokens += len(generation.tokens)
        self._metrics.generated(time.time() - started, len(generation.tokens), generation.finish_reason)
        new_spans = generation.spans or [(version, 0, len(generation.tokens))]
        tokens = np.concatenate([so_far, generation.tokens])
        logprobs = np.concatenate([done.logprobs, generation.logprobs]) if done is not None else generation.logprobs
        spans = join_spans(done.spans if done is not None else [], new_spans, len(so_far))
        top_ids, top_logprobs = join_alternatives(done, generation, len(tokens))
        if generation.finish_reason == "abort":  # only a pause aborts: the sample goes on after the resume
            return Partial(
                prompt=prompt,
                sample=sample,
                generated=tokens,
                logprobs=logprobs,
                spans=spans,
                top_token_ids=top_ids,
                top_logprobs=top_logprobs,
            )
        finished = time.time()
        return Rollout(
            prompt_id=prompt.id,
            sample=sample,
            n=prompt.n,
            version=spans[0][0] if spans else version,
            version_end=spans[-1][0] if spans else version,
            finish_reason=generation.finish_reason,
            worker=self._name,
            prompt_tokens=prompt.tokens,
            tokens=tokens,
            logprobs=logprobs,
            spans=spans,
            meta=prompt.meta,
            timing={"queued_s": max(0.0, started - prompt.ts), "generate_s": finished - started, "finished": finished},
            error=error,
            reward_fn=prompt.reward_fn,
            cached_tokens=generation.cached_tokens,
            adapter=prompt.adapter,
            routed_experts=generation.routed_experts if len(tokens) else None,
            top_token_ids=top_ids,
            top_logprobs=top_logprobs,
        )

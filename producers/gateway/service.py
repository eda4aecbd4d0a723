"""What one gateway call does, apart from HTTP: check, place, queue, wait, answer, extend the session.

A call becomes one prompt on the queue with `reply_to` naming this replica: a session's turn in its
worker's inbox (`{ns}:inbox:{worker}`), a call without a session on `{ns}:prompts` (any worker). The
ordinary workers serve it; the rollouts come back on this replica's reply stream. Nothing is queued
for a call that fails its checks, and a call made while the policy is paused for a weight sync waits
for the resume before it is queued (so it never runs on half-loaded weights). A sync that lands while
a turn is in flight does not reach the caller: the worker continues the turn after the sync (abort →
partial → continue, or keep), and the answer's `spans` show both versions.

`model` picks the policy, as on vLLM's own server with LoRA modules: the served model name is the base model, and
the name of a LoRA adapter published in the namespace (`{ns}:adapters`) is that adapter; `/v1/models` lists both.
A session stays on the model of its first turn, and its finished trajectory is a rollout of that adapter.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pipeline.streams import Streams
from pipeline.wire import NAME_PATTERN, PauseMode, Prompt, Rollout, Sampling
from producers.gateway.answers import Call, Reply, answer, apply_stops
from producers.gateway.chat import ChatRenderer, TemplateError
from producers.gateway.metrics import GatewayMetrics
from producers.gateway.openai_api import ChatRequest, CompletionRequest, FinishRequest, OpenAIError
from producers.gateway.placement import Placement, candidates, place
from producers.gateway.replies import Replies
from producers.gateway.rl_control import WeightUpdates, read_hold
from producers.gateway.sampling import Ask, ask_of, check_chat_logprobs, check_logprobs, check_sampling
from producers.gateway.sessions import Session, SessionStore, Trajectory
from producers.gateway.vllm_api import GenerateRequest, TokenizeRequest, generate_answer
from staleness.state import adapter_names, read_state

T = TypeVar("T")


@dataclass
class GatewaySettings:
    served_model_name: str
    name: str
    """This replica's name: its reply stream is `{ns}:replies:{name}`."""
    placement: Placement = "sticky"
    session_ttl_s: float = 600.0
    """A session idle this long is released: its pin and its unfinished trajectory expire."""
    pause_timeout_s: float = 60.0
    """How long a call made during a weight sync waits for the resume before a 503."""
    request_timeout_s: float = 600.0
    """How long a queued call waits for its answer before a 504."""
    max_model_len: int | None = None
    """Longest prompt + reply; None: the smallest that the live workers' heartbeats report."""
    poll_s: float = 0.05
    threads: int = 64
    """Redis calls in flight at once (each on a thread)."""
    rl_control: bool = False
    """Serve vLLM's RL control routes (`/pause`, `/resume`, the weight-transfer routes): `--rl-control`."""
    rl_pause_ttl_s: float = 600.0
    """A `POST /pause` not resumed within this long is lifted (its caller died)."""
    weights_transport: str = "redis://"
    """How the weight-transfer routes publish (`init_info.transport` may name another)."""
    weights_mode: PauseMode = "abort"
    """The pause mode of a weight update finished with no `POST /pause` in force."""
    model_dir: Path | None = None
    """The served model's directory: the weight routes check tensor names and shapes against its checkpoint."""


class Gateway:
    def __init__(self, streams: Streams, renderer: ChatRenderer, settings: GatewaySettings) -> None:
        self.streams = streams
        self.renderer = renderer
        self.settings = settings
        self.sessions = SessionStore(streams, settings.session_ttl_s, busy_timeout_s=settings.request_timeout_s + 30)
        self.replies = Replies(streams.replies, settings.name)
        self.metrics = GatewayMetrics(streams.keys.ns, settings.name)
        self.weights = WeightUpdates(streams, settings.name, settings.weights_transport, settings.model_dir)

    async def start(self) -> None:
        # Every Redis call runs on a thread (the stream layer is synchronous), one of them always blocked on the
        # reply stream: asyncio's default pool (cores + 4) would queue concurrent calls behind each other.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(self.settings.threads, "gateway"))
        await asyncio.to_thread(self.streams.ensure_groups)
        self.replies.start()

    async def stop(self) -> None:
        await self.replies.stop()

    async def models(self) -> dict[str, Any]:
        """The base model and every LoRA adapter published in the namespace (its `parent` the base model)."""
        base = self.settings.served_model_name
        adapters = await asyncio.to_thread(adapter_names, self.streams.redis, self.streams.keys)
        live = await asyncio.to_thread(self.streams.registry.live_workers)
        try:
            limit: int | None = self._max_model_len(live)
        except OpenAIError:  # no worker yet: the context is not known
            limit = None
        model = {"object": "model", "created": 0, "owned_by": "rollout-streams", "max_model_len": limit}
        data = [{"id": base, **model, "root": base}] + [
            {"id": a, **model, "root": base, "parent": base} for a in adapters
        ]
        return {"object": "list", "data": data}

    # -- the endpoints -------------------------------------------------------------------------------

    async def chat(self, request: ChatRequest, session_id: str | None) -> dict[str, Any]:
        adapter = await self._adapter_of(request.model)
        ask = ask_of(request, request.completion_limit(), check_chat_logprobs(request.logprobs, request.top_logprobs))
        _check_session(session_id, ask.n)
        messages = [m.for_template() for m in request.messages]
        if messages[-1]["role"] == "assistant":
            raise OpenAIError(400, "the last message is the assistant's: nothing to answer", param="messages")
        call = f"chatcmpl-{uuid.uuid4().hex}"
        session = await self._begin(session_id, call, adapter)
        try:
            if session is not None and session.turns:
                prompt, between = self._continue_chat(session, messages, request.tools)
            else:
                prompt, between = np.asarray(self._render(messages, request.tools), np.int32), []
            [replies] = await self._generate([prompt], ask, session, adapter)
            if session is not None:
                session.messages = [*messages, {"role": "assistant", "content": replies[0].text}]
                await self._extend(session, call, prompt, between, replies[0])
        except BaseException:
            if session is not None:
                await asyncio.to_thread(self.sessions.release, session.id, call)
            raise
        asked = Call(call, request.model, [prompt], request.logprobs, request.return_token_ids, session_id)
        asked.ids_as_tokens = request.return_tokens_as_token_ids
        asked.top_logprobs = ask.top_logprobs
        return answer(asked, [replies], self.renderer, chat=True)

    async def complete(self, request: CompletionRequest, session_id: str | None) -> dict[str, Any]:
        adapter = await self._adapter_of(request.model)
        logprobs = check_logprobs(request.logprobs, "logprobs")
        ask = ask_of(request, request.max_tokens, logprobs or 0)
        _check_session(session_id, ask.n)
        batch = request.prompts()
        if session_id is not None and len(batch) > 1:
            raise OpenAIError(400, "a session's turn has one prompt: send a batch without X-Session-ID", param="prompt")
        call = f"cmpl-{uuid.uuid4().hex}"
        session = await self._begin(session_id, call, adapter)
        try:
            if session is not None:
                prompt, between = self._completion_prompt(batch[0], session)
                prompts = [prompt]
            else:
                prompts = [self._completion_prompt(p, None)[0] for p in batch]
            replies = await self._generate(prompts, ask, session, adapter)
            if session is not None:
                await self._extend(session, call, prompt, between, replies[0][0])
        except BaseException:
            if session is not None:
                await asyncio.to_thread(self.sessions.release, session.id, call)
            raise
        asked = Call(call, request.model, prompts, logprobs is not None, request.return_token_ids, session_id)
        asked.ids_as_tokens = request.return_tokens_as_token_ids
        asked.top_logprobs = ask.top_logprobs
        return answer(asked, replies, self.renderer, chat=False)

    async def generate_tokens(self, request: GenerateRequest, session_id: str | None) -> dict[str, Any]:
        """vLLM's `POST /inference/v1/generate`: token ids in, token ids (and their logprobs, versions) out. A session
        here is routing only: its calls go to the worker it is pinned to, and no trajectory is kept (the caller
        assembles its own); `POST /finish_session` releases the pin."""
        adapter = await self._adapter_of(request.model) if request.model else None
        ask, logprobs = request.ask()
        session = None
        if session_id is not None:
            _check_session(session_id, 1)
            session = Session(id=session_id, routing_only=True)
        prompt = np.asarray(request.token_ids, np.int32)
        [replies] = await self._generate([prompt], ask, session, adapter)
        return generate_answer(request, self.served_name(adapter), prompt, replies, ask, logprobs, self.renderer)

    def served_name(self, adapter: str | None) -> str:
        return adapter or self.settings.served_model_name

    async def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        """vLLM's `/tokenize`: a text prompt, or chat messages through the template."""
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError(400, "send one of prompt (text) or messages", param="prompt")
        if request.messages is not None:
            text = self.renderer.render(request.messages, None, prompt=request.add_generation_prompt)
            ids = self.renderer.encode(text)
        else:
            assert request.prompt is not None
            ids = list(self.renderer.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
        live = await self.live_workers()
        try:
            limit: int | None = self._max_model_len(live)
        except OpenAIError:
            limit = None
        strs = [self.renderer.token_text(t) for t in ids] if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}

    async def live_workers(self) -> dict[str, dict[str, str]]:
        return await asyncio.to_thread(self.streams.registry.live_workers)

    def serving(self, live: dict[str, dict[str, str]]) -> dict[str, int]:
        """The workers of `live` that take calls (placement's `candidates`, with their samples in flight); the 503
        `no_worker` when none does: what a call meets then, and what `GET /health` answers until a worker serves."""
        workers = candidates(live)
        if not workers:
            raise no_worker(self.streams.keys.ns)
        return workers

    async def is_paused(self) -> bool:
        return await asyncio.to_thread(self._paused, None) is not None

    async def policy_version(self) -> int:
        return (await asyncio.to_thread(read_state, self.streams.redis, self.streams.keys)).version

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """A blocking (Redis) call, off the event loop."""
        return await asyncio.to_thread(fn, *args)

    async def finish_session(self, session_id: str) -> bool:
        """Release a session's pin (SkyRL's `/finish_session`, best effort): its worker no longer counts it."""
        _check_session_id(session_id)
        return await asyncio.to_thread(self.sessions.release_pin, session_id)

    async def finish(self, session_id: str, request: FinishRequest) -> dict[str, Any]:
        _check_session_id(session_id)
        rollout = await asyncio.to_thread(self.sessions.finish, session_id, request)
        self.metrics.finished.inc()
        return {
            "id": rollout.id,
            "object": "session.finished",
            "session_id": session_id,
            "group": rollout.prompt_id,
            "sample": rollout.sample,
            "group_size": rollout.n,
            "turns": rollout.meta.get("turns"),
            "prompt_tokens": len(rollout.prompt_tokens),
            "tokens": rollout.n_tokens,
            "model_tokens": int(rollout.model_token_mask().sum()),
            "reward": rollout.reward,
        }

    # -- checks ---------------------------------------------------------------------------------------

    async def _adapter_of(self, model: str) -> str | None:
        """The LoRA adapter a call's `model` names (None: the base model); 404 for a model not served."""
        if model == self.settings.served_model_name:
            return None
        adapters = await asyncio.to_thread(adapter_names, self.streams.redis, self.streams.keys)
        if model not in adapters:
            served = ", ".join(f"`{m}`" for m in [self.settings.served_model_name, *adapters])
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this gateway serves {served}",
                code="model_not_found",
                param="model",
            )
        return model

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        try:
            return self.renderer.first_prompt(messages, tools)
        except TemplateError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None

    def _continue_chat(
        self, session: Session, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[np.ndarray, list[int]]:
        """The next turn's prompt: the session's exact tokens, then the template's tokens of the new messages."""
        known = session.messages
        if len(messages) <= len(known) or messages[: len(known)] != known:
            raise OpenAIError(
                400,
                f"session {session.id!r}: the messages must repeat the session's {len(known)} messages so far "
                "(the last one the assistant's reply, as it was given) and add new ones after them",
                code="session_history_mismatch",
                param="messages",
            )
        assert session.trajectory is not None
        try:
            between = self.renderer.next_turn(known, messages[len(known) :], tools, session.last_stop)
        except TemplateError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        return np.concatenate([session.trajectory.context(), np.asarray(between, np.int32)]), between

    def _completion_prompt(self, prompt: str | list[int], session: Session | None) -> tuple[np.ndarray, list[int]]:
        """Token ids (as given, or the text's); a session's turn must extend the session's tokens."""
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            raise OpenAIError(400, "prompt token ids must be >= 0", param="prompt")
        if session is None or not session.turns:
            ids = prompt if isinstance(prompt, list) else self.renderer.encode(prompt)
            return np.asarray(ids, np.int32), []
        assert session.trajectory is not None
        context = session.trajectory.context()
        if isinstance(prompt, list):
            if len(prompt) <= len(context) or not np.array_equal(prompt[: len(context)], context):
                raise OpenAIError(
                    400,
                    "a session's prompt must start with the session's tokens so far",
                    code="session_history_mismatch",
                )
            between = list(prompt[len(context) :])
        else:
            so_far = self.renderer.decode(context)
            if len(prompt) <= len(so_far) or not prompt.startswith(so_far):
                raise OpenAIError(
                    400, "a session's prompt must start with the session's text so far", code="session_history_mismatch"
                )
            between = self.renderer.encode(prompt[len(so_far) :])
        return np.concatenate([context, np.asarray(between, np.int32)]), between

    def _max_model_len(self, workers: dict[str, dict[str, str]]) -> int:
        """The context a call may use: `--max-model-len`, or the smallest that the live workers report."""
        limits = [self.settings.max_model_len] if self.settings.max_model_len else []
        limits += [int(w["max_model_len"]) for w in workers.values() if w.get("max_model_len", "").isdigit()]
        if not limits:
            raise no_worker(self.streams.keys.ns)
        return min(limits)

    # -- one turn through the queue ---------------------------------------------------------------------

    async def _begin(self, session_id: str | None, call: str, adapter: str | None) -> Session | None:
        if session_id is None:
            return None
        return await asyncio.to_thread(self.sessions.begin, session_id, call, adapter)

    async def _generate(
        self, prompts: list[np.ndarray], ask: Ask, session: Session | None, adapter: str | None = None
    ) -> list[list[Reply]]:
        """Queue each prompt (`ask.n` samples) and wait for their rollouts; the replies per prompt, in sample order.
        Nothing is queued unless every prompt fits the context."""
        live = await asyncio.to_thread(self.streams.registry.live_workers)  # one read for the limit and the placement
        limit = self._max_model_len(live)
        items = [
            self._item(prompt, self._room(prompt, ask.max_tokens, limit), ask, session, adapter) for prompt in prompts
        ]
        await self._wait_unpaused(None)
        if adapter is not None:
            await self._wait_unpaused(adapter)
        batches = await asyncio.gather(*(self._run(item, session, live) for item in items))
        errors = [r.error for rollouts in batches for r in rollouts if r.finish_reason == "error"]
        if errors:
            raise OpenAIError(400, f"the engine refused this request: {errors[0]}", code="engine_refused")
        for prompt, rollouts in zip(prompts, batches, strict=True):
            self.metrics.prompt_tokens.inc(len(prompt))
            self.metrics.cached_tokens.inc(rollouts[0].cached_tokens or 0)
        if session is not None:
            session.workers.append(batches[0][0].worker)
            session.cached_tokens += batches[0][0].cached_tokens or 0
        return [[apply_stops(r, ask.stops, self.renderer, ask.min_tokens) for r in rollouts] for rollouts in batches]

    def _room(self, prompt: np.ndarray, max_tokens: int | None, limit: int) -> int:
        """The completion's length (`max_tokens`, or the rest of the context); 400 when the prompt does not fit."""
        room = limit - len(prompt)
        wanted = max_tokens if max_tokens is not None else room
        if room < 1 or wanted > room:
            asked = f"{len(prompt) + wanted} tokens ({len(prompt)} in the messages, {wanted} in the completion)"
            if room < 1:
                asked = f"{len(prompt)} tokens in the messages alone"
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested {asked}. "
                "Please reduce the length of the messages or completion.",
                code="context_length_exceeded",
                param="messages",
            )
        return wanted

    def _item(
        self, prompt: np.ndarray, max_tokens: int, ask: Ask, session: Session | None, adapter: str | None
    ) -> Prompt:
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if ask.temperature is None else ask.temperature,
            top_p=1.0 if ask.top_p is None else ask.top_p,
            stop_token_ids=ask.stop_token_ids,
            seed=ask.seed,
            logprobs_mode=ask.logprobs_mode,
            top_logprobs=ask.top_logprobs,
            **ask.knobs,
        )
        check_sampling(sampling, ask.where)  # `min_tokens` against the rest of the context, when that is the limit
        return Prompt(
            id=f"turn-{uuid.uuid4().hex}",
            n=ask.n,
            tokens=prompt,
            sampling=sampling,
            meta={"gateway": self.settings.name, "session": session.id if session else None},
            reply_to=self.settings.name,
            adapter=adapter,
        )

    async def _run(self, item: Prompt, session: Session | None, live: dict[str, dict[str, str]]) -> list[Rollout]:
        """Queue one prompt and wait for its `n` rollouts (a 504 after `request_timeout_s`)."""
        future = self.replies.expect(item.id, item.n)
        try:
            worker = await self._queue(item, session, live)
            try:
                with self.metrics.wait("answer").track_inprogress():
                    return await asyncio.wait_for(future, self.settings.request_timeout_s)
            except TimeoutError:
                raise OpenAIError(
                    504,
                    f"no answer within {self.settings.request_timeout_s:g} s (queued for "
                    f"{worker or 'any worker'}); are workers running (`rollouts top`)?",
                    "timeout",
                    "no_answer",
                ) from None
        finally:
            self.replies.forget(item.id)

    async def _wait_unpaused(self, adapter: str | None) -> None:
        """Queue nothing while a weight sync (of the base model, or of the call's adapter) is under way, or while a
        caller holds the gateway paused (`POST /pause`); give up with a 503 after `pause_timeout_s`."""
        reason = await asyncio.to_thread(self._paused, adapter)
        if reason is None:
            return
        deadline = time.monotonic() + self.settings.pause_timeout_s
        with self.metrics.wait("resume").track_inprogress():
            while reason is not None:
                if time.monotonic() > deadline:
                    raise OpenAIError(
                        503,
                        f"{reason} and did not resume within {self.settings.pause_timeout_s:g} s; retry later",
                        "service_unavailable",
                        "policy_paused",
                    )
                await asyncio.sleep(self.settings.poll_s)
                reason = await asyncio.to_thread(self._paused, adapter)

    def _paused(self, adapter: str | None) -> str | None:
        """Why calls wait now (None: they need not). Blocking."""
        state = read_state(self.streams.redis, self.streams.keys, adapter)
        if state.paused:
            return f"the policy is paused for a weight sync (version {state.version} -> {state.pending_version})"
        hold = read_hold(self.streams) if adapter is None else None
        if hold is not None:
            return f"the gateway is paused by POST /pause (mode {hold.mode}, by {hold.by})"
        return None

    async def _queue(self, item: Prompt, session: Session | None, live: dict[str, dict[str, str]]) -> str | None:
        """A session's turn to its worker's inbox; a call without one to the shared prompts (any worker)."""
        workers = self.serving(live)
        if session is None:
            await asyncio.to_thread(self.streams.writer.add_prompts, [item])
            return None
        worker = await asyncio.to_thread(place, self.settings.placement, self.sessions, session.id, workers)
        if session.routing_only:  # no turn marks it: its pin's hash expires when idle all the same
            await asyncio.to_thread(self.sessions.touch, session.id)
        session.worker = worker
        await asyncio.to_thread(self.streams.writer.add_to_inbox, worker, item)
        return worker

    async def _extend(self, session: Session, call: str, prompt: np.ndarray, between: list[int], reply: Reply) -> None:
        """Add the turn to the session's trajectory and write it back (if this call still holds the session)."""
        if session.trajectory is None:
            session.trajectory = Trajectory(prompt_tokens=prompt)
        session.trajectory.add_turn(between, reply.rollout)
        session.turns += 1
        session.last_stop = reply.stop_token
        session.finish_reason = reply.rollout.finish_reason
        served = reply.rollout.worker
        if served and served != session.worker:  # its worker died: the turn ran elsewhere, and the session moves
            await asyncio.to_thread(self.sessions.place, session.id, served)
            session.worker = served
        await asyncio.to_thread(self.sessions.commit, session, call)


def no_worker(ns: str) -> OpenAIError:
    """The 503 `no_worker`: no worker serves the namespace (none has started, or every heartbeat expired)."""
    return OpenAIError(
        503, f"no worker serves namespace {ns} (start `rollouts worker --ns {ns}`)", "service_unavailable", "no_worker"
    )


def _check_session(session_id: str | None, n: int) -> None:
    if session_id is not None:
        _check_session_id(session_id)
        if n != 1:
            raise OpenAIError(400, "a session's turn has one reply: n must be 1 with X-Session-ID", param="n")


def _check_session_id(session_id: str) -> None:
    if not re.match(NAME_PATTERN, session_id):
        raise OpenAIError(
            400, f"X-Session-ID {session_id[:64]!r} must be 1-128 of A-Z a-z 0-9 _ . @ -", param="X-Session-ID"
        )

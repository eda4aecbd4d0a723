"""Sessions: the pin to a worker and the trajectory so far, kept in Redis so that every gateway replica agrees.

One hash per session, `{ns}:session:{id}`, readable in `redis-cli` like the streams (scalars as text,
token ids and logprobs as raw little-endian arrays, ranges as JSON):

- `worker`: the pin; `turns`; `messages` (JSON, the conversation with the replies given); `created`, `ts`;
- the trajectory: `prompt_tokens` (the first turn's prompt), `tokens` (all that followed: the model's
  replies and, between them, the template's, tools' and user's tokens), `logprobs`, `spans`, `mask`
  (the ranges the model wrote), `last_stop` (the stop token that ended the last reply, if one did);
- `busy`/`busy_ts`: the call whose turn is in flight (one turn at a time); `sample` once finished.

The hash expires after the idle TTL; each turn renews it. Pins live in `{ns}:pins:{worker}` sorted sets
scored by expiry, so an idle session stops counting against its worker's load by itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from pipeline.codec import FLOAT32, INT32, as_fields, encode_float32, encode_int32
from pipeline.lua import register_all
from pipeline.streams import Streams
from pipeline.wire import Rollout, Span, join_spans
from producers.gateway.openai_api import FinishRequest, OpenAIError
from staleness.admission import Admission
from staleness.state import read_state

SCRIPTS = Path(__file__).with_name("lua")
"""`pin.lua` (sticky least-loaded placement) and `join_group.lua` (a finished session's sample index)."""
FINISHED_TTL_S = 3600
"""How long a finished session answers a retried finish with the same result."""


@dataclass
class Trajectory:
    """A session's tokens so far: the first prompt, then replies and what came between them."""

    prompt_tokens: np.ndarray
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    spans: list[Span] = field(default_factory=list)
    mask: list[tuple[int, int]] = field(default_factory=list)

    def context(self) -> np.ndarray:
        """Every token so far: the next turn's prompt starts with exactly these."""
        return np.concatenate([self.prompt_tokens, self.tokens]).astype(np.int32)

    def add_turn(self, between: list[int], reply: Rollout) -> None:
        """Append the tokens before a reply (not the model's: masked out, logprob 0) and the reply itself.

        The tokens between carry the version of the reply before them (the first turn has none), so that
        `spans` keep covering every token; the mask says which tokens count.
        """
        version = self.spans[-1][0] if self.spans else reply.version
        offset = len(self.tokens)
        seam = [(version, 0, len(between))] if between else []
        self.spans = join_spans(self.spans, seam, offset)
        start = offset + len(between)
        self.spans = join_spans(self.spans, list(reply.spans), start)
        if len(reply.tokens):
            self.mask.append((start, start + len(reply.tokens)))
        self.tokens = np.concatenate([self.tokens, np.asarray(between, np.int32), reply.tokens]).astype(np.int32)
        self.logprobs = np.concatenate([self.logprobs, np.zeros(len(between), np.float32), reply.logprobs])


@dataclass
class Session:
    id: str
    worker: str | None = None
    turns: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    trajectory: Trajectory | None = None
    last_stop: int | None = None
    finish_reason: str = "stop"
    workers: list[str] = field(default_factory=list)
    """Every worker that served a turn, in order (a session moves when its worker dies)."""
    cached_tokens: int = 0
    created: float = field(default_factory=time.time)
    sample: int | None = None
    finished: bool = False
    adapter: str | None = None
    """The LoRA adapter of its first turn (the call's `model`): every turn and its trajectory stay on it."""
    routing_only: bool = False
    """A session of vLLM's `/inference/v1/generate`: a pin to a worker and nothing more (no turns, no trajectory)."""


class SessionStore:
    """Sessions of one namespace; every method is one or two round trips, safe from any replica."""

    def __init__(self, streams: Streams, idle_ttl_s: float, busy_timeout_s: float) -> None:
        self.streams = streams
        self.redis: redis.Redis = streams.redis
        self.keys = streams.keys
        self.idle_ttl_s = idle_ttl_s
        self.busy_timeout_s = busy_timeout_s
        """A turn marked in flight for longer than this belongs to a replica that died: the session is free."""
        scripts = register_all(self.redis, SCRIPTS)
        self._pin, self._join_group = scripts["pin"], scripts["join_group"]

    # -- a turn ------------------------------------------------------------------------------------

    def begin(self, session_id: str, call: str, adapter: str | None = None) -> Session:
        """Mark a turn of the session in flight (one at a time) and return the session (new or not). A session stays
        on the model (`adapter`) of its first turn: a turn that names another is refused."""
        key = self.keys.session(session_id)
        with self.redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)
                fields = as_fields(pipe.hgetall(key))
                session = _decode(session_id, fields)
                if session.finished:
                    raise OpenAIError(409, f"session {session_id!r} is finished; start a new one", code="session_done")
                if session.turns and session.adapter != adapter:
                    was = session.adapter or "the base model"
                    raise OpenAIError(
                        400, f"session {session_id!r} runs on {was}: every turn must name it", param="model"
                    )
                session.adapter = adapter
                busy_since = float(fields.get(b"busy_ts") or 0)
                if fields.get(b"busy") and time.time() - busy_since < self.busy_timeout_s:
                    raise OpenAIError(
                        409,
                        f"session {session_id!r} has a turn in flight; send the next turn after its answer",
                        code="session_busy",
                    )
                pipe.multi()
                pipe.hset(key, mapping={"busy": call, "busy_ts": repr(time.time()), "created": repr(session.created)})
                pipe.expire(key, int(self.idle_ttl_s))
                pipe.execute()
            except redis.WatchError:
                raise OpenAIError(
                    409, f"session {session_id!r} changed meanwhile; retry", code="session_busy"
                ) from None
        return session

    def release(self, session_id: str, call: str) -> None:
        """The turn failed: free the session for the next call (if the turn is still ours)."""
        key = self.keys.session(session_id)
        if self.redis.hget(key, "busy") == call.encode():
            self.redis.hdel(key, "busy", "busy_ts")

    def pin(self, session_id: str, candidates: dict[str, int]) -> str:
        """The session's worker among `candidates` (name -> samples in flight): sticky, else least loaded."""
        now = time.time()
        names = sorted(candidates)
        keys = [self.keys.session(session_id), *(self.keys.pins(n) for n in names)]
        args: list[Any] = [session_id, repr(now), repr(now + self.idle_ttl_s)]
        for name in names:
            args += [name, candidates[name]]
        return _text(self._pin(keys=keys, args=args))

    def touch(self, session_id: str) -> None:
        """Renew the session's idle TTL (a routing-only session's hash has no turn to do it)."""
        self.redis.expire(self.keys.session(session_id), int(self.idle_ttl_s))

    def release_pin(self, session_id: str) -> bool:
        """Free the session's pin (vLLM routers' `/finish_session`): its worker no longer counts it. A routing-only
        session (no turns) is forgotten; a session with turns keeps them, for its finish. False if it had no pin."""
        key = self.keys.session(session_id)
        worker, turns = self.redis.hmget(key, ["worker", "turns"])
        if not worker:
            return False
        pipe = self.redis.pipeline(transaction=True)
        pipe.zrem(self.keys.pins(_text(worker)), session_id)
        if not turns:
            pipe.delete(key)
        else:
            pipe.hdel(key, "worker")
        pipe.execute()
        return True

    def place(self, session_id: str, worker: str) -> None:
        """Pin the session to `worker` (placement other than sticky least-loaded: hash, random; or a move)."""
        old = self.redis.hget(self.keys.session(session_id), "worker")
        pipe = self.redis.pipeline(transaction=True)
        if old is not None and _text(old) != worker:
            pipe.zrem(self.keys.pins(_text(old)), session_id)
        pipe.hset(self.keys.session(session_id), "worker", worker)
        pipe.zadd(self.keys.pins(worker), {session_id: time.time() + self.idle_ttl_s})
        pipe.execute()

    def commit(self, session: Session, call: str) -> None:
        """Write the turn (the session's new trajectory and messages) if this call still holds the session."""
        key = self.keys.session(session.id)
        assert session.trajectory is not None
        t = session.trajectory
        with self.redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)
                if pipe.hget(key, "busy") != call.encode():
                    raise OpenAIError(
                        409, f"session {session.id!r} expired or was taken over during this turn", code="session_lost"
                    )
                pipe.multi()
                pipe.hset(
                    key,
                    mapping={
                        "turns": session.turns,
                        "messages": json.dumps(session.messages),
                        "prompt_tokens": encode_int32(t.prompt_tokens),
                        "tokens": encode_int32(t.tokens),
                        "logprobs": encode_float32(t.logprobs),
                        "spans": json.dumps(t.spans),
                        "mask": json.dumps(t.mask),
                        "last_stop": "" if session.last_stop is None else str(session.last_stop),
                        "finish_reason": session.finish_reason,
                        "workers": json.dumps(session.workers),
                        "cached_tokens": session.cached_tokens,
                        "adapter": session.adapter or "",
                        "ts": repr(time.time()),
                    },
                )
                pipe.hdel(key, "busy", "busy_ts")
                pipe.expire(key, int(self.idle_ttl_s))
                if session.worker is not None:
                    pipe.zadd(self.keys.pins(session.worker), {session.id: time.time() + self.idle_ttl_s})
                pipe.execute()
            except redis.WatchError:
                raise OpenAIError(
                    409, f"session {session.id!r} changed during this turn", code="session_lost"
                ) from None

    # -- the end -----------------------------------------------------------------------------------

    def finish(self, session_id: str, request: FinishRequest, version: int | None = None) -> Rollout:
        """Publish the session's trajectory to `{ns}:rollouts` as one group member and release its pin.

        Idempotent: a retried finish returns the same rollout and publishes nothing more (the publish dedupe).
        `version` (default: its model's, from the state) labels a trajectory that has no spans.
        """
        key = self.keys.session(session_id)
        fields = as_fields(self.redis.hgetall(key))
        if not fields:
            raise OpenAIError(
                404, f"no session {session_id!r} (never started, or idle past its TTL)", code="no_session"
            )
        session = _decode(session_id, fields)
        if fields.get(b"busy") and time.time() - float(fields.get(b"busy_ts") or 0) < self.busy_timeout_s:
            raise OpenAIError(409, f"session {session_id!r} has a turn in flight; finish it after", code="session_busy")
        if session.trajectory is None:
            raise OpenAIError(400, f"session {session_id!r} has no turn yet: nothing to train on", code="empty_session")
        group = request.group or session_id
        try:
            sample = int(
                self._join_group(keys=[key, self.keys.group(group)], args=[request.group_size, FINISHED_TTL_S * 24])
            )
        except redis.ResponseError as exc:
            raise OpenAIError(409, f"group {group!r}: {str(exc).split(' ', 1)[-1]}", code="group_conflict") from None
        if version is None:  # the version of its model, for a trajectory without spans
            version = read_state(self.redis, self.keys, session.adapter).version
        rollout = trajectory_rollout(session, group, sample, request, version)
        if self.streams.writer.add_rollouts([rollout]):
            Admission(self.redis, self.keys, adapter=session.adapter).count(1)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, "finished", "1")
        pipe.expire(key, FINISHED_TTL_S)
        if session.worker is not None:
            pipe.zrem(self.keys.pins(session.worker), session_id)
        pipe.execute()
        return rollout


def trajectory_rollout(session: Session, group: str, sample: int, request: FinishRequest, version: int) -> Rollout:
    """A finished session as one rollout of the wire contract (see the README: "Trajectories")."""
    t = session.trajectory
    assert t is not None
    spans = t.spans
    return Rollout(
        prompt_id=group,
        sample=sample,
        n=request.group_size,
        version=spans[0][0] if spans else version,
        version_end=spans[-1][0] if spans else version,
        finish_reason=session.finish_reason,
        worker=session.workers[-1] if session.workers else "",
        prompt_tokens=t.prompt_tokens,
        tokens=t.tokens,
        logprobs=t.logprobs,
        spans=spans,
        mask=t.mask,
        meta={**request.meta, "session": session.id, "turns": session.turns, "workers": session.workers},
        timing={"started": session.created, "finished": time.time()},
        reward=request.reward,
        cached_tokens=session.cached_tokens,
        adapter=session.adapter,
    )


def _decode(session_id: str, fields: dict[bytes, bytes]) -> Session:
    get = {k.decode(): v for k, v in fields.items()}
    session = Session(
        id=session_id,
        worker=_text(get["worker"]) if get.get("worker") else None,
        turns=int(get.get("turns", 0)),
        created=float(get.get("created") or time.time()),
        finished=bool(get.get("finished")),
        sample=int(get["sample"]) if get.get("sample") is not None else None,
    )
    if session.turns == 0:
        return session
    session.messages = json.loads(get["messages"])
    session.trajectory = Trajectory(
        prompt_tokens=np.frombuffer(get["prompt_tokens"], INT32).astype(np.int32),
        tokens=np.frombuffer(get["tokens"], INT32).astype(np.int32),
        logprobs=np.frombuffer(get["logprobs"], FLOAT32).astype(np.float32),
        spans=[tuple(s) for s in json.loads(get["spans"])],
        mask=[tuple(m) for m in json.loads(get["mask"])],
    )
    session.last_stop = int(get["last_stop"]) if get.get("last_stop") else None
    session.finish_reason = _text(get.get("finish_reason", b"stop"))
    session.workers = json.loads(get.get("workers", b"[]"))
    session.cached_tokens = int(get.get("cached_tokens", 0))
    session.adapter = _text(get["adapter"]) or None if get.get("adapter") else None
    return session


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""Rollouts as OpenAI answers: chat completions, completions, their logprobs, and stop strings.

Extensions beyond OpenAI's fields, all optional to read: each choice's `spans` (the policy versions of its
tokens, `[[version, start, end], ...]`) and, with `return_token_ids` (vLLM's extension), `token_ids`; the
answer's `prompt_token_ids`, `session_id` and `policy_version` (the version of the reply's first token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.wire import Rollout, Span
from producers.gateway.chat import ChatRenderer


@dataclass
class Reply:
    """One sample of a call, after stop strings: what the caller reads and what the session keeps."""

    rollout: Rollout
    text: str
    stop_token: int | None
    """The stop token that ended the reply (kept in its tokens), None when it ran out of tokens or hit a stop string."""


def apply_stops(rollout: Rollout, stops: list[str], renderer: ChatRenderer) -> Reply:
    """Cut a reply at its first stop string (the text before it is returned; its tokens keep the tokens up to
    and including the one that completed the stop string, as vLLM's token ids do)."""
    tokens = rollout.tokens
    if stops:
        for k in range(1, len(tokens) + 1):
            text = renderer.reply_text(tokens[:k])
            at = min((text.find(s) for s in stops if s in text), default=-1)
            if at >= 0:
                cut = rollout.model_copy(
                    update={
                        "tokens": tokens[:k],
                        "logprobs": rollout.logprobs[:k],
                        "spans": clip_spans(rollout.spans, k),
                        "finish_reason": "stop",
                    }
                )
                return Reply(cut, text[:at], None)
    stop_token = int(tokens[-1]) if rollout.finish_reason == "stop" and len(tokens) else None
    return Reply(rollout, renderer.reply_text(tokens), stop_token)


def clip_spans(spans: list[Span], end: int) -> list[Span]:
    return [(v, s, min(e, end)) for v, s, e in spans if s < end]


def usage(prompt_len: int, replies: list[Reply]) -> dict[str, Any]:
    completion = sum(len(r.rollout.tokens) for r in replies)
    cached = max((r.rollout.cached_tokens or 0 for r in replies), default=0)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Call:
    """What an answer says about its call, besides the replies."""

    id: str
    model: str
    prompt: np.ndarray
    logprobs: bool
    token_ids: bool
    """vLLM's `return_token_ids`: `prompt_token_ids` on the answer, `token_ids` on each choice."""
    session_id: str | None


def answer(call: Call, replies: list[Reply], renderer: ChatRenderer, chat: bool) -> dict[str, Any]:
    """A `chat.completion` (`chat`) or a `text_completion`, one choice per reply."""
    choices = []
    for index, reply in enumerate(replies):
        choice: dict[str, Any] = {"index": index, "finish_reason": reply.rollout.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": reply.text}
            choice["logprobs"] = {"content": _token_logprobs(reply.rollout, renderer)} if call.logprobs else None
        else:
            choice["text"] = reply.text
            choice["logprobs"] = _legacy_logprobs(reply.rollout, renderer) if call.logprobs else None
        choice["spans"] = [list(s) for s in reply.rollout.spans]
        if call.token_ids:
            choice["token_ids"] = reply.rollout.tokens.tolist()
        choices.append(choice)
    body: dict[str, Any] = {
        "id": call.id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": call.model,
        "choices": choices,
        "usage": usage(len(call.prompt), replies),
        "policy_version": replies[0].rollout.version if replies else None,
    }
    if call.session_id is not None:
        body["session_id"] = call.session_id
    if call.token_ids:
        body["prompt_token_ids"] = call.prompt.tolist()
    return body


def _token_logprobs(rollout: Rollout, renderer: ChatRenderer) -> list[dict[str, Any]]:
    out = []
    for token, logprob in zip(rollout.tokens, rollout.logprobs, strict=True):
        text = renderer.token_text(int(token))
        out.append({"token": text, "logprob": float(logprob), "bytes": list(text.encode()), "top_logprobs": []})
    return out


def _legacy_logprobs(rollout: Rollout, renderer: ChatRenderer) -> dict[str, Any]:
    texts = [renderer.token_text(int(t)) for t in rollout.tokens]
    offsets = np.cumsum([0, *(len(t) for t in texts)])[:-1]
    return {
        "tokens": texts,
        "token_logprobs": [float(x) for x in rollout.logprobs],
        "top_logprobs": None,
        "text_offset": [int(o) for o in offsets],
    }

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
    stop_string: str | None = None
    """The stop string that cut the reply, if one did."""


def apply_stops(rollout: Rollout, stops: list[str], renderer: ChatRenderer) -> Reply:
    """Cut a reply at its first stop string (the text before it is returned; its tokens keep the tokens up to
    and including the one that completed the stop string, as vLLM's token ids do)."""
    tokens = rollout.tokens
    if stops:
        for k in range(1, len(tokens) + 1):
            text = renderer.reply_text(tokens[:k])
            found = [(text.find(s), s) for s in stops if s in text]
            if found:
                at, matched = min(found)
                cut = rollout.model_copy(
                    update={
                        "tokens": tokens[:k],
                        "logprobs": rollout.logprobs[:k],
                        "spans": clip_spans(rollout.spans, k),
                        "finish_reason": "stop",
                    }
                )
                return Reply(cut, text[:at], None, matched)
    stop_token = int(tokens[-1]) if rollout.finish_reason == "stop" and len(tokens) else None
    return Reply(rollout, renderer.reply_text(tokens), stop_token)


def clip_spans(spans: list[Span], end: int) -> list[Span]:
    return [(v, s, min(e, end)) for v, s, e in spans if s < end]


def usage(prompt_lens: list[int], replies: list[list[Reply]]) -> dict[str, Any]:
    """Tokens of every prompt and every reply of a call; cached: the prompt tokens the engines found in their prefix
    caches (the most any sample of a prompt did, summed over the prompts)."""
    prompt = sum(prompt_lens)
    completion = sum(len(r.rollout.tokens) for group in replies for r in group)
    cached = sum(max((r.rollout.cached_tokens or 0 for r in group), default=0) for group in replies)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Call:
    """What an answer says about its call, besides the replies."""

    id: str
    model: str
    prompts: list[np.ndarray]
    """The call's prompts: one, or a completions batch."""
    logprobs: bool
    token_ids: bool
    """vLLM's `return_token_ids`: `prompt_token_ids` on the answer (and on each completion choice), `token_ids` on
    each choice."""
    session_id: str | None
    ids_as_tokens: bool = False
    """vLLM's `return_tokens_as_token_ids`: each logprob's token is `token_id:{id}`."""


def answer(call: Call, replies: list[list[Reply]], renderer: ChatRenderer, chat: bool) -> dict[str, Any]:
    """A `chat.completion` (`chat`) or a `text_completion`: one choice per reply, prompt by prompt (choice `i * n + k`
    is sample `k` of prompt `i`, as vLLM orders a batch)."""
    choices: list[dict[str, Any]] = []
    for prompt, group in zip(call.prompts, replies, strict=True):
        for reply in group:
            index = len(choices)
            choice: dict[str, Any] = {"index": index, "finish_reason": reply.rollout.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": reply.text}
                logprobs = token_logprobs(reply.rollout, renderer, call.ids_as_tokens) if call.logprobs else None
                choice["logprobs"] = {"content": logprobs} if logprobs is not None else None
            else:
                choice["text"] = reply.text
                choice["logprobs"] = (
                    _legacy_logprobs(reply.rollout, renderer, call.ids_as_tokens) if call.logprobs else None
                )
            choice["spans"] = [list(s) for s in reply.rollout.spans]
            if call.token_ids:
                choice["token_ids"] = reply.rollout.tokens.tolist()
                if not chat:
                    choice["prompt_token_ids"] = prompt.tolist()
            choices.append(choice)
    first = replies[0][0].rollout.version if replies and replies[0] else None
    body: dict[str, Any] = {
        "id": call.id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": call.model,
        "choices": choices,
        "usage": usage([len(p) for p in call.prompts], replies),
        "policy_version": first,
    }
    if call.session_id is not None:
        body["session_id"] = call.session_id
    if call.token_ids and len(call.prompts) == 1:
        body["prompt_token_ids"] = call.prompts[0].tolist()
    return body


def token_string(token: int, renderer: ChatRenderer, as_id: bool) -> str:
    return f"token_id:{token}" if as_id else renderer.token_text(token)


def token_logprobs(rollout: Rollout, renderer: ChatRenderer, as_id: bool) -> list[dict[str, Any]]:
    out = []
    for token, logprob in zip(rollout.tokens, rollout.logprobs, strict=True):
        text = token_string(int(token), renderer, as_id)
        out.append({"token": text, "logprob": float(logprob), "bytes": list(text.encode()), "top_logprobs": []})
    return out


def _legacy_logprobs(rollout: Rollout, renderer: ChatRenderer, as_id: bool) -> dict[str, Any]:
    texts = [token_string(int(t), renderer, as_id) for t in rollout.tokens]
    offsets = np.cumsum([0, *(len(t) for t in texts)])[:-1]
    return {
        "tokens": texts,
        "token_logprobs": [float(x) for x in rollout.logprobs],
        "top_logprobs": None,
        "text_offset": [int(o) for o in offsets],
    }

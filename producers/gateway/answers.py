"""Rollouts as OpenAI answers: chat completions, completions, their logprobs, and stop strings.

Extensions beyond OpenAI's fields, all optional to read: each choice's `spans` (the policy versions of its
tokens, `[[version, start, end], ...]`) and, with `return_token_ids` (vLLM's extension), `token_ids`; the
answer's `prompt_token_ids`, `session_id` and `policy_version` (the version of the reply's first token).

Alternatives (the k most likely tokens of each position, `Rollout.top_token_ids` / `top_logprobs`) come in OpenAI's
shapes: chat's `top_logprobs` are the k most likely, most likely first; completions' `top_logprobs` map the sampled
token and the k most likely to their logprobs (up to k + 1, as OpenAI's legacy completions and vLLM's). A logprob
of -inf (a token top-p dropped, in processed logprobs) is -9999.0, as vLLM's server writes it (JSON has no -inf).
"""

from __future__ import annotations

import math
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


def apply_stops(rollout: Rollout, stops: list[str], renderer: ChatRenderer, min_tokens: int = 0) -> Reply:
    """Cut a reply at its first stop string (the text before it is returned; its tokens keep the tokens up to
    and including the one that completed the stop string, as vLLM's token ids do). With `min_tokens`, as vLLM's: a
    stop string counts only once it ends after the text of the first `min_tokens` tokens."""
    tokens = rollout.tokens
    if stops:
        floor = len(renderer.reply_text(tokens[:min_tokens])) if min_tokens else 0
        for k in range(min_tokens + 1, len(tokens) + 1):
            text = renderer.reply_text(tokens[:k])
            found = [(at, s) for s in stops if (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
            if found:
                at, matched = min(found)
                cut = rollout.model_copy(
                    update={
                        "tokens": tokens[:k],
                        "logprobs": rollout.logprobs[:k],
                        "spans": clip_spans(rollout.spans, k),
                        "finish_reason": "stop",
                        "top_token_ids": None if rollout.top_token_ids is None else rollout.top_token_ids[:k],
                        "top_logprobs": None if rollout.top_logprobs is None else rollout.top_logprobs[:k],
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
    top_logprobs: int = 0
    """The alternatives of each token asked for (chat's `top_logprobs`, completions' `logprobs: k`)."""


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
                logprobs = (
                    token_logprobs(reply.rollout, renderer, call.ids_as_tokens, call.top_logprobs)
                    if call.logprobs
                    else None
                )
                choice["logprobs"] = {"content": logprobs} if logprobs is not None else None
            else:
                choice["text"] = reply.text
                choice["logprobs"] = (
                    _legacy_logprobs(reply.rollout, renderer, call.ids_as_tokens, call.top_logprobs)
                    if call.logprobs
                    else None
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


def clamp_logprob(logprob: float) -> float:
    """OpenAI's floor of a logprob in JSON: -inf (and NaN) become -9999.0, as vLLM's server writes them."""
    return -9999.0 if math.isnan(logprob) else max(float(logprob), -9999.0)


def alternatives(rollout: Rollout, position: int) -> list[tuple[int, float]]:
    """The k most likely tokens at `position` and their logprobs, most likely first; none if the rollout has none."""
    if rollout.top_token_ids is None or rollout.top_logprobs is None:
        return []
    ids, logprobs = rollout.top_token_ids[position], rollout.top_logprobs[position]
    return [(int(t), float(lp)) for t, lp in zip(ids, logprobs, strict=True)]


def engine_order(rollout: Rollout, position: int) -> list[tuple[int, float, int | None]]:
    """vLLM's order of a position's logprobs, `(token, logprob, rank)`: the sampled token first (its rank when it is
    among the alternatives, else None: not known past k), then the alternatives by rank without it."""
    token, logprob = int(rollout.tokens[position]), float(rollout.logprobs[position])
    top = alternatives(rollout, position)
    rank = next((r for r, (t, _) in enumerate(top, 1) if t == token), None)
    return [(token, logprob, rank), *((t, lp, r) for r, (t, lp) in enumerate(top, 1) if t != token)]


def token_logprobs(
    rollout: Rollout, renderer: ChatRenderer, as_id: bool, top: int = 0, engine: bool = False
) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: each token's logprob and its `top` most likely alternatives (OpenAI's). `engine`:
    vLLM's generate route's order instead, the sampled token first, then the others (`max(top, 1)` of them)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_string(token, renderer, as_id)
        return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(text.encode())}

    out = []
    for i, (token, logprob) in enumerate(zip(rollout.tokens, rollout.logprobs, strict=True)):
        if not top:
            shown: list[tuple[int, float]] = []
        elif engine:
            shown = [(t, lp) for t, lp, _ in engine_order(rollout, i)[: max(top, 1)]]
        else:
            shown = alternatives(rollout, i)[:top]
        out.append({**entry(int(token), float(logprob)), "top_logprobs": [entry(t, lp) for t, lp in shown]})
    return out


def _legacy_logprobs(rollout: Rollout, renderer: ChatRenderer, as_id: bool, top: int = 0) -> dict[str, Any]:
    """Completions' logprobs; with `top` (k), each position's `top_logprobs` maps the sampled token and the k most
    likely to their logprobs (up to k + 1 entries, as OpenAI's and vLLM's)."""
    texts = [token_string(int(t), renderer, as_id) for t in rollout.tokens]
    offsets = np.cumsum([0, *(len(t) for t in texts)])[:-1]
    tops = None
    if top:
        tops = [
            {token_string(t, renderer, as_id): clamp_logprob(lp) for t, lp, _ in engine_order(rollout, i)[: top + 1]}
            for i in range(len(texts))
        ]
    return {
        "tokens": texts,
        "token_logprobs": [clamp_logprob(x) for x in rollout.logprobs],
        "top_logprobs": tops,
        "text_offset": [int(o) for o in offsets],
    }

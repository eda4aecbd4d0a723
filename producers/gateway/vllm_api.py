"""The request and answer shapes of vLLM's RL routes (checked against vLLM 0.32's server and SkyRL 0.4.0's client).

`POST /inference/v1/generate` (vLLM's token-in/token-out route): `token_ids` and `sampling_params` (vLLM's
`SamplingParams` as JSON) in; `choices[].token_ids`, `choices[].logprobs.content[].logprob` (the sampled token's) and,
with `logprobs: k` (1 to 20), `top_logprobs` in vLLM's order (the sampled token first, then the k most likely without
it, `max(k, 1)` entries, each with its `rank`; the sampled token's rank is null when it is not among the k),
`finish_reason`, `stop_reason` and `weight_versions` (vLLM's per-token version spans, `[{version, start, end}]`, from
our `spans`) out. Every sampling field is honoured or refused
(`producers.gateway.sampling`). `output_mode="text"` adds `text` and text logprobs; `stream` is refused (rollouts
arrive whole).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pipeline.wire import INT64_MAX, MAX_SAMPLES, SAMPLING_KNOBS
from producers.gateway.answers import Reply, clamp_logprob, engine_order, token_logprobs, usage
from producers.gateway.chat import ChatRenderer
from producers.gateway.openai_api import OpenAIError
from producers.gateway.sampling import Ask, check_fields, check_knobs, check_logprobs, check_token_ids

NO_TEXT = ("skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens")
"""Sampling fields that shape text only: without it (`output_mode="tokens"`) they change nothing."""


class VllmSamplingParams(BaseModel):
    """The honoured part of vLLM's `SamplingParams`; the rest lands in `model_extra` and is checked there."""

    model_config = ConfigDict(extra="allow")

    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    max_tokens: int | None = Field(default=None, ge=1)
    """None (left out): the rest of the context, as vLLM's server does for this route."""
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX - MAX_SAMPLES)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    top_k: int | None = None
    """As the knobs below (`pipeline.wire.SAMPLING_KNOBS`): None, vLLM's default; ranges checked with a 400 naming
    the field (`check_knobs`)."""
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = None
    """Ours: vLLM sets this per engine (`--logprobs-mode`), so its `SamplingParams` has no such field. None: raw."""


class GenerateRequest(BaseModel):
    """`POST /inference/v1/generate`'s body. Fields not modelled are checked (`check_fields`): multimodal inputs,
    priorities and disaggregated-serving parameters are refused unless null."""

    model_config = ConfigDict(extra="allow")

    token_ids: list[int] = Field(min_length=1)
    sampling_params: VllmSamplingParams = Field(default_factory=VllmSamplingParams)
    model: str | None = None
    request_id: str | None = Field(default=None, max_length=256)
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    cache_salt: str | None = None
    """Accepted, not passed on: workers never serve one policy version's prefix cache to another."""

    def ask(self) -> tuple[Ask, bool]:
        """The call's `Ask` (with the alternatives asked per token, `logprobs: k`) and whether logprobs are asked for,
        after checking every other field."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in ("features", "content_parts")}
        for multimodal in ("features", "content_parts"):
            if (self.model_extra or {}).get(multimodal) is not None:
                raise OpenAIError(400, f"{multimodal}: text only (no multimodal inputs)", param=multimodal)
        check_fields(extra)
        if self.stream:
            raise OpenAIError(
                400, "stream=true is not supported here: rollouts arrive whole; send stream=false", param="stream"
            )
        if any(t < 0 for t in self.token_ids):
            raise OpenAIError(400, "token_ids must not contain negative values", param="token_ids")
        sp = self.sampling_params
        others = dict(sp.model_extra or {})
        if self.output_mode == "tokens":
            for name in NO_TEXT:
                others.pop(name, None)
        where = "sampling_params."
        check_fields(others, where)
        logprobs = check_logprobs(sp.logprobs, "sampling_params.logprobs")
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        if any(not s for s in stops):
            raise OpenAIError(400, "stop strings must not be empty", param="sampling_params.stop")
        ask = Ask(
            n=sp.n,
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            seed=sp.seed,
            stop_token_ids=check_token_ids(sp.stop_token_ids, "sampling_params.stop_token_ids"),
            stops=stops,
            knobs=check_knobs({name: getattr(sp, name) for name in SAMPLING_KNOBS}, where, sp.max_tokens),
            where=where,
            logprobs_mode="processed" if sp.logprobs_mode == "processed_logprobs" else "raw",
            top_logprobs=logprobs or 0,
        )
        return ask, logprobs is not None


def generate_answer(
    request: GenerateRequest,
    model: str,
    prompt: np.ndarray,
    replies: list[Reply],
    ask: Ask,
    logprobs: bool,
    renderer: ChatRenderer,
) -> dict[str, Any]:
    """vLLM's `GenerateTokensResponse` (or `GenerateTextResponse`), one choice per sample, with our `spans` and
    `policy_version` beside vLLM's own fields."""
    choices = []
    for index, reply in enumerate(replies):
        rollout = reply.rollout
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": rollout.finish_reason,
            "stop_reason": _stop_reason(reply, ask),
            "token_ids": rollout.tokens.tolist(),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": [{"version": str(v), "start": s, "end": e} for v, s, e in rollout.spans],
            "spans": [list(s) for s in rollout.spans],
        }
        if request.output_mode == "text":
            choice["text"] = reply.text
            content = token_logprobs(rollout, renderer, False, ask.top_logprobs, engine=True)
            choice["logprobs"] = {"content": content} if logprobs else None
        else:
            choice["logprobs"] = {"content": _token_id_logprobs(reply, ask.top_logprobs)} if logprobs else None
        choices.append(choice)
    return {
        "request_id": f"generate-tokens-{request.request_id or ''}".rstrip("-") or "generate-tokens",
        "model": model,
        "created": int(time.time()),
        "output_mode": request.output_mode,
        "choices": choices,
        "usage": usage([len(prompt)], [replies]),
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": prompt.tolist() if request.return_token_ids else None,
        "kv_transfer_params": None,
        "policy_version": replies[0].rollout.version if replies else None,
    }


def _token_id_logprobs(reply: Reply, top: int) -> list[dict[str, Any]]:
    """vLLM's `GenerateLogProbs.content` of a sample: each token's id, its `token` as vLLM writes it for token ids
    (`token_id:N`: what renderers' client, verifiers' train client, requires) and logprob and, with `top` (k), vLLM's
    `top_logprobs` (the engine's order: the sampled token, then the k most likely without it; `max(k, 1)` of them)."""
    rollout, content = reply.rollout, []
    for i, (token, logprob) in enumerate(zip(rollout.tokens, rollout.logprobs, strict=True)):
        entry: dict[str, Any] = {"token_id": int(token), "token": f"token_id:{int(token)}",
                                 "logprob": clamp_logprob(logprob), "rank": None}  # fmt: skip
        entry["top_logprobs"] = []
        if top:
            order = engine_order(rollout, i)
            entry["rank"] = order[0][2]
            entry["top_logprobs"] = [
                {"token_id": t, "token": f"token_id:{t}", "logprob": clamp_logprob(lp), "rank": r}
                for t, lp, r in order[: max(top, 1)]
            ]
        content.append(entry)
    return content


def _stop_reason(reply: Reply, ask: Ask) -> int | str | None:
    """vLLM's `stop_reason`: the stop string or the `stop_token_ids` entry that ended the sample; None on the end of
    sequence, on length and on abort."""
    if reply.rollout.finish_reason != "stop":
        return None
    if reply.stop_string is not None:
        return reply.stop_string
    return reply.stop_token if reply.stop_token in ask.stop_token_ids else None


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize` (a text prompt, or chat messages through the template)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int] = Field(default_factory=list)

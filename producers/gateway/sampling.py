"""Every sampling field a caller may send the gateway, and what becomes of it: nothing is dropped silently.

A field is either **honoured** (carried on the wire's `Sampling` to the workers, or applied by the gateway: `n`,
`max_tokens`, `temperature`, `top_p`, `seed`, `stop_token_ids`, `stop`, `logprobs` of the sampled token and up to
`MAX_TOP_LOGPROBS` alternatives of each token (`top_logprobs`, completions' `logprobs: k`), and the knobs
`pipeline.wire.SAMPLING_KNOBS`: `top_k`, `min_p`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`,
`min_tokens`, each checked against the wire's ranges with a 400 that names it), **inert** (it changes nothing in the
answer: `user`, `metadata`, the prefix-cache salt, ...), or **default only**: the wire and the engines have no such
knob, so its default ("off") is accepted and any other value is refused with OpenAI's 400 shape, naming the field and
saying why. A field in none of these lists is refused as OpenAI refuses it ("Unrecognized request argument supplied").
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from pipeline.wire import MAX_TOP_LOGPROBS, SAMPLING_KNOBS, LogprobsMode, Sampling
from producers.gateway.openai_api import OpenAIError, Sampled

NO_KNOB = "the wire's sampling has no such knob, and no engine applies it"


@dataclass(frozen=True)
class DefaultOnly:
    """A field whose default (each of `allowed` means "off") is accepted and any other value refused, because `why`."""

    allowed: tuple[Any, ...]
    why: str = NO_KNOB


DEFAULT_ONLY: dict[str, DefaultOnly] = {
    # What samplers do that ours do not: the wire's `Sampling` would have to carry them, and every engine honour them.
    "length_penalty": DefaultOnly((None, 1)),
    "logit_bias": DefaultOnly((None, {})),
    "allowed_token_ids": DefaultOnly((None,)),
    "bad_words": DefaultOnly((None, [])),
    "ignore_eos": DefaultOnly((None, False)),
    "best_of": DefaultOnly((None, 1)),
    "use_beam_search": DefaultOnly((None, False)),
    "watermarking": DefaultOnly((None,)),
    "thinking_token_budget": DefaultOnly((None,)),
    "repetition_detection": DefaultOnly((None,)),
    "extra_args": DefaultOnly((None, {})),
    "truncate_prompt_tokens": DefaultOnly((None,), "a prompt is never truncated: one too long is refused"),
    # Constrained decoding.
    "structured_outputs": DefaultOnly((None,), "no engine constrains decoding (structured outputs, guided decoding)"),
    "guided_json": DefaultOnly((None,), "no engine constrains decoding (structured outputs, guided decoding)"),
    "guided_regex": DefaultOnly((None,), "no engine constrains decoding (structured outputs, guided decoding)"),
    "guided_choice": DefaultOnly((None,), "no engine constrains decoding (structured outputs, guided decoding)"),
    "guided_grammar": DefaultOnly((None,), "no engine constrains decoding (structured outputs, guided decoding)"),
    "response_format": DefaultOnly((None, {"type": "text"}), "no engine constrains decoding (JSON mode, schemas)"),
    # Logprobs beyond the sampled token's.
    "prompt_logprobs": DefaultOnly((None,), "the engines report no logprobs of the prompt"),
    "prompt_logprob_token_ids": DefaultOnly((None,), "the engines report no logprobs of the prompt"),
    "prompt_logprob_start": DefaultOnly((None,), "the engines report no logprobs of the prompt"),
    "logprob_token_ids": DefaultOnly((None,), "the engines report the sampled token's logprob, no others"),
    "flat_logprobs": DefaultOnly((None, False), "logprobs come in OpenAI's (or vLLM's) shape"),
    # Answers the gateway does not give.
    "echo": DefaultOnly((None, False), "the answer holds the completion, not the prompt"),
    "suffix": DefaultOnly((None,), "there is no insertion mode"),
    "audio": DefaultOnly((None,), "text only"),
    "modalities": DefaultOnly((None, ["text"]), "text only"),
    "prediction": DefaultOnly((None,), "no speculative decoding from a predicted output"),
    "web_search_options": DefaultOnly((None,), "no tools run in the gateway"),
    "functions": DefaultOnly((None,), "pass tools as `tools` (they go to the chat template)"),
    "function_call": DefaultOnly((None,), "pass tools as `tools` (they go to the chat template)"),
    "tool_choice": DefaultOnly((None, "auto"), "the model chooses (tools are not parsed or forced)"),
    "reasoning_effort": DefaultOnly((None,), "the chat template renders the messages as they are"),
    "continue_final_message": DefaultOnly((None, False), "the last message must not be the assistant's"),
    "add_generation_prompt": DefaultOnly((None, True), "every chat prompt ends with the template's generation prompt"),
    "chat_template": DefaultOnly((None,), "the model's own chat template renders every session"),
    "chat_template_kwargs": DefaultOnly((None, {}), "the model's own chat template renders every session"),
    "documents": DefaultOnly((None,), "the model's own chat template renders every session"),
    "mm_processor_kwargs": DefaultOnly((None,), "text only"),
    "stream_interval": DefaultOnly((None, 1), "a reply streams as one chunk (rollouts arrive whole)"),
    "output_text_buffer_length": DefaultOnly((None, 0), "a reply streams as one chunk (rollouts arrive whole)"),
    "skip_clone": DefaultOnly((None, False), "an engine-internal flag"),
    "skip_reading_prefix_cache": DefaultOnly((None, False), "the workers' engines manage their prefix caches"),
    "routed_experts_prompt_start": DefaultOnly((None, 0), "routed experts are not reported"),
    "trace_decode_token_ids": DefaultOnly((None,), "no decode traces are reported"),
    "priority": DefaultOnly((None, 0), "the queue is first in, first out"),
    "kv_transfer_params": DefaultOnly((None,), "no disaggregated prefill"),
    "ec_transfer_params": DefaultOnly((None,), "no disaggregated prefill"),
    "spaces_between_special_tokens": DefaultOnly((None, True), "text is decoded as the tokenizer does by default"),
    "skip_special_tokens": DefaultOnly(
        (None, True), "a reply's text leaves out special tokens (its token ids keep them)"
    ),
    "include_stop_str_in_output": DefaultOnly((None, False), "a reply's text ends before its stop string"),
}
"""Fields accepted at their default only, with the reason any other value is refused."""

INERT = frozenset(
    {
        "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls", "safety_identifier",
        "prompt_cache_key", "verbosity", "request_id", "cache_salt", "output_kind", "detokenize",
    }
)  # fmt: skip
"""Accepted and without effect on the answer: identifiers, storage and service hints, stream options (a reply streams
as one chunk), `cache_salt` (workers never serve one version's prefix cache to another: a sync resets it, or salts it by
version in `inflight`), vLLM's `output_kind` (the server sets it) and `detokenize` (text is decoded where a route
returns text)."""


def check_fields(fields: dict[str, Any], where: str = "") -> None:
    """Refuse, in OpenAI's 400 shape, a field of `fields` (the request's extras, or vLLM's `sampling_params` less the
    honoured ones) that is neither inert nor at its default. `where`: the parameter's prefix (`sampling_params.`)."""
    for name, value in fields.items():
        if name in INERT:
            continue
        rule = DEFAULT_ONLY.get(name)
        if rule is None:
            raise OpenAIError(
                400,
                f"Unrecognized request argument supplied: {where}{name}",
                code="unknown_parameter",
                param=where + name,
            )
        if not any(_same(value, allowed) for allowed in rule.allowed):
            off = " or ".join("null" if a is None else repr(a) for a in rule.allowed)
            raise OpenAIError(
                400,
                f"{where}{name}={value!r} is not supported: {rule.why}; leave it out (or send {off})",
                code="unsupported_parameter",
                param=where + name,
            )


def _same(value: Any, allowed: Any) -> bool:
    """`value` is `allowed` (`True` is not 1, `0` is not `False`, `null` only `None`)."""
    if value is None or allowed is None or isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return bool(value == allowed)


@dataclass(frozen=True)
class Ask:
    """What one prompt of a call asks the workers for, checked: its samples, their sampling, and what the gateway
    applies to them (stop strings, none before `min_tokens` tokens)."""

    n: int = 1
    max_tokens: int | None = None
    """None: the rest of the context."""
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    logprobs_mode: LogprobsMode = "raw"
    """What the samples' logprobs are (`pipeline.wire.LogprobsMode`): vLLM's route takes it in `sampling_params`, by
    vLLM's engine-wide names (`raw_logprobs`, `processed_logprobs`), because verl and TRL ask for processed ones."""
    knobs: dict[str, Any] = field(default_factory=dict)
    """The knobs of `pipeline.wire.SAMPLING_KNOBS` the call set (checked: `check_knobs`); the others stay at the
    wire's defaults (off)."""
    where: str = ""
    """Where the call's sampling fields are (`sampling_params.` on vLLM's generate route): a 400 names `where` + the
    field."""
    top_logprobs: int = 0
    """The alternatives of each token the workers report (`pipeline.wire.Sampling.top_logprobs`), 0 to
    `MAX_TOP_LOGPROBS`."""

    @property
    def min_tokens(self) -> int:
        """No stop token before this many tokens (the engines mask them), and no stop string (`apply_stops`)."""
        return int(self.knobs.get("min_tokens") or 0)


def check_knobs(given: dict[str, Any], where: str = "", max_tokens: int | None = None) -> dict[str, Any]:
    """The knobs of `given` that are set (not None), checked against the wire's ranges (`Sampling.problem_fields`;
    `min_tokens` against `max_tokens` when the call gives it): a 400 in OpenAI's shape naming the first bad one."""
    knobs = {name: value for name, value in given.items() if value is not None}
    limit = {} if max_tokens is None else {"max_tokens": max_tokens}
    check_sampling(Sampling(**limit, **knobs), where, only=knobs)
    return knobs


def check_sampling(sampling: Sampling, where: str = "", only: Collection[str] = SAMPLING_KNOBS) -> None:
    """A 400 naming the first field of `only` that `sampling` has out of range (`Sampling.problem_fields`)."""
    for name, message in sampling.problem_fields():
        if name in only:
            raise OpenAIError(400, where + message, code="invalid_value", param=where + name)


def check_logprobs(value: int | bool | None, param: str) -> int | None:
    """What a completions' (or vLLM's `sampling_params`) `logprobs` asks for: None (`null`, `false`) no logprobs; 0
    (`true`, `0`: vLLM's "the sampled token only") the sampled tokens'; k (1 to `MAX_TOP_LOGPROBS`) those and the k
    most likely alternatives of each token. More, or a negative number, is refused."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    return check_top_logprobs(value, param)


def check_top_logprobs(value: int | None, param: str) -> int:
    """The alternatives asked per token, 0 to `MAX_TOP_LOGPROBS` (OpenAI's limit, and vLLM's default `max_logprobs`);
    any other number is a 400 in OpenAI's shape."""
    if value is None:
        return 0
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise OpenAIError(
            400,
            f"{param}={value} is out of range: ask for 0 to {MAX_TOP_LOGPROBS} alternatives of each token",
            code="invalid_value",
            param=param,
        )
    return value


def check_chat_logprobs(logprobs: bool, top_logprobs: int | None) -> int:
    """A chat request's alternatives per token (0: none): a 400 past the limit, or asked without `logprobs`."""
    top = check_top_logprobs(top_logprobs, "top_logprobs")
    if top and not logprobs:
        raise OpenAIError(
            400, "top_logprobs needs logprobs=true (as OpenAI's and vLLM's servers ask)", param="top_logprobs"
        )
    return top


def ask_of(request: Sampled, max_tokens: int | None, top_logprobs: int = 0) -> Ask:
    """A chat or completions request's `Ask`, after checking its other fields (`check_fields`). `top_logprobs`: the
    alternatives of each token asked for (checked: `check_top_logprobs`)."""
    check_fields(dict(request.model_extra or {}))
    return Ask(
        n=request.n,
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop_token_ids=check_token_ids(request.stop_token_ids, "stop_token_ids"),
        stops=request.stops(),
        knobs=check_knobs({name: getattr(request, name) for name in SAMPLING_KNOBS}, max_tokens=max_tokens),
        top_logprobs=top_logprobs,
    )


def check_token_ids(ids: list[int] | None, param: str) -> list[int]:
    if ids and any(t < 0 for t in ids):
        raise OpenAIError(400, f"{param} must be token ids (>= 0)", param=param)
    return sorted(set(ids or []))

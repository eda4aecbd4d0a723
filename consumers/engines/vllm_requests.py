"""One vLLM request as the `vllm` engine builds and reads it: our `Sampling` as vLLM's `SamplingParams`
(`sampling_params`: token-in, token-out, one final output, flat logprobs of the sampled token first, then the top k),
and that final output as ours (`sampled_logprobs`, `alternatives`, `routes`, and the spans of a sample cut by adapter
pauses, `add_span`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.logprobs import FlatLogprobs
from vllm.sampling_params import RequestOutputKind

from consumers.engines.base import EngineInputError, refuse_logprobs_mode, top_k_within
from pipeline.wire import LogprobsMode, Sampling

log = logging.getLogger(__name__)

EMPTY_LOGPROBS = np.zeros(0, dtype=np.float32)
"""The logprobs of a request that generated nothing."""


def sampling_params(
    sampling: Sampling,
    prompt_len: int,
    *,
    engine: str,
    logprobs_mode: LogprobsMode,
    max_model_len: int,
    vocab_size: int,
    eos_ids: Iterable[int],
) -> Any:
    """Our `Sampling` as vLLM `SamplingParams` for a prompt of `prompt_len` tokens (within `max_model_len`, stopping
    at `eos_ids` too); values vLLM refuses raise `EngineInputError`, and so does a `logprobs_mode` other than the
    engine's."""
    refuse_logprobs_mode(engine, logprobs_mode, sampling)
    max_tokens = min(sampling.max_tokens, max_model_len - prompt_len)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=top_k_within(sampling, vocab_size),
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            min_tokens=min(sampling.min_tokens, max_tokens),  # the context may end first: then it ends the sample
            seed=sampling.seed,
            stop_token_ids=sorted(set(sampling.stop_token_ids) | set(eos_ids)),
            logprobs=sampling.top_logprobs,  # the sampled token's logprob first, then the k most likely
            flat_logprobs=True,  # plain lists, not a dict of `Logprob` objects per token
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request (`vllm_engine`'s docstring)
        )
    except (ValueError, VLLMClientError) as exc:  # vLLM's own range checks (e.g. temperature <= 2)
        raise EngineInputError(str(exc)) from exc


def routes_of(output: Any, sampling: Sampling, prompt_len: int, n_tokens: int, request_id: str) -> np.ndarray | None:
    """The routed experts of a final output as int16 `[prompt_len + n_tokens - 1, layers, top_k]` when the request
    asked; None when it did not, generated nothing or was aborted (its continuation reads the whole sample again),
    and, logged, when vLLM's do not cover the sample one route a position (the tokens are kept all the same)."""
    positions = prompt_len + n_tokens - 1
    if not sampling.routed_experts or not n_tokens or output.finish_reason == "abort":
        return None
    routes = getattr(output, "routed_experts", None)
    shape = None if routes is None else np.shape(routes)
    if shape is None or len(shape) != 3 or shape[0] != positions:
        log.warning(
            "request %s: vLLM's routed experts are of shape %s, not [%d, layers, top_k]; its rollout carries none",
            request_id, shape, positions,
        )  # fmt: skip
        return None
    return np.asarray(routes, dtype=np.int16)


def add_span(spans: list[tuple[int, int, int]], version: int, start: int, end: int) -> None:
    """Append `(version, start, end)`, merged into the last span when that one is of the same version."""
    if spans and spans[-1][0] == version and spans[-1][2] == start:
        spans[-1] = (version, spans[-1][1], end)
    else:
        spans.append((version, start, end))


def alternatives(tokens: list[int], flat: FlatLogprobs | None, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The k most likely tokens of each position and their logprobs, `[len(tokens), k]` int32 / float32, from vLLM's
    flat logprobs of a request with `logprobs=k`; None when k is 0 or there are no tokens.

    vLLM's sampler gives each position the sampled token first, then the top k in rank order (`gather_logprobs`; the
    sampled token again among them if it is one), of the same distribution as the sampled token's logprob (the
    engine's `logprobs_mode`)."""
    if not k or not tokens:
        return None
    if flat is None or len(flat.start_indices) != len(tokens):
        raise RuntimeError(f"vLLM returned logprobs for {0 if flat is None else len(flat)} of {len(tokens)} tokens")
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    if not np.array_equal(np.asarray(flat.end_indices, dtype=np.int64) - starts, np.full(len(tokens), k + 1)):
        raise RuntimeError(f"vLLM did not return the sampled token and {k} alternatives at every position")
    index = (starts[:, None] + 1 + np.arange(k)[None, :]).reshape(-1)
    ids = np.asarray(flat.token_ids, dtype=np.int32)[index].reshape(len(tokens), k)
    return ids, np.asarray(flat.logprobs, dtype=np.float32)[index].reshape(len(tokens), k)


def sampled_logprobs(tokens: list[int], flat: FlatLogprobs | None) -> np.ndarray:
    """The logprob of each sampled token, as float32, from vLLM's flat logprobs (`logprobs=0`, `flat_logprobs`).

    Each position's entries begin with the sampled token (vLLM's sampler puts it first; a top-0 request
    adds no others, a top-k one its k alternatives after it), so its logprob is the one at the position's start
    index.
    """
    if not tokens:
        return EMPTY_LOGPROBS
    if flat is None or len(flat.start_indices) != len(tokens):
        raise RuntimeError(f"vLLM returned logprobs for {0 if flat is None else len(flat)} of {len(tokens)} tokens")
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    if not np.array_equal(np.asarray(flat.token_ids, dtype=np.int64)[starts], np.asarray(tokens, dtype=np.int64)):
        raise RuntimeError("vLLM's logprobs are not those of the sampled tokens")
    return np.asarray(flat.logprobs, dtype=np.float32)[starts]

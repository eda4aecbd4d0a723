"""What the two vLLM engines share (in process, `vllm_engine`, and a server's client, `remote_engine`): vLLM's finish
reasons and its per-token weight-version labels, as ours. Imports nothing of vLLM, so `remote` runs without it."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from pipeline.wire import FinishReason

VLLM_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "repetition": "stop",
}
"""vLLM's finish reasons as ours, for both vLLM engines (in process and `remote`); "error" is an engine failure."""


def vllm_spans(labelled: Iterable[tuple[str, int, int]], n_tokens: int, version: int) -> list[tuple[int, int, int]]:
    """vLLM's per-token weight-version labels `(label, start, end)` as spans covering `[0, n_tokens)`; none reported:
    all of `version`. A label that is not a policy version, or spans with a gap, raise `RuntimeError`."""
    if not n_tokens:
        return []
    labelled = list(labelled)
    if not labelled:
        return [(version, 0, n_tokens)]
    try:
        spans = [(int(label), int(start), int(end)) for label, start, end in labelled if end > start]
    except ValueError:
        raise RuntimeError(
            f"vLLM labels its weights {[label for label, _, _ in labelled]}, not with policy versions "
            "(another client relabelled it: /update_weight_version)"
        ) from None
    if spans[0][1] != 0 or spans[-1][2] != n_tokens or any(a[2] != b[1] for a, b in itertools.pairwise(spans)):
        raise RuntimeError(f"vLLM weight-version spans {spans} do not cover {n_tokens} tokens")
    return spans

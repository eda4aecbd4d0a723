"""The reply's text for reward functions that read text: the scorer's tokenizer (`rollouts scorer --tokenizer DIR`).

The stage decodes each rollout's generated tokens (special tokens skipped) and passes the text in the view
(`rollout_view(rollout, text=...)`), so reward functions on RQ workers get it too, without a tokenizer of their own.
transformers is imported only here, only when a scorer is given a tokenizer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

Decode = Callable[[list[int]], str]
"""Token ids of one reply to its text."""


def load_decoder(path: Path | str) -> Decode:
    """The tokenizer of `path` (a local model or tokenizer directory) as a `Decode`. An id the tokenizer cannot
    decode (hostile input: negative, past the vocabulary) gives an empty text and a warning, never an exception."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))

    def decode(ids: list[int]) -> str:
        try:
            return str(tokenizer.decode(ids, skip_special_tokens=True))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # the stage must go on (a Rust panic in tokenizers is a BaseException)
            log.warning("cannot decode a reply of %d tokens: %s: %s", len(ids), type(exc).__name__, exc)
            return ""

    return decode

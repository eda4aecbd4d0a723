"""Chat messages to token ids, turn by turn, without ever re-tokenizing what the model wrote.

A trajectory must hold the exact tokens the model saw and wrote. Re-rendering the whole conversation
each turn would re-tokenize the model's replies (a byte-level BPE model often writes a non-canonical
split, "a"+"b" where the tokenizer says "ab"), so the trainer would score tokens the model never
produced. Instead, a later turn appends only the template's text *after* the last reply: the
conversation is rendered once with that reply replaced by a sentinel, and the text past the sentinel
(the end of the reply's turn, the tool and user messages, the generation prompt) is tokenized alone.
Special tokens separate the pieces, so the tokens are those of the whole rendering.

The text before the sentinel must equal the previous turn's prompt: a template that renders earlier
turns differently once the conversation grows (one that strips old reasoning, say) cannot give one
token sequence for the whole session, and such a turn is refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

SENTINEL = "\ue000rollouts-reply\ue001"
"""Private-use characters: no template or message contains them."""


class TemplateError(ValueError):
    """The chat template cannot render these messages, or not incrementally; the message says which."""


class ChatRenderer:
    """The model's tokenizer and chat template, as the gateway uses them."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template: /v1/chat/completions needs one")
        self.tokenizer = tokenizer
        # The gateway checks lengths against the workers' context itself; the tokenizer's own limit only warns.
        self.tokenizer.model_max_length = 1 << 62

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, prompt: bool) -> str:
        """The template's text of `messages` (with the assistant's generation prompt when `prompt`)."""
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tools=tools, add_generation_prompt=prompt, tokenize=False
            )
        except Exception as exc:  # jinja raises its own errors (TemplateError, UndefinedError, TypeError)
            raise TemplateError(f"the chat template cannot render these messages: {exc}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (its special tokens included as such; no BOS added: the template has it)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return self.encode(self.render(messages, tools, prompt=True))

    def next_turn(
        self,
        history: Sequence[dict[str, Any]],
        new: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        last_token: int | None,
    ) -> list[int]:
        """The tokens between the model's last reply (the last message of `history`) and its next one.

        `last_token`: the reply's last token when the model ended it with a stop token (its end of
        turn, e.g. `<|im_end|>`): the template's own copy of it is then not added a second time.
        A reply cut off by `max_tokens` gets the template's end of turn, as a token the model did not write.
        """
        marked = [*history[:-1], {**history[-1], "content": SENTINEL}, *new]
        text = self.render(marked, tools, prompt=True)
        if text.count(SENTINEL) != 1:
            raise TemplateError("the chat template does not render the assistant's reply verbatim")
        before, after = text.split(SENTINEL)
        if before != self.render(history[:-1], tools, prompt=True):
            raise TemplateError(
                "the chat template renders the earlier turns differently once the conversation grows, so this "
                "session cannot be one token sequence; start a new session (or keep `tools` the same every turn)"
            )
        if last_token is not None:
            own = self.token_text(last_token)
            if own and after.startswith(own):
                after = after[len(own) :]
        return self.encode(after)

    def reply_text(self, tokens: np.ndarray | Sequence[int]) -> str:
        """What the caller reads: the reply without special tokens (its end-of-turn token among them)."""
        return self._decode(tokens, skip_special=True)

    def token_text(self, token: int) -> str:
        return self._decode([token], skip_special=False)

    def decode(self, tokens: np.ndarray | Sequence[int]) -> str:
        return self._decode(tokens, skip_special=False)

    def _decode(self, tokens: np.ndarray | Sequence[int], skip_special: bool) -> str:
        """The tokens' text as the model wrote it (no clean-up of spaces around punctuation)."""
        ids = [int(t) for t in tokens]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

"""The OpenAI request shapes the gateway accepts, and its errors in OpenAI's shape.

What a rollout honours is modelled here; every other field a request carries is checked against the table in
`producers.gateway.sampling` (inert, accepted at its default only, or refused with a 400 that names it), so no
parameter is ever dropped silently.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.wire import INT64_MAX, MAX_SAMPLES


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message; `content` as text or text parts (images and audio are refused)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        """The plain dict a chat template reads, with `None`s dropped: also what two turns compare."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        fields: dict[str, Any] = {"role": self.role, "content": content or "", "name": self.name}
        fields |= {"tool_call_id": self.tool_call_id, "tool_calls": self.tool_calls}
        return {k: v for k, v in fields.items() if v is not None}


class Sampled(BaseModel):
    """What chat and completions share. Fields not modelled land in `model_extra` and are checked there
    (`producers.gateway.sampling.check_fields`)."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    """vLLM's extension: token ids that end a sample (besides the model's end of sequence), kept in its tokens."""
    min_tokens: int | None = Field(default=None, ge=0)
    """vLLM's extension: no stop (a stop token or string) before this many tokens; at most the completion's length."""
    top_k: int | None = None
    """vLLM's extension, as the knobs below (`pipeline.wire.Sampling`, ranges checked there, a 400 naming the field):
    None, 0 or -1 off."""
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    """OpenAI's, as `frequency_penalty`: in [-2, 2]."""
    frequency_penalty: float | None = None
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX - MAX_SAMPLES)
    stream: bool = False
    return_token_ids: bool = False
    """vLLM's extension: `prompt_token_ids` on the answer and `token_ids` on each choice."""
    return_tokens_as_token_ids: bool = False
    """vLLM's extension: each logprob's token as `token_id:{id}` rather than its text."""

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise OpenAIError(400, "stop strings must not be empty", param="stop")
        return stops


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    """With `logprobs`: the 0 to 20 most likely tokens of each position, most likely first (OpenAI's)."""
    tools: list[dict[str, Any]] | None = None

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampled):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    """One prompt (text or token ids) or a batch of them (as TRL sends): each is queued on its own, and the answer's
    choices come prompt by prompt, `n` each (choice `i * n + k` is sample `k` of prompt `i`), as vLLM orders them."""
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: bool | int | None = None
    """`true` or `0`: the sampled token's logprob (`token_logprobs`); k (1 to 20): also the k most likely tokens of
    each position (`top_logprobs`, with the sampled token's besides, as OpenAI's legacy completions)."""
    echo: Literal[False] = False

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt alone, or each of a list of prompts (texts, or token id lists); none may be empty."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        ids: list[int] = []
        batch: list[str | list[int]] = []
        for item in self.prompt:
            if isinstance(item, int):
                ids.append(item)
            else:
                batch.append(item)
        if any(len(p) == 0 for p in batch):
            raise OpenAIError(400, "a prompt of the batch is empty", param="prompt")
        return [ids] if ids else batch


class FinishRequest(BaseModel):
    """`POST /v1/sessions/{id}/finish`: the session's reward, and the group it joins."""

    model_config = ConfigDict(extra="forbid")

    reward: float | None = None
    group: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.@:-]{1,128}$")
    """Sessions of one task, for group-normalized advantages: the trajectory's `prompt_id`. None: the session's id."""
    group_size: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    """How many sessions the group has: its rollouts' `n`. Every session of a group must say the same."""
    meta: dict[str, Any] = Field(default_factory=dict)

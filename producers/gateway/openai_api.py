"""The OpenAI request shapes the gateway accepts, and its errors in OpenAI's shape.

Only what a rollout can honour is modelled; other OpenAI parameters are accepted and ignored (as
vLLM's server does), except where ignoring them would change the answer silently: `top_logprobs`
and completions' `logprobs` above 0 ask for alternatives the engines do not report, `echo` for text
the gateway does not return; those are refused.
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
    """What chat and completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX - MAX_SAMPLES)
    stream: bool = False
    return_token_ids: bool = False
    """vLLM's extension: `prompt_token_ids` on the answer and `token_ids` on each choice."""

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise OpenAIError(400, "stop strings must not be empty", param="stop")
        return stops


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    tools: list[dict[str, Any]] | None = None

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampled):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=0)
    echo: Literal[False] = False


class FinishRequest(BaseModel):
    """`POST /v1/sessions/{id}/finish`: the session's reward, and the group it joins."""

    model_config = ConfigDict(extra="forbid")

    reward: float | None = None
    group: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.@:-]{1,128}$")
    """Sessions of one task, for group-normalized advantages: the trajectory's `prompt_id`. None: the session's id."""
    group_size: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    """How many sessions the group has: its rollouts' `n`. Every session of a group must say the same."""
    meta: dict[str, Any] = Field(default_factory=dict)

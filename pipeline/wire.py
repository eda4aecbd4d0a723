"""Wire contract v1: key names, consumer groups and the fields of every entry.

This module is the public interface that `redis-cli` users and other languages see.
Everything that reads or writes a stream goes through the schemas here; change a name
or a field's meaning only together with a new `v`.

Field encoding: scalars as plain text, token ids as raw little-endian int32, logprobs as
raw little-endian float32, small maps as JSON.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from pipeline.codec import (
    FLOAT32,
    INT32,
    CodecError,
    decode_array,
    decode_json,
    decode_text,
    encode_float32,
    encode_int32,
    encode_json,
)

WIRE_VERSION = "1"
GENERATORS = "generators"
"""Consumer group of the workers on `prompts` and `partials`."""
TRAINER = "trainer"
"""Consumer group of the trainer on `rollouts`."""
MAX_SAMPLES = 4096
"""Largest `n` a prompt may ask for; more is rejected as bad input."""

FinishReason = Literal["stop", "length", "abort", "error"]
Fields = dict[bytes, bytes]
Int32Array = Annotated[np.ndarray, BeforeValidator(lambda value: np.asarray(value, dtype=INT32))]
Float32Array = Annotated[np.ndarray, BeforeValidator(lambda value: np.asarray(value, dtype=FLOAT32))]


class WireError(ValueError):
    """An entry that does not follow the contract. Its message says which field and why."""


class Keys:
    """Redis key names of one pipeline; all share the hash tag `{ns}` (one cluster slot)."""

    def __init__(self, ns: str) -> None:
        if not ns or any(c in ns for c in "{}: \t\n"):
            raise ValueError(f"namespace {ns!r} must be non-empty, without braces, colons or spaces")
        self.ns = ns
        tag = "{" + ns + "}"
        self.prompts = f"{tag}:prompts"
        self.partials = f"{tag}:partials"
        self.rollouts = f"{tag}:rollouts"
        self.control = f"{tag}:control"
        self.state = f"{tag}:state"
        self.dead = f"{tag}:dead"
        self.worker_prefix = f"{tag}:worker:"
        self.published_prefix = f"{tag}:published:"

    def worker(self, name: str) -> str:
        """Heartbeat hash of one worker; it expires when the worker stops beating."""
        return self.worker_prefix + name

    def published(self, rollout_id: str) -> str:
        """Marker set once a rollout id is on `rollouts`: the dedupe of redelivered work."""
        return self.published_prefix + rollout_id


class Sampling(BaseModel):
    """Sampling parameters of a prompt.

    Only types are checked on decode; ranges are checked by `problems()`, so that a prompt
    with, say, a negative temperature becomes error rollouts that its trainer sees rather
    than a dead letter nobody waits for.
    """

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None

    def problems(self) -> list[str]:
        found = []
        if self.max_tokens < 1:
            found.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            found.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            found.append(f"top_p must be in (0, 1], got {self.top_p}")
        return found


class Prompt(BaseModel):
    """A work item on `{ns}:prompts`: generate `n` samples from `tokens`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    id: str = Field(min_length=1)
    n: int = Field(ge=1, le=MAX_SAMPLES)
    tokens: Int32Array
    sampling: Sampling = Field(default_factory=Sampling)
    meta: dict[str, Any] = Field(default_factory=dict)
    submitted_version: int = 0
    ts: float = Field(default_factory=time.time)

    def to_fields(self) -> Fields:
        return {
            b"v": WIRE_VERSION.encode(),
            b"id": self.id.encode(),
            b"n": str(self.n).encode(),
            b"tokens": encode_int32(self.tokens),
            b"sampling": encode_json(self.sampling.model_dump(exclude_defaults=True)),
            b"meta": encode_json(self.meta),
            b"submitted_version": str(self.submitted_version).encode(),
            b"ts": repr(self.ts).encode(),
        }

    @classmethod
    def from_fields(cls, fields: Fields) -> Prompt:
        def parse(get: _FieldReader) -> Prompt:
            return cls(
                id=get.text(b"id"),
                n=get.text(b"n"),
                tokens=get.array(b"tokens", INT32),
                sampling=get.json(b"sampling", {}),
                meta=get.json(b"meta", {}),
                submitted_version=get.text(b"submitted_version", "0"),
                ts=get.text(b"ts", "0"),
            )

        return _decode(fields, parse)


class Rollout(BaseModel):
    """One generated sample on `{ns}:rollouts`, self-contained for training or replay."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_id: str
    sample: int = Field(ge=0)
    n: int = Field(ge=1, le=MAX_SAMPLES)
    """Samples in this rollout's group (its prompt's `n`), so a reader knows when the group is whole."""
    version: int
    version_end: int
    finish_reason: FinishReason
    worker: str
    prompt_tokens: Int32Array
    tokens: Int32Array
    logprobs: Float32Array
    spans: list[tuple[int, int, int]]
    meta: dict[str, Any] = Field(default_factory=dict)
    timing: dict[str, float] = Field(default_factory=dict)
    reward: float | None = None
    error: str | None = None

    @property
    def id(self) -> str:
        return rollout_id(self.prompt_id, self.sample)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def to_fields(self) -> Fields:
        fields = {
            b"v": WIRE_VERSION.encode(),
            b"id": self.id.encode(),
            b"prompt_id": self.prompt_id.encode(),
            b"sample": str(self.sample).encode(),
            b"n": str(self.n).encode(),
            b"version": str(self.version).encode(),
            b"version_end": str(self.version_end).encode(),
            b"n_tokens": str(self.n_tokens).encode(),
            b"finish_reason": self.finish_reason.encode(),
            b"worker": self.worker.encode(),
            b"prompt_tokens": encode_int32(self.prompt_tokens),
            b"tokens": encode_int32(self.tokens),
            b"logprobs": encode_float32(self.logprobs),
            b"spans": encode_json(self.spans),
            b"meta": encode_json(self.meta),
            b"timing": encode_json(self.timing),
        }
        if self.reward is not None:
            fields[b"reward"] = repr(self.reward).encode()
        if self.error is not None:
            fields[b"error"] = self.error.encode()
        return fields

    @classmethod
    def from_fields(cls, fields: Fields) -> Rollout:
        def parse(get: _FieldReader) -> Rollout:
            rollout = cls(
                prompt_id=get.text(b"prompt_id"),
                sample=get.text(b"sample"),
                n=get.text(b"n"),
                version=get.text(b"version"),
                version_end=get.text(b"version_end"),
                finish_reason=get.text(b"finish_reason"),
                worker=get.text(b"worker", ""),
                prompt_tokens=get.array(b"prompt_tokens", INT32),
                tokens=get.array(b"tokens", INT32),
                logprobs=get.array(b"logprobs", FLOAT32),
                spans=get.json(b"spans", []),
                meta=get.json(b"meta", {}),
                timing=get.json(b"timing", {}),
                reward=get.optional_text(b"reward"),
                error=get.optional_text(b"error"),
            )
            if len(rollout.logprobs) != len(rollout.tokens):
                raise WireError(f"logprobs has {len(rollout.logprobs)} values for {len(rollout.tokens)} tokens")
            return rollout

        return _decode(fields, parse)


def rollout_id(prompt_id: str, sample: int) -> str:
    """Deterministic, so that a redelivered prompt produces the same ids and dedupes."""
    return f"{prompt_id}:{sample}"


def dead_letter_fields(original: Fields, error: str, stage: str) -> Fields:
    """A dead letter: the original fields, plus why and where it failed."""
    return {**original, b"error": error.encode(), b"stage": stage.encode()}


class _FieldReader:
    def __init__(self, fields: Fields) -> None:
        self.fields = fields

    def raw(self, name: bytes) -> bytes:
        try:
            return self.fields[name]
        except KeyError:
            raise WireError(f"missing field {name.decode()!r}") from None

    def text(self, name: bytes, default: str | None = None) -> str:
        if default is not None and name not in self.fields:
            return default
        return decode_text(self.raw(name), name.decode())

    def optional_text(self, name: bytes) -> str | None:
        return self.text(name) if name in self.fields else None

    def array(self, name: bytes, dtype: np.dtype) -> np.ndarray:
        return decode_array(self.raw(name), dtype, name.decode())

    def json(self, name: bytes, default: Any) -> Any:
        return decode_json(self.fields[name], name.decode()) if name in self.fields else default


def _decode(fields: Fields, parse: Any) -> Any:
    """Check `v`, run the parser, and turn every failure into a `WireError` with one message."""
    version = fields.get(b"v")
    if version != WIRE_VERSION.encode():
        raise WireError(f"unsupported wire version v={version!r}, this reader speaks v={WIRE_VERSION}")
    try:
        return parse(_FieldReader(fields))
    except (CodecError, WireError) as exc:
        raise WireError(str(exc)) from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise WireError(problems) from None

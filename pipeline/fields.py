"""The wire messages' fields, declared once: each message of `pipeline.wire` lists its fields as specs, and one codec
writes and reads every message from them (the bytes of each kind as `pipeline.codec` makes them).

A `WireField` is one field of an entry: its name, its `Kind` (how its value becomes bytes and back), what a reader
takes when it is absent (`REQUIRED`: a `WireError`; `KEEP`: the model's own default; else that value), and when a
writer leaves it out (`omit`). A spec that spans several fields (`Inline`: a nested message's; `Shaped`: an array and
its shape; `Alternatives`: two `[n_tokens, k]` arrays) writes and reads them itself (`Spec`). The field order of an
entry is the order of its specs, after `v`. Each message class compiles its specs once, as it is made, into its
`Plan`: the codec that `to_fields` and `from_fields` run.
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Callable, MutableMapping
from copy import copy
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, ClassVar, Literal, Protocol, Self, Union, get_args, get_origin

import numpy as np
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from pipeline import codec
from pipeline.codec import CodecError, decode_array, decode_json, decode_text, encode_json

WIRE_VERSION = "1"
Fields = dict[bytes, bytes]
REQUIRED: Any = object()
"""`WireField.absent`: a reader refuses an entry without the field (`missing field 'NAME'`)."""
KEEP: Any = object()
"""`WireField.absent`: a reader leaves the field to the model's own default."""


class WireError(ValueError):
    """An entry that does not follow the contract. Its message says which field and why."""


@dataclass(frozen=True)
class Kind:
    """How a value of one field becomes bytes (`write`) and is read back (`read(raw, name)`, before the model
    validates it; an error names the field)."""

    write: Callable[[Any], bytes]
    read: Callable[[bytes, str], Any]
    inline: str = ""
    """`write` as an expression, the value in its `{}` (`str({}).encode()`), for a `Plan` to write in place of the
    call; "": the plan calls `write`."""


def _text(raw: bytes, name: str) -> str:
    """A field as text: the trainer reads a dozen a rollout, so the common case is a decode, and `decode_text`
    words what is wrong."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return decode_text(raw, name)


def _array(dtype: np.dtype) -> Callable[[bytes, str], np.ndarray]:
    return lambda raw, name: decode_array(raw, dtype, name)


TEXT = Kind(lambda value: str(value).encode(), _text, inline="str({}).encode()")
"""Strings and integers, as plain text."""
FLOAT = Kind(lambda value: repr(value).encode(), _text, inline="repr({}).encode()")
"""Floats, as Python writes them back exactly (`repr`)."""
INT32S = Kind(codec.encode_int32, _array(codec.INT32))
"""Arrays as raw little-endian values: int32 (token ids), float32 (logprobs), int16 (routed experts)."""
FLOAT32S = Kind(codec.encode_float32, _array(codec.FLOAT32))
INT16S = Kind(codec.encode_int16, _array(codec.INT16))
JSON = Kind(encode_json, decode_json)
TRIPLES = Kind(codec.encode_int_triples, decode_json)
"""`(version, start, end)` spans: JSON, written without its encoder's per-value work."""
MODEL = Kind(lambda value: encode_json(value.model_dump(exclude_defaults=True)), decode_json)
"""A nested model as JSON of the values that differ from its defaults (`Sampling`)."""


class FieldReader:
    """An entry's fields, as specs read them."""

    def __init__(self, fields: Fields) -> None:
        self.fields = fields

    def raw(self, name: str) -> bytes:
        try:
            return self.fields[name.encode()]
        except KeyError:
            raise WireError(f"missing field {name!r}") from None


class Spec(Protocol):
    """One part of a message's entry: written from the message into `fields`, read from the entry into `values`
    (the model's arguments, by name). A `late` one is read once the model is built (the others' values still there
    to read), its values set on it unvalidated, before its `check`."""

    late: ClassVar[bool]

    def write(self, message: Any, fields: Fields, shared: dict[int, bytes]) -> None: ...

    def read(self, get: FieldReader, values: MutableMapping[str, Any]) -> None: ...


def is_none(value: Any) -> bool:
    return value is None


def falsy(value: Any) -> bool:
    return not value


@dataclass(frozen=True)
class WireField:
    """One field: `name` (the model's attribute and the entry's field), `kind`, `absent` (what a reader takes when the
    entry lacks it), `omit` (the values a writer leaves out), `readable` (False: written from a property of the
    message, never read back), `shared` (encoded once per group of messages: `Message.to_fields`'s `shared`)."""

    name: str
    kind: Kind = TEXT
    absent: Any = REQUIRED
    omit: Callable[[Any], bool] | None = None
    readable: bool = True
    shared: bool = False
    key: bytes = field(init=False)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"a wire field is named as its model's attribute, not {self.name!r}")
        object.__setattr__(self, "key", self.name.encode())


def optional(name: str, kind: Kind = TEXT) -> WireField:
    """A field that may be None: left out of the entry then, and None when absent."""
    return WireField(name, kind, absent=None, omit=is_none)


@dataclass(frozen=True)
class Inline:
    """A nested message whose fields are the entry's own (a partial's prompt)."""

    name: str
    message: type[Message]
    late: ClassVar[bool] = False

    def write(self, message: Any, fields: Fields, shared: dict[int, bytes]) -> None:
        fields.update(getattr(message, self.name).to_fields())

    def read(self, get: FieldReader, values: MutableMapping[str, Any]) -> None:
        values[self.name] = self.message.from_fields(get.fields)


@dataclass(frozen=True)
class Shaped:
    """An optional array of `dims` dimensions, flat in field `name`, its shape as JSON in field `shape`: both or
    neither, the shape's sizes (`described`) multiplying to the number of values."""

    name: str
    shape: str
    kind: Kind
    dims: int
    described: str
    late: ClassVar[bool] = False

    def write(self, message: Any, fields: Fields, shared: dict[int, bytes]) -> None:
        value = getattr(message, self.name)
        if value is not None:
            fields[self.name.encode()] = self.kind.write(value)
            fields[self.shape.encode()] = encode_json(list(value.shape))

    def read(self, get: FieldReader, values: MutableMapping[str, Any]) -> None:
        if self.name.encode() not in get.fields:
            if self.shape.encode() in get.fields:
                raise WireError(f"{self.shape} without {self.name}")
            return
        raw_shape = get.fields.get(self.shape.encode())
        shape: Any = None if raw_shape is None else decode_json(raw_shape, self.shape)
        flat = self.kind.read(get.raw(self.name), self.name)
        sizes = isinstance(shape, list) and len(shape) == self.dims and all(type(d) is int and d >= 0 for d in shape)
        if not sizes or math.prod(shape) != len(flat):
            raise WireError(f"{self.shape}: {shape!r} is not {self.described} of the {len(flat)} values of {self.name}")
        try:
            values[self.name] = flat.reshape(shape)
        except ValueError as exc:  # sizes past what numpy indexes (a zero among them keeps the product small)
            raise WireError(f"{self.shape}: {shape!r}: {exc}") from None


@dataclass(frozen=True)
class Alternatives:
    """`top_token_ids` (int32) and `top_logprobs` (float32), flat, read as `[n_tokens, k]` arrays, `n_tokens` the
    length of the field `tokens` read before: both or neither, the same k >= 1 for every token."""

    tokens: str
    late: ClassVar[bool] = True

    def write(self, message: Any, fields: Fields, shared: dict[int, bytes]) -> None:
        if message.top_token_ids is not None and message.top_logprobs is not None:
            fields[b"top_token_ids"] = INT32S.write(message.top_token_ids)
            fields[b"top_logprobs"] = FLOAT32S.write(message.top_logprobs)

    def read(self, get: FieldReader, values: MutableMapping[str, Any]) -> None:
        present = [name for name in (b"top_token_ids", b"top_logprobs") if name in get.fields]
        if not present:
            return
        if len(present) == 1:
            raise WireError("top_token_ids and top_logprobs come together: one is missing")
        n_tokens = len(values[self.tokens])
        ids = INT32S.read(get.raw("top_token_ids"), "top_token_ids")
        logprobs = FLOAT32S.read(get.raw("top_logprobs"), "top_logprobs")
        if len(ids) != len(logprobs) or not n_tokens or not len(ids) or len(ids) % n_tokens:
            raise WireError(
                f"top_token_ids ({len(ids)} values) and top_logprobs ({len(logprobs)}) are not k >= 1 values for each "
                f"of the {n_tokens} tokens"
            )
        k = len(ids) // n_tokens
        values["top_token_ids"], values["top_logprobs"] = ids.reshape(n_tokens, k), logprobs.reshape(n_tokens, k)


class Plan:
    """A message class's codec, made once, as the class is made (`Message.__pydantic_init_subclass__`): its specs
    resolved into two functions written out as Python, as `dataclasses` writes an `__init__` (the per-call work of
    the hand-written codecs before it: no walk over the specs, no call a plain field). A `WireField` is a few lines of
    them (`source` shows them); another spec's own `write` and `read` are called in its place, in its order."""

    def __init__(self, message: type[Message]) -> None:
        self.names: dict[str, Any] = {
            "Model": message, "WireError": WireError, "FieldReader": FieldReader, "ChainMap": ChainMap, "copy": copy,
        }  # fmt: skip
        leading = [f"{b'v'!r}: {WIRE_VERSION.encode()!r}"]  # the plain fields up to the first other: one dict display
        shared, encode = list[str](), list[str]()
        decode, late = ["values = {}"], list[str]()
        if any(not isinstance(spec, WireField) for spec in message.FIELDS):
            decode.append("get = FieldReader(fields)")
        for i, spec in enumerate(message.FIELDS):
            if not isinstance(spec, WireField):
                self.names[f"spec{i}"] = spec
                encode.append(f"spec{i}.write(self, fields, shared)")
                (late if spec.late else decode).append(f"spec{i}.read(get, {'late' if spec.late else 'values'})")
                continue
            self.names |= {f"write{i}": spec.kind.write, f"read{i}": spec.kind.read, f"omit{i}": spec.omit}
            decode += self._reads(spec, i) if spec.readable else []
            if encode or spec.omit is not None:
                encode += self._writes(spec, i)
            elif spec.shared:
                shared += [f"value = self.{spec.name}", *self._once(spec, i, f"raw{i}")]
                leading.append(f"{spec.key!r}: raw{i}")
            else:
                leading.append(f"{spec.key!r}: {self._written(spec, i, f'self.{spec.name}')}")
        encode = [*shared, "fields = {", *(f"    {field}," for field in leading), "}", *encode]
        if any(not isinstance(spec, WireField) or spec.shared for spec in message.FIELDS):  # they write to `shared`
            encode.insert(0, "shared = {} if shared is None else shared")
        decode.append("message = Model(**values)")
        if late:
            decode += ["late = ChainMap({}, values)", *late, "for name, value in late.maps[0].items():"]
            decode.append("    setattr(message, name, value)")
        self.source = "\n".join(
            [
                "def to_fields(self, shared=None):",
                *("    " + line for line in [*encode, "return fields"]),
                "def decode(fields):",
                *("    " + line for line in [*decode, "return message"]),
            ]
        )
        exec(compile(self.source, f"<wire plan of {message.__name__}>", "exec"), self.names)
        self.encode: Callable[[Message, dict[int, bytes] | None], Fields] = self.names["to_fields"]
        self.decode: Callable[[Fields], Message] = self.names["decode"]

    def _writes(self, spec: WireField, i: int) -> list[str]:
        """The lines that write `spec`'s field into `fields`."""
        put = [f"fields[{spec.key!r}] = {self._written(spec, i, 'value')}"]
        if spec.shared:
            put = [*self._once(spec, i, "raw"), f"fields[{spec.key!r}] = raw"]
        if spec.omit is None:
            return [f"value = self.{spec.name}", *put]
        tests: dict[Callable[[Any], bool], str] = {is_none: "value is not None", falsy: "value"}
        test = tests.get(spec.omit, f"not omit{i}(value)")
        return [f"value = self.{spec.name}", f"if {test}:", *("    " + line for line in put)]

    def _written(self, spec: WireField, i: int, value: str) -> str:
        """The expression of `value`'s bytes: the kind's own (`Kind.inline`; a text field of a `str` type: its
        `encode()`), or a call of its `write`."""
        if spec.kind is TEXT and _is_str(self.names["Model"].model_fields.get(spec.name)):
            return f"{value}.encode()"
        return spec.kind.inline.format(value) if spec.kind.inline else f"write{i}({value})"

    def _once(self, spec: WireField, i: int, raw: str) -> list[str]:
        """The lines that set `raw` to the bytes of `value`, a value a group's messages share: encoded once a group."""
        return [
            f"{raw} = shared.get(id(value))",
            f"if {raw} is None:",
            f"    {raw} = shared[id(value)] = {self._written(spec, i, 'value')}",
        ]

    def _reads(self, spec: WireField, i: int) -> list[str]:
        """The lines that read `spec`'s field into `values`."""
        read = [f"    values[{spec.name!r}] = read{i}(raw, {spec.name!r})"]
        if spec.kind.read is _text:  # the common case in place: a decode (`_text` words a failure)
            decoded = f"        values[{spec.name!r}] = raw.decode()"
            read = ["    try:", decoded, "    except UnicodeDecodeError:", "    " + read[0]]
        lines = [f"raw = fields.get({spec.key!r})", "if raw is not None:", *read]
        if spec.absent is REQUIRED:
            return [*lines, "else:", f"    raise WireError({f'missing field {spec.name!r}'!r})"]
        if spec.absent is KEEP:
            return lines
        self.names[f"absent{i}"] = spec.absent
        absent = f"copy(absent{i})" if type(spec.absent) in (list, dict) else f"absent{i}"  # a list each, not one
        return [*lines, "else:", f"    values[{spec.name!r}] = {absent}"]


def _is_str(info: FieldInfo | None) -> bool:
    """Whether a model's field holds a `str` whenever it is not None (`str`, `str | None`, a `Literal` of strings)."""
    if info is None:  # a property
        return False
    kinds = get_args(info.annotation) if get_origin(info.annotation) in (Union, UnionType) else (info.annotation,)
    return all(
        kind is str or (get_origin(kind) is Literal and all(type(value) is str for value in get_args(kind)))
        for kind in kinds
        if kind is not type(None)
    )


class Message(BaseModel):
    """A wire message: its entry's fields are its `FIELDS`, after `v`, written and read by its `PLAN`."""

    FIELDS: ClassVar[tuple[WireField | Spec, ...]] = ()
    PLAN: ClassVar[Plan]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.PLAN = Plan(cls)
        cls.PLAN.encode.__doc__ = Message.to_fields.__doc__
        cls.to_fields = cls.PLAN.encode  # type: ignore[method-assign,assignment]  # the plan's, no call between

    def to_fields(self, shared: dict[int, bytes] | None = None) -> Fields:
        """The entry's fields. `shared`: encodings of the values this message may share with others of its group
        (a rollout's prompt tokens and meta), by the value's `id()`, filled as they are met: a group encodes them
        once. Pass one dict per group, and only while the messages live (an `id()` is reused after). Each message
        class has its `PLAN`'s in place of this one."""
        return self.PLAN.encode(self, shared)

    @classmethod
    def from_fields(cls, fields: Fields) -> Self:
        """Check `v`, read every spec, build and `check` the message; every failure a `WireError` with one message."""
        version = fields.get(b"v")
        if version != WIRE_VERSION.encode():
            raise WireError(f"unsupported wire version v={version!r}, this reader speaks v={WIRE_VERSION}")
        try:
            message = cls.PLAN.decode(fields)
            message.check()
            return message  # type: ignore[return-value]  # the plan of `cls` makes a `cls`
        except (CodecError, WireError) as exc:
            raise WireError(str(exc)) from None
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise WireError(problems) from None

    def check(self) -> None:
        """What the contract asks beyond the field types (a `WireError` naming the field); run on every read."""

"""Byte-level codec for stream fields.

Arrays travel as raw little-endian bytes (int32 token ids, float32 logprobs): they
are 2-7x cheaper to encode than msgpack lists and any language can read them.
Small maps travel as compact JSON so that `redis-cli` shows them as text.
Nothing is ever pickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

INT16 = np.dtype("<i2")
INT32 = np.dtype("<i4")
FLOAT32 = np.dtype("<f4")
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False)
"""One encoder for every field: `json.dumps` with these options builds a new one per call. No circular check: what we
encode came from JSON or through a pydantic model, which refuses a value that contains itself."""


def _c_encoder() -> Any:
    """CPython's C encoder with `_ENCODER`'s options, made once: `JSONEncoder.encode` makes a new one per call. None
    where there is none, or where it does not give `_ENCODER`'s bytes (another Python's signature)."""
    try:
        made = json.encoder.c_make_encoder(  # type: ignore[attr-defined]  # CPython-only, not in typeshed
            None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",", False, False, True
        )
        probe = {"a": [1, 2.5, None, True, "é\n"], "b": {"c": 1e300, "d": -0.0}}
        return made if "".join(made(probe, 0)) == _ENCODER.encode(probe) else None
    except Exception:
        return None


_C_ENCODER = _c_encoder()
_DECODER = json.JSONDecoder()


class CodecError(ValueError):
    """A field could not be decoded; the message names the field and why."""


def encode_int32(values: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=INT32).tobytes()


def encode_int16(values: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=INT16).tobytes()


def encode_float32(values: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=FLOAT32).tobytes()


def decode_array(raw: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    """Read a raw little-endian array; a length that is not a whole number of items is an error."""
    if len(raw) % dtype.itemsize:
        raise CodecError(f"{field}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte items")
    return np.frombuffer(raw, dtype=dtype)


def encode_json(value: Any) -> bytes:
    if _C_ENCODER is None:
        return _ENCODER.encode(value).encode()
    return "".join(_C_ENCODER(value, 0)).encode()


def encode_int_triples(rows: Sequence[Sequence[int]]) -> bytes:
    """`encode_json` of a list of `[int, int, int]` (a rollout's spans), byte for byte, without the general
    encoder's per-item dispatch: every rollout carries one. Anything else goes through `encode_json`."""
    if all(len(row) == 3 and type(row[0]) is type(row[1]) is type(row[2]) is int for row in rows):
        return ("[" + ",".join([f"[{row[0]},{row[1]},{row[2]}]" for row in rows]) + "]").encode()
    return encode_json(rows)


def decode_json(raw: bytes, field: str) -> Any:
    """Parse JSON; anything `json.loads` refuses is a `CodecError` naming the field.

    Besides `JSONDecodeError` that is `ValueError` (a number past Python's 4300-digit limit) and
    `RecursionError` (arrays nested ~1000 deep): both once escaped and killed the reader.
    """
    try:
        if raw[:1] in b"[{" and raw[1:2] not in b"\x00":  # what `json.loads` would detect as UTF-8, without detecting
            text = raw.decode("utf-8", "surrogatepass")
            value, end = _DECODER.raw_decode(text)  # a third of `json.loads`'s time: no whitespace to skip before
            return value if end == len(text) else json.loads(text)  # after it, `json.loads` decides (and words why)
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CodecError(f"{field}: not valid JSON ({str(exc)[:200]})") from None


def decode_text(raw: bytes, field: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise CodecError(f"{field}: not UTF-8 text") from None


# redis-py types its replies for both kinds of client, `bytes | str`; ours never set `decode_responses`, so every
# reply is bytes. These helpers say so once, where a reply is read, instead of a check or a cast at each use.

RawFields = dict[bytes, bytes]
"""A hash's or a stream entry's fields as our clients read them (the wire's `Fields`)."""


def as_text(value: bytes | str) -> str:
    """A reply's value (a hash field, a set member, a status) as text."""
    return value.decode() if isinstance(value, bytes) else value


def as_fields(reply: Mapping[bytes | str, bytes | str]) -> RawFields:
    """An `HGETALL` reply (or a stream entry's fields) as bytes to bytes: what our clients get."""
    return cast(RawFields, reply)


def as_entries(reply: object) -> list[tuple[bytes, RawFields]]:
    """An `XRANGE`/`XREVRANGE` reply: `(id, fields)` pairs in bytes. These commands never return a deleted entry
    (only `XCLAIM` and `XAUTOCLAIM` do, as an id with no fields), and never None."""
    return cast(list[tuple[bytes, RawFields]], reply)


def for_redis(fields: RawFields) -> dict[FieldT, EncodableT]:
    """Our fields as redis-py's `XADD` types them (its dict is invariant in its key and value types): the same map."""
    return cast("dict[FieldT, EncodableT]", fields)


def stream_ids(after: Mapping[str, bytes] | Mapping[str, str]) -> dict[KeyT, StreamIdT]:
    """Streams and the ids to read after, as redis-py's `XREAD`/`XREADGROUP` type them: the same pairs, in a dict."""
    return cast("dict[KeyT, StreamIdT]", dict(after))

"""Wire contract v1: field encodings, round trips and the errors bad entries get."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.codec import (
    INT32,
    CodecError,
    decode_array,
    decode_json,
    encode_float32,
    encode_int32,
    encode_int_triples,
    encode_json,
)
from pipeline.wire import Keys, Prompt, Rollout, Sampling, WireError, rollout_id


def make_rollout(**over: object) -> Rollout:
    fields = dict(
        prompt_id="p1",
        sample=2,
        n=4,
        version=3,
        version_end=4,
        finish_reason="length",
        worker="w1",
        prompt_tokens=[1, 2, 3],
        tokens=np.array([7, 8, 9, 10], np.int32),
        logprobs=np.array([-0.5, -1.25, -2.0, -0.125], np.float32),
        spans=[(3, 0, 2), (4, 2, 4)],
        meta={"task": "add", "nested": {"a": [1, 2]}},
        timing={"generate_s": 0.25},
    )
    fields.update(over)
    return Rollout(**fields)


def test_arrays_are_raw_little_endian() -> None:
    assert encode_int32([1, -2]) == b"\x01\x00\x00\x00\xfe\xff\xff\xff"
    assert encode_float32([1.0]) == b"\x00\x00\x80\x3f"
    assert decode_array(encode_int32([5, 6]), INT32, "tokens").tolist() == [5, 6]
    with pytest.raises(CodecError, match="tokens: 5 bytes"):
        decode_array(b"\x00" * 5, INT32, "tokens")


@pytest.mark.parametrize(
    "rows",
    [[], [(0, 0, 1024)], [[3, 0, 5], (4, 5, 9)], [(-(2**63), 0, 2**70)], [(True, 0, 1)], [(1.5, 0, 1)], [(1, 2)]],
)
def test_spans_encode_as_json_writes_them_and_decode_back(rows: list) -> None:
    """The fast paths (spans written without the json module, JSON read by `raw_decode`) are byte for byte and value
    for value what `json` gives, including the rows they leave to it (bools, floats, pairs)."""
    written = json.dumps(rows, separators=(",", ":")).encode()
    assert encode_int_triples(rows) == encode_json(rows) == written
    assert decode_json(written, "spans") == json.loads(written)
    for junk in (written + b" x", written + b"\n", b"[1]]", b"\xff[]"):
        try:
            expected = json.loads(junk)
        except ValueError:
            with pytest.raises(CodecError, match="spans: not valid JSON"):
                decode_json(junk, "spans")
        else:
            assert decode_json(junk, "spans") == expected


def test_keys_share_one_hash_tag() -> None:
    keys = Keys("exp1")
    names = [keys.prompts, keys.partials, keys.rollouts, keys.control, keys.state, keys.dead, keys.worker("a")]
    assert names[:6] == [f"{{exp1}}:{k}" for k in ("prompts", "partials", "rollouts", "control", "state", "dead")]
    assert all(name.startswith("{exp1}:") for name in names)
    with pytest.raises(ValueError, match="namespace"):
        Keys("a:b")


def test_prompt_round_trip_and_readable_fields() -> None:
    prompt = Prompt(id="p1", n=3, tokens=[4, 5, 6], sampling=Sampling(max_tokens=9, temperature=0.5), meta={"k": 1})
    fields = prompt.to_fields()
    assert set(fields) == {b"v", b"id", b"n", b"tokens", b"sampling", b"meta", b"submitted_version", b"ts"}
    assert fields[b"v"] == b"1" and fields[b"n"] == b"3"
    assert json.loads(fields[b"sampling"]) == {"max_tokens": 9, "temperature": 0.5}
    back = Prompt.from_fields(fields)
    assert back.tokens.tolist() == [4, 5, 6] and back.sampling == prompt.sampling and back.meta == {"k": 1}


def test_rollout_round_trip() -> None:
    rollout = make_rollout()
    fields = rollout.to_fields()
    assert fields[b"id"] == b"p1:2" == rollout_id("p1", 2).encode()
    assert fields[b"n_tokens"] == b"4" and fields[b"finish_reason"] == b"length"
    assert json.loads(fields[b"spans"]) == [[3, 0, 2], [4, 2, 4]]
    back = Rollout.from_fields(fields)
    assert back.tokens.tolist() == [7, 8, 9, 10]
    assert back.logprobs.tolist() == [-0.5, -1.25, -2.0, -0.125]
    assert back.spans == [(3, 0, 2), (4, 2, 4)] and back.meta == rollout.meta and back.error is None
    scored = Rollout.from_fields(make_rollout(reward=1.5, finish_reason="error", error="boom").to_fields())
    assert scored.reward == 1.5 and scored.error == "boom"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({b"v": b"2"}, "unsupported wire version"),
        ({b"n": b"zero"}, "n:"),
        ({b"n": b"0"}, "n:"),
        ({b"tokens": b"\x01\x02\x03"}, "tokens: 3 bytes"),
        ({b"sampling": b"{not json"}, "sampling: not valid JSON"),
        ({b"sampling": b'{"temperature": "hot"}'}, "sampling.temperature"),
        ({b"sampling": b'{"colour": 1}'}, "sampling.colour"),
        ({b"id": b"\xff\xfe"}, "id: not UTF-8"),
    ],
)
def test_bad_prompt_fields_say_what_is_wrong(change: dict[bytes, bytes], message: str) -> None:
    fields = Prompt(id="p", n=1, tokens=[1]).to_fields() | change
    with pytest.raises(WireError, match=message):
        Prompt.from_fields(fields)


def test_missing_field_and_mismatched_logprobs() -> None:
    fields = make_rollout().to_fields()
    with pytest.raises(WireError, match="missing field 'tokens'"):
        Rollout.from_fields({k: v for k, v in fields.items() if k != b"tokens"})
    with pytest.raises(WireError, match="3 values for 4 tokens"):
        Rollout.from_fields(fields | {b"logprobs": encode_float32([0.0, 0.0, 0.0])})


ROUTES = np.arange(6 * 2 * 2, dtype=np.int16).reshape(6, 2, 2)
"""Routed experts of `make_rollout()`: 3 prompt tokens and 4 generated, one route a position but the last's."""


def test_routed_experts_round_trip_as_int16_bytes_and_a_shape() -> None:
    fields = make_rollout(routed_experts=ROUTES).to_fields()
    assert fields[b"routed_experts"] == ROUTES.astype("<i2").tobytes() and fields[b"routed_experts_shape"] == b"[6,2,2]"
    back = Rollout.from_fields(fields).routed_experts
    assert back is not None and back.dtype == np.int16 and np.array_equal(back, ROUTES)
    assert Rollout.from_fields(make_rollout().to_fields()).routed_experts is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({b"routed_experts_shape": b"[6,4]"}, r"routed_experts_shape: \[6, 4\] is not \[positions, layers, top_k\]"),
        ({b"routed_experts_shape": str([10**31, 0, 0]).encode(), b"routed_experts": b""}, "routed_experts_shape"),
        ({b"routed_experts_shape": b"[4,4611686018427387904,0]", b"routed_experts": b""}, "routed_experts_shape"),
        ({b"routed_experts_shape": b"[6,2,-2]"}, "is not"),
        ({b"routed_experts_shape": b"[3,4,2]"}, r"routed_experts: shape \[3, 4, 2\], expected \[6, layers, top_k\]"),
        ({b"routed_experts_shape": b"{"}, "routed_experts_shape: not valid JSON"),
        ({b"routed_experts": b"\x01\x02\x03"}, "routed_experts: 3 bytes"),
    ],
)
def test_bad_routed_experts_say_what_is_wrong(change: dict[bytes, bytes], message: str) -> None:
    """What a reader of rollouts refuses as a `WireError` (a dead letter, never a crash of the trainer)."""
    with pytest.raises(WireError, match=message):
        Rollout.from_fields(make_rollout(routed_experts=ROUTES).to_fields() | change)
    shape_alone = {k: v for k, v in make_rollout(routed_experts=ROUTES).to_fields().items() if k != b"routed_experts"}
    with pytest.raises(WireError, match="routed_experts_shape without routed_experts"):
        Rollout.from_fields(shape_alone)


def test_sampling_ranges_are_problems_not_decode_errors() -> None:
    sampling = Sampling(temperature=-1, top_p=0, max_tokens=0)
    assert len(sampling.problems()) == 3
    assert Sampling().problems() == []


KNOBS = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": -0.5, "frequency_penalty": 0.25,
         "min_tokens": 3}  # fmt: skip


def test_sampling_knobs_round_trip_as_json_and_an_older_prompt_without_them_decodes_to_off() -> None:
    asked = Prompt(id="p1", n=2, tokens=[4, 5], sampling=Sampling(max_tokens=9, seed=7, **KNOBS))
    fields = asked.to_fields()
    assert json.loads(fields[b"sampling"]) == {"max_tokens": 9, "seed": 7, **KNOBS}  # readable in redis-cli
    assert Prompt.from_fields(fields).sampling == asked.sampling
    # A prompt written before the knobs existed (or by a producer that sets none) reads as every knob off ...
    older = fields | {b"sampling": b'{"max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 7}'}
    off = Prompt.from_fields(older).sampling
    assert (off.top_k, off.min_p, off.repetition_penalty, off.presence_penalty, off.frequency_penalty,
            off.min_tokens) == (0, 0.0, 1.0, 0.0, 0.0, 0)  # fmt: skip
    # ... and a prompt that sets none is written byte for byte as before: the knobs at "off" are left out.
    plain = Prompt(id="p1", n=2, tokens=[4, 5], sampling=Sampling(max_tokens=9, top_k=-1, min_p=0.0))
    assert plain.to_fields()[b"sampling"] == b'{"max_tokens":9}'
    assert fields[b"v"] == plain.to_fields()[b"v"] == b"1"


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"top_k": -2}, "top_k must be -1 or 0 (off) or >= 1, got -2"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0 (1: off), got 0.0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be > 0 (1: off), got inf"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in [-2, 2], got nan"),
        ({"min_tokens": 10, "max_tokens": 8}, "min_tokens must be in [0, max_tokens=8], got 10"),
        ({"min_tokens": -1}, "min_tokens must be in [0, max_tokens=64], got -1"),
    ],
)
def test_a_knob_out_of_range_is_a_problem_that_names_it_not_a_dead_letter(knobs: dict, message: str) -> None:
    fields = Prompt(id="p1", n=1, tokens=[4, 5]).to_fields() | {b"sampling": json.dumps(knobs).encode()}
    sampling = Prompt.from_fields(fields).sampling  # decodes: the worker answers with error rollouts
    assert sampling.problems() == [message]
    assert sampling.problem_fields() == [(message.split()[0], message)]

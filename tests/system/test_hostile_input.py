"""Hostile input, fuzzed: every stream a client can write, and the CLI's files (issue 12, item 3).

Two layers. The decoders (`Prompt/Partial/Rollout/Control.from_fields`, the prompts file, recordings)
take thousands of generated entries (hypothesis): random field maps, the contract's field names with
junk values, and valid entries with a field mutated (wrong types, huge and empty values, NaN/inf,
negative or too large `n`, odd byte lengths for arrays, bad JSON, a wrong `v`). Each either decodes to
an object that every later step accepts (the worker's generation path, the trainer's arrays, the
recorder's Parquet row, the scorer's JSON view, a re-encode) or is refused with a `WireError` whose
message names the field: never any other exception. Then a few hundred such entries go raw onto a
real Redis, read by a real worker, the trainer client, the scoring stage and the recorder: nothing
crashes or stalls, every bad entry is a dead letter or an error rollout with a reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import fakeredis
import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.engines.base import Generation, check_request
from consumers.engines.torch_scheduler import sampling_uniform
from consumers.scoring.inline import InlineBackend
from consumers.scoring.job import rollout_view, score_group
from consumers.scoring.stage import ScoringStage, StageSettings
from consumers.worker import Worker
from pipeline.codec import as_entries, encode_float32, encode_int32, for_redis
from pipeline.local import RedisServer
from pipeline.recording import Recorder, RecorderSettings, RecordingError, read_recording, to_table
from pipeline.streams import Entry, Streams
from pipeline.wire import (
    GENERATORS,
    SCORERS,
    TRAINER,
    Control,
    Fields,
    Partial,
    Prompt,
    Rollout,
    Sampling,
    WireError,
)
from producers.client import Batch, Group, RolloutClient
from producers.prompts_file import read_prompts_file
from tests.fixtures import StartWorker, wait_until

PROMPT_FIELDS = ("v", "id", "n", "tokens", "sampling", "meta", "submitted_version", "ts", "reward_fn")
PARTIAL_FIELDS = (*PROMPT_FIELDS, "sample", "generated", "logprobs", "spans")
ROLLOUT_FIELDS = (
    "v", "id", "prompt_id", "sample", "n", "version", "version_end", "n_tokens", "finish_reason", "worker",
    "prompt_tokens", "tokens", "logprobs", "spans", "meta", "timing", "reward", "error", "reward_fn", "reward_error",
)  # fmt: skip
CONTROL_FIELDS = ("v", "cmd", "epoch", "version", "uri", "mode", "worker", "adapter", "ts")
CONTEXT, VOCAB = 512, 1000
"""The limits the generation path is checked against (the tiny model's context; any vocabulary)."""
REWARD_FNS = ("tests.rewards:even_share", "sys:exit", "builtins:exit", "os:getcwd", "builtins:len", "no.such:f")
"""Import paths a hostile prompt may name: a real reward, functions that exit, take no argument, return an int,
and a module that does not exist. Each must end as a `reward` or a `reward_error`, never a dead scorer."""

# -- the junk: one catalogue for both layers ---------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE_INT = b"9" * 5_000
"""Past Python's 4300-digit limit for int(str): `json.loads` raises ValueError, not a JSON error."""
BLOB = b"\x00\xff" * 2**19
"""1 MiB of binary."""
SPECIAL = (
    b"", b"0", b"-1", b"1", b"2", b"4096", b"4097", b"nan", b"NaN", b"inf", b"-inf", b"1e999", b"1.5", b" 1 ", b"1_0",
    b"0x10", b"9" * 30, b"-" + b"9" * 30, HUGE_INT, b"true", b"null", b"[]", b"{}", b"\xff\xfe", b"\x00",
    b"\xed\xa0\x80", b"\"\\ud800\"", DEEP, b"{" * 5_000, b'{"a":' + HUGE_INT + b"}", b"[1e999]", b"[NaN]",
    b"{not json", b"\xef\xbb\xbf{}", "{}".encode("utf-16"), BLOB, b"9223372036854775808", b"-9223372036854775809",
    b"2147483648", b"stop", b"error", b"abort", b"weights", b"resume", b"pause", b"keep", b"sys:exit",
)  # fmt: skip
"""Hand-picked values that broke or nearly broke a reader: numbers at and past every bound, NaN/inf, deep and
huge JSON, invalid UTF-8 and surrogates, the command and reason words, a value that is a megabyte."""
BIG = (0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30)
"""Integers at the edges of int32 and int64 (Parquet columns, numpy and torch tensors)."""
DEEP_DICT = b'{"a":' * 900 + b"1" + b"}" * 900
"""Deep, yet under the JSON parser's limit: it decodes, and must go on through every reader."""
FIELD_JUNK: dict[str, tuple[bytes, ...]] = {
    "sampling": tuple(
        json.dumps(value).encode()
        for value in (
            {"seed": 2**64}, {"seed": 2**63 - 1}, {"seed": -1}, {"max_tokens": 0}, {"max_tokens": 10**30},
            {"temperature": -1}, {"temperature": 1e-300}, {"temperature": float("inf")}, {"top_p": float("nan")},
            {"top_p": 0}, {"stop_token_ids": [10**9]}, {"stop_token_ids": [2**40]}, {"seed": 1.5},
        )
    ),
    "tokens": (b"", encode_int32([10**6]), encode_int32([-5]), encode_int32([7] * 600), b"\x00" * 2**20),
    "n": (b"0", b"1", b"2", b"4096", b"4097", b"-1"),
    "sample": (b"0", b"1", b"5", b"-1", b"2147483648"),
    "version": (b"-1", b"9223372036854775807", b"9223372036854775808", b"-9223372036854775809"),
    "spans": (
        b"[]", b"[[0,0,1]]", b"[[0,0,3]]", b"[[0,0,1],[1,1,3]]", b"[[0,1,3]]", b"[[0,0,2147483648]]", b"[[1e99,0,3]]",
    ),
    "meta": (DEEP, DEEP_DICT, b'{"x":NaN}', b"[]", b'{"big":' + HUGE_INT + b"}"),
    "finish_reason": (b"error", b"abort", b"stop", b"oops"),
    "error": (b"", b"boom"),
    "ts": (b"nan", b"inf", b"-1e308", b"0"),
    "reward": (b"nan", b"inf", b"1e999", b"x"),
    "cmd": (b"weights", b"resume", b"stop", b"pause"),
    "epoch": (b"0", b"-1", b"9" * 30),
}  # fmt: skip
"""Values with a valid `v` and valid types that are still wrong (or nearly): out of range, out of order, at a limit."""

json_scalars = st.none() | st.booleans() | st.integers() | st.sampled_from(BIG) | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


ints = st.integers() | st.sampled_from(BIG)
int_text = ints.map(lambda i: str(i).encode())
float_text = st.floats().map(lambda f: repr(f).encode())
int32_arrays = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20).map(encode_int32)
float32_arrays = st.lists(st.floats(width=32), max_size=20).map(encode_float32)
spans = st.lists(st.lists(ints | st.floats() | st.text(max_size=3), max_size=4), max_size=4) | json_values
sampling = st.dictionaries(
    st.sampled_from(["max_tokens", "temperature", "top_p", "stop_token_ids", "seed", "colour"]),
    json_values | ints | st.lists(ints, max_size=3),
    max_size=5,
)
junk = (
    st.sampled_from(SPECIAL)
    | st.binary(max_size=40)
    | int_text
    | float_text
    | json_values.map(dumps)
    | int32_arrays
    | float32_arrays
    | st.binary(max_size=41).filter(lambda b: len(b) % 4)  # an odd byte length for an array
    | spans.map(dumps)
    | sampling.map(dumps)
    | st.sampled_from(REWARD_FNS).map(str.encode)
)
"""Any value of any field."""


def valid_prompt(pid: str, n: int = 2, **over: Any) -> Prompt:
    return Prompt(id=pid, n=n, tokens=[5, 17, 33], sampling=Sampling(max_tokens=4), meta={"k": 1}, **over)


def valid_rollout(pid: str, sample: int = 0, n: int = 1) -> Rollout:
    return Rollout(
        prompt_id=pid, sample=sample, n=n, version=0, version_end=1, finish_reason="length", worker="fz",
        prompt_tokens=[5, 17], tokens=[3, 4, 5], logprobs=[-0.5, -1.0, -2.0], spans=[(0, 0, 2), (1, 2, 3)],
        meta={"m": [1]}, timing={"generate_s": 0.1},
    )  # fmt: skip


def valid_partial(pid: str) -> Partial:
    return Partial(prompt=valid_prompt(pid, n=1), sample=0, generated=[3, 4], logprobs=[-0.5, -1.0], spans=[(0, 0, 2)])


def valid_control() -> Control:
    return Control(cmd="resume", epoch=0)


def field_maps(names: tuple[str, ...], base: Callable[[], Fields]) -> st.SearchStrategy[Fields]:
    """The three shapes of hostile entry: random keys, the contract's keys with junk, a valid entry mutated."""
    any_key = st.binary(max_size=10) | st.sampled_from([n.encode() for n in names])
    random_map = st.dictionaries(any_key, junk, max_size=12)
    contract = st.dictionaries(st.sampled_from([n.encode() for n in names]), junk, max_size=len(names)).map(
        lambda fields: fields | {b"v": b"1"} if b"v" not in fields else fields
    )

    @st.composite
    def mutated(draw: st.DrawFn) -> Fields:
        fields = dict(base())
        for _ in range(draw(st.integers(1, 3))):
            name = draw(st.sampled_from(names)).encode()
            if draw(st.integers(0, 4)) == 0:
                fields.pop(name, None)
            else:
                fields[name] = draw(st.sampled_from(FIELD_JUNK.get(name.decode(), SPECIAL)) | junk)
        return fields

    return random_map | contract | mutated()


class Decoded(Protocol):
    """A decoded wire entry: it encodes to fields again."""

    def to_fields(self) -> Fields: ...


class Decoder(Protocol):
    """A wire model's class as the streams' readers use it (`Prompt`, `Partial`, `Control`, `Rollout`)."""

    def from_fields(self, fields: Fields) -> Decoded: ...


def assert_names_a_field(error: WireError, names: tuple[str, ...]) -> None:
    """The message starts with the field it is about (`field: why`, `missing field 'x'`, `... v=`)."""
    if str(error).startswith("unsupported wire version v="):
        return
    match = re.match(r"(?:missing field ')?(\w+)", str(error))
    assert match and match.group(1) in names, f"the error names no field: {str(error)[:300]!r}"


def decode(kind: Decoder, fields: Fields, names: tuple[str, ...]) -> Any:
    """The decoder's answer: the object (which re-encodes to itself), or None after checking the refusal's message."""
    try:
        decoded = kind.from_fields(fields)
    except WireError as exc:
        assert_names_a_field(exc, names)
        return None
    assert kind.from_fields(decoded.to_fields()).to_fields() == decoded.to_fields()  # (NaN != NaN: compare bytes)
    return decoded


FUZZ = settings(
    deadline=None,
    database=None,  # nothing written into the checkout; CI runs derandomized anyway (hypothesis's ci profile)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
"""What every property test shares; each sets its own `max_examples`: together 9,600 generated entries and files
(~45 s on 2 cores), and the end-to-end test writes ~450 more: the issue's 10,000 a CI run."""


# -- layer 1: the decoders and what follows them --------------------------------------------------------


class FakeEngine:
    """The engine protocol's generate, checks included, without a model: a few tokens at the loaded version."""

    name = "fake"
    version = 3
    max_model_len = CONTEXT
    vocab_size = VOCAB

    async def generate(self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling) -> Generation:
        check_request(prompt_tokens, sampling, self.max_model_len, self.vocab_size, no_routes="it has no model")
        if sampling.seed is not None:  # what the torch engine does with it, for every row of a batch
            sampling_uniform(torch.tensor([sampling.seed]), torch.tensor([0]))
        k = min(2, sampling.max_tokens)
        return Generation(np.arange(k, dtype=np.int32), np.full(k, -1.0, np.float32), "length", [(3, 0, k)])


@pytest.fixture(scope="module")
def fake_worker() -> Worker:
    """A worker on fakeredis and `FakeEngine`: its real per-sample path, called directly."""
    return Worker(Streams(fakeredis.FakeRedis(), "fuzz"), FakeEngine(), name="fz")  # type: ignore[arg-type]  # a fake with only what the per-sample path calls


def check_trainer_side(rollout: Rollout) -> None:
    """Whatever decodes must survive every reader after the trainer's decode, and re-encode to itself."""
    again = Rollout.from_fields(rollout.to_fields())
    assert again.id == rollout.id and again.tokens.tolist() == rollout.tokens.tolist()
    Batch([Group(rollout.prompt_id, [rollout])]).to_arrays()
    to_table([rollout], "fuzz", [b"1-0"])
    json.dumps(rollout_view(rollout))  # the scoring job's argument (RQ's JSON serializer)


def generate(worker: Worker, prompt: Prompt, sample: int, done: Partial | None) -> None:
    """The worker's path for one sample: a rollout of the group (an error one says why) that every reader takes."""
    made = asyncio.run(worker._generate_sample(prompt, sample, Entry("{fuzz}:prompts", b"1-0", {}), done))
    assert isinstance(made, Rollout) and made.sample == sample and made.n == prompt.n
    assert (made.finish_reason == "error") == (made.error is not None)
    check_trainer_side(made)


work_entries = st.one_of(
    field_maps(PROMPT_FIELDS, lambda: valid_prompt("p").to_fields()).map(lambda f: (Prompt, f)),
    field_maps(PARTIAL_FIELDS, lambda: valid_partial("p").to_fields()).map(lambda f: (Partial, f)),
)
"""What a worker reads: prompts, and partials (a prompt's fields plus the sample generated so far)."""


@settings(FUZZ, max_examples=4500)
@given(work_entries)
def test_any_prompt_or_partial_entry_decodes_or_names_its_field_and_generates_or_errors(
    fake_worker: Worker, entry: tuple[type[Prompt] | type[Partial], Fields]
) -> None:
    kind, fields = entry
    decoded = decode(kind, fields, PARTIAL_FIELDS if kind is Partial else PROMPT_FIELDS)
    if isinstance(decoded, Partial):
        generate(fake_worker, decoded.prompt, decoded.sample, decoded)
    elif decoded is not None:
        for sample in {0, decoded.n - 1}:
            generate(fake_worker, decoded, sample, None)


@settings(FUZZ, max_examples=3000)
@given(field_maps(ROLLOUT_FIELDS, lambda: valid_rollout("p", 1, 2).to_fields()))
def test_any_rollout_entry_decodes_into_something_every_reader_takes_or_names_its_field(fields: Fields) -> None:
    rollout = decode(Rollout, fields, ROLLOUT_FIELDS)
    if rollout is not None:
        assert 0 <= rollout.sample < rollout.n
        check_trainer_side(rollout)


@settings(FUZZ, max_examples=1300)
@given(field_maps(CONTROL_FIELDS, lambda: valid_control().to_fields()))
def test_any_control_entry_decodes_or_names_its_field(fields: Fields) -> None:
    decode(Control, fields, CONTROL_FIELDS)


def test_named_cases_found_by_fuzzing() -> None:
    """Regressions: each of these once crashed a reader or stalled a consumer group (see the README)."""
    prompt = valid_prompt("p").to_fields()
    rollout = valid_rollout("p", 0, 2).to_fields()
    for fields, says in [
        (prompt | {b"meta": DEEP}, "meta: not valid JSON"),  # RecursionError escaped: a worker task died
        (prompt | {b"sampling": b'{"seed":' + HUGE_INT + b"}"}, "sampling: not valid JSON"),  # int-digits ValueError
        (rollout | {b"sample": b"2"}, "sample: 2 is not below n=2"),  # a group handed over with a sample missing
        (rollout | {b"version": b"9223372036854775808"}, "version:"),  # the recorder's int64 column overflowed
        (rollout | {b"spans": b"[[0,0,2147483648]]"}, "spans:"),  # ... and its int32 span ends
        (rollout | {b"spans": b"[[0,1,3]]"}, "spans:"),  # spans must cover [0, n_tokens) in order
        (rollout | {b"finish_reason": b"error"}, "error: a rollout with finish_reason=error must say why"),
    ]:
        with pytest.raises(WireError, match=re.escape(says)):
            (Rollout if b"prompt_id" in fields else Prompt).from_fields(fields)
    partial = valid_partial("p").to_fields() | {b"sample": b"1"}
    with pytest.raises(WireError, match=re.escape("sample: 1 is not below n=1")):
        Partial.from_fields(partial)
    # A seed past int64 made the torch engine's batched sampler raise: every row of the batch failed, retried
    # elsewhere, and the prompt was handed out until it became a dead letter ('deliver').
    assert all(any("seed" in p for p in Sampling(seed=s).problems()) for s in (2**63, 2**63 - 4095, -1))
    assert Sampling(seed=2**63 - 4096).problems() == [] == Sampling(seed=0).problems()
    # A reward function that calls exit() ended the scoring stage (SystemExit escaped its thread).
    assert "SystemExit" in score_group("sys:exit", [rollout_view(valid_rollout("p"))])["error"]
    # A token id past int32 raised OverflowError (not a validation error) out of `Prompt(...)` and `submit`.
    with pytest.raises(ValueError, match="tokens"):
        Prompt(id="p", n=1, tokens=[2**40])


def test_named_prompts_file_cases_found_by_fuzzing(tmp_path: Path) -> None:
    """A byte that is not UTF-8 made `rollouts submit` print a bare codec error naming no line; a deeply nested
    line raised RecursionError; a token id past int32 an OverflowError. Now each is one line of the report."""
    client = RolloutClient(fakeredis.FakeRedis(), "fuzz")
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"tokens": [1, 2]}\n\x80\n' + DEEP + b'\n{"tokens": [1099511627776]}\n')
    with pytest.raises(ValueError) as raised:
        read_prompts_file(path, client)
    report = str(raised.value)
    assert report.startswith(f"{path} has 3 bad lines, nothing was queued")
    assert "line 2: not UTF-8 text" in report and "line 3: not JSON (nested too deep)" in report
    assert "line 4: tokens: Value error, values must fit int32" in report


# -- the CLI's files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def file_client(tiny_model_dir: Path) -> Iterator[RolloutClient]:
    """A client on fakeredis with the tiny model's tokenizer: text prompts are tokenized as `rollouts submit` does."""
    client = RolloutClient(fakeredis.FakeRedis(), "fuzz", tokenizer=tiny_model_dir)
    yield client
    client.streams.redis.close()


prompt_line = st.fixed_dictionaries(
    {},
    optional={
        "id": json_values | st.text(max_size=8),
        "prompt": st.text(max_size=20) | json_values,
        "tokens": st.lists(ints, max_size=5) | json_values,
        "n": ints | json_values,
        "max_tokens": ints | json_values,
        "temperature": st.floats() | json_values,
        "top_p": st.floats() | json_values,
        "stop_token_ids": st.lists(ints, max_size=3) | json_values,
        "seed": ints | json_values,
        "meta": json_values,
        "chat": st.booleans() | json_values,
        "reward_fn": st.sampled_from(REWARD_FNS) | json_values,
        "colour": json_values,
    },
).map(dumps)
lines = st.lists(prompt_line | junk.filter(lambda b: b"\n" not in b and b"\r" not in b), min_size=0, max_size=6)


@settings(FUZZ, max_examples=500)
@given(lines)
def test_any_prompts_file_is_queued_whole_or_refused_line_by_line(
    file_client: RolloutClient, lines: list[bytes]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_bytes(b"\n".join(lines))
        try:
            prompts = read_prompts_file(path, file_client)
        except ValueError as exc:  # `rollouts submit` prints it as one clean error
            message = str(exc)
            assert message.startswith(str(path)), message[:300]
            numbers = [int(n) for n in re.findall(r"^  line (\d+): ", message, re.MULTILINE)]
            assert all(1 <= n <= len(lines) for n in numbers) and (numbers or "has no prompts" in message)
            return
    for prompt in prompts:
        assert Prompt.from_fields(prompt.to_fields()).id == prompt.id


@pytest.fixture(scope="module")
def recording_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real recording file (a few rollouts), to corrupt."""
    path = tmp_path_factory.mktemp("rec") / "r.parquet"
    import pyarrow.parquet as pq

    pq.write_table(to_table([valid_rollout(f"p{i}") for i in range(4)], "fuzz", [b"1-0"] * 4), path)
    return path.read_bytes()


@settings(FUZZ, max_examples=300)
@given(st.data())
def test_any_recording_file_is_read_or_refused_with_its_name(recording_bytes: bytes, data: st.DataObject) -> None:
    """`rollouts replay` reads files a person points it at: junk, truncated or bit-flipped Parquet."""
    content = data.draw(
        st.binary(max_size=200)
        | st.integers(0, len(recording_bytes)).map(lambda k: recording_bytes[:k])
        | st.lists(
            st.tuples(st.integers(0, len(recording_bytes) - 1), st.integers(1, 255)), min_size=1, max_size=8
        ).map(lambda flips: _flip(recording_bytes, flips))
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.parquet"
        path.write_bytes(content)
        try:
            rows = list(read_recording(path))
        except RecordingError as exc:
            assert str(path) in str(exc)
            return
    for row in rows:
        check_trainer_side(row.rollout)


def _flip(content: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(content)
    for at, mask in flips:
        out[at] ^= mask
    return bytes(out)


# -- layer 2: a few hundred hostile entries through real processes ------------------------------------

E2E_SEED = 20261122
JSON_JUNK: tuple[Any, ...] = (
    [], {}, [[0, 0, 1]], [[0, 0, 2]], [[2**63, 0, 2]], [[0, -1, 2]], {"max_tokens": 10**30}, {"max_tokens": 0},
    {"seed": 2**64}, {"seed": 2**63 - 1}, {"seed": -1}, {"temperature": 1e-300}, {"temperature": -1}, {"top_p": 0},
    {"stop_token_ids": [10**9]}, {"stop_token_ids": [2**40]}, {"colour": 1}, {"a": [1, {"b": None}]}, "text", 1.5,
    None, float("nan"), float("inf"), 2**70, [1, 2], {"generate_s": "slow"},
)  # fmt: skip
"""JSON values for any JSON field of an end-to-end entry (sampling, meta, spans, timing) and for any other."""


def junk_value(rng: random.Random) -> bytes:
    """One value drawn like hypothesis' `junk`, from a seeded generator."""
    roll = rng.random()
    if roll < 0.4:
        return rng.choice(SPECIAL)
    if roll < 0.55:
        return rng.randbytes(rng.randint(0, 40))
    if roll < 0.7:
        return str(rng.choice(BIG) * rng.choice((1, -1))).encode()
    if roll < 0.8:
        return encode_int32([rng.randint(-(2**31), 2**31 - 1) for _ in range(rng.randint(0, 6))])
    if roll < 0.93:
        return dumps(rng.choice(JSON_JUNK))
    return rng.choice(REWARD_FNS).encode()


def hostile_entry(rng: random.Random, names: tuple[str, ...], base: Fields) -> Fields:
    """Random keys, the contract's keys with junk (3 in 20 each), or `base` with 1-3 fields mutated."""
    roll = rng.random()
    if roll < 0.15:
        return {rng.randbytes(rng.randint(1, 8)): junk_value(rng) for _ in range(rng.randint(0, 8))}
    if roll < 0.3:
        return {b"v": b"1"} | {rng.choice(names).encode(): junk_value(rng) for _ in range(rng.randint(1, len(names)))}
    fields = dict(base)
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(names).encode()
        if rng.random() < 0.2:
            fields.pop(name, None)
        else:
            fields[name] = rng.choice(FIELD_JUNK.get(name.decode(), SPECIAL)) if rng.random() < 0.5 else junk_value(rng)
    return fields


STREAMS: dict[str, tuple[Decoder, tuple[str, ...]]] = {
    "prompts": (Prompt, PROMPT_FIELDS),
    "partials": (Partial, PARTIAL_FIELDS),
    "control": (Control, CONTROL_FIELDS),
    "rollouts": (Rollout, ROLLOUT_FIELDS),
}
"""The streams a client can write: each one's decoder and field names."""


def found_by_fuzzing(plan: Plan) -> None:
    """The cases the fuzzing found, written end to end every run whatever the generator draws."""
    prompt, rollout = valid_prompt("seed-past-int64", n=2).to_fields(), valid_rollout("r-found").to_fields()
    for stream, case, fields in [
        # Its seed made the torch sampler raise inside a batched step: every row of the batch failed with it.
        ("prompts", b"seed-past-int64", prompt | {b"sampling": b'{"max_tokens":4,"seed":18446744073709551616}'}),
        ("prompts", b"deep-meta", prompt | {b"id": b"deep-meta", b"meta": DEEP}),  # RecursionError killed a task
        ("prompts", b"reward-exits", valid_prompt("reward-exits", n=1, reward_fn="sys:exit").to_fields()),
        ("partials", b"sample-outside-group", valid_partial("q-found").to_fields() | {b"sample": b"1"}),
        ("rollouts", b"sample-outside-group", rollout | {b"sample": b"1"}),
        ("rollouts", b"version-past-int64", rollout | {b"version": b"9223372036854775808"}),  # killed the recorder
        ("rollouts", b"span-past-int32", rollout | {b"spans": b"[[0,0,2147483648]]"}),
        ("rollouts", b"error-without-reason", rollout | {b"finish_reason": b"error"}),
    ]:
        assert plan.add(stream, f"{stream}-{case.decode()}".encode(), fields), case


class Plan:
    """What was written where, and what each entry must become (worked out with the same decoders the readers use).

    Entries are drawn from `random.Random(E2E_SEED)` rather than hypothesis: against live processes there is
    nothing to shrink, and `@given` would start from its simplest example. An entry that decodes must also be
    cheap and unambiguous (a unique prompt id, a group that can be whole, a control command that changes
    nothing); one that is not is drawn again. Every entry carries a `_case` field that no reader reads.
    """

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.entries: dict[str, list[Fields]] = {"prompts": [], "partials": [], "control": [], "rollouts": []}
        self.errors: dict[bytes, str] = {}
        """`_case` -> the decode error its dead letter must carry."""
        self.groups: dict[str, int] = {}
        """Prompt id -> samples of every group that must reach the trainer."""
        self.scored: set[str] = set()
        """Prompt ids whose rollouts pass through the scoring stage."""
        self.raw: set[str] = set()
        """Prompt ids of the groups written straight onto rollouts (not made by the worker)."""

    def draw(self, stream: str, count: int) -> None:
        for i in range(count):
            while not self._accept(stream, f"{stream}-{i}".encode()):
                pass

    def _accept(self, stream: str, case: bytes) -> bool:
        """Draw one entry for `stream`; False (draw again) when it decodes to something the test cannot expect."""
        rng = self.rng
        base: Prompt | Partial | Control | Rollout
        if stream == "prompts":
            pid = f"fz-{case.decode()}"
            base = valid_prompt(pid, n=rng.choice((1, 2)), reward_fn=rng.choice((None, None, *REWARD_FNS)))
        elif stream == "partials":
            base = valid_partial(f"fz-{case.decode()}")
        elif stream == "control":
            base = valid_control()
        else:
            base = valid_rollout(f"fz-{case.decode()}")
        return self.add(stream, case, hostile_entry(rng, STREAMS[stream][1], base.to_fields()))

    def add(self, stream: str, case: bytes, fields: Fields) -> bool:
        """File an entry under its `case` with what it must become; False (and not filed) if that is unclear."""
        kind, _ = STREAMS[stream]
        fields = fields | {b"_case": case}
        try:
            decoded = kind.from_fields(fields)
        except WireError as exc:
            decoded, self.errors[case] = None, str(exc)
        if decoded is not None and not self._expect(decoded):
            return False
        self.entries[stream].append(fields)
        return True

    def _expect(self, decoded: Any) -> bool:
        if isinstance(decoded, Control):  # obeyed as it should be, so only commands that change nothing
            return (
                decoded.cmd == "resume"
                or (decoded.cmd == "weights" and decoded.epoch <= 0)
                or (decoded.cmd == "stop" and decoded.worker not in ("", "w1"))
            )
        if isinstance(decoded, Rollout):
            pid, n, reward_fn, cost = decoded.prompt_id, decoded.n, None, 0
        else:
            prompt = decoded.prompt if isinstance(decoded, Partial) else decoded
            pid, n, reward_fn = prompt.id, prompt.n, prompt.reward_fn
            cost = n * min(max(prompt.sampling.max_tokens, 0), CONTEXT)
        if pid in self.groups or cost > 1200 or (n != 1 and not isinstance(decoded, Prompt)):
            return False  # a taken id, too much work, or a lone sample of a group that could never be whole
        self.groups[pid] = n
        if isinstance(decoded, Rollout):
            self.raw.add(pid)
        if reward_fn:
            self.scored.add(pid)
        return True


def run_in_thread(target: Callable[[threading.Event], Any]) -> tuple[threading.Event, threading.Thread, list[Any]]:
    """Run `target(stop)` on a thread; what it returns or raises lands in the list."""
    stop, outcome = threading.Event(), []

    def main() -> None:
        try:
            outcome.append(target(stop))
        except BaseException as exc:  # reported by the test, whatever it is
            outcome.append(exc)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return stop, thread, outcome


def test_hostile_entries_on_every_stream_end_to_end(
    redis_server: RedisServer, ns: str, workers: StartWorker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hundreds of hostile entries, raw, onto prompts, partials, control and rollouts, mixed with valid prompts;
    a real worker (torch, tiny model), the trainer client, the scoring stage and the recorder read them."""
    monkeypatch.setenv("COLUMNS", "1000")  # the worker's log (rich) on one line a message, to search it
    # A worker's Redis replies time out after redis-py's 5 s, and a publish batch that outlives that leaves its prompt
    # pending for a claim (and a traceback in the log). Beside another test on 2 busy cores one did, so this worker
    # waits up to 30 s for a reply: the test is about hostile entries, not about a slow machine (its log must still
    # be clean). Its `--redis`, given again, is the one the worker takes.
    proc = workers("w1", "--redis", f"{redis_server.url}?socket_timeout=30")
    plan = Plan(E2E_SEED)
    for stream, count in (("prompts", 170), ("partials", 80), ("control", 60), ("rollouts", 130)):
        plan.draw(stream, count)
    found_by_fuzzing(plan)
    valid = [valid_prompt(f"ok-{i}", n=2, reward_fn="tests.rewards:even_share" if i < 3 else None) for i in range(12)]
    plan.groups |= {p.id: p.n for p in valid}
    plan.scored |= {p.id for p in valid if p.reward_fn}

    client = RolloutClient(redis_server.url, ns, trim_every_s=3600)  # keep every rollout to look at
    streams, r, keys = client.streams, client.streams.redis, client.streams.keys
    streams.ensure_scoring_group()
    scorer = ScoringStage(
        Streams(redis.Redis.from_url(redis_server.url), ns),
        InlineBackend(timeout_s=5, threads=2),
        "fz-scorer",
        StageSettings(lease_s=2),
    )
    recorder = Recorder(streams, tmp_path / "rec", RecorderSettings(roll_s=1, block_ms=200))
    threads = [run_in_thread(scorer.run), run_in_thread(recorder.run)]
    try:
        # Raw rollouts first, so that the trainer reads each before the last group a worker makes.
        for stream in ("rollouts", "control", "partials", "prompts"):
            pipe = r.pipeline(transaction=False)
            for fields in plan.entries[stream]:
                pipe.xadd(getattr(keys, stream), for_redis(fields))
            pipe.execute()
        streams.add_prompts(valid)

        got: dict[str, Group] = {}
        groups = client.groups(timeout=60)
        with contextlib.closing(groups):  # acks the last group handed over
            for group in groups:
                got[group.prompt_id] = group
                if len(got) == len(plan.groups):
                    break
        assert set(got) == set(plan.groups), f"missing groups {sorted(set(plan.groups) - set(got))[:10]}"
        last = r.xinfo_stream(keys.rollouts)["last-generated-id"]

        def recorder_read_all() -> bool:
            groups = r.xinfo_groups(keys.rollouts)
            return any(g["name"] == b"recorder" and g["last-delivered-id"] == last for g in groups)

        wait_until(recorder_read_all, 30, "the recorder to read every rollout")
    finally:
        for stop, _, _ in threads:
            stop.set()
        for _, thread, _ in threads:
            thread.join(timeout=30)
    for _, _, outcome in threads:
        assert outcome and not isinstance(outcome[0], BaseException), f"a reader died: {outcome!r}"

    # Every group whole; a failed generation or reward says why.
    for pid, group in got.items():
        assert [x.sample for x in group.rollouts] == list(range(plan.groups[pid]))
        made_here = pid not in plan.raw  # by the worker, not written straight onto rollouts
        for rollout in group.rollouts:
            assert rollout.finish_reason != "error" or rollout.error, rollout
            if made_here:
                assert rollout.finish_reason in ("stop", "length", "error")
                assert (rollout.finish_reason == "error") == bool(rollout.error), rollout
            if pid in plan.scored and rollout.finish_reason != "error":
                assert rollout.reward is not None or rollout.reward_error, rollout
    assert all(x.finish_reason != "error" for p in valid for x in got[p.id].rollouts)
    scored_errors = {x.reward_error for p in plan.scored for x in got[p].rollouts if x.reward_error}
    assert {e.split(":")[0] for e in scored_errors} <= {"sys", "builtins", "os", "no.such"}, scored_errors
    assert "SystemExit" in (got["reward-exits"].rollouts[0].reward_error or "")
    assert all("seed must be in" in (x.error or "") for x in got["seed-past-int64"].rollouts)

    # Every entry that does not decode is a dead letter, with the reason its reader gave and where; a bad
    # control entry (a broadcast that every worker reads, no consumer group) is logged and skipped.
    expected = {c: e for c, e in plan.errors.items() if not c.startswith(b"control")}
    wait_until(lambda: r.xlen(keys.dead) >= len(expected), 30, "the worker's last dead letters")
    dead = [fields for _, fields in as_entries(r.xrange(keys.dead))]
    letters = {fields[b"_case"]: fields for fields in dead}
    assert len(dead) == len(letters) and set(letters) == set(expected), "each bad entry is dead-lettered once"
    for case, fields in letters.items():
        stage = "trainer-decode" if case.startswith(b"rollouts") else "decode"
        assert fields[b"stage"].decode() == stage and fields[b"error"].decode() == expected[case]

    # Nothing pending in any group; the worker still serves, logged no traceback, and still obeys control.
    for stream, reader in ((keys.prompts, GENERATORS), (keys.partials, GENERATORS), (keys.rollouts, TRAINER),
                           (keys.scoring, SCORERS), (keys.rollouts, "recorder")):  # fmt: skip
        assert r.xpending(stream, reader)["pending"] == 0, (stream, reader)
    assert proc.poll() is None and r.hget(keys.worker("w1"), "status") == b"serving"
    bad_control = len(plan.errors) - len(expected)

    def skipped_control() -> int:
        return (tmp_path / "w1.log").read_text().count("ignoring a bad control entry")

    wait_until(lambda: skipped_control() >= bad_control, 30, "the worker to skip every bad control entry")
    assert bad_control > 20 and skipped_control() == bad_control
    log = (tmp_path / "w1.log").read_text()
    assert "Traceback" not in log and "stays pending" not in log, log[-3000:]
    # The recorder skipped what the trainer dead-lettered and recorded, readably, every rollout the trainer got.
    recorder_stats = threads[1][2][0]
    assert recorder_stats.bad == sum(c.startswith(b"rollouts") for c in plan.errors)
    recorded = {row.rollout.id for row in read_recording(tmp_path / "rec")}
    assert recorded == {x.id for g in got.values() for x in g.rollouts}
    streams.control.send(Control(cmd="stop"))
    wait_until(lambda: proc.poll() is not None, 60, "the worker to obey a stop sent after the junk")
    assert proc.returncode == 0

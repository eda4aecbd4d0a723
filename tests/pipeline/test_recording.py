"""Recording `{ns}:rollouts` to Parquet and replaying it: bit for bit, crash-safe, read by pandas, pyarrow, datasets."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from rich.table import Table

from pipeline.codec import as_entries, for_redis
from pipeline.local import RedisServer
from pipeline.processes import start_command, stop_process
from pipeline.recording import (
    SCHEMA,
    Recorder,
    RecorderSettings,
    read_recording,
    recording_files,
    replay,
    to_table,
)
from pipeline.streams import Streams, trim_consumed
from pipeline.top import render, snapshot
from pipeline.wire import RECORDER, TRAINER, Keys, Rollout
from producers.client import Batch, RolloutClient
from producers.replay import Recording
from tests.cli.test_cli import assert_clean_error, rollouts
from tests.fixtures import ENGINES_ON_BOTH_REDIS, REDIS_VERSIONS, StartWorker, wait_until

WITNESS = "witness"
"""A group that reads nothing and acks nothing: trimming never passes it, so the test keeps the wire's raw fields."""


def synthetic_group(prompt_id: str, n: int = 3, version: int = 0, seed: int = 0, tokens: int = 40) -> list[Rollout]:
    """A group with the awkward cases: an error sample, rewards and a reward error, float32 edge values, nested meta,
    routed experts (sample 0: int16's whole range, one per prompt and generated token but the last)."""
    rng = np.random.default_rng(seed)
    group = []
    for k in range(n):
        length = 0 if k == 1 else int(rng.integers(1, tokens))
        logprobs = -rng.exponential(2.0, length).astype(np.float32)
        if k == 2 and length >= 5:
            logprobs[:5] = np.array([-0.0, np.nan, -np.inf, -1e-45, -3.4e38], np.float32)
        group.append(
            Rollout(
                prompt_id=prompt_id,
                sample=k,
                n=n,
                version=version,
                version_end=version + (k == 2),
                finish_reason="error" if k == 1 else "length",
                worker=f"w{k}",
                prompt_tokens=rng.integers(0, 2**31 - 1, 7, dtype=np.int32),
                tokens=rng.integers(0, 50_000, length, dtype=np.int32),
                logprobs=logprobs,
                spans=[] if k == 1 else [(version, 0, max(1, length // 2)), (version + 1, max(1, length // 2), length)],
                meta={"answer": [1, {"ü": None}], "big": 2**62, "f": 0.1 + 0.2, "i": seed},
                timing={"queued_s": 0.25, "generate_s": float(rng.random()), "finished": 1.7e9 + rng.random()},
                reward=None if k == 1 else float(rng.normal()),
                error="prompt is too long for the context (600 > 512)" if k == 1 else None,
                reward_fn="my_rewards:exact_match",
                reward_error="my_rewards:exact_match: ValueError: no answer" if k == 1 else None,
                routed_experts=rng.integers(-(2**15), 2**15, (6 + length, 3, 2), dtype=np.int16) if k == 0 else None,
                top_token_ids=rng.integers(0, 50_000, (length, 3), dtype=np.int32) if k == 2 else None,
                top_logprobs=-rng.exponential(2.0, (length, 3)).astype(np.float32) if k == 2 else None,
            )
        )
    return group


def add_rollouts(client: redis.Redis, ns: str, rollouts: list[Rollout]) -> list[bytes]:
    """Put rollouts on `{ns}:rollouts` as a worker's publish does (XADD of `to_fields`), without markers."""
    pipe = client.pipeline(transaction=False)
    for rollout in rollouts:
        pipe.xadd(Keys(ns).rollouts, for_redis(rollout.to_fields()))
    return pipe.execute()


def wire_fields(client: redis.Redis, stream: str) -> dict[bytes, dict[bytes, bytes]]:
    return {fields[b"id"]: fields for _, fields in as_entries(client.xrange(stream))}


def group_info(client: redis.Redis, stream: str, group: str) -> dict | None:
    groups = client.xinfo_groups(stream) if client.exists(stream) else []
    return next((g for g in groups if g["name"] == group.encode()), None)


def has_read_up_to(client: redis.Redis, stream: str, group: str, last_id: bytes) -> bool:
    info = group_info(client, stream, group)
    return info is not None and info["last-delivered-id"] == last_id


def pending(client: redis.Redis, stream: str, group: str) -> int:
    return client.xpending(stream, group)["pending"]


def recorded_ids(directory: Path) -> list[str]:
    return [r.rollout.id for r in read_recording(directory)]


def test_rows_round_trip_every_field_bit_for_bit_and_pandas_pyarrow_datasets_read_them(tmp_path: Path) -> None:
    rollouts = [r for i in range(4) for r in synthetic_group(f"p{i}", version=i, seed=i)]
    path = tmp_path / "one.parquet"
    pq.write_table(to_table(rollouts, "exp1", [f"{i}-0".encode() for i in range(len(rollouts))]), path)

    back = list(read_recording(path))
    assert [r.rollout.to_fields() for r in back] == [r.to_fields() for r in rollouts]  # bytes: NaN, -0.0 included
    assert [(r.ns, r.entry_id) for r in back] == [("exp1", f"{i}-0") for i in range(len(rollouts))]

    schema = pq.read_schema(path)
    for name, kind in (("tokens", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float32())), ("sample", pa.int32())):
        assert schema.field(name).type == kind
    span = pa.struct([("version", pa.int64()), ("start", pa.int32()), ("end", pa.int32())])
    assert schema.field("spans").type == pa.list_(span)
    assert schema.names == SCHEMA.names

    frame = pd.read_parquet(tmp_path)
    assert list(frame["id"]) == [r.id for r in rollouts]
    assert frame["tokens"].iloc[0].dtype == np.int32 and frame["logprobs"].iloc[0].dtype == np.float32
    assert np.array_equal(frame["tokens"].iloc[3], rollouts[3].tokens)
    assert json.loads(frame["meta"].iloc[0]) == rollouts[0].meta
    assert frame["reward"].isna().tolist() == [r.reward is None for r in rollouts]
    routes = rollouts[0].routed_experts  # flat in its column, its shape beside it
    assert routes is not None and frame["routed_experts"].iloc[0].dtype == np.int16
    assert np.array_equal(frame["routed_experts"].iloc[0].reshape(frame["routed_experts_shape"].iloc[0]), routes)
    assert frame["routed_experts"].isna().tolist() == [r.routed_experts is None for r in rollouts]
    alternatives = rollouts[2].top_token_ids  # flat in its column: k a token
    assert alternatives is not None and frame["top_token_ids"].iloc[2].dtype == np.int32
    assert np.array_equal(frame["top_token_ids"].iloc[2].reshape(-1, 3), alternatives)
    assert frame["top_logprobs"].isna().tolist() == [r.top_logprobs is None for r in rollouts]
    version, start, end = rollouts[0].spans[1]
    assert frame["spans"].iloc[0][1] == {"version": version, "start": start, "end": end}

    table = pq.read_table(tmp_path)
    assert table.num_rows == len(rollouts) and table.column("error").null_count == len(rollouts) - 4

    import datasets

    data = datasets.load_dataset("parquet", data_files=str(tmp_path / "*.parquet"), cache_dir=str(tmp_path / "hf"))
    rows = data["train"]
    assert rows.num_rows == len(rollouts) and rows[5]["id"] == rollouts[5].id
    assert np.asarray(rows[5]["logprobs"], np.float32).tobytes() == rollouts[5].logprobs.tobytes()  # NaN too
    assert rows[5]["tokens"] == rollouts[5].tokens.tolist()
    assert json.loads(rows[2]["timing"]) == rollouts[2].timing


def test_the_recorder_rolls_by_size_and_acks_a_file_only_once_it_is_on_disk(
    redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    streams = Streams(client, ns)
    settings = RecorderSettings(roll_bytes=10_000, roll_s=3600, read_count=10, row_group_rows=10)
    recorder = Recorder(streams, tmp_path / "rec", settings)
    rollouts = [r for i in range(40) for r in synthetic_group(f"p{i}", seed=i)]
    ids = add_rollouts(client, ns, rollouts)
    stream = streams.keys.rollouts

    most_held = 0
    while not has_read_up_to(client, stream, RECORDER, ids[-1]):
        recorder.step()
        on_disk = recording_files(recorder.directory) if recorder.stats.files else []
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in on_disk)
        assert rows == recorder.stats.rollouts
        held = {p["message_id"] for p in client.xpending_range(stream, RECORDER, "-", "+", 1000)}
        written = {r.entry_id.encode() for r in read_recording(on_disk)} if on_disk else set()
        assert not held & written, "every entry in a finished file is acked"
        info = group_info(client, stream, RECORDER)
        assert info is not None
        delivered = ids.index(info["last-delivered-id"]) + 1
        assert len(held) + len(written) == delivered
        most_held = max(most_held, len(held))
    assert most_held > 0, "the open file's entries wait for it"
    recorder.close()
    assert pending(client, stream, RECORDER) == 0

    files = recording_files(recorder.directory)
    sizes = [f.stat().st_size for f in files]
    assert len(files) >= 4, sizes  # ~3 KB of footer a row group come on top of the data counted
    assert recorded_ids(recorder.directory) == [r.id for r in rollouts]  # each once, in order
    assert not list(recorder.directory.glob(".*.tmp"))


def test_the_recorder_rolls_by_time_while_no_rollout_comes(redis_server: RedisServer, ns: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_server.url)
    streams = Streams(client, ns)
    recorder = Recorder(streams, tmp_path, RecorderSettings(roll_s=0.6))
    for wave, size in enumerate((2, 1)):
        group = [r for i in range(size) for r in synthetic_group(f"wave{wave}-{i}", seed=i)]
        add_rollouts(client, ns, group)
        wait_until(lambda: recorder.step() is not None, 10, "the file to roll by age")
        assert recorder.stats.files[-1].exists() and pending(client, streams.keys.rollouts, RECORDER) == 0
        assert [r.rollout.id for r in read_recording(recorder.stats.files[-1])] == [r.id for r in group]
    assert len(recording_files(tmp_path)) == 2
    recorder.close()


@pytest.mark.parametrize("redis_server", REDIS_VERSIONS, indirect=True)
def test_trimming_waits_for_the_recorder(redis_server: RedisServer, ns: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_server.url)
    streams = Streams(client, ns)
    recorder = Recorder(streams, tmp_path, RecorderSettings(roll_s=3600))
    add_rollouts(client, ns, synthetic_group("a") + synthetic_group("b", seed=1))
    trainer = streams.trainer.read_rollouts("trainer-0", 100, None)
    streams.trainer.ack_rollouts([e.id for e in trainer])
    assert len(trainer) == 6
    trim_consumed(streams.redis, streams.keys.rollouts)
    assert client.xlen(streams.keys.rollouts) == 6, "the recorder has read none of them yet"
    recorder.step()
    assert pending(client, streams.keys.rollouts, RECORDER) == 6
    trim_consumed(streams.redis, streams.keys.rollouts)
    assert client.xlen(streams.keys.rollouts) == 6, "read, but not yet in a finished file"
    recorder.close()
    trim_consumed(streams.redis, streams.keys.rollouts)
    assert client.xlen(streams.keys.rollouts) == 0


def test_top_shows_the_recorders_group_with_its_lag_and_pending(
    redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    streams = Streams(client, ns)
    recorder = Recorder(streams, tmp_path, RecorderSettings(roll_s=3600, read_count=5))
    add_rollouts(client, ns, [r for i in range(3) for r in synthetic_group(f"p{i}", seed=i)])
    recorder.step()  # 5 read into the open file, 4 not yet read

    snap = snapshot(streams)
    groups = snap["streams"]["rollouts"]["groups"]
    assert groups[RECORDER] == {"lag": 4, "pending": 5, "consumers": 1}
    assert groups[TRAINER] == {"lag": 9, "pending": 0, "consumers": 0}
    table = render(snap).renderables[0]
    assert isinstance(table, Table)
    assert RECORDER in table.columns[2]._cells and "4" in table.columns[3]._cells
    recorder.close()


def test_a_recorder_killed_mid_file_loses_nothing(redis_server: RedisServer, ns: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_server.url)
    out, log = tmp_path / "rec", tmp_path / "record.log"
    stream = Keys(ns).rollouts
    roll_mb = 0.02
    args = ("record", "--redis", redis_server.url, "--ns", ns, "--to", str(out), "--roll-mb", str(roll_mb))
    first = [r for i in range(30) for r in synthetic_group(f"first-{i}", seed=i)]
    second = synthetic_group("second", seed=99)
    third = [r for i in range(4) for r in synthetic_group(f"third-{i}", seed=i)]
    assert to_table(first, ns, ["0-0"] * len(first)).nbytes > roll_mb * 2**20 > to_table(second, ns, ["0-0"] * 3).nbytes

    def add_at_once(rollouts: list[Rollout]) -> bytes:
        """In one MULTI, so that the recorder reads them in one read and its file holds all or none."""
        pipe = client.pipeline(transaction=True)
        for rollout in rollouts:
            pipe.xadd(stream, for_redis(rollout.to_fields()))
        return pipe.execute()[-1]

    recorder = start_command(*args, log_file=log)
    try:
        wait_until(lambda: group_info(client, stream, RECORDER) is not None, 60, "the recorder's group")
        add_at_once(first)  # more than --roll-mb: one finished file
        wait_until(lambda: len(list(out.glob("*.parquet"))) == 1, 30, "the first file")
        wait_until(lambda: pending(client, stream, RECORDER) == 0, 10, "its entries to be acked")
        add_at_once(second)  # a file opened, far from full: the recorder is killed with it open
        wait_until(
            lambda: bool(list(out.glob(".*.tmp"))) and pending(client, stream, RECORDER) == 3, 30, "an open file"
        )
        os.kill(recorder.pid, signal.SIGKILL)
        recorder.wait()
    finally:
        stop_process(recorder)

    (tmp,) = out.glob(".*.tmp")  # the open file, cut short
    assert len(pd.read_parquet(out)) == pq.read_table(out).num_rows == len(first)  # the .tmp is not read
    assert [r.id for r in Recording(out).rollouts()] == [r.id for r in first]
    assert pending(client, stream, RECORDER) == 3, "the open file's entries were never acked"

    add_at_once(third)  # while no recorder runs
    recorder = start_command(*args, log_file=log)
    try:
        wait_until(lambda: not tmp.exists(), 60, "the restarted recorder to remove the dead one's temporary file")
        wait_until(lambda: pending(client, stream, RECORDER) == 15, 30, "the restarted recorder to read on")
    finally:
        assert stop_process(recorder) == 0, log.read_text()  # SIGTERM: the open file is finished
    assert pending(client, stream, RECORDER) == 0
    assert not list(out.glob(".*.tmp"))
    published = first + second + third
    by_id = {r.rollout.id: r.rollout for r in read_recording(out)}
    assert sorted(by_id) == sorted(r.id for r in published), "every rollout recorded"
    assert all(by_id[r.id].to_fields() == r.to_fields() for r in published)
    assert "recorded 15 rollouts in 1 file to" in log.read_text()


def test_a_recorder_that_dies_between_rename_and_ack_records_twice_and_readers_dedupe(
    redis_server: RedisServer, ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    streams = Streams(client, ns)
    group = synthetic_group("a") + synthetic_group("b", seed=1)
    add_rollouts(client, ns, group)
    doomed = Recorder(streams, tmp_path, RecorderSettings(roll_s=3600))
    doomed.step()

    def die(*_: object) -> int:
        raise SystemExit("killed after the rename")

    monkeypatch.setattr(streams, "ack", die)
    with pytest.raises(SystemExit):
        doomed.close()
    monkeypatch.undo()
    assert len(recording_files(tmp_path)) == 1 and pending(client, streams.keys.rollouts, RECORDER) == 6

    successor = Recorder(streams, tmp_path, RecorderSettings(roll_s=3600))
    successor.step()  # re-reads what is still pending
    successor.close()
    assert pending(client, streams.keys.rollouts, RECORDER) == 0
    assert sorted(recorded_ids(tmp_path)) == sorted(2 * [r.id for r in group])
    recording = Recording(tmp_path)
    assert [r.id for r in recording.rollouts()] == [r.id for r in group]
    assert [len(g.rollouts) for g in recording.groups()] == [3, 3] and recording.stats["duplicates"] == 6


def test_a_second_recorder_on_the_same_directory_and_group_is_refused(
    redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    streams = Streams(redis.Redis.from_url(redis_server.url), ns)
    first = Recorder(streams, tmp_path)
    result = rollouts("record", "--redis", redis_server.url, "--ns", ns, "--to", str(tmp_path), timeout=60)
    assert_clean_error(result, "another recorder", "--group")
    first.close()
    with pytest.raises(ValueError, match="group of its own"):
        Recorder(streams, tmp_path, RecorderSettings(group=TRAINER))


def test_the_offline_source_yields_whole_deduped_groups_within_the_bound(
    redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    groups = [synthetic_group(f"p{i}", n=2 + i % 3, version=i % 4, seed=i) for i in range(12)]
    interleaved = [r for k in range(4) for g in groups for r in g[k : k + 1]]  # groups finish out of order
    files = [interleaved[:20], interleaved[15:]]  # 5 rollouts recorded twice, as across a crash
    for i, part in enumerate(files):
        ids = [f"{1000 * i + j}-0".encode() for j in range(len(part))]
        pq.write_table(to_table(part, ns, ids), tmp_path / f"part{i}.parquet")
    pq.write_table(to_table(synthetic_group("cut", n=3)[:2], "other", [b"1-1", b"1-2"]), tmp_path / "part2.parquet")

    recording = Recording(tmp_path, ns=ns)
    got = list(recording.groups())
    assert sorted(g.prompt_id for g in got) == sorted(f"p{i}" for i in range(12))
    for group in got:
        original = groups[int(group.prompt_id[1:])]
        assert [r.to_fields() for r in group.rollouts] == [r.to_fields() for r in original]
    assert recording.stats == {"received": len(interleaved), "duplicates": 5, "groups": 12, "stale": 0}
    assert recording.incomplete == {}, "the cut group was recorded from another namespace"
    everything = Recording(tmp_path)
    assert len(everything.collect(20)) == 12 and everything.incomplete == {"cut": [0, 1]}
    assert [g.prompt_id for g in everything.collect(2)] == [g.prompt_id for g in got[:2]]

    fresh = list(recording.groups(max_staleness=1, trainer_version=3))
    assert {g.prompt_id for g in fresh} == {f"p{i}" for i in range(12) if i % 4 >= 2}
    assert all(g.trainer_version == 3 for g in fresh)
    assert recording.stale and recording.stats["stale"] == sum(len(groups[i]) for i in range(12) if i % 4 < 2)
    with pytest.raises(ValueError, match="trainer_version"):
        next(recording.groups(max_staleness=1))

    reads: list[int] = []

    def version() -> int:
        reads.append(1)
        return 3

    batches = list(recording.batches(2, max_staleness=1, trainer_version=version))
    assert [len(b.groups) for b in batches] == [2, 2, 2] and all(b.trainer_version == 3 for b in batches)
    assert all(g.staleness(3) <= 1 for b in batches for g in b.groups)
    assert len(reads) < 12, "read once per full batch, not per group"

    # `to_arrays` is the live client's: the same groups through Redis give the same arrays.
    client = redis.Redis.from_url(redis_server.url)
    add_rollouts(client, ns, interleaved)
    live = RolloutClient(redis_server.url, ns)
    for offline, online in zip(Recording(tmp_path, ns=ns).batches(3), live.batches(3, timeout=10), strict=False):
        assert [g.prompt_id for g in offline.groups] == [g.prompt_id for g in online.groups]
        a, b = offline.to_arrays(), online.to_arrays()
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)
        if offline.groups[-1].prompt_id == got[-1].prompt_id:
            break
    else:
        raise AssertionError("the live client never reached the last group")


def test_replay_gives_every_field_back_and_a_second_replay_adds_nothing(
    redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    streams = Streams(client, ns)
    recorder = Recorder(streams, tmp_path / "rec", RecorderSettings(roll_bytes=20_000, roll_s=3600, read_count=20))
    client.xgroup_create(streams.keys.rollouts, WITNESS, id="0")
    last = add_rollouts(client, ns, [r for i in range(30) for r in synthetic_group(f"p{i}", seed=i)])[-1]
    while not has_read_up_to(client, streams.keys.rollouts, RECORDER, last):
        recorder.step()
    recorder.close()
    original = wire_fields(client, streams.keys.rollouts)
    assert len(original) == 90 and len(recording_files(tmp_path / "rec")) > 1

    target = f"{ns}-replayed"
    started = time.monotonic()
    first = rollouts("replay", str(tmp_path / "rec"), "--redis", redis_server.url, "--ns", target, "--rate", "150")
    took = time.monotonic() - started
    assert first.returncode == 0, first.stderr
    assert "replayed 90 recorded rows onto {" + target + "}:rollouts: 90 added, 0 already there" in first.stderr
    assert took >= 90 / 150, "paced at --rate"
    assert wire_fields(client, Keys(target).rollouts) == original  # every field, byte for byte

    again = replay(Streams(client, target), tmp_path / "rec")
    assert (again.read, again.added, again.present) == (90, 0, 90)
    assert client.xlen(Keys(target).rollouts) == 90
    replayed = RolloutClient(redis_server.url, target).collect(30, timeout=10)
    assert sorted(g.prompt_id for g in replayed) == sorted(f"p{i}" for i in range(30))


def test_record_and_replay_errors_are_one_line(redis_server: RedisServer, ns: str, tmp_path: Path) -> None:
    url = redis_server.url
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "a-file").write_text("")
    cases = [
        (("replay", str(tmp_path / "missing"), "--redis", url, "--ns", ns), ["no recording at"]),
        (("replay", str(tmp_path / "empty"), "--redis", url, "--ns", ns), ["no Parquet files in"]),
        (("replay", str(tmp_path / "junk"), "--redis", url, "--ns", ns), ["x.parquet: not a readable Parquet file"]),
        (("replay", str(tmp_path / "empty"), "--redis", url, "--ns", ns, "--rate", "0"), ["--rate", "> 0"]),
        (("record", "--to", str(tmp_path / "a-file"), "--redis", url, "--ns", ns), ["is a file"]),
        (("record", "--to", str(tmp_path / "r"), "--redis", url, "--ns", ns, "--group", "trainer"), ["of its own"]),
        (("record", "--to", str(tmp_path / "r"), "--redis", url, "--ns", ns, "--roll-mb", "0"), ["--roll-mb"]),
    ]
    for args, needles in cases:
        assert_clean_error(rollouts(*args, timeout=60), *needles)


RECORDED_RUNS = [
    pytest.param(
        *param.values,
        marks=[*param.marks, pytest.mark.long("recorded as bytes, whatever engine wrote them: [torch-installed]")],
        id=param.id,
    )
    if "vllm" in param.values
    else param
    for param in ENGINES_ON_BOTH_REDIS
]
"""`ENGINES_ON_BOTH_REDIS`, the vLLM run in the long tier: the recorder and the replay read and write the stream's
fields as bytes, never asking which engine wrote them, so the torch runs check the same path."""


@pytest.mark.parametrize(("engine", "redis_server"), RECORDED_RUNS, indirect=["redis_server"])
def test_a_run_with_real_workers_records_and_replays_bit_for_bit(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, workers: StartWorker, engine: str, tmp_path: Path
) -> None:
    url, out, log = redis_server.url, tmp_path / "rec", tmp_path / "record.log"
    keys = Keys(ns)
    client = RolloutClient(url, ns, tokenizer=tiny_model_dir, trim_every_s=0)  # trims at every ack
    r = client.streams.redis
    r.xgroup_create(keys.rollouts, WITNESS, id="0")
    recorder = start_command("record", "--redis", url, "--ns", ns, "--to", str(out), "--roll-mb", "0.01", log_file=log)
    try:
        wait_until(lambda: group_info(r, keys.rollouts, RECORDER) is not None, 60, "the recorder's group")
        workers("w1", "--engine", engine)
        ids = [client.submit(f"what is {i} + {i}?", n=3, max_tokens=16, seed=i, meta={"i": i}) for i in range(4)]
        ids += [client.submit(tokens=[5 + i, 17, 33], n=3, max_tokens=16, temperature=0.8) for i in range(4)]
        live = client.collect(len(ids), timeout=180)
        last = as_entries(r.xrevrange(keys.rollouts, count=1))[0][0]
        wait_until(lambda: has_read_up_to(r, keys.rollouts, RECORDER, last), 30, "the recorder to read every rollout")
    finally:
        assert stop_process(recorder) == 0, log.read_text()
    original = wire_fields(r, keys.rollouts)
    assert len(original) == 24 and pending(r, keys.rollouts, RECORDER) == 0
    assert "recorded 24 rollouts in" in log.read_text()

    # The files hold the wire's own bytes, and read back as the trainer got them.
    recorded = {x.rollout.id.encode(): x.rollout.to_fields() for x in read_recording(out)}
    assert recorded == original
    offline = Recording(out).collect(100)
    assert [g.prompt_id for g in offline] == [g.prompt_id for g in live]
    a, b = Batch(offline).to_arrays(), Batch(live).to_arrays()
    assert all(np.array_equal(a[k], b[k]) for k in a)

    # Back onto a fresh namespace: every field, bit for bit; onto the run's own (and again): nothing added.
    target = f"{ns}-replayed"
    for namespace, added in ((target, 24), (target, 0), (ns, 0)):
        result = rollouts("replay", str(out), "--redis", url, "--ns", namespace)
        assert result.returncode == 0, result.stderr
        assert f": {added} added, {24 - added} already there" in result.stderr, result.stderr
    assert wire_fields(r, Keys(target).rollouts) == original
    assert r.xlen(keys.rollouts) == 24

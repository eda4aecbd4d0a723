"""Rewards scored by the scoring stage (`rollouts scorer`), inline and on RQ workers, across processes.

What a user notices: every group reaches the trainer scored (`reward` on every rollout, readable in
`redis-cli`), with the value their function gives; a function that raises, hangs or returns junk
gives the group a `reward_error` and the loop goes on; a scorer (an RQ worker, or the stage itself)
killed mid-job loses nothing; and nothing is pickled on the way.

The workers run the synthetic engine: rewards are computed from whatever tokens arrive, so the engine's numbers are
not what is tested, and a synthetic worker serves after ~3.5 s (torch: ~10 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import psutil
import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from consumers.scoring.backend import Outcome
from consumers.scoring.inline import InlineBackend
from consumers.scoring.job import load_reward_fn, score_group
from consumers.scoring.rq_backend import RQBackend
from pipeline.codec import as_entries, as_fields, for_redis
from pipeline.local import RedisServer
from pipeline.processes import start_command, stop_process
from pipeline.top import snapshot
from pipeline.wire import Keys, Prompt, Rollout, WireError
from producers.client import Group, RolloutClient
from producers.prompts_file import read_prompts_file
from tests import rewards
from tests.fixtures import REDIS_VERSIONS, StartWorker, wait_until

StartScoring = Callable[..., subprocess.Popen[bytes]]
"""`start(command, *args, name=...)`: `rollouts scorer` or `rollouts score-worker` in a process of its own."""


def view(tokens: list[int], sample: int = 0, finish: str = "length") -> dict:
    return {"id": f"p:{sample}", "prompt_id": "p", "sample": sample, "n": 2, "prompt_tokens": [1], "tokens": tokens,
            "finish_reason": finish, "version": 0, "meta": {}, "error": None}  # fmt: skip


# -- the job, without Redis ----------------------------------------------------------------------


def test_the_job_scores_rollouts_groups_and_async_functions() -> None:
    group = [view([2, 4, 5, 7]), view([2], sample=1)]
    assert score_group("tests.rewards:even_share", group) == {"rewards": [0.5, 1.0]}
    assert score_group("tests.rewards:async_even_share", group) == {"rewards": [0.5, 1.0]}
    assert score_group("tests.rewards:rank_by_length", group) == {"rewards": [0.5, 0.0]}
    failed = [view([2]), view([], sample=1, finish="error")]
    assert score_group("tests.rewards:even_share", failed) == {"rewards": [1.0, None]}  # no reward for no generation


@pytest.mark.parametrize(
    ("reward_fn", "says"),
    [
        ("tests.rewards:raises", "ValueError: cannot parse the answer"),
        ("tests.rewards:not_a_number", "a reward must be a finite number, got 'high' (str)"),
        ("tests.no_such_module:f", "cannot import reward module 'tests.no_such_module'"),
        ("tests.rewards:missing", "has no 'missing'"),
    ],
)
def test_a_failing_reward_function_is_a_result_that_says_why(reward_fn: str, says: str) -> None:
    result = score_group(reward_fn, [view([2])])
    assert set(result) == {"error"} and says in result["error"] and reward_fn in result["error"]


def test_reward_fn_travels_on_the_wire_and_a_bad_one_is_refused() -> None:
    prompt = Prompt(id="p", n=2, tokens=[1, 2], reward_fn="my_rewards.math:exact_match")
    assert Prompt.from_fields(prompt.to_fields()).reward_fn == "my_rewards.math:exact_match"
    assert Prompt.from_fields(Prompt(id="q", n=1, tokens=[1]).to_fields()).reward_fn is None
    fields = prompt.to_fields() | {b"reward_fn": b"not a path"}
    with pytest.raises(WireError, match="reward_fn"):
        Prompt.from_fields(fields)
    rollout = Rollout(prompt_id="p", sample=0, n=1, version=0, version_end=0, finish_reason="stop", worker="w",
                      prompt_tokens=[1], tokens=[2], logprobs=[-1.0], spans=[(0, 0, 1)], reward_fn="m:f",
                      reward_error="m:f: ValueError: x")  # fmt: skip
    back = Rollout.from_fields(rollout.to_fields())
    assert (back.reward_fn, back.reward_error, back.reward) == ("m:f", "m:f: ValueError: x", None)
    with pytest.raises(ValueError, match="import path"):
        load_reward_fn("no-colon")


def test_an_inline_call_past_its_timeout_is_a_reward_error_at_once() -> None:
    backend = InlineBackend(timeout_s=0.1, threads=1)
    backend.submit("g", "tests.rewards:slow", [view([2]), view([4], sample=1)])  # 0.3 s a rollout
    outcomes: list[Outcome] = []

    def polled() -> bool:
        outcomes.extend(backend.poll())
        return bool(outcomes)

    wait_until(polled, 5, "the inline timeout")
    assert outcomes[0].key == "g" and outcomes[0].error == "timed out after 0.1 s (inline scoring)"
    backend.close()


def test_rq_jobs_lost_attempts_times_give_a_reward_error(redis_server: RedisServer, ns: str) -> None:
    """No RQ worker: each job is deleted, as RQ does with one whose worker died and whose record expired."""
    connection = redis.Redis.from_url(redis_server.url)
    backend = RQBackend(connection, f"lost-{ns}", timeout_s=5, attempts=2)
    backend.submit("g", "tests.rewards:even_share", [view([2])])
    Job.fetch(backend._tracked["g"].job_id, connection, serializer=JSONSerializer).delete()
    assert backend.poll() == [] and backend.stats()["retries"] == 1  # enqueued again
    Job.fetch(backend._tracked["g"].job_id, connection, serializer=JSONSerializer).delete()
    [outcome] = backend.poll()
    assert outcome.error == "scoring failed 2 times, last: the job is gone from RQ (deleted or expired)"


def test_a_trainer_waiting_on_unscored_rollouts_is_told_to_start_a_scorer(
    redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    client = RolloutClient(redis_server.url, ns)
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"id": "p", "tokens": [5, 6], "n": 2, "reward_fn": "tests.rewards:even_share"}\n')
    [prompt] = read_prompts_file(lines, client)  # `rollouts submit --file` reads reward_fn from a line
    assert prompt.reward_fn == "tests.rewards:even_share"
    rollout = Rollout(prompt_id="p", sample=0, n=2, version=0, version_end=0, finish_reason="length", worker="w",
                      prompt_tokens=[5, 6], tokens=[2], logprobs=[-1.0], spans=[(0, 0, 1)],
                      reward_fn=prompt.reward_fn)  # fmt: skip
    client.streams.redis.xadd(client.streams.keys.scoring, for_redis(rollout.to_fields()))  # what a worker publishes
    with pytest.raises(TimeoutError, match=rf"1 rollouts wait on \{{{ns}\}}:scoring for a reward: is `rollouts scorer"):
        client.collect(1, timeout=0.5)


# -- across processes ----------------------------------------------------------------------------


@pytest.fixture
def scoring(redis_server: RedisServer, ns: str, tmp_path: Path) -> Iterator[StartScoring]:
    """Start `rollouts scorer` / `rollouts score-worker` processes (each in its own process group); all
    are stopped (or killed with their children) at the end."""
    started: list[subprocess.Popen[bytes]] = []
    env_dir = tmp_path / "scoring"
    env_dir.mkdir()
    os.environ["SCORING_TEST_DIR"] = str(env_dir)

    def start(command: str, *args: str, name: str) -> subprocess.Popen[bytes]:
        extra = ["--ns", ns] if command == "scorer" else []
        process = start_command(
            command, "--redis", redis_server.url, *extra, *args, "--name", name,
            log_file=tmp_path / f"{name}.log", new_session=True,
        )  # fmt: skip
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:  # killed with its children: reward jobs may hang on purpose
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()
    os.environ.pop("SCORING_TEST_DIR", None)


def submit(client: RolloutClient, prefix: str, count: int, reward_fn: str | None, n: int = 3) -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(count)]
    for i, pid in enumerate(ids):
        client.submit(tokens=[5 + i, 9, 11], n=n, max_tokens=6, seed=i, id=pid, reward_fn=reward_fn)
    return ids


def collect(client: RolloutClient, count: int, timeout: float = 90) -> dict[str, Group]:
    return {g.prompt_id: g for g in client.collect(count, timeout=timeout)}


def test_inline_scoring_sets_the_reward_every_reader_sees(
    redis_server: RedisServer, ns: str, workers: StartWorker, scoring: StartScoring
) -> None:
    workers("w0", "--engine", "synthetic")
    scoring("scorer", name="scorer-a")
    client = RolloutClient(redis_server.url, ns)
    scored = submit(client, "scored", 4, "tests.rewards:even_share")
    ranked = submit(client, "ranked", 2, "tests.rewards:rank_by_length")
    plain = submit(client, "plain", 2, None)
    groups = collect(client, 8)
    assert set(groups) == set(scored + ranked + plain)
    for pid in scored:
        for r in groups[pid].rollouts:
            assert r.reward == pytest.approx(rewards.even_share({"tokens": r.tokens.tolist()}))
            assert r.reward_fn == "tests.rewards:even_share" and r.reward_error is None
    for pid in ranked:
        views = [{"tokens": r.tokens.tolist()} for r in groups[pid].rollouts]
        assert groups[pid].rewards == rewards.rank_by_length(views)
    for pid in plain:  # no reward_fn: straight from the worker, unscored
        assert groups[pid].rewards == [None] * 3
    # What redis-cli (and a recorder) reads: the `reward` field of the entries on {ns}:rollouts.
    raw = as_entries(redis.Redis.from_url(redis_server.url).xrange(Keys(ns).rollouts))
    with_reward = [fields for _id, fields in raw if b"reward" in fields]
    assert len(with_reward) == 6 * 3 and all(float(f[b"reward"]) >= 0 for f in with_reward)
    top = subprocess.run(
        [sys.executable, "-m", "rollouts", "top", "--redis", redis_server.url, "--ns", ns, "--once", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    snap = json.loads(top.stdout)
    assert snap["scorer"]["groups"] == "6" and snap["scorer"]["reward_errors"] == "0"
    assert snap["scorer"]["mode"] == "inline" and snap["scorer"]["leader"] == "scorer-a"
    assert snap["streams"]["scoring"]["groups"]["scorers"]["pending"] == 0


def publish_for_scoring(client: RolloutClient, prompt_id: str, n: int, reward_fn: str) -> None:
    """A whole group on `{ns}:scoring`, as workers publish the rollouts of a prompt that names a `reward_fn`."""
    for sample in range(n):
        tokens = [2 + sample, 3, 4 + 2 * sample]
        rollout = Rollout(prompt_id=prompt_id, sample=sample, n=n, version=0, version_end=0, finish_reason="length",
                          worker="w", prompt_tokens=[5, 6], tokens=tokens, logprobs=[-1.0] * len(tokens),
                          spans=[(0, 0, len(tokens))], reward_fn=reward_fn)  # fmt: skip
        client.streams.redis.xadd(client.streams.keys.scoring, for_redis(rollout.to_fields()))


def test_a_scorer_at_its_default_threads_scores_a_reward_whose_first_call_imports_transformers(
    redis_server: RedisServer, ns: str, scoring: StartScoring
) -> None:
    """Issue 53: at `--threads 4` the first calls imported transformers on four threads at once, and groups failed
    with `ImportError: cannot import name 'AutoTokenizer' from 'transformers'`. Sixteen groups wait before the fresh
    scorer starts, so its first read hands them to its threads at once; every run of it failed before the fix."""
    client = RolloutClient(redis_server.url, ns)
    ids = [f"lazy-{i}" for i in range(16)]
    for pid in ids:
        publish_for_scoring(client, pid, 2, "tests.rewards:imports_transformers")
    scoring("scorer", name="scorer-lazy")  # default --threads 4
    groups = collect(client, len(ids))
    assert set(groups) == set(ids)
    assert {pid: g.reward_error for pid, g in groups.items()} == dict.fromkeys(ids)
    for group in groups.values():
        assert group.rewards == [rewards.even_share({"tokens": r.tokens.tolist()}) for r in group.rollouts]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollouts", *args], capture_output=True, text=True, timeout=120)


def test_submit_and_top_say_when_rollouts_would_wait_for_a_scorer_that_is_not_there(
    redis_server: RedisServer, ns: str, scoring: StartScoring, tmp_path: Path
) -> None:
    url, keys = redis_server.url, Keys(ns)
    connection = redis.Redis.from_url(url)
    scored = tmp_path / "scored.jsonl"
    scored.write_text(
        '{"id": "s", "tokens": [5, 6], "n": 2, "reward_fn": "tests.rewards:even_share"}\n'
        '{"id": "u", "tokens": [5, 7]}\n'  # no reward_fn
    )
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"id": "u2", "tokens": [5, 8], "n": 2}\n')

    def warnings(file: Path) -> list[str]:
        done = cli("submit", "--redis", url, "--ns", ns, "--file", str(file))
        assert done.returncode == 0, done.stderr
        return [line for line in done.stderr.splitlines() if "warning" in line and "no worker is alive" not in line]

    def top() -> dict:
        done = cli("top", "--redis", url, "--ns", ns, "--once", "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    assert warnings(scored) == [
        f"warning: 1 of these prompts name a reward_fn and no scorer is alive on namespace {ns}: their rollouts will "
        f"wait on {keys.scoring} until `rollouts scorer --ns {ns}` runs"
    ]
    assert warnings(plain) == []
    assert top()["scoring"] == {"waiting": 0, "scorer_alive": False, "warning": None}  # nothing generated yet

    client = RolloutClient(url, ns)
    publish_for_scoring(client, "s", 2, "tests.rewards:even_share")  # what a worker publishes for prompt `s`
    unscored = (
        f"2 rollouts wait on {keys.scoring} for a reward and no scorer is alive (no {keys.scorer_lease}): "
        f"start `rollouts scorer --ns {ns}`"
    )
    assert top()["scoring"] == {"waiting": 2, "scorer_alive": False, "warning": unscored}
    table = cli("top", "--redis", url, "--ns", ns, "--once")
    assert f"warning: {unscored}" in " ".join(table.stdout.split())  # the table view, however it wraps

    scorer = scoring("scorer", "--lease-s", "1", name="scorer-top")
    wait_until(lambda: bool(connection.exists(keys.scorer_lease)), 60, "the scorer to take its lease")
    [group] = client.collect(1, timeout=60)
    assert group.prompt_id == "s" and group.reward_error is None
    assert top()["scoring"] == {"waiting": 0, "scorer_alive": True, "warning": None}
    assert warnings(scored) == []  # a scorer is alive: nothing to say

    os.killpg(scorer.pid, signal.SIGKILL)  # its lease, the heartbeat, expires after --lease-s
    scorer.wait()
    wait_until(lambda: not connection.exists(keys.scorer_lease), 10, "the dead scorer's lease to expire")
    publish_for_scoring(client, "s2", 2, "tests.rewards:even_share")
    assert top()["scoring"] == {"waiting": 2, "scorer_alive": False, "warning": unscored}
    assert len(warnings(scored)) == 1


@pytest.mark.parametrize("redis_server", REDIS_VERSIONS, indirect=True)
def test_top_counts_what_waits_on_scoring_read_or_not_on_both_redis_versions(
    redis_server: RedisServer, ns: str
) -> None:
    """Redis 6.2 reports no group lag: the rollouts not yet read are counted from the group's last read entry."""
    client = RolloutClient(redis_server.url, ns)
    publish_for_scoring(client, "a", 2, "tests.rewards:even_share")
    assert snapshot(client.streams)["scoring"]["waiting"] == 2  # no scorer ever read: the whole stream waits
    client.streams.scoring.ensure_scoring_group()
    read = client.streams.scoring.read_scoring(1, None)
    publish_for_scoring(client, "b", 3, "tests.rewards:even_share")
    assert snapshot(client.streams)["scoring"]["waiting"] == 5  # 1 read and not forwarded, 4 not read
    client.streams.scoring.forward_scored([], [entry.id for entry in read])
    assert snapshot(client.streams)["scoring"]["waiting"] == 4


def test_rq_scoring_with_json_jobs_and_reward_errors_that_never_stall_the_loop(
    redis_server: RedisServer, ns: str, workers: StartWorker, scoring: StartScoring
) -> None:
    queue = f"rewards-{ns}"
    workers("w0", "--engine", "synthetic")
    scoring("scorer", "--rq", "--queue", queue, "--timeout-s", "2", name="scorer-rq")
    scoring("score-worker", "--queue", queue, name="rq-a")
    scoring("score-worker", "--queue", queue, name="rq-b")
    client = RolloutClient(redis_server.url, ns)
    good = submit(client, "good", 3, "tests.rewards:even_share")
    bad = submit(client, "raises", 1, "tests.rewards:raises")
    junk = submit(client, "junk", 1, "tests.rewards:not_a_number")
    hung = submit(client, "hangs", 1, "tests.rewards:hangs")
    after = submit(client, "after", 2, "tests.rewards:async_even_share")
    groups = collect(client, 8)
    for pid in good + after:
        for r in groups[pid].rollouts:
            assert r.reward == pytest.approx(rewards.even_share({"tokens": r.tokens.tolist()}))
    assert "ValueError: cannot parse the answer" in (groups[bad[0]].reward_error or "")
    assert "finite number" in (groups[junk[0]].reward_error or "")
    assert "timeout" in (groups[hung[0]].reward_error or "").lower()
    for pid in bad + junk + hung:
        assert groups[pid].rewards == [None] * 3
    # No pickle: each job's payload is JSON (RQ stores it zlib-compressed in the job hash).
    connection = redis.Redis.from_url(redis_server.url)
    job_keys = [k for k in connection.scan_iter(match="rq:job:*") if connection.type(k) == b"hash"]
    payloads = [cast("bytes | None", connection.hget(k, "data")) for k in job_keys]  # no decode_responses: bytes
    assert payloads and all(json.loads(zlib.decompress(p)) for p in payloads if p)

    def status() -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in as_fields(connection.hgetall(Keys(ns).scorer)).items()}

    # The counters are added once a group is forwarded: the last group may reach the trainer just before its count.
    wait_until(lambda: status().get("groups") == "8", 10, "the scorer to count every group")
    assert status()["reward_errors"] == "3" and status()["mode"] == f"rq:{queue}", status()


def test_a_score_worker_killed_mid_job_loses_no_group(
    redis_server: RedisServer, ns: str, workers: StartWorker, scoring: StartScoring, tmp_path: Path
) -> None:
    queue = f"rewards-{ns}"
    workers("w0", "--engine", "synthetic")
    scoring("scorer", "--rq", "--queue", queue, "--timeout-s", "6", name="scorer-rq")
    doomed = scoring("score-worker", "--queue", queue, name="rq-doomed")
    client = RolloutClient(redis_server.url, ns)
    ids = submit(client, "g", 4, "tests.rewards:stalls_first_call")
    marker = tmp_path / "scoring" / "started"
    wait_until(marker.exists, 90, "the first scoring job to start on the doomed worker")
    # The RQ worker and its work-horse, mid-job, as when their machine dies (the horse has a session of its own).
    for process in [*psutil.Process(doomed.pid).children(recursive=True), psutil.Process(doomed.pid)]:
        process.kill()
    doomed.wait()
    scoring("score-worker", "--queue", queue, name="rq-new")
    groups = collect(client, 4, timeout=120)
    assert set(groups) == set(ids)
    for group in groups.values():
        assert group.reward_error is None
        for r in group.rollouts:
            assert r.reward == pytest.approx(rewards.even_share({"tokens": r.tokens.tolist()}))
    # The status hash is written once a second: wait for the beat after the retry.
    connection = redis.Redis.from_url(redis_server.url)
    wait_until(lambda: int(connection.hget(Keys(ns).scorer, "retries") or 0) >= 1, 10, "the retry in the status")


def test_a_scorer_killed_mid_run_is_replaced_and_every_group_arrives_once(
    redis_server: RedisServer, ns: str, workers: StartWorker, scoring: StartScoring
) -> None:
    workers("w0", "--engine", "synthetic")
    first = scoring("scorer", "--lease-s", "1", "--threads", "1", name="scorer-first")
    connection = redis.Redis.from_url(redis_server.url)
    keys = Keys(ns)
    wait_until(lambda: connection.hget(keys.scorer, "leader") == b"scorer-first", 30, "the first scorer to lead")
    standby = scoring("scorer", "--lease-s", "1", "--threads", "1", name="scorer-standby")
    client = RolloutClient(redis_server.url, ns)
    ids = submit(client, "g", 8, "tests.rewards:slow")
    wait_until(lambda: int(connection.hget(keys.scorer, "groups") or 0) >= 2, 90, "the first scored groups")
    os.killpg(first.pid, signal.SIGKILL)  # with groups read and not forwarded
    first.wait()
    groups = collect(client, 8, timeout=120)
    assert set(groups) == set(ids) and client.stats["received"] == 8 * 3
    assert all(r.reward is not None for g in groups.values() for r in g.rollouts)
    assert connection.hget(keys.scorer, "leader") == b"scorer-standby"
    assert connection.xinfo_groups(keys.scoring)[0]["pending"] == 0
    stop_process(standby)
    # Forwarding is atomic (ack + add in one step): the successor re-scored only what was not forwarded, so no
    # rollout was forwarded twice. Counted by what the stream was ever given (Redis 7's `entries-added`): its entries
    # the trainer acked may be trimmed already (a busy machine's run once kept only the last 3 groups).
    assert connection.xinfo_stream(keys.rollouts)["entries-added"] == 8 * 3

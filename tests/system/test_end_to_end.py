"""End to end: real redis-server, `rollouts worker` in its own process, the trainer client here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import redis

from pipeline.codec import as_entries, for_redis
from pipeline.local import RedisServer, find_redis_cli
from pipeline.processes import start_worker, stop_processes, wait_for_worker
from pipeline.wire import GENERATORS, Keys, Prompt, Sampling
from producers.client import RolloutClient
from tests.fixtures import (
    ENGINES_ON_BOTH_REDIS,
    ENGINES_ON_EVERY_SERVER,
    EVERY_SERVER,
    FAST,
    REDIS_VERSIONS,
    StartWorker,
    holds_work,
    wait_until,
)
from tests.reference import forward_logprobs

SYNTHETIC = ("--engine", "synthetic")
"""For tests of the protocol (fields, claims, dedup, heartbeats), not of the engine's numbers: a synthetic worker
serves after ~3.5 s, a torch one after ~10 s. True logprobs are checked above, on torch and vLLM."""


class SharedVllmWorker:
    """One `rollouts worker --engine vllm` named `w1` on a namespace of its own, shared by this module's vLLM tests
    that leave it running (a vLLM worker takes ~50 s to serve on 2 cores). They key on their own prompt ids; the
    namespace is fresh for the first of them. A test that kills it takes it last; one after that starts another."""

    def __init__(self, server: RedisServer, model: Path, logs: Path) -> None:
        self.server, self.model, self.logs = server, model, logs
        self.ns = f"t{uuid.uuid4().hex[:10]}"
        self.started: list[subprocess.Popen[bytes]] = []

    def serving(self) -> tuple[str, subprocess.Popen[bytes]]:
        """The namespace and the process of a live, serving `w1` (started on first use)."""
        if self.started and self.started[-1].poll() is None:
            return self.ns, self.started[-1]
        self.ns = f"t{uuid.uuid4().hex[:10]}"  # a new worker, a new namespace: nothing of the killed one's is left
        log = self.logs / f"w1-{len(self.started)}.log"
        proc = start_worker(self.server.url, self.ns, self.model, "w1", *FAST, "--engine", "vllm", log_file=log)
        self.started.append(proc)
        client = redis.Redis.from_url(self.server.url)
        try:
            wait_for_worker(client, self.ns, "w1", proc, timeout_s=240)
        except Exception:
            print(log.read_text())
            raise
        finally:
            client.close()
        return self.ns, proc


@pytest.fixture(scope="module")
def shared_vllm(
    installed_redis: RedisServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedVllmWorker]:
    shared = SharedVllmWorker(installed_redis, tiny_model_dir, tmp_path_factory.mktemp("shared-vllm"))
    yield shared
    stop_processes(shared.started)


def serve_w1(
    request: pytest.FixtureRequest, engine: str, ns: str, workers: StartWorker
) -> tuple[str, subprocess.Popen[bytes]]:
    """A worker `w1` serving with `engine`, and its namespace: for vLLM the module's shared one (on the installed
    Redis, which is the vLLM params' `redis_server`), else one of this test's own on `ns`."""
    if engine == "vllm":
        return request.getfixturevalue("shared_vllm").serving()
    return ns, workers("w1", "--engine", engine)


@pytest.mark.parametrize(("engine", "redis_server"), ENGINES_ON_EVERY_SERVER, indirect=["redis_server"])
def test_every_sample_delivered_once_with_true_logprobs(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    workers: StartWorker,
    engine: str,
) -> None:
    ns, _ = serve_w1(request, engine, ns, workers)
    client = RolloutClient(redis_server.url, ns, tokenizer=tiny_model_dir, trim_every_s=0)
    ids = [client.submit(f"what is {i} + {i}?", n=3, max_tokens=24, seed=i, meta={"i": i}) for i in range(6)]
    ids += [client.submit(tokens=[5 + i, 17, 33, 8], n=3, max_tokens=24, temperature=0.8) for i in range(6)]
    groups = client.collect(len(ids), timeout=120)

    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    rollouts = [r for g in groups for r in g.rollouts]
    assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in ids for k in range(3))
    assert client.stats["duplicates"] == 0
    if engine == "vllm":  # vLLM's CPU build repacks its weights after loading: it pushes no version to a joiner
        assert client.streams.redis.hget(client.streams.keys.worker("w1"), "shares") == b"0"
    for r in rollouts:
        assert r.version == r.version_end == 0 and r.worker == "w1"
        assert r.finish_reason in ("stop", "length") and 1 <= r.n_tokens <= 24
        assert r.spans == [(0, 0, r.n_tokens)]
        reference = forward_logprobs(tiny_model_dir, r.prompt_tokens.tolist(), r.tokens.tolist())
        np.testing.assert_allclose(r.logprobs, reference, atol=1e-4)
    assert {g.rollouts[0].meta.get("i") for g in groups} >= set(range(6))
    # Nothing left behind: prompts acked by the worker, rollouts acked by the client.
    keys = Keys(ns)
    assert client.streams.redis.xpending(keys.prompts, GENERATORS)["pending"] == 0
    assert client.streams.redis.xpending(keys.rollouts, "trainer")["pending"] == 0
    assert client.streams.redis.xlen(keys.rollouts) <= 3, "acked rollouts are trimmed behind the trainer"
    # No further group shows up: nothing was delivered twice.
    with pytest.raises(TimeoutError):
        next(client.groups(timeout=1.5))


def redis_cli_fields(port: int, key: str) -> dict[str, str]:
    """The first entry of a stream as `redis-cli` prints it to a person."""
    out = subprocess.run(
        [find_redis_cli(), "-p", str(port), "--no-raw", "XRANGE", key, "-", "+", "COUNT", "1"],
        check=True,
        capture_output=True,
        text=True,
        errors="replace",
    ).stdout
    values = [m.group(1) for m in re.finditer(r'^\s*(?:\d+\)\s+)+"(.*)"$', out, re.MULTILINE)]
    pairs = values[1:]  # values[0] is the entry id
    return dict(zip(pairs[::2], pairs[1::2], strict=False))


@pytest.mark.parametrize("redis_server", REDIS_VERSIONS, indirect=True)
def test_rollouts_are_readable_in_redis_cli(redis_server: RedisServer, ns: str, workers: StartWorker) -> None:
    workers("w1", *SYNTHETIC)
    client = RolloutClient(redis_server.url, ns)
    client.submit(tokens=[3, 4, 5], n=2, max_tokens=5, temperature=0, id="cli-check")
    client.collect(1, timeout=60)
    fields = redis_cli_fields(redis_server.port, Keys(ns).rollouts)
    assert fields["v"] == "1"
    assert fields["id"] == "cli-check:0" and fields["prompt_id"] == "cli-check"
    assert fields["version"] == "0" and fields["worker"] == "w1"
    assert fields["n_tokens"].isdigit() and fields["finish_reason"] in ("stop", "length")
    assert fields["spans"] == f"[[0,0,{fields['n_tokens']}]]"


@pytest.mark.parametrize(("engine", "redis_server"), ENGINES_ON_BOTH_REDIS, indirect=["redis_server"])
def test_bad_input_is_dead_lettered_or_errored_and_the_worker_goes_on(
    request: pytest.FixtureRequest, redis_server: RedisServer, ns: str, workers: StartWorker, engine: str
) -> None:
    ns, proc = serve_w1(request, engine, ns, workers)
    client = RolloutClient(redis_server.url, ns)
    keys = client.streams.keys
    r = client.streams.redis
    # Entries that cannot be decoded or validated.
    r.xadd(keys.prompts, {b"hello": b"world"})
    r.xadd(keys.prompts, for_redis(Prompt(id="bad-bytes", n=1, tokens=[1]).to_fields() | {b"tokens": b"\x01\x02\x03"}))
    r.xadd(keys.prompts, for_redis(Prompt(id="bad-n", n=1, tokens=[1]).to_fields() | {b"n": b"-4"}))
    # Entries that decode but that the engine cannot serve: written directly, as another language might.
    too_long = Prompt(id="too-long", n=2, tokens=[7] * 600)
    hot = Prompt(id="bad-sampling", n=2, tokens=[7, 8], sampling=Sampling(temperature=-1.0))
    outside = Prompt(id="bad-token", n=1, tokens=[7, 10**6])
    client.submit_prompts([too_long, hot, outside])
    good = client.submit(tokens=[9, 10, 11], n=2, max_tokens=8)

    groups = {g.prompt_id: g for g in client.collect(4, timeout=60)}
    assert set(groups) == {"too-long", "bad-sampling", "bad-token", good}
    for pid, needle in (("too-long", "context"), ("bad-sampling", "temperature"), ("bad-token", "token ids")):
        for rollout in groups[pid].rollouts:
            assert rollout.finish_reason == "error" and rollout.n_tokens == 0
            assert needle in (rollout.error or "")
    assert all(r.finish_reason in ("stop", "length") for r in groups[good].rollouts)

    wait_until(lambda: r.xlen(keys.dead) == 3, 10, "three dead letters")
    dead = {fields.get(b"id", b"?"): fields for _, fields in as_entries(r.xrange(keys.dead))}
    assert [d[b"stage"] for d in dead.values()] == [b"decode"] * 3
    assert dead[b"?"][b"hello"] == b"world" and b"unsupported wire version" in dead[b"?"][b"error"]
    assert b"tokens: 3 bytes" in dead[b"bad-bytes"][b"error"]
    assert b"n: Input should be greater than or equal to 1" in dead[b"bad-n"][b"error"]
    assert r.xpending(keys.prompts, GENERATORS)["pending"] == 0
    assert proc.poll() is None, "the worker must keep serving"


@pytest.mark.parametrize("redis_server", EVERY_SERVER, indirect=True)
def test_a_killed_workers_prompts_finish_on_another_worker(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    fast = ("--claim-idle-ms", "1500", "--heartbeat-s", "0.3", "--max-inflight", "16")
    doomed = workers("doomed", *SYNTHETIC, *fast)
    client = RolloutClient(redis_server.url, ns)
    r = client.streams.redis
    ids = [client.submit(tokens=[4 + i, 20, 30], n=2, max_tokens=200, seed=i) for i in range(24)]

    wait_until(holds_work(client, "doomed"), 60, "the first worker to take prompts")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait()
    prompts_key = client.streams.keys.prompts
    orphaned = r.xpending_range(prompts_key, GENERATORS, "-", "+", 1000, consumername="doomed")
    orphaned_ids = {
        Prompt.from_fields(as_entries(r.xrange(prompts_key, p["message_id"], p["message_id"]))[0][1]).id
        for p in orphaned
    }
    assert orphaned_ids, "the killed worker held no prompts"
    workers("rescuer", *SYNTHETIC, *fast)

    groups = client.collect(len(ids), timeout=180)
    rollouts = [x for g in groups for x in g.rollouts]
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    assert len({x.id for x in rollouts}) == len(rollouts) == 2 * len(ids)
    assert client.stats["duplicates"] == 0
    assert all(x.worker == "rescuer" for x in rollouts if x.prompt_id in orphaned_ids)
    assert r.xpending(client.streams.keys.prompts, GENERATORS)["pending"] == 0


@pytest.mark.vllm
def test_a_killed_vllm_worker_leaves_no_engine_process_behind(shared_vllm: SharedVllmWorker) -> None:
    _, worker = shared_vllm.serving()  # the shared worker's last test: it kills it
    engine_processes = psutil.Process(worker.pid).children(recursive=True)
    assert any("EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM") for p in engine_processes)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()

    def all_gone() -> bool:
        return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engine_processes)

    wait_until(all_gone, 30, "vLLM's processes to die with their worker")


def test_a_prompt_submitted_twice_is_delivered_once(redis_server: RedisServer, ns: str, workers: StartWorker) -> None:
    workers("w1", *SYNTHETIC)
    client = RolloutClient(redis_server.url, ns)
    for _ in range(2):  # a trainer retrying a submit it thought had failed: the same submission, queued once
        client.submit(tokens=[6, 7, 8], n=2, max_tokens=16, seed=3, id="retried")
    assert client.admission_usage().submitted == 2
    # Another producer queues the same prompt id past admission (a replay): its rollouts are not published again.
    again = client.make_prompt(tokens=[6, 7, 8], n=2, sampling=Sampling(max_tokens=16, seed=3), id="retried")
    client.streams.redis.xadd(client.streams.keys.prompts, for_redis(again.to_fields()))
    (group,) = client.collect(1, timeout=60)
    assert [r.finish_reason for r in group.rollouts] != ["error", "error"]
    wait_until(
        lambda: (
            client.streams.redis.xpending(client.streams.keys.prompts, GENERATORS)["pending"] == 0
            and client.streams.redis.xlen(client.streams.keys.prompts) == 2
        ),
        30,
        "both entries to be served",
    )
    assert client.streams.redis.xlen(client.streams.keys.rollouts) == 2
    with pytest.raises(TimeoutError):
        next(client.groups(timeout=1.0))


@pytest.mark.vllm
def test_a_worker_whose_engine_dies_exits_and_its_work_finishes_elsewhere(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    fast = ("--claim-idle-ms", "1500", "--heartbeat-s", "0.3")
    doomed = workers("doomed", "--engine", "vllm", *fast)
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[4 + i, 20, 30], n=2, max_tokens=400, seed=i) for i in range(4)]
    wait_until(holds_work(client, "doomed"), 60, "the vLLM worker to take prompts")
    engine_cores = [p for p in psutil.Process(doomed.pid).children(recursive=True) if "EngineCore" in p.name()]
    assert engine_cores, "no vLLM engine process found under the worker"
    for proc in engine_cores:
        proc.kill()
    assert doomed.wait(timeout=60) == 1, "a worker whose engine died must exit with code 1"

    workers("rescuer", "--engine", "torch", *fast)
    groups = client.collect(len(ids), timeout=120)
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    assert client.stats["duplicates"] == 0
    assert any(r.worker == "rescuer" for g in groups for r in g.rollouts)


def test_the_heartbeat_counts_generated_tokens_and_busy_time(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    started = time.monotonic()
    workers("w1", *SYNTHETIC)
    client = RolloutClient(redis_server.url, ns)
    key = client.streams.keys.worker("w1")
    for i in range(8):
        client.submit(tokens=[5 + i, 6, 7], n=2, max_tokens=40, seed=i)
    rollouts = [r for g in client.collect(8, timeout=60) for r in g.rollouts]

    def beat() -> dict[str, float]:
        fields = client.streams.redis.hgetall(key)
        return {k.decode(): float(fields[k]) for k in (b"generated_tokens", b"busy_s", b"inflight", b"ts")}

    wait_until(lambda: beat()["generated_tokens"] == sum(r.n_tokens for r in rollouts), 10, "the counted tokens")
    wait_until(lambda: beat()["inflight"] == 0, 10, "an idle worker")
    idle = beat()
    assert 0 < idle["busy_s"] < time.monotonic() - started
    wait_until(lambda: beat()["ts"] >= idle["ts"] + 1.0, 10, "a heartbeat an idle second later")
    assert beat()["busy_s"] == pytest.approx(idle["busy_s"], abs=0.01), "no busy time while nothing is in flight"

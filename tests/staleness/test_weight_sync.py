"""Weight syncs across worker processes: pause → load → ack → resume, partial rollouts, eviction."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from consumers.sync import AWAITING_WEIGHTS
from pipeline.codec import as_entries, for_redis
from pipeline.control import CONTROL_RECHECK_S, bell_index
from pipeline.local import RedisServer, free_port
from pipeline.wire import GENERATORS, Control, Partial, PauseMode
from producers.client import Group, RolloutClient
from staleness.manager import Manager, SyncError
from staleness.state import read_state
from tests.fixtures import ENGINES_ON_EVERY_SERVER, StartWorker, wait_until
from tests.reference import check_kept_cache_spans, check_spans_and_logprobs


def generating(client: RolloutClient, at_least: int) -> Callable[[], bool]:
    """True once the workers have `at_least` prompts in flight (pending in the generators group)."""
    return lambda: client.streams.redis.xpending(client.streams.keys.prompts, GENERATORS)["pending"] >= at_least


def sync_runs() -> list[Any]:
    """`ENGINES_ON_EVERY_SERVER` x pause mode. vLLM runs both modes, one after the other, on one pair of workers: two
    vLLM workers take a minute to start on 2 cores, and a second pair would only start them again. The other servers
    than the installed one run `abort` in the default run (`keep` is in the long tier), and the installed one `keep`
    (`abort` is in the long tier): the modes differ in the engine, and a server sees the same commands in both."""
    runs = []
    for param in ENGINES_ON_EVERY_SERVER:
        engine, server = param.values
        each = [("abort", "keep")] if engine == "vllm" else [("abort",), ("keep",)]
        each = [("abort",)] if server == "valkey" else each
        for m in each:
            marks = list(param.marks)
            if server == "bundled" and m == ("keep",):
                marks.append(pytest.mark.long("the same commands in abort mode: the [torch-bundled6.2-abort] run"))
            if engine == "torch" and server == "installed" and m == ("abort",):
                marks.append(pytest.mark.long("abort: [torch-bundled6.2-abort]; Redis 7: [torch-installed-keep]"))
            runs.append(pytest.param(engine, server, m, marks=marks, id=f"{param.id}-{'-'.join(m)}"))
    return runs


@pytest.mark.parametrize(("engine", "redis_server", "modes"), sync_runs(), indirect=["redis_server"])
def test_weights_published_mid_generation_reach_every_sample_exactly_once(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    tmp_path: Path,
    modes: tuple[PauseMode, ...],
    engine: str,
) -> None:
    workers.many(("w1", "--engine", engine), ("w2", "--engine", engine))
    client = RolloutClient(redis_server.url, ns)
    weights = {0: tiny_model_dir}
    for turn, mode in enumerate(modes):
        v = 3 * turn  # the version the workers serve as this mode's turn begins
        prompts = [client.submit(tokens=[5 + i, 40, 41, 42], n=2, max_tokens=300, seed=16 * turn + i)
                   for i in range(16)]  # fmt: skip
        wait_until(generating(client, 8), 60, "generation to start")
        assert client.publish_weights(tiny_model_dir_v1, transport="redis://", mode=mode) == v + 1
        assert client.last_sync is not None
        assert sorted(client.last_sync.acked) == ["w1", "w2"] and client.last_sync.evicted == []
        assert client.publish_weights(tiny_model_dir, transport=f"fs://{tmp_path / 'weights'}", mode=mode) == v + 2
        uri = f"nccl://127.0.0.1:{free_port()}"
        assert client.publish_weights(tiny_model_dir_v1, transport=uri, mode=mode) == v + 3
        assert client.last_sync is not None
        assert sorted(client.last_sync.acked) == ["w1", "w2"] and client.last_sync.evicted == []
        assert client.last_broadcast is not None
        assert (client.last_broadcast.workers, client.last_broadcast.ranks) == (2, 2)
        weights |= {v + 1: tiny_model_dir_v1, v + 2: tiny_model_dir, v + 3: tiny_model_dir_v1}

        groups: list[Group] = client.collect(len(prompts), timeout=240)
        rollouts = [r for g in groups for r in g.rollouts]
        assert sorted(g.prompt_id for g in groups) == sorted(prompts)
        assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in prompts for k in range(2))
        assert client.stats["duplicates"] == 0
        for rollout in rollouts:
            check_spans_and_logprobs(rollout, weights)
        assert any(len(r.spans) >= 2 for r in rollouts), f"{mode}: some rollouts must span two or more versions"
        assert client.streams.redis.xpending(client.streams.keys.partials, GENERATORS)["pending"] == 0
        # Each worker continued what a pause interrupted itself: nothing went through `{ns}:partials` (XINFO field
        # of 6.2 and 7.x).
        assert client.streams.redis.xinfo_stream(client.streams.keys.partials)["last-generated-id"] == b"0-0"
        # Only the current version is kept, and it was broadcast: the stored ones are gone.
        assert not list(client.streams.redis.scan_iter(match=client.streams.keys.weights_prefix + f"{v + 1}:*"))
        assert not [p.name for p in (tmp_path / "weights").iterdir() if p.name.startswith("v")]


def test_inflight_syncs_mid_generation_reach_every_sample_once_with_spans_over_the_kept_cache(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    """`publish_weights(..., mode="inflight")` twice while two torch workers generate: every sample arrives once,
    nothing is interrupted (no partials), and each token's logprob is its version's over the cache the earlier
    versions wrote (the running samples were neither ended nor prefilled again)."""
    workers.many(("w1", "--engine", "torch"), ("w2", "--engine", "torch"))
    client = RolloutClient(redis_server.url, ns)
    prompts = [client.submit(tokens=[5 + i, 40, 41, 42], n=2, max_tokens=300, seed=i) for i in range(16)]
    wait_until(generating(client, 8), 60, "generation to start")
    assert client.publish_weights(tiny_model_dir_v1, transport="redis://", mode="inflight") == 1
    assert client.last_sync is not None
    assert sorted(client.last_sync.acked) == ["w1", "w2"] and client.last_sync.evicted == []
    assert client.publish_weights(tiny_model_dir, transport="redis://", mode="inflight") == 2
    assert client.last_sync is not None
    assert sorted(client.last_sync.acked) == ["w1", "w2"] and client.last_sync.evicted == []

    groups: list[Group] = client.collect(len(prompts), timeout=240)
    rollouts = [r for g in groups for r in g.rollouts]
    assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in prompts for k in range(2))
    assert client.stats["duplicates"] == 0
    assert all(r.finish_reason in ("stop", "length") for r in rollouts)
    weights = {0: tiny_model_dir, 1: tiny_model_dir_v1, 2: tiny_model_dir}
    for rollout in rollouts:
        check_kept_cache_spans(rollout, weights)
    assert any(len(r.spans) >= 2 for r in rollouts), "some rollouts must span two or more versions"
    assert client.streams.redis.xinfo_stream(client.streams.keys.partials)["last-generated-id"] == b"0-0"


def test_a_worker_stuck_between_pause_and_ack_is_evicted_and_its_work_finishes_elsewhere(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    stuck = workers("stuck", "--heartbeat-s", "4")  # silent past the ack deadline only after 10 s: evicted, not gone
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[6 + i, 50, 51], n=2, max_tokens=200, seed=i) for i in range(8)]
    wait_until(generating(client, 4), 60, "generation to start")
    healthy = workers("healthy")
    os.kill(stuck.pid, signal.SIGSTOP)  # frozen: it will never ack
    assert client.publish_weights(tiny_model_dir_v1, mode="abort", ack_timeout_s=3) == 1
    assert client.last_sync is not None
    assert client.last_sync.acked == ["healthy"] and client.last_sync.evicted == ["stuck"]
    os.kill(stuck.pid, signal.SIGCONT)  # it wakes up evicted, and leaves
    assert stuck.wait(timeout=60) == 1

    groups = client.collect(len(ids), timeout=240)
    rollouts = [r for g in groups for r in g.rollouts]
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    assert len({r.id for r in rollouts}) == len(rollouts) == 2 * len(ids)
    for rollout in rollouts:
        check_spans_and_logprobs(rollout, {0: tiny_model_dir, 1: tiny_model_dir_v1})
    assert healthy.poll() is None


def test_a_late_worker_loads_the_current_version_before_taking_work(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1) == 1  # no worker yet: the state alone moves
    assert client.last_sync is not None
    assert client.last_sync.acked == []
    workers("late")
    assert client.streams.redis.hget(client.streams.keys.worker("late"), "version") == b"1"
    client.submit(tokens=[7, 8, 9], n=2, max_tokens=20, id="after")
    (group,) = client.collect(1, timeout=60)
    for rollout in group.rollouts:
        assert rollout.spans == [(1, 0, rollout.n_tokens)]
        check_spans_and_logprobs(rollout, {1: tiny_model_dir_v1})


def test_with_nccl_a_late_worker_takes_no_work_until_the_next_broadcast(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    workers("early")
    client = RolloutClient(redis_server.url, ns)
    nccl = f"nccl://127.0.0.1:{free_port()}"
    assert client.publish_weights(tiny_model_dir_v1, transport=nccl) == 1
    workers("late", "--join-from", "store", until=AWAITING_WEIGHTS)  # version 1 is nowhere stored (not from a peer)
    client.submit(tokens=[7, 8, 9], n=4, max_tokens=20, id="meanwhile")
    (group,) = client.collect(1, timeout=60)
    assert {r.worker for r in group.rollouts} == {"early"}
    assert all(r.spans == [(1, 0, r.n_tokens)] for r in group.rollouts)

    # The next one through the CLI, as an operator would (its own process hosts the rendezvous).
    done = rollouts_cli("publish-weights", "--redis", redis_server.url, "--ns", ns, "--from", str(tiny_model_dir),
                        "--transport", f"nccl://127.0.0.1:{free_port()}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["version"], sorted(report["acked"]), report["evicted"]) == (2, ["early", "late"], [])
    late_status = client.streams.keys.worker("late")
    wait_until(lambda: client.streams.redis.hget(late_status, "status") == b"serving", 30, "the late worker to serve")
    ids = [client.submit(tokens=[9, 10 + i], n=2, max_tokens=20, id=f"after{i}") for i in range(6)]
    rollouts = [r for g in client.collect(len(ids), timeout=60) for r in g.rollouts]
    assert "late" in {r.worker for r in rollouts}
    for rollout in rollouts:
        assert rollout.spans == [(2, 0, rollout.n_tokens)]
        check_spans_and_logprobs(rollout, {2: tiny_model_dir})


def test_with_nccl_a_worker_generates_while_the_sync_waits_for_the_others_to_join(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    """A worker joins the broadcast (and builds its group) before it pauses: the wait for a late worker, and a new
    group's setup, are not time it stands still. Its heartbeat's `stall_s` (pause to resume) says so."""
    healthy = workers("healthy")
    slow = workers("slow")
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[6 + i, 50, 51], n=2, max_tokens=400, seed=i) for i in range(40)]
    wait_until(generating(client, 8), 60, "generation to start")
    os.kill(slow.pid, signal.SIGSTOP)  # it answers the sync late
    r, keys = client.streams.redis, client.streams.keys
    with ThreadPoolExecutor(1) as pool:
        sync = pool.submit(client.publish_weights, tiny_model_dir_v1, transport=f"nccl://127.0.0.1:{free_port()}")
        wait_until(lambda: read_state(r, keys).paused, 30, "the sync to begin")
        began = time.time()  # a heartbeat written after this one counts what came after the weights command
        wait_until(lambda: float(r.hget(keys.worker("healthy"), "ts") or 0) > began + 0.35, 30, "a fresh heartbeat")
        before = int(r.hget(keys.worker("healthy"), "generated_tokens") or 0)
        wait_until(
            lambda: int(r.hget(keys.worker("healthy"), "generated_tokens") or 0) > before + 50,
            30,
            "the healthy worker to generate while the sync waits for the stopped one",
        )
        assert r.hget(keys.worker("healthy"), "status") == b"serving" and read_state(r, keys).paused
        os.kill(slow.pid, signal.SIGCONT)
        assert sync.result(timeout=120) == 1
    assert client.last_sync is not None
    assert sorted(client.last_sync.acked) == ["healthy", "slow"] and client.last_broadcast is not None
    wait_until(lambda: r.hget(keys.worker("healthy"), "status") == b"serving", 30, "the resume")
    stall_s = float(r.hget(keys.worker("healthy"), "stall_s") or 0)
    assert 0 < stall_s < client.last_sync.stall_s - client.last_broadcast.join_s, "it stood still while others joined"

    rollouts = [r for g in client.collect(len(ids), timeout=240) for r in g.rollouts]
    assert len({r.id for r in rollouts}) == len(rollouts) == 2 * len(ids)
    for rollout in rollouts:
        check_spans_and_logprobs(rollout, {0: tiny_model_dir, 1: tiny_model_dir_v1})
    assert healthy.poll() is None and slow.poll() is None


def test_a_worker_that_cannot_load_a_broadcast_stops_and_its_work_finishes_elsewhere(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker,
    tmp_path: Path,
) -> None:  # fmt: skip
    from consumers.engines.tiny_model import build_tiny_model

    wide_model = build_tiny_model(tmp_path / "wide", seed=2, hidden_size=128)
    wide = workers("wide", "--model", str(wide_model))  # the last --model wins: another architecture
    workers("fits")
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[6 + i, 50, 51], n=2, max_tokens=100, seed=i) for i in range(8)]
    wait_until(generating(client, 4), 60, "generation to start")
    assert client.publish_weights(tiny_model_dir_v1, transport=f"nccl://127.0.0.1:{free_port()}", ack_timeout_s=60) == 1
    assert client.last_sync is not None
    assert client.last_sync.acked == ["fits"] and client.last_sync.evicted == []
    assert client.last_sync.stall_s < 30, "the sync waited for a worker that declined"
    assert wide.wait(timeout=60) == 1
    assert "could not load weights version 1" in (tmp_path / "wide.log").read_text()

    rollouts = [r for g in client.collect(len(ids), timeout=240) for r in g.rollouts]
    assert len({r.id for r in rollouts}) == len(rollouts) == 2 * len(ids)
    for rollout in rollouts:  # the wide model's tokens (version 0) have other logprobs: spans only
        assert rollout.spans[0][1] == 0 and rollout.spans[-1][2] == rollout.n_tokens
        assert [v for v, _, _ in rollout.spans] == sorted({v for v, _, _ in rollout.spans})


def test_the_state_refuses_a_sync_out_of_order(redis_server: RedisServer, ns: str) -> None:
    client = RolloutClient(redis_server.url, ns)
    manager = Manager(client.streams, ack_timeout_s=1)
    with pytest.raises(SyncError, match="version conflict"):
        manager.sync(3, "redis://x/v3")
    assert manager.sync(1, "redis://x/v1").version == 1
    state = manager.state()
    assert (state.version, state.epoch, state.paused, state.weights_uri) == (1, 1, False, "redis://x/v1")


def test_a_failed_transfer_still_concludes_the_sync(redis_server: RedisServer, ns: str) -> None:
    client = RolloutClient(redis_server.url, ns)
    manager = Manager(client.streams, ack_timeout_s=1)

    def broken_broadcast(epoch: int, workers: int) -> None:
        raise RuntimeError(f"broadcast of sync {epoch} to {workers} workers failed")

    with pytest.raises(RuntimeError, match="broadcast of sync 1 to 0 workers failed"):
        manager.sync(1, "nccl://127.0.0.1:1/v1", transfer=broken_broadcast)
    state = manager.state()
    assert (state.version, state.epoch, state.paused) == (1, 1, False), "nobody may stay paused"
    assert manager.sync(2, "redis://x/v2").version == 2


def rollouts_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollouts", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_publish_weights_command_and_the_manager_finishing_a_sync_whose_driver_died(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker,
    tmp_path: Path,
) -> None:  # fmt: skip
    url = redis_server.url
    healthy = workers("healthy", "--engine", "synthetic")  # the sync protocol is tested here, not the weights
    done = rollouts_cli("publish-weights", "--redis", url, "--ns", ns, "--from", str(tiny_model_dir_v1),
                        "--transport", f"fs://{tmp_path / 'w'}", "--mode", "keep")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["version"], report["acked"], report["evicted"]) == (1, ["healthy"], [])

    # Its heartbeat must outlive the freeze (TTL 5 heartbeats: 150 s), or the manager finds it gone, not late: on a
    # busy machine the freeze below (two CLI starts and a sync) outlasted the 5 s TTL of the tests' 0.3 s heartbeat.
    stuck = workers("stuck", "--engine", "synthetic", "--heartbeat-s", "30")
    os.kill(stuck.pid, signal.SIGSTOP)
    driver = subprocess.Popen(
        [sys.executable, "-m", "rollouts", "publish-weights", "--redis", url, "--ns", ns,
         "--from", str(tiny_model_dir), "--ack-timeout-s", "600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = RolloutClient(url, ns)
    manager = Manager(client.streams)
    wait_until(lambda: manager.state().paused and manager.state().pending_version == 2, 60, "the sync to begin")
    wait_until(lambda: client.streams.redis.hget(client.streams.keys.worker("healthy"), "epoch") == b"2", 60, "ack")
    driver.kill()  # the driver dies mid-sync: every worker stays paused
    driver.wait()
    assert manager.state().paused

    finished = rollouts_cli("manager", "--redis", url, "--ns", ns, "--once", "--abandoned-after-s", "0")
    assert finished.returncode == 0, finished.stderr
    assert "finished an abandoned sync" in finished.stderr
    assert json.loads(finished.stdout) == {"version": 2, "epoch": 2, "paused": False}
    os.kill(stuck.pid, signal.SIGCONT)
    assert stuck.wait(timeout=60) == 1  # evicted: it never acked
    client.submit(tokens=[3, 4, 5], n=1, max_tokens=8, id="after")
    (group,) = client.collect(1, timeout=60)
    assert group.rollouts[0].version == 2 and group.rollouts[0].worker == "healthy"
    assert healthy.poll() is None


def test_the_sync_stall_does_not_grow_with_a_million_other_keys(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """The manager finds workers in the registry set `{ns}:workers`, never by SCAN: a namespace that holds a
    million other keys (a SCAN of them took 1.18 s) syncs as fast as an empty one."""
    import statistics

    import torch

    workers("w1", "--engine", "synthetic")
    client = RolloutClient(redis_server.url, ns)
    weights = {"w": torch.zeros(4)}

    def stall() -> float:
        client.publish_weights(weights)
        assert client.last_sync is not None and client.last_sync.acked == ["w1"]
        return client.last_sync.stall_s

    before = statistics.median(stall() for _ in range(3))

    def each_key(command: str) -> None:  # in scripts of 100k keys: one of a million outlasts Redis's busy limit
        script = f"for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do redis.call('{command}', KEYS[1] .. i, '1') end"
        for first in range(1, 1_000_001, 100_000):
            client.streams.redis.eval(script, 1, f"{{{ns}}}:other:", first, first + 99_999)

    each_key("SET")
    assert client.streams.redis.dbsize() > 1_000_000
    after = statistics.median(stall() for _ in range(3))
    each_key("DEL")
    assert after < before + 0.1, (before, after)


def test_workers_wait_on_their_bell_not_on_control_and_an_unrung_command_still_arrives(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """Workers block on their doorbell (`{ns}:bell:K`), never on `control`, so that a manager can wake a fleet in
    waves; a command whose ring never came (its sender died after writing it) is read at the next recheck."""
    workers("syn", "--engine", "synthetic")
    client = RolloutClient(redis_server.url, ns)
    bell = client.streams.keys.bell(bell_index("syn"))
    blocking_reads: list[str] = []
    deadline = time.monotonic() + 30
    with client.streams.redis.monitor() as monitor:
        for command in monitor.listen():  # the worker's blocking reads, as Redis saw them
            if command["command"].startswith("XREAD ") and " BLOCK " in command["command"]:
                blocking_reads.append(command["command"])
            if any(bell in read for read in blocking_reads) or time.monotonic() > deadline:
                break
    assert any(f" STREAMS {bell} " in read for read in blocking_reads), blocking_reads
    assert not any(client.streams.keys.control in read for read in blocking_reads), blocking_reads

    proc = workers("syn2", "--engine", "synthetic")
    stop = for_redis(Control(cmd="stop").to_fields())
    client.streams.redis.xadd(client.streams.keys.control, stop)  # written, never rung
    wait_until(lambda: proc.poll() is not None, CONTROL_RECHECK_S + 30, "the worker to read the unrung stop")
    assert proc.returncode == 0


def test_publish_weights_returns_before_the_resume_is_rung_and_settle_waits_for_it(
    redis_server: RedisServer, ns: str
) -> None:
    """`publish_weights` returns once the resume is written; `settle()` returns once every wave has been rung, and the
    next `publish_weights` starts only then."""
    import torch

    from pipeline.control import BELLS, WAKE_COST_S, wave_gap

    client = RolloutClient(redis_server.url, ns)
    fleet = 1000  # registered, none heartbeating: nobody to wait for, the rings are the whole sync
    client.streams.redis.sadd(client.streams.keys.workers, *[f"w{i}" for i in range(fleet)])
    assert client.publish_weights({"w": torch.zeros(2)}, mode="abort") == 1
    bells = [client.streams.keys.bell(index) for index in range(BELLS)]
    returned = time.monotonic()
    client.settle()
    assert time.monotonic() - returned >= 0.5 * wave_gap(fleet, WAKE_COST_S) * 31  # the ring went on meanwhile
    assert all(as_entries(client.streams.redis.xrange(bell))[0][1] == {b"cmd": b"resume"} for bell in bells)
    assert client.publish_weights({"w": torch.ones(2)}, mode="keep") == 2
    client.settle()
    assert read_state(client.streams.redis, client.streams.keys).version == 2


SLOW_SYNTHETIC = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 30, "lengths": "uniform:150-200"}')
"""A synthetic worker whose samples take 5-7 s: every sync below interrupts some, though the test process that
publishes it may be slow to (under a loaded suite its samples of ~3 s were all done before the sync came)."""


def busy_for(client: RolloutClient, name: str, seconds: float) -> Callable[[], bool]:
    """True once worker `name` has generated for `seconds` (its heartbeat's `busy_s`): its samples have tokens."""
    return lambda: float(client.streams.redis.hget(client.streams.keys.worker(name), "busy_s") or 0) >= seconds


@pytest.mark.parametrize("hand_off", [False, True], ids=["continued-here", "handed-off"])
def test_an_abort_sync_continues_interrupted_samples_where_they_were_unless_handed_off(
    redis_server: RedisServer, ns: str, tiny_model_dir_v1: Path, workers: StartWorker, hand_off: bool
) -> None:
    """By default a worker continues the samples an `abort` pause interrupted itself, after the resume: nothing goes
    through `{ns}:partials`. With `--hand-off-partials` each goes there, acked with its prompt, for any worker."""
    workers("w", *SLOW_SYNTHETIC, *(["--hand-off-partials"] if hand_off else []))
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[5 + i, 9], n=2, max_tokens=200, seed=i) for i in range(8)]
    wait_until(busy_for(client, "w", 0.5), 30, "generation to start")
    assert client.publish_weights(tiny_model_dir_v1, transport="redis://", mode="abort") == 1
    groups = client.collect(len(ids), timeout=120)
    rollouts = [r for g in groups for r in g.rollouts]
    assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in ids for k in range(2))
    assert client.stats["duplicates"] == 0
    interrupted = [r for r in rollouts if len(r.spans) == 2]
    assert interrupted and all(r.spans[0][0] == 0 and r.spans[1][0] == 1 for r in interrupted), [
        r.spans for r in rollouts
    ]
    went_through_redis = client.streams.redis.xinfo_stream(client.streams.keys.partials)["last-generated-id"] != b"0-0"
    assert went_through_redis == hand_off
    # ... and the heartbeat says which, for the manager's pacing of abort syncs.
    assert client.streams.registry.live_workers_with("partials") == {"w": "hand-off" if hand_off else "here"}


def test_a_worker_that_stops_before_the_resume_hands_its_interrupted_samples_to_the_others(
    redis_server: RedisServer, ns: str, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    """A worker asked to stop while an abort sync holds it paused cannot continue what the pause interrupted: it
    publishes those samples to `{ns}:partials` as it drains, and another worker finishes them from where they were."""
    frozen = workers("frozen", *SLOW_SYNTHETIC, "--heartbeat-s", "30")  # its heartbeat outlives the sync below
    os.kill(frozen.pid, signal.SIGSTOP)  # it never acks: the sync holds `leaving` paused until the ack timeout
    leaving = workers("leaving", *SLOW_SYNTHETIC)
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[5 + i, 9], n=2, max_tokens=200, seed=i) for i in range(8)]
    wait_until(busy_for(client, "leaving", 0.5), 30, "generation to start")
    with ThreadPoolExecutor(1) as pool:
        sync = pool.submit(client.publish_weights, tiny_model_dir_v1, mode="abort", ack_timeout_s=6)
        worker_key = client.streams.keys.worker("leaving")
        wait_until(lambda: client.streams.redis.hget(worker_key, "epoch") == b"1", 20, "`leaving` to ack")
        os.kill(leaving.pid, signal.SIGTERM)
        assert leaving.wait(timeout=30) == 0
        handed = [
            Partial.from_fields(f) for _, f in as_entries(client.streams.redis.xrange(client.streams.keys.partials))
        ]
        assert handed, "the interrupted samples were handed off"
        assert sync.result(timeout=60) == 1
    assert client.last_sync is not None
    assert client.last_sync.evicted == ["frozen"]
    os.kill(frozen.pid, signal.SIGCONT)  # it wakes up evicted, and leaves
    assert frozen.wait(timeout=60) == 1
    workers("finisher", *SLOW_SYNTHETIC)
    groups = client.collect(len(ids), timeout=120)
    rollouts = [r for g in groups for r in g.rollouts]
    assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in ids for k in range(2))
    assert client.stats["duplicates"] == 0
    by_id = {r.id: r for r in rollouts}
    for partial in handed:  # each finished by the newcomer from where `leaving` was, under the new version
        rollout = by_id[f"{partial.prompt.id}:{partial.sample}"]
        done = len(partial.generated)
        assert rollout.worker == "finisher" and list(rollout.tokens[:done]) == list(partial.generated)
        assert rollout.spans[-1][0] == 1 and all(v == 0 for v, _, end in rollout.spans if end <= done)

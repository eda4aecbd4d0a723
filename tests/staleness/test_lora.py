"""Multi-LoRA through the whole pipeline: worker processes on a real Redis, adapters published by the trainer.

Seed 003's four scenarios (SkyRL's per-adapter pause), with adapters trained to prefer their own tokens so that
whose tokens a sample holds is plain to see: pausing adapter A does not stop adapter B; A's in-flight samples
recover after the resume with tokens from A's new version; a sample that spans the update shows both versions
in order, each span's logprobs a forward pass under base + that version; a fresh A request made during the
pause waits at the gate and runs entirely under the new version. Plus: many adapters on few slots (evictions),
an adapter nobody published (an error rollout), and an adapter sync while the base model syncs too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from consumers.engines.lora import save_adapter
from consumers.engines.tiny_model import make_adapter
from pipeline.codec import as_entries
from pipeline.local import RedisServer, free_port
from pipeline.processes import start_command
from pipeline.wire import GENERATORS, Partial, PauseMode, Sampling, ack_field
from producers.client import Group, RolloutClient
from staleness.manager import Manager, SyncReport
from staleness.state import read_state
from staleness.weights import open_transport
from tests.fixtures import StartWorker, wait_until
from tests.reference import check_spans_and_logprobs, merged_model_dir, random_prompts

Adapter = tuple[dict[str, torch.Tensor], dict]
FAVOURED = {"a1": range(100, 140), "a2": range(200, 240), "b1": range(300, 340), "c1": range(400, 440)}
"""The tokens each adapter (name + version) was trained to prefer: disjoint, so a token tells whose it is."""


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path) -> dict[str, Adapter]:
    return {key: make_adapter(tiny_model_dir, list(tokens), seed=i) for i, (key, tokens) in enumerate(FAVOURED.items())}


def share(tokens: np.ndarray, key: str) -> float:
    """The fraction of `tokens` in adapter version `key`'s favoured set."""
    favoured = FAVOURED[key]
    return float(np.mean([favoured.start <= t < favoured.stop for t in tokens])) if len(tokens) else 0.0


def submit(client: RolloutClient, ids: list[str], adapter: str | None, max_tokens: int, n: int = 2) -> None:
    for prompt_id, tokens in zip(ids, random_prompts([8] * len(ids), seed=len(ids)), strict=True):
        client.submit(tokens=tokens, n=n, max_tokens=max_tokens, temperature=0.0, id=prompt_id, adapter=adapter)


def start_long_samples_of_a(client: RolloutClient, ids: list[str]) -> None:
    """Long greedy samples of adapter a, generating when this returns: a short probe submitted after them is done."""
    submit(client, ids, "a", max_tokens=400)
    submit(client, ["a-probe"], "a", max_tokens=8, n=1)
    [probe] = client.collect(1, timeout=60)
    assert probe.prompt_id == "a-probe"


@contextmanager
def a_sync_held_open(
    client: RolloutClient, adapters: dict[str, Adapter], mode: PauseMode, worker: str
) -> Iterator[tuple[threading.Event, Future[SyncReport]]]:
    """Adapter a's sync to its version 2 (`a2`), by hand so that it can be held open: yields once `worker` acked it
    (it closed a's gate, paused a and loaded: a prompt submitted when the state only says "paused" may reach a worker
    that has not read the command yet, and start under version 1); the manager resumes once the event is set."""
    redis_client, keys = client.streams.redis, client.streams.keys
    store = open_transport("redis://", redis_client=redis_client, ns=keys.ns, adapter="a")
    uri = store.publish(adapters["a2"][0], 2, adapter_config=adapters["a2"][1])
    released = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        sync = pool.submit(Manager(client.streams, adapter="a").sync, 2, uri, mode, lambda e, w: released.wait(120))
        wait_until(lambda: read_state(redis_client, keys, "a").paused, 30, "a's pause")
        epoch = str(read_state(redis_client, keys, "a").epoch).encode()
        acked = lambda: redis_client.hget(keys.worker(worker), ack_field("a")) == epoch  # noqa: E731
        wait_until(acked, 60, f"{worker}'s ack of a's sync")
        try:
            yield released, sync
        finally:
            released.set()


@pytest.mark.parametrize(
    ("engine", "mode"),
    [("torch", "keep"), ("torch", "abort"), pytest.param("vllm", "keep", marks=pytest.mark.vllm)],
)
def test_an_adapter_sync_pauses_that_adapter_alone_and_its_samples_go_on_under_the_new_version(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    workers: StartWorker,
    adapters: dict[str, Adapter],
    tmp_path: Path,
    engine: str,
    mode: PauseMode,
    one_thread: None,
) -> None:
    """vLLM has no per-adapter pause: its engine aborts the adapter's requests and, in keep mode, continues each
    from prompt + tokens so far after the resume (seed 003's way); the worker sees the same behaviour."""
    client = RolloutClient(redis_server.url, ns)
    client.publish_weights(adapters["a1"][0], adapter="a", adapter_config=adapters["a1"][1])
    client.publish_weights(adapters["b1"][0], adapter="b", adapter_config=adapters["b1"][1])
    workers("w1", "--engine", engine, "--max-loras", "2", "--max-batch", "16")
    submit(client, ["warm-a"], "a", max_tokens=4)  # a and b loaded (on demand) before the long ones come
    submit(client, ["warm-b"], "b", max_tokens=4)
    assert len(client.collect(2, timeout=120)) == 2
    a_ids = [f"a{i}" for i in range(6 if engine == "torch" else 24)]  # vLLM is faster: more, to be mid-way
    start_long_samples_of_a(client, a_ids)
    with a_sync_held_open(client, adapters, mode, "w1") as (released, sync):
        submit(client, ["fresh-a"], "a", max_tokens=24)  # made during the pause: waits at the gate
        b_ids = [f"b{i}" for i in range(4)]
        submit(client, b_ids, "b", max_tokens=24)
        during = client.collect(len(b_ids), timeout=60)  # b goes on while a is paused
        assert sorted(g.prompt_id for g in during) == b_ids, "only b's groups finish while a is paused"
        assert not read_state(client.streams.redis, client.streams.keys, "b").paused
        released.set()
        report = sync.result(timeout=120)
    assert report.acked == ["w1"] and not report.evicted
    after = {g.prompt_id: g for g in client.collect(len(a_ids) + 1, timeout=120)}
    assert sorted(after) == sorted([*a_ids, "fresh-a"])

    for group in during:  # b: its own version 1 throughout, its own tokens
        for rollout in group.rollouts:
            assert rollout.adapter == "b" and rollout.spans == [(1, 0, rollout.n_tokens)]
            assert share(rollout.tokens, "b1") > 0.7
    fresh = after.pop("fresh-a")  # entirely under a's new version
    for rollout in fresh.rollouts:
        assert rollout.spans == [(2, 0, rollout.n_tokens)] and share(rollout.tokens, "a2") > 0.7
    references = {
        1: merged_model_dir(tiny_model_dir, *adapters["a1"], tmp_path / "a1"),
        2: merged_model_dir(tiny_model_dir, *adapters["a2"], tmp_path / "a2"),
    }
    spanning = [r for g in after.values() for r in g.rollouts if len(r.spans) == 2]
    assert spanning, "some of a's samples were in flight when its sync began"
    for group in after.values():
        for rollout in group.rollouts:
            assert rollout.adapter == "a" and {v for v, _, _ in rollout.spans} <= {1, 2}
            check_spans_and_logprobs(rollout, references)
            for version, start, end in rollout.spans:  # each version's tokens are that version's own (a span's
                if end - start >= 20:  # first few tokens may still be the base model's favourites)
                    assert share(rollout.tokens[start:end], f"a{version}") > 0.6, (version, rollout.tokens[start:end])
    assert read_state(client.streams.redis, client.streams.keys, "a").version == 2
    assert read_state(client.streams.redis, client.streams.keys).version == 0  # the base model never moved


@pytest.mark.parametrize(
    ("engine", "mode"),
    [
        ("torch", "keep"),
        ("torch", "abort"),
        pytest.param("vllm", "keep", marks=[pytest.mark.vllm, pytest.mark.long("the same with the torch engine")]),
    ],
)
def test_a_worker_stopped_inside_an_adapter_sync_hands_that_adapters_samples_on_at_once_and_another_finishes_them(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    workers: StartWorker,
    adapters: dict[str, Adapter],
    tmp_path: Path,
    engine: str,
    mode: PauseMode,
    one_thread: None,
) -> None:
    """While an adapter's sync is held open its samples wait here (frozen by a `keep` sync, or at the adapter's gate
    after an `abort` one), and so does a request for it made meanwhile. A worker stopped then waits for none of them:
    each goes to `{ns}:partials` with its tokens so far at once, not after the worker's 30 s drain, and a worker
    started during the sync continues them under the adapter's new version."""
    client = RolloutClient(redis_server.url, ns)
    redis_client, keys = client.streams.redis, client.streams.keys
    client.publish_weights(adapters["a1"][0], adapter="a", adapter_config=adapters["a1"][1])
    w1 = workers("w1", "--engine", engine, "--max-loras", "2", "--max-batch", "16")
    submit(client, ["warm-a"], "a", max_tokens=4)
    assert len(client.collect(1, timeout=120)) == 1
    long_ids = [f"a{i}" for i in range(2 if engine == "torch" else 8)]  # vLLM is faster: more, to be mid-way
    start_long_samples_of_a(client, long_ids)
    with a_sync_held_open(client, adapters, mode, "w1") as (released, sync):
        pending = lambda: redis_client.xpending(keys.prompts, GENERATORS)["pending"]  # noqa: E731
        unfinished = pending()  # none of a's samples can finish while it is paused
        assert unfinished >= 1, "some long samples were in flight when a's sync began"
        submit(client, ["fresh-a"], "a", max_tokens=24, n=1)  # made during the sync: it waits at a's gate in w1
        wait_until(lambda: pending() == unfinished + 1, 30, "w1 to take the fresh request")

        stopped = time.monotonic()
        w1.send_signal(signal.SIGTERM)
        assert w1.wait(timeout=60) == 0 and time.monotonic() - stopped < 15
        partials = [Partial.from_fields(fields) for _, fields in as_entries(redis_client.xrange(keys.partials))]
        assert pending() == 0  # every prompt acked with its hand-off
        handed = {(p.prompt.id, p.sample): p for p in partials}
        assert handed.pop(("fresh-a", 0)).generated.size == 0
        assert len(handed) == 2 * unfinished and {prompt_id for prompt_id, _ in handed} <= set(long_ids)
        assert all(0 < len(p.generated) < 400 and p.spans == [(1, 0, len(p.generated))] for p in handed.values())

        workers("w2", "--engine", engine, "--max-loras", "2", "--max-batch", "16")  # it joins a's sync under way
        released.set()
        report = sync.result(timeout=120)
    assert not report.evicted
    groups = {g.prompt_id: g for g in client.collect(len(long_ids) + 1, timeout=240)}
    assert sorted(groups) == sorted([*long_ids, "fresh-a"])
    references = {
        1: merged_model_dir(tiny_model_dir, *adapters["a1"], tmp_path / "a1"),
        2: merged_model_dir(tiny_model_dir, *adapters["a2"], tmp_path / "a2"),
    }
    (fresh,) = groups.pop("fresh-a").rollouts
    assert fresh.worker == "w2" and fresh.spans == [(2, 0, fresh.n_tokens)]
    for group in groups.values():
        for rollout in group.rollouts:
            check_spans_and_logprobs(rollout, references)
            kept = handed.get((group.prompt_id, rollout.sample))
            if kept is not None:  # w1's tokens, continued by w2 under a's version 2
                k = len(kept.generated)
                assert rollout.worker == "w2" and rollout.tokens[:k].tolist() == kept.generated.tolist()
                assert rollout.spans == [(1, 0, k), (2, k, rollout.n_tokens)]


def test_many_adapters_share_few_slots_and_an_unpublished_one_is_an_error_rollout(
    redis_server: RedisServer,
    ns: str,
    workers: StartWorker,
    adapters: dict[str, Adapter],
) -> None:
    client = RolloutClient(redis_server.url, ns)
    for name, key in (("a", "a1"), ("b", "b1"), ("c", "c1"), ("d", "a2")):
        client.publish_weights(adapters[key][0], adapter=name, adapter_config=adapters[key][1])
    port = free_port()
    workers("w1", "--max-loras", "2", "--metrics-port", str(port))
    keys = {"a": "a1", "b": "b1", "c": "c1", "d": "a2"}
    for round_ in range(3):  # every round needs all four: two slots force evictions
        for name in keys:
            submit(client, [f"{name}{round_}-{i}" for i in range(2)], name, max_tokens=16)
    submit(client, ["nobody"], "never-published", max_tokens=16, n=1)
    groups: list[Group] = client.collect(3 * 4 * 2 + 1, timeout=180)
    by_id = {g.prompt_id: g for g in groups}
    error = by_id.pop("nobody").rollouts[0]
    assert error.finish_reason == "error" and "never-published" in (error.error or "")
    assert "never published" in (error.error or "")
    for group in by_id.values():
        for rollout in group.rollouts:
            assert rollout.finish_reason != "error", rollout.error
            assert share(rollout.tokens, keys[rollout.adapter or ""]) > 0.7, (rollout.adapter, rollout.tokens)
    held = client.streams.registry.live_workers()["w1"].get("adapters", "")
    assert 1 <= len(held.split(",")) <= 2, held
    scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text  # what Prometheus sees
    lines = scraped.splitlines()
    loads = sum(float(line.split()[-1]) for line in lines if line.startswith("rollouts_adapter_loads_total"))
    evictions = next(float(line.split()[-1]) for line in lines if line.startswith("rollouts_adapter_evictions_total"))
    assert loads >= 4 and evictions >= 2  # four adapters through two slots


def test_an_adapter_syncs_while_the_base_model_syncs(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    adapters: dict[str, Adapter],
) -> None:
    client = RolloutClient(redis_server.url, ns)
    client.publish_weights(adapters["a1"][0], adapter="a", adapter_config=adapters["a1"][1])
    workers("w1")
    submit(client, [f"base{i}" for i in range(4)], None, max_tokens=200)
    submit(client, [f"a{i}" for i in range(4)], "a", max_tokens=200)
    wait_until(lambda: client.streams.redis.xpending(client.streams.keys.prompts, GENERATORS)["pending"] >= 8, 60, "")
    other = RolloutClient(redis_server.url, ns, consumer="publisher")
    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(client.publish_weights, tiny_model_dir_v1)
        adapter = pool.submit(other.publish_weights, adapters["a2"][0], adapter="a", adapter_config=adapters["a2"][1])
        assert base.result(timeout=120) == 1 and adapter.result(timeout=120) == 2
    groups = client.collect(8, timeout=120)
    for group in groups:
        allowed = {1, 2} if group.adapter == "a" else {0, 1}
        for rollout in group.rollouts:
            assert {v for v, _, _ in rollout.spans} <= allowed and rollout.finish_reason != "error"
    assert read_state(client.streams.redis, client.streams.keys).version == 1
    assert read_state(client.streams.redis, client.streams.keys, "a").version == 2
    assert not client.last_sync.evicted and not other.last_sync.evicted  # type: ignore[union-attr]  # publish_weights set them


def test_an_adapter_broadcast_over_nccl_reaches_every_worker_and_a_late_one_waits_for_the_next(
    redis_server: RedisServer,
    ns: str,
    workers: StartWorker,
    adapters: dict[str, Adapter],
) -> None:
    """Over `nccl://` (gloo here, on CPUs) an adapter is stored nowhere: every live worker receives it during the
    sync and keeps a copy to load from; a worker started later has none, so its request for the adapter waits for
    the adapter's next broadcast, and then runs entirely under that version."""
    client = RolloutClient(redis_server.url, ns)
    workers.many(("w1",), ("w2",))
    nccl = f"nccl://127.0.0.1:{free_port()}"
    client.publish_weights(adapters["a1"][0], adapter="a", adapter_config=adapters["a1"][1], transport=nccl)
    assert sorted(client.last_sync.acked) == ["w1", "w2"]  # type: ignore[union-attr]  # publish_weights set it
    submit(client, [f"a{i}" for i in range(4)], "a", max_tokens=16)
    for group in client.collect(4, timeout=60):
        for rollout in group.rollouts:
            assert rollout.spans == [(1, 0, rollout.n_tokens)] and share(rollout.tokens, "a1") > 0.7

    workers("w3")  # after the broadcast: no copy of a's version 1
    for prompt_id, adapter in (("late-a", "a"), ("late-base", None)):
        greedy = Sampling(max_tokens=16, temperature=0.0)
        prompt = client.make_prompt(tokens=[7, 8, 9], n=1, id=prompt_id, adapter=adapter, sampling=greedy)
        client.streams.writer.add_to_inbox("w3", prompt)  # work for w3 only
    [base] = client.collect(1, timeout=60)  # w3 serves the base model meanwhile...
    assert base.prompt_id == "late-base" and base.rollouts[0].worker == "w3"
    with pytest.raises(TimeoutError):  # ...while its request for a waits for a version it can load
        client.collect(1, timeout=3)
    client.publish_weights(adapters["a2"][0], adapter="a", adapter_config=adapters["a2"][1], transport=nccl)
    assert sorted(client.last_sync.acked) == ["w1", "w2", "w3"]  # type: ignore[union-attr]  # publish_weights set it
    [late] = client.collect(1, timeout=60)
    rollout = late.rollouts[0]
    assert late.prompt_id == "late-a" and rollout.worker == "w3"
    assert rollout.spans == [(2, 0, rollout.n_tokens)] and share(rollout.tokens, "a2") > 0.7


def test_an_adapter_sync_whose_driver_died_is_finished_by_the_manager_and_a_silent_worker_evicted(
    redis_server: RedisServer,
    ns: str,
    workers: StartWorker,
    adapters: dict[str, Adapter],
    tmp_path: Path,
) -> None:
    """The manager's protocol per adapter, through the CLI: `publish-weights --adapter` from a PEFT directory, its
    driver killed mid-sync (every worker's adapter left paused), `rollouts manager` finishing it, and the worker
    that never acked evicted."""
    url = redis_server.url
    healthy = workers("healthy")
    stuck = workers("stuck", "--heartbeat-s", "30")  # its heartbeat (TTL 150 s) outlives the freeze: late, not gone
    os.kill(stuck.pid, signal.SIGSTOP)  # frozen: it will never ack
    peft = save_adapter(*adapters["a1"], tmp_path / "a1")
    driver = start_command(
        "publish-weights", "--redis", url, "--ns", ns, "--from", str(peft), "--adapter", "a", "--ack-timeout-s", "600"
    )
    client = RolloutClient(url, ns)
    keys = client.streams.keys
    wait_until(lambda: read_state(client.streams.redis, keys, "a").paused, 60, "a's sync to begin")
    wait_until(lambda: client.streams.redis.hget(keys.worker("healthy"), "epoch@a") == b"1", 60, "healthy's ack")
    driver.kill()  # the driver dies mid-sync
    driver.wait()
    assert read_state(client.streams.redis, keys, "a").paused

    manager = [sys.executable, "-m", "rollouts", "manager", "--redis", url, "--ns", ns, "--once"]
    finished = subprocess.run(
        [*manager, "--abandoned-after-s", "0"], capture_output=True, text=True, timeout=120, check=False
    )
    assert finished.returncode == 0, finished.stderr
    assert "finished an abandoned sync of adapter a" in finished.stderr.replace("\n", " ")
    state = read_state(client.streams.redis, keys, "a")
    assert (state.version, state.paused, read_state(client.streams.redis, keys).version) == (1, False, 0)
    os.kill(stuck.pid, signal.SIGCONT)
    assert stuck.wait(timeout=60) == 1  # evicted: it never acked a's sync
    submit(client, ["after"], "a", max_tokens=16, n=1)
    [group] = client.collect(1, timeout=60)
    rollout = group.rollouts[0]
    assert rollout.worker == "healthy" and rollout.spans == [(1, 0, rollout.n_tokens)]
    assert share(rollout.tokens, "a1") > 0.7
    assert healthy.poll() is None

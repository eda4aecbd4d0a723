"""The `remote` engine: workers that serve the queue with a vLLM server someone else runs (`vllm serve`).

One real vLLM OpenAI-compatible server (its own processes, ~40 s to come up on 2 cores) serves the module. The first
test starts a worker before the server answers; the last one kills the server. Tests run in file order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.chaos_proxy import Proxy
from consumers.engines.base import EngineInputError
from consumers.engines.remote_engine import RemoteVllmEngine
from consumers.engines.vllm_engine import VllmEngine
from pipeline.local import RedisServer, free_port
from pipeline.processes import start_worker, stop_process, wait_for_worker
from pipeline.wire import GENERATORS, PauseMode, Prompt, Sampling
from producers.client import RolloutClient
from tests.consumers.test_lazy import heartbeat, serve_one
from tests.engine_loop import Served
from tests.fixtures import StartWorker, holds_work, wait_until
from tests.reference import check_spans_and_logprobs, forward_logprobs, random_prompts
from tests.vllm_server import Server, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A vLLM server for the module, started but not waited for (the first test starts a worker before it is up)."""
    with vllm_server(tiny_model_dir, tmp_path_factory.mktemp("vllm-server") / "server.log") as server:
        yield server


REMOTE_FLAGS = ("--claim-idle-ms", "10000", "--heartbeat-s", "2")
"""Heartbeats alive 10 s: a worker that sits behind the busy server on a 2-core machine is late, not dead."""


def remote_worker(
    redis_server: RedisServer, ns: str, model: Path, name: str, url: str, log: Path, *extra: str
) -> subprocess.Popen:
    flags = (*REMOTE_FLAGS, "--engine", "remote", "--url", url, *extra)
    return start_worker(redis_server.url, ns, model, name, *flags, log_file=log)


def logged(needle: str, log: Path) -> bool:
    """`needle` is in the worker's log, however rich wrapped it (at 80 columns, long paths mid-word)."""
    return "".join(needle.split()) in "".join(log.read_text().split())


def test_a_worker_started_before_its_server_serves_once_it_is_up_and_bad_input_spares_the_server(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, server: Server, tmp_path: Path
) -> None:
    assert not server.healthy(), "the server must still be coming up when the worker starts"
    worker = remote_worker(redis_server, ns, tiny_model_dir, "w1", server.url, tmp_path / "w1.log")
    try:
        client = RolloutClient(redis_server.url, ns, trim_every_s=0)
        ids = [client.submit(tokens=[5 + i, 17, 33, 8], n=3, max_tokens=24, seed=i, temperature=0.8) for i in range(4)]
        # What vLLM's server would not survive or refuses: checked in the worker, each an error rollout.
        client.submit_prompts(
            [Prompt(id="bad-token", n=1, tokens=[7, 10**6]), Prompt(id="too-long", n=1, tokens=[7] * 600)]
        )
        groups = {g.prompt_id: g for g in client.collect(len(ids) + 2, timeout=300)}
        assert server.healthy() and worker.poll() is None

        assert sorted(groups) == sorted([*ids, "bad-token", "too-long"])
        assert client.stats["duplicates"] == 0
        for pid, needle in (("bad-token", "token ids"), ("too-long", "context")):
            (rollout,) = groups[pid].rollouts
            assert rollout.finish_reason == "error" and needle in (rollout.error or "")
        rollouts = [r for pid in ids for r in groups[pid].rollouts]
        assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in ids for k in range(3))
        for r in rollouts:
            assert r.worker == "w1" and r.spans == [(0, 0, r.n_tokens)] and r.finish_reason in ("stop", "length")
            reference = forward_logprobs(tiny_model_dir, r.prompt_tokens.tolist(), r.tokens.tolist())
            np.testing.assert_allclose(r.logprobs, reference, atol=1e-4)
        assert client.streams.redis.xpending(client.streams.keys.prompts, GENERATORS)["pending"] == 0
    finally:
        stop_process(worker)


def test_the_engine_drops_an_idle_connection_before_the_vllm_server_does() -> None:
    """A request sent on a pooled connection in the instant the server closes it as idle fails with `ReadError('')`,
    which a worker takes for a dead server: it stopped mid-run once (the GRPO test on a `vllm serve`). So the
    engine's pool must expire idle connections sooner than vLLM's keep-alive (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`)."""
    import vllm.envs

    from consumers.engines.remote_engine import http_client

    client = http_client("http://127.0.0.1:1", {})
    try:
        # httpx keeps its Limits only in the pool.
        expiry = client._transport._pool._keepalive_expiry  # type: ignore[attr-defined]  # httpx declares no pool
        assert expiry is not None and expiry < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE / 2
    finally:
        asyncio.run(client.aclose())


def test_greedy_tokens_and_logprobs_match_the_in_process_vllm_engine(tiny_model_dir: Path, server: Server) -> None:
    wait_until(server.healthy, 300, "the vLLM server")
    local = Served(VllmEngine(tiny_model_dir))
    remote = RemoteVllmEngine(tiny_model_dir, url=server.url)
    prompts = random_prompts([3, 9, 17, 30], seed=5)
    greedy = Sampling(max_tokens=40, temperature=0)
    try:
        local.run(local.engine.start(), timeout=240)

        async def both(engine: VllmEngine | RemoteVllmEngine) -> list:
            await engine.start()
            return await asyncio.gather(*(engine.generate(f"g{i}", p, greedy) for i, p in enumerate(prompts)))

        mine, theirs = local.run(both(local.engine)), local.run(both(remote))
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
            assert a.finish_reason == b.finish_reason and b.spans == [(0, 0, len(b.tokens))]
        for engine in (local.engine, remote):  # the same refusals, before anything reaches vLLM
            with pytest.raises(EngineInputError, match="temperature"):
                local.run(engine.generate("bad", prompts[0], Sampling(temperature=-1)))

        async def aborted() -> tuple[int, str]:
            """A request frozen by a pause cannot finish on its own: only the abort ends it, however slow the
            machine. (Partial tokens of aborted requests: the abort-mode sync test.)"""
            await remote.pause("keep")
            run = asyncio.ensure_future(remote.generate("long", prompts[1], Sampling(max_tokens=480, seed=1)))
            await asyncio.sleep(0)  # let `generate` send its request; the abort is sent again until it lands
            await remote.abort(["long"])
            generation = await run
            await remote.resume()
            return len(generation.tokens), generation.finish_reason

        remote_done = remote.generated_tokens
        n, reason = local.run(aborted())
        assert (reason, n) == ("abort", 0)
        assert remote.generated_tokens == remote_done + n
    finally:
        local.run(remote.shutdown())
        local.run(local.engine.shutdown(), timeout=60)
        local.close()


def test_a_connection_that_breaks_under_a_live_server_is_sent_again_not_taken_for_a_dead_server(
    tiny_model_dir: Path, server: Server
) -> None:
    """A connection that breaks while the server is up (a pooled one the server closed as idle in the instant it was
    reused; a reset on the way) once stopped the GRPO test's only worker mid-run, as if its server had died. Here a
    proxy resets every connection under a generation the server holds frozen: the engine finds the server still
    answering, sends the request again, and it finishes in full under the server's weights; the cut request does not
    linger on the server."""
    wait_until(server.healthy, 300, "the vLLM server")
    server.serve_base_model(tiny_model_dir)
    proxy = Proxy(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    served = Served(RemoteVllmEngine(tiny_model_dir, url=f"http://127.0.0.1:{proxy.port}"))
    engine: RemoteVllmEngine = served.engine
    prompt = random_prompts([12], seed=7)[0]
    try:
        served.run(engine.start())
        generate = engine.generate("cut", prompt, Sampling(max_tokens=300, seed=2))
        run = asyncio.run_coroutine_threadsafe(generate, served.loop)
        wait_until(lambda: server.running() >= 1, 60, "the server to run the request")
        served.run(engine.pause("keep"))  # frozen: it cannot finish before the cut, however fast the machine
        connections = proxy.connections
        assert proxy.cut() >= 1
        wait_until(lambda: proxy.connections > connections, 60, "the engine to connect again")
        served.run(engine.resume())
        generation = run.result(timeout=240)
        assert (generation.finish_reason, len(generation.tokens)) == ("length", 300)
        expected = forward_logprobs(tiny_model_dir, prompt.tolist(), generation.tokens.tolist())
        np.testing.assert_allclose(generation.logprobs, expected, atol=1e-4)
        wait_until(lambda: server.running() == 0, 60, "the cut request to leave the server")
    finally:
        served.run(engine.shutdown())
        served.close()
        proxy.close()


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_two_workers_sharing_one_server_sync_weights_mid_generation(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    server: Server,
    tmp_path: Path,
    mode: PauseMode,
) -> None:
    wait_until(server.healthy, 300, "the vLLM server")
    server.serve_base_model(tiny_model_dir)  # the previous test left it at version 2
    # In abort mode `a` continues the samples a pause interrupted itself (the default: it sends them to the paused
    # server again at once, and the server holds them until its resume) and `b` hands its own off to `{ns}:partials`.
    # Room for 6 of the 12 prompts each: a worker with room for all took all 12 before the other read one (CI, once),
    # and the other generated nothing.
    room = ["--max-inflight", "24"]
    flags = {"a": room, "b": [*room, "--hand-off-partials"] if mode == "abort" else room}
    started = [
        remote_worker(redis_server, ns, tiny_model_dir, name, server.url, tmp_path / f"{name}.log", *flags[name])
        for name in "ab"
    ]
    try:
        client = RolloutClient(redis_server.url, ns)
        for name, process in zip("ab", started, strict=True):
            wait_for_worker(client.streams.redis, ns, name, process, timeout_s=120)
        # The tiny model is fast on a server of its own: enough work that some is in flight at each sync.
        ids = [client.submit(tokens=[5 + i, 40, 41, 42], n=4, max_tokens=480, seed=i) for i in range(12)]
        wait_until(lambda: server.running() >= 8, 120, "the workers' requests to run on the server")
        assert client.publish_weights(tiny_model_dir_v1, transport="redis://", mode=mode) == 1
        # Both moved to v1 (a worker whose heartbeat lapsed in a machine stall counts as gone, not evicted: see
        # REMOTE_FLAGS); the spans below prove every token's version either way.
        report = client.last_sync
        assert report is not None
        assert sorted(report.acked + report.gone) == ["a", "b"] and report.evicted == [], report
        assert client.publish_weights(tiny_model_dir, transport=f"fs://{tmp_path / 'weights'}", mode=mode) == 2
        weights = {0: tiny_model_dir, 1: tiny_model_dir_v1, 2: tiny_model_dir}

        rollouts = [r for g in client.collect(len(ids), timeout=300) for r in g.rollouts]
        assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in ids for k in range(4))
        assert client.stats["duplicates"] == 0
        # Both generated (a rollout names the worker that finished it: in abort mode one worker may finish all).
        beats = [client.streams.keys.worker(name) for name in "ab"]
        generated = lambda: [int(client.streams.redis.hget(k, "generated_tokens") or 0) for k in beats]  # noqa: E731
        wait_until(lambda: min(generated()) > 0, 30, "both workers' heartbeats to show tokens")
        for rollout in rollouts:
            check_spans_and_logprobs(rollout, weights)
        partials = client.streams.redis.xinfo_stream(client.streams.keys.partials)["last-generated-id"]
        spanning = any(len(r.spans) >= 2 for r in rollouts)
        if mode == "keep":
            assert spanning, f"none spans two versions: {[r.spans for r in rollouts]}"
        else:  # how far each sample had come at the abort depends on the machine's pace: one aborted before its first
            # token spans one version; an interrupted sample went on in place (spans) or as a partial of `b`'s
            assert spanning or partials != b"0-0", [r.spans for r in rollouts]
        assert httpx.get(f"{server.url}/weight_info").json()["weight_version"] == "2"
    finally:
        for process in started:
            stop_process(process)


def test_a_lazy_remote_worker_connects_on_the_first_prompt_and_its_release_leaves_the_server_serving(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, server: Server, tmp_path: Path
) -> None:
    wait_until(server.healthy, 300, "the vLLM server")
    server.serve_base_model(tiny_model_dir)
    staging = tmp_path / "staging"  # where a user would mount a volume the server also sees
    staging.mkdir()
    log = tmp_path / "lazy.log"
    flags = ("--lazy", "--release-after-s", "2", "--engine-args", json.dumps({"staging_dir": str(staging)}))
    worker = remote_worker(redis_server, ns, tiny_model_dir, "lazy", server.url, log, *flags)
    try:
        client = RolloutClient(redis_server.url, ns)
        wait_for_worker(client.streams.redis, ns, "lazy", worker, timeout_s=120, status="idle")
        assert heartbeat(client, "lazy")["engine_starts"] == "0"

        serve_one(client, "first", 0, {0: tiny_model_dir})
        status = lambda: heartbeat(client, "lazy")["status"]  # noqa: E731
        wait_until(lambda: status() == "released", 60, "the idle engine to be released")
        assert server.healthy(), "a release closes the worker's connections; the server is not the worker's to stop"

        # A sync while released is acked with nothing loaded; the next start loads it through the staging directory.
        assert client.publish_weights(tiny_model_dir_v1, transport="redis://") == 1
        assert client.last_sync is not None
        assert client.last_sync.acked == ["lazy"] and client.last_sync.evicted == []
        assert httpx.get(f"{server.url}/weight_info").json()["weight_version"] == "0"
        serve_one(client, "second", 1, {1: tiny_model_dir_v1})
        assert httpx.get(f"{server.url}/weight_info").json()["weight_version"] == "1"
        assert heartbeat(client, "lazy")["engine_starts"] == "2"
        assert logged(f"staged in {staging}", log) and list(staging.iterdir()) == []  # staged there, then removed
    finally:
        stop_process(worker)


def test_a_worker_whose_server_dies_exits_and_its_work_finishes_elsewhere(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, server: Server, workers: StartWorker, tmp_path: Path
) -> None:
    wait_until(server.healthy, 300, "the vLLM server")
    log = tmp_path / "doomed.log"
    doomed = remote_worker(redis_server, ns, tiny_model_dir, "doomed", server.url, log)
    try:
        client = RolloutClient(redis_server.url, ns)
        ids = [client.submit(tokens=[4 + i, 20, 30], n=2, max_tokens=400, seed=i) for i in range(4)]
        wait_until(holds_work(client, "doomed"), 120, "the remote worker to take prompts")
        os.killpg(server.process.pid, signal.SIGKILL)  # the server and its engine core
        server.process.wait()
        assert doomed.wait(timeout=60) == 1, "a worker whose server died must exit with code 1"
        assert "server" in log.read_text()

        workers("rescuer", "--engine", "torch")
        groups = client.collect(len(ids), timeout=120)
        assert sorted(g.prompt_id for g in groups) == sorted(ids)
        assert client.stats["duplicates"] == 0
        assert any(r.worker == "rescuer" for g in groups for r in g.rollouts)
    finally:
        stop_process(doomed)


def refused_at_start(
    redis_server: RedisServer, ns: str, model: Path, name: str, url: str, log: Path, engine_args: dict[str, object]
) -> Path:
    """A remote worker for `url` exits 1 with one line that says what to fix, no traceback, and leaves no
    registration behind."""
    worker = remote_worker(redis_server, ns, model, name, url, log, "--engine-args", json.dumps(engine_args))
    try:
        assert worker.wait(timeout=180) == 1, log.read_text()
    finally:
        stop_process(worker)
    assert "Traceback" not in log.read_text() and logged(f"worker {name} failed: the engine could not start:", log)
    client = RolloutClient(redis_server.url, ns)
    assert not client.streams.redis.exists(client.streams.keys.worker(name)), "a refused worker stays registered"
    return log


def test_a_worker_with_no_server_at_its_url_is_refused_at_start_and_its_prompt_waits_for_another(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, workers: StartWorker, tmp_path: Path
) -> None:
    """No server at the URL: the worker exits 1 with one line that says what to fix, and the prompt waits for a
    worker that can serve it."""
    client = RolloutClient(redis_server.url, ns)
    waiting = client.submit(tokens=[3, 4, 5], n=2, max_tokens=8, seed=0)
    nobody = f"http://127.0.0.1:{free_port()}"
    log = refused_at_start(redis_server, ns, tiny_model_dir, "nobody", nobody, tmp_path / "nobody.log",
                           {"start_timeout_s": 1})  # fmt: skip
    assert logged("no vLLM server answered", log)
    workers("rescuer", "--engine", "torch")
    (group,) = client.collect(1, timeout=120)
    assert group.prompt_id == waiting and client.stats["duplicates"] == 0


@pytest.mark.long("no server at the URL: test_a_worker_with_no_server_at_its_url_is_refused_at_start_and_its_prom...")
def test_a_server_that_wants_an_api_key_or_lacks_the_rl_endpoints_is_refused_at_start_with_what_to_fix(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A server that wants an API key, one without the RL endpoints (no dev mode): each worker exits 1 with one line
    that says what to fix (a vLLM server of its own: ~100 s on 2 cores)."""
    with vllm_server(tiny_model_dir, tmp_path / "server.log", "--api-key", "sesame", dev_mode=False) as bare:
        wait_until(bare.healthy, 300, "the vLLM server without dev mode")
        keyless = refused_at_start(redis_server, ns, tiny_model_dir, "keyless", bare.url, tmp_path / "keyless.log", {})
        assert logged("wants its API key", keyless)
        keyed = refused_at_start(redis_server, ns, tiny_model_dir, "keyed", bare.url, tmp_path / "keyed.log",
                                 {"api_key": "sesame"})  # fmt: skip
        assert logged("VLLM_SERVER_DEV_MODE=1", keyed)

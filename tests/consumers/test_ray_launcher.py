"""`rollouts launch`: workers as Ray actors on a real local Ray cluster (CPU, torch engine, the tiny model).

Ray 2.60 turns on token auth for new clusters and keeps its token under `~/.ray`: the cluster and
every Ray client here run with `RAY_AUTH_MODE=disabled` and a temp dir of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import ray
from ray.util.placement_group import placement_group_table

from consumers.ray_launcher import ray_namespace
from pipeline.codec import as_fields
from pipeline.local import RedisServer, free_port
from pipeline.wire import GENERATORS, Keys
from producers.client import RolloutClient
from tests.cli.test_cli import assert_clean_error
from tests.fixtures import FAST, wait_until

RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


def rollouts(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **RAY_ENV}
    return subprocess.run(
        [sys.executable, "-m", "rollouts", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`ray start --head --block`: 2 CPUs, its own ports and temp dir; at the end it is killed with all it started."""
    temp = tmp_path_factory.mktemp("ray")
    log = temp / "head.log"
    port = free_port()
    ports = ("--ray-client-server-port", "--dashboard-port", "--dashboard-agent-listen-port")
    # Ray's CLI through this interpreter: its `ray` script need not sit beside it (a venv over system packages).
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port)]
    # Not under pytest's tmp path, which is long under xdist: Ray's socket paths there passed AF_UNIX's 107 bytes.
    ray_temp = tempfile.mkdtemp(prefix="rollouts-ray-")
    command += ["--num-cpus", "2", "--temp-dir", ray_temp, "--include-dashboard=false", "--disable-usage-stats"]
    command += [arg for flag in ports for arg in (flag, str(free_port()))]
    with open(log, "wb") as out:
        head = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV}, start_new_session=True
        )
    try:
        wait_until(lambda: head.poll() is not None or "Ray runtime started" in log.read_text(), 120, "the Ray head")
        assert head.poll() is None, log.read_text()
        with pytest.MonkeyPatch.context() as patch:  # for the checks that this process makes as a Ray client
            for name, value in RAY_ENV.items():
                patch.setenv(name, value)
            yield f"127.0.0.1:{port}"
    finally:
        head.terminate()  # `ray start --block` stops the node's processes on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # anything of its session that outlived it
        shutil.rmtree(ray_temp, ignore_errors=True)


def ray_view(address: str, ns: str) -> tuple[list[str], list[str]]:
    """The named actors in the pipeline's Ray namespace, and the names of its placement groups not removed."""
    ray.init(
        address=address,
        namespace=ray_namespace(ns),
        logging_level="error",  # type: ignore[arg-type]  # ray takes a level's name too, though it types an int
        log_to_driver=False,
    )
    try:
        actors = ray.util.list_named_actors()
        groups = [g["name"] for g in placement_group_table().values() if g["state"] != "REMOVED"]
        return sorted(actors), sorted(groups)
    finally:
        ray.shutdown()


def test_ray_workers_serve_are_restarted_after_kill_9_and_lose_nothing(
    ray_cluster: str, redis_server: RedisServer, ns: str, tiny_model_dir: Path
) -> None:
    url, keys = redis_server.url, Keys(ns)
    launched = rollouts(
        "launch", "--ray", ray_cluster, "--redis", url, "--ns", ns, "--workers", "2",
        "--engine", "torch", "--model", str(tiny_model_dir), "--num-threads", "1", *FAST, "--hand-off-partials",
        "--no-wait",
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout + launched.stderr
    print(launched.stderr)
    assert "started worker-0, worker-1" in launched.stderr
    assert f"2 workers serving on {keys.prompts}: ray-0, ray-1" in launched.stderr
    assert ray_view(ray_cluster, ns) == (["worker-0", "worker-1"], ["worker-0", "worker-1"])

    client = RolloutClient(url, ns, tokenizer=tiny_model_dir)
    r = client.streams.redis
    beat = {name: r.hgetall(keys.worker(name)) for name in ("ray-0", "ray-1")}
    assert {b[b"status"] for b in beat.values()} == {b"serving"}
    assert {b[b"partials"] for b in beat.values()} == {b"hand-off"}, "the worker flags reach the actors"
    doomed = psutil.Process(int(beat["ray-0"][b"pid"]))
    assert doomed.name().startswith("ray::") or "ray::" in " ".join(doomed.cmdline()), doomed.cmdline()

    first = [client.submit(f"warm up {i}", n=2, max_tokens=8, seed=i) for i in range(8)]
    assert sorted(g.prompt_id for g in client.collect(len(first), timeout=60)) == sorted(first)

    # kill -9 one actor's process while it holds prompts; submit more around the kill
    ids = [client.submit(tokens=[4 + i, 20, 30], n=4, max_tokens=256, seed=i) for i in range(48)]

    def doomed_holds_work() -> bool:
        pending = r.xpending(keys.prompts, GENERATORS)["consumers"]
        return any(c["name"] == b"ray-0" and c["pending"] >= 3 for c in pending)

    wait_until(doomed_holds_work, 60, "ray-0 to take prompts")
    doomed.kill()
    doomed.wait(timeout=30)
    orphaned = r.xpending_range(keys.prompts, GENERATORS, "-", "+", 1000, consumername="ray-0")
    assert orphaned, "the killed actor held no prompts"
    print(f"killed ray-0 (pid {doomed.pid}) holding {len(orphaned)} prompts")
    ids += [client.submit(tokens=[5 + i, 21, 31], n=4, max_tokens=64, seed=i) for i in range(16)]

    groups = client.collect(len(ids), timeout=120)
    assert Counter(g.prompt_id for g in groups) == Counter(ids), "every group exactly once"
    rollouts_ = [x for g in groups for x in g.rollouts]
    assert len({x.id for x in rollouts_}) == len(rollouts_) == 4 * len(ids)
    assert client.stats["duplicates"] == 0
    assert r.xpending(keys.prompts, GENERATORS)["pending"] == 0 and r.xlen(keys.dead) == 0

    def restarted() -> bool:
        now = r.hgetall(keys.worker("ray-0"))
        return now.get(b"status") == b"serving" and now.get(b"pid") != beat["ray-0"][b"pid"]

    wait_until(restarted, 120, "Ray to restart ray-0's actor")
    assert not doomed.is_running()
    last = [client.submit(f"after the restart {i}", n=2, max_tokens=8) for i in range(8)]
    assert sorted(g.prompt_id for g in client.collect(len(last), timeout=60)) == sorted(last)

    stopped = rollouts("launch", "--stop", "--ray", ray_cluster, "--redis", url, "--ns", ns)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    print(stopped.stderr)
    assert f"stopped 2 workers of {ns}: worker-0, worker-1" in stopped.stderr
    assert list(r.scan_iter(match=keys.worker_prefix + "*")) == [], "a drained worker removes its heartbeat"
    assert ray_view(ray_cluster, ns) == ([], [])


def test_launch_mistakes_get_one_line(ray_cluster: str, redis_server: RedisServer, ns: str, tmp_path: Path) -> None:
    url = redis_server.url
    common = ("--redis", url, "--ns", ns)
    assert_clean_error(rollouts("launch", "--ray", ray_cluster, *common, "--model", str(tmp_path)), "no model at")
    nobody = f"127.0.0.1:{free_port()}"
    assert_clean_error(rollouts("launch", "--stop", "--ray", nobody, *common), f"cannot reach Ray at {nobody}")
    zero = rollouts("launch", "--ray", ray_cluster, *common, "--workers", "0", "--engine", "synthetic")
    assert_clean_error(zero, "--workers must be at least 1")
    greedy = rollouts("launch", "--ray", ray_cluster, *common, "--gpus-per-worker", "1", "--engine", "synthetic")
    assert_clean_error(greedy, "--workers 1 need 1 GPU in all, but the Ray cluster has 0")
    assert_clean_error(rollouts("launch", "--ray", "local", *common, "--stop"), "nothing to --stop")
    unpaced = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 0}')  # the engine refuses it in the actor
    broken = rollouts("launch", "--ray", ray_cluster, *common, *unpaced)
    assert_clean_error(broken, "ray-0 could not start: ValueError: steps_per_s must be > 0")
    assert ray_view(ray_cluster, ns) == ([], [])
    RolloutClient(url, ns).submit(tokens=[4, 5], n=1, max_tokens=4)  # work waits: --autoscale 0:1 starts a worker
    scaled = rollouts("launch", "--ray", ray_cluster, *common, *unpaced, "--autoscale", "0:1")
    assert_clean_error(scaled, "ray-0 could not start: ValueError: steps_per_s must be > 0")
    assert ray_view(ray_cluster, ns) == ([], [])


def test_lazy_ray_workers_start_their_engine_on_the_first_work_and_release_it_when_idle(
    ray_cluster: str, redis_server: RedisServer, ns: str, tiny_model_dir: Path
) -> None:
    """`--lazy --release-after-s` reach the actors: each registers without an engine, starts one when work comes,
    shuts it down after the idle time and starts it again for the next work (a release builds a fresh engine from
    the actor's factory)."""
    url, keys = redis_server.url, Keys(ns)
    launched = rollouts(
        "launch", "--ray", ray_cluster, "--redis", url, "--ns", ns, "--engine", "torch", "--model", str(tiny_model_dir),
        "--num-threads", "1", *FAST, "--lazy", "--release-after-s", "2", "--no-wait",
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert f"1 workers ready (--lazy) on {keys.prompts}: ray-0" in " ".join(launched.stderr.split())
    client = RolloutClient(url, ns)

    def beat() -> dict[str, str]:
        fields = as_fields(client.streams.redis.hgetall(keys.worker("ray-0")))
        return {k.decode(): v.decode() for k, v in fields.items()}

    assert (beat()["status"], beat()["engine_starts"]) == ("idle", "0")
    try:
        for round_ in (1, 2):
            ids = [client.submit(tokens=[4 + i, 20, 30], n=2, max_tokens=16, seed=i) for i in range(4)]
            assert sorted(g.prompt_id for g in client.collect(len(ids), timeout=120)) == sorted(ids)
            wait_until(lambda: beat()["status"] == "released", 60, "ray-0 to release its idle engine")
            assert beat()["engine_starts"] == str(round_)
        assert client.stats["duplicates"] == 0
    finally:
        stopped = rollouts("launch", "--stop", "--ray", ray_cluster, "--redis", url, "--ns", ns)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert ray_view(ray_cluster, ns) == ([], [])


def requested_from_ray(address: str) -> list[dict[str, float]]:
    """What Ray's autoscaler was last asked for (`request_resources`): a cluster without an autoscaler keeps the
    request in the GCS's key-value store, where the (v1) autoscaler reads it."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    ray.init(address=address, logging_level="error", log_to_driver=False)  # type: ignore[arg-type]  # as above
    try:
        raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
        return json.loads(raw) if raw else []
    finally:
        ray.shutdown()


def test_autoscale_grows_to_the_maximum_under_a_backlog_and_drains_back_to_the_minimum(
    ray_cluster: str, redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    """`--autoscale 1:3`: one worker at first; a backlog of slow prompts (2 s each, 2 a worker) asks for 3, which Ray
    is asked for and which all serve; once the queue is empty for the cool-down the surplus drains away, each prompt
    delivered once."""
    url, keys = redis_server.url, Keys(ns)
    slow = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 20}', "--max-inflight", "2")
    log = tmp_path / "launch.log"
    command = [sys.executable, "-m", "rollouts", "launch", "--ray", ray_cluster, "--redis", url, "--ns", ns]
    command += [*slow, *FAST, "--cpus-per-worker", "0.5", "--autoscale", "1:3", "--cooldown-s", "4"]
    with open(log, "wb") as out:
        launcher = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV})
    client = RolloutClient(url, ns)
    r = client.streams.redis

    def until(condition: Callable[[], bool], what: str) -> None:
        def check() -> bool:
            assert launcher.poll() is None, log.read_text()
            return condition()

        wait_until(check, 120, what)

    try:
        until(lambda: "autoscaling 1..3 workers" in log.read_text(), "the launcher to serve")
        assert "1 workers serving" in " ".join(log.read_text().split())
        ids = [client.submit(tokens=[4, 5, k], n=1, max_tokens=40, seed=k) for k in range(40)]

        def three() -> bool:
            return all(r.hget(keys.worker(f"ray-{i}"), "status") == b"serving" for i in range(3))

        until(three, "3 serving workers")
        assert requested_from_ray(ray_cluster) == [{"CPU": 0.5}] * 3
        groups = client.collect(len(ids), timeout=120)
        assert Counter(g.prompt_id for g in groups) == Counter(ids), "every prompt exactly once"
        assert set(Counter(x.worker for g in groups for x in g.rollouts)) == {"ray-0", "ray-1", "ray-2"}
        assert client.stats["duplicates"] == 0

        until(lambda: ray_view(ray_cluster, ns)[0] == ["worker-0"], "the fleet to shrink to 1")
        assert ray_view(ray_cluster, ns) == (["worker-0"], ["worker-0"])
        assert requested_from_ray(ray_cluster) == [{"CPU": 0.5}]
        assert r.exists(keys.worker("ray-2")) == 0, "a drained worker removes its heartbeat"
        assert r.xpending(keys.prompts, GENERATORS)["pending"] == 0
    finally:
        launcher.send_signal(signal.SIGINT)  # Ctrl-C: scaling stops, the workers keep running
        launcher.wait(timeout=60)
        stopped = rollouts("launch", "--stop", "--ray", ray_cluster, "--redis", url, "--ns", ns)
    text = log.read_text()
    print(text)
    lines = [line for line in text.splitlines() if line.startswith("autoscale: need")]
    assert any("target 3 of" in line for line in lines), lines
    assert any("target 1" in line and "need stayed below" in line for line in lines), lines
    assert "drained ray-2" in text or "drained ray-2, ray-1" in text
    assert requested_from_ray(ray_cluster) == [], "the request is withdrawn when the launcher ends"
    assert stopped.returncode == 0 and ray_view(ray_cluster, ns) == ([], [])

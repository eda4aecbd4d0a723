"""Processes that clean up after themselves: the demo under SIGTERM or a failure, a worker whose Redis is
gone, and a manager that says what it watches."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis
from rich.console import Console

from pipeline.local import RedisServer, find_redis_server
from pipeline.processes import start_command, start_worker, stop_processes, stop_signals_unwind, wait_for_worker
from pipeline.streams import Streams
from pipeline.wire import Control
from producers.client import RolloutClient
from rollouts import demo
from staleness.manager import Manager
from tests.fixtures import holds_work, wait_until

WIDE = {"COLUMNS": "400"}
"""Rich wraps a log record at the terminal's width (80 in a pipe): one record, one line, for the assertions."""


def _kill_left(processes: list[psutil.Process]) -> list[str]:
    """Kill, by PID, those of `processes` still running (a test's cleanup); returns what they were."""
    left = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline()[:4]))
                process.kill()
    return left


def test_the_demo_with_keep_stopped_by_sigterm_leaves_no_process_and_no_temp_dir(tmp_path: Path) -> None:
    temp, log = tmp_path / "temp", tmp_path / "demo.log"
    temp.mkdir()
    env = os.environ | WIDE | {"TMPDIR": str(temp), "PYTHONUNBUFFERED": "1"}
    args = ["demo", "--keep", "--prompts", "2", "--n", "1", "--max-tokens", "4", "--train-steps", "0"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "rollouts", *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path
        )
    children: list[psutil.Process] = []
    try:
        wait_until(lambda: "stay up" in log.read_text() or process.poll() is not None, 300, "the demo to be ready")
        output = log.read_text()
        assert process.poll() is None, output
        port = int(re.findall(r"redis-cli -p (\d+) ", output)[0])  # printed while its Redis runs: it answers
        assert redis.Redis(port=port, socket_connect_timeout=2).ping()
        children = psutil.Process(process.pid).children(recursive=True)
        names = " ".join(" ".join(child.cmdline()) for child in children)
        assert "redis-server" in names and " manager " in names and " worker " in names, names
        assert any(p.name.startswith("rollouts-demo-") for p in temp.iterdir()), list(temp.iterdir())

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, log.read_text()
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running: {alive}\n{log.read_text()}"
        left = [p.name for p in temp.iterdir() if p.name.startswith("rollouts-")]  # torch keeps a cache there too
        assert not left, f"the demo's temporary files are left behind: {left}"
        assert not list(tmp_path.glob("*.png")), "no PNG unless --plot asks for one"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        _kill_left(children)


def test_a_demo_that_fails_early_leaves_no_temp_dir(tmp_path: Path) -> None:
    env = os.environ | {"TMPDIR": str(tmp_path), "ROLLOUTS_REDIS_SERVER": "/bin/false"}  # no redis-server
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "demo", "--train-steps", "0"],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0 and "is not a redis-server binary" in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())


def test_a_demo_that_fails_with_its_redis_up_stops_it_and_leaves_no_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cannot_build(*_args: object, **_kwargs: object) -> Path:
        raise RuntimeError("no model today")

    monkeypatch.setattr(demo, "build_tiny_model", cannot_build)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="no model today"):
        demo.run_demo(Console(quiet=True), prompts=1, n=1, max_tokens=1, keep=False, train_steps=0)
    started = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    _gone, alive = psutil.wait_procs(started, timeout=15)
    assert not _kill_left(alive), "the demo's Redis is left running"
    assert not list(tmp_path.iterdir())


def test_a_worker_whose_redis_is_gone_stops_within_seconds_of_sigterm(tmp_path: Path) -> None:
    ns, log = "gone", tmp_path / "w1.log"
    server = RedisServer(binary=find_redis_server()).start()
    worker = None
    try:
        slow = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 5}', "--heartbeat-s", "0.3")
        worker = start_worker(server.url, ns, Path("synthetic"), "w1", *slow, log_file=log, env=WIDE)
        client = RolloutClient(server.url, ns)
        wait_for_worker(client.streams.redis, ns, "w1", worker, timeout_s=120)
        client.submit(tokens=[5, 6, 7], n=2, max_tokens=1000, id="long")  # ~200 s of tokens: in flight at the kill
        wait_until(holds_work(client, "w1"), 30, "the worker to take the prompt")
        server.kill()
        stopped = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
        took = time.monotonic() - stopped
        text = log.read_text()
        assert took < 8, f"took {took:.1f} s to stop\n{text}"
        assert code == 0, text
        [line] = [line for line in text.splitlines() if "is gone" in line]
        assert f"its Redis at 127.0.0.1:{server.port} is gone" in line, line
        assert "the work it held (1 entry, 2 samples) was neither published nor handed on" in line, line
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
        server.stop()


def test_the_manager_logs_what_it_watches_and_each_sync_it_finishes(tmp_path: Path) -> None:
    ns, log = "watched", tmp_path / "manager.log"
    with RedisServer(binary=find_redis_server()) as server:
        redis.Redis(port=server.port).config_set("requirepass", "s3cret")
        url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
        args = ("--redis", url, "--ns", ns, "--interval", "0.1", "--ack-timeout-s", "7", "--abandoned-after-s", "1")
        manager = start_command("manager", *args, log_file=log, env=WIDE)
        try:
            wait_until(lambda: "checking every" in log.read_text() or manager.poll() is not None, 60, "its first line")
            first = log.read_text()
            assert "s3cret" not in first, first
            assert f"manager of namespace {ns} at redis://:***@127.0.0.1:{server.port}/0" in first, first
            assert "ack deadline is 7 s" in first and "older than 1 s is finished as abandoned" in first, first
            assert "checking every 0.1 s" in first, first

            # A trainer that began a sync and died: a live worker never acks it.
            streams = Streams(redis.Redis.from_url(url), ns)
            streams.registry.heartbeat("ghost", {"status": "serving"}, ttl_s=60)
            driver = Manager(streams)
            weights = Control(cmd="weights", version=1, uri="/nowhere/v1", mode="abort").to_fields()
            fields = (x for pair in weights.items() for x in pair)
            driver._begin(keys=driver._keys, args=[0, 1, "token", 0, *fields])  # 0: the highest epoch a worker acked

            def finished() -> bool:  # the resume's line (read back from control) and the finish's, in either order
                text = log.read_text()
                return "sync 1 done" in text and "finished an abandoned sync" in text

            wait_until(finished, 30, "the manager to finish the abandoned sync")
            text = log.read_text()
            assert "sync 1 began: version 1 from /nowhere/v1 (pause: abort)" in text, text
            assert "worker ghost evicted" in text, text
            assert "finished an abandoned sync" in text, text
            assert "sync 1 done: the workers resume at version 1" in text, text
        finally:
            stop_processes([manager])


def test_a_stop_signal_that_lands_inside_a_finalizer_still_interrupts_the_command() -> None:
    """Garbage collection runs a `__del__` between any two bytecodes, and a `KeyboardInterrupt` raised there is printed
    and dropped: a failover-chaos run stopped by SIGTERM while a redis-py pool was being collected ran on for its
    whole duration. The signal is delivered again once the finalizer is done."""

    class Collected:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs when this returns: still inside `__del__`

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), stop_signals_unwind():
        Collected()  # dropped at once: its `__del__` runs here
        while time.monotonic() - started < 5:
            time.sleep(0.01)
    interrupted_after = time.monotonic() - started
    assert interrupted_after < 2, f"interrupted only after {interrupted_after:.1f} s"

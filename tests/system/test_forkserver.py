"""The tests' fork server (`tests/forkserver.py`): a `rollouts` command forked from it runs as `python -m rollouts`
does, and what a test does with its process (wait, poll, signal, read its log) works as with one it started itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import redis

from pipeline.local import RedisServer
from pipeline.processes import start_command, start_worker, stop_process, wait_for_worker
from tests.fixtures import wait_until
from tests.forkserver import ForkedProcess, forked_cpu


def test_a_plain_rollouts_command_is_forked_and_exits_with_its_code_and_its_output_in_its_log(tmp_path: Path) -> None:
    log = tmp_path / "help.log"
    ok = start_command("--help", log_file=log)
    assert isinstance(ok, ForkedProcess)
    assert ok.wait(timeout=60) == 0 and "worker" in log.read_text()
    bad = start_command("worker", "--no-such-flag", log_file=tmp_path / "bad.log")
    assert bad.wait(timeout=60) == 2 and "--no-such-flag" in (tmp_path / "bad.log").read_text()
    assert ok.poll() == 0 and bad.returncode == 2


def test_a_forked_worker_serves_takes_signals_by_its_pid_and_its_cpu_is_counted(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Its PID is a process of its own under the fork server (a child of this test's process); SIGSTOP and SIGCONT
    reach it, SIGTERM drains it (exit 0), SIGKILL kills it (-9); its CPU is told once it exits."""
    client = redis.Redis.from_url(redis_server.url)
    synthetic = ("--engine", "synthetic", "--heartbeat-s", "0.3")
    worker = start_worker(redis_server.url, "fork", tiny_model_dir, "w", *synthetic, log_file=tmp_path / "w.log")
    assert isinstance(worker, ForkedProcess)
    wait_for_worker(client, "fork", "w", worker, timeout_s=60)
    assert worker.pid in {p.pid for p in psutil.Process().children(recursive=True)} and worker.pid != os.getpid()
    assert psutil.Process(worker.pid).ppid() != os.getpid()  # the fork server's child
    os.kill(worker.pid, signal.SIGSTOP)
    wait_until(lambda: psutil.Process(worker.pid).status() == psutil.STATUS_STOPPED, 10, "the worker stopped")
    assert worker.poll() is None
    os.kill(worker.pid, signal.SIGCONT)
    before = forked_cpu[0]
    assert stop_process(worker, timeout_s=30) == 0
    assert worker.cpu_s > 0 and forked_cpu[0] == pytest.approx(before + worker.cpu_s)
    assert "stopped after publishing" in (tmp_path / "w.log").read_text()
    doomed = start_worker(redis_server.url, "fork", tiny_model_dir, "d", *synthetic)
    wait_for_worker(client, "fork", "d", doomed, timeout_s=60)
    doomed.kill()
    assert doomed.wait(timeout=30) == -signal.SIGKILL
    running = start_worker(redis_server.url, "fork", tiny_model_dir, "r", *synthetic)
    with pytest.raises(subprocess.TimeoutExpired):
        running.wait(timeout=0.5)
    assert stop_process(running, timeout_s=30) == 0


def test_a_command_with_an_environment_of_its_own_is_started_as_a_process_of_its_own(tmp_path: Path) -> None:
    """What the fork server imported read the environment it was started with: a command given other variables
    starts afresh."""
    proc = start_command("--help", log_file=tmp_path / "help.log", env={"ROLLOUTS_SOMETHING": "1"})
    assert not isinstance(proc, ForkedProcess) and isinstance(proc.args, list)
    assert proc.args[:3] == [sys.executable, "-m", "rollouts"]
    assert proc.wait(timeout=60) == 0

"""Local `rollouts` processes (workers, the manager, a gateway) that the demo, the tests, the examples and the lab start
and stop by PID."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import redis

from pipeline.wire import Keys


def start_command(
    *args: str,
    log_file: Path | None = None,
    new_session: bool = False,
    env: Mapping[str, str] | None = None,
    module: str = "rollouts",
    launcher: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """`rollouts ARGS...` in its own process, as a user would run it (`new_session`: its own process group,
    so that a test can kill it with its children, as a machine that dies would; `env`: variables set for it alone,
    e.g. `CUDA_VISIBLE_DEVICES` for a vLLM worker on a GPU of its own; `module`: the program, run as `python -m
    MODULE`, e.g. the lab's `benchmarks` for a command of its own; `launcher`: what the command line starts with, a
    program that execs the rest, e.g. `ip netns exec NS` for a network namespace of its own)."""
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [*launcher, sys.executable, "-m", module, *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=new_session,
    )


def start_worker(
    redis_url: str,
    ns: str,
    model: Path,
    name: str,
    *extra: str,
    log_file: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """`rollouts worker` in its own process, as a user would run it."""
    args = ["worker", "--redis", redis_url, "--ns", ns, "--model", str(model), "--name", name, *extra]
    return start_command(*args, log_file=log_file, env=env)


def wait_for_worker(
    client: redis.Redis,
    ns: str,
    name: str,
    process: subprocess.Popen[bytes],
    timeout_s: float,
    status: str = "serving",
) -> None:
    """Wait until the worker's heartbeat shows `status`; fail early if its process died."""
    key = Keys(ns).worker(name)
    deadline = time.monotonic() + timeout_s
    while client.hget(key, "status") != status.encode():
        if process.poll() is not None:
            raise RuntimeError(f"worker {name} exited with code {process.returncode} before {status!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {name} did not reach {status!r} within {timeout_s:.0f}s")
        time.sleep(0.1)


def stop_process(process: subprocess.Popen[Any], timeout_s: float = 45.0) -> int:
    """SIGTERM (the worker drains), then SIGKILL if it does not exit in time.

    The default outwaits a worker's own drain (30 s): a SIGKILLed vLLM worker leaves its
    `EngineCore` process running, since vLLM 0.32 does not watch for its parent's death.
    """
    return stop_processes([process], timeout_s)[0]


def stop_processes(processes: Sequence[subprocess.Popen[Any]], timeout_s: float = 45.0) -> list[int]:
    """`stop_process` for several at once: all are sent SIGTERM first, so their drains and exits overlap (a vLLM
    worker takes seconds to stop), and each is waited for against one deadline. One already stopped
    is skipped. Returns their exit codes, in order."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return [process.returncode for process in processes]


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What ends a command that starts processes as Ctrl-C does (`stop_signals_unwind`)."""
REDELIVER_S = 0.05
"""A stop signal that came inside a finalizer is delivered again this much later (`stop_signals_unwind`)."""


def in_finalizer(frame: FrameType | None) -> bool:
    """Whether `frame` runs inside an object's `__del__` (garbage collection can run one between any two bytecodes),
    where Python prints an exception raised and drops it ("Exception ignored in ...")."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def stop_signals_unwind() -> Iterator[None]:
    """SIGTERM and SIGHUP end the command (`rollouts demo`, the lab's chaos runs) as Ctrl-C does: a `KeyboardInterrupt`,
    so that every `finally` stops its processes and removes its files (Python's default for them ends the process at
    once, leaving its Redis, manager and workers running and its temporary directory behind). Only the first of them
    interrupts: one that comes while the command cleans up is ignored, so that the cleanup is not cut short. One that
    comes inside a finalizer (a redis-py connection pool's `__del__`, say), where the interrupt would be dropped, is
    delivered again once it is done: a failover run went on for its whole duration. A signal ignored already stays
    ignored (SIGHUP under `nohup`, SIGINT for a job that a script started in the background); outside the main thread
    (run inside another program's thread) signals stay as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if received:
            return
        if in_finalizer(frame):  # raised here it would be printed and dropped: interrupt once the finalizer is done
            threading.Timer(REDELIVER_S, _thread.interrupt_main, args=(signum,)).start()
            return
        received.append(signum)
        raise KeyboardInterrupt

    ignored = {sig for sig in STOP_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN}
    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS if sig not in ignored}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

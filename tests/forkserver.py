"""The suite's `rollouts` processes (workers, gateways, the manager), forked from a process that has imported what
they import: a torch worker spends ~4 of its ~5 CPU seconds to serving importing torch and transformers, and a run
starts ~250 processes on 2 cores (benchmarks/results/2026-12-07-ci-time-5.md).

`pipeline.processes.start_command` starts every one of them; the `forked_commands` fixture (tests/fixtures.py) routes
its `python -m rollouts ...` starts here, those with no environment or launcher of their own. The fork server is a child
of the test process (one per xdist worker), started at the first such command: it imports `PRELOAD`, then forks a
child per command, which takes the command's stdout, working directory and environment, resets the signals a Python
starts with, and runs `rollouts` as `python -m rollouts` does (`runpy`, then the interpreter's own exit: its atexit
handlers, its threads joined). What the test holds is a `ForkedProcess`: a `subprocess.Popen` whose exit status comes
from the fork server, which reaps it; signals go to its PID as before. Nothing is imported in the fork server that
starts a thread or uses OpenMP, so a fork is as a fresh process; each child's `random` is seeded again by Python.

Run as `python -m tests.forkserver SOCKET`.
"""

from __future__ import annotations

import array
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.processes import stop_process

PRELOAD = (
    "rollouts.app",
    "consumers.worker",
    "consumers.engines.torch_engine",
    "consumers.engines.synthetic_engine",
    "transformers.models.auto.modeling_auto",
    "transformers.models.qwen2.modeling_qwen2",
    "producers.gateway.app",
)
"""What the fork server imports before it forks: the CLI, the worker and its engines, the tiny model's transformers
classes, the gateway. A module missing here only costs its import in the child."""
READY = b"ready\n"
START_TIMEOUT_S = 120.0


# -- the fork server ------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Preload, listen on the Unix socket `path`, fork a child per request, and send each child's exit to its
    requester. Exits when its parent (the test process) is gone. Returns only in a child: as the command's own run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the children (they reset it) and the tests
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # nothing more down the pipe that said READY, which nobody reads: a full pipe would block a writer
    os.close(null)
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError) as exc:  # a requester gone mid-request: the others are served on
                print(f"tests' fork server: a request failed: {exc}", file=sys.stderr)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in waiting.values():
                    other.close()
                conn.close()
                _become(request, fds[0] if fds else None)
                return  # the command ran: the interpreter exits as `python -m rollouts` would
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        _reap(waiting)
    for conn in waiting.values():
        conn.close()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: a JSON line, and the file descriptor of its stdout with its first bytes (SCM_RIGHTS)."""
    data, fds = b"", list[int]()
    while not data.endswith(b"\n"):
        chunk, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(array.array("i", [0]).itemsize))
        if not chunk:
            raise ConnectionError("the request ended early")
        data += chunk
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
    return json.loads(data), fds


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is None:
            continue
        exit_msg = {"returncode": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(exit_msg).encode() + b"\n")
        conn.close()


def _become(request: Mapping[str, Any], out: int | None) -> None:
    """In the child: the command's process, as `subprocess.Popen` would have started it, then its run."""
    if request["new_session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(out if out is not None else null, 1)
    os.dup2(out if out is not None else null, 2)
    for fd in {null, out} - {None, 0, 1, 2}:
        os.close(fd)  # type: ignore[arg-type]
    # As PYTHONUNBUFFERED leaves them: what a test reads of a log is there as soon as it is written.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [request["argv"][0], *request["argv"][1:]]
    sys.path[0] = request["cwd"]  # where `python -m` looks first: the directory it was started in
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


# -- the test process's side ----------------------------------------------------------------------


class ForkedProcess(subprocess.Popen[bytes]):
    """A command the fork server started: a `subprocess.Popen` whose exit status comes from the fork server."""

    def __init__(self, args: Sequence[str], server: Forkserver, conn: socket.socket, pid: int) -> None:
        # (Popen's own __init__ would start a process.)
        self.args = list(args)
        self._server = server
        self.pid = pid
        self.returncode: Any = None
        self.stdin = self.stdout = self.stderr = None
        self.cpu_s = 0.0
        """The child's CPU seconds, once it exited (the fork server reaped it)."""
        self._conn = conn
        self._buf = b""
        self._child_created = False  # no Popen.__del__ bookkeeping: the fork server reaps it

    def poll(self) -> int | None:
        return self._exit(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def _exit(self, timeout: float | None) -> int | None:
        """The exit status once the fork server sent it (waiting up to `timeout`; None: for ever), else None."""
        if self.returncode is not None:
            return self.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._buf.endswith(b"\n"):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                break
            self._buf += chunk
        if self._buf.endswith(b"\n"):
            message = json.loads(self._buf)
            self.returncode, self.cpu_s = message["returncode"], message["cpu_s"]
            forked_cpu[0] += self.cpu_s
            self._server.told += self.cpu_s
        else:  # the fork server is gone without saying (it died), and did not reap the child
            self.returncode = -signal.SIGKILL
        self._conn.close()
        return self.returncode

    def _internal_poll(self, _deadstate: Any = None, *args: Any, **kwargs: Any) -> int | None:
        return self.poll()

    def _wait(self, timeout: float | None) -> int:
        return self.wait(timeout)

    def __del__(self) -> None:
        pass


forked_cpu = [0.0]
"""CPU seconds of every child the fork server reaped and this process was told of: what `cpu_seconds` adds."""


class Forkserver:
    """The fork server of this test process, started at the first command."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="rollouts-forkserver-")
        self.path = str(Path(self._dir) / "s")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", self.path],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            cwd=Path(__file__).resolve().parents[1],  # where `tests` is a package, whatever the test's directory
        )
        assert self.process.stdout is not None
        self.told = 0.0
        """CPU seconds of its children told so far (`forked_cpu`): its own reaping adds them to this process's
        children's CPU again, so `close` takes them back off `forked_cpu`."""
        line = self.process.stdout.readline()
        if line != READY:
            raise RuntimeError(f"the tests' fork server did not start (it said {line!r})")

    def start(
        self, module: str, args: Sequence[str], stdout: Any, env: Mapping[str, str], new_session: bool
    ) -> ForkedProcess:
        """`python -m MODULE ARGS...` forked, with `stdout` (a file, or DEVNULL) as its stdout and stderr."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(START_TIMEOUT_S)
        conn.connect(self.path)
        request = {"module": module, "argv": [sys.executable, *args], "env": dict(env), "cwd": os.getcwd(),
                   "new_session": new_session}  # fmt: skip
        fds = [stdout.fileno()] if hasattr(stdout, "fileno") else []
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        conn.sendmsg([json.dumps(request).encode() + b"\n"], rights)
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                raise RuntimeError("the tests' fork server closed the connection before it forked")
            line += chunk
        conn.settimeout(None)
        return ForkedProcess([sys.executable, "-m", module, *args], self, conn, json.loads(line)["pid"])

    def close(self) -> None:
        stop_process(self.process, timeout_s=10)
        forked_cpu[0] -= self.told  # reaped: its children's CPU is in RUSAGE_CHILDREN now, with its own
        self.told = 0.0
        if self.process.stdout is not None:
            self.process.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self._dir)


class RoutedSubprocess(types.ModuleType):
    """`subprocess` as `pipeline.processes` sees it under the `forked_commands` fixture: `Popen` of a plain
    `python -m rollouts ...` (no environment of its own, no launcher) goes to the fork server; all else is
    `subprocess`'s."""

    def __init__(self) -> None:
        super().__init__("subprocess")
        self.server: Forkserver | None = None
        self.enabled = True
        """False: every command starts afresh (a test marked `fresh_processes`)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:  # subprocess.Popen, by its name
        plain_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        forkable = (
            self.enabled
            and len(args) > 3
            and list(args[:3]) == [sys.executable, "-m", "rollouts"]
            and kwargs.get("env") == plain_env
            and kwargs.get("stderr") == subprocess.STDOUT
            and set(kwargs) <= {"stdout", "stderr", "env", "start_new_session"}
        )
        if not forkable:
            return subprocess.Popen(args, **kwargs)
        if self.server is None:
            self.server = Forkserver()
        return self.server.start("rollouts", args[3:], kwargs.get("stdout"), plain_env,
                                 bool(kwargs.get("start_new_session")))  # fmt: skip

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def main() -> None:
    serve(sys.argv[1])


if __name__ == "__main__":
    main()

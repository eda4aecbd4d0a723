"""A private Redis for the demo and the tests: a `redis-server` on a free loopback port.

It is started and stopped by PID and never touches a server a user may run on 6379.
When no `redis-server` is installed, `embedded_redis` falls back to fakeredis's TCP
server, which `redis-cli` can still reach.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A `redis-server` process of our own, with its data in a temporary directory."""

    def __init__(self, port: int | None = None, appendonly: bool = False, data_dir: Path | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install -y redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.appendonly = appendonly
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="rollouts-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        args += ["--save", "", "--appendonly", "yes" if self.appendonly else "no", "--protected-mode", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """Kill -9, as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def embedded_redis() -> Iterator[tuple[str, str]]:
    """A private Redis URL and what serves it: `redis-server` if installed, else fakeredis over TCP."""
    if shutil.which("redis-server"):
        with RedisServer() as server:
            yield server.url, "redis-server"
        return
    from fakeredis import TcpFakeServer

    port = free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{port}/0", "fakeredis"
    finally:
        server.shutdown()
        server.server_close()

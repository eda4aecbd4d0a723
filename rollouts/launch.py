"""`rollouts launch`: workers as Ray actors (placed, restarted and stopped by Ray), Redis the only data path."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlparse

import typer
from rich.live import Live
from rich.table import Table

from pipeline.codec import as_text
from pipeline.connections import redact
from pipeline.sentinel import is_sentinel_url, parse_sentinel_url
from pipeline.streams import Streams
from rollouts.app import (
    DEFAULT_NS,
    DEFAULT_REDIS,
    LogLevelOpt,
    NsOpt,
    RedisOpt,
    app,
    check_engine,
    console,
    fail,
    open_streams,
    require,
    resolve_model,
    user_errors,
)
from rollouts.engine_spec import NO_MODEL, EngineSpec
from rollouts.worker_flags import worker_flags, worker_settings

if TYPE_CHECKING:
    from consumers.ray_launcher import LaunchSpec

ACTOR_ENV = ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS", "VLLM_LOGGING_STREAM")
"""Settings of this process that the actors get too (models are local directories there as well)."""


@app.command()
@worker_flags(leave_out=("max_loras",))
def launch(
    ctx: typer.Context,
    model: Annotated[
        Path | None, typer.Option(help="Model directory, at the same path on every Ray node (not for --stop).")
    ] = None,
    ray_address: Annotated[
        str,
        typer.Option(
            "--ray",
            help="Ray cluster: auto (this node's, or RAY_ADDRESS), HOST:PORT, ray://HOST:PORT, or local "
            "(a private cluster inside this command, for trying it: it ends with it).",
        ),
    ] = "auto",
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    workers: Annotated[int, typer.Option(help="Workers to run (actors worker-0 .. worker-N-1).")] = 1,
    gpus_per_worker: Annotated[
        int, typer.Option(help="GPUs per worker: its tensor-parallel group (0: CPU workers).")
    ] = 0,
    cpus_per_worker: Annotated[float, typer.Option(help="CPUs per worker (the actor's own).")] = 1.0,
    max_restarts: Annotated[int, typer.Option(help="Restarts of a dead worker actor by Ray (-1: always).")] = -1,
    name_prefix: Annotated[
        str, typer.Option(help="Worker names (in heartbeats, `rollouts top`): PREFIX0, ...")
    ] = "ray-",
    stop: Annotated[bool, typer.Option("--stop", help="Drain and end this namespace's workers, then exit.")] = False,
    wait: Annotated[
        bool, typer.Option(help="Show the workers until Ctrl-C (--no-wait: return once they serve).")
    ] = True,
    start_timeout_s: Annotated[float, typer.Option(help="How long the workers may take to serve.")] = 600.0,
    autoscale: Annotated[
        str | None,
        typer.Option(
            metavar="MIN:MAX",
            help="Follow the queue's need (rollouts_workers_needed) between MIN and MAX workers until Ctrl-C, "
            "asking Ray's autoscaler for their nodes (instead of --workers).",
        ),
    ] = None,
    cooldown_s: Annotated[
        float, typer.Option(help="--autoscale: drain surplus workers once the need has stayed lower this long.")
    ] = 30.0,
    log_level: LogLevelOpt = "info",
) -> None:
    """Run N workers as Ray actors, one placement group each, restarted by Ray when they die (their
    in-flight work is claimed by the others); `--stop` ends them. Takes the worker's engine flags."""
    local = ray_address == "local"
    stop_hint = f"rollouts launch --stop --ray {ray_address} --ns {ns}"
    if stop and local:
        fail("--ray local ends with the command that started it: there is nothing to --stop")
    if local and not wait:
        fail(
            "--ray local lives only as long as this command: drop --no-wait, or start a cluster with `ray start --head`"
        )
    bounds = _autoscale_bounds(ctx, autoscale, cooldown_s)
    settings = worker_settings(ctx.params)
    workers = workers if bounds is None else bounds[0]
    require("ray", "torch", purpose="rollouts launch")  # torch: the launcher imports the worker
    placed = workers if bounds is None else max(workers, 1)  # --autoscale 0:N starts none at first
    spec = None if stop else _engine_spec(ctx, model, placed, gpus_per_worker, cpus_per_worker, ray_address)
    import ray

    from consumers import ray_launcher

    with user_errors(redis_url):
        streams = open_streams(redis_url, ns)
        try:
            ray_launcher.connect_ray(ray_address, ns)
            if spec is None:
                stopped = ray_launcher.stop()
                console.print(f"stopped {len(stopped)} workers of {ns}: {', '.join(stopped) or 'none were running'}")
                return
            launch_spec = ray_launcher.LaunchSpec(
                redis_url=redis_url,
                ns=ns,
                engine=spec.kind,
                model=str(spec.model),
                engine_options=spec.options(),
                settings=settings,
                gpus=gpus_per_worker,
                cpus=cpus_per_worker,
                max_restarts=max_restarts,
                name_prefix=name_prefix,
                log_level=log_level,
                env={name: os.environ[name] for name in ACTOR_ENV if name in os.environ},
            )
            _warn_loopback(redis_url)
            started, running = ray_launcher.launch(launch_spec, workers, start_timeout_s)
            console.print(
                f"Ray namespace {ray_launcher.ray_namespace(ns)}: started {', '.join(started) or 'none'}"
                + (f"; already running {', '.join(running)}" if running else "")
            )
            try:
                ray_launcher.wait_serving(launch_spec, started, streams, start_timeout_s)
            except ray_launcher.LaunchError:
                ray_launcher.stop(list(started))  # what this launch started, and their placement groups
                raise
            names = [launch_spec.worker_name(i) for i in range(workers)]
            state = "ready (--lazy)" if launch_spec.settings.lazy else "serving"
            console.print(f"{workers} workers {state} on {streams.keys.prompts}: {', '.join(names)}")
            if bounds is not None:
                _autoscale(launch_spec, streams, bounds, cooldown_s)
            elif wait:
                _watch(streams, ray_launcher.actor_names(), name_prefix)
        except ray_launcher.LaunchError as exc:
            fail(str(exc))
        except KeyboardInterrupt:  # while the workers start (the view above takes Ctrl-C itself)
            if not local:
                console.print(f"interrupted; end the workers with: {stop_hint}")
            raise typer.Exit(130) from None
        finally:
            if local and ray.is_initialized():  # the cluster ends with this process: drain its workers first
                stopped = ray_launcher.stop()
                console.print(f"stopped {len(stopped)} workers with the local Ray cluster")
    if wait and not local:
        console.print(f"the workers keep running; end them with: {stop_hint}")


def _engine_spec(
    ctx: typer.Context, model: Path | None, workers: int, gpus: int, cpus: float, ray_address: str
) -> EngineSpec:
    """The engine flags as for `rollouts worker`, checked against the placement (GPUs, tensor parallelism)."""
    if workers < 1:
        fail(f"--workers must be at least 1, not {workers}")
    if gpus < 0 or cpus <= 0:
        fail(f"--gpus-per-worker must be >= 0 and --cpus-per-worker > 0 (got {gpus} and {cpus:g})")
    if model is None and ctx.params["engine"] != "synthetic":
        fail("--model DIR is required (the same path on every Ray node)")
    with user_errors():
        spec = EngineSpec.from_flags(ctx.params, resolve_model(model).absolute() if model else NO_MODEL)
    if not ray_address.startswith("ray://"):  # a remote client's model lives on the cluster, not here
        check_engine(spec)
    if spec.kind == "vllm" and gpus > 1 and spec.tensor_parallel_size == 1:
        spec.tensor_parallel_size = gpus  # the worker's GPUs are its tensor-parallel group
    if spec.kind == "vllm" and spec.tensor_parallel_size not in (1, gpus):
        fail(f"--tensor-parallel-size {spec.tensor_parallel_size} needs --gpus-per-worker {spec.tensor_parallel_size}")
    if spec.kind != "vllm" and gpus > 1:
        fail(f"the {spec.kind} engine uses one device: --gpus-per-worker 0 or 1, not {gpus}")
    if spec.kind == "torch" and gpus == 1 and spec.device == "cpu":
        spec.device = "cuda"  # the GPU that Ray gave the actor (CUDA_VISIBLE_DEVICES)
    return spec


def _autoscale_bounds(ctx: typer.Context, autoscale: str | None, cooldown_s: float) -> tuple[int, int] | None:
    """`--autoscale MIN:MAX` checked against the flags it excludes; None without it."""
    sources = {name: ctx.get_parameter_source(name) for name in ("workers", "stop", "wait", "cooldown_s")}
    given = {name for name, source in sources.items() if source is not None and source.name == "COMMANDLINE"}
    if autoscale is None:
        if "cooldown_s" in given:
            fail("--cooldown-s is for --autoscale MIN:MAX")
        return None
    clash = {"workers": "--workers", "stop": "--stop", "wait": "--no-wait"}
    for name in sorted(given & clash.keys()):
        fail(f"--autoscale sets the workers and runs until Ctrl-C: drop {clash[name]}")
    low, _, high = autoscale.partition(":")
    if not (low.strip().isdigit() and high.strip().isdigit()):
        fail(f"--autoscale takes MIN:MAX workers (e.g. 1:4), not {autoscale!r}")
    if not 0 <= int(low) <= int(high) or int(high) < 1:
        fail(f"--autoscale MIN:MAX needs MIN <= MAX and MAX >= 1, not {autoscale}")
    if cooldown_s < 0:
        fail(f"--cooldown-s must be >= 0, not {cooldown_s:g}")
    return int(low), int(high)


def _autoscale(spec: LaunchSpec, streams: Streams, bounds: tuple[int, int], cooldown_s: float) -> None:
    """Follow the queue's need until Ctrl-C (`consumers.ray_autoscale`), a line a change."""
    from consumers.ray_autoscale import RayAutoscaler, run
    from pipeline.scaling import ScalePolicy

    console.print(f"autoscaling {bounds[0]}..{bounds[1]} workers (cool-down {cooldown_s:g} s); Ctrl-C: stop scaling")
    run(RayAutoscaler(spec, streams, ScalePolicy(*bounds, cooldown_s), lambda line: console.print(line, markup=False)))


def _warn_loopback(redis_url: str) -> None:
    """Every node must reach Redis at the URL given: a loopback one works only on a one-node cluster."""
    import ray

    if is_sentinel_url(redis_url):
        hosts = {host for host, _port in parse_sentinel_url(redis_url).sentinels}
    else:
        hosts = {urlparse(redis_url).hostname or ""}
    nodes = [node for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]  # ray: unannotated
    if hosts <= {"127.0.0.1", "localhost", "::1"} and len(nodes) > 1:
        console.print(
            f"[yellow]warning:[/] --redis {redact(redis_url)} is loopback, but the cluster has {len(nodes)} nodes: "
            "workers on the others will not reach it; pass an address they can reach"
        )


def _watch(streams: Streams, actors: list[str], name_prefix: str) -> None:
    """Each actor (Ray's view) beside its worker's heartbeat (Redis's view), every second, until Ctrl-C."""
    from consumers.ray_launcher import ACTOR_PREFIX, actor_info, actor_names

    def table() -> Table:
        view = Table(title=f"Ray workers of {streams.keys.ns} (Ctrl-C: stop watching)")
        for column in ("worker", "ray actor", "host:pid", "status", "version", "inflight", "published", "tok/s"):
            view.add_column(column)
        for actor, info in actor_info(actor_names() or actors).items():
            name = name_prefix + actor.removeprefix(ACTOR_PREFIX)
            raw = streams.redis.hgetall(streams.keys.worker(name))
            beat = {as_text(key): as_text(value) for key, value in raw.items()}
            state = info["actor"] + (" (restarted)" if info.get("restarted") else "")
            view.add_row(
                name,
                f"{actor} {state}" + (f": {info['failure']}" if info.get("failure") else ""),
                f"{info['host']}:{info['pid']}" if "pid" in info else "",
                beat.get("status", "no heartbeat"),
                *(beat.get(key, "") for key in ("version", "inflight", "published", "tokens_per_s")),
            )
        return view

    with Live(table(), console=console, refresh_per_second=2) as live:
        try:
            while True:
                time.sleep(1.0)
                live.update(table())
        except KeyboardInterrupt:
            pass
    if not console.is_terminal:
        console.print()  # Live leaves its last frame without a line end there

"""`rollouts worker` and `rollouts manager`: the long-running processes of a pipeline."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Annotated

import redis
import typer

from pipeline.connections import redact
from pipeline.registry import default_name
from rollouts.app import (
    DEFAULT_NS,
    DEFAULT_REDIS,
    LogLevelOpt,
    MetricsAddrOpt,
    MetricsPortOpt,
    NsOpt,
    RedisOpt,
    app,
    check_engine,
    check_port,
    check_torch_device,
    console,
    fail,
    open_streams,
    require,
    resolve_model,
    serve_metrics,
    setup_logging,
    sync_report,
    user_errors,
)
from rollouts.engine_spec import NO_MODEL, EngineSpec
from rollouts.worker_flags import worker_flags, worker_settings

log = logging.getLogger(__name__)


@app.command()
@worker_flags()
def worker(
    ctx: typer.Context,
    model: Annotated[
        Path | None,
        typer.Option(help="Model directory (safetensors + tokenizer); the synthetic engine needs none (see --engine)."),
    ] = None,
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    name: Annotated[str | None, typer.Option(help="Consumer name; default host-pid.")] = None,
    log_level: LogLevelOpt = "info",
    metrics_port: MetricsPortOpt = None,
    metrics_addr: MetricsAddrOpt = "0.0.0.0",
) -> None:
    """Serve prompts from the namespace until interrupted (SIGINT/SIGTERM drain in-flight work)."""
    # The engine's and the worker loop's flags come in `ctx.params` (`worker_flags`).
    setup_logging(log_level)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", log_level.upper())
    if metrics_port is not None:
        check_port(metrics_port, "--metrics-port")
    settings = worker_settings(ctx.params)
    with user_errors():
        spec = EngineSpec.from_flags(ctx.params, NO_MODEL if model is None else resolve_model(model))
    check_engine(spec)
    require("torch", purpose="rollouts worker")  # whatever the engine: the worker loads weights with it
    check_torch_device(spec)
    streams = open_streams(redis_url, ns)
    from consumers.lifecycle import engine_factory  # torch: after the checks, so that a mistake is told at once
    from consumers.metrics import WorkerMetrics
    from consumers.worker import run_worker
    from pipeline.exporter import process_registry

    name = name or default_name()
    metrics = WorkerMetrics(ns, name, process_registry())
    if metrics_port is not None:  # before the engine loads: a port in use fails at once
        serve_metrics(metrics.registry, metrics_port, metrics_addr)
    with user_errors(redis_url):
        factory = engine_factory(spec.kind, str(spec.model), spec.options(), streams.redis, ns, name)
        done = run_worker(streams, factory(), name, settings, metrics, factory)  # built here, started by the worker
    state = done.state
    console.print(f"worker {done.name} stopped after publishing {state.published} rollouts and generating "
                  f"{state.generated_tokens} tokens")  # fmt: skip
    if done.failure:
        console.print(f"[bold red]worker {done.name} failed:[/] {done.failure}")
        raise typer.Exit(1)


@app.command()
def manager(
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    ack_timeout_s: Annotated[
        float, typer.Option(help="A sync's ack deadline; a sync older than it + 5 s is finished.")
    ] = 60.0,
    abandoned_after_s: Annotated[
        float | None, typer.Option(help="Finish a sync older than this (default: ack timeout + 5 s).")
    ] = None,
    interval: Annotated[float, typer.Option(help="Seconds between checks.")] = 1.0,
    once: Annotated[bool, typer.Option(help="Check once and exit.")] = False,
    metrics_port: MetricsPortOpt = None,
    metrics_addr: MetricsAddrOpt = "0.0.0.0",
    log_level: LogLevelOpt = "info",
) -> None:
    """Keep `{ns}:state` and finish weight syncs whose driver died (workers left paused), until interrupted.

    It logs what it watches as it starts, then every sync (whoever drove it), eviction and abandoned sync it finishes.
    With `--metrics-port`, it also serves every sync's stall, the syncs and evictions (whoever drove them)."""
    from pipeline.exporter import process_registry
    from staleness.manager import Manager
    from staleness.metrics import SyncMetrics
    from staleness.state import adapter_names

    for flag, seconds in (("--ack-timeout-s", ack_timeout_s), ("--interval", interval)):
        if not seconds > 0:
            fail(f"{flag} must be > 0 seconds, not {seconds:g}")
    if abandoned_after_s is not None and abandoned_after_s < 0:
        fail(f"--abandoned-after-s must be >= 0 seconds, not {abandoned_after_s:g}")
    if metrics_port is not None:
        check_port(metrics_port, "--metrics-port")
    streams = open_streams(redis_url, ns)
    keeper = Manager(streams, ack_timeout_s=ack_timeout_s)
    keepers: dict[str | None, Manager] = {None: keeper}
    with user_errors(redis_url):
        syncs = SyncMetrics(streams, process_registry())
    if metrics_port is not None:
        serve_metrics(syncs.registry, metrics_port, metrics_addr)
    setup_logging(log_level)
    abandoned = ack_timeout_s + 5.0 if abandoned_after_s is None else abandoned_after_s
    log.info(
        "manager of namespace %s at %s: a sync's ack deadline is %g s, one whose weights command is older than %g s "
        "is finished as abandoned; checking every %g s%s",
        ns, redact(redis_url), ack_timeout_s, abandoned, interval,
        f"; metrics on {metrics_addr}:{metrics_port}" if metrics_port is not None else "",
    )  # fmt: skip
    with user_errors(redis_url):
        streams.ensure_groups()
        while True:
            try:
                for adapter in [None, *adapter_names(streams.redis, streams.keys)]:  # each adapter syncs alone
                    if adapter not in keepers:
                        keepers[adapter] = Manager(streams, ack_timeout_s=ack_timeout_s, adapter=adapter)
                        log.info("watching the syncs of adapter %s too", adapter)
                    report = keepers[adapter].finish_abandoned(abandoned_after_s)
                    if report is not None:
                        syncs.abandoned()
                        of = f" of adapter {adapter}" if adapter else ""
                        console.print(f"finished an abandoned sync{of}: {json.dumps(sync_report(report))}")
                syncs.poll()
            except redis.ConnectionError as exc:  # gone for longer than the client's reconnects: keep checking
                if once:
                    raise
                console.print(f"[yellow]Redis unreachable ({exc}); checking again in {interval:g} s[/]")
            if once:
                state = keeper.state()
                print(json.dumps({"version": state.version, "epoch": state.epoch, "paused": state.paused}))
                return
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return

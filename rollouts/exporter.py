"""`rollouts exporter`: the whole pipeline as Prometheus metrics, read from Redis at each scrape."""

from __future__ import annotations

import signal
import threading
from typing import Annotated

import typer

from pipeline.connections import redact
from rollouts.app import (
    DEFAULT_NS,
    DEFAULT_REDIS,
    NsOpt,
    RedisOpt,
    app,
    check_port,
    console,
    serve_metrics,
    setup_logging,
    user_errors,
)

DEFAULT_PORT = 9650
SCRAPE_TIMEOUT_S = 5.0
"""A stuck Redis fails a scrape (`rollouts_up 0`) within Prometheus's default 10 s scrape timeout."""


@app.command()
def exporter(
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    port: Annotated[int, typer.Option(help="Port of the /metrics endpoint (0: a free one).")] = DEFAULT_PORT,
    addr: Annotated[str, typer.Option(help="Address the endpoint listens on.")] = "0.0.0.0",
    log_level: Annotated[str, typer.Option(help="debug, info, warning.")] = "info",
) -> None:
    """Serve the fleet's metrics (streams, groups, policy, admission, workers, scorer) until interrupted.

    Each scrape reads Redis once; a Redis that is gone then gives `rollouts_up 0`, not an error.
    """
    from prometheus_client import CollectorRegistry

    from pipeline.connections import connect
    from pipeline.exporter import FleetCollector
    from pipeline.streams import Streams

    check_port(port)
    setup_logging(log_level)
    with user_errors(redis_url):  # a wrong URL at start is a mistake to report, not a metric
        client = connect(
            redis_url, ns=ns, reconnect=False, socket_timeout=SCRAPE_TIMEOUT_S, socket_connect_timeout=SCRAPE_TIMEOUT_S
        )
        streams = Streams(client, ns)
    registry = CollectorRegistry()
    registry.register(FleetCollector(streams))
    serve_metrics(registry, port, addr, "--port")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console.print(f"exporter for namespace {ns} on {redact(redis_url)}")
    stop.wait()

"""The `rollouts` application: the typer app, the options its commands share, and the helpers that turn a person's
mistakes into one line each.

Every command turns the mistakes a person makes (a wrong URL, a missing model, a bad
prompts file) into one line that says what to fix, never a traceback. The commands live in the modules beside this
one (`pipeline.cli` imports them); other packages add commands through the `rollouts.commands` entry-point group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import redis
import typer
from rich.console import Console
from rich.logging import RichHandler

from pipeline.cli.engine_spec import EngineSpec
from pipeline.connections import UnsupportedRedisError, connect, redact
from pipeline.fast_exit import leave
from pipeline.streams import Streams
from pipeline.wire import WireError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from consumers.worker import WorkerSettings

# Models are local directories: never reach for a hub, and keep load/save progress bars out of logs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# vLLM logs to stdout by default; stdout is for results (`top --json`, `publish-weights`, the lab's reports).
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

app = typer.Typer(
    help="Rollout Streams: a Redis-streams rollout pipeline for asynchronous RL on language models.",
    epilog="Benchmarks, soaks and fault runs (the lab) are listed by `rollouts-bench --help`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
log = logging.getLogger(__name__)

RedisOpt = Annotated[str, typer.Option("--redis", envvar="ROLLOUTS_REDIS", help="Redis URL.")]
NsOpt = Annotated[str, typer.Option("--ns", envvar="ROLLOUTS_NS", help="Pipeline namespace (the key hash tag).")]
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_NS = "rollouts"
MetricsPortOpt = Annotated[
    int | None, typer.Option(help="Serve this process's Prometheus metrics on this port (default: off).")
]
MetricsAddrOpt = Annotated[str, typer.Option(help="Address the metrics endpoint listens on.")]
# The worker loop's flags, shared by `rollouts worker` and `rollouts launch` (Ray).
MaxInflightOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Samples in flight on the engine at once. Default: as many as the engine decodes at once (torch and "
        "synthetic: --max-batch; vLLM: its max_num_seqs; 256 where the engine does not say); a value given here wins.",
    ),
]
MaxInflightTokensOpt = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="Tokens in flight at once, each sample counted as prompt + max_tokens. Default: the engine's (vLLM: its "
        "KV cache; none on the others); a value given here wins; 0: no limit.",
    ),
]
ClaimIdleOpt = Annotated[int, typer.Option(help="Claim work untouched this long (a dead worker's).")]
HeartbeatOpt = Annotated[float, typer.Option(help="Heartbeat period in seconds.")]
LogLevelOpt = Annotated[str, typer.Option(help="debug, info, warning.")]
LazyOpt = Annotated[
    bool, typer.Option(help="Start the engine when the first work arrives (heartbeat status `idle` until then).")
]
ReleaseAfterOpt = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        help="Shut the engine down after this many seconds without work (status `released`); work starts it again.",
    ),
]
HandOffOpt = Annotated[
    bool,
    typer.Option(
        help="In an abort sync, hand interrupted samples to any worker through {ns}:partials (durable, the prompt "
        "acked) instead of continuing them here after the resume (nothing through Redis).",
    ),
]
DedupeTtlOpt = Annotated[
    int,
    typer.Option(
        min=1,
        help="How long a published rollout id is remembered, so that the same id from another entry (a prompt "
        "submitted twice, a replay) is not published again; Redis holds ~22 B per rollout for this long.",
    ),
]


def fail(message: str) -> NoReturn:
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)  # one line, however long: greppable
    raise typer.Exit(2)


@contextlib.contextmanager
def user_errors(redis_url: str | None = None) -> Iterator[None]:
    """Report the errors a user can fix in one line each."""
    where = None if redis_url is None else redact(redis_url)
    try:
        yield
    except redis.AuthenticationError as exc:  # a ConnectionError too: first
        fail(f"Redis at {where} refused the credentials: {exc}. Check the user and password in --redis.")
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        fail(f"cannot reach Redis at {where}: {exc}. Is redis-server running there? Pass --redis URL.")
    except redis.ResponseError as exc:
        fail(f"Redis at {where} refused a command: {exc}")
    except (FileNotFoundError, NotADirectoryError, ValueError, WireError, UnsupportedRedisError) as exc:
        fail(str(exc))


def open_streams(redis_url: str, ns: str) -> Streams:
    with user_errors(redis_url):
        return Streams(connect(redis_url, ns=ns), ns)


def check_engine(spec: EngineSpec) -> None:
    """Refuse an unknown engine or a missing model before anything heavy is imported."""
    from consumers.engines import ENGINES

    if spec.kind not in ENGINES:
        fail(f"unknown engine {spec.kind!r}; choose one of {', '.join(ENGINES)}")
    if spec.kind == "remote" and not spec.url:
        fail("--engine remote needs --url: the vLLM server, e.g. http://127.0.0.1:8000")
    if spec.kind != "synthetic" and not (spec.model / "config.json").is_file():  # synthetic: a model is optional
        fail(f"no model at {spec.model} (config.json missing). Build a tiny one with: rollouts tiny-model {spec.model}")


def worker_settings(
    max_inflight: int | None,
    claim_idle_ms: int,
    heartbeat_s: float,
    dedupe_ttl_s: int = 86_400,
    lazy: bool = False,
    release_after_s: float | None = None,
    hand_off_partials: bool = False,
    max_inflight_tokens: int | None = None,
) -> WorkerSettings:
    """The worker loop's settings from its flags; a heartbeat lives at least 5 periods, and a blocking read waits at
    most one (a worker asked to beat every 0.3 s stops within 0.3 s, not the default read's 1 s)."""
    from consumers.worker import WorkerSettings

    settings = WorkerSettings(
        max_inflight=max_inflight,
        max_inflight_tokens=max_inflight_tokens,
        claim_idle_ms=claim_idle_ms,
        heartbeat_s=heartbeat_s,
        dedupe_ttl_s=dedupe_ttl_s,
        block_ms=max(1, min(WorkerSettings.block_ms, round(heartbeat_s * 1000))),
    )
    settings.lazy, settings.release_after_s = lazy, release_after_s
    settings.hand_off_partials = hand_off_partials
    settings.heartbeat_ttl_s = max(settings.heartbeat_ttl_s, 5 * heartbeat_s)
    settings.freeze_heap = True  # a worker process of its own (`rollouts worker`, or a `rollouts launch` actor)
    return settings


def serve_metrics(registry: CollectorRegistry, port: int, addr: str) -> int:
    """Serve `registry` on http://addr:port/metrics; returns the port (0 asks for a free one).

    The `_created` series of counters and histograms are left out: in the text format they are only noise."""
    from prometheus_client import disable_created_metrics

    from pipeline.exporter import serve

    disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
    try:
        server = serve(registry, port, addr)
    except OSError as exc:
        fail(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}. Pass another port.")
    console.print(f"metrics on http://{addr}:{server.server_port}/metrics")
    return server.server_port


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(message)s", handlers=[RichHandler(console=console)])
    for name, reason in skipped_plugins:
        log.debug("commands of %s left out: %s", name, reason)


PLUGINS = "rollouts.commands"
"""The entry-point group through which other packages add commands: each entry is a callable given the app."""
skipped_plugins: list[tuple[str, str]] = []
"""The plugins that failed to load, with why: `rollouts` runs without them (shown under `--log-level debug`)."""


def load_plugins(target: typer.Typer) -> None:
    """Let every installed `rollouts.commands` entry point add its commands to `target`; one that fails to import
    or to register is skipped, so that a broken plugin never breaks `rollouts`."""
    for entry in entry_points(group=PLUGINS):
        try:
            register: Callable[[typer.Typer], None] = entry.load()
            register(target)
        except Exception as exc:  # a plugin's failure, whatever it is, is the plugin's
            skipped_plugins.append((entry.value, f"{type(exc).__name__}: {exc}"))


def sync_report(report: object) -> dict[str, object]:
    """A weight sync's report (`SyncReport`) as JSON fields, its stall rounded."""
    from dataclasses import asdict

    fields: dict[str, Any] = asdict(report)  # type: ignore[call-overload]  # a SyncReport, typed object here
    fields["stall_s"] = round(fields["stall_s"], 4)
    return fields


def main() -> NoReturn:
    """`rollouts`: the command asked for, then `leave` with its exit code (seconds sooner with torch or vLLM
    loaded)."""
    load_plugins(app)
    try:
        app()
    except SystemExit as done:
        leave(exit_code(done))
    leave(0)


def exit_code(done: SystemExit) -> int:
    """The status Python gives a `SystemExit`: None is 0, a message is printed and is 1."""
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)
    return 1

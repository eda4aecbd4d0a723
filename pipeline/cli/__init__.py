"""The `rollouts` command: the one place that composes pipeline, producers, consumers and staleness.

Every command turns the mistakes a person makes (a wrong URL, a missing model, a bad
prompts file) into one line that says what to fix, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import redis
import typer
from rich.console import Console
from rich.live import Live
from rich.logging import RichHandler

from pipeline.cli.engine_spec import (
    DeviceOpt,
    DtypeOpt,
    EagerOpt,
    EngineArgsOpt,
    EngineOpt,
    EngineProcessOpt,
    EngineSpec,
    KvCacheOpt,
    MaxBatchOpt,
    MaxLenOpt,
    MaxLorasOpt,
    SeedOpt,
    ThreadsOpt,
    TpOpt,
    UrlOpt,
)
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
# vLLM logs to stdout by default; stdout is for results (`bench`, `top --json`).
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

app = typer.Typer(
    help="Rollout Streams: a Redis-streams rollout pipeline for asynchronous RL on language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

RedisOpt = Annotated[str, typer.Option("--redis", envvar="ROLLOUTS_REDIS", help="Redis URL.")]
NsOpt = Annotated[str, typer.Option("--ns", envvar="ROLLOUTS_NS", help="Pipeline namespace (the key hash tag).")]
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_NS = "rollouts"
MetricsPortOpt = Annotated[
    int | None, typer.Option(help="Serve this process's Prometheus metrics on this port (default: off).")
]
MetricsAddrOpt = Annotated[str, typer.Option(help="Address the metrics endpoint listens on.")]
# The worker loop's flags, shared by `rollouts worker` and `rollouts launch` (Ray).
MaxInflightOpt = Annotated[int, typer.Option(help="Samples in flight on the engine at once.")]
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
    try:
        yield
    except redis.AuthenticationError as exc:  # a ConnectionError too: first
        fail(f"Redis at {redact(redis_url)} refused the credentials: {exc}. Check the user and password in --redis.")
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        fail(f"cannot reach Redis at {redact(redis_url)}: {exc}. Is redis-server running there? Pass --redis URL.")
    except redis.ResponseError as exc:
        fail(f"Redis at {redact(redis_url)} refused a command: {exc}")
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
    max_inflight: int,
    claim_idle_ms: int,
    heartbeat_s: float,
    dedupe_ttl_s: int = 86_400,
    lazy: bool = False,
    release_after_s: float | None = None,
    hand_off_partials: bool = False,
) -> WorkerSettings:
    """The worker loop's settings from its flags; a heartbeat lives at least 5 periods, and a blocking read waits at
    most one (a worker asked to beat every 0.3 s stops within 0.3 s, not the default read's 1 s)."""
    from consumers.worker import WorkerSettings

    settings = WorkerSettings(
        max_inflight=max_inflight,
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

    disable_created_metrics()
    try:
        server = serve(registry, port, addr)
    except OSError as exc:
        fail(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}. Pass another port.")
    console.print(f"metrics on http://{addr}:{server.server_port}/metrics")
    return server.server_port


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(message)s", handlers=[RichHandler(console=console)])


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer to.")],
    seed: Annotated[int, typer.Option(help="Weight seed: different seeds give different policy weights.")] = 0,
) -> None:
    """Build the tiny local Qwen2 model and its byte-level BPE tokenizer (nothing is downloaded)."""
    from consumers.engines.tiny_model import build_tiny_model

    with user_errors():
        path = build_tiny_model(out, seed=seed)
    console.print(f"tiny model (seed {seed}) written to [bold]{path}[/]")


@app.command()
def worker(
    ctx: typer.Context,
    model: Annotated[Path, typer.Option(help="Model directory (safetensors + tokenizer).")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    engine: EngineOpt = "torch",
    name: Annotated[str | None, typer.Option(help="Consumer name; default host-pid.")] = None,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    max_batch: MaxBatchOpt = 64,
    max_loras: MaxLorasOpt = None,
    num_threads: ThreadsOpt = None,
    max_model_len: MaxLenOpt = None,
    kv_cache_bytes: KvCacheOpt = None,
    tensor_parallel_size: TpOpt = 1,
    enforce_eager: EagerOpt = True,
    seed: SeedOpt = None,
    url: UrlOpt = None,
    engine_args: EngineArgsOpt = None,
    engine_process: EngineProcessOpt = False,
    max_inflight: MaxInflightOpt = 256,
    claim_idle_ms: ClaimIdleOpt = 10_000,
    heartbeat_s: HeartbeatOpt = 1.0,
    log_level: LogLevelOpt = "info",
    metrics_port: MetricsPortOpt = None,
    metrics_addr: MetricsAddrOpt = "0.0.0.0",
    dedupe_ttl_s: DedupeTtlOpt = 86_400,
    lazy: LazyOpt = False,
    release_after_s: ReleaseAfterOpt = None,
    hand_off_partials: HandOffOpt = False,
) -> None:
    """Serve prompts from the namespace until interrupted (SIGINT/SIGTERM drain in-flight work)."""
    # The engine flags reach the engine through `ctx.params` (EngineSpec.from_flags).
    from consumers.lifecycle import engine_factory
    from consumers.metrics import WorkerMetrics
    from consumers.worker import default_worker_name, run_worker
    from pipeline.exporter import process_registry

    setup_logging(log_level)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", log_level.upper())
    with user_errors():
        spec = EngineSpec.from_flags(ctx.params, model)
    check_engine(spec)
    streams = open_streams(redis_url, ns)
    settings = worker_settings(
        max_inflight, claim_idle_ms, heartbeat_s, dedupe_ttl_s, lazy, release_after_s, hand_off_partials
    )
    name = name or default_worker_name()
    metrics = WorkerMetrics(ns, name, process_registry())
    if metrics_port is not None:  # before the engine loads: a port in use fails at once
        serve_metrics(metrics.registry, metrics_port, metrics_addr)
    with user_errors(redis_url):
        factory = engine_factory(spec.kind, str(spec.model), spec.options(), streams.redis, ns, name)
        done = run_worker(streams, factory(), name, settings, metrics, factory)  # built here, started by the worker
    console.print(f"worker {done.name} stopped after publishing {done.published} rollouts")
    if done.failure:
        console.print(f"[bold red]worker {done.name} failed:[/] {done.failure}")
        raise typer.Exit(1)


@app.command()
def submit(
    file: Annotated[Path, typer.Option("--file", help="JSONL: one prompt object a line.")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    model: Annotated[Path | None, typer.Option(help="Model directory whose tokenizer reads text prompts.")] = None,
) -> None:
    """Queue prompts from a JSONL file: `id`, `prompt` (text) or `tokens`, `n`, `max_tokens`,
    `temperature`, `top_p`, `stop_token_ids`, `seed`, `meta`, `reward_fn`, `adapter` (a LoRA adapter's name). Nothing
    is queued unless every line is valid."""
    from producers.prompts_file import read_prompts_file

    if not file.is_file():
        fail(f"no prompts file at {file}")
    with user_errors(redis_url):
        from producers.client import RolloutClient

        client = RolloutClient(redis_url, ns, tokenizer=model)
        prompts = read_prompts_file(file, client)
        client.submit_prompts(prompts)
    samples = sum(p.n for p in prompts)
    console.print(f"queued {len(prompts)} prompts ({samples} samples) on {client.streams.keys.prompts}")


@app.command()
def top(
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    once: Annotated[bool, typer.Option(help="Print one snapshot and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --once: print the snapshot as JSON.")] = False,
    interval: Annotated[float, typer.Option(help="Refresh period in seconds.")] = 1.0,
) -> None:
    """Live view of stream depth, group lag and pending, and workers; `--once --json` for scripts."""
    from pipeline.top import render, snapshot

    streams = open_streams(redis_url, ns)
    with user_errors(redis_url):
        if once:
            snap = snapshot(streams)
            if as_json:
                print(json.dumps(snap, indent=2))
            else:
                Console().print(render(snap))
            return
        with Live(render(snapshot(streams)), console=Console(), refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(render(snapshot(streams)))
            except KeyboardInterrupt:
                pass


@app.command("publish-weights")
def publish_weights(
    source: Annotated[Path, typer.Option("--from", help="Checkpoint directory (safetensors) of the new policy.")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    transport: Annotated[
        str,
        typer.Option(
            help="redis (chunks in this Redis), fs://DIR (shared storage) or nccl://HOST:PORT (broadcast from "
            "this process, which the workers reach at HOST:PORT)."
        ),
    ] = "redis",
    mode: Annotated[str, typer.Option(help="Pause mode: abort (partials continue anywhere) or keep.")] = "abort",
    ack_timeout_s: Annotated[float, typer.Option(help="Evict a worker that has not loaded it by then.")] = 60.0,
    adapter: Annotated[
        str | None,
        typer.Option(
            help="A LoRA adapter's name: --from is a PEFT directory (adapter_model.safetensors + "
            "adapter_config.json), and only this adapter moves to its next version (only its requests pause)."
        ),
    ] = None,
) -> None:
    """Make a checkpoint the next policy version on every worker (pause → load → ack → resume); JSON out."""
    from producers.client import RolloutClient

    if mode not in ("abort", "keep"):
        fail(f"--mode must be abort or keep, not {mode!r}")
    if not any(source.glob("*.safetensors")):
        fail(f"no safetensors checkpoint in {source}")
    if adapter is not None and not (source / "adapter_config.json").is_file():
        fail(f"--adapter {adapter}: {source} has no adapter_config.json (a PEFT adapter directory has)")
    spec = "redis://" if transport in ("redis", "redis://") else transport
    with user_errors(redis_url):
        client = RolloutClient(redis_url, ns)
        version = client.publish_weights(
            source,
            transport=spec,
            mode=mode,  # type: ignore[arg-type]
            ack_timeout_s=ack_timeout_s,
            adapter=adapter,
        )
    of = {} if adapter is None else {"adapter": adapter}
    print(json.dumps({"version": version} | of | _report(client.last_sync)))


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
) -> None:
    """Keep `{ns}:state` and finish weight syncs whose driver died (workers left paused), until interrupted.

    With `--metrics-port`, it also serves every sync's stall, the syncs and evictions (whoever drove them)."""
    from pipeline.exporter import process_registry
    from staleness.manager import Manager
    from staleness.metrics import SyncMetrics
    from staleness.state import adapter_names

    streams = open_streams(redis_url, ns)
    keeper = Manager(streams, ack_timeout_s=ack_timeout_s)
    keepers: dict[str | None, Manager] = {None: keeper}
    with user_errors(redis_url):
        syncs = SyncMetrics(streams, process_registry())
    if metrics_port is not None:
        serve_metrics(syncs.registry, metrics_port, metrics_addr)
    with user_errors(redis_url):
        streams.ensure_groups()
        while True:
            try:
                for adapter in [None, *adapter_names(streams.redis, streams.keys)]:  # each adapter syncs alone
                    if adapter not in keepers:
                        keepers[adapter] = Manager(streams, ack_timeout_s=ack_timeout_s, adapter=adapter)
                    report = keepers[adapter].finish_abandoned(abandoned_after_s)
                    if report is not None:
                        syncs.abandoned()
                        of = f" of adapter {adapter}" if adapter else ""
                        console.print(f"finished an abandoned sync{of}: {json.dumps(_report(report))}")
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


def _report(report: object) -> dict[str, object]:
    from dataclasses import asdict

    fields = asdict(report)  # type: ignore[call-overload]
    fields["stall_s"] = round(fields["stall_s"], 4)
    return fields


@app.command()
def demo(
    prompts: Annotated[int, typer.Option(help="How many prompts to submit.")] = 16,
    n: Annotated[int, typer.Option(help="Samples per prompt.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per sample.")] = 48,
    keep: Annotated[bool, typer.Option(help="Keep Redis and the worker running for a look inside.")] = False,
    train_steps: Annotated[
        int, typer.Option(min=0, help="Fully-async GRPO steps against the worker, publishing weights each (0: none).")
    ] = 100,
    plot: Annotated[Path, typer.Option(help="Where to write the learning curve (PNG).")] = Path(
        "rollouts-demo-curve.png"
    ),
) -> None:
    """Everything on an embedded default: private Redis, tiny model, a worker, prompts, a summary, then a
    short GRPO run with a live table of the reward rising as the weights change under the worker."""
    from pipeline.cli.demo import run_demo

    with user_errors():
        run_demo(console, prompts=prompts, n=n, max_tokens=max_tokens, keep=keep, train_steps=train_steps, plot=plot)


@app.command()
def bench(
    ctx: typer.Context,
    engine: EngineOpt = "torch",
    model: Annotated[Path | None, typer.Option(help="Model directory; default: a fresh tiny model.")] = None,
    prompts: Annotated[int, typer.Option(help="Prompts per round.")] = 64,
    n: Annotated[int, typer.Option(help="Samples per prompt.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Tokens per sample (no early stop).")] = 64,
    rounds: Annotated[int, typer.Option(help="Rounds of each; medians are reported.")] = 3,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    max_batch: MaxBatchOpt = 64,
    num_threads: ThreadsOpt = None,
    max_model_len: MaxLenOpt = None,
    kv_cache_bytes: KvCacheOpt = None,
    tensor_parallel_size: TpOpt = 1,
    enforce_eager: EagerOpt = True,
    engine_args: EngineArgsOpt = None,
    engine_process: EngineProcessOpt = False,
    one_engine: Annotated[
        bool,
        typer.Option(
            help="One engine for both sides: the worker runs in the bench's process on the direct side's engine, "
            "and the trainer's client in a process of its own (no difference between two engines counts as the "
            "pipeline's)."
        ),
    ] = False,
    paired: Annotated[
        bool,
        typer.Option(
            help="Both sides at once on one engine (implies --one-engine), half the prompts each, in the same engine "
            "steps: the engine's own round-to-round noise hits both alike. Measures the time the pipeline adds, not "
            "the CPU it takes from the engine."
        ),
    ] = False,
    plot: Annotated[Path | None, typer.Option(help="Also draw the rounds of both sides to this PNG.")] = None,
) -> None:
    """Rollouts/s and tokens/s of the engine called directly vs through the whole pipeline; JSON out."""
    from pipeline.cli.bench import plot_bench, run_bench

    with user_errors():
        spec = EngineSpec.from_flags(ctx.params, model or Path("tiny-model"))
        if model is not None:
            check_engine(spec)
        result = run_bench(
            console,
            spec,
            build_model=model is None,
            prompts=prompts,
            n=n,
            max_tokens=max_tokens,
            rounds=rounds,
            one_engine=one_engine,
            paired=paired,
        )
        if plot is not None:
            plot_bench(result, plot)
            console.print(f"plot written to {plot}")
    print(json.dumps(result, indent=2))


@app.command("bench-sync")
def bench_sync(
    ctx: typer.Context,
    engine: EngineOpt = "torch",
    sizes: Annotated[
        str, typer.Option(help="Model sizes, comma-separated: tiny, small, medium, large, xl.")
    ] = "tiny,small,medium",
    transports: Annotated[
        str, typer.Option(help="Transports, comma-separated: redis, fs, nccl, ipc.")
    ] = "redis,fs,nccl",
    rounds: Annotated[int, typer.Option(help="Publishes per size and transport; medians are reported.")] = 3,
    mode: Annotated[str, typer.Option(help="Pause mode: abort or keep.")] = "abort",
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    max_batch: MaxBatchOpt = 64,
    num_threads: ThreadsOpt = None,
    kv_cache_bytes: KvCacheOpt = None,
    trainer_device: Annotated[
        str, typer.Option(help="Where the trainer's weights live (cpu, cuda:0): nccl broadcasts from there.")
    ] = "cpu",
    plot: Annotated[Path | None, typer.Option(help="Also draw stall against model size to this PNG.")] = None,
    logs: Annotated[Path | None, typer.Option(help="Keep the worker's logs here (one per size and transport).")] = None,
    idle: Annotated[
        bool, typer.Option(help="No requests during the syncs: the transfer alone, no generation beside it.")
    ] = False,
) -> None:
    """The stall of a weight sync (publish_weights → every worker generating again), per transport and size."""
    from pipeline.cli.bench_sync import SIZES, TRANSPORTS, plot_bench_sync, run_bench_sync

    chosen, paths = sizes.split(","), transports.split(",")
    if unknown := [s for s in chosen if s not in SIZES]:
        fail(f"unknown sizes {unknown}; choose from {', '.join(SIZES)}")
    if unknown := [t for t in paths if t not in TRANSPORTS]:
        fail(f"unknown transports {unknown}; choose from {', '.join(TRANSPORTS)}")
    if mode not in ("abort", "keep"):
        fail(f"--mode must be abort or keep, not {mode!r}")
    spec = EngineSpec.from_flags(ctx.params, Path("per-size"))
    with user_errors():
        result = run_bench_sync(console, spec, chosen, paths, rounds, mode, trainer_device, logs, idle)
        if plot is not None:
            plot_bench_sync(result, plot)
            console.print(f"plot written to {plot}")
    print(json.dumps(result, indent=2))


# Commands that live in modules beside this one register themselves on `app` when imported.
from pipeline.cli import (  # noqa: E402, F401
    acl,
    bench_broker,
    bench_gateway,
    bench_lora,
    chaos,
    chaos_trainer,
    exporter,
    gateway,
    launch,
    recording,
    scale,
    scale_fleet,
    scoring,
    soak,
)


def main() -> NoReturn:
    """`rollouts`: the command asked for, then `leave` with its exit code (seconds sooner with torch or vLLM
    loaded)."""
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

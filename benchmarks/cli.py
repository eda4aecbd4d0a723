"""`rollouts-bench`: the lab's commands (benchmarks, soaks, fault runs), each also a hidden command of `rollouts`.

`register` is the `rollouts.commands` entry point: `rollouts bench ...` runs the same command as `rollouts-bench bench
...`, while `rollouts --help` lists only what a user runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from benchmarks import bench_broker, bench_gateway, bench_lora, chaos, chaos_trainer, scale, scale_fleet, soak
from pipeline.cli.app import check_engine, console, exit_code, fail, user_errors
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
    ThreadsOpt,
    TpOpt,
)
from pipeline.fast_exit import leave
from pipeline.wire import is_pause_mode

lab = typer.Typer(
    help="The lab of Rollout Streams: benchmarks, soaks and fault runs, each a JSON report on stdout.",
    epilog="Each is also a hidden command of `rollouts` (`rollouts bench ...`).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


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
    from benchmarks.bench import plot_bench, run_bench

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
    from benchmarks.bench_sync import SIZES, TRANSPORTS, plot_bench_sync, run_bench_sync

    chosen, paths = sizes.split(","), transports.split(",")
    if unknown := [s for s in chosen if s not in SIZES]:
        fail(f"unknown sizes {unknown}; choose from {', '.join(SIZES)}")
    if unknown := [t for t in paths if t not in TRANSPORTS]:
        fail(f"unknown transports {unknown}; choose from {', '.join(TRANSPORTS)}")
    if not is_pause_mode(mode):
        fail(f"--mode must be abort or keep, not {mode!r}")
    spec = EngineSpec.from_flags(ctx.params, Path("per-size"))
    with user_errors():
        result = run_bench_sync(console, spec, chosen, paths, rounds, mode, trainer_device, logs, idle)
        if plot is not None:
            plot_bench_sync(result, plot)
            console.print(f"plot written to {plot}")
    print(json.dumps(result, indent=2))


COMMANDS: list[tuple[str, Callable[..., Any], bool]] = [
    ("bench", bench, False),
    ("bench-sync", bench_sync, False),
    ("bench-broker", bench_broker.bench_broker, False),
    ("bench-gateway", bench_gateway.bench_gateway, False),
    ("bench-lora", bench_lora.bench_lora, False),
    ("soak", soak.soak, False),
    ("scale", scale.scale, False),
    ("chaos", chaos.chaos_command, False),
    ("chaos-trainer", chaos_trainer.chaos_trainer, True),
    ("scale-ping", scale.scale_ping, True),
    ("scale-fleet", scale_fleet.scale_fleet, True),
]
"""Every lab command: its name, its function, and whether even `rollouts-bench --help` leaves it out (the processes
that `chaos` and `scale` start)."""

for _name, _command, _hidden in COMMANDS:
    lab.command(_name, hidden=_hidden)(_command)


def register(app: typer.Typer) -> None:
    """The `rollouts.commands` entry point: every lab command on `rollouts` too, hidden from its help."""
    for name, command, _ in COMMANDS:
        app.command(name, hidden=True)(command)


def main() -> NoReturn:
    """`rollouts-bench`: the command asked for, then `leave` with its exit code, as `rollouts` does."""
    try:
        lab()
    except SystemExit as done:
        leave(exit_code(done))
    leave(0)

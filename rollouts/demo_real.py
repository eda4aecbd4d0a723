"""`rollouts demo --model smollm2`: a real pretrained model learning one-digit sums by GRPO, on this machine's CPU.

SmolLM2-135M-Instruct (built from PyPI by `rollouts pretrained`, cached) answers one-digit sums through its chat
template, sampled at temperature 1; its held-out accuracy starts near a third. The trainer steps one step off the
worker: while it trains on step k's groups, the worker already generates step k+1's (with the policy one version
behind, each token tagged with its version, corrected by the decoupled PPO loss), and every published version goes to
the running worker. Every `eval_every` steps the held-out split (problems the trainer never sees) is sampled through
the same worker, and the table shows its accuracy beside the version that answered it.

`train_real` is the loop; the shell's demo (`rollouts.demo`) starts Redis, the manager and the worker around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from pipeline.wire import Rollout
from producers.client import Batch, Group, RolloutClient
from producers.tasks import Problem
from producers.tasks.base import stable_hash

TASK = "arithmetic:sum-1d"
PROMPTS, SAMPLES, MAX_TOKENS, LR, EVAL_SAMPLES = 8, 4, 48, 2e-5, 2
"""A step: 8 problems x 4 samples, up to 48 new tokens (most replies take 10-30), AdamW at 2e-5; each held-out
problem sampled twice. Measured on a 2-core VM: a step ~40 s (generation ~12 s beside training ~28 s in fp32)."""
EVAL_PROBLEMS = 16
"""The whole held-out split of one-digit sums (16 of its 100 problems)."""
TRAIN_STEPS = 8
EVAL_EVERY = 2


@dataclass
class RealRow:
    step: int
    version: int
    """The version this step published."""
    reward: float
    """Train reward (exact match) over the step's samples."""
    reply_tokens: float
    staleness: float
    """Mean over the step's samples of (the trainer's version - the version that began each)."""
    stall_s: float
    elapsed_s: float


@dataclass(frozen=True)
class HeldOut:
    """One evaluation of the held-out split through the worker."""

    elapsed_s: float
    version: int
    """The version that began most of its samples (the median)."""
    accuracy: float
    step: int
    """The step during which it arrived (the number of steps for those after the last)."""


@dataclass
class RealRun:
    rows: list[RealRow] = field(default_factory=list)
    evals: list[HeldOut] = field(default_factory=list)
    """In the order they finished: the base policy's first."""


def train_real(
    console: Console,
    url: str,
    ns: str,
    model: Path,
    steps: int = TRAIN_STEPS,
    eval_every: int = EVAL_EVERY,
    lr: float = LR,
    seed: int = 0,
    prompts: int = PROMPTS,
    samples: int = SAMPLES,
    eval_problems: int = EVAL_PROBLEMS,
) -> RealRun:
    """GRPO one step off the worker on `TASK`, with the held-out accuracy sampled through the worker before the first
    step, every `eval_every` steps and after the last; a live table on `console`. A step is `prompts` problems x
    `samples` samples; `eval_problems` problems of the held-out split are evaluated."""
    import torch
    from transformers import AutoModelForCausalLM

    from producers.grpo import grpo_step
    from producers.tasks import get_task
    from producers.tasks.rewards import text_reward

    task = get_task(TASK)
    torch.set_num_threads(1)  # the trainer on one core, the worker on the other
    torch.manual_seed(seed)
    client = RolloutClient(url, ns, tokenizer=model)
    tokenizer = client.tokenizer
    reward = text_reward(lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)))
    held_out = task.problems("eval", eval_problems, seed=seed)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99))
    run, received = RealRun(), _Received(client.groups(timeout=600))
    started = time.monotonic()

    def ask(problems: list[Problem], n: int, prefix: str) -> list[str]:
        """Each prompt with a sampling seed of its own: a run repeats (up to batching's rounding) for one `seed`."""
        ids = []
        for i, p in enumerate(problems):
            draw = stable_hash(f"{seed}|{prefix}|{i}") % 2**31
            ids.append(client.submit(p.prompt, n=n, max_tokens=MAX_TOKENS, meta=p.meta, id=f"{prefix}-{i}", seed=draw))
        return ids

    def submit_step(step: int) -> list[str]:
        return ask(task.problems("train", prompts, seed=seed * 100_003 + step), samples, f"s{step}")

    def submit_eval(version: int) -> list[str]:
        return ask(held_out, EVAL_SAMPLES, f"eval-v{version}")

    evals: list[list[str]] = [submit_eval(0)]
    pending = submit_step(0)
    version = 0
    with Live(_table(run, steps), console=console, auto_refresh=False) as live:
        for step in range(steps):
            groups = received.wait_for(pending)
            if step + 1 < steps:
                pending = submit_step(step + 1)  # generated while this step trains: one step off
            batch = Batch(groups, trainer_version=version)
            out = grpo_step(policy, optimizer, batch, reward, clip_low=0.2, clip_high=0.28)
            version = client.publish_weights(policy)
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                evals.append(submit_eval(version))
            rollouts = batch.rollouts
            row = RealRow(
                step=step, version=version, reward=out.reward,
                reply_tokens=sum(r.n_tokens for r in rollouts) / len(rollouts),
                staleness=sum(version - 1 - r.version for r in rollouts) / len(rollouts),
                stall_s=client.last_sync.stall_s if client.last_sync else 0.0,
                elapsed_s=time.monotonic() - started,
            )  # fmt: skip
            run.rows.append(row)
            while evals and received.has(evals[0]):
                run.evals.append(_evaluated(received.wait_for(evals.pop(0)), reward, row.elapsed_s, step))
            live.update(_table(run, steps), refresh=True)
            if not console.is_terminal:  # a Live table shows only at its end there: a line a step meanwhile
                held = _held(run.evals[-1]) if run.evals else ""
                console.print(f"step {step + 1}/{steps}: version {version}, reward {out.reward:.2f}, held-out "
                              f"{held}, {row.elapsed_s:.0f} s", soft_wrap=True)  # fmt: skip
        for ids in evals:  # the last versions' accuracy, off the training clock
            run.evals.append(_evaluated(received.wait_for(ids), reward, time.monotonic() - started, steps))
        live.update(_table(run, steps), refresh=True)
    received.close()
    if not console.is_terminal:
        console.line()
    return run


class _Received:
    """Whole groups as they arrive, kept by prompt id until a step asks for its own."""

    def __init__(self, groups: Iterator[Group]) -> None:
        self._groups = groups
        self._by_id: dict[str, Group] = {}

    def has(self, ids: list[str]) -> bool:
        return all(i in self._by_id for i in ids)

    def wait_for(self, ids: list[str]) -> list[Group]:
        while not self.has(ids):
            group = next(self._groups)
            self._by_id[group.prompt_id] = group
        return [self._by_id.pop(i) for i in ids]

    def close(self) -> None:
        close = getattr(self._groups, "close", None)
        if close is not None:
            close()  # acks the last group


def _evaluated(groups: list[Group], reward: Callable[[Rollout], float], elapsed_s: float, step: int) -> HeldOut:
    rollouts = [r for g in groups for r in g.rollouts]
    versions = sorted(r.version for r in rollouts)
    accuracy = sum(reward(r) for r in rollouts) / len(rollouts)
    return HeldOut(elapsed_s, versions[len(versions) // 2], accuracy, step)


def _table(run: RealRun, steps: int) -> Table:
    from rollouts.demo import bar

    table = Table(
        title=f"GRPO on one-digit sums, SmolLM2-135M-Instruct, one step off: step {len(run.rows)}/{steps}",
        caption=(
            "reward: share of the step's samples answered right (exact match, temperature 1)\n"
            "held-out: accuracy on problems never trained on, sampled through the worker, by version v\n"
            "stale: versions behind the trainer; stall: the worker's pause in the step's sync"
        ),
    )
    for name in ("step", "version", "reward", "", "held-out", "tokens", "stale", "stall", "time"):
        table.add_column(name, justify="left" if name == "" else "right", min_width=10 if name == "" else None)
    shown = {e.step: e for e in run.evals[1:]}
    if run.evals:
        table.add_row("base", "0", "", "", _held(run.evals[0]), "", "", "", "")
    for row in run.rows:
        table.add_row(
            str(row.step + 1), str(row.version), f"{row.reward:.2f}", bar(row.reward), _held(shown.get(row.step)),
            f"{row.reply_tokens:.0f}", f"{row.staleness:.2f}", f"{row.stall_s:.1f}s", f"{row.elapsed_s:.0f}s",
        )  # fmt: skip
    for late in run.evals[1:]:
        if late.step >= len(run.rows):
            table.add_row("end", str(late.version), "", "", _held(late), "", "", "", f"{late.elapsed_s:.0f}s")
    return table


def _held(held: HeldOut | None) -> str:
    return "" if held is None else f"{held.accuracy:.0%} v{held.version}"


def report_real(console: Console, run: RealRun, plot: Path | None) -> None:
    """One line: the held-out accuracy from the base to the last version, and the curve as a PNG at `plot`."""
    from rollouts.demo import save_curve

    base, last = run.evals[0], run.evals[-1]
    console.print(
        f"[bold]held-out accuracy[/] {base.accuracy:.0%} (v{base.version}) → {last.accuracy:.0%} (v{last.version}) "
        f"in {len(run.rows)} steps, "
        f"{run.rows[-1].elapsed_s:.0f} s of training",
        soft_wrap=True,
    )
    save_curve(console, plot, lambda path: _plot_real(run, path))


def _plot_real(run: RealRun, path: Path) -> None:
    """Held-out accuracy against time, and the train reward per step, side by side."""
    from rollouts.demo import two_panels

    fig, left, right = two_panels()
    left.plot([e.elapsed_s for e in run.evals], [e.accuracy for e in run.evals], marker="o")
    left.set(xlabel="seconds", ylabel="held-out accuracy", ylim=(0, 1.02))
    left.set_title("SmolLM2-135M-Instruct, one-digit sums: held-out accuracy")
    right.plot([r.step + 1 for r in run.rows], [r.reward for r in run.rows], marker=".", label="train reward")
    right.set(xlabel="step", ylabel="train reward", ylim=(0, 1.02))
    right.set_title("train reward per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

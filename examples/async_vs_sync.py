"""Fully-async RL against synchronous RL on your machine: the reference trainer (`grpo_trainer.py`) once per mode.

    python examples/async_vs_sync.py --modes sync,async:2 --steps 60 --plot async_vs_sync.png

Each mode runs `grpo_trainer.train` with the same task, seed and hyper-parameters (heavy-tailed response lengths, as
reasoning traces have), against a worker and a manager of its own on one private Redis. It prints one line a mode:
the wall time until the mean training reward of five steps in a row reaches `--target`, the steps that took, and the
share of the generated tokens trained on; `--plot` draws the reward of every mode against wall time. The project's
own measurement of this (a held-out eval off the clock, several seeds, fleets of workers) is the lab's
`rollouts-bench bench-rl`, run from a checkout (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import grpo_trainer as reference  # beside this file: Python puts the script's folder on the path
import numpy as np
import torch

from pipeline.local import RedisServer

WINDOW = 5
"""Steps whose mean reward is compared with the target."""


def parse_mode(text: str) -> tuple[str, int]:
    """`sync`, `one-step-off` or `async:η` as the trainer's mode and its staleness bound η."""
    name, _, eta = text.partition(":")
    if name not in ("sync", "one-step-off", "async") or (eta and (name != "async" or not eta.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r}: use sync, one-step-off or async:η (async:2)")
    return name, int(eta) if eta else {"sync": 0, "one-step-off": 1, "async": 2}[name]


def time_to(logs: list[reference.StepLog], target: float) -> tuple[float, int] | None:
    """The elapsed seconds and steps when the mean reward of the last `WINDOW` steps first reached `target`."""
    for end in range(WINDOW, len(logs) + 1):
        if np.mean([log.reward for log in logs[end - WINDOW : end]]) >= target:
            return logs[end - 1].elapsed_s, end
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="sync,async:2", help="sync, one-step-off, async:η; comma-separated.")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.3, help="The mean training reward to reach.")
    parser.add_argument("--length-alpha", type=float, default=1.5, help="Pareto exponent of response lengths.")
    parser.add_argument("--pause-mode", default="abort", choices=["abort", "keep", "inflight"])
    parser.add_argument("--model", type=Path, help="Model directory (default: a fresh tiny model).")
    parser.add_argument("--plot", type=Path, help="Draw the reward against wall time to this PNG.")
    args = parser.parse_args(argv)
    try:
        modes = [parse_mode(m) for m in args.modes.split(",")]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    base = reference.TrainConfig(
        steps=args.steps, seed=args.seed, length_alpha=args.length_alpha, length_sets=True, pause_mode=args.pause_mode
    )
    torch.set_num_threads(1)  # the trainer on one core, the worker on the other
    runs: dict[str, list[reference.StepLog]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="async-vs-sync-")))
        url = stack.enter_context(RedisServer()).url
        model = args.model or tmp / "model"
        if args.model is None:
            subprocess.run(reference.rollouts_cli("tiny-model", str(model)), check=True, capture_output=True)
        for mode, eta in modes:
            config = replace(base, mode=mode, max_staleness=eta)
            name, ns = f"{mode}:{eta}" if mode == "async" else mode, f"avs-{mode}-{eta}"
            try:
                with reference.generation_side(url, ns, model, "torch", 1, tmp):
                    runs[name] = logs = list(reference.train(config, url, ns, model))
            except reference.GenerationSideDied as exc:
                raise SystemExit(f"async_vs_sync: a process of the {name} run stopped: {exc}") from None
            summary = reference.summarize(config, logs, url, ns)
            reached = time_to(logs, args.target)
            took = f"{reached[0]:.1f} s ({reached[1]} steps)" if reached else f"not within {len(logs)} steps"
            print(f"{name:>14}: reward {args.target} after {took}, final {summary['final_reward']:.2f}, "
                  f"{summary['trained_share']:.0%} of generated tokens trained", flush=True)  # fmt: skip
    if args.plot:
        plot(runs, args.plot)


def plot(runs: dict[str, list[reference.StepLog]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots()
    for name, logs in runs.items():
        axes.plot([log.elapsed_s for log in logs], [log.reward for log in logs], marker=".", label=name)
    axes.set(xlabel="seconds", ylabel="mean reward", title="GRPO on the token-set task", ylim=(0, 1.02))
    axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

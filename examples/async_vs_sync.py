"""Fully-async RL against synchronous RL on your machine: `rollouts bench-rl`, called from a script you can adapt.

    python examples/async_vs_sync.py --steps 60 --seeds 0,1,2 --plot async_vs_sync.png

Each mode runs the reference trainer (`grpo_trainer.py`) with the same task, seeds and hyper-parameters, against a
worker and a manager of its own; the measure is the wall time until the current policy's reward on held-out prompts
reaches `--target` (evaluated off the clock). It prints one line a mode and writes the whole report (`--out`). The
lab's command does the same with every option: `rollouts bench-rl --help`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from benchmarks.bench_rl import Mode, Settings, load_trainer, plot_bench_rl, run_bench_rl


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="sync,async:2", help="sync, one-step-off, async:η; comma-separated.")
    parser.add_argument("--seeds", default="0", help="Seeds, comma-separated.")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--target", type=float, default=0.3, help="The eval reward of the current policy to reach.")
    parser.add_argument("--length-alpha", type=float, default=1.5, help="Pareto exponent of response lengths.")
    parser.add_argument("--pause-mode", default="abort", choices=["abort", "keep", "inflight"])
    parser.add_argument("--out", type=Path, help="Write the whole report (JSON) here.")
    parser.add_argument("--plot", type=Path, help="Draw eval reward against wall time to this PNG.")
    args = parser.parse_args(argv)
    trainer = load_trainer()
    base = trainer.TrainConfig(
        steps=args.steps, length_alpha=args.length_alpha, length_sets=True, pause_mode=args.pause_mode
    )
    try:
        modes = tuple(Mode.parse(m) for m in args.modes.split(","))
    except ValueError as exc:
        parser.error(str(exc))
    seeds = tuple(int(s) for s in args.seeds.split(","))
    settings = Settings(modes=modes, seeds=seeds, steps=args.steps, target=args.target)
    try:
        report = run_bench_rl(Console(stderr=True), settings, base)
    except trainer.GenerationSideDied as exc:
        sys.exit(f"async_vs_sync: a process of the run stopped: {exc}")
    for name, row in report["summary"]["modes"].items():
        share = row["trained_share"]["median"]
        print(f"{name:>14}: {row['time_to_target_s']} s to {args.target} ({row['speedup']}x sync), "
              f"{row['steps_to_target']} steps, {share:.0%} of generated tokens trained")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot_bench_rl(report, args.plot)


if __name__ == "__main__":
    main()

"""Real-model `rollouts bench-rl` reports of one or several device calls, merged and judged against issue 63's goals.

    python benchmarks/device/bench_rl_real_summary.py OUT1/bench_rl.json OUT2/logs/runs.jsonl ... \
        [--target 0.62] [--json merged.json] [--plot merged.png]

Each argument is a report (`bench_rl.json`) or a `runs.jsonl` (a call cut short keeps its finished runs there). A grid
split over calls has one target: the one given, else the first report's. Every run's time and steps to it are read
again from its curve (each call chose its own from its own measurement of the base, which varies a little). Per W and
mode: medians over the seeds of time to target, steps to target, final accuracy (and per task), the share of
generated tokens trained, the share of groups with all rewards equal, the sync stall, the trainer's step and the
generation tokens/s; then, at each W, each async mode (η <= 2) against sync: the goal is >= 2.5x sooner at W = 4,
steps within 15 % of sync's, a final accuracy no lower.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

SPEEDUP_GOAL = 2.5
STEPS_WITHIN = 0.15


def load(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any] | None]:
    """Every run (a run in several files once), the first report's `real` block and settings."""
    runs: dict[tuple[Any, ...], dict[str, Any]] = {}
    real = settings = None
    for path in paths:
        text = path.read_text()
        if path.suffix == ".jsonl":
            found = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            report = json.loads(text)
            found = report["runs"]
            real = real or report.get("real")
            settings = settings or report.get("settings")
        for run in found:
            runs[(run["workers"], run["mode"], run["seed"], run["wall_s"])] = run
    return list(runs.values()), real, settings


def reached(run: dict[str, Any], target: float) -> tuple[int, float] | None:
    """The first evaluated (step, seconds) whose held-out accuracy is at least `target`."""
    return next(((n, t) for n, t, acc in run["curve"] if acc >= target), None)


def median(values: list[float | None]) -> float | None:
    """The median, a run that never reached the target counting as later than any; None if the median did not."""
    if not values:
        return None
    middle = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(middle) else round(middle, 3)


def summarize(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w in sorted({r["workers"] for r in runs}):
        modes: dict[str, Any] = {}
        for name in dict.fromkeys(r["mode"] for r in runs if r["workers"] == w):
            rows = [r for r in runs if r["workers"] == w and r["mode"] == name]
            hits = [reached(r, target) for r in rows]
            tasks = list(rows[0].get("final_by_task", {}))
            modes[name] = {
                "seeds": sorted(r["seed"] for r in rows),
                "reached": sum(h is not None for h in hits),
                "time_to_target_s": median([h[1] if h else None for h in hits]),
                "steps_to_target": median([h[0] if h else None for h in hits]),
                "final_accuracy": median([r["final_eval_reward"] for r in rows]),
                "final_by_task": {t: median([r["final_by_task"][t] for r in rows]) for t in tasks},
                "trained_share": median([r["tokens"]["trained_share"] for r in rows]),
                "flat_group_share": median([r.get("flat_group_share") for r in rows]),
                "sync_stall_s": median([r["sync_stall_s_median"] for r in rows]),
                "trainer_step_s": median([r["trainer_step_s_median"] for r in rows]),
                "generation_tokens_per_s": median([r.get("generation_tokens_per_s") for r in rows]),
                "wall_s": median([r["wall_s"] for r in rows]),
            }
        sync = modes.get("sync")
        for name, row in modes.items():
            if sync is None or name == "sync":
                continue
            ttt, base_ttt = row["time_to_target_s"], sync["time_to_target_s"]
            steps, base_steps = row["steps_to_target"], sync["steps_to_target"]
            row["speedup"] = round(base_ttt / ttt, 3) if ttt and base_ttt else None
            row["steps_ratio"] = round(steps / base_steps, 3) if steps and base_steps else None
            if name.startswith("async:") and int(name.split(":")[1].split("@")[0]) <= 2:
                row["goals"] = {
                    f"speedup >= {SPEEDUP_GOAL}": None if row["speedup"] is None else row["speedup"] >= SPEEDUP_GOAL,
                    f"steps within {STEPS_WITHIN:.0%}": None
                    if row["steps_ratio"] is None
                    else row["steps_ratio"] <= 1 + STEPS_WITHIN,
                    "final accuracy no lower": None
                    if row["final_accuracy"] is None or sync["final_accuracy"] is None
                    else row["final_accuracy"] >= sync["final_accuracy"],
                }
        out[str(w)] = modes
    return out


def lines(summary: dict[str, Any], target: float, real: dict[str, Any] | None) -> list[str]:
    out = []
    if real is not None:
        base = f"base {real['base']['accuracy']} {real['base']['by_task']}"
        rule = f"the first report's rule: {real['target_rule']}"
        out.append(f"{Path(real['model']).name} on {','.join(real['tasks'])}: {base}, target {target} ({rule})")
        if real.get("direct"):
            out.append(f"direct engine call: {real['direct']['tokens_per_s']} tokens/s; through the pipeline (sync): "
                       f"{real.get('against_direct', {}).get('pipeline')}")  # fmt: skip
    else:
        out.append(f"target {target}")
    for w, modes in summary.items():
        for name, row in modes.items():
            extra = f", {row['speedup']}x sync, steps ratio {row['steps_ratio']}" if "speedup" in row else ""
            goals = f", goals {row['goals']}" if "goals" in row else ""
            out.append(
                f"W {w} {name}: to target {row['time_to_target_s']} s / {row['steps_to_target']} steps "
                f"(reached {row['reached']}/{len(row['seeds'])}){extra}, final {row['final_accuracy']} "
                f"{row['final_by_task']}, trained {row['trained_share']}, flat groups {row['flat_group_share']}, "
                f"stall {row['sync_stall_s']} s, trainer step {row['trainer_step_s']} s, "
                f"gen {row['generation_tokens_per_s']} tokens/s{goals}"
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--target", type=float, help="The common target (default: the first report's).")
    parser.add_argument("--json", type=Path, help="Write the merged runs and the summary here.")
    parser.add_argument("--plot", type=Path, help="Draw every run's curve (bench-rl's figure) here.")
    args = parser.parse_args(argv)
    runs, real, settings = load(args.reports)
    target = args.target if args.target is not None else (real or {}).get("target")
    if target is None or not runs:
        sys.exit("no target: give --target, or a bench_rl.json among the reports; and at least one run")
    summary = summarize(runs, target)
    print("\n".join(lines(summary, target, real)))
    merged = {"target": target, "real": real, "summary": summary, "runs": runs}
    if args.json is not None:
        args.json.write_text(json.dumps(merged, indent=1))
    if args.plot is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: the lab's figure
        from benchmarks.bench_rl import plot_bench_rl

        names = list(dict.fromkeys(r["mode"] for r in runs))
        seeds = sorted({r["seed"] for r in runs})
        report = {"settings": (settings or {}) | {"modes": [{"name": n} for n in names], "seeds": seeds,
                                                   "workers": sorted({r["workers"] for r in runs}), "target": target},
                  "runs": runs}  # fmt: skip
        if real is not None:
            rule = real["target_rule"] if args.target is None else "given"
            report["real"] = real | {"target": target, "target_rule": rule}
        plot_bench_rl(report, args.plot)


if __name__ == "__main__":
    main()

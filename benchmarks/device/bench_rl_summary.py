"""One line per mode of a `rollouts bench-rl` report, and one per run: what a device call prints.

python benchmarks/device/bench_rl_summary.py bench_rl.json

A report of several worker counts (`--workers 1,2,4`) has no `summary`: its lines are per W (`fleet.by_workers`), each
mode's with its measured step against the ideal of a perfectly spread fleet and its largest share of a step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def mode_lines(summary: dict[str, Any], prefix: str = "") -> list[str]:
    out = [f"{prefix}bound {summary['bound']}"]
    for name, row in summary["modes"].items():
        share = row["trained_share"]["median"] if row["trained_share"] else None
        stall = row["sync_stall_s_median"]["median"] if row["sync_stall_s_median"] else None
        fleet = ""
        if "ideal_step_s" in row:
            top = max(row["share_max"].values(), default=None)
            fleet = f", step {row['step_s']} s (ideal {row['ideal_step_s']} s: {row['measured_over_ideal']}x)"
            fleet += f", top share {top}"
        out.append(
            f"{prefix}{name}: to target {row['time_to_target_s']} s (range {row['time_to_target_s_range']}), "
            f"{row['speedup']}x sync, steps {row['steps_to_target']}, reached {row['reached']}/{row['seeds']}, "
            f"trained {share}, stall {stall} s, steps/s {row['steps_per_s']['median']}{fleet}"
        )
    return out


def lines(report: dict[str, Any]) -> list[str]:
    if "summary" in report:
        out = mode_lines(report["summary"])
    else:
        out = [line for w, s in report["fleet"]["by_workers"].items() for line in mode_lines(s, f"W {w} ")]
    for run in report["runs"]:
        fleet = f"W {run['workers']} " if "summary" not in report else ""
        out.append(
            f"  {fleet}{run['mode']} seed {run['seed']}: {run['time_to_target_s']} s, {run['steps_to_target']} steps, "
            f"final {run['final_eval_reward']}, wall {run['wall_s']} s, stall {run['sync_stall_s_median']} s, "
            f"idle trainer {run['trainer_idle']} generator {run['generator_idle']}, tokens {run['tokens']}"
        )
    return out


if __name__ == "__main__":
    print("\n".join(lines(json.loads(Path(sys.argv[1]).read_text()))))

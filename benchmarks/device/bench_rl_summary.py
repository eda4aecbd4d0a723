"""One line per mode of a `rollouts bench-rl` report, and one per run: what a device call prints.

python benchmarks/device/bench_rl_summary.py bench_rl.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def lines(report: dict[str, Any]) -> list[str]:
    out = [f"bound {report['summary']['bound']}"]
    for name, row in report["summary"]["modes"].items():
        share = row["trained_share"]["median"] if row["trained_share"] else None
        stall = row["sync_stall_s_median"]["median"] if row["sync_stall_s_median"] else None
        out.append(
            f"{name}: to target {row['time_to_target_s']} s (range {row['time_to_target_s_range']}), "
            f"{row['speedup']}x sync, steps {row['steps_to_target']}, reached {row['reached']}/{row['seeds']}, "
            f"trained {share}, stall {stall} s, steps/s {row['steps_per_s']['median']}"
        )
    for run in report["runs"]:
        out.append(
            f"  {run['mode']} seed {run['seed']}: {run['time_to_target_s']} s, {run['steps_to_target']} steps, "
            f"final {run['final_eval_reward']}, wall {run['wall_s']} s, stall {run['sync_stall_s_median']} s, "
            f"idle trainer {run['trainer_idle']} generator {run['generator_idle']}, tokens {run['tokens']}"
        )
    return out


if __name__ == "__main__":
    print("\n".join(lines(json.loads(Path(sys.argv[1]).read_text()))))

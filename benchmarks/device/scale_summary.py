"""One line per fleet size of a `rollouts scale` JSON: rate, pinger p99 (all, during syncs, between), stall, Redis CPU.

python benchmarks/device/scale_summary.py OUT/scale.json [LABEL]
"""

from __future__ import annotations

import json
import sys


def main(path: str, label: str = "") -> None:
    with open(path) as file:
        report = json.load(file)
    prefix = f"{label} " if label else ""
    for size in report["sizes"]:
        if "failed" in size:
            print(f"{prefix}{size['workers']}", "failed", size["failed"][-300:], flush=True)
            continue
        print(
            f"{prefix}{size['workers']}", "rps", size["rollouts_per_s"], "ping", size["publish_ms_ping"],
            "during", size["publish_ms_ping_during_syncs"], "between", size["publish_ms_ping_between_syncs"],
            "stall", size["sync_stall_s"], "redis", size["redis_cpu_cores"], flush=True,
        )  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:3])

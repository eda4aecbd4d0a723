"""`rollouts bench` on two checkouts, alternated, with the engine's steps timed in both of each run's processes.

    git worktree add /tmp/before HEAD~1
    python benchmarks/probes/bench_ab.py --before /tmp/before --pairs 6 --rounds 9          # torch; JSON on stdout
    python benchmarks/probes/bench_ab.py --before /tmp/before --pairs 2 -- --device cuda:0  # after --: for bench
    python benchmarks/probes/bench_ab.py --after-args=--engine-process --pairs 6             # one checkout, two ways

A run's wall-clock ratio (pipeline / engine called directly) moves by several per cent from run to run on a shared
machine, so a change of a few per cent needs many runs, alternated so that the machine's moods hit both sides. Each run
also loads `step_probe/` (beside this script) in its processes, which times every step of the torch engine (the wall
time and the thread's CPU): the engine in the worker process and the one called directly run the same steps, so
`step_wall` and `step_cpu` (worker / direct) say how much slower the engine itself ran behind the pipeline, and
`off_cpu` how long its thread stood off the CPU during its steps (the GIL held by the worker's other threads, or the
runqueue). Those move far less between runs than the ratio does. Prints one JSON line per run, then the medians per
side.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

PROBE = Path(__file__).resolve().parent / "step_probe"
WARMUP_STEPS = 300
"""Steps left out of the totals: round 0 (the warm-up round of `bench`) and the first steps of round 1."""


def run_bench(checkout: Path, rounds: int, extra: list[str]) -> dict[str, Any]:
    """One `rollouts bench` in `checkout` (its code, the worker's too), probed; its ratio and the steps' totals."""
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as probe:
        env = {
            **os.environ,
            "STEP_PROBE": probe,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH")])),
        }
        out = subprocess.run(
            [sys.executable, "-m", "rollouts", "bench", "--rounds", str(rounds), *extra],
            cwd=checkout, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        bench = json.loads(out.stdout)
        totals: dict[str, float] = {}
        for path in Path(probe).glob("*.json"):
            probed = json.loads(path.read_text())
            steps = probed["steps"][WARMUP_STEPS:] or probed["steps"]  # a short run: all of them
            if not steps:
                continue  # a process that ran no engine (the manager, a helper)
            argv = probed["argv"]
            side = "worker" if "worker" in argv or argv[0].endswith("engine_host.py") else "direct"
            totals[f"{side}_wall_s"] = sum(s[0] for s in steps)
            totals[f"{side}_cpu_s"] = sum(s[1] for s in steps)
    return {
        "ratio": bench["ratio"],
        "direct_rollouts_per_s": bench["direct"]["rollouts_per_s"],
        "pipeline_rollouts_per_s": bench["pipeline"]["rollouts_per_s"],
        "same_tokens": bench["same_tokens"],
        "step_wall": round(totals["worker_wall_s"] / totals["direct_wall_s"], 4),
        "step_cpu": round(totals["worker_cpu_s"] / totals["direct_cpu_s"], 4),
        "off_cpu_worker": round(1 - totals["worker_cpu_s"] / totals["worker_wall_s"], 4),
        "off_cpu_direct": round(1 - totals["direct_cpu_s"] / totals["direct_wall_s"], 4),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("ratio", "step_wall", "step_cpu", "off_cpu_worker", "off_cpu_direct")
    return {"runs": len(runs), **{k: round(statistics.median(r[k] for r in runs), 4) for k in keys},
            "ratios": [r["ratio"] for r in runs]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = Path(__file__).resolve().parents[2]
    parser.add_argument("--before", type=Path, default=here, help="checkout of the code to compare against")
    parser.add_argument("--after", type=Path, default=here, help="default: this one")
    parser.add_argument("--before-args", default="", help="more arguments for the before side's `rollouts bench`")
    parser.add_argument("--after-args", default="", help="more arguments for the after side's `rollouts bench`")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9, help="rounds of each `rollouts bench`")
    parser.add_argument("extra", nargs="*", help="after --: more arguments for `rollouts bench`")
    args = parser.parse_args()
    console = Console(stderr=True)
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with Progress(console=console) as progress:
        task = progress.add_task("bench runs", total=2 * args.pairs)
        for pair in range(args.pairs):
            for side in ("before", "after") if pair % 2 == 0 else ("after", "before"):
                extra = [*args.extra, *shlex.split(getattr(args, f"{side}_args"))]
                result = {"side": side, "pair": pair, **run_bench(getattr(args, side), args.rounds, extra)}
                runs[side].append(result)
                print(json.dumps(result), flush=True)
                progress.advance(task)
    print(json.dumps({side: summary(r) for side, r in runs.items()}))


if __name__ == "__main__":
    main()

"""`benchmarks/probes/bench_ab.py`: two checkouts benched alternately, the engine's steps timed in both processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ab_times_the_engine_steps_of_both_sides_in_both_checkouts() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "bench_ab.py"), "--before", str(ROOT), "--pairs", "1",
         "--rounds", "1", "--", "--prompts", "16", "--n", "2", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    *runs, medians = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(r["side"] for r in runs) == ["after", "before"]
    for run in runs:
        assert run["same_tokens"] and run["ratio"] > 0
        # Both engines were probed (the worker process too, through PYTHONPATH) and ran steps that took time.
        assert run["step_wall"] > 0 and run["step_cpu"] > 0 and 0 <= run["off_cpu_worker"] < 1
    assert medians["before"]["runs"] == medians["after"]["runs"] == 1

"""`benchmarks/probes/bench_wake.py`: a blocked fleet woken by one control entry, and by doorbells rung in waves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline.control import waves

ROOT = Path(__file__).resolve().parents[2]


def test_bench_wake_wakes_every_reader_both_ways_and_times_the_probe_throughout() -> None:
    readers = 300  # 11 waves of bells
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "bench_wake.py"), "--readers", str(readers), "--trials",
         "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    *trials, summary = [json.loads(line) for line in result.stdout.splitlines()]
    assert [t["mode"] for t in trials] == ["control", "bells", "bells", "control"]  # alternated
    for trial in trials:
        assert trial["answered"] == readers, trial  # every blocked reader got the command (or its ring)
        assert trial["pings"] > 0 and 0 < trial["first_answered_ms"] <= trial["last_answered_ms"]
        assert trial["probe_p50_ms"] <= trial["probe_p99_ms"] <= trial["probe_max_ms"]
    assert len(waves(readers)) == 11 and summary["readers"] == readers and summary["probe_max_ratio"] > 0

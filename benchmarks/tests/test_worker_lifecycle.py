"""`benchmarks/probes/worker_lifecycle.py`: how long a worker takes to serve and to exit once told to stop; and
`benchmarks/probes/gc_pauses.py`: how long the collector stops a worker while it serves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "probes" / "worker_lifecycle.py"


def test_worker_lifecycle_times_each_round_and_every_worker_exits_cleanly(tiny_model_dir: Path) -> None:
    args = ["--engines", "synthetic", "--rounds", "2", "--model", str(tiny_model_dir)]
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    rounds = report["rounds"]["synthetic"]
    assert len(rounds) == 2 and all(r["exit"] == 0 and r["start_s"] > 0 and r["stop_s"] > 0 for r in rounds), rounds
    assert set(report["median"]) == {"synthetic"}
    bad = subprocess.run([sys.executable, str(SCRIPT), "--engines", "tpu"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown engines ['tpu']" in bad.stderr and "Traceback" not in bad.stderr


def test_gc_pauses_reports_the_worker_process_collections_during_its_rounds() -> None:
    script = ROOT / "benchmarks" / "probes" / "gc_pauses.py"
    args = ["--engine", "torch", "--rounds", "2"]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["engine"] == "torch" and len(report["rounds_s"]) == 2 and min(report["rounds_s"]) > 0
    for generation in ("gen1", "gen2"):
        count, total_ms, longest_ms = report[generation]
        assert count >= 0 and total_ms >= longest_ms >= 0, report

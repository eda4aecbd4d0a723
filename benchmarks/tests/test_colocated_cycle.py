"""`benchmarks/probes/colocated_cycle.py`: the colocated loop (generate, sleep, train, publish) with a real worker
process, here on the CPU with the torch engine (on the GPU machines: vLLM's CUDA build, `run_colocated.sh`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "level",
    [
        pytest.param(0, marks=pytest.mark.long("the same round with a sleep between its steps: the [2] run")),
        2,
    ],
)
def test_each_round_generates_sleeps_trains_and_publishes_the_next_version(level: int) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "colocated_cycle.py"), "--rounds", "2", "--prompts", "2",
         "--n", "2", "--max-tokens", "16", "--level", str(level)],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout)
    rounds = report["rounds"]
    assert [r["version"] for r in rounds] == [1, 2]  # one publish a round, each acked by the worker
    for row in rounds:
        assert row["tokens"] > 0 and row["train_s"] > 0 and row["publish_s"] > 0
        assert row["free_before"] is None and row["publish_peak_mib"] is None  # the CPU: no device memory to count
        if level:
            assert row["status_asleep"] == "asleep" and row["awake"] == [] and row["sleep_s"] > 0
        else:
            assert "sleep_s" not in row
    assert report["medians"]["cycle_s"] > 0

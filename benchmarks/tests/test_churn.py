"""`rollouts-bench churn`, short: notices, kills, joins and leaves under a backlog lose nothing, deliver nothing
twice, and every notice's worker exits inside its deadline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.long(
    "the paths it drives: tests/consumers/test_departure.py (notices, drain), tests/consumers/test_fleet.py (kills)"
)
def test_a_short_churn_loses_nothing_delivers_nothing_twice_and_every_notice_exits_inside_its_deadline() -> None:
    args = ["--duration-s", "10", "--workers", "3", "--min-workers", "2", "--max-workers", "4", "--every-s", "2",
            "--grace-s", "3", "--tokens", "60", "--steps-per-s", "30", "--backlog", "24", "--seed", "1"]  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "benchmarks", "churn", *args], capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    report = json.loads(result.stdout)
    churn, steady = report["churn"], report["steady"]
    assert report["ok"] and churn["lost"] == steady["lost"] == 0 and churn["duplicates"] == steady["duplicates"] == 0
    assert sum(churn["events"].values()) >= 3 and not any(steady["events"].values())
    assert churn["over_deadline"] == 0
    assert churn["join_to_serving_s"]["n"] >= 3 and churn["tokens_per_s"] > 0 and report["throughput_ratio"] > 0

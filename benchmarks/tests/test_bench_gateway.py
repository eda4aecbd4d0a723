"""`rollouts bench-gateway` as a person runs it: its own Redis, workers and gateways, one JSON report on stdout.

The synthetic engine keeps it fast (no model to run); what is checked is the report's shape and that every
turn of every session was answered under every placement policy and on both sides of the overhead comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SESSIONS, TURNS, ROUNDS = 3, 3, 1


def test_bench_gateway_reports_every_policy_and_the_overhead(tmp_path: Path) -> None:
    plot = tmp_path / "bench-gateway.png"
    args = ["--engine", "synthetic", "--sessions", str(SESSIONS), "--turns", str(TURNS), "--rounds", str(ROUNDS)]
    args += ["--workers", "2", "--max-tokens", "8", "--plot", str(plot)]
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "bench-gateway", *args], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    answered = ROUNDS * SESSIONS * TURNS
    assert (report["engine"], report["workers"], report["sessions"], report["turns"]) == ("synthetic", 2, 3, 3)
    assert report["engine_reports_cache"] is False
    assert set(report["placement"]) == {"sticky", "hash", "random"}
    for policy, row in report["placement"].items():
        assert row["turns_answered"] == answered, policy
        assert sum(row["turns_per_worker"].values()) == answered, policy
        assert set(row["turns_per_worker"]) <= {"bench-w0", "bench-w1"}, policy
        assert [b["turn"] for b in row["by_turn"]] == [1, 2, 3]
        # The history grows: every turn's prompt is longer than the one before.
        lengths = [b["prompt_tokens"] for b in row["by_turn"]]
        assert lengths == sorted(lengths) and lengths[0] < lengths[-1], lengths
        assert 0 < row["turn_s"]["median"] <= row["turn_s"]["p90"] and row["wall_s"] > 0
        assert row["hit_rate"] == 0.0  # the synthetic engine has no prefix cache to report
        assert row["reply_tokens"] == answered * 8  # synthetic replies run to max_tokens
    assert report["placement"]["sticky"]["moves"] == 0 and report["placement"]["hash"]["moves"] == 0
    # Sticky least-loaded spreads the sessions over both workers.
    assert len(report["placement"]["sticky"]["turns_per_worker"]) == 2

    overhead = report["overhead"]
    assert overhead["alternated"] is True and overhead["workers"] == 1
    assert overhead["gateway"]["turns_answered"] == overhead["direct"]["turns_answered"] == answered
    assert overhead["gateway"]["turns_per_worker"] == {"bench-w0": answered}
    assert overhead["same_tokens"] is True  # seeded: the engine called directly makes the gateway's replies
    assert overhead["ratio"] > 0
    assert overhead["gateway_overhead_pct"] == round(100 * (1 - overhead["ratio"]), 2)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

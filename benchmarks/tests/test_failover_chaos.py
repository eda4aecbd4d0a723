"""`rollouts failover-chaos` as a person runs it, short: a primary, two replicas and three Sentinels, synthetic workers,
the manager and the chaos trainer given only the Sentinels in the `replica` mode, and the primary failed by each kind
(kill -9, SIGSTOP past down-after, a crash that loses its AOF's tail, and where the run may make network namespaces, a
partition of the primary and one worker from the rest). The long run (over 20 failovers a mode, both
modes) is in benchmarks/results; this one checks in about a minute that nothing acknowledged was lost, nothing trained
twice and no version reused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import netns
from benchmarks.failover_chaos import DEFAULT_KINDS, KINDS


def test_a_short_failover_run_in_the_replica_mode_loses_nothing_acknowledged(tmp_path: Path) -> None:
    """Every kind of fault once, a partition too where this machine lets the run make network namespaces (root)."""
    kinds = KINDS if netns.why_not() is None else DEFAULT_KINDS
    args = ["--modes", "replica", "--duration-s", str(8 * len(kinds)), "--every-s", "5", "--workers", "2"]
    args += ["--kinds", ",".join(kinds), "--drain-timeout-s", "150"]
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "failover-chaos", *args, "--keep-logs", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = json.loads(result.stdout)["runs"]
    assert run["mode"] == "replica" and set(run["faults"]) == set(kinds)
    assert run["failovers"] == sum(run["faults"].values()) >= 3
    assert run["acknowledged_lost"] == [] and run["groups_trained"] == run["prompts_submitted"] > 0
    assert run["duplicates_trained"] == 0 and run["versions_reused"] == [] and run["syncs"] >= 2
    assert run["unrecovered"] == 0 and run["recovery_s"]["max"] < 30
    goals = run["goals"]
    assert goals["none_lost"] and goals["no_duplicate_trained"] and goals["no_version_reused"]


def test_failover_chaos_refuses_a_mode_or_a_fault_it_does_not_know() -> None:
    for args, says in ((["--modes", "fsync"], "unknown durability modes"), (["--kinds", "meteor"], "unknown fault")):
        result = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "failover-chaos", *args], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2 and says in result.stderr, result.stderr

"""`rollouts chaos` as a person runs it: its own Redis with appendonly everysec, synthetic workers, the manager,
the scorer and a trainer, each a process, and every kind of fault injected at least once: kill -9 of workers, Redis,
the scorer, the trainer and the manager mid-sync, SIGSTOP of a worker, connections cut by a proxy. The full run
(hundreds of faults) is in the README; this one checks in about a minute that nothing was lost or handed over twice,
that the staleness bound held and that every fault was recovered from. The fixes it led to are tested on their own
in tests/system/test_chaos.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_a_short_chaos_run_loses_nothing_and_hands_nothing_over_twice(tmp_path: Path) -> None:
    plot = tmp_path / "chaos.png"
    # 25 s: after the 5 s warm-up one fault every 2 s, the first seven one of each kind, then three drawn by weight
    args = ["--duration-s", "25", "--workers", "4", "--every-s", "2", "--seed", "1", "--plot", str(plot)]
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "chaos", *args, "--keep-logs", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)

    assert all(count >= 1 for count in report["faults"].values()), report["faults"]
    assert report["lost_samples"] == 0 and report["lost_prompts"] == []
    assert report["duplicates"] == 0
    assert report["groups_not_whole"] == report["spans_not_covering"] == report["over_staleness_bound"] == 0
    assert report["groups_unscored"] == 0  # every prompt names a reward: each trained group was scored
    assert report["max_staleness_seen"] <= 4
    assert (
        report["trained_samples"] + report["stale_samples"] + sum(report["dead_letters"].values()) * 4
        == (report["samples"])
    )
    assert report["trained_samples"] > 0 and report["syncs"]["done"] >= 3
    # Restarted as a supervisor would: the trainer and the manager after their kills, workers after theirs.
    assert report["starts"]["trainer"] >= 2 and report["starts"]["manager"] >= 2 and report["starts"]["scorer"] >= 2
    for kind in ("redis-kill", "trainer-kill", "manager-kill", "scorer-kill", "proxy-cut"):
        assert report["recovery_s"][kind]["n"] >= 1, kind
    assert report["recovery_s"]["all"]["max"] < 60
    assert plot.stat().st_size > 10_000


def test_with_poison_every_n_chunks_the_first_prompt_of_every_nth_chunk_is_poison() -> None:
    """`--poison-every 3`: prompts c2-0, c5-0, ... hold the poison token; `0`: none."""
    from benchmarks.chaos_trainer import is_poison

    assert [c for c in range(9) if is_poison(c, 0, 3)] == [2, 5, 8]
    assert not any(is_poison(2, i, 3) for i in range(1, 16)), "only the first prompt of a chunk"
    assert not any(is_poison(c, 0, 0) for c in range(9)), "0: no poison"

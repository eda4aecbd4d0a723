"""`rollouts soak`, short, as a person runs it: its own Redis and synthetic workers, one JSON report on stdout.

The full soak (a million rollouts) is for the README; this one checks, in well under a minute, that the report
says what it should: every rollout arrived exactly once, Redis memory stayed small, the streams were trimmed
behind the consumer groups, throughput never fell to zero, every process's RSS was read, the PNG was drawn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROLLOUTS, N = 20_000, 4


def test_a_short_soak_receives_everything_once_with_bounded_memory(tmp_path: Path) -> None:
    plot = tmp_path / "soak.png"
    # 40 steps/s x 256 requests of 16 tokens: at most 1,280 rollouts/s from two workers, so the run lasts past the
    # 10 s after which the workers trim `prompts` and the trainer client trims `rollouts`.
    args = ["--rollouts", str(ROLLOUTS), "--n", str(N), "--tokens", "16", "--workers", "2", "--steps-per-s", "40"]
    args += ["--sample-s", "0.25", "--plot", str(plot), "--dedupe-ttl-s", "5"]
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "soak", *args], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)

    assert report["rollouts"] == ROLLOUTS and report["prompts"] == ROLLOUTS // N
    delivery = report["delivery"]
    assert delivery["exactly_once"] is True
    assert delivery["received"] == ROLLOUTS and delivery["groups"] == ROLLOUTS // N
    assert delivery["duplicates"] == delivery["dead"] == delivery["groups_repeated"] == 0
    assert delivery["groups_malformed"] == 0

    memory = report["redis_memory"]
    assert 0 < memory["min_mb"] <= memory["median_mb"] <= memory["max_mb"] < 100
    assert memory["streams_max_mb"] < 50
    # What the memory is made of at the end, by key kind (`{ns}:KIND...`): every key is counted once.
    assert {"prompts", "rollouts"} <= set(memory["keys_by_kind"])
    assert sum(memory["keys_by_kind"].values()) <= memory["keys_last"]  # markers may expire between the two reads
    # The workers' dedupe lives --dedupe-ttl-s (5 s here), in time buckets of 1 s: a handful of hashes, not a key
    # per rollout, and those of the first seconds are gone.
    assert 0 < memory["keys_by_kind"].get("published", 0) <= 10

    streams = report["streams"]
    assert streams["partials"]["max"] == 0  # no weight sync: nothing is interrupted
    # Trimmed behind the groups: neither stream ever held everything that went through it.
    assert streams["prompts"]["max"] < ROLLOUTS // N
    assert streams["rollouts"]["max"] < ROLLOUTS

    throughput = report["throughput"]["quarters_median_per_s"]
    assert len(throughput) == 4 and all(rate > 0 for rate in throughput), throughput
    assert report["rollouts_per_s"] > 0 and report["samples"] >= 8

    rss = report["rss_mb"]
    assert set(rss) == {"trainer", "redis-server", "soak-w0", "soak-w1"}
    assert all(row["max"] > 0 for row in rss.values())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

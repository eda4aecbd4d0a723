"""`rollouts-bench fleet` (also `rollouts fleet`) as a person runs it, tiny: a step spread over two synthetic worker
processes against one worker's, and one takeover of a killed worker's prompts. What is checked is the report's
shape and that its numbers are sane (every sample served once, a share per worker, times within the run's
bounds, nothing lost or duplicated), not the goals: the full run is in benchmarks/results/2026-12-01-fleet.md."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.test_cli import assert_clean_error, rollouts


def test_fleet_reports_the_spread_of_a_step_and_a_takeover(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = ["--workers", "2", "--steps", "2", "--warmup-steps", "0", "--max-tokens", "20", "--rounds", "1"]
    args += ["--signals", "kill", "--live", "1", "--victim-prompts", "4", "--logs", str(logs)]
    result = rollouts("fleet", *args, timeout=240)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: a goal missed on a loaded machine
    report = json.loads(result.stdout)
    assert "fleet [" in result.stderr and "spread W 2: step 2/2" in result.stderr  # progress lines, not a terminal
    assert report["ok"] == (result.returncode == 0)

    spread = report["spread"]
    assert set(spread["fleets"]) == {"1", "2"}
    assert spread["settings"]["step_samples"] == 64
    for size, fleet in spread["fleets"].items():
        assert len(fleet["steps"]) == 2
        for step in fleet["steps"]:
            assert step["samples"] == 64 and sum(step["served"].values()) == 64
            assert len(step["served"]) == int(size) and step["max_served"] == max(step["served"].values())
            assert step["wall_s"] > 0
        assert fleet["duplicates"] == 0 and fleet["dead_letters"] == 0
    one, two = spread["fleets"]["1"], spread["fleets"]["2"]
    assert one["max_served_max"] == 64 and one["measured_over_ideal"] == 1.0
    # One engine of 8 runs 64 samples of 20 tokens at 200 a second in 8 waves (0.8 s); two share them.
    assert one["median_step_s"] >= one["engine_bound_step_s"] == 0.8
    assert two["ideal_step_s"] == round(one["median_step_s"] / 2, 4)
    assert two["workers_serving_min"] == 2 and two["max_served_max"] < 64
    assert 0.5 < two["measured_over_ideal"] < 3
    assert [row["workers"] for row in spread["table"]] == [1, 2]

    takeover = report["takeover"]
    assert set(takeover["signals"]) == {"kill"}
    kill = takeover["signals"]["kill"]
    assert kill["not_taken_over"] == 0 and kill["lost"] == 0 and kill["duplicates"] == 0
    (round_,) = kill["rounds"]
    assert 0 < round_["first_s"] <= round_["last_s"] < 30
    assert sum(round_["claimed_by"].values()) == 4 and set(round_["claimed_by"]) == {"live0"}
    assert kill["first_s"]["median"] == round_["first_s"]
    assert set(takeover["goals"]) == {"kill_median_first_le_3s", "none_lost_or_duplicated"}
    assert report["code"]["pipeline/streams/work.py"] and report["machine"]["cpus"] >= 1
    assert any(logs.glob("takeover-kill-0-victim.log"))


def test_fleet_refuses_a_part_it_does_not_know() -> None:
    assert_clean_error(rollouts("fleet", "--part", "everything"), "--part must be spread, takeover or all")

"""`examples/step_probe/rounds.py`: a bench round split into the engine's span and the time before and after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def engine_file(path: Path, parent: str, round_starts: list[float]) -> None:
    """Two 0.1 s steps a round, each round at its start (the first is the bench's warm-up)."""
    lines = [json.dumps({"parent": parent})]
    for start in round_starts:
        lines += [json.dumps([start, 0.1, 0.08, 4, 40]), json.dumps([start + 0.1, 0.1, 0.08, 0, 4])]
    path.write_text("\n".join(lines) + "\n")


def split_rounds(probe_dir: Path, bench: dict[str, Any]) -> dict[str, Any]:
    """`rounds.py` run as a person runs it, on the probe's files in `probe_dir` and the bench's JSON `bench`."""
    (probe_dir / "bench.json").write_text(json.dumps(bench))
    script = ROOT / "examples" / "step_probe" / "rounds.py"
    result = subprocess.run(
        [sys.executable, str(script), str(probe_dir), str(probe_dir / "bench.json")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_rounds_splits_each_side_into_the_engines_span_and_the_time_before_and_after_it(tmp_path: Path) -> None:
    engine_file(tmp_path / "101.jsonl", "python -m pipeline.cli bench --engine vllm --rounds 2", [1.0, 10.0, 30.0])
    worker = "python -m pipeline.cli worker --ns bench --engine vllm"
    engine_file(tmp_path / "202.jsonl", worker, [2.0, 20.0, 40.0])
    # The bench's rounds on the steps' clock: direct 0.01 s before its first step and 0.01 s after its last,
    # pipeline 0.03 s before and 0.05 s after.
    rounds = [["direct", 0.99, 1.21], ["pipeline", 1.97, 2.25], ["direct", 9.99, 10.21], ["pipeline", 19.97, 20.25]]
    rounds += [["direct", 29.99, 30.21], ["pipeline", 39.97, 40.25]]
    rounds = [[*r, 1000.0] for r in rounds]  # wall clock = perf_counter + 1000
    # The client's reads that made groups whole, in wall time with their samples' latest `finished`: the last of a
    # round came 0.01 s after the engine's last step (at 1020.2) in the worker, 0.03 s later to the client, and the
    # round ended 0.01 s after that.
    for end in (1020.2, 1040.2):
        rounds += [["take", end - 0.1, end - 0.15], ["take", end + 0.04, end + 0.01]]
    (tmp_path / "bench-rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    bench = {"ratio": 0.786, "direct": {"seconds": [0.22, 0.22]}, "pipeline": {"seconds": [0.28, 0.28]}}
    split = split_rounds(tmp_path, bench)
    direct, pipeline = split["direct"], split["pipeline"]
    assert direct["engine_span_s"] == pipeline["engine_span_s"] == pytest.approx(0.2)
    assert direct["steps"] == pipeline["steps"] == 2
    assert (direct["head_s"], direct["tail_s"], direct["outside_engine_s"]) == pytest.approx((0.01, 0.01, 0.02))
    assert (pipeline["head_s"], pipeline["tail_s"], pipeline["outside_engine_s"]) == pytest.approx((0.03, 0.05, 0.08))
    parts = (pipeline["tail_worker_s"], pipeline["tail_delivery_s"], pipeline["tail_return_s"])
    assert parts == pytest.approx((0.01, 0.03, 0.01))
    assert "tail_worker_s" not in direct  # no client reads in its rounds
    assert split["span_ratio"] == 1.0
    assert split["outside_extra_pct"] == pytest.approx(100 * 0.06 / 0.22, abs=0.01)


def test_with_one_engine_each_run_of_steps_goes_to_the_side_whose_round_it_began_in(tmp_path: Path) -> None:
    # `--one-engine`: one engine file, both sides' rounds in it, told apart only by the bench's rounds.
    engine_file(tmp_path / "101.jsonl", "python -m pipeline.cli bench --one-engine", [1.0, 2.0, 10.0, 20.0])
    rounds = [["direct", 0.99, 1.21], ["pipeline", 1.97, 2.25], ["pipeline", 9.97, 10.25], ["direct", 19.99, 20.21]]
    (tmp_path / "bench-rounds.jsonl").write_text("".join(json.dumps([*r, 1000.0]) + "\n" for r in rounds))
    bench = {"ratio": 0.786, "one_engine": True, "direct": {"seconds": [0.22]}, "pipeline": {"seconds": [0.28]}}
    split = split_rounds(tmp_path, bench)
    direct, pipeline = split["direct"], split["pipeline"]
    assert direct["engine_span_s"] == pipeline["engine_span_s"] == pytest.approx(0.2)
    # The measured round of each side is its last: direct's from 19.99, the pipeline's from 9.97.
    assert (direct["head_s"], direct["tail_s"]) == pytest.approx((0.01, 0.01))
    assert (pipeline["head_s"], pipeline["tail_s"]) == pytest.approx((0.03, 0.05))
    assert split["outside_extra_pct"] == pytest.approx(100 * 0.06 / 0.22, abs=0.01)

"""`benchmarks/probes/step_probe/rounds.py`: a bench round split into the engine's span and the time around it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE_DIR = ROOT / "benchmarks" / "probes" / "step_probe"


def engine_file(path: Path, parent: str, round_starts: list[float]) -> None:
    """Two 0.1 s steps a round, each round at its start (the first is the bench's warm-up)."""
    lines = [json.dumps({"parent": parent})]
    for start in round_starts:
        lines += [json.dumps([start, 0.1, 0.08, 4, 40]), json.dumps([start + 0.1, 0.1, 0.08, 0, 4])]
    path.write_text("\n".join(lines) + "\n")


def split_rounds(probe_dir: Path, bench: dict[str, Any]) -> dict[str, Any]:
    """`rounds.py` run as a person runs it, on the probe's files in `probe_dir` and the bench's JSON `bench`."""
    (probe_dir / "bench.json").write_text(json.dumps(bench))
    script = ROOT / "benchmarks" / "probes" / "step_probe" / "rounds.py"
    result = subprocess.run(
        [sys.executable, str(script), str(probe_dir), str(probe_dir / "bench.json")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_rounds_splits_each_side_into_the_engines_span_and_the_time_before_and_after_it(tmp_path: Path) -> None:
    engine_file(tmp_path / "101.jsonl", "python -m rollouts bench --engine vllm --rounds 2", [1.0, 10.0, 30.0])
    worker = "python -m rollouts worker --ns bench --engine vllm"
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
    engine_file(tmp_path / "101.jsonl", "python -m rollouts bench --one-engine", [1.0, 2.0, 10.0, 20.0])
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


def test_paired_splits_each_side_of_a_round_into_head_and_tail_and_the_pipelines_head_into_parts(
    tmp_path: Path,
) -> None:
    # `--paired`: both sides in one round, on one engine. Two rounds: the first is the bench's warm-up (skipped).
    # Round 2, the pipeline first, from 20.0 (wall clock = perf_counter + 1000): its submit returns at 20.003, the
    # worker's read at 20.002, its two requests are called at 20.004 and 20.005 and return at 21.000 and 21.001;
    # the direct side starts at 20.006, calls at 20.007 and 20.0075, gets its results at 21.0 and 21.0005 and ends
    # at 21.001. The client's last read makes the last group whole at 21.004 (wall 1021.004), its samples finished at
    # 21.0012; the pipeline side ends at 21.006.
    lines: list[list[Any]] = []
    for base in (10.0, 20.0):
        lines += [["pipeline", base, base + 1.006, 1000.0], ["direct", base + 0.006, base + 1.001, 1000.0]]
        lines += [["submitted", base + 0.003], ["read", base + 0.002, 2]]
        lines += [
            ["request", "pipeline", base + 0.004, base + 1.0],
            ["request", "pipeline", base + 0.005, base + 1.001],
        ]
        lines += [["request", "direct", base + 0.007, base + 1.0], ["request", "direct", base + 0.0075, base + 1.0005]]
        lines += [["take", 1000 + base + 0.5, 1000 + base + 0.4], ["take", 1000 + base + 1.004, 1000 + base + 1.0012]]
    (tmp_path / "bench-rounds.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "bench.json").write_text(json.dumps({"paired": True, "ratio": 0.99, "direct": {"seconds": [0.995]}}))
    script = PROBE_DIR / "paired.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(tmp_path / "bench.json")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    split = json.loads(result.stdout)
    assert set(split) == {"all", "pipeline_first", "ratio"}  # no round had the direct side first
    got = split["pipeline_first"]
    assert got["rounds"] == 1 and got["requests_pipeline"] == got["requests_direct"] == 2
    expected = {
        "pipeline_head_ms": 5.0, "direct_head_ms": 1.5, "head_extra_ms": 3.5,
        "pipeline_tail_ms": 5.0, "direct_tail_ms": 0.5, "tail_extra_ms": 4.5,
        "submit_ms": 3.0, "read_ms": 2.0, "to_engine_ms": 3.0,
        "last_in_gap_ms": -2.5, "last_out_gap_ms": 0.5,
        "tail_worker_ms": 0.2, "tail_delivery_ms": 2.8, "tail_return_ms": 2.0,
    }  # fmt: skip
    assert {key: got[key] for key in expected} == pytest.approx(expected, abs=1e-3)


def test_paired_timeline_lists_a_rounds_tail_batch_by_batch(tmp_path: Path) -> None:
    # One measured round (the first is the warm-up): the pipeline's two results return at 21.000 and 21.001 (both
    # within 5 ms of the last: the burst), its publisher sends one batch of 2 prompts at 21.0015 (answered at
    # 21.0025), the trainer's read returns 4 rollouts at 21.003, a collection of 0.5 ms starts at 21.0032, the read
    # that makes the groups whole is done at 21.004 (wall 1021.004) and the side ends at 21.006.
    lines: list[list[Any]] = []
    for base in (10.0, 20.0):
        lines += [["pipeline", base, base + 1.006, 1000.0], ["direct", base + 0.006, base + 1.001, 1000.0]]
        lines += [["request", "pipeline", base + 0.004, base + 1.0]]
        lines += [["request", "pipeline", base + 0.005, base + 1.001]]
        lines += [["request", "direct", base + 0.007, base + 1.0]]
        lines += [["publish", base + 1.0015, base + 1.0025, 2], ["rread", base + 0.9, base + 1.003, 4]]
        lines += [["gc", 77, 1, base + 1.0032, 0.0005], ["take", 1000 + base + 1.004, 1000 + base + 1.0012]]
    (tmp_path / "bench-rounds.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "bench.json").write_text(json.dumps({"paired": True, "ratio": 0.99, "direct": {"seconds": [0.995]}}))
    result = subprocess.run(
        [sys.executable, str(PROBE_DIR / "paired.py"), str(tmp_path), str(tmp_path / "bench.json"), "--timeline", "5"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "-101.00 rr> +0.00 2 ended +0.50 pub2> +1.50 <pub2 +2.00 <rr4 +2.20 gc 77:1:0.50 +3.00 take +5.00 END"
    ]


def test_paired_refuses_a_run_that_was_not_paired(tmp_path: Path) -> None:
    (tmp_path / "bench.json").write_text(json.dumps({"ratio": 0.99}))
    script = PROBE_DIR / "paired.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(tmp_path / "bench.json")], capture_output=True, text=True
    )
    assert result.returncode == 1 and "not a `rollouts bench --paired` run" in result.stderr


def test_the_probe_records_a_paired_synthetic_bench_that_paired_splits(tmp_path: Path) -> None:
    # The probe in the bench's processes (the bench with its worker, the trainer), on the synthetic engine: every
    # request of both sides is recorded, and each side's round splits into parts that add up to it.
    probe = tmp_path / "probe"
    probe.mkdir()
    env = os.environ | {"STEP_PROBE": str(probe), "PYTHONPATH": os.pathsep.join([str(PROBE_DIR), str(ROOT)])}
    bench = subprocess.run(
        [sys.executable, "-m", "rollouts", "bench", "--engine", "synthetic", "--paired", "--rounds", "2",
         "--prompts", "8", "--n", "2", "--max-tokens", "8", "--engine-args", '{"steps_per_s": 100}'],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr[-2000:]
    (tmp_path / "bench.json").write_text(bench.stdout)
    result = subprocess.run(
        [sys.executable, str(PROBE_DIR / "paired.py"), str(probe), str(tmp_path / "bench.json")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    split = json.loads(result.stdout)
    got = split["all"]
    assert got["rounds"] == 2 and got["requests_pipeline"] == got["requests_direct"] == 4 * 2
    for side in ("pipeline", "direct"):  # 8 tokens at 100 a second: 80 ms between the head and the tail
        assert 1000 * got[f"{side}_s"] == pytest.approx(got[f"{side}_head_ms"] + 80 + got[f"{side}_tail_ms"], abs=15)
    assert 0 < got["read_ms"] < got["pipeline_head_ms"] and got["submit_ms"] > 0
    timeline = subprocess.run(
        [sys.executable, str(PROBE_DIR / "paired.py"), str(probe), str(tmp_path / "bench.json"), "--timeline", "2"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert timeline.returncode == 0, timeline.stderr
    tails = timeline.stdout.splitlines()
    assert len(tails) == 2  # each round's tail: its burst, the publisher's batches, the trainer's reads, its end
    for tail in tails:
        assert "+0.00 " in tail and " ended" in tail and "pub" in tail and "<rr" in tail and " END" in tail
        # After the round's end only publishes may return: on a loaded machine the worker's publish call can come back
        # after the trainer has read what it wrote (the entry is in Redis before the reply reaches the worker).
        after = tail.partition(" END")[2].split()[1::2]
        assert all(event.startswith("<pub") for event in after), tail


@pytest.mark.parametrize("run", ["run1", "run2", "run3", "run4"])
def test_the_stored_device_runs_read_again_as_the_readme_says(tmp_path: Path, run: str) -> None:
    # benchmarks/results/device_runs/2026-11-28-paired: the probe's files, gunzipped, give the `paired.py` JSON stored
    # beside them (the README's figures), and the ratio is the bench's own.
    import gzip

    stored = ROOT / "benchmarks" / "results" / "device_runs" / "2026-11-28-paired" / run
    for packed in stored.glob("*.gz"):
        (tmp_path / packed.stem).write_bytes(gzip.decompress(packed.read_bytes()))
    result = subprocess.run(
        [sys.executable, str(PROBE_DIR / "paired.py"), str(tmp_path), str(stored / "bench.json")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads((stored / "paired.json").read_text())
    assert json.loads(result.stdout)["ratio"] == json.loads((stored / "bench.json").read_text())["ratio"]

"""`rollouts bench`: the engine called directly against the same engine behind the whole pipeline, on the tiny
model; and the pieces of its paired mode."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench import SharedEngine, balanced_ratio, room_for_both
from benchmarks.tests.test_lab_cli_errors import assert_refused_in_one_line, lab_here
from consumers.engines.synthetic_engine import SyntheticEngine
from pipeline.local import RedisServer
from rollouts.engine_spec import EngineSpec
from tests.cli.test_cli import rollouts


def small_bench(model: Path, *flags: str) -> dict[str, Any]:
    """`rollouts bench` on the tiny model, 8 prompts of 2 samples of 32 tokens a round: its JSON report."""
    result = rollouts(
        "bench", "--model", str(model), "--prompts", "8", "--n", "2", "--max-tokens", "32", *flags, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_bench_compares_both_sides_on_the_same_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    report = small_bench(tiny_model_dir, "--rounds", "1", "--plot", str(plot))
    assert report["same_tokens"] is True
    assert report["direct"]["rollouts_per_s"] > 0 and report["pipeline"]["rollouts_per_s"] > 0
    assert report["ratio"] == pytest.approx(report["direct"]["seconds"][0] / report["pipeline"]["seconds"][0], rel=0.05)
    # The CPU goes to the process that ran the engine: this one on the direct side, the worker on the pipeline side.
    direct, pipeline = report["direct"]["cpu_s"], report["pipeline"]["cpu_s"]
    assert pipeline["worker"] > direct["worker"] and direct["bench"] > pipeline["bench"], (direct, pipeline)
    own = [cpu["bench"] + cpu["worker"] + cpu["redis"] for cpu in (direct, pipeline)]  # the engine's processes left out
    assert report["pipeline_extra_cpu_s"] == pytest.approx(own[1] - own[0], abs=0.005)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_with_one_engine_serves_both_sides_from_it_and_the_trainer_from_a_process_of_its_own(
    tiny_model_dir: Path,
) -> None:
    report = small_bench(tiny_model_dir, "--rounds", "2", "--one-engine")
    assert report["one_engine"] is True and report["same_tokens"] is True
    assert len(report["pipeline"]["seconds"]) == 2 and report["pipeline"]["rollouts_per_s"] > 0
    # One engine (torch: in this process), run by this process on both sides; the trainer works on the pipeline side.
    direct, pipeline = report["direct"]["cpu_s"], report["pipeline"]["cpu_s"]
    assert set(direct) == {"bench", "engine", "trainer", "redis", "total"}
    assert direct["trainer"] <= pipeline["trainer"] and min(direct["bench"], pipeline["bench"]) > 0, (direct, pipeline)
    own = [cpu["bench"] + cpu["trainer"] + cpu["redis"] for cpu in (direct, pipeline)]
    assert report["pipeline_extra_cpu_s"] == pytest.approx(own[1] - own[0], abs=0.01)


def test_bench_paired_runs_both_sides_in_the_same_engine_steps_and_balances_which_goes_first(
    tiny_model_dir: Path,
) -> None:
    report = small_bench(tiny_model_dir, "--rounds", "2", "--paired")
    assert report["paired"] is True and report["one_engine"] is True and report["same_tokens"] is True
    assert report["prompts_per_side"] == 4 and report["options"]["max_batch"] >= 16  # room for both sides' samples
    assert len(report["direct"]["seconds"]) == len(report["pipeline"]["seconds"]) == 2
    # Round 1 the pipeline went first, round 2 the direct side; the ratio is the two kinds' geometric mean.
    by_first = report["ratio_by_first"]
    assert by_first == {"pipeline": report["ratios"][0], "direct": report["ratios"][1]}
    assert report["ratio"] == pytest.approx((by_first["pipeline"] * by_first["direct"]) ** 0.5, abs=1e-4)
    # Both sides ran in the same seconds: the CPU is the round's, by role, not a side's.
    assert set(report["cpu_s"]) == {"bench", "engine", "trainer", "redis", "total"} and report["cpu_s"]["total"] > 0
    assert "cpu_s" not in report["direct"] and report["pipeline_extra_cpu_s"] is None
    # In this process (`lab_here`): the lab's command line itself is checked in test_lab_cli_errors.py.
    assert_refused_in_one_line(lab_here("bench", "--paired", "--prompts", "1"), "--paired splits a round's prompts")


def test_the_paired_ratio_cancels_the_advantage_of_going_second() -> None:
    """The side that goes second finishes ~1 % sooner than it would have first (measured on vLLM): with an order
    effect `o` and a pipeline cost `p`, the rounds alternate between two ratios around `1 / (1 + p)`."""
    o, p = 0.012, 0.008
    pipeline_first, direct_first = (1 - o) / (1 + p), 1 / ((1 - o) * (1 + p))
    noise = [0.998, 1.003, 1.0, 0.997, 1.002, 1.001]
    ratios = [(pipeline_first if i % 2 == 0 else direct_first) * e for i, e in enumerate(noise * 5)]
    by_first, ratio = balanced_ratio(ratios)
    assert by_first["pipeline"] < 1 / (1 + p) < by_first["direct"]
    assert ratio == pytest.approx(1 / (1 + p), abs=0.002)


def test_paired_gives_the_engine_room_for_both_sides_or_says_why_it_cannot() -> None:
    vllm = EngineSpec(kind="vllm", model=Path("m"))
    assert room_for_both(vllm, 256).engine_args == {"max_num_seqs": 256}
    assert room_for_both(replace(vllm, engine_args={"max_num_seqs": 512}), 256).engine_args == {"max_num_seqs": 512}
    with pytest.raises(ValueError, match="max_num_seqs 64 is too small"):
        room_for_both(replace(vllm, engine_args={"max_num_seqs": 64}), 256)
    assert room_for_both(EngineSpec(kind="torch", model=Path("m")), 256).max_batch == 256


def test_a_bench_trainer_that_dies_is_reported_with_the_end_of_its_log(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """`--one-engine`'s trainer process fails (here: asked for prompts from a vocabulary of no tokens) and exits: the
    bench says so with the end of its log, since the log itself goes with the bench's temporary directory."""
    shape = {"prompts": 1, "n": 1, "max_tokens": 4, "vocab": 0}
    side = SharedEngine(redis_server.url, SyntheticEngine(), shape, tmp_path / "trainer.log")
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match=r"the bench's trainer exited with code 1: .*ValueError"):
            side.round(loop, [], "r0")
    finally:
        side.close(loop)
        loop.close()

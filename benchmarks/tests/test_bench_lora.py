"""`rollouts bench-lora` as a person runs it, small: its own Redis and worker, one JSON report on stdout.

What is checked is the report's shape, that both phases generated (B's tokens/s > 0, the same tokens: greedy),
that adapter a really synced during the syncing phase (its version moved once per sync) while the base model
and adapter b never moved, that every rollout of both adapters arrived exactly once, and that bad options are
one line and exit code 2, with nothing started; on a vLLM worker (its own LoRA) too, in the long tier.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.tests.test_lab_cli_errors import assert_refused_in_one_line, assert_the_command_line_refuses, lab_here


def bench_lora(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollouts", "bench-lora", *args], capture_output=True, text=True, timeout=timeout
    )


def test_bench_lora_measures_b_while_a_syncs_and_every_rollout_arrives_once(tmp_path: Path) -> None:
    plot = tmp_path / "lora.png"
    result = bench_lora(
        "--rounds", "1", "--b-prompts", "4", "--a-prompts", "2", "--n", "2", "--tokens", "32", "--plot", str(plot)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    config = report["config"]
    assert (config["rounds"], config["b_prompts"], config["a_prompts"], config["n"], config["tokens"]) == (
        1,
        4,
        2,
        2,
        32,
    )
    assert config["mode"] == "keep" and config["max_loras"] == 2
    rates = report["b_tokens_per_s"]
    assert rates["quiet"] > 0 and rates["syncing"] > 0
    assert rates["quiet_rounds"] == [rates["quiet"]] and rates["syncing_rounds"] == [rates["syncing"]]
    assert report["b_tokens"]["quiet"] == report["b_tokens"]["syncing"] == [4 * 2 * 32]
    assert report["ratio"] == pytest.approx(rates["syncing"] / rates["quiet"], rel=0.01)
    syncs = report["adapter_syncs"]
    assert syncs["count"] >= 1 and syncs["per_round"] == [syncs["count"]]
    stall = syncs["stall_s"]
    assert 0 < stall["p50"] <= stall["p90"] <= stall["max"]
    assert report["versions"] == {"base": 0, "a": 1 + syncs["count"], "b": 1}  # a's first publish, then each sync
    assert report["base_version_unchanged"] is True
    assert report["exactly_once"] is True and report["error_rollouts"] == 0
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.vllm
@pytest.mark.long(
    "the bench's report: test_bench_lora_measures_b_while_a_syncs_and_every_rollout_arrives_once (torch); an adapter "
    "synced on a vLLM worker while another generates: tests/staleness/test_lora.py's "
    "test_an_adapter_sync_pauses_that_adapter_alone_and_its_samples_go_on_under_the_new_version[vllm-keep]"
)
def test_bench_lora_on_a_vllm_worker_syncs_a_while_b_generates_and_loses_nothing() -> None:
    """`--engine vllm`: vLLM's own LoRA (two slots), the engine flags passed as the worker takes them."""
    result = bench_lora(
        "--engine", "vllm", "--engine-args", '{"max_num_seqs": 32}', "--rounds", "1", "--b-prompts", "2",
        "--a-prompts", "2", "--n", "2", "--tokens", "24", timeout=480,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    args = report["config"]["worker_args"]
    assert args[:2] == ["--engine", "vllm"] and "--engine-args" in args and "--max-loras" in args
    assert report["b_tokens"]["quiet"] == report["b_tokens"]["syncing"] == [2 * 2 * 24]
    assert report["adapter_syncs"]["count"] >= 1 and report["exactly_once"] is True and report["error_rollouts"] == 0
    assert report["versions"]["b"] == 1 and report["base_version_unchanged"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "--rounds must be at least 1, not 0"),
        (["--tokens", "0"], "--tokens must be at least 1, not 0"),
        (["--mode", "later"], "--mode must be keep or abort, not 'later'"),
        (["--engine", "remote"], "--engine must be torch or vllm, not 'remote'"),
        (["--engine-args", "[1]"], "--engine-args must be a JSON object, got [1]"),
    ],
)
def test_bench_lora_refuses_bad_options_in_one_line(args: list[str], message: str) -> None:
    """In this process, as its command line runs it (`lab_here`); the command line itself: the test below."""
    result = lab_here("bench-lora", *args)
    assert_refused_in_one_line(result, message, code=2)
    assert result.stderr.strip().splitlines() == [f"error: {message}"]


def test_on_the_command_line_a_bad_option_is_refused_in_one_line() -> None:
    assert_the_command_line_refuses(["bench-lora", "--rounds", "0"], "--rounds must be at least 1, not 0")

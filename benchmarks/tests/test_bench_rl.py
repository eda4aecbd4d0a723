"""`rollouts bench-rl`: sync, one-step-off and async side by side, judged by the eval reward of the current policy."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from benchmarks.bench_rl import HeldOut, Mode, expected_reward, load_trainer, median_or_none
from benchmarks.cpu import command_line, descendants
from pipeline.wire import Keys
from tests.fixtures import wait_until
from tests.reference import load_model

BENCH = [sys.executable, "-m", "benchmarks", "bench-rl"]
SUMMARY = Path(__file__).resolve().parents[1] / "device" / "bench_rl_summary.py"


def run_bench(*args: str, timeout: float = 600) -> dict[str, Any]:
    result = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_every_generated_token_is_trained_left_over_or_parked_and_each_mode_is_as_stale_as_it_says(
    tmp_path: Path,
) -> None:
    args = ["--modes", "sync,one-step-off,async:1", "--seeds", "0", "--steps", "4", "--groups-per-step", "4"]
    args += ["--eval-prompts", "8", "--plot", str(tmp_path / "rl.png"), "--logs", str(tmp_path / "logs")]
    report = run_bench(*args)
    runs = {run["mode"]: run for run in report["runs"]}
    assert list(runs) == ["sync", "one-step-off", "async:1"]
    kept = [json.loads(line) for line in (tmp_path / "logs" / "runs.jsonl").read_text().splitlines()]
    assert kept == report["runs"], "each run kept as it ended, as the report has it"
    for run in runs.values():
        tokens = run["tokens"]
        assert tokens["generated"] == tokens["trained"] + tokens["left_over"] + tokens["parked"], run
        assert tokens["parked"] == 0 and tokens["trained_share"] == 1.0, "nothing admitted is thrown away"
        assert [point[0] for point in run["curve"]] == [1, 2, 3, 4], "the policy after every step was evaluated"
        assert all(0 <= reward <= 1 for _, _, reward in run["curve"])
        assert 0 <= run["trainer_idle"] <= 1 and 0 <= run["generator_idle"] <= 1
    assert runs["sync"]["staleness_token_mean"] == 0 and runs["sync"]["tokens"]["left_over"] == 0
    # one-step-off: step 0 trains on version 0 at version 0, every later step on the version before its own
    assert runs["one-step-off"]["staleness_token_mean"] == 0.75 and runs["one-step-off"]["staleness_first_max"] == 1
    assert report["summary"]["bound"]["ideal_overlap_bound"] > 0
    assert (tmp_path / "rl.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "rl.json").write_text(json.dumps(report))  # what a device call prints of it
    summary = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path / "rl.json")], capture_output=True, text=True)
    assert summary.returncode == 0 and summary.stdout.count("\n") == 1 + 3 + 3, summary.stderr


def test_the_eval_reward_is_the_probability_of_a_set_token_under_the_policy(tiny_model_dir: Path) -> None:
    """With one token to write, the expected reward is exactly the mass a plain forward pass puts on the set."""
    trainer = load_trainer()
    config = trainer.TrainConfig(max_tokens=1)
    held_out = HeldOut.make(trainer, config, 6)
    policy = load_model(tiny_model_dir)
    want = []
    with torch.no_grad():
        for prompt, ids in zip(held_out.prompts, held_out.sets, strict=True):
            probs = torch.softmax(policy(torch.tensor([prompt])).logits[0, -1].float(), -1)
            want.append(float(probs[ids].sum()))
    assert expected_reward(policy, held_out, temperature=1.0, seed=0) == pytest.approx(sum(want) / len(want), rel=1e-4)


def test_where_the_policy_decides_its_length_a_sample_that_stops_early_scores_its_share_of_the_demand(
    tiny_model_dir: Path,
) -> None:
    """One position to go (cap 1) on prompts that demand 4: the expected reward is the set's probability there
    over 4, whether the sample then stops or not."""
    trainer = load_trainer()
    config = trainer.TrainConfig(max_tokens=4, stop_set=8)
    made = HeldOut.make(trainer, config, 6)
    assert made.cap == 64 and made.stops == tuple(range(100, 108)) and made.lengths == [4] * 6
    held_out = HeldOut(made.prompts, made.lengths, made.sets, cap=1, stops=made.stops)
    policy = load_model(tiny_model_dir)
    with torch.no_grad():
        want = [
            float(torch.softmax(policy(torch.tensor([prompt])).logits[0, -1].float(), -1)[ids].sum()) / 4
            for prompt, ids in zip(held_out.prompts, held_out.sets, strict=True)
        ]
    assert expected_reward(policy, held_out, temperature=1.0, seed=0) == pytest.approx(sum(want) / len(want), rel=1e-4)


def test_modes_and_medians() -> None:
    assert Mode.parse("async:2") == Mode("async:2", "async", 2) and Mode.parse("sync").max_staleness == 0
    with pytest.raises(ValueError, match="use sync, one-step-off or async:η"):
        Mode.parse("async")
    inflight = Mode.parse("async:1@inflight")
    assert (inflight.trainer_mode, inflight.max_staleness, inflight.pause_mode) == ("async", 1, "inflight")
    with pytest.raises(ValueError, match="one of abort, keep, inflight"):
        Mode.parse("async:1@wait")
    base = load_trainer().TrainConfig(pause_mode="keep")
    assert inflight.config(base, seed=0).pause_mode == "inflight"
    assert Mode.parse("sync").config(base, seed=0).pause_mode == "keep", "no @: the settings' pause mode"
    assert median_or_none([3.0, None, 1.0]) == 3.0, "a seed that never reached the target counts as the latest"
    assert median_or_none([3.0, None, None]) is None


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (["--modes", "async:x"], "use sync, one-step-off or async:η"),
        (["--seeds", ""], "at least one mode and one seed"),
    ],
)
def test_bad_arguments_say_what_to_fix(bad: list[str], says: str) -> None:
    result = subprocess.run([*BENCH, *bad], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and says in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_when_its_worker_dies_bench_rl_stops_and_says_so() -> None:
    """A worker killed once it generated ends the benchmark with a line that names it, and nothing it started is left
    running (its Redis, manager and worker are stopped)."""
    args = [*BENCH, "--modes", "async:1", "--seeds", "0", "--steps", "1000", "--groups-per-step", "4"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        worker = wait_for_generating_worker(process.pid, "rl-worker-0", timeout_s=180)
        os.kill(worker, signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
        with pytest.raises(ProcessLookupError):
            os.killpg(process.pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == 1, stderr[-3000:]
    assert "bench-rl: a process of the run stopped: rl-worker-0 was killed by signal 9" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr


def wait_for_generating_worker(root: int, name: str, timeout_s: float) -> int:
    """The PID of worker `name` among `root`'s descendants, once its heartbeat counts tokens generated in a run (not
    the calibration's: its namespace is the run's)."""
    found: list[int] = []

    def generating() -> bool:
        for pid in descendants(root):
            argv = command_line(pid)
            if {"worker", "--redis", "--ns", name} <= set(argv):
                url, ns = argv[argv.index("--redis") + 1], argv[argv.index("--ns") + 1]
                if "calibration" in ns:
                    continue
                with redis.Redis.from_url(url) as client:
                    if int(client.hget(Keys(ns).worker(name), "generated_tokens") or 0) > 0:
                        found.append(pid)
                        return True
        return False

    wait_until(generating, timeout_s, f"{name} to generate")
    return found[0]


@pytest.mark.timeout(900)
def test_async_at_eta_1_with_long_tails_reaches_the_reward_sync_reaches_within_a_measured_margin() -> None:
    """Learning is the test: the eval reward of the current policy, not the training batches'. η = 1 is the setting of
    the README's figures (on the GPU it reached 0.1 in 28 steps against sync's 29). η = 2 is not tested here: on this
    2-core machine under a full suite its crossing wandered from 46 to 80 steps against sync's 32-50 (2026-11-28 and
    -29, `benchmarks/results/2026-11-29-eta4.md` and the closing notes): it learns less per step, an open question, not
    a bound to gate CI on. 30 steps of margin: async still has to learn, in 80 steps, what sync learns."""
    args = ["--modes", "sync,async:1", "--seeds", "0", "--steps", "80", "--target", "0.3", "--eval-prompts", "16"]
    report = run_bench(*args, timeout=840)
    runs = {run["mode"]: run for run in report["runs"]}
    sync, async_1 = runs["sync"], runs["async:1"]
    assert sync["steps_to_target"] is not None, sync["curve"]
    assert async_1["steps_to_target"] is not None, async_1["curve"]
    assert async_1["steps_to_target"] <= sync["steps_to_target"] + 30, (sync["curve"], async_1["curve"])
    assert async_1["tokens"]["parked"] == 0 and async_1["tokens"]["trained_share"] >= 0.95

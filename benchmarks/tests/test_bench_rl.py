"""`rollouts bench-rl`: sync, one-step-off and async side by side, judged by the eval reward of the current policy."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import torch

from benchmarks.bench_rl import (
    BenchProgress,
    HeldOut,
    Mode,
    compare_fleet,
    expected_reward,
    load_trainer,
    median_or_none,
    reset_namespace,
    worker_shares,
)
from benchmarks.cpu import command_line, descendants
from benchmarks.tests.test_lab_cli_errors import assert_refused_in_one_line, assert_the_command_line_refuses, lab_here
from pipeline.local import RedisServer
from pipeline.wire import Keys
from producers.client import RolloutClient
from tests.fixtures import StartWorker, wait_until
from tests.reference import load_model

BENCH = [sys.executable, "-m", "benchmarks", "bench-rl"]
SUMMARY = Path(__file__).resolve().parents[1] / "device" / "bench_rl_summary.py"


def run_bench(*args: str, timeout: float = 600) -> dict[str, Any]:
    return run_bench_piped(*args, timeout=timeout)[0]


def run_bench_piped(*args: str, timeout: float = 600) -> tuple[dict[str, Any], str]:
    """The report, and what it wrote on stderr: a pipe, not a terminal."""
    result = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout)
    return report, result.stderr


def rewards(run: dict[str, Any]) -> dict[int, float]:
    """A run's eval reward by step, the whole curve (a failure's message shows it all)."""
    return {int(step): reward for step, _, reward in run["curve"]}


def progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("bench-rl [")]


def test_every_generated_token_is_trained_left_over_or_parked_and_each_mode_is_as_stale_as_it_says(
    tmp_path: Path,
) -> None:
    """The three modes run one after another on one kept fleet, each after the namespace's reset: each is as stale
    as a run on a fresh fleet is (versions relative to the one it starts at), and loses nothing."""
    args = ["--modes", "sync,one-step-off,async:1", "--seeds", "0", "--steps", "4", "--groups-per-step", "4"]
    args += ["--eval-prompts", "8", "--plot", str(tmp_path / "rl.png"), "--logs", str(tmp_path / "logs")]
    report, stderr = run_bench_piped(*args)
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
    starts = [run["start_version"] for run in runs.values()]
    assert starts[0] == 0 and starts[1] > 0 and starts[2] > starts[1], "one fleet, kept: versions only go on"
    # one-step-off: step 0 trains on version 0 at version 0, every later step on the version before its own
    assert runs["one-step-off"]["staleness_token_mean"] == 0.75 and runs["one-step-off"]["staleness_first_max"] == 1
    assert report["summary"]["bound"]["ideal_overlap_bound"] > 0
    assert report["summary"] == report["fleet"]["by_workers"]["1"], "one worker count: its summary, as it always was"
    for mode in runs:  # stderr is a pipe: plain lines, every run's first and last step among them
        assert f"W 1, {mode}, seed 0: step 1/4, reward " in stderr, stderr
        assert f"W 1, {mode}, seed 0: step 4/4, reward " in stderr, stderr
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
        (["--workers", "0"], "--workers takes distinct worker counts >= 1"),
        (["--workers", "1,x"], "--workers takes distinct worker counts >= 1"),
        (["--workers", "2,2"], "--workers takes distinct worker counts >= 1"),
    ],
)
def test_bad_arguments_say_what_to_fix(bad: list[str], says: str) -> None:
    assert_refused_in_one_line(lab_here("bench-rl", *bad), says)


def test_a_bad_argument_on_the_command_line_is_one_line_with_no_traceback() -> None:
    assert_the_command_line_refuses(["bench-rl", "--modes", "async:x"], "use sync, one-step-off or async:η")


@pytest.mark.timeout(180)
def test_on_two_workers_both_serve_and_the_report_has_the_fleet_figures_with_progress_lines_on_a_pipe() -> None:
    """`--workers 2`: two real `rollouts worker` processes (torch, the tiny model) serve the run, the rollouts say
    which served what, the report has W = 2's ideal step beside the measured one, and stderr (a pipe here) has plain
    progress lines. `--max-batch 4` (one group a read): both serve even where a worker reads all it has room for."""
    args = ["--workers", "2", "--modes", "sync", "--seeds", "0", "--steps", "3", "--groups-per-step", "4"]
    report, stderr = run_bench_piped(*args, "--eval-prompts", "8", "--max-batch", "4", timeout=170)
    (run,) = report["runs"]
    assert run["workers"] == 2 and report["fleet"]["workers"] == [2]
    shares = run["worker_shares"]
    assert set(shares["served"]) == {"rl-worker-0", "rl-worker-1"}
    assert all(count > 0 for count in shares["served"].values()), shares
    assert sum(shares["served"].values()) == 3 * 4 * 4, "every sample trained on is counted to the worker that made it"
    assert 0.5 <= shares["step_top_share_max"] < 1 and min(shares["share_max"].values()) > 0, shares
    sync = report["fleet"]["by_workers"]["2"]["modes"]["sync"]
    assert report["summary"] == report["fleet"]["by_workers"]["2"]
    assert sync["served"] == shares["served"] and sync["seeds"] == 1
    bound = report["summary"]["bound"]
    ideal = run["tokens_per_step"] / bound["full_batch_tokens_per_s"] / 2  # one worker's time at full batching ÷ W
    assert sync["ideal_step_s"] == pytest.approx(ideal, abs=1e-3)
    assert sync["measured_over_ideal"] == pytest.approx(sync["step_s"] / sync["ideal_step_s"], rel=0.01)
    assert bound["fleet_generator_step_s"] == pytest.approx(bound["generator_step_s"] / 2, abs=1e-4)
    assert report["fleet"]["side_by_side"]["sync"]["2"]["measured_over_ideal"] == sync["measured_over_ideal"]
    lines = progress_lines(stderr)
    assert any("calibrated: " in line for line in lines), stderr
    assert any("W 2, sync, seed 0: step 1/3, reward " in line for line in lines), stderr
    assert any("W 2, sync, seed 0: step 3/3, reward " in line for line in lines), stderr
    assert any("W 2, sync, seed 0: target" in line and "(2/2 done)" in line for line in lines), stderr


def test_progress_on_a_pipe_is_a_line_a_run_and_its_steps_at_most_every_interval(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Not a terminal: a line for each stage and run, and of a run's steps the first, the last, and one an interval."""
    from rich.console import Console

    console = Console(file=sys.stderr, force_terminal=False)
    with BenchProgress(console, total=2, every_s=3600) as progress:
        progress.note("calibrating")
        for step in range(50):
            log = SimpleNamespace(step=step, reward=0.5, elapsed_s=float(step))  # what it reads of a StepLog
            progress.step("async:1", 4, 7, log, 50)
        progress.advance("a run ended")
    lines = progress_lines(capsys.readouterr().err)
    assert [line.split("] ", 1)[1] for line in lines] == [
        "calibrating",
        "W 4, async:1, seed 7: step 1/50, reward 0.500, 0.0 s",
        "W 4, async:1, seed 7: step 50/50, reward 0.500, 49.0 s",
        "a run ended (1/2 done)",
    ]
    with BenchProgress(console, total=1, every_s=0) as progress:
        for step in range(3):
            log = SimpleNamespace(step=step, reward=0.5, elapsed_s=float(step))  # what it reads of a StepLog
            progress.step("sync", 1, 0, log, 10)
    assert len(progress_lines(capsys.readouterr().err)) == 3, "an interval of 0: every step"


def test_worker_shares_and_the_fleet_comparison() -> None:
    made_by = {"a": "rl-worker-0", "b": "rl-worker-0", "c": "rl-worker-1", "d": "rl-worker-0"}
    shares = worker_shares([["a", "b", "c", "d"], ["a", "c"]], made_by, workers=2)
    assert shares["served"] == {"rl-worker-0": 4, "rl-worker-1": 2}
    assert shares["share_max"] == {"rl-worker-0": 0.75, "rl-worker-1": 0.5}
    assert shares["step_top_share_max"] == 0.75 and shares["step_top_share_median"] == 0.625

    def mode(ttt: float | None, steps: int | None, speedup: float | None) -> dict[str, Any]:
        share = {"rl-worker-0": 0.5}
        return {"time_to_target_s": ttt, "steps_to_target": steps, "speedup": speedup, "step_s": 1.0,
                "ideal_step_s": 0.5, "measured_over_ideal": 2.0, "share_max": share}  # fmt: skip

    by_workers = {
        "1": {"modes": {"sync": mode(10.0, 20, 1.0), "async:1": mode(5.0, 22, 2.0)}},
        "2": {"modes": {"sync": mode(8.0, 20, 1.0), "async:1": mode(None, None, None)}},
    }
    fleet = compare_fleet(by_workers)
    one = fleet["against_sync"]["1"]["async:1"]
    assert (one["time_to_target_speedup"], one["steps_ratio"], one["steps_within_10pct"]) == (2.0, 1.1, True)
    assert fleet["against_sync"]["2"]["async:1"]["steps_within_10pct"] is None, "not reached: no verdict"
    assert fleet["side_by_side"]["sync"]["2"]["time_to_target_s"] == 8.0


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
@pytest.mark.long(
    "bench-rl runs in test_on_two_workers_both_serve_and_the_report_has_the_fleet_figures_with_progress_lines_on_a_pipe"
)
def test_async_at_eta_1_with_long_tails_reaches_the_reward_sync_reaches_within_a_measured_margin() -> None:
    """Learning is the test: the eval reward of the current policy, not the training batches'. η = 1 is the setting of
    the README's figures (on the GPU it reached 0.1 in 28 steps against sync's 29). η = 2 is not tested here: on this
    2-core machine under a full suite its crossing wandered from 46 to 80 steps against sync's 32-50 (2026-11-28 and
    -29, `benchmarks/results/2026-11-29-eta4.md` and the closing notes): it learns less per step, an open question, not
    a bound to gate CI on. 30 steps of margin: async still has to learn, in 80 steps, what sync learns. The policy
    after every other step is evaluated (`--eval-every 2`): either mode's crossing is found to within a step.

    The target is 0.15 (about 10x the base policy's 0.013): one seed's run is not one run. A batch's rows are batched
    differently from run to run, their rounding flips a sampled token now and then, and RL amplifies it: sync alone,
    seed 0, reached 0.3 in 32, 36, 50, 56 and 74 steps and once not in 80 (CI, 2026-12-02), and 0.15 in 27 to 42
    (`benchmarks/results/2026-12-02-bench-rl-seed-spread.md`)."""
    args = ["--modes", "sync,async:1", "--seeds", "0", "--steps", "80", "--target", "0.15", "--eval-prompts", "16"]
    args += ["--eval-every", "2"]
    report = run_bench(*args, timeout=840)
    runs = {run["mode"]: run for run in report["runs"]}
    sync, async_1 = runs["sync"], runs["async:1"]
    assert sync["steps_to_target"] is not None, rewards(sync)
    assert async_1["steps_to_target"] is not None, rewards(async_1)
    assert async_1["steps_to_target"] <= sync["steps_to_target"] + 30, (rewards(sync), rewards(async_1))
    assert async_1["tokens"]["parked"] == 0 and async_1["tokens"]["trained_share"] >= 0.95


def test_a_kept_fleets_reset_brings_every_worker_back_to_the_base_policy_and_admission_to_a_fresh_start(
    redis_server: RedisServer, ns: str, workers: StartWorker, tiny_model_dir: Path, tiny_model_dir_v1: Path
) -> None:
    """Between two runs on one fleet of two worker processes: the base policy is published as the next version and
    both workers ack it, the admission counters say every version so far used exactly a batch (so that the next run
    may use what a fresh namespace may), and nothing stays parked."""
    for name in ("a", "b"):
        workers(name, "--engine", "synthetic")
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1) == 1  # what the run before left the fleet serving
    client.streams.redis.xadd(client.streams.keys.stale, {b"n_tokens": b"7"})
    config = load_trainer().TrainConfig(mode="async", groups_per_step=4, n=4, sync_every=2)
    reset_namespace(client, lambda: load_model(tiny_model_dir), config)
    report = client.last_sync
    assert report is not None and sorted(report.acked) == ["a", "b"], report
    usage = client.admission_usage()
    assert usage.version == 2 and usage.used == 2 * 16 * 2, usage
    assert not client.streams.redis.exists(client.streams.keys.stale)

    def versions() -> dict[str, str | None]:
        return {name: beat.get("version") for name, beat in client.streams.registry.live_workers().items()}

    wait_until(lambda: versions() == {"a": "2", "b": "2"}, 10, "both workers to say they serve version 2")

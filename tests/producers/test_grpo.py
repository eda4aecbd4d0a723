"""The reference trainer (`examples/grpo_trainer.py`) learns through the pipeline, run as a user runs it.

It starts `rollouts worker` and `rollouts manager` itself, trains on the token-set task and syncs
weights every step. Each step's JSON line says what it trained on, so the tests check that every sample
was trained on once and nothing admitted was thrown away. How soon each mode reaches a reward is
`rollouts bench-rl`'s (benchmarks/tests/test_bench_rl.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.local import RedisServer
from pipeline.wire import Keys
from producers.client import RolloutClient
from tests.fixtures import StartWorker, wait_until
from tests.vllm_server import vllm_server

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_trainer.py"


def load_example() -> Any:
    """`examples/grpo_trainer.py` as a module (the lab loads it the same way)."""
    from benchmarks.bench_rl import load_trainer

    return load_trainer()


def run_trainer(redis_server: RedisServer, ns: str, *args: str, timeout: float = 600) -> list[dict[str, Any]]:
    """The trainer in a process group of its own, whatever is left of which (the manager and workers it started) is
    killed when the test ends, however it ends: a timeout (`subprocess.run`'s, or pytest's) killed the trainer
    alone, and its children lived on, holding CPU, for the tests that came after. In this session, not a new one:
    a vLLM server a test starts is in this session too, and in two sessions (two autogroups, README "Server and
    workers on one small host") the GRPO run on a server took 58-74 s for 30 steps, against 43 s in one."""
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--redis", redis_server.url, "--ns", ns, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == 0, stderr[-3000:]
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.long(
    "a learning curve: the trainer learns in test_the_async_trainer_trains_each_sample_once_throws_nothing_away_and_"
    "learns; sync mode's one sync a step, on-policy, every sample once and the plot in "
    "test_the_trainer_trains_on_workers_you_run_yourself"
)
def test_the_trainer_learns_the_task_in_sync_mode(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    args = ["--model", str(tiny_model_dir), "--mode", "sync", "--steps", "100", "--plot", str(tmp_path / "curve.png")]
    lines = run_trainer(redis_server, ns, *args)
    *steps, summary = lines
    assert len(steps) == 100 and summary["steps"] == 100
    assert steps[0]["reward"] < 0.05, "a random policy rarely hits the named set"
    assert summary["final_reward"] > 0.5, f"it did not learn: {[round(s['reward'], 2) for s in steps]}"
    assert summary["samples"] == summary["unique"] == 100 * 64, "every sample trained on once"
    assert all(s["staleness_max"] == 0 and s["kl"] < 1e-6 for s in steps), "sync: on-policy, trainer == engine"
    assert [s["version"] for s in steps] == list(range(1, 101)), "one weight sync a step"
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_the_async_trainer_trains_each_sample_once_throws_nothing_away_and_learns(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path
) -> None:
    args = ["--model", str(tiny_model_dir), "--mode", "async", "--max-staleness", "1", "--steps", "120"]
    *steps, summary = run_trainer(redis_server, ns, *args)
    assert summary["samples"] == summary["unique"] == 120 * 64, "every sample trained on once"
    assert summary["parked"] == 0 and summary["trained_share"] == 1.0, "nothing admitted is thrown away"
    assert any(s["staleness_max"] >= 1 for s in steps), "fully async: some batches were generated a version back"
    assert all(s["staleness_token"] <= s["staleness_first"] <= s["staleness_max"] for s in steps)
    assert any(s["multi_version"] > 0 for s in steps), "samples continued across a weight sync (partials)"
    assert summary["final_reward"] > steps[0]["reward"] + 0.15, [round(s["reward"], 2) for s in steps]


@pytest.mark.long(
    "RQ scores rewards across processes in tests/consumers/test_scoring.py; the async trainer learns in "
    "test_the_async_trainer_trains_each_sample_once_throws_nothing_away_and_learns"
)
def test_with_rewards_scored_on_rq_workers_the_async_trainer_learns(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path
) -> None:
    """`--scoring rq`: the prompts name the task's reward; `rollouts scorer --rq` and two `rollouts
    score-worker`s score every group before the trainer gets it, and it learns from those rewards alone.

    100 steps: at η = 2 nearly every batch is two versions old; after 60 steps the reward was ~0.10 on a quiet
    machine (the old bar, +0.1, failed about half the time), after 100 it is 0.35-0.42."""
    args = ["--model", str(tiny_model_dir), "--mode", "async", "--max-staleness", "2", "--steps", "100"]
    args += ["--scoring", "rq", "--score-workers", "2"]
    *steps, summary = run_trainer(redis_server, ns, *args)
    assert summary["samples"] == summary["unique"] == 100 * 64, "every sample trained on once"
    assert all(s["reward_errors"] == 0 for s in steps)
    assert summary["final_reward"] > steps[0]["reward"] + 0.2, [round(s["reward"], 2) for s in steps]
    scorer = RolloutClient(redis_server.url, ns).streams.redis.hgetall(Keys(ns).scorer)
    assert scorer[b"mode"] == f"rq:rewards-{ns}".encode() and int(scorer[b"groups"]) >= 100 * 16
    assert scorer[b"reward_errors"] == b"0"


def test_the_trainer_trains_on_workers_you_run_yourself(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, workers: StartWorker, tmp_path: Path
) -> None:
    """`--workers 0 --redis URL`: no processes of its own; the namespace's workers serve it and take its weights. In
    sync mode: one weight sync a step, every batch on-policy (the engine's logprobs are the trainer's)."""
    mine = workers("mine")
    args = ["--workers", "0", "--model", str(tiny_model_dir), "--mode", "sync", "--steps", "5"]
    *steps, summary = run_trainer(redis_server, ns, *args, "--plot", str(tmp_path / "curve.png"))
    assert summary["samples"] == summary["unique"] == 5 * 64, "every sample trained on once"
    assert [s["version"] for s in steps] == [1, 2, 3, 4, 5], "one weight sync a step"
    assert all(s["staleness_max"] == 0 and s["kl"] < 1e-6 for s in steps), "sync: on-policy, trainer == engine"
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    heartbeat = RolloutClient(redis_server.url, ns).streams.redis.hgetall(Keys(ns).worker("mine"))
    assert heartbeat[b"version"] == b"5" and mine.poll() is None, "our worker served every step and took each sync"


def test_when_its_worker_dies_the_trainer_stops_and_says_so_instead_of_waiting_for_ever(
    redis_server: RedisServer, ns: str
) -> None:
    """A trainer whose only worker stopped once waited for samples until the test's timeout. It watches what it
    started: a worker killed mid-run ends the run at once, with a line that names it, and nothing left running. No
    `--model`: the trainer builds its own tiny model first."""
    args = [str(EXAMPLE), "--redis", redis_server.url, "--ns", ns, "--mode", "async", "--steps", "1000"]
    process = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        assert process.stdout is not None and process.stdout.readline().startswith('{"step": 0')
        worker = RolloutClient(redis_server.url, ns).streams.redis.hget(Keys(ns).worker("rl-worker-0"), "pid")
        assert worker is not None
        os.kill(int(worker), signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
        with pytest.raises(ProcessLookupError):  # the manager it started was stopped too: its process group is empty
            os.killpg(process.pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == 1 and "rl-worker-0 was killed by signal 9" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr


@pytest.mark.vllm
@pytest.mark.long(
    "keep syncs into vLLM: test_weights_published_mid_generation_reach_every_sample_exactly_once[vllm-installed-abort-"
    "keep]; the async trainer learning: test_the_async_trainer_trains_each_sample_once_throws_nothing_away_and_learns"
)
def test_with_vllm_workers_paused_in_keep_mode_the_async_trainer_learns(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path
) -> None:
    args = ["--model", str(tiny_model_dir), "--engine", "vllm", "--mode", "async", "--max-staleness", "1"]
    args += ["--pause-mode", "keep", "--steps", "100"]
    *steps, summary = run_trainer(redis_server, ns, *args)
    assert summary["samples"] == summary["unique"] == 100 * 64 and summary["parked"] == 0
    assert any(s["multi_version"] > 0 for s in steps), "frozen requests continued under the new weights"
    assert summary["final_reward"] > steps[0]["reward"] + 0.15, [round(s["reward"], 2) for s in steps]


@pytest.mark.vllm
@pytest.mark.timeout(600)  # ~2 min here (60 syncs of ~0.2 s); a worker that stops now ends the run (README)
@pytest.mark.long(
    "the async trainer learns through vLLM workers in keep mode: "
    "test_with_vllm_workers_paused_in_keep_mode_the_async_trainer_learns"
)
def test_with_a_vllm_server_as_the_engine_paused_in_keep_mode_the_async_trainer_learns(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The in-process vLLM test above, with the trainer's worker driving a `vllm serve` of its own (`--engine
    remote`): the server pauses, reloads and relabels its weights at every step."""
    with vllm_server(tiny_model_dir, tmp_path / "server.log") as server:
        wait_until(server.healthy, 300, "the vLLM server")
        args = ["--engine", "remote", "--url", server.url, "--model", str(tiny_model_dir), "--mode", "async"]
        # 60 steps: the reward first passed 0.5 at step 60 in runs of 100 (0.98 at 100); +0.15 is asked.
        args += ["--max-staleness", "1", "--pause-mode", "keep", "--steps", "60"]
        *steps, summary = run_trainer(redis_server, ns, *args)
        label = httpx.get(f"{server.url}/weight_info", timeout=10).json()["weight_version"]
    assert summary["samples"] == summary["unique"] == 60 * 64 and summary["parked"] == 0
    assert any(s["multi_version"] > 0 for s in steps), "frozen requests continued under the new weights"
    assert summary["final_reward"] > steps[0]["reward"] + 0.15, [round(s["reward"], 2) for s in steps]
    assert label == str(steps[-1]["version"]), "the server serves the last weights the trainer published"


def test_with_sync_every_2_the_async_trainer_publishes_every_other_step(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path
) -> None:
    args = ["--model", str(tiny_model_dir), "--mode", "async", "--sync-every", "2", "--steps", "4"]
    args += ["--groups-per-step", "4"]
    *steps, summary = run_trainer(redis_server, ns, *args)
    assert [s["version"] for s in steps] == [0, 1, 1, 2], "a publish after steps 1 and 3 only"
    assert [s["publish_s"] > 0 for s in steps] == [False, True, False, True]
    assert summary["samples"] == summary["unique"] == 4 * 16 and summary["parked"] == 0


def test_where_the_policy_decides_its_length_stop_ids_end_its_samples(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path
) -> None:
    """`--stop-set 8`: 8 ids (and EOS) end a sample, 256 tokens is only the cap. The random policy draws one of them
    with probability 9/512 a token, so its samples (the first step's) end after ~57 tokens on average, at lengths of
    their own; training then moves the lengths (a full suite once saw a later step average 160), never all to the
    cap."""
    args = ["--model", str(tiny_model_dir), "--mode", "async", "--stop-set", "8", "--steps", "4"]
    args += ["--groups-per-step", "4"]
    *steps, summary = run_trainer(redis_server, ns, *args)
    assert summary["samples"] == summary["unique"] == 4 * 16 and summary["parked"] == 0
    per_sample = [s["tokens"] / 16 for s in steps]
    assert 8 < per_sample[0] < 160 and all(t < 256 for t in per_sample), f"tokens a sample, not the cap: {per_sample}"
    assert len(set(per_sample)) > 1, "lengths the samples chose, not one fixed length"


def test_a_vllm_worker_on_cuda_n_sees_that_gpu_alone() -> None:
    trainer = load_example()
    assert trainer.gpu_of("cuda:1") == {"CUDA_VISIBLE_DEVICES": "1"}
    assert trainer.gpu_of("cpu") is None and trainer.gpu_of("cuda") is None


@pytest.mark.parametrize(
    "bad",
    [["--mode", "both"], ["--steps", "many"], ["--engine", "remote"], ["--mode", "sync", "--sync-every", "2"],
     ["--mode", "sync", "--park-max-age", "1"], ["--is-level", "word"], ["--stop-set", "65"]],
)  # fmt: skip
def test_bad_arguments_say_what_to_fix(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Checked in this process (the example's `main`, as its command line calls it): a process a case cost ~7 s of
    imports. The command line itself is checked once, below."""
    with pytest.raises(SystemExit) as exited:
        load_example().main(bad)
    assert exited.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_bad_argument_on_the_command_line_exits_2_with_no_traceback() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--mode", "both"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error:" in result.stderr

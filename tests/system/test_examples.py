"""The examples a user copies (`examples/`), run as a user runs them: against a private Redis and a synthetic worker."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from consumers.scoring.job import score_group
from pipeline.local import RedisServer, free_port
from pipeline.processes import start_command, start_worker, stop_process, wait_for_worker
from pipeline.wire import TRAINER, Keys
from producers.client import RolloutClient
from producers.prompts_file import read_prompts_file
from tests.fixtures import FAST, wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run `examples/NAME ARGS` as a user would; its stdout, once it exited 0."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=timeout,
        env=os.environ | (env or {}),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture
def worker(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A `rollouts worker --engine synthetic` on the tiny model's vocabulary, started and not waited for: an example
    waits for its rollouts as a user's program does, and the worker starts while the example imports torch."""
    proc = start_worker(redis_server.url, ns, tiny_model_dir, "w1", "--engine", "synthetic", *FAST,
                        log_file=tmp_path / "w1.log")  # fmt: skip
    yield proc
    stop_process(proc)


def test_the_minimal_trainer_trains_on_every_rollout_once_and_publishes_each_step(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, worker: subprocess.Popen[bytes]
) -> None:
    args = ["--model", str(tiny_model_dir), "--redis", redis_server.url, "--ns", ns, "--steps", "3"]
    out = example("minimal_trainer.py", *args, "--groups-per-step", "2").splitlines()
    assert [line.split(":")[0] for line in out[:3]] == ["step 0", "step 1", "step 2"], out
    assert [line.rsplit(" ", 1)[1] for line in out[:3]] == ["1", "2", "3"], out  # a policy version a step
    assert all("8 rollouts" in line for line in out[:3]) and out[3] == "received 24 rollouts, 0 duplicates", out
    client = RolloutClient(redis_server.url, ns)
    assert client.streams.redis.xpending(Keys(ns).rollouts, TRAINER)["pending"] == 0  # every batch acked


@pytest.fixture
def gateway(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path, worker: subprocess.Popen[bytes]
) -> Iterator[str]:
    """`rollouts gateway` on this test's namespace, after its worker; its base URL once its `/health` says it is
    ready (200: the worker serves), as a client of vLLM waits for a server's `/health`."""
    port, log = free_port(), tmp_path / "gateway.log"
    args = ["gateway", "--redis", redis_server.url, "--ns", ns, "--model", str(tiny_model_dir), "--port", str(port)]
    proc = start_command(*args, "--log-level", "warning", log_file=log)

    def listening() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited: {log.read_text()}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(listening, 120, "the gateway to be ready (a worker serving)")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_process(proc)


def test_the_agent_gets_a_reply_each_turn_and_its_session_reaches_the_trainer(
    redis_server: RedisServer, ns: str, worker: subprocess.Popen[bytes], gateway: str
) -> None:
    client = RolloutClient(redis_server.url, ns)
    wait_for_worker(client.streams.redis, ns, "w1", worker, timeout_s=60)  # a session is placed on a live worker
    out = example("agent_gateway.py", "--base-url", gateway, "--session", "task-1").splitlines()
    assert [line.split(":")[0] for line in out] == ["turn 0", "turn 1", "finished task-1 with reward 0.0"], out
    finished = json.loads(out[2].split(": ", 1)[1].replace("'", '"'))
    assert finished["turns"] == 2, finished
    [group] = client.collect(1, timeout=30)
    assert group.prompt_id == "task-1" and group.rewards == [0.0]


def test_my_rewards_score_groups_as_the_scorer_runs_them_and_the_prompts_file_is_valid(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # where the scorer runs, my_rewards is importable
    importlib.import_module("my_rewards")._tokenizer.cache_clear()  # as in a fresh scorer: no tokenizer loaded yet
    monkeypatch.delenv("MY_REWARDS_MODEL", raising=False)
    unset = score_group("my_rewards:exact_match", [{"tokens": [5], "finish_reason": "stop", "meta": {}}])
    assert unset == {
        "error": "my_rewards:exact_match: RuntimeError: set MY_REWARDS_MODEL to the workers' model directory where "
        "the scorer runs"
    }
    monkeypatch.setenv("MY_REWARDS_MODEL", str(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def view(sample: int, text: str) -> dict[str, object]:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        return {"id": f"p:{sample}", "prompt_id": "p", "sample": sample, "n": 3, "prompt_tokens": [5], "tokens": tokens,
                "finish_reason": "stop", "version": 0, "meta": {"answer": "42"}, "error": None}  # fmt: skip

    group = [view(0, "42"), view(1, "41"), view(2, "forty-two")]
    assert score_group("my_rewards:exact_match", group) == {"rewards": [1.0, 0.0, 0.0]}
    # The right answer beats both; of the wrong two, the shorter wins.
    assert score_group("my_rewards:pairwise", group) == {"rewards": [1.0, 0.5, 0.0]}
    client = RolloutClient(redis_server.url, ns, tokenizer=tiny_model_dir)
    prompts = read_prompts_file(EXAMPLES / "prompts.jsonl", client)  # as `rollouts submit --file` reads it
    assert {p.reward_fn for p in prompts} == {"my_rewards:exact_match", "my_rewards:pairwise", None}


def test_async_vs_sync_runs_the_reference_trainer_once_a_mode_and_draws_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`examples/async_vs_sync.py`, short: a line a mode (a target of 0 is reached after the first five steps), every
    generated token trained, and the plot."""
    plot = tmp_path / "async_vs_sync.png"
    args = ["--modes", "sync,async:1", "--steps", "6", "--target", "0", "--length-alpha", "0"]
    out = example("async_vs_sync.py", *args, "--model", str(tiny_model_dir), "--plot", str(plot), timeout=300)
    lines = out.splitlines()
    assert [line.split(": ", 1)[0].strip() for line in lines] == ["sync", "async:1"], out
    assert all("(5 steps)" in line and "100% of generated tokens trained" in line for line in lines), out
    assert plot.read_bytes()[:4] == b"\x89PNG"

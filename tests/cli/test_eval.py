"""`rollouts eval`: a held-out accuracy pinned to one policy version while the fleet moves on.

Run as a user runs it (a process, JSON on stdout) against a real Redis, a real worker and syncs by `redis://` and
`fs://`. What is checked is what a user relies on: the report names the version the namespace served, every sample is
that version's (its logprobs are a forward pass of those weights, never a mix, even with a sync published while the
evaluation runs), the accuracy is the task's reward over the replies, and mistakes are one line."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from pipeline.local import RedisServer
from producers.client import RolloutClient
from producers.tasks import get_task
from tests.fixtures import StartWorker
from tests.reference import forward_logprobs

TASK = "arithmetic:sum-1d"


def evaluate(redis_server: RedisServer, ns: str, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["eval", "--redis", redis_server.url, "--ns", ns, "--model", str(model), "--task", TASK, "--samples", "2",
            "--max-tokens", "12", "--num-threads", "1", "--replies", *extra]  # fmt: skip
    return subprocess.run([sys.executable, "-m", "rollouts", *args], capture_output=True, text=True, timeout=300)


def check_pinned(report: dict[str, Any], weights: dict[int | None, Path], model: Path) -> None:
    """Every reply's logprobs are those of the weights of the version the report names; its reward is the task's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    task = get_task(TASK)
    by_id = {p.id: p for p in task.problems("eval", report["problems"])}
    assert len(report["replies"]) == report["problems"] * report["samples"] == 32  # the whole split (16), 2 each
    right = 0.0
    for reply in report["replies"]:
        problem = by_id[reply["problem"]]
        prompt = tokenizer.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)  # fmt: skip
        expected = forward_logprobs(weights[report["version"]], cast(list[int], prompt), reply["tokens"])
        np.testing.assert_allclose(reply["logprobs"], expected, rtol=0, atol=1e-4)
        assert reply["reward"] == task.reward(reply["text"], problem.meta)
        right += reply["reward"]
    assert report["accuracy"] == pytest.approx(right / 32, abs=1e-4)


def test_eval_reports_the_served_version_and_every_sample_is_its_own_while_a_sync_lands(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker,
    manager: subprocess.Popen[bytes], tmp_path: Path,
) -> None:  # fmt: skip
    workers("w1", "--num-threads", "1")
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1, transport="redis://") == 1
    racing = threading.Thread(
        target=lambda: client.publish_weights(tiny_model_dir, transport=f"fs://{tmp_path / 'weights'}")
    )  # version 2 while the evaluation starts: it evaluates 1 or 2, each sample of the one it names
    racing.start()
    done = evaluate(redis_server, ns, tiny_model_dir)
    racing.join(timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["version"] in (1, 2) and report["task"] == TASK
    assert report["weights"].startswith("redis://" if report["version"] == 1 else f"fs://{tmp_path / 'weights'}")
    check_pinned(report, {1: tiny_model_dir_v1, 2: tiny_model_dir}, tiny_model_dir)
    assert f"of version {report['version']}" in done.stderr

    later = evaluate(redis_server, ns, tiny_model_dir)  # the fleet is at 2 now: so is the evaluation
    assert later.returncode == 0, later.stderr
    report = json.loads(later.stdout)
    assert report["version"] == 2
    check_pinned(report, {2: tiny_model_dir}, tiny_model_dir)


def test_eval_of_a_fresh_namespace_is_the_base_model_and_of_a_checkpoint_is_its_weights(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path
) -> None:
    base = evaluate(redis_server, ns, tiny_model_dir)
    assert base.returncode == 0, base.stderr
    report = json.loads(base.stdout)
    assert (report["version"], report["weights"]) == (0, "base")
    check_pinned(report, {0: tiny_model_dir}, tiny_model_dir)
    checkpoint = evaluate(redis_server, ns, tiny_model_dir, "--checkpoint", str(tiny_model_dir_v1))
    assert checkpoint.returncode == 0, checkpoint.stderr
    report = json.loads(checkpoint.stdout)
    assert (report["version"], report["weights"]) == (None, str(tiny_model_dir_v1))
    check_pinned(report, {None: tiny_model_dir_v1}, tiny_model_dir)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("--task", "arithmetic:nope"), "unknown task"),
        (("--engine", "synthetic"), "runs a torch or vllm engine of its own"),
        (("--checkpoint", "/nonexistent"), "--checkpoint /nonexistent: no safetensors there"),
    ],
)
def test_eval_refuses_a_mistake_in_one_line(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, extra: tuple[str, ...], says: str
) -> None:
    done = evaluate(redis_server, ns, tiny_model_dir, *extra)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1

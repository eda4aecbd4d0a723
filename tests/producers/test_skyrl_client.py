"""SkyRL's own client code drives the gateway's vLLM routes through a generate → pause → weights → resume cycle
against real workers: a real redis-server, `rollouts manager`, a torch worker process and `rollouts gateway
--rl-control`; SkyRL 0.4.0 (`RemoteInferenceClient`, `SkyrlWeightSyncClient`) runs in a Python 3.12 venv of its own
(tests/skyrl_driver.py says how it is installed, and why torch is a stand-in there).

The venv is built once from the package index (`skyrl` without its dependencies, plus what its client modules
import) and cached under `~/.cache/rollout-streams/`; SkyRL needs Python >= 3.12, so the test is skipped, saying so,
on a machine without one (it looks at `ROLLOUTS_PYTHON312`, `python3.12` on PATH, then pyenv's versions)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from pipeline.local import RedisServer
from pipeline.wire import Keys
from tests.fixtures import StartGateway, StartWorker, cached_venv, wait_until
from tests.reference import forward_logprobs

SKYRL = "skyrl==0.4.0"
CLIENT_DEPS = [
    "aiohttp==3.14.5", "orjson==3.13.0", "pybase64==1.5.1", "numpy==2.5.5", "requests==2.34.2", "loguru==0.7.3",
    "cloudpathlib==0.26.0", "pydantic==2.14.4", "rich==15.0.0",
]  # fmt: skip
"""What `remote_inference_client` and `control_plane` import, torch aside (found by importing them in a bare venv),
pinned to the versions last tested (docs/development.md, "Pinned versions")."""
DRIVER = Path(__file__).resolve().parents[1] / "skyrl_driver.py"


def python312() -> str | None:
    """A Python 3.12 that runs (a pyenv shim of a version not selected does not)."""
    candidates = [os.environ.get("ROLLOUTS_PYTHON312")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")), reverse=True)
    candidates.append(shutil.which("python3.12"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                                   capture_output=True, text=True, timeout=60)  # fmt: skip
            if probe.stdout.strip() == "True":
                return candidate
    return None


@pytest.fixture(scope="session")
def skyrl_python() -> str:
    """The Python of a venv with SkyRL's client installed (built once, cached; a lock keeps xdist workers apart).
    SkyRL 0.4.0 asks for Python >= 3.12, < 3.15; 3.12 is the one it was tried on here."""
    base = python312()
    if base is None:
        pytest.skip("SkyRL 0.4.0 needs Python >= 3.12 and none was found (set ROLLOUTS_PYTHON312)")
    return cached_venv("skyrl-0.4.0-py312", base, [["--no-deps", SKYRL], CLIENT_DEPS])


def span_logprobs(
    models: dict[int, Path], prompt: list[int], tokens: list[int], spans: list[dict[str, Any]]
) -> np.ndarray:
    """Each token's logprob under its span's version, over the whole prefix (what `keep` gives: the engine recomputes
    the cache of a frozen request under the new weights)."""
    out = np.zeros(len(tokens), np.float32)
    for span in spans:
        start, end = span["start"], span["end"]
        out[start:end] = forward_logprobs(models[int(span["version"])], prompt, tokens)[start:end]
    return out


def test_skyrl_client_drives_generate_pause_weights_resume(
    skyrl_python: str,
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    gateways: StartGateway,
    manager: subprocess.Popen[bytes],
    one_thread: None,
) -> None:
    worker = workers("w1")
    url = gateways("gw", "--rl-control").removesuffix("/v1")
    prompt = [5, 6, 7, 8, 9, 10]
    config: dict[str, object] = {"url": url, "model": "tiny", "prompt": prompt, "weights_dir": str(tiny_model_dir_v1)}
    config |= {"long_tokens": 480, "long_samples": 16, "short_tokens": 12}
    driver = subprocess.Popen(
        [skyrl_python, str(DRIVER), json.dumps(config)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    beat = redis.Redis.from_url(redis_server.url)
    try:
        assert driver.stdout is not None and driver.stdin is not None
        started = driver.stdout.readline()
        if json.loads(started or "{}").get("event") != "started":
            raise AssertionError(f"SkyRL's driver did not start: {started}{driver.communicate(timeout=30)[1]}")
        # The long generations are on the worker with tokens of version 0. The worker is frozen (SIGSTOP) until the
        # sync has begun, so that samples are still running when it pauses them, whatever the tiny model's end of
        # sequence does (it ends a sample after ~50 tokens at times); a few hundred ms, well inside its heartbeat's TTL.
        generating = lambda: int(beat.hget(Keys(ns).worker("w1"), "generated_tokens") or 0) >= 16  # noqa: E731
        wait_until(generating, 60, "the worker to generate SkyRL's first request")
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            driver.stdin.write(json.dumps({"event": "go"}) + "\n")
            driver.stdin.flush()
            wait_until(lambda: beat.hget(Keys(ns).state, "paused") == b"1", 60, "the weight routes to begin a sync")
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        out, err = driver.communicate(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["event"] == "done"
    models = {0: tiny_model_dir, 1: tiny_model_dir_v1}

    assert result["world_size"] == [1, 1]
    assert "400" in result["wait"] and "no counterpart" in result["wait"], result["wait"]
    assert result["paused"] == {"is_paused": True}
    assert "[400]" in result["nccl"] and "cannot join" in result["nccl"], result["nccl"]
    assert "[404]" in result["delta"] and "delta" in result["delta"], result["delta"]
    assert result["reset"]["success"] is True
    assert result["during_done_before_resume"] is False

    # The requests in flight across the sync: complete answers, those still running at the pause with tokens of both
    # versions, each span's logprobs those of its version over the whole prefix (keep: frozen, then recomputed under
    # the new weights). SkyRL's client reads the first choice's tokens and logprobs.
    choices = result["long"]["choices"]
    assert len(choices) == 16 and result["long"]["response_ids"] == choices[0]["token_ids"]
    versions = [[s["version"] for s in c["weight_versions"]] for c in choices]
    assert ["0", "1"] in versions and all(v in (["0"], ["0", "1"]) for v in versions), versions
    for choice in choices:
        tokens, spans = choice["token_ids"], choice["weight_versions"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == len(tokens) and choice["spans"][-1][2] == len(tokens)
        got = [c["logprob"] for c in choice["logprobs"]["content"]]
        np.testing.assert_allclose(got, span_logprobs(models, prompt, tokens, spans), atol=2e-4)
    np.testing.assert_allclose(
        result["long"]["response_logprobs"], [c["logprob"] for c in choices[0]["logprobs"]["content"]]
    )
    # The call made during the pause waited, and ran on the new weights alone; so did the one after the resume.
    during = result["during"]
    [held] = during["response_ids"]
    assert held and during["responses"][0] is not None
    reference = forward_logprobs(tiny_model_dir_v1, prompt, held)
    np.testing.assert_allclose(during["response_logprobs"][0], reference, atol=2e-4)
    for sequence in result["sample"]:
        reference = forward_logprobs(tiny_model_dir_v1, prompt, sequence["tokens"])
        np.testing.assert_allclose(sequence["logprobs"], reference, atol=2e-4)

    # One sync: the state moved to version 1, the worker acked and serves it, nobody was evicted, no hold is left.
    state = beat.hgetall(Keys(ns).state)
    assert state[b"version"] == b"1" and state[b"paused"] == b"0"
    heartbeat = beat.hgetall(Keys(ns).worker("w1"))
    assert heartbeat[b"version"] == b"1" and heartbeat[b"epoch"] == b"1"
    assert not beat.exists(Keys(ns).gateway_hold) and not beat.exists(Keys(ns).gateway_weights)
    assert not beat.exists(Keys(ns).session("traj-0"))  # finish_session released the pin
    beat.close()
    assert manager.poll() is None

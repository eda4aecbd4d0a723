"""`rollouts bench-broker` as a person runs it, small: its own Redis, one JSON report on stdout.

What is checked is the report's shape, that every rollout our publish path published reached the trainer client
exactly once (and every prompt entry was acked), and that `--pipelinerl-src` loads a checkout's
`pipelinerl/streams.py` and `pipelinerl/rollouts.py` by path and reports the ratios. CI has no PipelineRL checkout,
so the test writes a stand-in with the same API (writer, reader, `TrainingText`) that moves JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROLLOUTS, N, BATCH = 256, 4, 16

STAND_IN_STREAMS = """
import json
import redis
from pathlib import Path
from pydantic import BaseModel

_backend = None


class RedisConfig(BaseModel):
    host: str
    port: int


class SingleStreamSpec(BaseModel):
    exp_path: Path
    topic: str

    def __str__(self):
        return self.topic


def set_streams_backend(backend, **kwargs):
    global _backend
    _backend = RedisConfig(**kwargs)


class RedisStreamWriter:
    def __init__(self, stream, mode="a"):
        self._redis, self._name = redis.Redis(host=_backend.host, port=_backend.port), str(stream)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._redis.close()

    def write(self, data):
        self._redis.xadd(self._name, {"data": json.dumps(data)})


class RedisStreamReader(RedisStreamWriter):
    def read(self):
        last = 0
        while True:
            for _, items in self._redis.xread({self._name: last}, count=1, block=100) or []:
                last, fields = items[0]
                yield json.loads(fields[b"data"])
"""

STAND_IN_ROLLOUTS = """
from pydantic import BaseModel


class TrainingText(BaseModel):
    text: str
    n_predicted: int
    logprobs: list[float] = []
    input_ids: list[int] = []
    labels: list[int] = []
    group_id: str | None = None
    finished: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
"""


def test_bench_broker_moves_every_rollout_once_and_reports_rates_and_ratios(tmp_path: Path) -> None:
    checkout = tmp_path / "PipelineRL" / "pipelinerl"
    checkout.mkdir(parents=True)
    (checkout / "streams.py").write_text(STAND_IN_STREAMS)
    (checkout / "rollouts.py").write_text(STAND_IN_ROLLOUTS)
    args = ["--rollouts", str(ROLLOUTS), "--n", str(N), "--tokens", "64", "--batch-groups", str(BATCH), "--rounds", "2"]
    args += ["--pipelinerl-src", str(checkout.parent)]
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "bench-broker", *args], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert (report["rollouts"], report["n"], report["tokens"], report["batch_groups"]) == (ROLLOUTS, N, 64, BATCH)
    ours = report["ours"]
    assert ours["exactly_once"] is True and ours["consumed"] == [ROLLOUTS, ROLLOUTS]
    assert ours["prompts_left_pending"] == 0
    for side in ("raw", "ours", "pipelinerl"):
        for phase in ("publish", "consume"):
            rates = report[side][f"{phase}_rounds"]
            assert len(rates) == 2 and all(rate > 0 for rate in rates), (side, phase)
            assert min(rates) <= report[side][f"{phase}_per_s"] <= max(rates)
    assert set(report["ratios"]) == {"ours_over_raw", "ours_over_pipelinerl"}
    for ratio in report["ratios"].values():
        assert set(ratio) == {"publish", "consume"} and all(value > 0 for value in ratio.values())


def test_bench_broker_refuses_a_checkout_without_pipelinerls_streams(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "bench-broker", "--rounds", "1", "--pipelinerl-src", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "ServiceNow/PipelineRL" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("behind", ["direct", "sentinel"])
def test_bench_broker_runs_a_durability_mode_beside_the_default_on_a_replicated_server(behind: str) -> None:
    """`--durability replica`: a replica attached, the default and the replica-acked publish side by side, every
    rollout once on each, and the mode's rates over the default's; `--sentinel`: through three Sentinels too, in the
    default and the replica mode, beside the primary reached directly."""
    args = ["--rollouts", str(ROLLOUTS), "--n", str(N), "--tokens", "64", "--batch-groups", str(BATCH), "--rounds", "1"]
    args += ["--sentinel"] if behind == "sentinel" else []
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "bench-broker", *args, "--durability", "replica"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    sides = ["ours-sentinel", "ours-sentinel-replica"] if behind == "sentinel" else ["ours-replica"]
    assert report["redis"].endswith("with a replica and three Sentinels" if behind == "sentinel" else "with a replica")
    assert all(report[side]["exactly_once"] is True for side in ["ours", *sides])
    for side in sides:
        ratio = report["ratios"][f"{side}_over_ours"]
        assert set(ratio) == {"publish", "consume"} and all(value > 0 for value in ratio.values())


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--durability", "fsync"], "--durability fsync: name modes among aof, replica, replica-aof"),
        (["--appendfsync", "sometimes"], "--appendfsync sometimes: everysec or always"),
    ],
    ids=["durability", "appendfsync"],
)
def test_bench_broker_refuses_a_durability_mode_or_fsync_policy_it_does_not_know(args: list[str], says: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "bench-broker", "--rounds", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and says in result.stderr, result.stderr

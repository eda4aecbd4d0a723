"""`rollouts bench-sync`: the stall of a weight sync per transport and model size, and which transports it skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_sync import cannot_run, plot_bench_sync
from pipeline.cli.engine_spec import EngineSpec
from tests.cli.test_cli import assert_clean_error, rollouts


def test_bench_sync_reports_the_stall_per_transport(tmp_path: Path) -> None:
    plot = tmp_path / "sync.png"
    logs = tmp_path / "logs"
    result = rollouts(
        "bench-sync", "--sizes", "tiny", "--rounds", "2", "--plot", str(plot), "--logs", str(logs), timeout=300
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [(r["size"], r["transport"]) for r in report["results"]] == [
        ("tiny", "redis"),
        ("tiny", "fs"),
        ("tiny", "nccl"),
    ]
    for row in report["results"]:
        assert row["parameters"] == 148_160 and row["bytes"] == 4 * 148_160
        assert 0 < row["sync_s"] <= row["publish_to_serving_s"] and 0 < row["stall_s"] <= row["publish_to_serving_s"]
    nccl = report["results"][2]
    # The worker joins and builds its group before it pauses: the first sync's setup is not time it stood still.
    assert nccl["first_stall_s"] < nccl["first_sync_s"] - nccl["first_setup_s"], nccl
    assert nccl["gb_per_s"] > 0 and 0 < nccl["broadcast_s"] < nccl["sync_s"] and 0 <= nccl["ready_s"] < nccl["sync_s"]
    assert nccl["first_setup_s"] > 0 and nccl["setup_s_rounds"][1:] == [0.0], "the second sync built a new group"
    assert sorted(p.name for p in logs.iterdir()) == ["tiny-fs.log", "tiny-nccl.log", "tiny-redis.log"]
    assert "broadcast" in (logs / "tiny-nccl.log").read_text()  # the worker's own log, kept
    assert plot.read_bytes()[:4] == b"\x89PNG"
    idle = rollouts("bench-sync", "--sizes", "tiny", "--transports", "nccl", "--rounds", "2", "--idle", timeout=300)
    assert idle.returncode == 0, idle.stderr
    assert json.loads(idle.stdout)["results"][0]["broadcast_s"] > 0
    assert_clean_error(rollouts("bench-sync", "--sizes", "huge"), "unknown sizes ['huge']")


def test_bench_sync_says_which_transports_cannot_run_on_the_devices_given() -> None:
    def spec(device: str, kind: str = "torch") -> EngineSpec:
        return EngineSpec(kind=kind, model=Path("m"), device=device)

    assert "NCCL cannot put two ranks on one GPU" in (cannot_run("nccl", spec("cuda:0"), "cuda") or "")
    assert cannot_run("nccl", spec("cuda:1"), "cuda:0") is None
    assert cannot_run("ipc", spec("cuda"), "cuda:0") is None
    for worker, trainer, kind in [("cuda:1", "cuda:0", "torch"), ("cpu", "cpu", "torch"), ("cuda:0", "cuda:0", "vllm")]:
        assert "same GPU" in (cannot_run("ipc", spec(worker, kind), trainer) or ""), (worker, trainer, kind)
    assert cannot_run("fs", spec("cuda:0"), "cuda:0") is None
    # a vLLM worker of tensor parallel 2 holds two GPUs: the trainer may be on neither for nccl
    assert "NCCL cannot put two ranks on one GPU" in (cannot_run("nccl", spec("cuda:1,2", "vllm"), "cuda:2") or "")
    assert cannot_run("nccl", spec("cuda:1,2", "vllm"), "cuda:0") is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 needs --engine vllm"),
        (["--engine", "vllm", "--tensor-parallel-size", "2", "--device", "cuda:1"],
         "--tensor-parallel-size 2 needs as many GPUs in --device (cuda:1,2), not 'cuda:1'"),
    ],
)  # fmt: skip
def test_bench_sync_refuses_tensor_parallel_without_its_gpus_in_one_line(args: list[str], message: str) -> None:
    assert_clean_error(rollouts("bench-sync", *args), message)


def test_the_plot_leaves_out_the_transports_that_did_not_run(tmp_path: Path) -> None:
    ran = {"size": "tiny", "transport": "ipc", "bytes": 592_640, "stall_s": 0.036}
    skipped = {"size": "tiny", "transport": "nccl", "bytes": 592_640, "skipped": "NCCL cannot put two ranks on one GPU"}
    plot_bench_sync({"engine": "torch", "mode": "abort", "results": [ran, skipped]}, tmp_path / "sync.png")
    assert (tmp_path / "sync.png").read_bytes()[:4] == b"\x89PNG"

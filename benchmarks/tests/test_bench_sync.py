"""`rollouts bench-sync`: the stall of a weight sync per transport and model size, and which transports it skips."""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.bench_sync import (
    ENGINE_LINE,
    INTERRUPTED,
    SHAPES,
    TimedWorkerExtension,
    _next_version,
    breakdown_rounds,
    build_shaped_model,
    cannot_run,
    copies,
    model_name,
    plot_bench_sync,
    random_version,
    read_breakdown,
    shaped_tensors,
    summarize,
    why,
    write_sparse_safetensors,
)
from benchmarks.tests.test_lab_cli_errors import assert_refused_in_one_line, lab_here
from consumers.engines.vllm_extension import RolloutsWorkerExtension
from rollouts.engine_spec import EngineSpec
from tests.cli.test_cli import rollouts


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
    assert_refused_in_one_line(lab_here("bench-sync", "--sizes", "huge"), "unknown sizes ['huge']", code=2)


def test_bench_sync_says_which_transports_cannot_run_on_the_devices_given() -> None:
    def spec(device: str, kind: str = "torch") -> EngineSpec:
        return EngineSpec(kind=kind, model=Path("m"), device=device)

    assert "NCCL cannot put two ranks on one GPU" in (cannot_run("nccl", spec("cuda:0"), "cuda") or "")
    assert cannot_run("nccl", spec("cuda:1"), "cuda:0") is None
    assert cannot_run("ipc", spec("cuda"), "cuda:0") is None
    assert cannot_run("ipc", spec("cuda:0", "vllm"), "cuda:0") is None  # vLLM's worker process opens the handle
    for worker, trainer, kind in [
        ("cuda:1", "cuda:0", "torch"),
        ("cpu", "cpu", "torch"),
        ("cuda:1,2", "cuda:1", "vllm"),  # tensor parallel: two GPUs, one buffer
        ("cuda:0", "cuda:0", "synthetic"),
    ]:
        assert "same one GPU" in (cannot_run("ipc", spec(worker, kind), trainer) or ""), (worker, trainer, kind)
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
    """In this process, as its command line runs it (`lab_here`); the lab's command line itself is checked in
    test_lab_cli_errors.py."""
    assert_refused_in_one_line(lab_here("bench-sync", *args), message, code=2)


def test_the_plot_leaves_out_the_transports_that_did_not_run(tmp_path: Path) -> None:
    ran = {"size": "tiny", "transport": "ipc", "bytes": 592_640, "stall_s": 0.036}
    skipped = {"size": "tiny", "transport": "nccl", "bytes": 592_640, "skipped": "NCCL cannot put two ranks on one GPU"}
    plot_bench_sync({"engine": "torch", "mode": "abort", "results": [ran, skipped]}, tmp_path / "sync.png")
    assert (tmp_path / "sync.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_sync_measures_a_real_model_and_a_real_configuration_with_where_the_stall_went(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    result = rollouts(
        "bench-sync", "--model", str(tiny_model_dir), "--sizes", "qwen2-tiny", "--transports", "redis",
        "--rounds", "2", "--dtype", "bfloat16", "--one-worker", "--logs", str(logs), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["dtype"] == "bfloat16" and report["copy_tb_per_s"] is None  # no GPU: no floor
    model, shaped = report["results"]
    assert (model["size"], shaped["size"]) == (tiny_model_dir.name, "qwen2-tiny")
    assert model["parameters"] == 148_160 and model["bytes"] == 2 * 148_160  # bf16: 2 bytes a parameter
    assert shaped["parameters"] == 152_128 and shaped["trainer_copies"] == 2
    for row in (model, shaped):
        assert "error" not in row and "floor_s" not in row, row
        assert 0 < row["stall_s"] <= row["stall_p90_s"]
        # the breakdown, from the worker's log: pause + load + resume is the stall
        assert row["pause_s"] > 0 and row["load_s"] > 0 and row["fetch_s"] >= 0, row
        assert row["pause_s"] + row["load_s"] + row["resume_s"] == pytest.approx(row["stall_s"], abs=2e-3)
    assert sorted(p.name for p in logs.iterdir()) == sorted([f"{tiny_model_dir.name}.log", "qwen2-tiny.log"])
    assert_refused_in_one_line(lab_here("bench-sync", "--model", str(tmp_path)), "not a model folder", code=2)


def test_the_real_configurations_have_their_models_parameters_and_a_tied_head_is_left_out() -> None:
    one, seven = shaped_tensors(SHAPES["qwen2.5-1.5b"]), shaped_tensors(SHAPES["qwen2.5-7b"])
    assert sum(math.prod(shape) for _, shape in one) == 1_543_714_304  # Qwen2.5-1.5B's count
    assert sum(math.prod(shape) for _, shape in seven) == 7_615_616_512  # Qwen2.5-7B's
    assert "lm_head.weight" not in dict(one) and dict(seven)["lm_head.weight"] == (152_064, 3584)
    assert dict(one)["model.layers.0.self_attn.k_proj.weight"] == (256, 1536)  # 2 KV heads of 128


def test_a_shaped_model_folder_loads_with_zero_weights_from_a_sparse_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = build_shaped_model(tmp_path / "m", SHAPES["qwen2-tiny"])
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 1
    assert all(not p.any() for p in model.parameters())
    big = tmp_path / "big.safetensors"
    write_sparse_safetensors(big, [("a", (4096, 4096)), ("b", (7,))], "BF16", 2)
    assert big.stat().st_size > 32 * 2**20 and big.stat().st_blocks * 512 < 2**20  # a hole, not 32 MiB written
    with safe_open(big, framework="pt") as handle:
        assert handle.get_tensor("b").dtype == torch.bfloat16 and not handle.get_tensor("a").any()


def test_the_trainers_versions_differ_from_one_publish_to_the_next() -> None:
    shapes = shaped_tensors(SHAPES["qwen2-tiny"])
    version = random_version(shapes, torch.bfloat16, "cpu", seed=0)
    assert version["model.norm.weight"].eq(1).all() and version["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert 0.015 < version["model.embed_tokens.weight"].float().std() < 0.025
    other = random_version(shapes, torch.bfloat16, "cpu", seed=1)
    assert _next_version([version, other], 0) is other and _next_version([version, other], 1) is version
    before = version["model.embed_tokens.weight"].clone()
    assert _next_version([version], 0)["model.embed_tokens.weight"].equal(-before)  # one held: negated in place
    assert copies(10**12, "cpu") == 2


def test_the_breakdown_comes_from_the_workers_log(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text(
        "(EngineCore pid=1) bench-sync engine load: ipc version 1 open_s 0.007000 reload_s 0.450000 wait_s 0.000100 "
        "tensors 338\n"
        "   INFO  w: sync 1: fetched or joined in 0.000 s, paused in 0.053 s, version 1 loaded and acked in 0.475 s "
        " sync.py:378\n"
        "(EngineCore pid=1) bench-sync engine load: blob version -1 open_s 2.000000 reload_s 0.600000 wait_s 0.000000 "
        "tensors 338\n"
        "   INFO  w: sync 2: fetched or joined in 5.000 s, paused in 0.020 s, version 2 loaded and acked in 15.000 s\n"
    )
    found = read_breakdown(log)
    assert found[1]["engine_reload_s"] == 0.45 and found[2]["fetch_s"] == 5.0
    assert found[1]["engine_rest_s"] == pytest.approx(0.475 - 0.007 - 0.45 - 0.0001)
    rounds = breakdown_rounds([0.6, 15.2], [1, 2], found)
    assert rounds["resume_s"] == pytest.approx([0.6 - 0.053 - 0.475, 15.2 - 0.02 - 15.0])
    assert breakdown_rounds([0.6], [3], found) == {}  # a sync the log lacks: no breakdown rather than a wrong one
    summary = summarize({"stall_s": [0.6, 0.2, 0.3, 0.25]})
    assert (
        summary["stall_s"] == 0.25 and summary["stall_p90_s"] == pytest.approx(0.29) and summary["first_stall_s"] == 0.6
    )
    assert why(KeyboardInterrupt()) == INTERRUPTED and why(ValueError("x")) == "ValueError: x"


def test_the_timed_extension_times_the_engines_load_and_keeps_to_the_engines_steps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from safetensors.torch import save

    class Worker(TimedWorkerExtension):  # vLLM's worker, as far as the extension uses it
        def __init__(self) -> None:
            self.device = torch.device("cpu")
            self.loaded: list[str] = []
            self._rollouts_layerwise = "vLLM repacks weights after loading them on cpu"

        def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
            self.loaded += [name for name, _ in weights_iterator or ()]

    worker = Worker()
    assert worker.rollouts_load_safetensors(save({"a": torch.zeros(2), "b": torch.ones(3)})) == 2
    assert sorted(worker.loaded) == ["a", "b"]  # safetensors may lay tensors out in any order
    line = ENGINE_LINE.search(capsys.readouterr().err)
    assert line is not None and line.group(1) == "blob" and line.group(6) == "2"
    # The timed methods repeat the engine's own steps, with clocks between them: the engine's must still be these.
    reload = "self.rollouts_reload(iter(tensors.items()))"
    for method, steps in [
        ("rollouts_load_handover", ["with opened_handover(", "tensors = dict(opened)", reload, "return len(tensors)"]),
        ("rollouts_load_safetensors", ["tensors = load(blob)", reload, "return len(tensors)"]),
    ]:
        source = inspect.getsource(getattr(RolloutsWorkerExtension, method))
        assert all(step in source for step in steps), method


def test_a_real_models_name_is_its_title(tmp_path: Path) -> None:
    (tmp_path / "rollouts-model.json").write_text(json.dumps({"title": "SmolLM2-135M-Instruct"}))
    assert model_name(tmp_path) == "SmolLM2-135M-Instruct"
    assert model_name(tmp_path / "elsewhere") == "elsewhere"
    assert os.sep not in model_name(tmp_path)


def test_bench_sync_measures_deltas_against_whole_syncs_side_by_side_on_real_training_steps(
    tiny_model_dir: Path,
) -> None:
    """`--deltas`: real AdamW steps of the model before each publish; redis and fs each measured whole and with deltas
    on one worker, the delta rows reading a few percent of what the whole rows read (after their first: no base).
    Two rounds: the first whole, the second a delta (a chain of them: tests/staleness/test_delta.py)."""
    result = rollouts(
        "bench-sync", "--model", str(tiny_model_dir), "--transports", "redis,fs", "--rounds", "2",
        "--dtype", "bfloat16", "--deltas", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["results"]
    assert report["deltas"] and [(r["transport"], r["deltas"]) for r in rows] == [
        ("redis", False), ("redis", True), ("fs", False), ("fs", True)
    ]  # fmt: skip
    for whole, delta in (rows[:2], rows[2:]):
        assert "error" not in whole and "error" not in delta, (whole, delta)
        assert whole["read_bytes"] == whole["bytes"] == delta["first_read_bytes"], "the first delta publish: whole"
        assert 0 < delta["read_bytes"] < 0.2 * whole["read_bytes"], delta
        assert delta["stall_s"] > 0 and whole["stall_s"] > 0
    assert 0 < rows[1]["redis_out_bytes"] < 0.3 * rows[0]["redis_out_bytes"], "Redis sent the deltas, not versions"

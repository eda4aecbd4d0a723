"""A mixture-of-experts policy (a random Qwen2-MoE: 8 experts, top-2, a shared expert) through the whole pipeline: a
torch worker and a vLLM worker serve it, every token's logprob its version's forward pass. The torch worker takes a
sync (the checkpoint's per-expert tensors merged into transformers' fused ones); vLLM's CPU build reloads MoE weights
wrongly, so its worker refuses the sync in one line and its samples finish elsewhere. Routed experts are not on the
wire (vLLM 0.32's CPU build cannot return them; on the GPU see `benchmarks/probes/moe_routing.py`)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_processes, wait_for_worker
from producers.client import RolloutClient
from staleness.weights.base import read_checkpoint, state_dict_of
from staleness.weights.fused import is_fused, to_module
from tests.fixtures import FAST
from tests.reference import check_spans_and_logprobs


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Versions 0 and 1 of one MoE architecture (weights seeds 0 and 1)."""
    return {v: build_tiny_model(tmp_path_factory.mktemp(f"moe-v{v}"), seed=v, experts=8, top_k=2) for v in (0, 1)}


@pytest.fixture
def moe_fleet(
    redis_server: RedisServer, ns: str, moe_models: dict[int, Path], tmp_path: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    fleet: list[subprocess.Popen[bytes]] = []
    beat = redis.Redis.from_url(redis_server.url)
    try:
        for name, engine in (("torch-moe", "torch"), ("vllm-moe", "vllm")):
            log = tmp_path / f"{name}.log"
            args = (*FAST, "--engine", engine)
            fleet.append(start_worker(redis_server.url, ns, moe_models[0], name, *args, log_file=log))
        for name, process in zip(("torch-moe", "vllm-moe"), fleet, strict=True):
            wait_for_worker(beat, ns, name, process, timeout_s=240)
        yield fleet
    finally:
        stop_processes(fleet)
        beat.close()


def test_a_moe_module_is_published_in_its_checkpoints_names_and_the_torch_engine_merges_them_back(
    moe_models: dict[int, Path], tiny_model_dir: Path
) -> None:
    """transformers 5 holds each layer's experts fused (`mlp.experts.gate_up_proj`); the wire, checkpoints and vLLM
    name each expert's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_models[1])
    assert is_fused(model) and any(name.endswith("experts.gate_up_proj") for name in model.state_dict())
    published, checkpoint = state_dict_of(model), read_checkpoint(moe_models[1])
    assert sorted(published) == sorted(checkpoint)
    assert all(torch.equal(published[name], checkpoint[name]) for name in checkpoint)
    merged, own = to_module(model, checkpoint), model.state_dict()
    assert sorted(merged) == sorted(own) and all(torch.equal(merged[name], own[name]) for name in own)
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not is_fused(dense) and sorted(state_dict_of(dense)) == sorted(read_checkpoint(tiny_model_dir))


@pytest.mark.vllm
def test_a_moe_policy_serves_exactly_on_torch_and_vllm_and_syncs_into_torch_while_vllm_on_cpu_refuses_its_reload(
    redis_server: RedisServer,
    ns: str,
    moe_models: dict[int, Path],
    moe_fleet: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    client = RolloutClient(redis_server.url, ns)
    for i in range(8):
        client.submit(tokens=[5 + i, 6, 7, 8], n=2, max_tokens=200, temperature=1.0, seed=i)
    first = client.collect(2, timeout=120)  # the rest are still running when the sync interrupts them
    assert client.publish_weights(moe_models[1], mode="abort") == 1
    report = client.last_sync
    assert report is not None and report.acked == ["torch-moe"] and report.gone == ["vllm-moe"], report
    log = " ".join((tmp_path / "vllm-moe.log").read_text().split())  # its lines are wrapped
    assert "reloads a mixture of experts' weights wrongly" in log and "--engine torch" in log, log[-2000:]
    groups = first + client.collect(6, timeout=240)  # the vLLM worker's samples are finished by the torch worker
    assert len({g.prompt_id for g in groups}) == 8  # every prompt once
    for group in groups:
        for rollout in group.rollouts:  # MoE routing and all: v0's on both engines, v1's on torch after its merge
            check_spans_and_logprobs(rollout, moe_models)
    assert any(len(r.spans) == 2 for g in groups for r in g.rollouts)  # interrupted samples went on under v1

"""A mixture-of-experts policy (a random Qwen2-MoE: 8 experts, top-2, a shared expert) through the whole pipeline: a
torch worker and a vLLM worker serve it, every token's logprob its version's forward pass. The torch worker takes a
sync (the checkpoint's per-expert tensors merged into transformers' fused ones); vLLM's CPU build reloads MoE weights
wrongly, so its worker refuses the sync in one line and its samples finish elsewhere. Rollouts carry each position's
routed experts when asked (rollout routing replay): the torch engine's, across a sync, and the refusals of engines that
cannot. vLLM 0.32's CPU build cannot return them (its model runner V2 needs Triton); its CUDA build's are tested on a
GPU (skipped elsewhere, run on the device machine: `benchmarks/device/run_gpu_tests.sh`)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import redis
import torch

from consumers.engines.base import EngineInputError, EngineLifecycle
from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_processes, wait_for_worker
from pipeline.wire import PauseMode, Rollout, Sampling
from producers.client import Batch, Group, RolloutClient
from producers.grpo import grpo_step
from producers.routing import routes_replayed
from staleness.weights.fused import is_fused, routers, to_module
from staleness.weights.sources import read_checkpoint, state_dict_of
from tests.fixtures import FAST, wait_until
from tests.reference import check_spans_and_logprobs, forward_logprobs, forward_routes


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
        client.submit(tokens=[5 + i, 6, 7, 8], n=2, max_tokens=400, temperature=1.0, seed=i)
    first = client.collect(1, timeout=120)  # the rest are still running when the sync interrupts them
    assert client.publish_weights(moe_models[1], mode="abort") == 1
    report = client.last_sync
    assert report is not None and report.acked == ["torch-moe"] and report.gone == ["vllm-moe"], report
    log = " ".join((tmp_path / "vllm-moe.log").read_text().split())  # its lines are wrapped
    assert "reloads a mixture of experts' weights wrongly" in log and "--engine torch" in log, log[-2000:]
    groups = first + client.collect(7, timeout=240)  # the vLLM worker's samples are finished by the torch worker
    assert len({g.prompt_id for g in groups}) == 8  # every prompt once
    for group in groups:
        for rollout in group.rollouts:  # MoE routing and all: v0's on both engines, v1's on torch after its merge
            check_spans_and_logprobs(rollout, moe_models)
    assert any(len(r.spans) == 2 for g in groups for r in g.rollouts)  # interrupted samples went on under v1


def test_rollouts_carry_the_experts_the_torch_engine_routed_each_position_to_across_a_sync(
    redis_server: RedisServer, ns: str, moe_models: dict[int, Path], tmp_path: Path
) -> None:
    """Routing replay's input: every position of prompt and tokens but the last, each layer's top-k, as the version
    that last read it routed it (a sample interrupted by the sync was read again by v1 when it went on)."""
    beat = redis.Redis.from_url(redis_server.url)
    worker = start_worker(redis_server.url, ns, moe_models[0], "torch-moe", *FAST, log_file=tmp_path / "w.log")
    try:
        wait_for_worker(beat, ns, "torch-moe", worker, timeout_s=240)
        client = RolloutClient(redis_server.url, ns)
        for i in range(8):
            client.submit(tokens=[5 + i, 6, 7, 8], n=2, max_tokens=300, seed=i, routed_experts=i > 0, id=f"p{i}")
        first = client.collect(1, timeout=120)  # the rest are still running when the sync interrupts them
        assert client.publish_weights(moe_models[1], mode="abort") == 1
        groups = first + client.collect(7, timeout=240)
    finally:
        stop_processes([worker])
        beat.close()
    assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(8)]
    rollouts = [r for g in groups for r in g.rollouts]
    assert any(len(r.spans) == 2 for r in rollouts), "no sample was interrupted by the sync"
    for rollout in rollouts:
        if rollout.prompt_id == "p0":  # not asked
            assert rollout.routed_experts is None
            continue
        sequence = rollout.prompt_tokens.tolist() + rollout.tokens.tolist()[:-1]
        assert rollout.routed_experts is not None and rollout.routed_experts.shape == (len(sequence), 2, 2)
        expected = forward_routes(moe_models[rollout.spans[-1][0]], sequence)
        assert np.array_equal(np.sort(rollout.routed_experts, axis=-1), expected), rollout.id

    # The reference trainer's step replays them: aligned with input_ids (-1 past them), then routed as given.
    from transformers import AutoModelForCausalLM

    asked = Batch([g for g in groups if g.prompt_id != "p0"])
    arrays = asked.to_arrays()
    row = asked.rollouts[0]
    positions = len(row.prompt_tokens) + row.n_tokens - 1
    assert row.routed_experts is not None
    assert np.array_equal(arrays["routed_experts"][0, :positions], row.routed_experts)
    assert (arrays["routed_experts"][0, positions:] == -1).all()
    policy = AutoModelForCausalLM.from_pretrained(moe_models[1])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    step = grpo_step(policy, optimizer, asked, lambda r: float(r.n_tokens % 3), replay_routes=True, minibatches=2)
    assert np.isfinite(step.loss) and step.grad_norm > 0
    unasked = Batch([g for g in groups if g.prompt_id == "p0"])
    with pytest.raises(ValueError, match=r"replay_routes: the batch's rollouts carry no routed experts; submit with"):
        grpo_step(policy, optimizer, unasked, lambda r: 0.0, replay_routes=True)


def test_engines_that_cannot_route_answer_with_a_line_that_says_what_to_start(
    tiny_model_dir: Path, moe_models: dict[int, Path]
) -> None:
    """A dense model on the torch engine, vLLM without `enable_return_routed_experts`, the remote and synthetic
    engines."""
    from consumers.engines.remote_engine import RemoteVllmEngine
    from consumers.engines.synthetic_engine import SyntheticEngine
    from consumers.engines.torch_engine import TorchEngine
    from consumers.engines.vllm_engine import VllmEngine

    asked = Sampling(max_tokens=4, routed_experts=True)
    prompt = np.array([5, 6, 7])
    torch_engine = TorchEngine(tiny_model_dir)
    with pytest.raises(EngineInputError, match=r"routed_experts were asked for, but the model has no mixture-of"):
        asyncio.run(_generate_then_stop(torch_engine, prompt, asked))
    with pytest.raises(EngineInputError, match=r"start it with --engine-args '\{\"enable_return_routed_experts\": "):
        asyncio.run(VllmEngine(moe_models[0]).generate("r", prompt, asked))  # refused before vLLM starts
    with pytest.raises(EngineInputError, match=r"the model is not a mixture of experts \(its config names no experts"):
        asyncio.run(VllmEngine(tiny_model_dir).generate("r", prompt, asked))
    with pytest.raises(EngineInputError, match=r"the synthetic engine runs no model, so it routes nothing"):
        asyncio.run(SyntheticEngine().generate("r", prompt, asked))
    remote = RemoteVllmEngine(moe_models[0], url="http://127.0.0.1:9")  # refused before any request is sent
    with pytest.raises(EngineInputError, match=r"the remote engine does not ask its server for them .*: serve these"):
        asyncio.run(remote.generate("r", prompt, asked))


def test_a_batch_aligns_the_routes_it_has_and_refuses_routes_of_two_models() -> None:
    """`Batch.to_arrays()["routed_experts"]`: a rollout's routes under its `input_ids`, -1 past them and for a rollout
    that carries none (it routes as the model does); rollouts routed over other layers or top-k, a `ValueError`."""

    def rollout(sample: int, routes: np.ndarray | None) -> Rollout:
        return Rollout(
            prompt_id="p", sample=sample, n=3, version=0, version_end=0, finish_reason="length", worker="w",
            prompt_tokens=[1, 2, 3], tokens=[4, 5], logprobs=[-1.0, -1.0], spans=[(0, 0, 2)], routed_experts=routes,
        )  # fmt: skip

    routes = np.arange(16, dtype=np.int16).reshape(4, 2, 2)
    group = [rollout(0, routes), rollout(1, None), rollout(2, routes[:, :1])]
    aligned = Batch([Group("p", group[:2])]).to_arrays()["routed_experts"]
    assert aligned.shape == (2, 5, 2, 2) and aligned.dtype == np.int16
    assert np.array_equal(aligned[0, :4], routes) and (aligned[0, 4:] == -1).all() and (aligned[1] == -1).all()
    assert "routed_experts" not in Batch([Group("p", group[1:2])]).to_arrays()
    with pytest.raises(ValueError, match=r"routed experts have several \[layers, top_k\]: \[\(1, 2\), \(2, 2\)\]"):
        Batch([Group("p", group)]).to_arrays()


async def _generate_then_stop(engine: Any, prompt: np.ndarray, sampling: Sampling) -> None:
    try:
        await engine.generate("r", prompt, sampling)
    finally:
        await engine.shutdown()


ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM returns routed experts on its CUDA build only")


@ON_CUDA
@pytest.mark.vllm
@pytest.mark.parametrize("sync", [None, "keep"], ids=["plain", "keep-sync"])
def test_a_vllm_worker_on_a_gpu_puts_its_routed_experts_on_the_wire(
    redis_server: RedisServer, ns: str, moe_models: dict[int, Path], tmp_path: Path, sync: PauseMode | None
) -> None:
    """vLLM started with `enable_return_routed_experts`: one route per position of prompt and tokens but the last, each
    layer's top-2 of 8 experts, mostly the trainer's for the version that last read them (a GPU's kernels are not the
    trainer's, so not all: chance is 1/28 a pair). With a `keep` sync mid-generation (vLLM recomputes what it kept)
    too: no route left off, none doubled."""
    beat = redis.Redis.from_url(redis_server.url)
    args: tuple[str, ...] = ("--engine", "vllm", "--kv-cache-bytes", "1000000000", "--engine-args",
            '{"enable_return_routed_experts": true}')  # fmt: skip
    if sync is not None:  # a group at a time, so that the sync finds one in flight (all at once, a GPU ends them first)
        args += ("--max-inflight", "2")
    worker = start_worker(redis_server.url, ns, moe_models[0], "vllm-moe", *FAST, *args, log_file=tmp_path / "w.log")
    try:
        wait_for_worker(beat, ns, "vllm-moe", worker, timeout_s=300)
        client = RolloutClient(redis_server.url, ns)
        prompts = 4 if sync is None else 8
        for i in range(prompts):
            client.submit(tokens=[5 + i, 6, 7, 8], n=2, max_tokens=48 if sync is None else 400, seed=i,
                          routed_experts=True)  # fmt: skip
        if sync is not None:
            key = client.streams.keys.worker("vllm-moe")
            wait_until(lambda: int(beat.hget(key, "inflight") or 0) > 0, 60, "a group taken")
            assert client.publish_weights(moe_models[1], mode=sync) == 1
        rollouts = [r for g in client.collect(prompts, timeout=240) for r in g.rollouts]
    finally:
        stop_processes([worker])
        beat.close()
    same = total = 0
    for rollout in rollouts:
        sequence = rollout.prompt_tokens.tolist() + rollout.tokens.tolist()[:-1]
        assert rollout.routed_experts is not None and rollout.routed_experts.shape == (len(sequence), 2, 2)
        assert rollout.routed_experts.min() >= 0 and rollout.routed_experts.max() < 8
        expected = forward_routes(moe_models[rollout.spans[-1][0]], sequence)
        same += int((np.sort(rollout.routed_experts, axis=-1) == expected).all(axis=-1).sum())
        total += expected.shape[0] * expected.shape[1]
    print(f"routed alike the trainer's fp32 forward pass: {same / total:.3f} of {total} (position, layer) pairs")
    assert same / total > 0.5
    if sync is not None:
        # A sample in flight at the sync: its first tokens are nearer v0's forward pass, its last nearer v1's (vLLM
        # 0.26, the device's build, tags no per-token versions, so its spans cannot say it; its fused MoE kernels
        # are not the trainer's, so nearer, not equal).
        switched = 0
        for rollout in rollouts:
            prompt, tokens = rollout.prompt_tokens.tolist(), rollout.tokens.tolist()
            off = [np.abs(rollout.logprobs - forward_logprobs(moe_models[v], prompt, tokens)) for v in (0, 1)]
            nearer_v0 = off[0] < off[1]
            switched += bool(len(tokens) >= 10 and nearer_v0[:5].all() and not nearer_v0[-5:].any())
        assert switched, "no sample was in flight at the sync"


def test_a_trainer_replays_the_engines_routes_and_its_router_still_learns(
    moe_models: dict[int, Path], tiny_model_dir: Path
) -> None:
    """`routes_replayed`: the model's own routes change nothing; another version's are taken as given (-1: its own);
    the routing weights stay the router's, so its gradient is there; what does not fit is refused in one line."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_models[1]).eval()
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    ids = torch.tensor([tokens])
    own, other = (torch.from_numpy(forward_routes(moe_models[v], tokens)) for v in (1, 0))
    assert not torch.equal(own, other)  # the two versions route some positions apart
    plain = model(ids).logits
    with routes_replayed(model, own[None]):
        assert torch.allclose(model(ids).logits, plain, atol=1e-6)

    given = other.clone()
    given[2] = -1  # no route for position 2: the router's own
    picked: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: picked.append(out[-1])) for r in routers(model)]
    with routes_replayed(model, given[None]):
        replayed = model(ids).logits
    for hook in hooks:
        hook.remove()
    taken = torch.stack(picked, dim=1).sort(dim=-1).values
    expected = other.clone()
    expected[2] = own[2]
    assert torch.equal(taken, expected) and not torch.allclose(replayed, plain, atol=1e-4)
    assert "forward" not in vars(routers(model)[0])  # routed as before outside

    model.zero_grad()
    with routes_replayed(model, other[None]):
        model(ids).logits[0, -1].logsumexp(-1).backward()
    # torch types a module's attributes Tensor | Module.
    weights = [cast(torch.Tensor, r.weight) for r in routers(model)]
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in weights)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.train().gradient_checkpointing_enable()  # the backward recomputes each layer's forward: replayed too
    model.zero_grad()
    with routes_replayed(model, other[None]):
        model(ids).logits[0, -1].logsumexp(-1).backward()
    model.gradient_checkpointing_disable()
    model.eval()
    for name, grad in grads.items():
        assert torch.allclose(model.get_parameter(name).grad, grad, atol=1e-6), name

    wrong = torch.zeros(1, 8, 3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"routes of shape \[1, 8, 3, 2\] do not fit the model: expected \[batch, "):
        routes_replayed(model, wrong).__enter__()
    with pytest.raises(ValueError, match=r"routes for 1 x 4 positions, but the forward pass routes 8: pass the"), \
            routes_replayed(model, own[None, :4]):  # fmt: skip
        model(ids)
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match=r"needs a mixture of experts with the routers of transformers' Qwen2-MoE, "):
        routes_replayed(dense, own[None]).__enter__()


def test_a_torch_engine_in_a_process_of_its_own_sends_its_routes_across(moe_models: dict[int, Path]) -> None:
    """`--engine-process`: the routes cross the engine's socket (int16 bytes and their shape) as the engine made
    them."""
    from consumers.engines import create_engine

    asked = Sampling(max_tokens=12, seed=3, routed_experts=True)
    prompt = np.array([5, 6, 7, 8])

    async def routes(process: bool) -> Any:
        engine = create_engine("torch", str(moe_models[0]), process=process, num_threads=1)
        assert isinstance(engine, EngineLifecycle)  # `async with`: every engine inherits it
        async with engine:
            return await engine.generate("r", prompt, asked)

    apart, here = asyncio.run(routes(True)), asyncio.run(routes(False))
    assert apart.tokens.tolist() == here.tokens.tolist()
    assert apart.routed_experts is not None and apart.routed_experts.dtype == np.int16
    assert np.array_equal(apart.routed_experts, here.routed_experts)
    assert apart.routed_experts.shape == (len(prompt) + len(apart.tokens) - 1, 2, 2)

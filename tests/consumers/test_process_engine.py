"""The engine in a process of its own (`--engine-process`, `consumers.engines.process_engine`): the same engine, the
same answers, across the channel; its process lives and dies with its worker."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file

from consumers.engines import create_engine
from consumers.engines.base import EngineClosedError, EngineInputError, Generation
from consumers.engines.process_engine import ProcessEngine
from consumers.engines.tiny_model import make_adapter
from consumers.engines.torch_engine import TorchEngine
from pipeline.local import RedisServer, free_port
from pipeline.wire import GENERATORS, Sampling
from producers.client import RolloutClient
from staleness.weights.ipc import ipc_device
from tests.consumers.test_torch_engine import LONG_PROMPT, LONG_SEED
from tests.fixtures import StartWorker, holds_work, wait_until
from tests.reference import check_spans_and_logprobs, forward_logprobs, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4


def run(go: Any, model_dir: Path, **options: Any) -> Any:
    """`go(engine)` on a started engine in a process of its own, shut down after."""

    async def main() -> Any:
        engine = create_engine("torch", str(model_dir), process=True, num_threads=1, **options)
        assert isinstance(engine, ProcessEngine)
        async with engine:
            return await go(engine)

    return asyncio.run(main())


def engine_process(engine: ProcessEngine) -> psutil.Process:
    assert engine._process is not None
    return psutil.Process(engine._process.pid)


def test_it_gives_the_in_process_engines_tokens_and_true_logprobs(tiny_model_dir: Path) -> None:
    prompts = random_prompts([3, 9, 17, 5, 12, 7])
    samplings = [Sampling(max_tokens=24, temperature=t, seed=i) for i, t in enumerate([0.0, 0.7, 1.0] * 2)]

    async def both(engine: Any) -> list[Generation]:
        return list(
            await asyncio.gather(
                *(engine.generate(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, samplings, strict=True)))
            )
        )

    async def in_process() -> list[Generation]:
        async with TorchEngine(tiny_model_dir, num_threads=1) as engine:
            return await both(engine)

    apart, here = run(both, tiny_model_dir), asyncio.run(in_process())
    for prompt, a, b in zip(prompts, apart, here, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.finish_reason == b.finish_reason
        assert a.spans == b.spans == [(0, 0, len(a.tokens))]
        assert a.tokens.dtype == np.int32 and a.logprobs.dtype == np.float32
        np.testing.assert_allclose(
            a.logprobs, forward_logprobs(tiny_model_dir, prompt.tolist(), a.tokens.tolist()), atol=ATOL
        )


def test_errors_keep_their_kind_and_the_engine_goes_on(
    tiny_model_dir: Path, tiny_model_dir_v1: Path, tmp_path: Path
) -> None:
    from consumers.engines.tiny_model import build_tiny_model

    wide = build_tiny_model(tmp_path / "wide", seed=2, hidden_size=128)

    async def go(engine: ProcessEngine) -> None:
        ok = Sampling(max_tokens=4, seed=1)
        with pytest.raises(EngineInputError, match=r"token ids must be in \[0, 512\)"):
            await engine.generate("big", np.array([5, 10**9]), ok)
        with pytest.raises(EngineInputError, match="adapter 'nope' is not loaded"):
            await engine.generate("lora", np.array([5, 6]), ok, adapter="nope")  # refused in the engine's process
        with pytest.raises(ValueError, match="does not fit the model"):
            await engine.load_weights(str(wide), 1)  # checked in the engine's process
        with pytest.raises(ValueError, match="does not fit the model"):
            engine.check_fits({"model.embed_tokens.weight": (512, 128)}, "a wide model")  # checked here
        with pytest.raises(FileNotFoundError):
            await engine.load_weights(str(tmp_path / "nothing"), 1)
        assert engine.version == 0
        generation = await engine.generate("fine", np.array([5, 6, 7]), ok)
        assert len(generation.tokens) == 4 and generation.spans == [(0, 0, 4)]

    run(go, tiny_model_dir)


def test_weights_by_path_and_by_tensors_reach_the_engines_process(
    tiny_model_dir: Path, tiny_model_dir_v1: Path
) -> None:
    prompt = np.array([9, 40, 41, 42], dtype=np.int32)
    sampling = Sampling(max_tokens=16, seed=5)

    async def go(engine: ProcessEngine) -> list[tuple[int, Generation]]:
        seen = []
        await engine.load_weights(str(tiny_model_dir_v1), 1)
        seen.append((engine.version, await engine.generate("a", prompt, sampling)))
        v0 = load_file(tiny_model_dir / "model.safetensors")
        await engine.load_tensors({k: t.to(torch.float32) for k, t in v0.items()}, 2)
        seen.append((engine.version, await engine.generate("b", prompt, sampling)))
        return seen

    (v1, on_v1), (v2, on_v0) = run(go, tiny_model_dir)
    assert (v1, v2) == (1, 2) and on_v1.spans[0][0] == 1 and on_v0.spans[0][0] == 2
    for model, generation in ((tiny_model_dir_v1, on_v1), (tiny_model_dir, on_v0)):
        expected = forward_logprobs(model, prompt.tolist(), generation.tokens.tolist())
        np.testing.assert_allclose(generation.logprobs, expected, atol=ATOL)


def test_pause_abort_keep_and_a_cancelled_request_cross_the_channel(
    tiny_model_dir: Path, tiny_model_dir_v1: Path
) -> None:
    prompt = LONG_PROMPT
    long = Sampling(max_tokens=400, seed=LONG_SEED)  # no eos within 500 tokens under the seed-0 weights

    async def go(engine: ProcessEngine) -> None:
        # abort: the request ends now, with its tokens so far
        task = asyncio.create_task(engine.generate("aborted", prompt, long))
        await asyncio.sleep(0.05)  # let it start (what follows does not depend on how many tokens it made: an idle
        # machine makes all 400 in under 0.3 s)
        await engine.pause("abort")
        aborted = await asyncio.wait_for(task, 30)
        assert aborted.finish_reason == "abort" and len(aborted.tokens) < 400
        await engine.resume()
        # keep: it goes on in place under the new weights, each token labelled with its version
        task = asyncio.create_task(engine.generate("kept", prompt, long))
        await asyncio.sleep(0.1)
        await engine.pause("keep")
        await engine.load_weights(str(tiny_model_dir_v1), 1)
        await engine.resume()
        kept = await asyncio.wait_for(task, 60)
        assert [v for v, _, _ in kept.spans] in ([0, 1], [1]), kept.spans
        # a cancelled call frees its request in the engine: its id serves again (once the cancel has arrived)
        task = asyncio.create_task(engine.generate("cancelled", prompt, long))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            try:
                again = await engine.generate("cancelled", prompt, Sampling(max_tokens=3, seed=1))
                break
            except EngineInputError as exc:
                assert "already in flight" in str(exc) and asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)  # the poll interval of this deadline wait
        assert len(again.tokens) == 3

    run(go, tiny_model_dir)


def test_lora_adapters_cross_the_channel(tiny_model_dir: Path) -> None:
    tensors, config = make_adapter(tiny_model_dir, list(range(100, 108)), seed=0)
    prompt = np.array([10, 11, 12, 13], dtype=np.int32)
    sampling = Sampling(max_tokens=20, seed=2)

    async def use(engine: Any) -> tuple[dict[str, int], Generation]:
        await engine.load_adapter("a", tensors, config, 3)
        return engine.adapters(), await engine.generate("lora", prompt, sampling, adapter="a")

    async def in_process() -> tuple[dict[str, int], Generation]:
        async with TorchEngine(tiny_model_dir, num_threads=1) as engine:
            return await use(engine)

    async def go(engine: ProcessEngine) -> tuple[dict[str, int], Generation]:
        loaded = await use(engine)
        bad = {k: v[:, :1] if v.ndim == 2 else v for k, v in tensors.items()}
        with pytest.raises(ValueError):
            await engine.load_adapter("bad", bad, config, 1)
        assert engine.adapters() == {"a": 3}
        await engine.remove_adapter("a")
        assert engine.adapters() == {}
        return loaded

    (adapters, apart), (_, here) = run(go, tiny_model_dir), asyncio.run(in_process())
    assert adapters == {"a": 3} and apart.spans == [(3, 0, len(apart.tokens))]
    assert apart.tokens.tolist() == here.tokens.tolist()
    np.testing.assert_allclose(apart.logprobs, here.logprobs, atol=ATOL)


def test_a_killed_engine_process_fails_what_waits_and_the_engine_says_it_is_closed(tiny_model_dir: Path) -> None:
    async def go(engine: ProcessEngine) -> None:
        waiting = asyncio.create_task(engine.generate("doomed", LONG_PROMPT, Sampling(max_tokens=400, seed=LONG_SEED)))
        await asyncio.sleep(0.2)
        engine_process(engine).kill()
        with pytest.raises(EngineClosedError, match=r"exited \(code -9\)"):
            await asyncio.wait_for(waiting, 30)
        with pytest.raises(EngineClosedError):
            await engine.generate("after", np.array([5, 6]), Sampling(max_tokens=4))

    run(go, tiny_model_dir)


def test_what_cannot_run_in_a_process_of_its_own_says_why(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="vllm engine already runs its compute outside the worker"):
        create_engine("vllm", str(tiny_model_dir), process=True)
    engine = create_engine("torch", str(tiny_model_dir), process=True)
    assert (engine.name, engine.max_model_len, engine.vocab_size) == ("torch", 512, 512)  # known before any start
    with pytest.raises(ValueError, match="--engine-process"):
        ipc_device(engine)


def test_a_worker_with_its_engine_apart_syncs_by_nccl_and_redis_and_its_engine_dies_with_it(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    worker = workers("apart", "--engine-process")
    children = psutil.Process(worker.pid).children()
    (engine,) = [p for p in children if "consumers.engines.engine_host" in " ".join(p.cmdline())]
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[6 + i, 50, 51], n=2, max_tokens=200, seed=i) for i in range(12)]
    wait_until(
        lambda: client.streams.redis.xpending(client.streams.keys.prompts, GENERATORS)["pending"] >= 4, 60, "work"
    )
    assert client.publish_weights(tiny_model_dir_v1, transport=f"nccl://127.0.0.1:{free_port()}") == 1
    assert client.publish_weights(tiny_model_dir, transport="redis://") == 2
    rollouts = [r for g in client.collect(len(ids), timeout=240) for r in g.rollouts]
    assert len({r.id for r in rollouts}) == len(rollouts) == 2 * len(ids)
    for rollout in rollouts:
        check_spans_and_logprobs(rollout, {0: tiny_model_dir, 1: tiny_model_dir_v1, 2: tiny_model_dir})
    assert engine.is_running()

    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    wait_until(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, 30, "the engine to exit")


def test_a_worker_whose_engine_process_dies_exits_and_its_work_finishes_elsewhere(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    doomed = workers("doomed", "--engine-process")
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[4 + i, 20, 30], n=2, max_tokens=400, seed=i) for i in range(4)]
    wait_until(holds_work(client, "doomed"), 60, "the worker to take prompts")
    for child in psutil.Process(doomed.pid).children():
        if "consumers.engines.engine_host" in " ".join(child.cmdline()):
            child.kill()
    assert doomed.wait(timeout=60) == 1, "a worker whose engine died must exit with code 1"

    workers("rescuer")
    groups = client.collect(len(ids), timeout=120)
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    assert client.stats["duplicates"] == 0


def test_an_engine_that_cannot_start_leaves_no_process_and_says_why(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    broken = Path(shutil.copytree(tiny_model_dir, tmp_path / "broken"))
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    engine = create_engine("torch", str(broken), process=True)

    async def go() -> None:
        with pytest.raises(Exception, match="in the engine process") as raised:
            await engine.start()
        assert not isinstance(raised.value, EngineClosedError), "a failed start is the model's fault, not a dead engine"
        await engine.shutdown()

    asyncio.run(go())
    hosts = [p for p in psutil.Process().children() if "consumers.engines.engine_host" in command_line(p)]
    assert hosts == [], "the engine's process outlived its failed start"


def command_line(process: psutil.Process) -> str:
    """A child's command line; "" for one that is gone or a zombie (an earlier test's vLLM engine core, not yet
    reaped, once was one: its `cmdline()` raises)."""
    try:
        return " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return ""


def test_the_flag_puts_the_workers_engine_apart_and_a_vllm_worker_says_to_drop_it(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path
) -> None:
    """`--engine-process` reaches a worker's engine (and `rollouts bench`'s worker), never the engine `bench` calls
    directly; a vLLM worker asked for it refuses in one line."""
    from rollouts.engine_spec import EngineSpec
    from tests.cli.test_cli import assert_clean_error, rollouts

    spec = EngineSpec.from_flags({"engine": "torch", "engine_process": True}, tiny_model_dir)
    assert spec.options()["process"] is True and "process" not in spec.in_process_options()
    assert "--engine-process" in spec.worker_args()
    assert "--engine-process" not in EngineSpec(kind="torch", model=tiny_model_dir).worker_args()
    refused = rollouts("worker", "--redis", redis_server.url, "--ns", ns, "--model", str(tiny_model_dir),
                       "--engine", "vllm", "--engine-process")  # fmt: skip
    assert_clean_error(refused, "already runs its compute outside the worker: drop --engine-process")

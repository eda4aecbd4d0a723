"""`ipc://` (`staleness.weights.ipc`): colocated handoff over CUDA IPC handles.

On any machine: the uri, the handle and manifest encoding (JSON, no pickle) and its checks, the arguments given to
torch's `rebuild_cuda_tensor`, the refusals (tensors off the GPU, adapters, engines on the CPU, vLLM over two GPUs)
and the trainer's bookkeeping against a real Redis (what it keeps, releases and frees), with the CUDA export replaced.
On a GPU (skipped elsewhere, run on the device machine): a trainer and torch worker processes on one GPU, end to
end: the worker serves the new weights (logprobs of a forward pass under them), the trainer frees what it released,
a late worker opens the current version, and a CPU worker refuses it; and a vLLM worker (its CUDA build) whose
worker process opens the handle: it serves the new weights, and the trainer frees the version it left.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import redis
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from benchmarks.transport_state import held_bytes
from consumers.engines.torch_engine import TorchEngine
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_process
from pipeline.wire import Keys
from producers.client import RolloutClient
from staleness.weights import fetch_weights, ipc, load_version, open_transport
from staleness.weights.base import WeightsUri, parse_uri
from staleness.weights.buckets import TensorMeta
from staleness.weights.ipc import Handle, IpcTransport, Manifest, manifest_key
from staleness.weights.sources import state_dict_of
from tests.fixtures import FAST, StartWorker, wait_until
from tests.reference import check_spans_and_logprobs, forward_logprobs

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (run on the device machine)")
HANDLE = Handle(device=0, handle=b"\x00\x01cudaIpcMemHandle\xff" * 3, size=4096, offset=512, event=b"\x07" * 64,
                event_sync=True)  # fmt: skip
SAME_GPU = "ipc:// needs the trainer and the worker on the same GPU"


def manifest(version: int = 3, **changes: Any) -> dict[str, Any]:
    meta = Manifest(
        version=version,
        gpu="GPU-1234",
        host="trainer-host",
        pid=4242,
        handle=HANDLE,
        tensors=[(TensorMeta("a.weight", "float32", (8, 4)), 0), (TensorMeta("empty", "bfloat16", (0, 3)), -1)],
    )
    return json.loads(meta.to_json()) | changes


# -- uris and encoding -----------------------------------------------------------------------------


def test_ipc_uris() -> None:
    assert parse_uri("ipc://exp1/v3") == WeightsUri("ipc", "exp1", 3)
    assert parse_uri("ipc://{exp1}/v3") == WeightsUri("ipc", "exp1", 3)
    assert parse_uri("ipc://") == WeightsUri("ipc", "", None)
    assert str(parse_uri("ipc://exp1/v3")) == "ipc://exp1/v3"
    with pytest.raises(ValueError, match=r"expected ipc://exp1/v<version>"):
        parse_uri("ipc://exp1/adapters/a/v1")
    with pytest.raises(ValueError, match=r"expected one of fs://, redis://, nccl://, ipc://"):
        parse_uri("cuda://x")


def test_the_handle_travels_as_json_and_rebuilds_with_torchs_own_argument_order() -> None:
    wire = json.dumps(HANDLE.to_json())  # what goes to Redis: JSON text, bytes as base64
    assert Handle.from_json(json.loads(wire)) == HANDLE
    no_event = replace(HANDLE, event=None, event_sync=False)
    assert Handle.from_json(json.loads(json.dumps(no_event.to_json()))) == no_event
    args = inspect.signature(rebuild_cuda_tensor).bind(*HANDLE.rebuild_args(device_index=5)).arguments
    assert args["tensor_cls"] is torch.Tensor and args["storage_cls"] is torch.UntypedStorage
    assert (args["tensor_size"], args["tensor_stride"], args["tensor_offset"]) == ((4096,), (1,), 0)
    assert args["dtype"] is torch.uint8 and args["requires_grad"] is False
    assert args["storage_device"] == 5, "the worker opens on its own index of the GPU"
    assert (args["storage_handle"], args["storage_size_bytes"], args["storage_offset_bytes"]) == (
        HANDLE.handle, 4096, 512,
    )  # fmt: skip
    assert (args["event_handle"], args["event_sync_required"]) == (HANDLE.event, True)
    assert args["ref_counter_handle"] == b"", "workers open without torch's counter: the trainer frees by the protocol"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": 9}, r"v=9, format='cuda-ipc'; this reader knows v=1"),
        ({"format": "safetensors"}, r"this reader knows v=1, format='cuda-ipc'"),
        ({"version": 4}, r"it is of version 4, not 3"),
        ({"gpu": None}, r"names no GPU"),
        ({"handle": {**HANDLE.to_json(), "handle": "not base64!"}}, r"'handle' is not base64"),
        ({"handle": {**HANDLE.to_json(), "size": -1}}, r"'size' must be an integer >= 0"),
        ({"handle": {**HANDLE.to_json(), "event_sync": "yes"}}, r"'event_sync' must be true or false"),
        ({"tensors": [["a", "float99", [1], 0]]}, r"bad tensor entry .*unknown tensor dtype 'float99'"),
        ({"tensors": [["a", "float32"]]}, r"bad tensor entry"),
    ],
)
def test_a_malformed_manifest_says_what_is_wrong(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=rf"ipc manifest k is malformed: .*{message}"):
        Manifest.from_json(json.dumps(manifest(**change)), "k", 3)
    with pytest.raises(ValueError, match=r"ipc manifest k is malformed"):
        Manifest.from_json(b"\x80\x04pickle?", "k", 3)
    parsed = Manifest.from_json(json.dumps(manifest()), "k", 3)
    assert parsed.handle == HANDLE and [m.name for m, _ in parsed.tensors] == ["a.weight", "empty"]


# -- refusals --------------------------------------------------------------------------------------


def test_the_trainer_refuses_what_it_cannot_hand_over(real_redis: redis.Redis, ns: str) -> None:
    transport = open_transport("ipc://", redis_client=real_redis, ns=ns)
    assert isinstance(transport, IpcTransport) and transport.uri_of(2) == f"ipc://{ns}/v2"
    with pytest.raises(ValueError, match=r"trainer's tensors must all be on one GPU.* \(they are on cpu\).*fs://"):
        transport.publish({"a": torch.zeros(3)}, 1)
    asked: list[str] = []

    def generator() -> Iterator[tuple[str, torch.Tensor]]:
        for name in ("a", "b", "c"):
            asked.append(name)
            yield name, torch.zeros(3)

    with pytest.raises(ValueError, match=r"trainer's tensors must all be on one GPU.* \(they are on cpu\)"):
        transport.publish(generator(), 1)
    assert asked == ["a"], "a tensor off the GPU is refused before the next is asked for"
    with pytest.raises(ValueError, match=r"LoRA adapters travel by fs://, redis:// or nccl://, not ipc://"):
        transport.publish({"a": torch.zeros(3)}, 1, adapter_config={"r": 8})
    with pytest.raises(ValueError, match=r"LoRA adapters travel by fs://, redis:// or nccl://, not ipc://"):
        open_transport("ipc://", redis_client=real_redis, ns=ns, adapter="a")
    with pytest.raises(ValueError, match=r"the ipc weight transport needs a Redis client"):
        open_transport("ipc://")
    with pytest.raises(ValueError, match=r"opened on the worker's GPU by its engine"):
        fetch_weights(f"ipc://{ns}/v1", 1)
    assert transport.versions() == [] and not real_redis.keys(f"{{{ns}}}:*")


def test_engines_that_cannot_reach_the_trainers_gpu_refuse_before_opening_anything(
    real_redis: redis.Redis, ns: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from consumers.engines import vllm_engine
    from consumers.engines.remote_engine import RemoteVllmEngine
    from consumers.engines.synthetic_engine import SyntheticEngine
    from consumers.engines.vllm_engine import VllmEngine

    real_redis.set(manifest_key(Keys(ns), 3), json.dumps(manifest()))
    cpu = TorchEngine(tiny_model_dir, device="cpu")  # not started: the refusal needs no weights
    with pytest.raises(ValueError, match=rf"{SAME_GPU}, but this torch worker runs on cpu: use nccl:// or fs://"):
        asyncio.run(load_version(cpu, f"ipc://{ns}/v3", 3, real_redis))
    with pytest.raises(ValueError, match=rf"{SAME_GPU}, but this synthetic worker runs on no GPU"):
        asyncio.run(load_version(SyntheticEngine(), f"ipc://{ns}/v3", 3, real_redis))
    with pytest.raises(ValueError, match=r"names version 3, not 4"):
        asyncio.run(load_version(cpu, f"ipc://{ns}/v3", 4, real_redis))

    remote = RemoteVllmEngine(tiny_model_dir, url="http://127.0.0.1:9")  # never reached: refused before
    with pytest.raises(ValueError, match=rf"{SAME_GPU}, .* but a remote engine's weights live in a server .*: publish"):
        asyncio.run(load_version(remote, f"ipc://{ns}/v3", 3, real_redis))

    vllm = VllmEngine(tiny_model_dir)  # not started: the refusals need no engine (the platform set as each asks)
    monkeypatch.setattr(vllm_engine, "current_platform", SimpleNamespace(is_cpu=lambda: True))
    with pytest.raises(ValueError, match=rf"{SAME_GPU}, but this vllm worker runs on the CPU: use nccl:// or fs://"):
        asyncio.run(load_version(vllm, f"ipc://{ns}/v3", 3, real_redis))
    monkeypatch.setattr(vllm_engine, "current_platform", SimpleNamespace(is_cpu=lambda: False))
    vllm.args["tensor_parallel_size"] = 2
    with pytest.raises(ValueError, match=r"this vllm worker holds its weights on 2 GPUs .*: use nccl://, which"):
        asyncio.run(load_version(vllm, f"ipc://{ns}/v3", 3, real_redis))


def test_a_worker_on_another_gpu_is_told_which_gpus_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """The UUID check alone (a one-GPU machine cannot show two GPUs): no CUDA call is made."""
    monkeypatch.setattr(ipc, "gpu_uuid", lambda device: "GPU-other")
    parsed = Manifest.from_json(json.dumps(manifest()), "k", 3)
    with pytest.raises(ValueError, match=rf"{SAME_GPU}: version 3 lies on GPU GPU-1234 of trainer-host, this "
                       r"worker's cuda:1 is GPU-other on .*; use nccl:// or fs://"):  # fmt: skip
        ipc.check_same_gpu(parsed, torch.device("cuda", 1))


# -- the trainer's bookkeeping (the CUDA export replaced) -----------------------------------------


class FakeExport:
    """Stands for `ipc.Export` on a machine without CUDA: records its close."""

    closed: ClassVar[list[int]] = []

    def __init__(self, tensors: dict[str, torch.Tensor] | Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        named = dict(tensors.items() if isinstance(tensors, dict) else tensors)
        self.version = version
        self.buffer = torch.zeros(sum(t.numel() * t.element_size() for t in named.values()), dtype=torch.uint8)
        metas = [(TensorMeta(n, "float32", tuple(t.shape)), 0) for n, t in named.items()]
        self.manifest = Manifest(version, "GPU-1234", "host", 1, HANDLE, metas)

    def close(self) -> None:
        FakeExport.closed.append(self.version)


@pytest.fixture
def fake_exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    FakeExport.closed = []
    monkeypatch.setattr(ipc, "export_tensors", FakeExport)
    monkeypatch.setattr(ipc, "_HELD", {})
    return FakeExport.closed


def test_the_trainer_keeps_the_current_version_and_frees_the_ones_every_worker_left(
    redis_server: RedisServer, ns: str, fake_exports: list[int]
) -> None:
    client = RolloutClient(redis_server.url, ns)
    keys = client.streams.keys
    weights = {"w": torch.ones(4, 4)}
    for expected in (1, 2, 3):  # no worker is live: each sync concludes at once
        assert client.publish_weights(weights, transport="ipc://") == expected
    exports = IpcTransport(client.streams.redis, ns)
    assert exports.versions() == [3] and fake_exports == [1, 2]
    assert [client.streams.redis.exists(manifest_key(keys, v)) for v in (1, 2, 3)] == [0, 0, 1]
    raw = client.streams.redis.get(manifest_key(keys, 3))
    assert raw is not None
    stored = json.loads(raw)  # plain JSON, readable in redis-cli
    assert stored["format"] == "cuda-ipc" and stored["tensors"] == [["w", "float32", [4, 4], 0]]
    assert client.streams.redis.hget(keys.state, "weights_uri") == f"ipc://{ns}/v3".encode()
    assert held_bytes() == 64

    with pytest.raises(FileExistsError, match=r"version 3 is exported by this process already"):
        exports.publish(weights, 3)
    client.streams.redis.set(manifest_key(keys, 4), b"left by a trainer process that is gone")
    assert exports.publish(weights, 4) == f"ipc://{ns}/v4", "a dead trainer's manifest is replaced"
    assert exports.release(keep=[4]) == [3] and fake_exports == [1, 2, 3]
    assert exports.remove(4) and not exports.remove(4) and exports.versions() == []
    assert not client.streams.redis.keys(f"{{{ns}}}:weights:ipc:*") and held_bytes() == 0


def test_moving_from_ipc_to_fs_frees_the_last_ipc_version(
    redis_server: RedisServer, ns: str, fake_exports: list[int], tmp_path: Path
) -> None:
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights({"w": torch.ones(2)}, transport="ipc://") == 1
    assert client.publish_weights({"w": torch.ones(2)}, transport=f"fs://{tmp_path}") == 2
    assert fake_exports == [1] and not client.streams.redis.exists(manifest_key(client.streams.keys, 1))


# -- on a GPU --------------------------------------------------------------------------------------


@GPU
def test_a_worker_on_the_trainers_gpu_serves_the_weights_it_opened(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker,
    tmp_path: Path,
) -> None:  # fmt: skip
    client = RolloutClient(redis_server.url, ns)
    workers("gpu", "--device", "cuda:0")
    baseline = torch.cuda.memory_allocated(0)
    v1 = {name: t.to("cuda:0") for name, t in state_dict_of(tiny_model_dir_v1).items()}
    v0 = {name: t.to("cuda:0") for name, t in state_dict_of(tiny_model_dir).items()}
    weights_bytes = torch.cuda.memory_allocated(0) - baseline

    assert client.publish_weights(iter(v1.items()), transport="ipc://") == 1  # a generator of CUDA tensors
    assert client.last_sync is not None
    assert client.last_sync.acked == ["gpu"] and client.last_sync.evicted == []
    client.submit(tokens=[7, 8, 9], n=2, max_tokens=24, id="after-v1")
    for rollout in client.collect(1, timeout=120)[0].rollouts:
        assert rollout.spans == [(1, 0, rollout.n_tokens)]
        check_spans_and_logprobs(rollout, {1: tiny_model_dir_v1})  # the weights it opened, not a copy gone stale

    held_v1 = torch.cuda.memory_allocated(0) - baseline - weights_bytes
    assert held_v1 >= held_bytes() > 0
    assert client.publish_weights(v0, transport="ipc://") == 2  # v1's buffer is freed once the worker moved on
    assert IpcTransport(client.streams.redis, ns).versions() == [2]
    assert torch.cuda.memory_allocated(0) - baseline - weights_bytes == held_v1, "v1's buffer was not freed"

    workers("late", "--device", "cuda:0")  # opens version 2 from the state, while the trainer holds it
    assert client.streams.redis.hget(client.streams.keys.worker("late"), "version") == b"2"
    client.submit(tokens=[7, 8, 9], n=2, max_tokens=24, id="after-v2")
    for rollout in client.collect(1, timeout=120)[0].rollouts:
        check_spans_and_logprobs(rollout, {2: tiny_model_dir})

    log = tmp_path / "cpu.log"
    cpu = start_worker(redis_server.url, ns, tiny_model_dir, "cpu", *FAST, "--device", "cpu", log_file=log)
    try:
        wait_until(lambda: cpu.poll() is not None, 120, "the CPU worker to give up")
    finally:
        stop_process(cpu)
    assert cpu.returncode != 0 and SAME_GPU in log.read_text()

    IpcTransport(client.streams.redis, ns).remove(2)
    assert torch.cuda.memory_allocated(0) - baseline == weights_bytes, "the trainer still holds a buffer"


@GPU
def test_a_handle_opens_in_another_process_on_the_same_gpu(tmp_path: Path) -> None:
    """The export and `open_tensors` alone, with every dtype and an empty tensor: bitwise the trainer's tensors."""
    tensors = {
        "f32": torch.randn(3, 5, device="cuda"),
        "bf16": torch.randn(7, device="cuda").to(torch.bfloat16),
        "i64": torch.arange(5, device="cuda"),
        "bool": torch.tensor([True, False, True], device="cuda"),
        "empty": torch.zeros(0, 4, device="cuda"),
        "scalar": torch.tensor(2.5, device="cuda"),
    }
    export = ipc.export_tensors(tensors, 1)
    try:
        expected = {name: t.cpu().view(-1).view(torch.uint8).tolist() for name, t in tensors.items()}
        reader = (
            "import json, sys, torch\n"
            "from staleness.weights.ipc import Manifest, open_tensors\n"
            "m = Manifest.from_json(sys.stdin.read(), 'stdin', 1)\n"
            "got = open_tensors(m, torch.device('cuda:0'))\n"
            "print(json.dumps({n: [str(t.dtype), list(t.shape), t.cpu().reshape(-1).view(torch.uint8).tolist()]"
            " for n, t in got.items()}))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", reader], input=export.manifest.to_json(), capture_output=True, text=True,
            timeout=120, check=True, cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        got = json.loads(done.stdout)
    finally:
        export.close()
    for name, tensor in tensors.items():
        assert got[name] == [str(tensor.dtype), list(tensor.shape), expected[name]], name


@GPU
@pytest.mark.vllm
def test_a_vllm_worker_on_the_trainers_gpu_reloads_from_the_trainers_memory(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    """vLLM's worker process opens the handle (`rollouts_load_handover`) and loads from it, straight into the model's
    parameters: its logprobs are v1's forward pass (to vLLM's CUDA kernels' precision, far closer than to v0's), and
    the trainer frees v1 once it moved on."""
    client = RolloutClient(redis_server.url, ns)
    workers("vllm", "--engine", "vllm", "--kv-cache-bytes", "1000000000")
    # Unquantized weights on a GPU load straight into vLLM's parameters, not through its layerwise reload.
    assert "versions load direct" in (workers.logs / "vllm.log").read_text()
    baseline = torch.cuda.memory_allocated(0)
    v1 = {name: t.to("cuda:0") for name, t in state_dict_of(tiny_model_dir_v1).items()}

    assert client.publish_weights(iter(v1.items()), transport="ipc://") == 1
    assert client.last_sync is not None
    assert client.last_sync.acked == ["vllm"] and client.last_sync.evicted == []
    client.submit(tokens=[7, 8, 9], n=4, max_tokens=24, temperature=1.0, seed=5, id="after-v1")
    for rollout in client.collect(1, timeout=120)[0].rollouts:
        assert rollout.spans == [(1, 0, rollout.n_tokens)]
        prompt, tokens = rollout.prompt_tokens.tolist(), rollout.tokens.tolist()
        off_v1 = np.abs(rollout.logprobs - forward_logprobs(tiny_model_dir_v1, prompt, tokens)).max()
        off_v0 = np.abs(rollout.logprobs - forward_logprobs(tiny_model_dir, prompt, tokens)).max()
        assert off_v1 < 0.02 and off_v1 < off_v0 / 10, (off_v1, off_v0)

    held = held_bytes()
    del v1
    v0 = {name: t.to("cuda:0") for name, t in state_dict_of(tiny_model_dir).items()}
    assert client.publish_weights(v0, transport="ipc://") == 2  # v1's buffer is freed once the worker moved on
    assert IpcTransport(client.streams.redis, ns).versions() == [2] and held_bytes() == held
    IpcTransport(client.streams.redis, ns).remove(2)
    del v0
    assert torch.cuda.memory_allocated(0) == baseline, "the trainer still holds a buffer"

"""Weights published as frameworks hold them: `publish_weights` fed a generator of `(name, tensor)` pairs that
produces each tensor lazily, as an FSDP or Megatron trainer gathers one at a time, across real processes (a real
redis-server, `rollouts manager`, a torch worker).

- Each transport (`redis://`, `fs://`, `nccl://` over gloo on the CPU) brings exactly the generator's weights to the
  worker: its logprobs equal a forward pass of those weights (`tests.reference`, 1e-4 as every weight-sync test).
- Memory, two observables that a transport holding the model cannot pass:
  - every tensor the generator yields owns its memory through a numpy array (`torch.from_numpy`), so that the array
    lives exactly as long as anything (the tensor, a detached view, a numpy view of its bytes) still points at that
    memory. Each time the transport asks for the next tensor, the generator adds up the arrays of the earlier ones
    still alive: over redis that is nothing (their bytes were copied into chunks), over fs at most one shard (the
    bucket), never the model;
  - the process's peak resident memory (`VmHWM`, reset through `/proc/self/clear_refs`) while publishing a 256 MiB
    generator with 16 MiB buckets, against the same measure while the generator is materialized.
- A tensor no worker's model takes (a wrong name, a shard's shape) or a missing one fails in one line that says what
  to fix, before any worker pauses: nothing is stored, the worker keeps serving the version it had.

nccl's staging holds the whole version where its tensors are (the meta is agreed before the pause), so it is checked
for exactness here, not for bounded memory; a GPU-to-GPU NCCL run needs the device machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import numpy as np
import pytest
import torch
from safetensors import safe_open

from benchmarks.probes.streamed_weights_memory import MEASURE
from pipeline.local import RedisServer, free_port
from pipeline.processes import start_command, stop_process
from producers.client import RolloutClient
from staleness.state import read_state
from staleness.weights.layout import LAYOUT_FIELD, WeightsMismatch
from tests.fixtures import StartWorker, wait_until
from tests.reference import check_spans_and_logprobs

BUCKET = 32 << 10
"""32 KiB: the tiny model (~580 KiB, 27 tensors, the biggest 128 KiB) spans many buckets."""


class Faults(TypedDict, total=False):
    """What `LazyModel.tensors` gets wrong on purpose."""

    names: list[str]
    rename: dict[str, str]
    reshape: dict[str, slice]


class LazyModel:
    """A generator of a checkpoint's tensors, each read from disk only when asked for, that watches how much of what it
    yielded before is still alive when the next one is asked for (see the module's docstring)."""

    def __init__(self, model_dir: Path) -> None:
        self.file = model_dir / "model.safetensors"
        with safe_open(str(self.file), framework="np") as reader:
            self.names = list(reader.keys())
            self.sizes = {name: reader.get_tensor(name).nbytes for name in self.names}
        self.alive_at_each_ask: list[int] = []
        self._arrays: list[tuple[weakref.ref[np.ndarray], int]] = []
        self.yielded = 0

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    @property
    def biggest(self) -> int:
        return max(self.sizes.values())

    def alive(self) -> int:
        return sum(nbytes for ref, nbytes in self._arrays if ref() is not None)

    def tensors(self, names: list[str] | None = None, rename: dict[str, str] | None = None,
                reshape: dict[str, slice] | None = None) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """Yield `names` (default: all) in order, read one at a time; `rename` and `reshape` (a slice of the first
        dimension: one rank's shard) make bad ones."""
        with safe_open(str(self.file), framework="np") as reader:
            for name in self.names if names is None else names:
                self.alive_at_each_ask.append(self.alive())
                array = np.array(reader.get_tensor(name))  # owns its memory
                if reshape and name in reshape:
                    array = np.array(array[reshape[name]])
                self._arrays.append((weakref.ref(array), array.nbytes))
                tensor = torch.from_numpy(array)
                del array  # only the tensor (and whatever it is handed to) keeps the memory now
                self.yielded += 1
                yield (rename or {}).get(name, name), tensor
                del tensor


@pytest.fixture
def manager(redis_server: RedisServer, ns: str, tmp_path: Path) -> Iterator[None]:
    """A real `rollouts manager` on the test's namespace (it finishes syncs whose driver died), stopped by PID."""
    proc = start_command("manager", "--redis", redis_server.url, "--ns", ns, "--interval", "0.2",
                         log_file=tmp_path / "manager.log")  # fmt: skip
    yield
    assert proc.poll() is None, (tmp_path / "manager.log").read_text()
    stop_process(proc)


def served_by(client: RolloutClient, version: int, weights: Path, tag: str) -> None:
    """Prompts generated now come back all of `version`, with the logprobs of a forward pass of `weights`."""
    ids = [client.submit(tokens=[7 + i, 40, 41, 42], n=2, max_tokens=24, seed=i, id=f"{tag}-{i}") for i in range(3)]
    groups = client.collect(len(ids), timeout=120)
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    for rollout in (r for g in groups for r in g.rollouts):
        assert rollout.finish_reason in ("stop", "length") and rollout.spans == [(version, 0, rollout.n_tokens)]
        check_spans_and_logprobs(rollout, {version: weights})


@pytest.mark.usefixtures("manager", "one_thread")
def test_a_model_published_tensor_by_tensor_is_served_exactly_over_each_transport(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker,
    tmp_path: Path,
) -> None:  # fmt: skip
    worker = workers("w1", "--engine", "torch")
    client = RolloutClient(redis_server.url, ns)
    keys = client.streams.keys
    digest = client.streams.redis.hget(keys.worker("w1"), LAYOUT_FIELD)
    assert digest and client.streams.redis.hkeys(keys.layouts) == [digest], "the worker advertises its model"
    served_by(client, 0, tiny_model_dir, "v0")

    runs = [("redis://", tiny_model_dir_v1), (f"fs://{tmp_path / 'weights'}", tiny_model_dir),
            (f"nccl://127.0.0.1:{free_port()}", tiny_model_dir_v1)]  # fmt: skip
    for version, (transport, weights) in enumerate(runs, 1):
        lazy = LazyModel(weights)
        assert lazy.total > 10 * BUCKET and lazy.biggest <= 4 * BUCKET
        assert client.publish_weights(lazy.tensors(), transport=transport, bucket_bytes=BUCKET) == version
        assert client.last_sync is not None and client.last_sync.acked == ["w1"] and client.last_sync.evicted == []
        assert lazy.yielded == len(lazy.names) and lazy.alive() == 0, "nothing is kept once published"
        stats = client.last_publish
        assert stats is not None and (stats.tensors, stats.bytes) == (len(lazy.names), lazy.total)
        if transport.startswith("redis"):  # every tensor was copied into chunks and let go before the next
            assert max(lazy.alive_at_each_ask) == 0
            assert stats.peak_buffered_bytes <= BUCKET
        elif transport.startswith("fs"):  # the tensors of one shard at most (a bigger tensor: a shard of its own)
            assert 0 < max(lazy.alive_at_each_ask) <= max(BUCKET, lazy.biggest)
            assert stats.peak_buffered_bytes <= max(BUCKET, lazy.biggest)
            shards = sorted(p.name for p in (tmp_path / "weights" / f"v{version}").iterdir())
            assert len(shards) > 4 and shards[-1] == "model.safetensors.index.json"
        else:  # nccl stages the version whole before the sync (here on the host: CPU tensors go over gloo)
            assert max(lazy.alive_at_each_ask) == lazy.total - lazy.sizes[lazy.names[-1]]
            assert client.last_broadcast is not None and client.last_broadcast.backend == "gloo"
        served_by(client, version, weights, f"v{version}")
    assert worker.poll() is None


@pytest.mark.usefixtures("manager", "one_thread")
@pytest.mark.parametrize("scheme", ["redis", "fs"])
def test_weights_that_fit_no_worker_fail_in_one_line_and_the_worker_keeps_serving(
    scheme: str, redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path,
    workers: StartWorker, tmp_path: Path,
) -> None:  # fmt: skip
    worker = workers("w1", "--engine", "torch")
    client = RolloutClient(redis_server.url, ns)
    root = tmp_path / "weights"
    transport = "redis://" if scheme == "redis" else f"fs://{root}"
    assert client.publish_weights(LazyModel(tiny_model_dir_v1).tensors(), transport=transport, bucket_bytes=BUCKET) == 1
    status = lambda: client.streams.redis.hget(client.streams.keys.worker("w1"), "status")  # noqa: E731
    wait_until(lambda: status() == b"serving", 30, "the worker to take the resume of version 1's sync")
    lazy = LazyModel(tiny_model_dir)
    embed = "model.embed_tokens.weight"
    rows = lazy.sizes[embed] // 4 // 64
    cases: list[tuple[Faults, str]] = [
        ({"rename": {embed: f"module.{embed}"}},
         rf"^tensor 'module\.{embed}' is not in the workers' model \(did you mean '{embed}'\?\): publish the names of "
         r"the model's state_dict\(\), without wrapper prefixes such as 'module\.'"),
        ({"reshape": {embed: slice(0, rows // 2)}},
         rf"^tensor '{embed}' has shape \({rows // 2}, 64\), the workers' model takes \({rows}, 64\): publish each "
         r"tensor whole \(gathered from its shards\), not one rank's shard"),
        ({"names": lazy.names[:-3]},
         r"^the weights lack 3 of the 27 tensors the workers' model takes \('.+', '.+', '.+'\): publish every "
         r"parameter and buffer of the model"),
    ]  # fmt: skip
    for kwargs, message in cases:
        lazy = LazyModel(tiny_model_dir)
        with pytest.raises(WeightsMismatch, match=message) as refused:
            client.publish_weights(lazy.tensors(**kwargs), transport=transport, bucket_bytes=BUCKET)
        text = str(refused.value)
        assert "\n" not in text and text.endswith("; nothing was published and every worker keeps serving version 1")
        if "names" not in kwargs:  # refused at the bad tensor: the rest was never gathered
            assert lazy.yielded == lazy.names.index(embed) + 1
        assert lazy.alive() == 0
        state = read_state(client.streams.redis, client.streams.keys)
        assert (state.version, state.paused, state.weights_uri.endswith("/v1")) == (1, False, True)
        stored = client.streams.redis.keys(f"{{{ns}}}:weights:2*") if scheme == "redis" else list(root.iterdir())
        assert stored == ([] if scheme == "redis" else [root / "v1"]), "nothing of version 2 is left"
        assert status() == b"serving"  # no refused publish paused it
    served_by(client, 1, tiny_model_dir_v1, "after")
    assert worker.poll() is None
    # Fixed, it goes through.
    assert client.publish_weights(LazyModel(tiny_model_dir).tensors(), transport=transport, bucket_bytes=BUCKET) == 2
    served_by(client, 2, tiny_model_dir, "fixed")


@pytest.mark.parametrize("scheme", ["redis", "fs"])
def test_publishing_a_generator_holds_about_one_bucket_of_it_not_the_model(
    scheme: str, ns: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    """256 MiB in 32 tensors of 8 MiB, each made when asked for, published with 16 MiB buckets by a fresh trainer
    process (no worker is live: the state alone moves): its peak resident memory rises by well under the model's size,
    where the same process holding the generator's tensors (the control) rises by the whole model."""
    n, size, bucket = 32, 8 << 20, 16 << 20

    def measure(target: str) -> dict[str, int]:
        args = [redis_server.url, ns, target, str(n), str(size), str(bucket)]
        done = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[2])  # fmt: skip
        assert done.returncode == 0, done.stderr
        result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    control = measure("control")
    assert control["growth"] >= n * size, f"the measure must see a materialized model: {control['growth'] >> 20} MiB"
    published = measure("redis://" if scheme == "redis" else f"fs://{tmp_path}")
    growth = published["growth"]
    assert growth < 4 * bucket, f"publishing held {growth >> 20} MiB of a {n * size >> 20} MiB model"
    assert published["bytes"] == n * size and published["buffered"] <= bucket

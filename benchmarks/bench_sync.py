"""`rollouts bench-sync`: how long workers stand still when the trainer publishes new weights.

For each model size and transport, one worker generates steadily while the trainer publishes a
new version again and again. Each publish is timed in parts: `publish_s` (the tensors into the
transport), `sync_s` (the manager's `weights` command to its `resume`: join, pause, load, ack),
`publish_to_serving_s` (from the `publish_weights` call until the worker reports it serves the new
version) and `stall_s`, the time the worker stood still: from its pause to its resume, as its heartbeat
reports it. With nccl a worker joins the broadcast, and builds its group, before it pauses, so the
join and a new group's setup count in `sync_s` but not in `stall_s`.
The trainer holds both versions in memory (on `trainer_device`), as a training loop would, and publishes first
once the worker has served a batch of short groups (`warm_up`), as a training loop publishes after its first
batch. `idle` leaves the worker without requests during the syncs: the transfer alone, with no generation
beside it on the worker's GPU. `workers` > 1 runs that many workers (each busy as the one is): `stall_s` is then the
median over the workers of each sync and `stall_max_s` the slowest worker's, `publish_to_serving_s` until the last
serves; by `redis://` every worker reads the whole version from the one Redis (W x the model's bytes a sync).

`nccl` also reports the broadcast's own figures (`setup_s`; `ready_s`, the wait until every receiver
posted its receives; `broadcast_s`, from then until the last byte landed; `gb_per_s`) and, when both
sides are on GPUs, a bare NCCL broadcast of the same bytes between the same two GPUs in this
process (`bare_gb_per_s`): the ceiling the transport is compared with (`ratio`). The first publish is
reported on its own (`first_stall_s`, `first_setup_s`, ...), the others as medians; JSON out.

`ipc` (colocated handoff) needs the trainer's weights and the worker on the same GPU (`--device cuda:0
--trainer-device cuda:0`); it also reports the GPU memory the trainer holds for the workers (`trainer_held_mib`).
A transport that cannot run with the devices given is not run: its row says why (`skipped`), e.g. nccl with
both sides on one GPU, where NCCL cannot put two ranks.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress

from consumers.engines.tiny_model import build_tiny_model
from pipeline.cli.engine_spec import EngineSpec
from pipeline.local import RedisServer, free_port
from pipeline.processes import gpu_of, start_worker, stop_process, wait_for_worker
from pipeline.wire import PauseMode
from producers.client import RolloutClient
from staleness.weights import open_transport
from staleness.weights.base import read_checkpoint

NS = "bench-sync"
SIZES = {
    "tiny": (64, 2),
    "small": (256, 4),
    "medium": (512, 8),
    "large": (1024, 8),
    "xl": (2048, 16),
    "7b": (4096, 44),
}
"""name -> (hidden size, layers) of the random Qwen2 models compared. `7b`: 7.4 B parameters (an MLP of twice the hidden
size, a tiny vocabulary), 13.8 GiB in bf16: the size issue 45 names for NCCL into vLLM."""


TRANSPORTS = ("redis", "fs", "nccl", "ipc")


def run_bench_sync(
    console: Console,
    spec: EngineSpec,
    sizes: list[str],
    transports: list[str],
    rounds: int,
    mode: PauseMode,
    trainer_device: str = "cpu",
    logs: Path | None = None,
    idle: bool = False,
    workers: int = 1,
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-sync-"))
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    try:
        with Progress(console=console) as progress:
            task = progress.add_task("publish rounds", total=len(sizes) * len(transports) * rounds)
            for size in sizes:
                hidden, layers = SIZES[size]
                models = [
                    build_tiny_model(tmp / size / f"seed{s}", seed=s, hidden_size=hidden, num_layers=layers)
                    for s in (0, 1)
                ]
                params = _parameters(models[0])
                dtype = getattr(torch, spec.dtype)  # the trainer publishes in the engine's dtype (bf16: half the bytes)
                weights = [{k: t.to(trainer_device, dtype) for k, t in read_checkpoint(m).items()} for m in models]
                nbytes = params * torch.empty(0, dtype=dtype).element_size()
                for transport in transports:
                    row = {"size": size, "parameters": params, "bytes": nbytes, "transport": transport}
                    if reason := cannot_run(transport, spec, trainer_device):
                        results.append(row | {"skipped": reason})
                        progress.advance(task, rounds)
                        continue
                    uri = {
                        "redis": "redis://",
                        "fs": f"fs://{tmp / size / 'published'}",
                        "nccl": f"nccl://127.0.0.1:{free_port()}",
                        "ipc": "ipc://",
                    }[transport]
                    log = (logs or tmp) / f"{size}-{transport}.log"
                    rows = _measure(spec, models[0], weights, uri, rounds, mode, log, progress, task, idle, workers)
                    if transport == "nccl" and trainer_device.startswith("cuda") and spec.device.startswith("cuda"):
                        receivers = [str(gpu) for gpu in worker_gpus(spec.device)]
                        bare = bare_broadcast_gb_per_s(nbytes, trainer_device, receivers)
                        rows |= {"bare_gb_per_s": round(bare, 2), "ratio": round(rows["gb_per_s"] / bare, 3)}
                    results.append(row | rows)
                del weights
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "engine": spec.kind,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "device": spec.device,
        "trainer_device": trainer_device,
        "mode": mode,
        "rounds": rounds,
        "workers": workers,
        "results": results,
    }


def cannot_run(transport: str, spec: EngineSpec, trainer_device: str) -> str | None:
    """Why `transport` cannot run between a trainer on `trainer_device` and this worker (None: it can)."""
    trainer, workers = _gpu(trainer_device), worker_gpus(spec.device)
    worker = workers[0] if workers else None
    if transport == "nccl" and trainer is not None and trainer in workers:
        return (
            f"the trainer and the worker are both on {trainer}, and NCCL cannot put two ranks on one GPU "
            "(use two GPUs, or ipc:// on one)"
        )
    if transport == "ipc" and (trainer is None or trainer != worker or spec.kind != "torch"):
        return (
            "ipc:// needs the trainer's weights and a torch worker on the same GPU; here: trainer on "
            f"{trainer_device}, {spec.kind} worker on {spec.device}"
        )
    return None


def _gpu(device: str) -> torch.device | None:
    """A CUDA device with its index (`cuda` is `cuda:0` here), or None for any other device."""
    parsed = torch.device(device)
    return torch.device("cuda", parsed.index or 0) if parsed.type == "cuda" else None


def worker_gpus(device: str) -> list[torch.device]:
    """The worker's CUDA devices: `cuda:1,2` (a vLLM worker of tensor parallel 2) is two; none for the CPU."""
    kind, _, indices = device.partition(":")
    if kind != "cuda" or "," not in indices:
        gpu = _gpu(device)
        return [gpu] if gpu is not None else []
    return [torch.device("cuda", int(i)) for i in indices.split(",")]


def _measure(
    spec: EngineSpec,
    model: Path,
    weights: list[dict[str, torch.Tensor]],
    transport: str,
    rounds: int,
    mode: PauseMode,
    log: Path,
    progress: Progress,
    task: Any,
    idle: bool = False,
    workers: int = 1,
) -> dict[str, Any]:
    timings: dict[str, list[float]] = {"publish_s": [], "sync_s": [], "publish_to_serving_s": [], "stall_s": []}
    if workers > 1:
        timings["stall_max_s"] = []
    broadcasts: dict[str, list[float]] = {
        "join_s": [],
        "setup_s": [],
        "ready_s": [],
        "broadcast_s": [],
        "gb_per_s": [],
    }
    with RedisServer() as server:
        url = server.url
        env = gpu_of(spec.device) if spec.kind == "vllm" else None  # vLLM takes the first GPU it sees
        names = ["bench-sync-worker"] if workers == 1 else [f"bench-sync-worker-{i}" for i in range(workers)]
        logs = [log] if workers == 1 else [log.with_name(f"{log.stem}-{i}{log.suffix}") for i in range(workers)]
        started_workers: list[Any] = []
        try:
            for name, worker_log in zip(names, logs, strict=True):
                started_workers.append(
                    start_worker(url, NS, model, name, *spec.worker_args(), log_file=worker_log, env=env)
                )
            client = RolloutClient(url, NS)
            for name, worker in zip(names, started_workers, strict=True):
                wait_for_worker(client.streams.redis, NS, name, worker, timeout_s=600)
            warm_up(client, groups=64 * workers)
            for i in range(0 if idle else 64 * workers):  # keep the workers busy: a sync interrupts real generation
                client.submit(tokens=[5 + i % 100, 6, 7, 8], n=2, max_tokens=400, seed=i)
            heartbeats = [client.streams.keys.worker(name) for name in names]
            for r in range(rounds):
                started = time.perf_counter()
                version = client.publish_weights(weights[(r + 1) % 2], transport=transport, mode=mode)
                published = time.perf_counter()
                stalls: dict[int, float] = {}
                while len(stalls) < workers:  # every worker serving the new version, each with its own stall
                    for index, heartbeat in enumerate(heartbeats):
                        if index in stalls:
                            continue
                        status, served, stall = client.streams.redis.hmget(heartbeat, "status", "version", "stall_s")
                        if (status, served) == (b"serving", str(version).encode()):
                            stalls[index] = float(stall or 0.0)
                        elif started_workers[index].poll() is not None:
                            code = started_workers[index].returncode
                            raise RuntimeError(f"a worker exited with code {code}; its log: {logs[index]}")
                    time.sleep(0.001)
                resumed = time.perf_counter()
                sync_s = client.last_sync.stall_s if client.last_sync else 0.0
                timings["sync_s"].append(sync_s)
                timings["publish_s"].append(published - started - sync_s)
                timings["publish_to_serving_s"].append(resumed - started)
                timings["stall_s"].append(statistics.median(stalls.values()))
                if workers > 1:
                    timings["stall_max_s"].append(max(stalls.values()))
                if transport.startswith("nccl://") and client.last_broadcast is not None:
                    stats = client.last_broadcast
                    broadcasts["join_s"].append(stats.join_s)
                    broadcasts["setup_s"].append(stats.setup_s)
                    broadcasts["ready_s"].append(stats.ready_s)
                    broadcasts["broadcast_s"].append(stats.transfer_s)
                    broadcasts["gb_per_s"].append(stats.gb_per_s)
                progress.advance(task)
            held = _forget_exports(client, transport)
        finally:
            for worker in started_workers:
                stop_process(worker)
    return summarize(timings | broadcasts) | held


def warm_up(client: RolloutClient, groups: int = 64, timeout_s: float = 600.0) -> None:
    """Have the worker generate `groups` short groups (batched as the measured work is) and take them, before the
    first publish: a training loop publishes after training on rollouts, so its first sync never meets an engine
    still in its first steps (CUDA kernels and their plans chosen on first use), and neither should the bench's."""
    for i in range(groups):
        client.submit(tokens=[5 + i % 100, 6, 7, 8], n=2, max_tokens=16, seed=10_000 + i)
    client.collect(groups, timeout=timeout_s)


def _forget_exports(client: RolloutClient, transport: str) -> dict[str, Any]:
    """For ipc: how much GPU memory the trainer held for the worker, then free it (the next run starts at v1)."""
    if not transport.startswith("ipc://"):
        return {}
    from staleness.weights.ipc import held_bytes

    held = {"trainer_held_mib": round(held_bytes() / 2**20, 1)}
    exports = open_transport(transport, redis_client=client.streams.redis, ns=NS)
    for version in exports.versions():
        exports.remove(version)
    return held


def summarize(rounds: dict[str, list[float]]) -> dict[str, Any]:
    """The first sync on its own (`first_*`: it may build what later ones keep), medians of the later ones, and
    every round's stall and setup."""
    later = {name: values[1:] or values for name, values in rounds.items() if values}
    summary: dict[str, Any] = {name: round(statistics.median(values), 4) for name, values in later.items()}
    summary |= {f"first_{name}": round(values[0], 4) for name, values in rounds.items() if values}
    for name in ("stall_s", "publish_to_serving_s", "setup_s"):
        if rounds.get(name):
            summary[f"{name}_rounds"] = [round(v, 4) for v in rounds[name]]
    return summary


def bare_broadcast_gb_per_s(nbytes: int, source: str, targets: list[str], repeats: int = 5) -> float:
    """GB/s of one plain NCCL broadcast of `nbytes` from GPU `source` to the GPUs `targets` (median of `repeats`).

    One thread of this process per GPU, one process group each: the ceiling for the nccl transport, with no
    rendezvous, bucketing or loading.
    """
    ranks = [source, *targets]
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
    seconds: list[float] = []

    def rank(index: int, device: str) -> None:
        torch.cuda.set_device(device)
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
        # torch's stubs type the backend as a Backend, not a ProcessGroup; Options() is the 3-argument default
        options = dist.ProcessGroupNCCL.Options()
        prefixed = dist.PrefixStore("bare/", client)
        group = cast(dist.ProcessGroup, dist.ProcessGroupNCCL(prefixed, index, len(ranks), options))
        buffer = torch.ones(nbytes, dtype=torch.uint8, device=device)
        for _ in range(repeats + 1):  # the first builds the communicator
            group.broadcast([buffer], dist.BroadcastOptions()).wait()
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            group.broadcast([buffer], dist.BroadcastOptions()).wait()
            torch.cuda.synchronize(device)
            if index == 0:
                seconds.append(time.perf_counter() - started)
        group.shutdown()

    threads = [threading.Thread(target=rank, args=(i, d)) for i, d in enumerate(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    del store
    return nbytes / statistics.median(seconds) / 1e9


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as handle:
        return sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())  # noqa: SIM118


def plot_bench_sync(result: dict[str, Any], path: Path) -> None:
    """Stall per model size, one line per transport (the transports that ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    measured = [row for row in result["results"] if "skipped" not in row]
    for transport in sorted({row["transport"] for row in measured}):
        rows = [row for row in measured if row["transport"] == transport]
        ax.plot([row["bytes"] / 2**20 for row in rows], [row["stall_s"] for row in rows], marker="o", label=transport)
    ax.set_xscale("log")
    ax.set_xlabel("weights (MiB, fp32)")
    ax.set_ylabel("stall (s, median)")
    ax.set_title(f"{result['engine']} worker: how long it stood still in a sync ({result['mode']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

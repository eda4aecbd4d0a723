"""`rollouts bench-sync`: how long workers stand still when the trainer publishes new weights.

For each model size and transport, one worker generates steadily while the trainer publishes a
new version again and again. Each publish is timed in parts: `publish_s` (the tensors into the
transport), `sync_s` (the manager's `weights` command to its `resume`: pause, load, ack) and
`stall_s` (from the `publish_weights` call until the worker reports it serves the new version).
Medians over rounds; JSON out.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from consumers.tiny_model import build_tiny_model
from pipeline.cli.engine_spec import EngineSpec
from pipeline.cli.processes import start_worker, stop_process, wait_for_worker
from pipeline.local import embedded_redis
from producers.client import RolloutClient

NS = "bench-sync"
SIZES = {"tiny": (64, 2), "small": (256, 4), "medium": (512, 8), "large": (1024, 8)}
"""name -> (hidden size, layers) of the random Qwen2 models compared."""


def run_bench_sync(
    console: Console, spec: EngineSpec, sizes: list[str], transports: list[str], rounds: int, mode: str
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-sync-"))
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
                for transport in transports:
                    spec_t = "redis://" if transport == "redis" else f"fs://{tmp / size / 'published'}"
                    rows = _measure(spec, models, spec_t, rounds, mode, tmp / f"{size}-{transport}.log", progress, task)
                    row = {"size": size, "parameters": params, "bytes": 4 * params, "transport": transport}
                    results.append(row | rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"engine": spec.kind, "mode": mode, "rounds": rounds, "results": results}


def _measure(
    spec: EngineSpec,
    models: list[Path],
    transport: str,
    rounds: int,
    mode: str,
    log: Path,
    progress: Progress,
    task: Any,
) -> dict[str, Any]:
    timings: dict[str, list[float]] = {"publish_s": [], "sync_s": [], "stall_s": []}
    with embedded_redis() as (url, _served_by):
        worker = start_worker(url, NS, models[0], "bench-sync-worker", *spec.worker_args(), log_file=log)
        try:
            client = RolloutClient(url, NS)
            wait_for_worker(client.streams.redis, NS, "bench-sync-worker", worker, timeout_s=300)
            for i in range(64):  # keep the worker busy: a sync interrupts real generation
                client.submit(tokens=[5 + i % 100, 6, 7, 8], n=2, max_tokens=400, seed=i)
            heartbeat = client.streams.keys.worker("bench-sync-worker")
            for r in range(rounds):
                started = time.perf_counter()
                version = client.publish_weights(models[(r + 1) % 2], transport=transport, mode=mode)  # type: ignore[arg-type]
                published = time.perf_counter()
                while client.streams.redis.hmget(heartbeat, "status", "version") != [b"serving", str(version).encode()]:
                    time.sleep(0.001)
                resumed = time.perf_counter()
                sync_s = client.last_sync.stall_s if client.last_sync else 0.0
                timings["sync_s"].append(sync_s)
                timings["publish_s"].append(published - started - sync_s)
                timings["stall_s"].append(resumed - started)
                progress.advance(task)
        finally:
            stop_process(worker)
    return {name: round(statistics.median(values), 4) for name, values in timings.items()} | {
        "stall_s_rounds": [round(v, 4) for v in timings["stall_s"]]
    }


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as handle:
        return sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())  # noqa: SIM118


def plot_bench_sync(result: dict[str, Any], path: Path) -> None:
    """Stall per model size, one line per transport."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for transport in sorted({row["transport"] for row in result["results"]}):
        rows = [row for row in result["results"] if row["transport"] == transport]
        ax.plot([row["bytes"] / 2**20 for row in rows], [row["stall_s"] for row in rows], marker="o", label=transport)
    ax.set_xscale("log")
    ax.set_xlabel("weights (MiB, fp32)")
    ax.set_ylabel("stall (s, median)")
    ax.set_title(f"{result['engine']} worker: publish_weights → generating again ({result['mode']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

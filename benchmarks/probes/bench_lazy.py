"""Time to first rollout from cold (`rollouts worker --lazy`, and after `--release-after-s`) vs warm, and the stall of
a weight sync while the engine is released vs while it serves.

    python benchmarks/probes/bench_lazy.py --engine torch --rounds 5
    python benchmarks/probes/bench_lazy.py --engine vllm --rounds 3

One private redis-server, the tiny model (two policy versions) and one `rollouts worker --lazy --release-after-s S`
process, as a user runs it. Each round: wait until the worker holds no engine (`idle` in round 0, `released` after),
publish the next version over `redis://` (the sync's stall, as the trainer sees it: nothing starts for it), submit
one prompt (1 sample, 16 tokens) and time it to its rollout: the cold start, the load of the new version and the
generation; then the same prompt again on the warm engine; then a sync on the warm engine. It prints one JSON line
per round, then the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_process, wait_for_worker
from producers.client import RolloutClient

NAME = "lazy"


def first_rollout_s(client: RolloutClient, prompt_id: str, version: int) -> float:
    """Seconds from submitting one prompt to its rollout; checks the rollout is of `version`."""
    began = time.monotonic()
    client.submit(tokens=[7, 8, 9], n=1, max_tokens=16, id=prompt_id, seed=0)
    (group,) = client.collect(1, timeout=600)
    seconds = time.monotonic() - began
    served = group.rollouts[0].version
    if served != version:
        raise RuntimeError(f"{prompt_id}: served version {served}, expected {version}")
    return seconds


def sync_s(client: RolloutClient, model: Path) -> tuple[int, float]:
    """Publish `model` as the next version; returns it and the sync's stall (its `weights` command to the resume)."""
    version = client.publish_weights(model, transport="redis://")
    report = client.last_sync
    assert report is not None  # publish_weights sets it
    if report.acked != [NAME]:
        raise RuntimeError(f"sync {version}: acked by {report.acked}, evicted {report.evicted}")
    return version, report.stall_s


def heartbeat_field(beats: redis.Redis, key: str, field: str) -> bytes:
    """A field of the worker's heartbeat, which it must have."""
    value = beats.hget(key, field)
    if not isinstance(value, bytes):
        raise RuntimeError(f"the worker's heartbeat {key} has no {field}")
    return value


def one_round(client: RolloutClient, beats: redis.Redis, key: str, models: list[Path], k: int) -> dict[str, Any]:
    status = heartbeat_field(beats, key, "status").decode()
    version, released_sync = sync_s(client, models[k % 2])
    cold = first_rollout_s(client, f"cold{k}", version)
    cold_start = float(heartbeat_field(beats, key, "cold_start_s"))
    warm = first_rollout_s(client, f"warm{k}", version)
    _, warm_sync = sync_s(client, models[(k + 1) % 2])
    return {
        "round": k,
        "from": status,
        "cold_first_rollout_s": round(cold, 3),
        "engine_start_s": round(cold_start, 3),
        "warm_first_rollout_s": round(warm, 3),
        "sync_while_released_s": round(released_sync, 4),
        "sync_while_serving_s": round(warm_sync, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--release-after-s", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        models = [build_tiny_model(Path(tmp) / f"v{seed}", seed=seed) for seed in (1, 0)]
        flags = ("--engine", args.engine, "--lazy", "--release-after-s", str(args.release_after_s))
        process = start_worker(server.url, "bench", models[1], NAME, *flags, log_file=Path(tmp) / "worker.log")
        beats = redis.Redis.from_url(server.url)
        client = RolloutClient(server.url, "bench")
        key = client.streams.keys.worker(NAME)
        rows = []
        try:
            for k in range(args.rounds):
                wait_for_worker(beats, "bench", NAME, process, timeout_s=600, status="idle" if k == 0 else "released")
                rows.append(one_round(client, beats, key, models, k))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            stop_process(process)
        medians = {name: round(statistics.median(r[name] for r in rows), 4) for name in rows[0] if name.endswith("_s")}
        print(json.dumps({"engine": args.engine, "rounds": args.rounds, "median": medians}))


if __name__ == "__main__":
    main()

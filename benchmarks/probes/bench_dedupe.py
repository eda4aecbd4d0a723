"""What the publish dedupe costs Redis per rollout: memory and keys, on a private redis-server.

    python benchmarks/probes/bench_dedupe.py --rollouts 200000

Puts `--rollouts` rollouts (groups of 4, small arrays) through the publish script in batches of 512, with no
source entry (as `rollouts replay` does), deletes the stream, and prints one JSON line: what the dedupe holds
(`used_memory` over the empty server, per rollout), how many keys, and how long the publishes took.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import redis

from pipeline.local import RedisServer
from pipeline.streams import Streams
from pipeline.wire import Rollout

N = 4


def rollout(prompt: int, sample: int) -> Rollout:
    small = np.arange(4, dtype=np.int32)
    return Rollout(
        prompt_id=f"{prompt:08x}-4f2a-9c1e", sample=sample, n=N, version=0, version_end=0, finish_reason="length",
        worker="w", prompt_tokens=small, tokens=small, logprobs=np.zeros(4, np.float32), spans=[(0, 0, 4)],
        meta={}, timing={},
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=200_000)
    rollouts = parser.parse_args().rollouts
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        streams = Streams(client, "dedupe")
        empty = client.info("memory")["used_memory"]
        took = 0.0
        for start in range(0, rollouts // N, 128):
            batch = [rollout(p, k) for p in range(start, min(start + 128, rollouts // N)) for k in range(N)]
            began = time.perf_counter()
            streams.writer.add_rollouts(batch)
            took += time.perf_counter() - began
        client.delete(streams.keys.rollouts)
        used = client.info("memory")["used_memory"] - empty
        result = {
            "rollouts": rollouts,
            "keys": client.dbsize(),
            "bytes_per_rollout": round(used / rollouts, 1),
            "publish_s": round(took, 2),
            "redis": server.binary.describe(),
        }
        print(json.dumps(result))


if __name__ == "__main__":
    main()

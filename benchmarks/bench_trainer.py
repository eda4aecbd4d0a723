"""`python -m benchmarks.bench_trainer REDIS_URL`: the trainer of `rollouts bench --one-engine`, in its own process.

With one engine for both sides, the bench's process holds the engine and the worker, as `rollouts worker` does. The
trainer's client then belongs in a process of its own, as a real trainer's does. It reads one JSON line a round
(the shape of the round's prompts), submits them, collects their groups, and answers one JSON line: the round's
seconds and the tokens, in prompt order. Lines of JSON on a pipe: nothing here is pickled.
"""

from __future__ import annotations

import json
import sys

from producers.client import RolloutClient


def main(redis_url: str) -> None:
    from benchmarks import bench  # the module: its functions are looked up at each call, where a probe may wrap them

    client = RolloutClient(redis_url, bench.NS)
    for line in sys.stdin:
        ask = json.loads(line)
        batch = bench.make_prompts(ask["prompts"], ask["n"], ask["max_tokens"], ask["vocab"], ask["tag"])
        seconds, tokens = bench.pipeline_round(client, batch)
        sys.stdout.write(json.dumps({"seconds": seconds, "tokens": tokens}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])

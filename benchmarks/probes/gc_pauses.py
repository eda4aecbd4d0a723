"""How long Python's collector stops a `rollouts worker`'s event loop while it serves.

    python benchmarks/probes/gc_pauses.py --engine vllm --rounds 10

Starts a private redis-server and one `rollouts worker` process (a fresh tiny model), with `gc_probe/` (beside this
script) on its `PYTHONPATH`, serves one warm-up round and then `--rounds` rounds of `rollouts bench`'s shape (64 prompts
x 4 samples x 64 tokens) through `RolloutClient`, and prints one JSON line: each round's seconds, and the worker's
collections of generations 1 and 2 during the rounds (how many, their milliseconds in all, the longest). To measure a
worker from before a change, put that checkout first on `PYTHONPATH` (the worker process is `python -m rollouts
worker`).
A measuring tool: the README's *A worker's heap, frozen once its engine is up* quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.bench import make_prompts, pipeline_round
from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_process, wait_for_worker
from producers.client import RolloutClient

PROBE = Path(__file__).resolve().parent / "gc_probe"


def collections(folder: Path, since: float, until: float) -> dict[str, list[float]]:
    """The worker process's collections between two wall times: `{"gen1": [count, ms, longest], "gen2": ...}`."""
    (log,) = [p for p in folder.glob("*.txt") if " worker " in p.read_text().splitlines()[0]]
    found: dict[str, list[float]] = {"gen1": [], "gen2": []}
    for line in log.read_text().splitlines()[1:]:
        generation, ms, at = line.split()
        if since <= float(at) <= until:
            found[f"gen{generation}"].append(float(ms))
    return {gen: [len(ms), round(sum(ms), 1), round(max(ms, default=0.0), 1)] for gen, ms in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["torch", "vllm", "synthetic"], default="vllm")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gc-pauses-"))
    model = build_tiny_model(tmp / "model", seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with RedisServer() as server:
        # The worker's process inherits these (this one read its PYTHONPATH at start: the probe stays out of it).
        os.environ["GC_PROBE"] = str(tmp)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(PROBE)]))
        worker = start_worker(server.url, "gc", model, "w", "--engine", args.engine, log_file=tmp / "worker.log")
        try:
            client = RolloutClient(server.url, "gc")
            wait_for_worker(client.streams.redis, "gc", "w", worker, timeout_s=300)
            pipeline_round(client, make_prompts(64, 4, 64, vocab, "warm-up"))
            since, seconds = time.time(), []
            for r in range(args.rounds):
                seconds.append(round(pipeline_round(client, make_prompts(64, 4, 64, vocab, f"r{r}"))[0], 3))
            until = time.time()
        finally:
            stop_process(worker)
    print(json.dumps({"engine": args.engine, "rounds_s": seconds, **collections(tmp, since, until)}))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

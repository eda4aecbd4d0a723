"""How long a `rollouts worker` takes to serve, and to exit once told to stop: what most of the test suite's time is.

Per engine and round: a worker started as a person starts it (`rollouts worker` in its own process, `--heartbeat-s
0.3` as the tests' workers), timed from the start to its heartbeat's `serving`, then SIGTERM, timed to its exit. An
idle worker: no prompts. JSON on stdout (every round, and the median per engine); progress on stderr. A private
Redis; the tiny model is built in a temporary directory unless `--model` names one.

    python benchmarks/probes/worker_lifecycle.py --engines synthetic,torch,vllm --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import redis
from rich.console import Console
from rich.progress import Progress

from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_process, wait_for_worker

ENGINES = ("synthetic", "torch", "vllm")


def one_round(server: RedisServer, client: redis.Redis, model: Path, engine: str, name: str, log: Path) -> dict:
    """Start one worker, wait for it to serve, stop it: seconds of each, and its exit code."""
    began = time.perf_counter()
    flags = ("--engine", engine, "--heartbeat-s", "0.3")
    process = start_worker(server.url, "lifecycle", model, name, *flags, log_file=log)
    wait_for_worker(client, "lifecycle", name, process, timeout_s=300)
    serving = time.perf_counter()
    code = stop_process(process, timeout_s=120)
    return {"start_s": round(serving - began, 2), "stop_s": round(time.perf_counter() - serving, 2), "exit": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="synthetic,torch", help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a model directory (default: the tiny model, built here)")
    args = parser.parse_args()
    engines = args.engines.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or args.rounds < 1:
        parser.error(f"unknown engines {unknown}" if unknown else "--rounds must be at least 1")
    with (
        tempfile.TemporaryDirectory() as tmp,
        RedisServer() as server,
        Progress(console=Console(stderr=True), transient=True) as progress,
    ):
        model = args.model or build_tiny_model(Path(tmp) / "tiny")
        client = redis.Redis.from_url(server.url)
        task = progress.add_task("workers", total=len(engines) * args.rounds)
        rounds: dict[str, list[dict]] = {}
        for engine in engines:
            for i in range(args.rounds):
                progress.update(task, description=f"{engine} {i + 1}/{args.rounds}")
                log = Path(tmp) / f"{engine}-{i}.log"
                rounds.setdefault(engine, []).append(one_round(server, client, model, engine, f"{engine}-{i}", log))
                progress.advance(task)
        client.close()
    medians = {
        engine: {key: round(statistics.median(r[key] for r in rows), 2) for key in ("start_s", "stop_s")}
        for engine, rows in rounds.items()
    }
    print(json.dumps({"rounds": rounds, "median": medians}, indent=2))


if __name__ == "__main__":
    main()

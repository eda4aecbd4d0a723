"""How long a `rollouts worker` takes to serve, and to exit once told to stop: what most of the test suite's time is.

Per engine and round: a worker started as a person starts it (`rollouts worker` in its own process, `--heartbeat-s
0.3` as the tests' workers), timed from the start to its first heartbeat (`first_beat_s`) and to its heartbeat's
`serving` (`start_s`), then SIGTERM, timed to its exit. An idle worker: no prompts. JSON on stdout (every round, and
the median per engine); progress on stderr. A private Redis; the tiny model is built in a temporary directory unless
`--model` names one.

    python benchmarks/probes/worker_lifecycle.py --engines synthetic,torch,vllm --rounds 3

`--trees before=/path/a,after=/path/b` compares checkouts: each round starts one worker from each tree in turn (the
first of them alternating from round to round), its `rollouts` imported from that tree (`PYTHONPATH`, and
`PYTHONSAFEPATH` so that the current directory's never is); results per `engine@label`.

    python benchmarks/probes/worker_lifecycle.py --engines synthetic --rounds 10 --trees before=../main,after=.
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
from pipeline.wire import Keys

ENGINES = ("synthetic", "torch", "vllm")


def one_round(
    server: RedisServer, client: redis.Redis, model: Path, engine: str, name: str, log: Path, tree: Path | None = None
) -> dict:
    """Start one worker (from `tree`, when given), wait for its first heartbeat and for it to serve, stop it: seconds
    of each, and its exit code."""
    env = None if tree is None else {"PYTHONPATH": str(tree.resolve()), "PYTHONSAFEPATH": "1"}
    began = time.perf_counter()
    flags = ("--engine", engine, "--heartbeat-s", "0.3")
    process = start_worker(server.url, "lifecycle", model, name, *flags, log_file=log, env=env)
    key, deadline = Keys("lifecycle").worker(name), began + 300
    while not client.exists(key) and process.poll() is None and time.perf_counter() < deadline:
        time.sleep(0.01)  # the poll of a deadline wait: the first heartbeat's time to 10 ms
    beat = time.perf_counter()
    wait_for_worker(client, "lifecycle", name, process, timeout_s=max(deadline - beat, 1))
    serving = time.perf_counter()
    code = stop_process(process, timeout_s=120)
    return {
        "first_beat_s": round(beat - began, 2),
        "start_s": round(serving - began, 2),
        "stop_s": round(time.perf_counter() - serving, 2),
        "exit": code,
    }


def parse_trees(text: str | None) -> list[tuple[str, Path | None]]:
    """`--trees label=path,...` as (label, path); none: this checkout, unlabelled. `ValueError` says what is wrong."""
    if not text:
        return [("", None)]
    trees: list[tuple[str, Path | None]] = []
    for item in text.split(","):
        label, sep, path = item.partition("=")
        if not sep or not label or not (Path(path) / "rollouts").is_dir():
            raise ValueError(f"--trees: {item!r} is not LABEL=PATH of a checkout (a directory with rollouts/)")
        trees.append((label, Path(path)))
    return trees


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="synthetic,torch", help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a model directory (default: the tiny model, built here)")
    parser.add_argument("--trees", help="LABEL=PATH,...: checkouts to compare, a worker from each in turn a round")
    args = parser.parse_args()
    engines = args.engines.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or args.rounds < 1:
        parser.error(f"unknown engines {unknown}" if unknown else "--rounds must be at least 1")
    try:
        trees = parse_trees(args.trees)
    except ValueError as exc:
        parser.error(str(exc))
    with (
        tempfile.TemporaryDirectory() as tmp,
        RedisServer() as server,
        Progress(console=Console(stderr=True), transient=True) as progress,
    ):
        model = args.model or build_tiny_model(Path(tmp) / "tiny")
        client = redis.Redis.from_url(server.url)
        task = progress.add_task("workers", total=len(engines) * args.rounds * len(trees))
        rounds: dict[str, list[dict]] = {}
        for engine in engines:
            for i in range(args.rounds):
                progress.update(task, description=f"{engine} {i + 1}/{args.rounds}")
                turn = i % len(trees)
                for label, tree in trees[turn:] + trees[:turn]:  # who goes first alternates
                    run = f"{engine}@{label}" if label else engine
                    name = f"{engine}-{label}-{i}" if label else f"{engine}-{i}"
                    log = Path(tmp) / f"{name}.log"
                    rounds.setdefault(run, []).append(one_round(server, client, model, engine, name, log, tree))
                    progress.advance(task)
        client.close()
    medians = {
        run: {key: round(statistics.median(r[key] for r in rows), 2) for key in ("first_beat_s", "start_s", "stop_s")}
        for run, rows in rounds.items()
    }
    print(json.dumps({"rounds": rounds, "median": medians}, indent=2))


if __name__ == "__main__":
    main()

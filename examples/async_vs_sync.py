"""Fully-async RL against synchronous RL, side by side in one run: same task, engine, seeds and steps.

    python examples/async_vs_sync.py --steps 40 --etas 1,2,4 --plot async_vs_sync.png
    python examples/async_vs_sync.py --trainer-device cuda:0 --worker-device cuda:1 --hidden-size 256 --num-layers 4

For each mode (sync, then async at each η) it starts a fresh `rollouts worker` and `rollouts manager`
on a fresh namespace and runs the reference trainer (`grpo_trainer.train`) for `--steps` steps. Each
prompt's `max_tokens` is drawn from a Pareto law (`--length-alpha`), so response lengths have the long
tail of reasoning traces: a synchronous batch waits for its longest sample. Reported per mode (JSON on
stdout, a PNG with `--plot`):

- `steps_per_s` and `speedup` over sync;
- `trainer_idle`: the share of the run the trainer waited for its batch;
- `generator_idle`: the share of the run the worker had nothing to generate or stood paused for a sync
  (from its heartbeat's `busy_s`);
- tokens: `generated`, `trained`, `left_over` (generated for groups the run did not get to before it
  stopped: kept, not thrown away), `thrown_away` (parked as over-stale), and `trained_share` =
  trained / (generated - left_over): 1.00 when nothing is thrown away;
- `final_reward` (mean of the last 5 steps), so that speed is never bought with learning;
- the **ideal overlap bound**, measured in the same run: the sync step time over the larger of the
  trainer's step (train + publish) and the generator's time for a step's tokens at full batching (the
  worker's tokens per busy second on a calibration batch of equal-length samples); and `of_bound`, the
  speedup as a share of it.

On GPUs, `--trainer-device cuda:0 --worker-device cuda:1` puts the trainer's policy on one GPU and the
worker (`rollouts worker --engine torch --device cuda:1`) on the other; `--hidden-size` and `--num-layers`
give a larger random policy than the CPU's tiny one, and `--transport` another path for the weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from grpo_trainer import GenerationSideDied, StepLog, TrainConfig, generation_side, train

from consumers.engines.tiny_model import build_tiny_model
from pipeline.codec import as_entries
from pipeline.local import RedisServer
from pipeline.wire import GENERATORS, TRAINER, Keys
from producers.client import RolloutClient

WORKER = "rl-worker-0"
COUNTERS = (b"busy_s", b"generated_tokens", b"inflight", b"ts")


def heartbeat(client: RolloutClient, ns: str, newer_than: float = 0.0) -> dict[str, float]:
    """The worker's counters, from a heartbeat written after `newer_than` (unix time): beats are periodic."""
    deadline = time.monotonic() + 30
    while True:
        fields = client.streams.redis.hgetall(Keys(ns).worker(WORKER))
        beat = {k.decode(): float(v) for k, v in fields.items() if k in COUNTERS}
        if beat.get("ts", 0.0) > newer_than:
            return beat
        if time.monotonic() > deadline:
            raise TimeoutError(f"no heartbeat of {WORKER} since {newer_than}")
        time.sleep(0.02)


def wait_idle(client: RolloutClient, ns: str, timeout_s: float = 300) -> None:
    """Until nothing is waiting on prompts or partials and the worker has nothing in flight."""
    keys, r = Keys(ns), client.streams.redis
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        waiting = 0
        for stream in (keys.prompts, keys.partials):
            delivered = next((g["last-delivered-id"].decode() for g in r.xinfo_groups(stream)), "0-0")
            undelivered = as_entries(r.xrange(stream, f"({delivered}", "+", count=1))
            waiting += r.xpending(stream, GENERATORS)["pending"] + len(undelivered)
        if waiting == 0 and heartbeat(client, ns, newer_than=time.time()).get("inflight", 1) == 0:
            return
        time.sleep(0.2)
    raise TimeoutError("the worker did not finish its work")


def calibrate(url: str, config: TrainConfig, model: Path, logs_dir: Path, worker_args: list[str]) -> float:
    """The worker's tokens per busy second at full batching: equal-length samples, many more than a batch.

    In a namespace of its own: admission counts every accepted sample, so these would eat into the
    capacity of the runs measured after.
    """
    ns = "bench-calibration"
    with generation_side(url, ns, model, "torch", 1, logs_dir, worker_args):
        client = RolloutClient(url, ns)
        before = heartbeat(client, ns)
        for i in range(4 * config.groups_per_step):
            client.submit(tokens=[300 + i % 100, 16], n=config.n, max_tokens=4 * config.max_tokens, seed=i)
        client.collect(4 * config.groups_per_step, timeout=600)
        wait_idle(client, ns)
        after = heartbeat(client, ns, newer_than=time.time())
    return (after["generated_tokens"] - before["generated_tokens"]) / (after["busy_s"] - before["busy_s"])


def leftover_tokens(url: str, ns: str) -> tuple[int, int]:
    """Tokens of rollouts the trainer never trained on (left over at the stop), and of those parked as stale.

    Left over: what the trainer was handed but had not used (groups still filling a batch, or not yet
    whole; pending under its consumer, `trainer-0`), and what it never read.
    """
    client = RolloutClient(url, ns)
    left = 0
    for consumer, pending in (("trainer-0", True), ("bench-drain", False)):
        while entries := client.streams.read_rollouts(consumer, 1000, None, pending=pending):
            left += sum(int(e.fields[b"n_tokens"]) for e in entries)
            client.streams.ack_rollouts([e.id for e in entries])
    stale = sum(int(fields[b"n_tokens"]) for _, fields in as_entries(client.streams.redis.xrange(Keys(ns).stale)))
    return left, stale


def run_mode(url: str, config: TrainConfig, model: Path, logs_dir: Path, worker_args: list[str]) -> dict[str, Any]:
    ns = f"bench-{config.mode}-{config.max_staleness}"
    with generation_side(url, ns, model, "torch", 1, logs_dir, worker_args):
        watcher = RolloutClient(url, ns)
        before = heartbeat(watcher, ns, newer_than=time.time())
        started = time.monotonic()
        logs: list[StepLog] = list(train(config, url, ns, model))
        wall = time.monotonic() - started
        during = heartbeat(watcher, ns, newer_than=time.time())  # at most one beat (0.2 s) late
        wait_idle(watcher, ns)
        after = heartbeat(watcher, ns, newer_than=time.time())
        left, stale = leftover_tokens(url, ns)
        assert watcher.streams.redis.xpending(Keys(ns).rollouts, TRAINER)["pending"] == 0
    generated = int(after["generated_tokens"] - before["generated_tokens"])
    trained = sum(s.tokens for s in logs)
    sampled = [s.elapsed_s for s in logs]
    return {
        "mode": config.mode if config.mode == "sync" else f"async η={config.max_staleness}",
        "steps": len(logs),
        "wall_s": round(wall, 3),
        "steps_per_s": round(len(logs) / wall, 4),
        "step_s_median": round(statistics.median(np.diff([0.0, *sampled])), 4),
        "trainer_step_s_median": round(statistics.median(s.train_s + s.publish_s for s in logs), 4),
        "trainer_idle": round(sum(s.wait_s for s in logs) / wall, 4),
        # Both from the worker's beats (busy seconds over its own clock), so never below 0.
        "generator_idle": round(1 - (during["busy_s"] - before["busy_s"]) / (during["ts"] - before["ts"]), 4),
        "tokens": {
            "generated": generated,
            "trained": trained,
            "left_over": left,
            "thrown_away": stale,
            "trained_share": round(trained / max(generated - left, 1), 4),
        },
        "tokens_per_step": round(trained / len(logs), 1),
        "final_reward": round(float(np.mean([s.reward for s in logs[-5:]])), 4),
        "staleness_max": max(s.staleness_max for s in logs),
        "curve": [[round(s.elapsed_s, 3), round(s.reward, 4)] for s in logs],
    }


def summarize(results: list[dict[str, Any]], full_batch_tokens_per_s: float) -> dict[str, float]:
    """Speedup over sync, and the ideal overlap bound: the sync step over max(trainer step, generator step)."""
    sync = results[0]
    generator_s = sync["tokens_per_step"] / full_batch_tokens_per_s
    trainer_s = statistics.median(row["trainer_step_s_median"] for row in results)
    bound = sync["step_s_median"] / max(trainer_s, generator_s)
    for row in results:
        row["speedup"] = round(row["steps_per_s"] / sync["steps_per_s"], 3)
        row["of_bound"] = round(row["speedup"] / bound, 3)
    return {
        "full_batch_tokens_per_s": round(full_batch_tokens_per_s, 1),
        "generator_step_s": round(generator_s, 4),
        "trainer_step_s": round(trainer_s, 4),
        "sync_step_s": sync["step_s_median"],
        "ideal_overlap_bound": round(bound, 3),
    }


def plot(results: list[dict[str, Any]], bound: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for row in results:
        xs, ys = zip(*row["curve"], strict=True)
        left.plot(xs, ys, label=row["mode"])
    left.set(xlabel="seconds", ylabel="mean reward", title="reward against wall time", ylim=(0, 1.02))
    left.legend()
    names = [row["mode"] for row in results]
    right.bar(names, [row["speedup"] for row in results], label="speedup over sync")
    right.axhline(bound["ideal_overlap_bound"], color="k", linestyle="--", label="ideal overlap bound")
    right.set(ylabel="x sync", title="steps/s over sync")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment() -> dict[str, Any]:
    """What the numbers were measured on, for the README beside them."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"torch": torch.__version__, "python": sys.version.split()[0], "gpus": gpus}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--etas", default="1,2,4", help="Staleness bounds of the async runs, comma-separated.")
    parser.add_argument("--groups-per-step", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16, help="The shortest response; the tail goes 16x further.")
    parser.add_argument("--length-alpha", type=float, default=1.5, help="Pareto exponent of response lengths.")
    parser.add_argument("--pause-mode", default="abort", choices=["abort", "keep"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--trainer-device", default="cpu", help="The trainer's policy and step (cuda:0).")
    parser.add_argument("--worker-device", default="cpu", help="The torch worker's engine (cuda:1).")
    parser.add_argument("--hidden-size", type=int, default=64, help="Of the random Qwen2 policy (multiple of 32).")
    parser.add_argument("--num-layers", type=int, default=2, help="Of the random Qwen2 policy.")
    parser.add_argument("--max-batch", type=int, help="The worker's largest decode batch (default: the engine's).")
    parser.add_argument("--transport", default="redis://", help="Weights transport: redis://, fs://DIR, nccl://...")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    etas = [int(x) for x in args.etas.split(",") if x]
    base = TrainConfig(
        steps=args.steps, groups_per_step=args.groups_per_step, n=args.n, max_tokens=args.max_tokens,
        length_alpha=args.length_alpha, pause_mode=args.pause_mode, seed=args.seed, device=args.trainer_device,
        transport=args.transport, lr=args.lr,
    )  # fmt: skip
    worker_args = ["--device", args.worker_device]
    worker_args += ["--max-batch", str(args.max_batch)] if args.max_batch else []
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp, RedisServer() as server:
        model = Path(tmp) / "model"
        build_tiny_model(model, seed=0, hidden_size=args.hidden_size, num_layers=args.num_layers)
        configs = [replace(base, mode="sync", max_staleness=0)]
        configs += [replace(base, mode="async", max_staleness=eta) for eta in etas]
        print("calibrating the worker at full batching ...", file=sys.stderr, flush=True)
        rate = calibrate(server.url, base, model, Path(tmp), worker_args)
        results = []
        for config in configs:
            print(f"running {config.mode} η={config.max_staleness} ...", file=sys.stderr, flush=True)
            results.append(run_mode(server.url, config, model, Path(tmp), worker_args))
        bound = summarize(results, rate)
    if args.plot:
        plot(results, bound, args.plot)
    report = {"config": vars(args) | {"plot": str(args.plot)}, "env": environment(), "bound": bound, "results": results}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    try:
        main()
    except GenerationSideDied as exc:
        sys.exit(f"async_vs_sync: a process of the run stopped: {exc}")

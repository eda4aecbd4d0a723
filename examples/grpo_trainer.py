"""A reference fully-async GRPO trainer on Rollout Streams: copy it and adapt it.

It uses the public API only: `RolloutClient` (submit with admission control, `batches` with the
staleness bound, `publish_weights`), `producers.grpo.grpo_step` (one update: rewards, group
advantages, the trainer's logprobs, the PPO-clipped loss of `producers.rl`, the optimizer step;
`rollouts demo` steps with it too), a task from `producers.tasks`, and the real CLI for the
generation side (`rollouts worker`, `rollouts manager`, started here as processes: point `--redis`
at a namespace whose workers you run yourself and pass `--workers 0`).

    python examples/grpo_trainer.py --steps 60 --mode async --max-staleness 2 --plot curve.png
    python examples/grpo_trainer.py --steps 60 --mode sync
    python examples/grpo_trainer.py --engine remote --url http://127.0.0.1:8000 --model MODEL  # a vLLM server

Modes. `sync`: submit a step's prompts, wait for all of them, train, publish; every sample is of
the current policy. `async`: a producer thread keeps submitting (admission holds it to
(η + v + 1) x B samples in use at version v), the trainer takes whole groups no more than η versions
old, trains, publishes; generation never waits for training.

Every step prints one JSON line (`StepLog`), and the run ends with a `summary` line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from pipeline.processes import start_command, start_worker, stop_processes, wait_for_worker
from pipeline.wire import PauseMode, Rollout
from producers.client import Batch, RolloutClient
from producers.grpo import grpo_step
from producers.tasks import TokenSetTask, token_set_reward


@dataclass
class TrainConfig:
    steps: int = 60
    mode: str = "async"
    """`sync` or `async`."""
    max_staleness: int = 2
    """η, for `async` (sync runs at 0)."""
    groups_per_step: int = 16
    n: int = 4
    """Samples per prompt (the GRPO group)."""
    max_tokens: int = 16
    length_alpha: float = 0.0
    """0: every prompt asks for `max_tokens`. > 0: `max_tokens` times a Pareto(alpha) draw, at most 16x as
    many: heavy-tailed response lengths, as reasoning traces have (the tiny model seldom stops early)."""
    temperature: float = 1.0
    lr: float = 1e-3
    clip_low: float = 0.2
    clip_high: float = 0.28
    pause_mode: PauseMode = "abort"
    transport: str = "redis://"
    seed: int = 0
    scoring: str = "trainer"
    """Where rewards are computed: `trainer` (here, inline), or by the scoring stage before the trainer
    gets the group: `inline` (`rollouts scorer`) or `rq` (`rollouts scorer --rq` + `rollouts score-worker`s)."""
    device: str = "cpu"
    """Where the trainer's policy and its step run (`cpu`, `cuda:0`); the workers pick theirs (`--device`)."""

    @property
    def batch_size(self) -> int:
        return self.groups_per_step * self.n


@dataclass
class StepLog:
    step: int
    version: int
    """The policy version published at the end of this step."""
    reward: float
    kl: float
    """KL(behaviour || current) over the batch, before the update."""
    clip_fraction: float
    staleness_mean: float
    """Trainer version - rollout version (that of its first token), over the batch's samples."""
    staleness_max: int
    multi_version: int
    """Samples whose tokens came from more than one policy version (a weight sync mid-sample)."""
    wait_s: float
    """The trainer waiting for its batch (idle)."""
    train_s: float
    sync_stall_s: float
    """How long the workers stood still in this step's weight sync."""
    publish_s: float
    """`publish_weights` as the trainer waited for it (tensors into the transport + the sync)."""
    samples: int
    tokens: int
    elapsed_s: float
    reward_errors: int = 0
    """Samples the scoring stage gave a `reward_error` (trained on with reward 0: no gradient from their group)."""
    ids: list[str] = field(default_factory=list, repr=False)


REWARD_FN = "producers.tasks:token_set_reward"
"""The task's reward by import path, for the scoring stage (`--scoring inline|rq`)."""


def stage_reward(rollout: Rollout) -> float:
    """The reward the scoring stage set; 0 where it could not (`reward_error`)."""
    return rollout.reward if rollout.reward is not None else 0.0


def rollouts_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *args]


class GenerationSideDied(BaseException):
    """A process the trainer started (a worker, the manager, a scorer) exited while the run needed it.

    A `BaseException`, as `KeyboardInterrupt` is: it is raised from a signal handler in whatever the main thread was
    running, and a library's `except Exception` there must not turn it into an error of its own (the manager's
    `sync` once re-raised it as a `SyncError`, and the run ended in a traceback instead of its one line)."""


def watch(processes: dict[str, tuple[subprocess.Popen[bytes], Path | None]], stopping: threading.Event,
          died: list[str]) -> None:  # fmt: skip
    """Stop the run if a process it started exits: else the trainer would wait for samples for ever (it did, when
    its only worker stopped). SIGUSR1 interrupts the main thread even in a blocking Redis read, and its handler
    (`generation_side`'s) raises `GenerationSideDied`, so the run unwinds and stops the rest by PID."""
    while not stopping.wait(1.0):
        for name, (process, log) in processes.items():
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
                code = process.returncode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                died.append(f"{name} {how}" + (f"; the end of its log:\n{tail}" if tail else ""))
                os.kill(os.getpid(), signal.SIGUSR1)
                return


@contextlib.contextmanager
def generation_side(
    url: str,
    ns: str,
    model: Path,
    engine: str,
    workers: int,
    log_dir: Path,
    worker_args: Sequence[str] = (),
    scoring: str = "trainer",
    score_workers: int = 1,
) -> Iterator[None]:
    """`rollouts manager` and `workers` x `rollouts worker`, as a user starts them; stopped by PID at the end.

    `worker_args`: more `rollouts worker` flags, e.g. `--device cuda:1` for a worker on a GPU of its own.
    `scoring` `inline` or `rq` also starts `rollouts scorer` (and, for `rq`, `score_workers` x
    `rollouts score-worker` on a queue of this namespace's own).
    """
    manager = subprocess.Popen(rollouts_cli("manager", "--redis", url, "--ns", ns), stderr=subprocess.DEVNULL)
    processes: dict[str, tuple[subprocess.Popen[bytes], Path | None]] = {"rollouts manager": (manager, None)}
    if scoring != "trainer":
        queue = ["--queue", f"rewards-{ns}"]
        scorer = ["scorer", "--redis", url, "--ns", ns, "--log-level", "warning"]
        scorer += ["--rq", *queue] if scoring == "rq" else []
        processes["rollouts scorer"] = start_command(*scorer, log_file=log_dir / "scorer.log"), log_dir / "scorer.log"
        for i in range(score_workers if scoring == "rq" else 0):
            args = ["score-worker", "--redis", url, *queue, "--name", f"{ns}-score-{i}", "--log-level", "warning"]
            log = log_dir / f"score-worker-{i}.log"
            processes[f"score-worker {i}"] = start_command(*args, log_file=log), log
    client = RolloutClient(url, ns)
    stopping, died = threading.Event(), list[str]()

    def raise_died(signum: int, frame: object) -> None:
        if not stopping.is_set():
            raise GenerationSideDied(died[0])

    previous = signal.signal(signal.SIGUSR1, raise_died)
    watcher = threading.Thread(target=watch, args=(processes, stopping, died), name="watch", daemon=True)
    try:
        for i in range(workers):
            name, log = f"rl-worker-{i}", log_dir / f"rl-worker-{i}.log"
            extra = ["--engine", engine, "--log-level", "warning", "--heartbeat-s", "0.2"]  # a fresh busy_s per mode
            extra += ["--num-threads", "1"] if engine == "torch" else []
            extra += list(worker_args)
            processes[name] = start_worker(url, ns, model, name, *extra, log_file=log), log
            try:
                wait_for_worker(client.streams.redis, ns, name, processes[name][0], timeout_s=300)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}; the end of its log:\n{log.read_text(errors='replace')[-2000:]}") from None
        watcher.start()
        yield
    finally:
        stopping.set()
        if watcher.is_alive():
            watcher.join()
        signal.signal(signal.SIGUSR1, previous)
        stop_processes([process for process, _ in processes.values()])


def submit_next(client: RolloutClient, task: TokenSetTask, config: TrainConfig, rng: random.Random, index: int,
                timeout: float | None = None) -> None:  # fmt: skip
    """Make prompt `index` of the run (the same sequence in both modes, for one seed) and submit it."""
    tokens, meta = task.prompt(rng)
    max_tokens = config.max_tokens
    if config.length_alpha > 0:
        max_tokens = min(16 * config.max_tokens, round(config.max_tokens * rng.paretovariate(config.length_alpha)))
    client.submit(
        tokens=tokens, n=config.n, max_tokens=max_tokens, temperature=config.temperature,
        seed=config.seed * 1_000_000 + index, meta=meta, id=f"s{config.seed}-p{index}", timeout=timeout,
        reward_fn=REWARD_FN if config.scoring != "trainer" else None,
    )  # fmt: skip


def produce(client: RolloutClient, task: TokenSetTask, config: TrainConfig, stop: threading.Event) -> None:
    """Async mode: submit prompts for ever; admission holds this thread back when (η + v + 1) x B are in use."""
    rng = random.Random(config.seed)
    index = 0
    while not stop.is_set():
        state = rng.getstate()
        try:
            submit_next(client, task, config, rng, index, timeout=5)
            index += 1
        except TimeoutError:
            rng.setstate(state)  # full: the trainer has not published yet; look at `stop`, then the same prompt again


def batches_of(client: RolloutClient, task: TokenSetTask, config: TrainConfig) -> Iterator[Batch]:
    """The batches the trainer steps on, in either mode."""
    if config.mode == "async":
        yield from client.batches(groups_per_batch=config.groups_per_step, max_staleness=config.max_staleness)
        return
    rng = random.Random(config.seed)
    for step in range(config.steps):
        for g in range(config.groups_per_step):
            submit_next(client, task, config, rng, step * config.groups_per_step + g)
        yield Batch(client.collect(config.groups_per_step, timeout=300, max_staleness=0), trainer_version=step)


def train(config: TrainConfig, url: str, ns: str, model: Path) -> Iterator[StepLog]:
    """The loop: a batch of whole groups → rewards → advantages → one clipped policy step → publish."""
    torch.manual_seed(config.seed)
    device = torch.device(config.device)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)  # type: ignore[arg-type]  # transformers' @wraps on .to: mypy reads it unbound
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr)
    task = TokenSetTask()
    if config.mode == "async":
        client = RolloutClient(url, ns, max_staleness=config.max_staleness, batch_size=config.batch_size)
    else:
        client = RolloutClient(url, ns)
    stop = threading.Event()
    if config.mode == "async":
        threading.Thread(target=produce, args=(client, task, config, stop), daemon=True).start()
    started = time.monotonic()
    waited_from = time.monotonic()
    try:
        for step, batch in enumerate(batches_of(client, task, config)):
            wait_s = time.monotonic() - waited_from
            t0 = time.monotonic()
            rollouts = batch.rollouts
            clip = {"clip_low": config.clip_low, "clip_high": config.clip_high}
            reward = token_set_reward if config.scoring == "trainer" else stage_reward
            out = grpo_step(policy, optimizer, batch, reward, **clip)  # rewards → advantages → loss → step
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # else the step's kernels would be timed as part of the publish
            t1 = time.monotonic()
            version = client.publish_weights(policy, transport=config.transport, mode=config.pause_mode)
            t2 = time.monotonic()
            trainer_version = batch.trainer_version if batch.trainer_version is not None else version - 1
            staleness = [trainer_version - r.version for r in rollouts]
            yield StepLog(
                step=step, version=version, reward=out.reward,
                kl=out.kl, clip_fraction=out.clip_fraction, staleness_mean=float(np.mean(staleness)),
                staleness_max=int(max(staleness)), multi_version=sum(len(r.spans) > 1 for r in rollouts),
                wait_s=wait_s, train_s=t1 - t0, sync_stall_s=client.last_sync.stall_s if client.last_sync else 0.0,
                publish_s=t2 - t1, samples=len(rollouts), tokens=sum(r.n_tokens for r in rollouts),
                elapsed_s=t2 - started, reward_errors=sum(r.reward_error is not None for r in rollouts),
                ids=[r.id for r in rollouts],
            )  # fmt: skip
            waited_from = time.monotonic()
            if step + 1 >= config.steps:
                break
    finally:
        stop.set()


def plot(logs: list[StepLog], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot([s.step for s in logs], [s.reward for s in logs], marker=".")
    left.set(xlabel="step", ylabel="mean reward", title=title, ylim=(0, 1.02))
    right.plot([s.elapsed_s for s in logs], [s.reward for s in logs], marker=".")
    right.set(xlabel="seconds", ylabel="mean reward", title="against wall time", ylim=(0, 1.02))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainConfig()
    choices = {"mode": ["sync", "async"], "pause_mode": ["abort", "keep"], "scoring": ["trainer", "inline", "rq"]}
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value, choices=choices.get(name))
    parser.add_argument("--redis", help="Redis URL (default: a private redis-server, started here).")
    parser.add_argument("--ns", default="grpo")
    parser.add_argument("--model", type=Path, help="Model directory (default: a fresh tiny model).")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm", "remote"])
    parser.add_argument("--url", help="--engine remote: the vLLM server the workers drive (it serves --model).")
    parser.add_argument("--workers", type=int, default=1, help="Workers to start here (0: yours are running).")
    parser.add_argument("--worker-device", default="cpu", help="torch engine: the workers' device (cuda:1).")
    parser.add_argument("--score-workers", type=int, default=1, help="--scoring rq: RQ score-workers to start here.")
    parser.add_argument("--plot", type=Path, help="Write the learning curve to this PNG.")
    args = parser.parse_args(argv)
    if args.engine == "remote" and (args.url is None or args.model is None):
        parser.error("--engine remote needs --url http://HOST:PORT of a running vLLM server and --model, its model")
    config = TrainConfig(**{name: getattr(args, name) for name in asdict(defaults)})
    torch.set_num_threads(1)  # the trainer on one core, the worker on the other
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="grpo-")))
        url = args.redis
        if url is None:
            from pipeline.local import RedisServer

            url = stack.enter_context(RedisServer()).url
        model = args.model
        if model is None:
            model = tmp / "model"
            subprocess.run(rollouts_cli("tiny-model", str(model)), check=True, capture_output=True)
        if args.workers:
            engine_flags = {"torch": ["--device", args.worker_device], "remote": ["--url", args.url]}
            worker_args = engine_flags.get(args.engine, [])
            stack.enter_context(
                generation_side(
                    url, args.ns, model, args.engine, args.workers, tmp, worker_args, config.scoring, args.score_workers
                )
            )
        logs, seen = [], set()
        try:
            for log in train(config, url, args.ns, model):
                logs.append(log)
                seen.update(log.ids)
                print(json.dumps({k: v for k, v in asdict(log).items() if k != "ids"}), flush=True)
        except GenerationSideDied as exc:
            stack.close()  # the others, stopped by PID before we go
            sys.exit(f"grpo_trainer: the run stopped after {len(logs)} steps: {exc}")
        trained = sum(log.samples for log in logs)
        summary = {"summary": True, "mode": config.mode, "steps": len(logs), "samples": trained, "unique": len(seen)}
        summary |= {"first_reward": logs[0].reward, "final_reward": float(np.mean([s.reward for s in logs[-5:]]))}
        summary |= {"elapsed_s": logs[-1].elapsed_s, "max_staleness": max(s.staleness_max for s in logs)}
        print(json.dumps(summary), flush=True)
        if args.plot:
            plot(logs, args.plot, f"GRPO on the token-set task ({config.mode})")


if __name__ == "__main__":
    main()

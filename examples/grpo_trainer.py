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

Tasks. `--task token-set` (the default) is the task the random tiny model learns, on token ids. With a real model
(`--model smollm2`, SmolLM2-135M-Instruct), `--task` names text tasks of `producers.tasks`, comma-separated
(`arithmetic:sum-1d,arithmetic:times-table`): prompts from their train splits through the model's chat template,
exact-match rewards on the decoded reply, `--max-tokens` the cap of a reply the policy ends itself; with several,
`--curriculum` mixes them (`mix`) or brings them in stage by stage (`staged`).

    python examples/grpo_trainer.py --model smollm2 --task arithmetic:sum-1d --lr 2e-5 --groups-per-step 8 \
        --max-tokens 64 --steps 8 --mode async --max-staleness 1

Modes. `sync`: submit a step's prompts, wait for all of them, train, publish; every sample is of
the current policy. `one-step-off`: the next step's prompts are generated while the trainer steps on
this one's, and weights are published between batches (nothing is in flight then): every sample is one
version old. `async`: a producer thread keeps submitting (admission holds it to (η + v + 1) x B samples
in use at version v), the trainer takes the next whole groups, trains, and publishes every
`--sync-every` steps; generation never waits for training, and a sample in flight across a sync carries
tokens of several versions. Nothing admitted is thrown away unless `--park-max-age` names a bound.

The update is decoupled PPO (`--objective`, `--is-level`, `--is-mode`, `--is-cap`, `--minibatches`:
`producers.grpo.grpo_step`). Every step prints one JSON line (`StepLog`), and the run ends with a
`summary` line: steps, reward, and `trained_share`, the share of the tokens generated for the run's
groups that it trained on (parked groups are the rest).
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
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from pipeline.processes import start_command, start_worker, stop_processes, wait_for_worker
from pipeline.wire import PauseMode, Rollout
from producers.client import Batch, ParkingBound, RolloutClient
from producers.grpo import grpo_step
from producers.rl import ImportanceWeights
from producers.tasks import Problem, TokenSetTask, get_task, text_reward, token_set_reward
from producers.tasks.base import stable_hash

TOKEN_SET = "token-set"
"""`TrainConfig.task`'s default: the token-set task (`producers.tasks.TokenSetTask`), on token ids."""
CURRICULA = ("mix", "staged")


@dataclass
class TrainConfig:
    steps: int = 60
    task: str = TOKEN_SET
    """`token-set` (the tiny model's task, on token ids), or text tasks of `producers.tasks`, comma-separated
    (`arithmetic:sum-1d,arithmetic:times-table`; a real model's, with its chat template): prompts from their train
    splits, exact-match rewards; `max_tokens` is then the cap of a reply the policy ends itself."""
    curriculum: str = "mix"
    """With several text tasks: `mix` (each prompt's task drawn uniformly) or `staged` (the run's steps in as many
    stages as tasks; stage k draws uniformly from the first k + 1, so the earlier ones stay in the mix)."""
    mode: str = "async"
    """`sync`, `one-step-off` or `async`."""
    max_staleness: int = 2
    """η, for `async`: admission keeps at most (η + v + 1) x B samples in use at version v (sync runs at 0,
    one-step-off at 1)."""
    groups_per_step: int = 16
    n: int = 4
    """Samples per prompt (the GRPO group)."""
    max_tokens: int = 16
    length_alpha: float = 0.0
    """0: every prompt asks for `max_tokens`. > 0: `max_tokens` times a Pareto(alpha) draw, at most 16x as
    many: heavy-tailed response lengths, as reasoning traces have (the tiny model seldom stops early)."""
    length_sets: bool = False
    """With `length_alpha`: the set a prompt names follows its length (the quarter of the length law it falls in),
    so the longest quarter of the prompts is one set: a trainer that skips long samples cannot learn it."""
    stop_set: int = 0
    """0: a sample is as long as its prompt asks (`max_tokens`). k > 0: the policy decides its own length: any of k
    stop ids ends a sample (`producers.tasks.TokenSetTask.stop_ids`), `max_tokens` is only the cap (16x the
    shortest), and the reward counts set tokens over the larger of the sample's length and the prompt's demanded
    length (the length draw above), so stopping early costs reward and the policy learns how long to go on."""
    temperature: float = 1.0
    lr: float = 1e-3
    clip_low: float = 0.2
    clip_high: float = 0.28
    objective: str = "decoupled"
    """`decoupled` (PPO clipped around the policy as the step starts, importance-weighted to the behaviour policy)
    or `ppo` (clipped around the behaviour policy): `producers.grpo`."""
    is_level: str = "token"
    is_mode: str = "truncate"
    is_cap: float = 2.0
    minibatches: int = 1
    """Optimizer steps a batch (the proximal policy is the policy as the step starts)."""
    sync_every: int = 1
    """`async`: publish weights every this many steps (admission's B is then the samples of that many steps)."""
    park_max_age: int = -1
    """-1: nothing is parked. k >= 0: park a group with a sample of which more than `park_max_share` of the tokens
    are more than k versions old (`producers.client.ParkingBound`)."""
    park_max_share: float = 0.0
    pause_mode: PauseMode = "abort"
    transport: str = "redis://"
    seed: int = 0
    scoring: str = "trainer"
    """Where rewards are computed: `trainer` (here, inline), or by the scoring stage before the trainer
    gets the group: `inline` (`rollouts scorer`) or `rq` (`rollouts scorer --rq` + `rollouts score-worker`s)."""
    device: str = "cpu"
    """Where the trainer's policy and its step run (`cpu`, `cuda:0`); the workers pick theirs (`--device`)."""
    dtype: str = "float32"
    """What the step computes in: `float32`, or `bfloat16` (autocast, where the engines serve the policy in bf16:
    tensor cores on a GPU; the weights, gradients and optimizer stay float32, and so does what is published)."""

    @property
    def batch_size(self) -> int:
        return self.groups_per_step * self.n

    def problems(self) -> list[str]:
        """What a user must fix before the run can start, one line each."""
        out = []
        if self.mode not in ("sync", "one-step-off", "async"):
            out.append(f"--mode {self.mode}: use sync, one-step-off or async")
        if self.sync_every < 1:
            out.append(f"--sync-every must be >= 1, got {self.sync_every}")
        elif self.sync_every > 1 and self.mode != "async":
            out.append("--sync-every is for --mode async (for several optimizer steps on one batch: --minibatches)")
        if not 0 <= self.stop_set <= TokenSetTask().max_stop_ids:
            out.append(f"--stop-set {self.stop_set}: use 0 (off) to {TokenSetTask().max_stop_ids} stop ids")
        if self.dtype not in ("float32", "bfloat16"):
            out.append(f"--dtype {self.dtype}: use float32 or bfloat16")
        if self.park_max_age >= 0 and self.mode != "async":
            out.append("--park-max-age is for --mode async (nothing in sync or one-step-off is older than it must be)")
        if self.curriculum not in CURRICULA:
            out.append(f"--curriculum {self.curriculum}: use {' or '.join(CURRICULA)}")
        if self.task != TOKEN_SET:
            for name in self.task.split(","):
                try:
                    get_task(name)
                except ValueError as exc:
                    out.append(f"--task: {exc}")
            if self.length_alpha > 0 or self.length_sets or self.stop_set:
                out.append("--length-alpha, --length-sets and --stop-set are the token-set task's (a text task's "
                           "policy ends its own reply; --max-tokens is its cap)")  # fmt: skip
            if self.scoring != "trainer":
                out.append("--scoring inline|rq is for the token-set task (text tasks are scored in the trainer)")
        return out

    @property
    def text_tasks(self) -> bool:
        """Whether `task` names text tasks (a real model's) rather than the token-set task."""
        return self.task != TOKEN_SET


@dataclass
class StepLog:
    step: int
    version: int
    """The policy version published at the end of this step."""
    reward: float
    kl: float
    """KL(behaviour || current) over the batch, before the update."""
    clip_fraction: float
    is_weight_mean: float
    """Mean importance weight proximal / behaviour over the tokens trained (1 when nothing is stale)."""
    is_capped_fraction: float
    """Share of tokens whose importance weight was over `is_cap`."""
    staleness_first: float
    """Trainer version - the version of a sample's first token, averaged over the batch's samples."""
    staleness_last: float
    """The same for a sample's last token."""
    staleness_token: float
    """Trainer version - the version that wrote a token, over the batch's tokens."""
    staleness_max: int
    """The most of any sample's first token."""
    multi_version: int
    """Samples whose tokens came from more than one policy version (a weight sync mid-sample)."""
    wait_s: float
    """The trainer waiting for its batch (idle)."""
    train_s: float
    sync_stall_s: float
    """How long the workers stood still in this step's weight sync (0 in a step that did not publish)."""
    publish_s: float
    """`publish_weights` as the trainer waited for it (tensors into the transport + the sync)."""
    samples: int
    tokens: int
    """Tokens trained on in this step."""
    parked: int
    """Samples parked (over `--park-max-age`) while this step's batch was filled."""
    elapsed_s: float
    reward_errors: int = 0
    """Samples the scoring stage gave a `reward_error` (trained on with reward 0: no gradient from their group)."""
    groups: int = 0
    flat_groups: int = 0
    """Groups whose rewards are all equal (all right or all wrong): no advantage, no signal for the update."""
    ids: list[str] = field(default_factory=list, repr=False)


REWARD_FN = "producers.tasks:token_set_reward"
"""The task's reward by import path, for the scoring stage (`--scoring inline|rq`)."""


def stage_reward(rollout: Rollout) -> float:
    """The reward the scoring stage set; 0 where it could not (`reward_error`)."""
    return rollout.reward if rollout.reward is not None else 0.0


def rollouts_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollouts", *args]


def gpu_of(device: str) -> dict[str, str] | None:
    """The environment that gives a vLLM worker GPU `cuda:N` alone, or `cuda:N,M` for tensor parallel 2 (vLLM takes the
    first GPUs it sees, and the worker's `--device` is the torch engine's); None for cpu or a bare `cuda`."""
    kind, _, index = device.partition(":")
    return {"CUDA_VISIBLE_DEVICES": index} if kind == "cuda" and index else None


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
    worker_env: dict[str, str] | None = None,
) -> Iterator[None]:
    """`rollouts manager` and `workers` x `rollouts worker`, as a user starts them; stopped by PID at the end.

    `worker_args`: more `rollouts worker` flags, e.g. `--device cuda:1` for a torch worker on a GPU of its own;
    `worker_env`: variables for the workers alone, e.g. `CUDA_VISIBLE_DEVICES=1` for a vLLM worker.
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
        names = [f"rl-worker-{i}" for i in range(workers)]
        for name in names:  # all started before any is waited for: a fleet starts in one worker's time
            log = log_dir / f"{name}.log"
            extra = ["--engine", engine, "--log-level", "warning", "--heartbeat-s", "0.2"]  # a fresh busy_s per mode
            extra += ["--num-threads", "1"] if engine == "torch" else []
            extra += list(worker_args)
            processes[name] = start_worker(url, ns, model, name, *extra, log_file=log, env=worker_env), log
        for name in names:
            process, log_file = processes[name]
            try:
                wait_for_worker(client.streams.redis, ns, name, process, timeout_s=300)
            except (RuntimeError, TimeoutError) as exc:
                tail = log_file.read_text(errors="replace")[-2000:] if log_file is not None else ""
                raise RuntimeError(f"{exc}; the end of its log:\n{tail}") from None
        watcher.start()
        yield
    finally:
        stopping.set()
        if watcher.is_alive():
            watcher.join()
        signal.signal(signal.SIGUSR1, previous)
        stop_processes([process for process, _ in processes.values()])


class TextPrompts:
    """The prompts of a run on text tasks (`TrainConfig.task`): prompt `index` is a train problem of the task
    `index` falls to (`TrainConfig.curriculum`), a pure function of the seed and the index, so every mode of one seed
    sees the same sequence. Within each window of `WINDOW` indices a task's problems are distinct (drawn without
    repeats from its train split); windows draw afresh."""

    WINDOW = 32

    def __init__(self, config: TrainConfig) -> None:
        self.tasks = [get_task(name) for name in config.task.split(",")]
        self.seed, self.curriculum = config.seed, config.curriculum
        self.steps, self.groups_per_step = config.steps, config.groups_per_step
        self._windows: dict[tuple[int, int], list[Problem]] = {}

    def task_of(self, index: int) -> int:
        """Which task prompt `index` is of: uniform over all (`mix`), or over those its stage has brought in."""
        k = len(self.tasks)
        if self.curriculum == "staged":
            step = index // max(self.groups_per_step, 1)
            k = min(k, 1 + step * k // max(self.steps, 1))
        return stable_hash(f"{self.seed}|task|{index}") % k

    def problem(self, index: int) -> Problem:
        which = self.task_of(index)
        task, window = self.tasks[which], index // self.WINDOW
        if (which, window) not in self._windows:
            size = task.split_size("train")
            count = self.WINDOW if size is None else min(self.WINDOW, size)
            seed = stable_hash(f"{self.seed}|{task.name}|{window}") % 2**31
            self._windows[(which, window)] = task.problems("train", count, seed=seed)
        drawn = self._windows[(which, window)]
        return drawn[index % len(drawn)]


def prompt_length(config: TrainConfig, rng: random.Random) -> tuple[int, int | None]:
    """A prompt's `max_tokens`, and with `length_sets` the set it names (the quarter of the length law it is in)."""
    if config.length_alpha <= 0:
        return config.max_tokens, None
    u = 1.0 - rng.random()  # in (0, 1]: the Pareto draw is u^(-1/alpha), longer for smaller u
    max_tokens = min(16 * config.max_tokens, round(config.max_tokens * u ** (-1.0 / config.length_alpha)))
    n_sets = TokenSetTask().n_sets
    return max_tokens, min(n_sets - 1, int((1.0 - u) * n_sets)) if config.length_sets else None


def submit_next(client: RolloutClient, task: TokenSetTask | TextPrompts, config: TrainConfig, rng: random.Random,
                index: int, run: str, timeout: float | None = None) -> None:  # fmt: skip
    """Make prompt `index` of the run (the same sequence in every mode, for one seed) and submit it, as prompt
    `{run}-s{seed}-p{index}`: `run` is new each run, so that a second run on the same namespace never reuses a
    rollout id (the publisher and the client drop a rollout whose id was seen)."""
    if isinstance(task, TextPrompts):  # text through the chat template; the policy ends its reply, max_tokens caps it
        problem = task.problem(index)
        client.submit(
            problem.prompt, n=config.n, max_tokens=config.max_tokens, temperature=config.temperature,
            seed=config.seed * 1_000_000 + index, meta=problem.meta, id=f"{run}-s{config.seed}-p{index}",
            timeout=timeout,
        )  # fmt: skip
        return
    max_tokens, named_set = prompt_length(config, rng)
    tokens, meta = task.prompt(rng, named_set)
    stop_ids = task.stop_ids(config.stop_set)
    if config.stop_set:  # the policy decides its length: the draw is what the reward demands, 16x it the cap
        meta, max_tokens = meta | {"length": max_tokens}, 16 * config.max_tokens
    client.submit(
        tokens=tokens, n=config.n, max_tokens=max_tokens, temperature=config.temperature, stop_token_ids=stop_ids,
        seed=config.seed * 1_000_000 + index, meta=meta, id=f"{run}-s{config.seed}-p{index}", timeout=timeout,
        reward_fn=REWARD_FN if config.scoring != "trainer" else None,
    )  # fmt: skip


def produce(
    client: RolloutClient, task: TokenSetTask | TextPrompts, config: TrainConfig, stop: threading.Event, run: str
) -> None:
    """Async mode: submit prompts for ever; admission holds this thread back when (η + v + 1) x B are in use."""
    rng = random.Random(config.seed)
    index = 0
    while not stop.is_set():
        state = rng.getstate()
        try:
            submit_next(client, task, config, rng, index, run, timeout=5)
            index += 1
        except TimeoutError:
            rng.setstate(state)  # full: the trainer has not published yet; look at `stop`, then the same prompt again


def batches_of(
    client: RolloutClient,
    task: TokenSetTask | TextPrompts,
    config: TrainConfig,
    publish: Callable[[], None],
    run: str,
) -> Iterator[Batch]:
    """The batches the trainer steps on. In `one-step-off` mode this also publishes (`publish`): between batches,
    once the next one is generated and before its successor is submitted, so that no sample spans a sync."""
    if config.mode == "async":
        yield from client.batches(groups_per_batch=config.groups_per_step)
        return
    rng = random.Random(config.seed)

    def submit_step(step: int) -> None:
        for g in range(config.groups_per_step):
            submit_next(client, task, config, rng, step * config.groups_per_step + g, run)

    submit_step(0)
    for step in range(config.steps):
        if config.mode == "sync":
            if step:
                submit_step(step)
            yield Batch(client.collect(config.groups_per_step, timeout=300))
            continue
        groups = client.collect(config.groups_per_step, timeout=300)  # generated while the trainer stepped
        if step:
            publish()  # the previous step's weights, with nothing in flight
        if step + 1 < config.steps:
            submit_step(step + 1)
        yield Batch(groups)


def stale_tokens(client: RolloutClient) -> int:
    """Tokens of the samples parked on `{ns}:stale` so far."""
    entries: list[tuple[bytes, dict[bytes, bytes]]] = client.streams.redis.xrange(client.streams.keys.stale)  # type: ignore[assignment]  # redis-py types replies loosely
    return sum(int(fields[b"n_tokens"]) for _, fields in entries)


OnStep = Callable[[int, torch.nn.Module, float], None]
"""Called after each step with (step, the policy, the run's elapsed seconds): e.g. to keep a snapshot that is
evaluated after the run. Its own time is taken off the run's clock."""


def train(config: TrainConfig, url: str, ns: str, model: Path, on_step: OnStep | None = None) -> Iterator[StepLog]:
    """The loop: a batch of whole groups → rewards → advantages → decoupled PPO step(s) → publish."""
    problems = config.problems()
    if problems:
        raise ValueError("; ".join(problems))
    torch.manual_seed(config.seed)
    device = torch.device(config.device)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)  # type: ignore[arg-type]  # transformers' @wraps on .to: mypy reads it unbound
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr)
    importance = ImportanceWeights(config.is_level, config.is_mode, config.is_cap)  # type: ignore[arg-type]  # argparse checked the names
    task = TextPrompts(config) if config.text_tasks else TokenSetTask()
    park = ParkingBound(config.park_max_age, config.park_max_share) if config.park_max_age >= 0 else None
    samples_per_version = config.batch_size * config.sync_every
    tokenizer = model if config.text_tasks else None  # text prompts go through the model's chat template
    if config.mode == "async":
        client = RolloutClient(
            url, ns, park=park, max_staleness=config.max_staleness, batch_size=samples_per_version, tokenizer=tokenizer
        )
    else:
        client = RolloutClient(url, ns, park=park, tokenizer=tokenizer)
    reward: Callable[[Rollout], float] = token_set_reward if config.scoring == "trainer" else stage_reward
    if config.text_tasks:
        decoder = client.tokenizer
        reward = text_reward(lambda ids: str(decoder.decode(ids, skip_special_tokens=True)))
    version = client.admission_usage().version
    published: dict[str, float] = {}

    def publish() -> None:
        nonlocal version
        t = time.monotonic()
        version = client.publish_weights(policy, transport=config.transport, mode=config.pause_mode)
        published.update(s=time.monotonic() - t, stall_s=client.last_sync.stall_s if client.last_sync else 0.0)

    stop = threading.Event()
    run = uuid.uuid4().hex[:8]
    if config.mode == "async":
        threading.Thread(target=produce, args=(client, task, config, stop, run), daemon=True).start()
    started = time.monotonic()
    off_clock = 0.0
    waited_from = time.monotonic()
    parked_before = 0
    try:
        for step, batch in enumerate(batches_of(client, task, config, publish, run)):
            wait_s = time.monotonic() - waited_from - published.get("s", 0.0)  # one-step-off published meanwhile
            trainer_version = version
            t0 = time.monotonic()
            rollouts = batch.rollouts
            out = grpo_step(
                policy, optimizer, batch, reward, objective=config.objective, importance=importance,  # type: ignore[arg-type]  # argparse checked it
                clip_low=config.clip_low, clip_high=config.clip_high, minibatches=config.minibatches,
                autocast=torch.bfloat16 if config.dtype == "bfloat16" else None,
            )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # else the step's kernels would be timed as part of the publish
            t1 = time.monotonic()
            if config.mode != "one-step-off" and (step + 1) % config.sync_every == 0:
                publish()
            staleness = batch.staleness(trainer_version)
            elapsed = time.monotonic() - started - off_clock
            yield StepLog(
                step=step, version=version, reward=out.reward, kl=out.kl, clip_fraction=out.clip_fraction,
                is_weight_mean=out.is_weight_mean, is_capped_fraction=out.is_capped_fraction,
                staleness_first=staleness["first"], staleness_last=staleness["last"],
                staleness_token=staleness["token_mean"], staleness_max=int(staleness["max"]),
                multi_version=sum(len(r.spans) > 1 for r in rollouts), wait_s=wait_s, train_s=t1 - t0,
                sync_stall_s=published.get("stall_s", 0.0), publish_s=published.get("s", 0.0), samples=len(rollouts),
                tokens=sum(r.n_tokens for r in rollouts), parked=client.stats["stale"] - parked_before,
                elapsed_s=elapsed, reward_errors=sum(r.reward_error is not None for r in rollouts),
                groups=len(out.rewards), flat_groups=sum(len(set(g)) <= 1 for g in out.rewards),
                ids=[r.id for r in rollouts],
            )  # fmt: skip
            parked_before = client.stats["stale"]
            if on_step is not None:
                t2 = time.monotonic()
                on_step(step, policy, elapsed)
                off_clock += time.monotonic() - t2
            published.clear()
            waited_from = time.monotonic()
            if step + 1 >= config.steps:
                break
    finally:
        stop.set()


def summarize(config: TrainConfig, logs: list[StepLog], url: str, ns: str) -> dict[str, object]:
    """The run's `summary` line."""
    trained = sum(log.tokens for log in logs)
    parked_tokens = stale_tokens(RolloutClient(url, ns))
    return {
        "summary": True, "mode": config.mode, "steps": len(logs), "samples": sum(log.samples for log in logs),
        "unique": len({i for log in logs for i in log.ids}), "first_reward": logs[0].reward,
        "final_reward": float(np.mean([s.reward for s in logs[-5:]])), "elapsed_s": logs[-1].elapsed_s,
        "max_staleness": max(s.staleness_max for s in logs), "parked": sum(s.parked for s in logs),
        "trained_tokens": trained, "parked_tokens": parked_tokens,
        "trained_share": trained / max(trained + parked_tokens, 1),
    }  # fmt: skip


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
    choices = {
        "mode": ["sync", "one-step-off", "async"], "pause_mode": ["abort", "keep", "inflight"],
        "scoring": ["trainer", "inline", "rq"], "objective": ["decoupled", "ppo"],
        "is_level": ["token", "sequence", "geometric"], "is_mode": ["truncate", "mask"],
        "dtype": ["float32", "bfloat16"], "curriculum": list(CURRICULA),
    }  # fmt: skip
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value, choices=choices.get(name))
    parser.add_argument("--redis", help="Redis URL (default: a private redis-server, started here).")
    parser.add_argument("--ns", default="grpo")
    parser.add_argument(
        "--model", type=Path, help="Model directory, or smollm2 (SmolLM2-135M-Instruct; default: a fresh tiny model)."
    )
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm", "remote"])
    parser.add_argument("--url", help="--engine remote: the vLLM server the workers drive (it serves --model).")
    parser.add_argument("--workers", type=int, default=1, help="Workers to start here (0: yours are running).")
    parser.add_argument(
        "--worker-device", default="cpu", help="The workers' device (cuda:1; for vLLM, the GPU they may see)."
    )
    parser.add_argument("--score-workers", type=int, default=1, help="--scoring rq: RQ score-workers to start here.")
    parser.add_argument("--plot", type=Path, help="Write the learning curve to this PNG.")
    args = parser.parse_args(argv)
    if args.engine == "remote" and (args.url is None or args.model is None):
        parser.error("--engine remote needs --url http://HOST:PORT of a running vLLM server and --model, its model")
    config = TrainConfig(**{name: getattr(args, name) for name in asdict(defaults)})
    for problem in config.problems():
        parser.error(problem)
    if config.text_tasks and args.model is None:
        parser.error(f"--task {config.task} needs a real model with a chat template: --model smollm2 (or a folder)")
    if args.model is not None and not args.model.exists():  # `smollm2`: its cached folder, built on first use
        from consumers.engines.pretrained import MODELS, PretrainedError, build_pretrained

        if str(args.model) not in MODELS:
            parser.error(f"--model {args.model}: no such folder (or a pretrained model's name: {', '.join(MODELS)})")
        try:
            args.model = build_pretrained(str(args.model))
        except PretrainedError as exc:
            parser.error(str(exc))
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
            side = generation_side(
                url, args.ns, model, args.engine, args.workers, tmp, worker_args, config.scoring, args.score_workers,
                worker_env=gpu_of(args.worker_device) if args.engine == "vllm" else None,
            )  # fmt: skip
            stack.enter_context(side)
        logs: list[StepLog] = []
        try:
            for log in train(config, url, args.ns, model):
                logs.append(log)
                print(json.dumps({k: v for k, v in asdict(log).items() if k != "ids"}), flush=True)
        except GenerationSideDied as exc:
            stack.close()  # the others, stopped by PID before we go
            sys.exit(f"grpo_trainer: the run stopped after {len(logs)} steps: {exc}")
        print(json.dumps(summarize(config, logs, url, args.ns)), flush=True)
        if args.plot:
            plot(logs, args.plot, f"GRPO on {config.task} ({config.mode})")


if __name__ == "__main__":
    main()

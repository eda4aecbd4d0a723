"""`rollouts bench-rl`: how much sooner fully-async RL reaches a reward than sync RL, as a user judges it.

The same task, engine, seeds and hyper-parameters in each mode (`sync`, `one-step-off`, `async:η`), each run the
reference trainer (`examples/grpo_trainer.py`'s `train`) against `rollouts worker`s and a `rollouts manager` kept up
for every run on that many workers: between runs the fleet is idle and its namespace is reset (the base policy
published again, the admission counters as a fresh namespace's relative to the version), so an engine starts once a
fleet, not once a run, and no run pays an engine's first requests (a warm-up batch, off the clock, goes first).

The task is the token-set task with long-tailed lengths (`--length-alpha`): a prompt's `max_tokens` is a Pareto
draw up to 16x the shortest, and with `--length-sets` (the default) the set a prompt names is the quarter of the
length law it falls in, so a trainer that skips long samples never learns the longest quarter.

The metric is **wall time to a target reward of the current policy**: after every `--eval-every` steps the
trainer's weights are copied (off the clock), and after the run each copy is evaluated on held-out prompts (each
with its own length and set, as in training): the expected share of set tokens along continuations the policy
samples itself (at each position, the probability mass the policy puts on the set: the reward's expectation,
without the noise of the token drawn). Per mode, over the seeds: the median and spread of time to target, beside
steps to target, steps/s, trained tokens/s, tokens generated and trained (`trained_share`: trained over generated
for the groups the run used or parked, left-overs at the stop aside), token staleness, clip fraction, capped
importance weights, the sync stall, and the ideal overlap bound of the setting (the sync step over the larger of
the trainer's step and the generator's time for a step's tokens at full batching). JSON on stdout; `--plot` draws
the eval reward against wall time, every mode and seed in one figure.

On a fleet (`--workers 1,2,4`): every mode and seed runs once per worker count W, against W `rollouts worker`s. Beside
each mode's measured step time stands the ideal of a perfectly spread fleet (one worker's generator time for a step's
tokens at full batching, from the calibration, ÷ W), and the share of each step's samples that each worker made (from
the rollouts' `worker` field): a step that lands on one worker shows as a share of 1. When stderr is not a terminal,
progress comes as plain lines (at most one every `PROGRESS_EVERY_S` while a run steps) instead of rich's bar.

On a real model (`--model smollm2 --task arithmetic:sum-1d`): a text task's prompts and exact-match rewards, the
held-out accuracy sampled through the fleet as the eval reward, the target chosen from the base policy's accuracy
(`--target-gain`), and the figures only a real model has: `benchmarks.bench_rl_real`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

from benchmarks import bench_rl_real
from benchmarks.bench_rl_real import RealEval, TextHeldOut
from consumers.engines.tiny_model import build_tiny_model
from consumers.engines.torch_scheduler import cache_name
from pipeline.codec import as_entries
from pipeline.local import RedisServer
from pipeline.wire import GENERATORS, PAUSE_MODES, TRAINER, Keys
from producers.client import RolloutClient
from producers.tasks import TokenSetTask

if TYPE_CHECKING:
    from transformers import PreTrainedModel

REPO = Path(__file__).resolve().parent.parent
TRAINER_FILE = REPO / "examples" / "grpo_trainer.py"
COUNTERS = (b"busy_s", b"generated_tokens", b"inflight", b"ts")
SERVED_GROUP = "bench-rl-served"
"""A consumer group on `{ns}:rollouts` that reads nothing during a run: trimming waits for it, so that after the run
every rollout still says which worker made it (`served_by`)."""
PROGRESS_EVERY_S = 10.0
"""When stderr is not a terminal: a run's steps print a line at most this often (its first and last step always)."""


def worker_names(workers: int) -> list[str]:
    """The names `generation_side` gives a run's workers."""
    return [f"rl-worker-{i}" for i in range(workers)]


def load_trainer() -> ModuleType:
    """The reference trainer, `examples/grpo_trainer.py`, as a module: the benchmark runs what users copy.

    Raises `FileNotFoundError` when this is not a clone of the repository (the examples are not installed)."""
    if "grpo_trainer" in sys.modules:
        return sys.modules["grpo_trainer"]
    if not TRAINER_FILE.exists():
        raise FileNotFoundError(f"bench-rl runs the reference trainer {TRAINER_FILE}: run it from a clone of the repo")
    spec = importlib.util.spec_from_file_location("grpo_trainer", TRAINER_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_trainer"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Mode:
    name: str
    """`sync`, `one-step-off` or `async:η`, with `@PAUSE` for a pause mode of its own (`async:1@inflight`)."""
    trainer_mode: str
    max_staleness: int
    pause_mode: str | None = None
    """How workers pause for this mode's syncs; None: the settings' `--pause-mode`."""

    @classmethod
    def parse(cls, text: str) -> Mode:
        """`sync`, `one-step-off`, `async:2`, `async:1@inflight`; raises `ValueError` saying what to write."""
        head, at, pause = text.partition("@")
        if at and pause not in PAUSE_MODES:
            raise ValueError(f"mode {text!r}: the pause mode after @ is one of {', '.join(PAUSE_MODES)}")
        pause_mode = pause if at else None
        if head in ("sync", "one-step-off"):
            return cls(text, head, 0 if head == "sync" else 1, pause_mode)
        name, _, eta = head.partition(":")
        if name == "async" and eta.isdigit():
            return cls(text, "async", int(eta), pause_mode)
        raise ValueError(f"mode {text!r}: use sync, one-step-off or async:η (async:2), optionally @abort|keep|inflight")

    def config(self, base: Any, seed: int) -> Any:
        """The trainer's config of this mode's run: `base`, whose async-only options (`sync_every`, parking) apply
        to the async modes alone. Raises `ValueError` with what to fix."""
        is_async = self.trainer_mode == "async"
        config = replace(
            base, mode=self.trainer_mode, max_staleness=self.max_staleness, seed=seed,
            sync_every=base.sync_every if is_async else 1, park_max_age=base.park_max_age if is_async else -1,
            pause_mode=self.pause_mode or base.pause_mode,
        )  # fmt: skip
        if problems := config.problems():
            raise ValueError("; ".join(problems))
        return config


@dataclass(frozen=True)
class Settings:
    modes: tuple[Mode, ...]
    seeds: tuple[int, ...]
    steps: int
    target: float
    eval_every: int = 1
    eval_prompts: int = 32
    engine: str = "torch"
    worker_args: tuple[str, ...] = ()
    worker_device: str = "cpu"
    """The worker's device: a torch worker's `--device`, a vLLM worker's only visible GPU."""
    logs: Path | None = None
    """Keep the processes' logs here (the worker's: `rl-worker-0.log`, every run appended) and each run's result as
    it ends (`runs.jsonl`); None: a temporary folder."""
    hidden_size: int = 64
    num_layers: int = 2
    workers: tuple[int, ...] = (1,)
    """Worker counts W: every mode and seed runs once per W, against W `rollouts worker`s (the calibration on one)."""
    model: Path | None = None
    """A real model's folder (`--model smollm2`): the trainer's text tasks (`TrainConfig.task`), held-out accuracy
    sampled through the fleet (`benchmarks.bench_rl_real`); None: a random tiny model on the token-set task."""
    target_gain: float | None = None
    """Real model: the target is the base policy's held-out accuracy + this (capped), measured before any run;
    None: `target` as given."""
    eval_samples: int = 4
    """Real model: samples a held-out problem (temperature 1)."""
    direct_steps: int = 1
    """Real model: the first seed's first this many steps' prompts generated by the workers' engine called directly,
    before any fleet starts (0: not measured)."""

    @property
    def real(self) -> bool:
        return self.model is not None


# -- the generator's counters -------------------------------------------------------------------


def heartbeat(client: RolloutClient, ns: str, workers: int = 1, newer_than: float = 0.0) -> dict[str, float]:
    """The counters of the run's `workers` workers summed, each from a heartbeat written after `newer_than` (unix
    time): beats are periodic. `ts` is the sum of the beats' times, so that a difference of two is worker-seconds."""
    total = dict.fromkeys((c.decode() for c in COUNTERS), 0.0)
    for name in worker_names(workers):
        deadline = time.monotonic() + 30
        while True:
            fields = client.streams.redis.hgetall(Keys(ns).worker(name))
            beat = {k.decode(): float(v) for k, v in fields.items() if k in COUNTERS}
            if beat.get("ts", 0.0) > newer_than:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no heartbeat of {name} since {newer_than}")
            time.sleep(0.02)
        for key, value in beat.items():
            total[key] += value
    return total


def wait_idle(client: RolloutClient, ns: str, workers: int = 1, timeout_s: float = 300) -> None:
    """Until nothing is waiting on prompts or partials and no worker has anything in flight."""
    keys, r = Keys(ns), client.streams.redis
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        waiting = 0
        for stream in (keys.prompts, keys.partials):
            delivered = next((g["last-delivered-id"].decode() for g in r.xinfo_groups(stream)), "0-0")
            undelivered = as_entries(r.xrange(stream, f"({delivered}", "+", count=1))
            waiting += r.xpending(stream, GENERATORS)["pending"] + len(undelivered)
        if waiting == 0 and heartbeat(client, ns, workers, newer_than=time.time()).get("inflight", 1) == 0:
            return
        time.sleep(0.2)
    raise TimeoutError("the workers did not finish their work")


def leftover_tokens(url: str, ns: str) -> tuple[int, int]:
    """Tokens of rollouts the trainer never trained on (left over at the stop: groups filling a batch or not yet
    whole, pending under its consumer, and what it never read), and of those parked on `{ns}:stale`."""
    client = RolloutClient(url, ns)
    left = 0
    for consumer, pending in ((TRAINER, True), ("bench-drain", False)):
        while entries := client.streams.trainer.read_rollouts(consumer, 1000, None, pending=pending):
            left += sum(int(e.fields[b"n_tokens"]) for e in entries)
            client.streams.trainer.ack_rollouts([e.id for e in entries])
    return left, load_trainer().stale_tokens(client)


def calibrate(client: RolloutClient, config: Any, submit: Callable[[int], None] | None = None) -> float:
    """One worker's tokens per busy second at full batching, on the fleet of one that serves `client`'s namespace:
    equal-length samples, many more than a batch. One batch first, unmeasured: an engine's first requests pay for
    its warm-up (vLLM's CUDA graphs, compiled kernels). A fleet's ideal is this ÷ W."""
    ns = client.streams.keys.ns
    warm_up(client, config, submit=submit)
    before = heartbeat(client, ns, newer_than=time.time())
    warm_up(client, config, (2 if submit else 4) * config.groups_per_step, submit=submit, first=config.groups_per_step)
    after = heartbeat(client, ns, newer_than=time.time())
    return (after["generated_tokens"] - before["generated_tokens"]) / (after["busy_s"] - before["busy_s"])


def warm_up(
    client: RolloutClient,
    config: Any,
    prompts: int | None = None,
    workers: int = 1,
    submit: Callable[[int], None] | None = None,
    first: int = 0,
) -> None:
    """`prompts` (default: a step's groups) of equal length, generated and collected off the clock, until the fleet
    is idle: a fleet's first requests pay for its engines' warm-up, which no run should. `submit(i)` submits prompt i
    instead (a real model's task prompts, `first` onwards; they end where the policy ends them)."""
    count = config.groups_per_step if prompts is None else prompts
    for i in range(count):
        if submit is not None:
            submit(first + i)
            continue
        client.submit(tokens=[300 + i % 100, 16], n=config.n, max_tokens=4 * config.max_tokens, seed=i)
    client.collect(count, timeout=600)
    wait_idle(client, client.streams.keys.ns, workers)


def generation_side(
    trainer: ModuleType, url: str, ns: str, model: Path, logs: Path, settings: Settings, workers: int
) -> Any:
    """The trainer's `generation_side`: `rollouts manager` and `workers` x `rollouts worker` of the settings' engine
    (`rl-worker-0`, `rl-worker-1`, ...; every vLLM worker sees the one GPU of `--worker-device`)."""
    worker_args = list(settings.worker_args)
    worker_args += ["--device", settings.worker_device] if settings.engine == "torch" else []
    env = trainer.gpu_of(settings.worker_device) if settings.engine == "vllm" else None
    return trainer.generation_side(url, ns, model, settings.engine, workers, logs, worker_args, worker_env=env)


def reset_namespace(client: RolloutClient, base_policy: Callable[[], torch.nn.Module], config: Any) -> None:
    """Make the kept fleet's namespace, idle after a run, as a fresh one is to the next run: the workers serve the
    base policy again (published as the next version, since versions never go back, when they serve another), the
    admission counters say that every version so far consumed exactly a batch (so that at version `v + k` the run
    may use what a fresh one may at `k`), and nothing is parked. The trainer and admission only ever look at
    versions relative to the one they start at."""
    state, r = client.streams.keys.state, client.streams.redis
    if client.admission_usage().version > 0:
        client.publish_weights(base_policy(), transport=config.transport, mode=config.pause_mode)
    version, stale = (int(x or 0) for x in r.hmget(state, ["version", "stale"]))
    per_version = config.batch_size * (config.sync_every if config.mode == "async" else 1)
    r.hset(state, "submitted", stale + version * per_version)
    r.delete(client.streams.keys.stale)


def hold_rollouts(client: RolloutClient) -> bytes:
    """Create `SERVED_GROUP` on the run's rollouts before it starts, so that none is trimmed before `served_by`;
    returns the stream's last id before the run (the run's rollouts come after it)."""
    stream, r = client.streams.keys.rollouts, client.streams.redis
    last = r.xinfo_stream(stream)["last-generated-id"] if r.exists(stream) else b"0-0"
    r.xgroup_create(stream, SERVED_GROUP, id=last, mkstream=True)
    return bytes(last) if isinstance(last, (bytes, bytearray)) else str(last).encode()


def served_by(client: RolloutClient, after: bytes = b"0-0") -> dict[str, str]:
    """Rollout id -> the worker that made it, over every rollout of the run (`hold_rollouts` kept them all: the ones
    after `after`)."""
    r, stream, start = client.streams.redis, client.streams.keys.rollouts, f"({after.decode()}"
    out: dict[str, str] = {}
    while page := as_entries(r.xrange(stream, start, "+", count=1000)):
        for _, fields in page:
            out.setdefault(fields[b"id"].decode(), fields.get(b"worker", b"").decode())
        start = f"({page[-1][0].decode()}"
    r.xgroup_destroy(stream, SERVED_GROUP)
    return out


def worker_shares(step_ids: list[list[str]], made_by: dict[str, str], workers: int) -> dict[str, Any]:
    """Who served the samples each step trained on: per worker, its samples over the run and its largest share of
    a step's samples; over the steps, the median and the largest of a step's top share (1: one worker made the whole
    step; 1/W: perfectly spread)."""
    names = worker_names(workers)
    served = dict.fromkeys(names, 0)
    share_max = dict.fromkeys(names, 0.0)
    top_shares = []
    for ids in step_ids:
        counts = dict.fromkeys(names, 0)
        for rollout_id in ids:
            worker = made_by.get(rollout_id, "")
            counts[worker] = counts.get(worker, 0) + 1  # "" or a stranger's name: not one of the run's workers
        for name, count in counts.items():
            served[name] = served.get(name, 0) + count
            share_max[name] = max(share_max.get(name, 0.0), count / max(len(ids), 1))
        top_shares.append(max(counts.values()) / max(len(ids), 1))
    return {
        "served": served,
        "share_max": {name: round(share, 4) for name, share in share_max.items()},
        "step_top_share_median": round(statistics.median(top_shares), 4) if top_shares else None,
        "step_top_share_max": round(max(top_shares), 4) if top_shares else None,
    }


# -- evaluation, off the clock ------------------------------------------------------------------


@dataclass(frozen=True)
class HeldOut:
    """Prompts the trainer never sees, each with the length and set the training law gives it; where the policy
    decides its own length (`stop_set`), the length is the demand, `cap` the most a sample may go on and `stops`
    the ids that end it."""

    prompts: list[list[int]]
    lengths: list[int]
    sets: list[list[int]]
    cap: int | None = None
    stops: tuple[int, ...] = ()

    @classmethod
    def make(cls, trainer: ModuleType, config: Any, count: int) -> HeldOut:
        rng, task = random.Random(f"held-out-{config.seed}"), TokenSetTask()
        prompts, lengths, sets = [], [], []
        for _ in range(count):
            max_tokens, named_set = trainer.prompt_length(config, rng)
            tokens, meta = task.prompt(rng, named_set)
            prompts.append(tokens)
            lengths.append(max_tokens)
            sets.append(meta["ids"])
        if not config.stop_set:
            return cls(prompts, lengths, sets)
        return cls(prompts, lengths, sets, cap=16 * config.max_tokens, stops=tuple(task.stop_ids(config.stop_set)))


@torch.no_grad()
def expected_reward(policy: torch.nn.Module, held_out: HeldOut, temperature: float, seed: int) -> float:
    """The token-set reward's expectation under `policy` on `held_out`, along a continuation it samples (at
    `temperature`): the probabilities of a set token summed over the positions the sample reaches, over the larger
    of its length and the prompt's. Fixed lengths: every sample goes on to its prompt's length. Where the policy
    decides its own (`held_out.stops`): until it samples a stop id or the model's EOS, or reaches the cap."""
    device = next(policy.parameters()).device
    rows, width = len(held_out.prompts), max(len(p) for p in held_out.prompts)
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    mask = torch.zeros(rows, width, dtype=torch.long, device=device)
    for i, prompt in enumerate(held_out.prompts):  # left-padded: every row's next token is at the end
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    demand = torch.tensor(held_out.lengths, device=device)
    cap = held_out.cap if held_out.stops else int(demand.max())
    assert cap is not None, "held-out prompts with stops have a cap (HeldOut.make sets both)"
    caps = torch.full_like(demand, cap) if held_out.stops else demand
    eos = cast("PreTrainedModel", policy).config.eos_token_id if held_out.stops else None  # a transformers model
    stops = torch.tensor([*held_out.stops, eos] if held_out.stops else [], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = policy(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    in_set = torch.zeros(rows, out.logits.shape[-1], device=device)
    for i, ids_of_set in enumerate(held_out.sets):
        in_set[i, ids_of_set] = 1.0
    hits, reached = torch.zeros(rows, device=device), torch.zeros(rows, device=device)
    alive = torch.ones(rows, dtype=torch.bool, device=device)
    for step in range(cap):
        alive &= step < caps
        if not alive.any():
            break
        probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
        hits += (probs * in_set).sum(-1) * alive
        token = torch.multinomial(probs, 1, generator=generator)
        alive &= ~torch.isin(token[:, 0], stops)
        reached += alive
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        positions = positions[:, -1:] + 1
        out = policy(
            input_ids=token, attention_mask=mask, position_ids=positions, use_cache=True,
            **{cache_name(policy): getattr(out, cache_name(policy))},
        )  # fmt: skip
    return float((hits / torch.maximum(reached, demand)).mean())


# -- one run ------------------------------------------------------------------------------------


def run_one(
    trainer: ModuleType,
    url: str,
    ns: str,
    config: Any,
    mode: Mode,
    model: Path,
    settings: Settings,
    workers: int = 1,
    progress: BenchProgress | None = None,
    real: RealEval | None = None,
) -> dict[str, Any]:
    """One mode and seed on the kept fleet of `workers` workers serving `ns`, idle: the namespace reset
    (`reset_namespace`), the trainer's run, then its snapshots evaluated (a real model's: `real`, through the fleet,
    the base policy's accuracy first, at step 0)."""
    snapshots: list[tuple[int, float, dict[str, torch.Tensor]]] = []
    steps: list[Any] = []

    def keep(step: int, policy: torch.nn.Module, elapsed: float) -> None:  # off the run's clock
        if progress is not None:
            progress.step(mode.name, workers, config.seed, steps[-1], config.steps)
        if (step + 1) % settings.eval_every == 0 or step + 1 == config.steps:
            snapshots.append(
                (step, elapsed, {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()})
            )

    watcher = RolloutClient(url, ns, tokenizer=model if real is not None else None)
    reset_namespace(watcher, lambda: load_policy(model, config.device), config)
    start_id = hold_rollouts(watcher)
    start_version = watcher.admission_usage().version
    before = heartbeat(watcher, ns, workers, newer_than=time.time())
    started = time.monotonic()
    for log in trainer.train(config, url, ns, model, on_step=keep):
        steps.append(log)  # before `keep`, which the trainer calls once this returns
    wall = time.monotonic() - started
    during = heartbeat(watcher, ns, workers, newer_than=time.time())  # at most one beat (0.2 s) late
    wait_idle(watcher, ns, workers)
    after = heartbeat(watcher, ns, workers, newer_than=time.time())
    left, parked = leftover_tokens(url, ns)
    made_by = served_by(watcher, start_id)
    policy = load_policy(model, config.device)
    curve = []
    by_task: list[list[Any]] = []
    if real is not None:  # through the fleet, idle now: each snapshot published, then the held-out split sampled
        curve.append((0, 0.0, real.base["accuracy"]))
        by_task.append([0, real.base["by_task"]])
        for step, elapsed, state in snapshots:
            policy.load_state_dict(state)
            watcher.publish_weights(policy, transport=config.transport, mode=config.pause_mode)
            accuracy = real.held_out.evaluate(watcher, f"{mode.name}-w{workers}-s{config.seed}-{step + 1}")
            curve.append((step + 1, elapsed, accuracy["accuracy"]))
            by_task.append([step + 1, accuracy["by_task"]])
    else:
        held_out = HeldOut.make(trainer, config, settings.eval_prompts)
        for step, elapsed, state in snapshots:
            policy.load_state_dict(state)
            curve.append((step + 1, elapsed, expected_reward(policy, held_out, config.temperature, seed=config.seed)))
    generated = int(after["generated_tokens"] - before["generated_tokens"])
    trained = sum(s.tokens for s in steps)
    reached = next(((n, t) for n, t, reward in curve if reward >= settings.target), None)
    synced = [s.sync_stall_s for s in steps if s.publish_s > 0]
    extra: dict[str, Any] = {}
    if real is not None:
        extra = bench_rl_real.run_figures(steps, generated, wall) | {"curve_by_task": by_task}
        extra["final_by_task"] = by_task[-1][1]
    return {
        "mode": mode.name,
        "workers": workers,
        "seed": config.seed,
        "start_version": start_version,
        "steps": len(steps),
        "wall_s": round(wall, 3),
        "time_to_target_s": round(reached[1], 3) if reached else None,
        "steps_to_target": reached[0] if reached else None,
        "final_eval_reward": round(curve[-1][2], 4),
        "steps_per_s": round(len(steps) / steps[-1].elapsed_s, 4),
        "trained_tokens_per_s": round(trained / steps[-1].elapsed_s, 1),
        "trainer_idle": round(sum(s.wait_s for s in steps) / wall, 4),
        "generator_idle": round(1 - (during["busy_s"] - before["busy_s"]) / (during["ts"] - before["ts"]), 4),
        "tokens": {
            "generated": generated,
            "trained": trained,
            "left_over": left,
            "parked": parked,
            "trained_share": round(trained / max(generated - left, 1), 4),
        },
        "tokens_per_step": round(trained / len(steps), 1),
        "step_s_median": round(statistics.median(np.diff([0.0, *[s.elapsed_s for s in steps]])), 4),
        "trainer_step_s_median": round(statistics.median(s.train_s + s.publish_s for s in steps), 4),
        "wait_s_median": round(statistics.median(s.wait_s for s in steps), 4),
        "worker_shares": worker_shares([s.ids for s in steps], made_by, workers),
        "staleness_token_mean": round(float(np.mean([s.staleness_token for s in steps])), 3),
        "staleness_first_max": max(s.staleness_max for s in steps),
        "clip_fraction_mean": round(float(np.mean([s.clip_fraction for s in steps])), 4),
        "is_capped_fraction_mean": round(float(np.mean([s.is_capped_fraction for s in steps])), 4),
        "sync_stall_s_median": round(statistics.median(synced), 4) if synced else 0.0,
        "curve": [[n, round(t, 3), round(r, 4)] for n, t, r in curve],
    } | extra


def load_policy(model: Path, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps on .to: mypy reads it unbound


# -- the whole comparison -----------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float] | None:
    """Median, min and max; None when a value is missing (a seed that never reached the target)."""
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def median_or_none(values: list[float | None]) -> float | None:
    """The median, a missing value (a seed that never reached the target) counting as later than any; None when the
    median itself is missing (half the seeds or more never reached it)."""
    if not values:
        return None
    middle = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(middle) else round(middle, 3)


def summarize(
    runs: list[dict[str, Any]], settings: Settings, full_batch_tokens_per_s: float, workers: int = 1
) -> dict[str, Any]:
    """Per mode over the seeds, for the runs on `workers` workers; `speedup` is sync's median time to target over the
    mode's. Beside each mode's measured step, the ideal of a perfectly spread fleet: one worker's generator time for
    the mode's tokens a step at full batching, ÷ `workers`."""
    runs = [r for r in runs if r.get("workers", 1) == workers]
    by_mode: dict[str, dict[str, Any]] = {}
    for mode in settings.modes:
        rows = [r for r in runs if r["mode"] == mode.name]
        reached = [r["time_to_target_s"] for r in rows if r["time_to_target_s"] is not None]
        step_s = statistics.median(r["step_s_median"] for r in rows)
        ideal_s = statistics.median(r["tokens_per_step"] for r in rows) / full_batch_tokens_per_s / workers
        shares = [r["worker_shares"] for r in rows]
        by_mode[mode.name] = {
            "seeds": len(rows),
            "reached": len(reached),
            "time_to_target_s": median_or_none([r["time_to_target_s"] for r in rows]),
            "time_to_target_s_range": spread(reached),
            "steps_to_target": median_or_none([r["steps_to_target"] for r in rows]),
            "final_eval_reward": spread([r["final_eval_reward"] for r in rows]),
            "steps_per_s": spread([r["steps_per_s"] for r in rows]),
            "trained_tokens_per_s": spread([r["trained_tokens_per_s"] for r in rows]),
            "trained_share": spread([r["tokens"]["trained_share"] for r in rows]),
            "staleness_token_mean": spread([r["staleness_token_mean"] for r in rows]),
            "clip_fraction_mean": spread([r["clip_fraction_mean"] for r in rows]),
            "sync_stall_s_median": spread([r["sync_stall_s_median"] for r in rows]),
            "step_s": round(step_s, 4),
            "ideal_step_s": round(ideal_s, 4),
            "measured_over_ideal": round(step_s / ideal_s, 3) if ideal_s > 0 else None,
            "trainer_step_s": round(statistics.median(r["trainer_step_s_median"] for r in rows), 4),
            "wait_s": round(statistics.median(r["wait_s_median"] for r in rows), 4),
            "served": {w: sum(s["served"].get(w, 0) for s in shares) for w in worker_names(workers)},
            "share_max": {w: max(s["share_max"].get(w, 0.0) for s in shares) for w in worker_names(workers)},
            "step_top_share_median": spread([s["step_top_share_median"] for s in shares]),
        }
        if settings.real:
            by_mode[mode.name] |= bench_rl_real.mode_figures(rows)
    base = by_mode["sync"]["time_to_target_s"] if "sync" in by_mode else None
    for row in by_mode.values():
        ttt = row["time_to_target_s"]
        row["speedup"] = round(base / ttt, 3) if base and ttt else None
    sync_runs = [r for r in runs if r["mode"] == "sync"]
    bound = None
    if sync_runs:
        generator_s = statistics.median(r["tokens_per_step"] for r in sync_runs) / full_batch_tokens_per_s
        trainer_s = statistics.median(r["trainer_step_s_median"] for r in runs)
        sync_step = statistics.median(r["step_s_median"] for r in sync_runs)
        bound = {
            "full_batch_tokens_per_s": round(full_batch_tokens_per_s, 1),
            "generator_step_s": round(generator_s, 4),
            "trainer_step_s": round(trainer_s, 4),
            "sync_step_s": round(sync_step, 4),
            "ideal_overlap_bound": round(sync_step / max(trainer_s, generator_s / workers), 3),
        }
        if workers != 1:
            bound["fleet_generator_step_s"] = round(generator_s / workers, 4)
    return {"modes": by_mode, "bound": bound}


STEPS_WITHIN = 0.10
"""The fleet check: a mode reaches the target in at most this much more steps than sync (median over seeds)."""


def compare_fleet(by_workers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """At each W, each mode against sync at that W: the ratio of median times to target (sync's over the mode's), the
    ratio of median steps to target (the mode's over sync's) and whether it is within `STEPS_WITHIN` more steps; and
    each mode's median time to target and measured ÷ ideal step, side by side over W."""
    against_sync: dict[str, dict[str, Any]] = {}
    for w, summary in by_workers.items():
        modes = summary["modes"]
        sync = modes.get("sync")
        if sync is None:
            continue
        rows = {}
        for name, row in modes.items():
            if name == "sync":
                continue
            steps, sync_steps = row["steps_to_target"], sync["steps_to_target"]
            ratio = round(steps / sync_steps, 3) if steps is not None and sync_steps else None
            rows[name] = {
                "time_to_target_speedup": row["speedup"],
                "steps_to_target": steps,
                "sync_steps_to_target": sync_steps,
                "steps_ratio": ratio,
                "steps_within_10pct": None if ratio is None else ratio <= 1 + STEPS_WITHIN,
            }
        against_sync[w] = rows
    names = next(iter(by_workers.values()))["modes"].keys() if by_workers else []
    side_by_side = {
        name: {
            w: {
                "time_to_target_s": s["modes"][name]["time_to_target_s"],
                "step_s": s["modes"][name]["step_s"],
                "ideal_step_s": s["modes"][name]["ideal_step_s"],
                "measured_over_ideal": s["modes"][name]["measured_over_ideal"],
                "step_top_share_max": max(s["modes"][name]["share_max"].values(), default=None),
            }
            for w, s in by_workers.items()
        }
        for name in names
    }
    return {"against_sync": against_sync, "side_by_side": side_by_side}


class BenchProgress:
    """Where the benchmark is, on stderr: rich's bar on a terminal; elsewhere (a pipe, a log file, a device call)
    plain lines, which a bar would not print: each run's start and end, and its steps at most every `every_s`
    (the first and the last always)."""

    def __init__(self, console: Console, total: int, every_s: float = PROGRESS_EVERY_S) -> None:
        self.console, self.total, self.every_s = console, total, every_s
        self.live = console.is_terminal
        self.bar: Progress | None = None
        self.task: Any = None
        self.started = time.monotonic()
        self.last_line = -math.inf
        self.done = 0

    def __enter__(self) -> BenchProgress:
        if self.live:
            self.bar = Progress(console=self.console, transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("calibrating the worker", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)

    def line(self, text: str) -> None:
        if not self.live:
            print(f"bench-rl [{time.monotonic() - self.started:7.1f} s] {text}", file=sys.stderr, flush=True)
            self.last_line = time.monotonic()

    def note(self, text: str) -> None:
        """A stage: the bar's description, or a line."""
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        self.line(text)

    def step(self, mode: str, workers: int, seed: int, log: Any, steps: int) -> None:
        """After a trainer step (its `StepLog`), off the run's clock."""
        where = f"W {workers}, {mode}, seed {seed}: step {log.step + 1}/{steps}"
        text = f"{where}, reward {log.reward:.3f}, {log.elapsed_s:.1f} s"
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        elif log.step == 0 or log.step + 1 >= steps or time.monotonic() - self.last_line >= self.every_s:
            self.line(text)

    def advance(self, text: str | None = None) -> None:
        """One unit of the whole done (the calibration, a run), with what it came to."""
        self.done += 1
        if self.bar is not None:
            self.bar.advance(self.task)
        if text is not None:
            self.line(f"{text} ({self.done}/{self.total} done)")


def run_line(run: dict[str, Any]) -> str:
    """A run's end, in one line of progress."""
    ttt, where = run["time_to_target_s"], f"W {run['workers']}, {run['mode']}, seed {run['seed']}"
    reached = f"target at {ttt} s (step {run['steps_to_target']})" if ttt is not None else "target not reached"
    top = run["worker_shares"]["step_top_share_max"]
    return f"{where}: {reached}, final reward {run['final_eval_reward']}, wall {run['wall_s']} s, top share {top}"


def run_bench_rl(console: Console, settings: Settings, base: Any) -> dict[str, Any]:
    """Every mode for every seed at every worker count, on one Redis and one model; the report (JSON-ready).

    `summary` is the one worker count's (`--workers 4`: that fleet's), as it always was; with several, it is absent
    and `fleet.by_workers` has each. `fleet` is there either way."""
    trainer = load_trainer()
    for mode in settings.modes:
        mode.config(base, settings.seeds[0])  # what a user must fix, before anything starts
    runs = []
    total = 1 + len(settings.modes) * len(settings.seeds) * len(settings.workers)
    fleets = sorted(settings.workers, key=lambda w: w != 1)  # W = 1 first: its fleet calibrates
    real: RealEval | None = None
    direct = None
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp, RedisServer() as server:
        model, logs = settings.model or Path(tmp) / "model", settings.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        if settings.model is None:
            build_tiny_model(model, seed=0, hidden_size=settings.hidden_size, num_layers=settings.num_layers)
        with BenchProgress(console, total) as progress:
            if settings.real and settings.direct_steps:  # before any fleet: the device is the direct call's alone
                progress.note(f"the workers' engine called directly on {settings.direct_steps} step(s)' prompts")
                first = replace(base, seed=settings.seeds[0])
                direct = bench_rl_real.direct_generation(settings, first, model, settings.direct_steps)
                progress.line(f"direct: {direct['tokens_per_s']} tokens/s ({direct['tokens']} tokens)")

            def calibration_of(client: RolloutClient) -> float:
                submit = bench_rl_real.warm_up_submitter(client, base) if settings.real else None
                return calibrate(client, base, submit)

            rate = 0.0
            if 1 not in fleets:
                progress.note("calibrating one worker at full batching")
                with generation_side(trainer, server.url, "bench-rl-calibration", model, logs, settings, 1):
                    tokenizer = model if settings.real else None
                    rate = calibration_of(RolloutClient(server.url, "bench-rl-calibration", tokenizer=tokenizer))
            for workers in fleets:
                ns = f"bench-rl-w{workers}"
                progress.note(f"W {workers}: starting the fleet")
                with generation_side(trainer, server.url, ns, model, logs, settings, workers):
                    client = RolloutClient(server.url, ns, tokenizer=model if settings.real else None)
                    if workers == 1:
                        progress.note("calibrating one worker at full batching")
                        rate = calibration_of(client)
                    else:
                        submit = bench_rl_real.warm_up_submitter(client, base) if settings.real else None
                        warm_up(client, base, workers=workers, submit=submit)
                    if workers == fleets[0]:
                        progress.advance(f"calibrated: {rate:.0f} tokens/s on one worker")
                    if settings.real and real is None:  # the base policy's accuracy, before any run: the target
                        progress.note("the base policy's held-out accuracy")
                        held_out = TextHeldOut.make(
                            base.task.split(","), settings.eval_prompts, settings.eval_samples, base.max_tokens
                        )
                        real = RealEval(held_out, held_out.evaluate(client, "base"))
                        if settings.target_gain is not None:
                            target = bench_rl_real.choose_target(real.base["accuracy"], settings.target_gain)
                            settings = replace(settings, target=target)
                        progress.line(f"base accuracy {real.base['accuracy']} {real.base['by_task']}; "
                                      f"target {settings.target}")  # fmt: skip
                    for seed in settings.seeds:
                        for mode in settings.modes:
                            progress.note(f"W {workers}, {mode.name}, seed {seed}: starting")
                            config = mode.config(base, seed)
                            run = run_one(
                                trainer, server.url, ns, config, mode, model, settings, workers, progress, real
                            )
                            runs.append(run)
                            with (logs / "runs.jsonl").open("a") as kept:  # what a run cut short still leaves
                                kept.write(json.dumps(run) + "\n")
                            progress.advance(run_line(run))
    by_workers = {str(w): summarize(runs, settings, rate, w) for w in settings.workers}
    fleet = {"workers": list(settings.workers), "by_workers": by_workers, **compare_fleet(by_workers)}
    trainer_settings = {k: v for k, v in asdict(base).items() if k != "seed"}
    report: dict[str, Any] = {
        "settings": asdict(settings)
        | {"logs": str(settings.logs), "model": str(settings.model) if settings.real else None}
        | {"trainer": trainer_settings},
        "env": environment(),
    }
    if real is not None:
        report["real"] = {
            "model": str(settings.model), "tasks": base.task.split(","), "curriculum": base.curriculum,
            "held_out": real.held_out.describe(), "base": real.base, "target": settings.target,
            "target_gain": settings.target_gain, "target_cap": bench_rl_real.TARGET_CAP,
            "target_rule": "fixed" if settings.target_gain is None else
            f"base {real.base['accuracy']} + {settings.target_gain}, capped at {bench_rl_real.TARGET_CAP}",
            "direct": direct, "against_direct": bench_rl_real.against_direct(runs, direct, settings.seeds[0]),
        }  # fmt: skip
    if len(settings.workers) == 1:
        report["summary"] = by_workers[str(settings.workers[0])]
    return report | {"fleet": fleet, "runs": runs}


def environment() -> dict[str, Any]:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"torch": torch.__version__, "python": sys.version.split()[0], "gpus": gpus, "date": time.strftime("%F")}


def plot_bench_rl(report: dict[str, Any], path: Path) -> None:
    """Eval reward against wall time: one colour a mode, one line a seed (one line style a worker count), the target
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [m["name"] for m in report["settings"]["modes"]]
    fleet = report["settings"].get("workers", [1])
    styles = ["-", "-.", ":", (0, (5, 1, 1, 1, 1, 1))]  # not "--": the target's
    for run in report["runs"]:
        colour = colours[names.index(run["mode"]) % len(colours)]
        w = run.get("workers", 1)
        style = styles[fleet.index(w) % len(styles)] if w in fleet else "-"
        steps, times, rewards = zip(*run["curve"], strict=True)
        label = None
        if run["seed"] == report["settings"]["seeds"][0]:
            label = run["mode"] if len(fleet) == 1 else f"{run['mode']}, W {w}"
        marker = "." if "real" in report else None  # a real model's few evaluations: each one shown
        left.plot(times, rewards, color=colour, linestyle=style, marker=marker, alpha=0.8, label=label)
        right.plot(steps, rewards, color=colour, linestyle=style, marker=marker, alpha=0.8, label=label)
    real = report.get("real")
    ylabel = "held-out accuracy of the current policy" if real else "eval reward of the current policy"
    for axis, xlabel in ((left, "seconds (evaluation off the clock)"), (right, "step")):
        axis.axhline(report["settings"]["target"], color="k", linestyle="--", linewidth=0.8)
        axis.set(xlabel=xlabel, ylabel=ylabel, ylim=(0, 1.02))
        axis.legend()
    where = ""
    if real:
        name = Path(real["model"]).name
        where = f"{name}, {','.join(real['tasks'])}, target {real['target']} ({real['target_rule']}): "
    left.set_title(f"{where}against wall time", fontsize=9 if real else None)
    right.set_title("against steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextlib.contextmanager
def trainer_errors() -> Any:
    """The trainer's `GenerationSideDied` (a `BaseException`) as a one-line exit."""
    trainer = load_trainer()
    try:
        yield
    except trainer.GenerationSideDied as exc:
        sys.exit(f"bench-rl: a process of the run stopped: {exc}")

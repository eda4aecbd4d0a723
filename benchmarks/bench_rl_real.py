"""`rollouts bench-rl --model smollm2 --task arithmetic:sum-1d`: bench-rl on a real model and a text task.

What changes from the tiny model's bench (`benchmarks.bench_rl`): the policy is a real model's folder
(SmolLM2-135M-Instruct: `--model smollm2`), prompts are a text task's train problems through its chat template
(`examples/grpo_trainer.py`'s `TextPrompts`; several tasks mixed or staged by `--curriculum`), rewards are exact
match on the decoded reply, and the policy ends its own replies (`--max-tokens` caps them: real long tails, no
length law). The eval reward is the **held-out accuracy**: the task's eval split (problems the trainer never sees),
sampled at temperature 1 a few times a problem (`--eval-samples`) through the run's own fleet after the run, the
snapshots published one after the other (off the clock, as bench-rl evaluates the tiny model's), the same problems
and sampling seeds for every snapshot, run and mode. With several tasks the accuracy is the mean of the tasks'.

The target is chosen before any run from the base policy's held-out accuracy, measured the same way on the first
fleet: `--target-gain 0.25` makes it base + 0.25, capped at `TARGET_CAP`; the report states both.

Beside bench-rl's figures each run has the share of its groups whose rewards were all equal (no signal), its
generation tokens/s, and its accuracy per task; the report has the generation tokens/s of the workers' engine called
directly on the first steps' prompts of the first seed (a process of its own, before any fleet starts: `direct`),
against sync's generation of the same prompts through the pipeline.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producers.client import RolloutClient
from producers.tasks import Problem, get_task, text_reward
from producers.tasks.base import stable_hash

TARGET_CAP = 0.95
"""The most a target chosen from the base accuracy may be (`--target-gain`): a sampled accuracy seldom reaches 1."""
TASK_DEFAULT = "arithmetic:sum-1d"
LR_DEFAULT = 2e-5
"""AdamW's learning rate for the real model (the tiny model's 1e-3 wrecks it in a step): the real demo's."""
TARGET_GAIN_DEFAULT = 0.25


@dataclass(frozen=True)
class RealChoice:
    """The flags of a real-model bench, checked: what the trainer and the settings take."""

    model: Path
    task: str
    target: float | None
    """A fixed target (`--target`), or None: base + `target_gain`."""
    target_gain: float | None
    lr: float
    length_alpha: float = 0.0
    length_sets: bool = False


def real_choice(
    model: Path | None,
    task: str | None,
    target: float | None,
    target_gain: float | None,
    lr: float | None,
    length_alpha: float | None,
    stop_set: int,
    eval_samples: int,
) -> RealChoice | None:
    """None for the tiny model's bench (no `--model`); else the real model's choices, `--model smollm2` built into the
    cache on first use. Raises `ValueError`, one line that says what to fix, for flags that do not go together."""
    if model is None:
        if task is not None or target_gain is not None:
            raise ValueError("--task and --target-gain are for a real model: add --model smollm2 (or a model folder)")
        return None
    from rollouts.app import resolve_model

    folder = resolve_model(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {model}: not a model folder (no config.json there); a real one: --model smollm2")
    names = (task or TASK_DEFAULT).split(",")
    for name in names:
        get_task(name)  # its ValueError names the known tasks
    if len(set(names)) < len(names):
        raise ValueError(f"--task {task}: a task twice")
    if length_alpha or stop_set:
        raise ValueError("--length-alpha and --stop-set are the token-set task's: a real model ends its own replies "
                         "(--max-tokens caps them)")  # fmt: skip
    if target is not None and target_gain is not None:
        raise ValueError("give --target (fixed) or --target-gain (base accuracy + gain), not both")
    gain = None if target is not None else (TARGET_GAIN_DEFAULT if target_gain is None else target_gain)
    if gain is not None and not 0 < gain < 1:
        raise ValueError(f"--target-gain {gain}: between 0 and 1 (0.25: the base accuracy + 25 points)")
    if eval_samples < 1:
        raise ValueError(f"--eval-samples {eval_samples}: at least 1")
    return RealChoice(folder, ",".join(names), target, gain, LR_DEFAULT if lr is None else lr)


def choose_target(base: float, gain: float) -> float:
    """The target of a run: the base policy's held-out accuracy + `gain`, capped at `TARGET_CAP`."""
    return round(min(base + gain, TARGET_CAP), 4)


@dataclass(frozen=True)
class TextHeldOut:
    """The held-out problems of every task (at most `per_task` each, a listed level's whole eval split where it holds
    fewer), each sampled `samples` times at temperature 1 with seeds of its own, the same for every evaluation."""

    problems: list[Problem]
    tasks: list[str]
    """Each problem's task (`family:level`)."""
    samples: int
    max_tokens: int

    @classmethod
    def make(cls, names: list[str], per_task: int, samples: int, max_tokens: int) -> TextHeldOut:
        problems, tasks = [], []
        for name in names:
            task = get_task(name)
            size = task.split_size("eval")
            drawn = task.problems("eval", per_task if size is None else min(per_task, size), seed=0)
            problems += drawn
            tasks += [name] * len(drawn)
        return cls(problems, tasks, samples, max_tokens)

    def evaluate(self, client: RolloutClient, tag: str) -> dict[str, Any]:
        """Sample every problem through the fleet that serves `client`'s namespace (idle, at the version to
        evaluate) and score the replies: `accuracy` (the mean of the tasks'), `by_task`, `reply_tokens` (mean) and
        `length_capped` (the share of replies that reached `max_tokens`). `client` has the model's tokenizer."""
        tokenizer = client.tokenizer
        reward = text_reward(lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)))
        ids = {}
        for i, problem in enumerate(self.problems):
            prompt_id = f"held-out-{tag}-{i}"
            client.submit(
                problem.prompt, n=self.samples, max_tokens=self.max_tokens, temperature=1.0, meta=problem.meta,
                id=prompt_id, seed=stable_hash(f"held-out|{problem.id}") % 2**40,
            )  # fmt: skip
            ids[prompt_id] = i
        right: dict[str, list[float]] = {name: [] for name in self.tasks}
        lengths, capped = [], 0
        got = 0
        while got < len(ids):
            for group in client.collect(len(ids) - got, timeout=900):
                if group.prompt_id not in ids:
                    continue  # not this evaluation's (nothing else should be on the stream by now)
                got += 1
                name = self.tasks[ids[group.prompt_id]]
                for rollout in group.rollouts:
                    right[name].append(reward(rollout))
                    lengths.append(rollout.n_tokens)
                    capped += rollout.n_tokens >= self.max_tokens
        by_task = {name: round(statistics.mean(values), 4) for name, values in right.items()}
        return {
            "accuracy": round(statistics.mean(by_task.values()), 4),
            "by_task": by_task,
            "reply_tokens": round(statistics.mean(lengths), 1),
            "length_capped": round(capped / max(len(lengths), 1), 4),
        }

    def describe(self) -> dict[str, Any]:
        counts = {name: self.tasks.count(name) for name in dict.fromkeys(self.tasks)}
        return {"problems": counts, "samples": self.samples, "max_tokens": self.max_tokens, "temperature": 1.0}


@dataclass(frozen=True)
class RealEval:
    """What a run on a real model is evaluated with: the held-out problems, and the base policy's accuracy on them
    (measured once, before any run: every curve starts there, at step 0)."""

    held_out: TextHeldOut
    base: dict[str, Any]


def warm_up_submitter(client: RolloutClient, config: Any) -> Any:
    """`submit(i)` of warm-up and calibration prompts: train problems of the run's tasks (their own sequence, apart
    from every run's), `config.n` samples each up to `config.max_tokens`."""
    from dataclasses import replace

    from benchmarks.bench_rl import load_trainer

    prompts = load_trainer().TextPrompts(replace(config, seed=10_007))
    tag = os.urandom(4).hex()

    def submit(i: int) -> None:
        problem = prompts.problem(i)
        client.submit(problem.prompt, n=config.n, max_tokens=config.max_tokens, temperature=config.temperature,
                      meta=problem.meta, id=f"warm-{tag}-{i}", seed=i)  # fmt: skip

    return submit


# -- the engine called directly, in a process of its own ----------------------------------------------------------


def direct_request(config: Any, model: Path, steps: int) -> dict[str, Any]:
    """What `direct_generation` runs: the first `steps` steps' prompts of `config`'s seed (as the trainer makes them),
    as token ids through the chat template, with the trainer's sampling seeds."""
    from transformers import AutoTokenizer

    from benchmarks.bench_rl import load_trainer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = load_trainer().TextPrompts(config)
    count = steps * config.groups_per_step
    rows = []
    for index in range(count):
        problem = prompts.problem(index)
        ids = tokenizer.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)  # fmt: skip
        rows.append({"tokens": list(ids), "seed": config.seed * 1_000_000 + index})
    return {"prompts": rows, "n": config.n, "max_tokens": config.max_tokens, "temperature": config.temperature}


def engine_options(settings: Any) -> tuple[str, dict[str, Any], dict[str, str] | None]:
    """The engine a worker of `settings` runs, as `create_engine` options, and the environment it runs in: its
    `--engine-args`, `--max-batch`, `--dtype`, a torch worker's device and one thread (as `generation_side` starts
    it), a vLLM worker's only visible GPU."""
    from benchmarks.bench_rl import load_trainer

    args = list(settings.worker_args)

    def flag(name: str) -> str | None:
        return args[args.index(name) + 1] if name in args else None

    options: dict[str, Any] = {"dtype": flag("--dtype") or "float32", "seed": 0}
    if max_batch := flag("--max-batch"):
        options["max_batch" if settings.engine == "torch" else "engine_args"] = (
            int(max_batch) if settings.engine == "torch" else {"max_num_seqs": int(max_batch)}
        )
    if settings.engine == "torch":
        return "torch", options | {"device": settings.worker_device, "num_threads": 1}, None
    engine_args = json.loads(flag("--engine-args") or "{}") | options.pop("engine_args", {})
    return "vllm", options | {"engine_args": engine_args}, load_trainer().gpu_of(settings.worker_device)


def direct_generation(settings: Any, config: Any, model: Path, steps: int) -> dict[str, Any]:
    """The workers' engine called directly (no Redis, no worker) on the first `steps` steps' prompts of the first
    seed, all at once: generated tokens over the seconds from the first request to the last reply, after a warm-up
    batch. In a process of its own, so that nothing of it (vLLM's processes, CUDA) stays in the bench's."""
    kind, options, env = engine_options(settings)
    request = direct_request(config, model, steps) | {"kind": kind, "model": str(model), "options": options}
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_rl_real"], input=json.dumps(request), capture_output=True,
        text=True, env=os.environ | (env or {}), timeout=1200,
    )  # fmt: skip
    if process.returncode != 0:
        raise RuntimeError(f"the direct engine call failed: {process.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(process.stdout.strip().splitlines()[-1])
    return result | {"engine": kind, "options": options, "steps": steps}


async def _direct(request: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from consumers.engines import create_engine
    from consumers.engines.base import continuation_seed
    from pipeline.wire import Sampling

    started = time.monotonic()
    engine = create_engine(request["kind"], request["model"], **request["options"])
    await engine.start()
    start_s = time.monotonic() - started

    async def one(row: dict[str, Any], k: int, tag: str) -> Any:
        sampling = Sampling(max_tokens=request["max_tokens"], temperature=request["temperature"],
                            seed=continuation_seed(row["seed"] + k, 0))  # fmt: skip  # sample k as a worker seeds it
        return await engine.generate(f"{tag}-{row['seed']}-{k}", np.asarray(row["tokens"], dtype=np.int32), sampling)

    try:
        rows, n = request["prompts"], request["n"]
        await asyncio.gather(*(one(row, k, "warm") for row in rows[: max(1, len(rows) // 4)] for k in range(n)))
        t0 = time.monotonic()
        generations = await asyncio.gather(*(one(row, k, "direct") for row in rows for k in range(n)))
        seconds = time.monotonic() - t0
    finally:
        await engine.shutdown()
    lengths = [len(g.tokens) for g in generations]
    return {
        "samples": len(lengths),
        "tokens": sum(lengths),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(lengths) / seconds, 1),
        "reply_tokens_mean": round(statistics.mean(lengths), 1),
        "reply_tokens_max": max(lengths),
        "engine_start_s": round(start_s, 1),
    }


# -- the report's real-model figures ------------------------------------------------------------------------------


def run_figures(steps: list[Any], generated: int, wall: float) -> dict[str, Any]:
    """Per run: the share of groups with all rewards equal, the generation tokens/s over the run's wall time, and
    each step's trained tokens and wait (sync: its generation) for the comparison with the direct call."""
    groups = sum(s.groups for s in steps)
    return {
        "flat_group_share": round(sum(s.flat_groups for s in steps) / max(groups, 1), 4),
        "generation_tokens_per_s": round(generated / wall, 1) if wall > 0 else None,
        "train_s_median": round(statistics.median(s.train_s for s in steps), 4),
        "step_tokens": [s.tokens for s in steps],
        "step_wait_s": [round(s.wait_s, 4) for s in steps],
    }


def mode_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode over the seeds: the median and range of the share of all-equal groups, generation tokens/s, the
    trainer's step and the final accuracy per task."""
    from benchmarks.bench_rl import spread

    tasks = list(rows[0]["final_by_task"]) if rows else []
    return {
        "flat_group_share": spread([r["flat_group_share"] for r in rows]),
        "generation_tokens_per_s": spread([r["generation_tokens_per_s"] for r in rows if r["generation_tokens_per_s"]]),
        "train_s_median": spread([r["train_s_median"] for r in rows]),
        "final_by_task": {t: spread([r["final_by_task"][t] for r in rows]) for t in tasks},
    }


def against_direct(runs: list[dict[str, Any]], direct: dict[str, Any] | None, seed: int) -> dict[str, Any] | None:
    """Sync's generation of the direct call's prompts through the pipeline (its first steps on that seed: tokens
    over the trainer's wait for them, per W) against the direct call's tokens/s."""
    if direct is None:
        return None
    steps = direct["steps"]
    out: dict[str, Any] = {"direct_tokens_per_s": direct["tokens_per_s"], "pipeline": {}}
    for run in runs:
        if run["mode"] != "sync" or run["seed"] != seed or len(run["step_tokens"]) < steps:
            continue
        tokens, wait = sum(run["step_tokens"][:steps]), sum(run["step_wait_s"][:steps])
        rate = tokens / wait if wait > 0 else math.nan
        out["pipeline"][str(run["workers"])] = {
            "tokens": tokens, "seconds": round(wait, 3), "tokens_per_s": round(rate, 1),
            "over_direct": round(rate / direct["tokens_per_s"], 3) if direct["tokens_per_s"] else None,
        }  # fmt: skip
    return out


if __name__ == "__main__":  # the direct call: the request as JSON on stdin, the result as one JSON line on stdout
    print(json.dumps(asyncio.run(_direct(json.loads(sys.stdin.read())))), flush=True)

"""The wire codec's cost per message: `Rollout.to_fields` and `Rollout.from_fields` of a 1k-token rollout (and a
prompt's), median microseconds of repeats. Imports `pipeline.wire` from wherever PYTHONPATH puts it; `--trees A B`
times each tree (an older commit's `git archive`, this checkout) in a process of its own, round after round, the
trees taking turns (in the reverse order every other round), so that a busy machine's drift falls on all of them
alike: each number is the median over the rounds (`*_best_us`: the least of all). JSON on stdout.

    mkdir /tmp/old && git archive 9919996 pipeline | tar -x -C /tmp/old
    python benchmarks/probes/wire_codec.py --trees /tmp/old . --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

import pipeline.wire
from pipeline.wire import Prompt, Rollout, Sampling


def rollout(tokens: int) -> Rollout:
    rng = np.random.default_rng(0)
    return Rollout(
        prompt_id="prompt-0001",
        sample=3,
        n=8,
        version=7,
        version_end=7,
        finish_reason="length",
        worker="host-1234",
        prompt_tokens=rng.integers(0, 50_000, 256, dtype=np.int32),
        tokens=rng.integers(0, 50_000, tokens, dtype=np.int32),
        logprobs=-rng.random(tokens, dtype=np.float32),
        spans=[(7, 0, tokens)],
        meta={"task": "countdown", "level": "easy"},
        timing={"queued_s": 0.01, "generate_s": 1.5},
        reward_fn="producers.tasks.rewards:countdown",
    )


def timed_us(call: Callable[[], object], repeats: int, loops: int) -> tuple[float, float]:
    """The median and the least over `repeats` of the mean time of `loops` calls, in microseconds (the least: what
    the call costs when nothing else on the machine gets in its way). CPU time of this process (`process_time`), so
    that the time it waits for a core on a shared machine is not counted."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(loops):
            call()
        times.append((time.process_time() - start) / loops * 1e6)
    return round(statistics.median(times), 2), round(min(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--loops", type=int, default=2000)
    parser.add_argument("--trees", nargs="+", help="time each of these trees (their pipeline/), taking turns")
    parser.add_argument("--rounds", type=int, default=9, help="--trees: rounds, each tree once a round")
    args = parser.parse_args()
    if args.trees:
        print(json.dumps(compare(args.trees, args.rounds, [f"--tokens={args.tokens}", f"--repeats={args.repeats}",
                                                           f"--loops={args.loops}"])))  # fmt: skip
        return
    sample = rollout(args.tokens)
    fields = sample.to_fields()
    prompt = Prompt(id="p-1", n=8, tokens=sample.prompt_tokens, sampling=Sampling(max_tokens=1024), meta=sample.meta)
    prompt_fields = prompt.to_fields()
    assert Rollout.from_fields(fields).to_fields() == fields
    calls: dict[str, Callable[[], object]] = {
        "rollout_encode": sample.to_fields,
        "rollout_decode": lambda: Rollout.from_fields(fields),
        "prompt_encode": prompt.to_fields,
        "prompt_decode": lambda: Prompt.from_fields(prompt_fields),
    }
    report: dict[str, object] = {"wire": pipeline.wire.__file__, "tokens": args.tokens}
    for name, call in calls.items():
        report[f"{name}_us"], report[f"{name}_best_us"] = timed_us(call, args.repeats, args.loops)
    print(json.dumps(report))


def compare(trees: list[str], rounds: int, flags: list[str]) -> dict[str, dict[str, float]]:
    """Each tree's numbers, the median of its `rounds` runs (the trees taking turns)."""
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    for round_ in range(rounds):
        for tree in trees if round_ % 2 == 0 else trees[::-1]:  # each tree first as often as last
            env = os.environ | {"PYTHONPATH": os.path.abspath(tree)}
            command = [sys.executable, __file__, *flags]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            run = json.loads(out.stdout)
            assert run["wire"].startswith(os.path.abspath(tree)), f"{tree}: imported {run['wire']} instead"
            runs[tree].append(run)

    def over_rounds(key: str, done: list[dict[str, float]]) -> float:
        return round((min if key.endswith("_best_us") else statistics.median)(run[key] for run in done), 2)

    keys = [key for key in next(iter(runs.values()))[0] if key.endswith("_us")]
    return {tree: {key: over_rounds(key, done) for key in keys} for tree, done in runs.items()}


if __name__ == "__main__":
    main()

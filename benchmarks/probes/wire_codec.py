"""The wire codec's cost per message: `Rollout.to_fields` and `Rollout.from_fields` of a 1k-token rollout (and a
prompt's), median microseconds of repeats. Imports `pipeline.wire` from wherever PYTHONPATH puts it, so that one
command times two trees (an older commit's `git archive` beside this one). JSON on stdout.

    python benchmarks/probes/wire_codec.py --tokens 1024 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def median_us(call: Callable[[], object], repeats: int, loops: int) -> float:
    """The median over `repeats` of the mean time of `loops` calls, in microseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            call()
        times.append((time.perf_counter() - start) / loops * 1e6)
    return round(statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--loops", type=int, default=2000)
    args = parser.parse_args()
    sample = rollout(args.tokens)
    fields = sample.to_fields()
    prompt = Prompt(id="p-1", n=8, tokens=sample.prompt_tokens, sampling=Sampling(max_tokens=1024), meta=sample.meta)
    prompt_fields = prompt.to_fields()
    assert Rollout.from_fields(fields).to_fields() == fields
    print(json.dumps({
        "wire": pipeline.wire.__file__,
        "tokens": args.tokens,
        "rollout_encode_us": median_us(sample.to_fields, args.repeats, args.loops),
        "rollout_decode_us": median_us(lambda: Rollout.from_fields(fields), args.repeats, args.loops),
        "prompt_encode_us": median_us(prompt.to_fields, args.repeats, args.loops),
        "prompt_decode_us": median_us(lambda: Prompt.from_fields(prompt_fields), args.repeats, args.loops),
    }))  # fmt: skip


if __name__ == "__main__":
    main()

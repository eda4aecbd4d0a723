"""`python -m benchmarks.bench_step`: the reference trainer's update (`producers.grpo.grpo_step`) timed alone.

A batch shaped as `rollouts bench-rl`'s (16 groups x 4 samples of the token-set task, response lengths 16 x
Pareto(1.5) capped at 256, random tokens) on a random Qwen2 of `--hidden-size` x `--num-layers` (default: the 25M
policy of issue 54), no pipeline: the step's own cost, which the loop's `train_s` adds waits and a shared GPU to.
Each step gets a fresh batch; the first is reported apart (`first_s`: kernels chosen, allocator warmed). JSON out.

    python -m benchmarks.bench_step --device cuda:0 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from producers.client import Batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--num-threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args)))


def run(args: argparse.Namespace) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from consumers.engines.tiny_model import build_tiny_model
    from producers.grpo import grpo_step
    from producers.rl import ImportanceWeights
    from producers.tasks import token_set_reward

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        size = {"hidden_size": args.hidden_size, "num_layers": args.num_layers}
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0, **size)
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)  # type: ignore[arg-type]  # transformers' @wraps on .to: mypy reads it unbound
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    rng = random.Random(0)
    vocab = int(policy.config.vocab_size)
    extra = {"autocast": torch.bfloat16} if args.dtype == "bfloat16" else {}
    seconds, tokens, padded = [], [], []
    for _ in range(args.steps + 1):
        batch = make_batch(rng, vocab, args.groups, args.n)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        grpo_step(policy, optimizer, batch, token_set_reward, importance=ImportanceWeights(), **extra)  # type: ignore[arg-type]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
        rollouts = batch.rollouts
        tokens.append(sum(r.n_tokens for r in rollouts))
        padded.append(len(rollouts) * max(len(r.prompt_tokens) + len(r.tokens) for r in rollouts))
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in policy.parameters()),
        "samples": args.groups * args.n,
        "tokens_median": int(statistics.median(tokens[1:])),
        "padded_positions_median": int(statistics.median(padded[1:])),
        "first_s": round(seconds[0], 4),
        "step_s": round(statistics.median(seconds[1:]), 4),
        "steps_s": [round(s, 4) for s in seconds[1:]],
    }


def make_batch(rng: random.Random, vocab: int, groups: int, n: int) -> Batch:
    """`groups` x `n` rollouts of the token-set task's prompts with random completions, lengths as bench-rl's."""
    from pipeline.wire import Rollout
    from producers.client import Group
    from producers.tasks import TokenSetTask

    task = TokenSetTask()
    made = []
    for g in range(groups):
        prompt, meta = task.prompt(rng)
        u = 1.0 - rng.random()
        length = min(256, round(16 * u ** (-1 / 1.5)))
        samples = []
        for k in range(n):
            tokens = np.array([rng.randrange(3, vocab) for _ in range(length)], np.int32)
            rollout = Rollout(
                v=1, id=f"p{g}:{k}", prompt_id=f"p{g}", sample=k, n=n, version=0, version_end=0,
                n_tokens=length, finish_reason="length", worker="bench-step",
                prompt_tokens=np.array(prompt, np.int32), tokens=tokens,
                logprobs=np.full(length, -np.log(vocab), np.float32), spans=[(0, 0, length)], meta=meta,
            )  # fmt: skip
            samples.append(rollout)
        made.append(Group(f"p{g}", samples))
    return Batch(made)


if __name__ == "__main__":
    main()

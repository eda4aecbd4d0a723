"""The smallest fully-async trainer: queue prompts, train on whole groups as they arrive, publish the new weights.

    rollouts tiny-model ./tiny                      # or any model directory (safetensors + tokenizer)
    rollouts worker --model ./tiny &                # Redis at redis://127.0.0.1:6379/0, namespace `rollouts`
    python examples/minimal_trainer.py --model ./tiny --steps 5

Each step takes a batch of whole groups (every sample of a prompt, each sample once), scores it, takes one GRPO step
and publishes the weights: the worker pauses, loads them, and goes on. `examples/grpo_trainer.py` is the full
reference (a task, admission control, a learning curve).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pipeline.wire import Rollout
from producers.client import RolloutClient
from producers.grpo import grpo_step


def even_share(rollout: Rollout) -> float:
    """The reward: the share of even token ids in the sample (put your task's here)."""
    return float((rollout.tokens % 2 == 0).mean()) if len(rollout.tokens) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the workers' model directory")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--ns", default="rollouts")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--groups-per-step", type=int, default=4)
    args = parser.parse_args()

    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    client = RolloutClient(args.redis, args.ns, tokenizer=args.model)
    for i in range(args.steps * args.groups_per_step):  # what the run trains on, queued up front
        client.submit(f"Name an even number after {i}.", n=4, max_tokens=16, seed=i)
    batches = client.batches(args.groups_per_step, timeout=120)
    for step, batch in zip(range(args.steps), batches, strict=False):
        out = grpo_step(policy, optimizer, batch, even_share)
        version = client.publish_weights(policy)  # every worker generates with these weights from now on
        print(f"step {step}: {len(batch.rollouts)} rollouts, reward {out.reward:.3f}, policy version {version}")
    batches.close()  # acks the last batch
    print(f"received {client.stats['received']} rollouts, {client.stats['duplicates']} duplicates")


if __name__ == "__main__":
    main()

"""One GRPO update on a `Batch`, as library code: the reference trainer and `rollouts demo` step with it.

Why it lives here: the loop around it (sync or async, how prompts are made, where weights go) differs
from trainer to trainer, but the update itself (rewards of whole groups → group-normalized
advantages → the trainer's logprobs → the PPO-clipped loss against the published behaviour logprobs
→ one clipped optimizer step) must be the same wherever it is shown, so that what the demo shows is
what the example measures. The helpers it composes are in `producers.rl`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeline.wire import Rollout
from producers.client import Batch
from producers.rl import group_advantages, policy_loss, token_logprobs

RewardFn = Callable[[Rollout], float]
"""The reward of one sample, computed from the rollout alone (e.g. `producers.tasks.token_set_reward`)."""


def batch_rewards(batch: Batch, reward: RewardFn) -> list[list[float]]:
    """`reward` of each sample, one list a group: the shape `group_advantages` takes."""
    return [[reward(r) for r in group.rollouts] for group in batch.groups]


def mean_reward(rewards: Sequence[Sequence[float]]) -> float:
    """The mean over every sample of the batch (groups weighted by their size); 0 for an empty one."""
    flat = [x for group in rewards for x in group]
    return sum(flat) / len(flat) if flat else 0.0


@dataclass
class GrpoStep:
    """What one update did, for a trainer's log line."""

    rewards: list[list[float]]
    reward: float
    """Mean reward over the batch's samples."""
    loss: float
    kl: float
    """KL(behaviour ‖ current) over the batch, before the update."""
    clip_fraction: float
    grad_norm: float
    """The gradient's norm before clipping."""


def grpo_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    reward: RewardFn,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    max_grad_norm: float = 1.0,
) -> GrpoStep:
    """Score `batch`, compute the PPO-clipped GRPO loss on it and take one optimizer step on `policy`.

    The batch's arrays go to the device of the policy's parameters, so a trainer on a GPU passes a
    policy on that GPU and nothing else. Publishing the new weights is the caller's (`publish_weights`).
    """
    rewards = batch_rewards(batch, reward)
    device = next(policy.parameters()).device
    arrays = {k: torch.from_numpy(v).to(device) for k, v in batch.to_arrays().items()}
    current = token_logprobs(policy, arrays["input_ids"], arrays["attention_mask"])
    out = policy_loss(
        current, arrays["logprobs"], group_advantages(rewards).to(device), arrays["loss_mask"],
        clip_low=clip_low, clip_high=clip_high,
    )  # fmt: skip
    optimizer.zero_grad()
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    optimizer.step()
    return GrpoStep(
        rewards=rewards, reward=mean_reward(rewards), loss=float(out.loss.detach()), kl=out.kl,
        clip_fraction=out.clip_fraction, grad_norm=float(grad_norm),
    )  # fmt: skip

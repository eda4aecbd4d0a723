"""One GRPO update on a `Batch`, as library code: the reference trainer and `rollouts demo` step with it.

Why it lives here: the loop around it (sync or async, how prompts are made, where weights go) differs
from trainer to trainer, but the update itself (rewards of whole groups → group-normalized
advantages → the trainer's logprobs → decoupled PPO against the published behaviour logprobs
→ clipped optimizer steps) must be the same wherever it is shown, so that what the demo shows is
what the example measures. The helpers it composes are in `producers.rl`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pipeline.wire import Rollout
from producers.groups import Batch
from producers.rl import ImportanceWeights, group_advantages, kl_behaviour_current, policy_loss, token_logprobs
from producers.routing import routes_replayed

RewardFn = Callable[[Rollout], float]
"""The reward of one sample, computed from the rollout alone (e.g. `producers.tasks.token_set_reward`)."""


def batch_rewards(batch: Batch, reward: RewardFn) -> list[list[float]]:
    """`reward` of each sample, one list a group: the shape `group_advantages` takes."""
    return [[reward(r) for r in group.rollouts] for group in batch.groups]


def mean_reward(rewards: Sequence[Sequence[float]]) -> float:
    """The mean over every sample of the batch (groups weighted by their size); 0 for an empty one."""
    flat = [x for group in rewards for x in group]
    return sum(flat) / len(flat) if flat else 0.0


Objective = Literal["decoupled", "ppo"]
"""`decoupled`: PPO clipped around the proximal policy, importance-weighted back to the behaviour policy (the default;
`producers.rl`); `ppo`: clipped around the behaviour policy, unweighted ("naive" PPO, right only when nothing is
stale and the engine computes logprobs as the trainer does)."""


@dataclass
class GrpoStep:
    """What one update did, for a trainer's log line."""

    rewards: list[list[float]]
    reward: float
    """Mean reward over the batch's samples."""
    loss: float
    """Mean over the minibatches."""
    kl: float
    """KL(behaviour ‖ current) over the batch, before the update."""
    clip_fraction: float
    """Share of completion tokens whose ratio was clipped, over the minibatches (0 in a decoupled step of one
    minibatch: its ratio is 1)."""
    grad_norm: float
    """The gradient's norm before clipping (mean over the minibatches)."""
    is_weight_mean: float = 1.0
    """Mean importance weight proximal / behaviour over the tokens trained (1.0 for `ppo`)."""
    is_capped_fraction: float = 0.0
    """Share of tokens whose importance weight was over the cap (truncated, or left out in `mask` mode)."""


def grpo_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    reward: RewardFn,
    *,
    objective: Objective = "decoupled",
    importance: ImportanceWeights | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    max_grad_norm: float = 1.0,
    minibatches: int = 1,
    replay_routes: bool = False,
    autocast: torch.dtype | None = None,
) -> GrpoStep:
    """Score `batch`, compute the GRPO loss on it and take `minibatches` optimizer steps on `policy`.

    `objective` (default `decoupled`) and `importance` (default token-level weights truncated at 2) are
    `producers.rl`'s. The proximal policy is the policy as the step starts: with one minibatch it is the forward pass
    that the loss takes anyway (free); with more, one forward pass without gradient over the whole batch comes
    first. The batch's arrays go to the device of the policy's parameters, so a trainer on a GPU passes a policy on
    that GPU and nothing else. Publishing the new weights is the caller's (`publish_weights`).

    `replay_routes`: a mixture-of-experts policy's forward passes route as the engine routed the rollouts
    (`producers.routing.routes_replayed`; the rollouts asked for with `submit(..., routed_experts=True)`).

    `autocast`: the dtype the forward and backward passes compute in (`torch.bfloat16` where the engines serve the
    policy in bf16: tensor cores on a GPU), the parameters, gradients and optimizer staying in theirs; logprobs and
    the loss are still float32 (`token_logprobs`). None: the parameters' dtype.

    Raises `ValueError` for an objective it does not know, `minibatches` < 1 or more than the batch's samples, or
    `replay_routes` for a batch that carries no routes.
    """
    if objective not in ("decoupled", "ppo"):
        raise ValueError(f"objective {objective!r}: use 'decoupled' (the default) or 'ppo'")
    rewards = batch_rewards(batch, reward)
    rows = sum(len(group) for group in rewards)
    if not 1 <= minibatches <= max(rows, 1):
        raise ValueError(f"minibatches must be between 1 and the batch's {rows} samples, got {minibatches}")
    device = next(policy.parameters()).device
    host = batch.to_arrays()
    given = host.pop("routed_experts", None)
    if replay_routes and given is None:
        raise ValueError("replay_routes: the batch's rollouts carry no routed experts; submit with routed_experts=True")
    routes = torch.from_numpy(given).to(device) if replay_routes and given is not None else None
    arrays = {k: torch.from_numpy(v).to(device) for k, v in host.items()}

    def routed(rows_of: torch.Tensor | slice) -> contextlib.ExitStack[bool | None]:
        """The policy routed as the engine routed these rows when `replay_routes` (its backward pass too), and computing
        in `autocast`'s dtype when given."""
        stack = contextlib.ExitStack()
        if autocast is not None:
            stack.enter_context(torch.autocast(device.type, dtype=autocast))
        if routes is not None:
            stack.enter_context(routes_replayed(policy, routes[rows_of]))
        return stack

    advantages = group_advantages(rewards).to(device)
    proximal = None  # the policy as the step starts, when minibatches > 1 (else each minibatch's own forward pass)
    if minibatches > 1:
        with torch.no_grad(), routed(slice(None)):
            proximal = token_logprobs(policy, arrays["input_ids"], arrays["attention_mask"])
    outs, norms = [], []
    for rows_of in torch.arange(rows, device=device).tensor_split(minibatches):
        part = {k: v[rows_of] for k, v in arrays.items()}
        with routed(rows_of):  # the backward too: a checkpointed layer recomputes its forward pass in it
            current = token_logprobs(policy, part["input_ids"], part["attention_mask"])
            anchor = None
            if objective == "decoupled":
                anchor = current.detach() if proximal is None else proximal[rows_of]
            out = policy_loss(
                current, part["logprobs"], advantages[rows_of], part["loss_mask"],
                clip_low=clip_low, clip_high=clip_high, proximal=anchor, importance=importance,
            )  # fmt: skip
            optimizer.zero_grad()
            out.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)))
        optimizer.step()
        outs.append(out)
    kl = outs[0].kl
    if proximal is not None:
        kl = float(kl_behaviour_current(proximal, arrays["logprobs"], arrays["loss_mask"]))
    return GrpoStep(
        rewards=rewards, reward=mean_reward(rewards), loss=mean(o.loss.detach() for o in outs), kl=kl,
        clip_fraction=mean(o.clip_fraction for o in outs), grad_norm=mean(norms),
        is_weight_mean=mean(o.is_weight_mean for o in outs),
        is_capped_fraction=mean(o.is_capped_fraction for o in outs),
    )  # fmt: skip


def mean(values: Iterable[float | torch.Tensor]) -> float:
    listed = [float(v) for v in values]
    return sum(listed) / len(listed)

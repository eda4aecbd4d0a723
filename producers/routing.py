"""Rollout routing replay: a mixture-of-experts policy's forward pass routed as the engine routed the rollout.

An engine and a trainer route some tokens to different experts (other kernels, other precision, newer weights), so
the trainer's logprobs are of a different sub-network than the one that sampled the tokens. Replaying the engine's
routes (`Rollout.routed_experts`, asked with `submit(..., routed_experts=True)`) makes the trainer's forward pass use
the same experts; the routing weights stay the trainer's own (its router's softmax at those experts), so the router
still learns.

    arrays = batch.to_arrays()                      # with "routed_experts" when a rollout carries them
    with routes_replayed(policy, torch.from_numpy(arrays["routed_experts"])):
        loss = loss_of(policy(input_ids, attention_mask=mask).logits)
        loss.backward()                             # inside too: a checkpointed layer recomputes its forward here

`grpo_step(..., replay_routes=True)` does this for the reference trainer. Rows of rollouts that carry no routes (-1
in `to_arrays`) route as the model does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from staleness.weights.fused import ROUTER_MODELS, routers

RouterForward = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@contextmanager
def routes_replayed(model: torch.nn.Module, routes: torch.Tensor) -> Iterator[None]:
    """Inside, every forward pass of `model` over `[batch, positions]` tokens routes position `p` of row `b` in the
    `l`-th layer with experts to the experts `routes[b, p, l]` (`[batch, positions, layers, top_k]`, integer; -1: the
    router's own choice, for positions the rollouts have no route for). The routing weights are the router's softmax
    at those experts, renormalized where the model normalizes its top-k. Outside, the model routes as before, so a
    backward pass that recomputes the forward (gradient checkpointing) runs inside too.

    `ValueError`: a model without the routers of transformers' Qwen2-MoE, Qwen3-MoE, Mixtral or OLMoE, routes of
    another number of layers or top-k, a replay inside another on the same model, or (in the forward pass) routes of
    another batch and length than its input."""
    found = routers(model)
    if not found:
        raise ValueError(
            f"routes_replayed needs a mixture of experts with the routers of transformers' {ROUTER_MODELS}; "
            f"{type(model).__name__} has none"
        )
    top_k = int(getattr(found[0], "top_k", routes.shape[-1]))
    if routes.dim() != 4 or routes.shape[2] != len(found) or routes.shape[3] != top_k:
        raise ValueError(
            f"routes of shape {list(routes.shape)} do not fit the model: expected [batch, positions, {len(found)}, "
            f"{top_k}] ({len(found)} layers with experts, top-{top_k})"
        )
    patched: list[torch.nn.Module] = []
    try:
        for layer, router in enumerate(found):
            router.forward = _replaying(router, routes[:, :, layer, :])  # an instance attribute over the class's own
            patched.append(router)
        yield
    finally:
        for router in patched:
            del router.forward  # the class's own again


def _replaying(router: torch.nn.Module, given: torch.Tensor) -> RouterForward:
    """`router`'s forward with its experts taken from `given` (`[batch, positions, top_k]`, -1: its own)."""
    if "forward" in vars(router):
        raise ValueError(f"{type(router).__name__}'s forward is replaced already: routes_replayed does not nest")
    own_forward = router.forward
    normalize = bool(getattr(router, "norm_topk_prob", True))  # Mixtral's router has no flag and always normalizes

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, scores, own = own_forward(hidden_states)
        if own.shape[0] != given.shape[0] * given.shape[1]:
            raise ValueError(
                f"routes for {given.shape[0]} x {given.shape[1]} positions, but the forward pass routes "
                f"{own.shape[0]}: pass the routes of the batch being forwarded (its width included)"
            )
        flat = given.reshape(-1, given.shape[-1]).to(own.device, own.dtype)
        experts = torch.where(flat >= 0, flat, own)
        weights = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), experts

    return forward

"""The trainer's helpers: advantages, the trainer's logprobs on `to_arrays()`, the clipped loss, KL, staleness."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from consumers.engines.torch_engine import TorchEngine
from pipeline.wire import Rollout, Sampling
from producers.client import Batch, Group
from producers.rl import group_advantages, kl_behaviour_current, policy_loss, staleness_stats, token_logprobs
from tests.reference import load_model, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_advantages_are_normalized_within_each_group_and_zero_without_signal() -> None:
    adv = group_advantages([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5], [2.0, 0.0, 1.0]])
    np.testing.assert_allclose(adv[:4], [1, -1, -1, 1], atol=1e-5)
    assert adv[4:6].tolist() == [0.0, 0.0], "a group with equal rewards teaches nothing"
    np.testing.assert_allclose(adv[6:], np.array([1.0, -1.0, 0.0]) / np.std([2.0, 0.0, 1.0]), atol=1e-5)
    np.testing.assert_allclose(group_advantages([[3.0, 1.0]], scale="none"), [1.0, -1.0])
    assert group_advantages([]).numel() == 0


def test_the_trainers_logprobs_on_to_arrays_equal_what_the_engine_published(tiny_model_dir: Path) -> None:
    """Alignment end to end: engine → rollouts → `to_arrays()` → `token_logprobs` of a plain forward pass."""

    async def generate() -> list[Rollout]:
        rollouts = []
        async with TorchEngine(str(tiny_model_dir), num_threads=1) as engine:
            for i, prompt in enumerate(random_prompts([3, 9, 5, 12], seed=4)):
                made = await engine.generate(f"r{i}", prompt, Sampling(max_tokens=6 + 4 * i, seed=i))
                fields = {"finish_reason": made.finish_reason, "tokens": made.tokens, "logprobs": made.logprobs}
                rollouts.append(
                    Rollout(
                        prompt_id=f"p{i // 2}",
                        sample=i % 2,
                        n=2,
                        version=0,
                        version_end=0,
                        worker="w",
                        prompt_tokens=prompt,
                        spans=made.spans,
                        **fields,
                    )
                )
        return rollouts

    rollouts = asyncio.run(generate())
    batch = Batch([Group("p0", rollouts[:2]), Group("p1", rollouts[2:])], trainer_version=0)
    arrays = {k: torch.from_numpy(v) for k, v in batch.to_arrays().items()}
    with torch.no_grad():
        mine = token_logprobs(load_model(tiny_model_dir), arrays["input_ids"], arrays["attention_mask"])
    mask = arrays["loss_mask"].bool()
    assert mask.sum() == sum(r.n_tokens for r in rollouts) > 0
    np.testing.assert_allclose(mine[mask].numpy(), arrays["logprobs"][mask].numpy(), atol=1e-4)
    assert float(kl_behaviour_current(mine, arrays["logprobs"], mask)) < 1e-6


def _logits_policy(tokens: torch.Tensor, vocab: int = 5, seed: int = 0) -> tuple[torch.nn.Parameter, torch.Tensor]:
    """A free per-position policy: logits as a parameter; returns them and the logprobs of `tokens`."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.nn.Parameter(torch.randn(*tokens.shape, vocab, generator=generator))
    return logits, torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def test_a_step_on_the_loss_raises_good_samples_and_lowers_bad_ones() -> None:
    tokens = torch.tensor([[1, 2, 3, 0], [4, 0, 2, 1]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    logits, current = _logits_policy(tokens)
    behaviour = current.detach().clone()
    out = policy_loss(current, behaviour, torch.tensor([1.0, -1.0]), mask)
    assert out.clip_fraction == 0.0 and out.ratio_mean == pytest.approx(1.0) and out.kl == pytest.approx(0.0)
    assert float(out.loss.detach()) == pytest.approx(-(3 * 1.0 + 2 * -1.0) / 5)  # token mean over the batch
    out.loss.backward()
    with torch.no_grad():
        after = torch.log_softmax(logits - 1.0 * logits.grad, -1).gather(-1, tokens[..., None]).squeeze(-1)
    moved = (after - behaviour)[mask.bool()]
    assert (moved[:3] > 0).all() and (moved[3:] < 0).all()
    assert logits.grad[~mask.bool()].abs().max() == 0, "prompt and padding get no gradient"


def test_tokens_outside_the_clip_give_no_gradient() -> None:
    tokens = torch.tensor([[1, 2, 3]])
    mask = torch.ones_like(tokens)
    logits, current = _logits_policy(tokens)
    behaviour = current.detach() - torch.tensor([[1.0, 0.0, -1.0]])  # ratios e, 1, 1/e
    out = policy_loss(current, behaviour, torch.tensor([1.0]), mask, clip_low=0.2)
    out.loss.backward()
    grads = logits.grad.abs().sum(-1)[0]
    assert grads[0] == 0 and grads[1] > 0 and grads[2] > 0, "ratio e > 1.2 with a positive advantage: clipped"
    assert out.clip_fraction == pytest.approx(1 / 3)
    logits.grad = None
    _, current = _logits_policy(tokens)
    out = policy_loss(current, behaviour, torch.tensor([-1.0]), mask, clip_low=0.2)
    assert out.clip_fraction == pytest.approx(1 / 3), "ratio 1/e < 0.8 with a negative advantage: clipped"
    wide = policy_loss(current, behaviour, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=2.0)
    assert wide.clip_fraction == 0.0, "an asymmetric clip (DAPO's clip-higher) lets ratio e through"


def test_decoupled_ppo_weights_tokens_by_the_truncated_proximal_over_behaviour_ratio() -> None:
    tokens = torch.tensor([[1, 2, 3]])
    mask = torch.ones_like(tokens)
    _, current = _logits_policy(tokens)
    proximal = current.detach()
    behaviour = proximal - torch.tensor([[0.0, 0.5, 3.0]])  # proximal/behaviour = 1, e^0.5, e^3 (capped at 2)
    out = policy_loss(current, behaviour, torch.tensor([1.0]), mask, proximal=proximal, tis_cap=2.0)
    assert out.ratio_mean == pytest.approx(1.0) and out.clip_fraction == 0.0  # clipped against the proximal policy
    assert out.tis_mean == pytest.approx((1 + np.exp(0.5) + 2.0) / 3, rel=1e-5)
    assert float(out.loss.detach()) == pytest.approx(-out.tis_mean, rel=1e-5)


def test_the_kl_estimate_matches_the_exact_kl_of_two_distributions() -> None:
    generator = torch.Generator().manual_seed(0)
    behaviour_p = torch.softmax(torch.randn(6, generator=generator), 0)
    current_p = torch.softmax(torch.randn(6, generator=generator), 0)
    samples = torch.multinomial(behaviour_p, 200_000, replacement=True, generator=generator)
    estimate = kl_behaviour_current(current_p.log()[samples], behaviour_p.log()[samples], torch.ones(len(samples)))
    exact = float((behaviour_p * (behaviour_p / current_p).log()).sum())
    assert exact > 0.05 and float(estimate) == pytest.approx(exact, rel=0.05)


def test_staleness_is_counted_over_completion_tokens() -> None:
    versions = torch.tensor([[-1, 3, 3, 4], [-1, 5, -1, -1]])
    mask = versions >= 0
    assert staleness_stats(versions, mask, trainer_version=5) == {"staleness_mean": 1.25, "staleness_max": 2.0}
    assert staleness_stats(versions, torch.zeros_like(mask), 5) == {"staleness_mean": 0.0, "staleness_max": 0.0}

"""What every GRPO-style trainer on this pipeline needs, as library code: advantages, the policy loss, KL.

All of it works on the tensors of `Batch.to_arrays()` (`torch.from_numpy` each): `[batch, seq]`,
right-padded, with `loss_mask` marking the completion tokens, and `logprobs` (the behaviour policy's,
published by the engine) aligned with `input_ids`: the logprob at position `t` is that of token `t`
given the tokens before it. `token_logprobs` computes the trainer's own in the same alignment.

Choices:
- **Advantages** are group-normalized (GRPO): `(r - mean(group)) / (std(group) + eps)`; a group whose
  rewards are all equal carries no signal and gets 0 (`scale="none"` keeps `r - mean` instead).
- **Importance ratio** per token: the trainer's current logprob over the published behaviour logprob.
  A sample generated across a weight sync carries tokens of several versions (its `spans`); each token's
  behaviour logprob is of the version that produced it, so the ratio is right token by token.
- **PPO clipping** on that ratio (`clip_low`, `clip_high`: DAPO's asymmetric clip when they differ). With
  staleness > 0 an unclipped importance-weighted loss can diverge (tinker-cookbook #822); the clip keeps
  each step inside a trust region around the policy that generated the data.
- **Decoupled PPO** (AReaL, arXiv 2505.24298), the default of `grpo_step`: the clip is centred on the
  *proximal* policy (the trainer's own logprobs of the batch at the start of the step, no gradient),
  not on the stale behaviour policy, and the gap between the two is corrected by an importance weight
  `proximal / behaviour` per token, detached. Clipping around the behaviour policy instead ("naive"
  PPO) zeroes the gradient of exactly the tokens earlier steps already moved the right way: AReaL's
  "improper clipping centre". With one optimizer step per batch the proximal policy *is* the current
  one, the clip never binds, and the loss is an importance-weighted policy gradient.
- **The importance weight** (`ImportanceWeights`, as verl's rollout correction and AReaL's
  `behav_imp_weight_cap` offer): at the `token` level, or one per sample (`sequence`: the product of
  its tokens' ratios; `geometric`: their geometric mean); `truncate`d at `cap` (TIS, Yao et al. 2025)
  or tokens/samples over `cap` `mask`ed out of the loss (MIS). It also corrects an engine that
  computes logprobs differently from the trainer (bf16, another kernel) when nothing is stale.
- **KL(behaviour ‖ current)**, the k3 estimator `r - 1 - log r` with `r = current / behaviour`, over
  samples drawn from the behaviour policy: unbiased and never negative. It tells how far the trainer has
  moved from what generated its data: a trainer that diverges shows it here first.
- Losses are means over completion tokens of the whole batch (token-level, as DAPO), so long samples
  are not down-weighted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch


def group_advantages(
    rewards: Sequence[Sequence[float]] | torch.Tensor, scale: Literal["std", "none"] = "std", eps: float = 1e-6
) -> torch.Tensor:
    """One advantage per sample, flattened in group order (the row order of `Batch.to_arrays()`).

    `rewards[g][k]` is the reward of sample `k` of group `g`; groups may differ in size. Computed for every group at
    once (the groups padded to the largest, the padding masked out of the means), no loop over groups.
    """
    sizes = [len(group) for group in rewards]
    if not sizes or not sum(sizes):
        return torch.zeros(0)
    width = max(sizes)
    table = torch.zeros(len(sizes), width, dtype=torch.float32)
    lengths = torch.tensor(sizes)
    present = torch.arange(width)[None, :] < lengths[:, None]
    table[present] = torch.cat([torch.as_tensor(group, dtype=torch.float32).reshape(-1) for group in rewards])
    counts = lengths.clamp(min=1).to(torch.float32)[:, None]
    centered = torch.where(present, table - table.sum(1, keepdim=True) / counts, 0.0)
    if scale == "std":
        std = ((centered**2).sum(1, keepdim=True) / counts).sqrt()  # unbiased=False, as torch.std's
        scaled = torch.where(std < eps, 0.0, centered / (std + eps))
        centered = torch.where(lengths[:, None] > 1, scaled, centered)
    return centered[present]


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The model's logprob of each token given those before it, `[batch, seq]`; 0 at position 0.

    Computed in float32 from the logits (as the engines report logprobs of the raw distribution,
    before temperature and top-p), so that it compares with `to_arrays()["logprobs"]` directly.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    taken = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(taken, (1, 0))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens where `mask` is set (0 when none is)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def kl_behaviour_current(current: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(behaviour ‖ current) per token, k3 estimator, averaged over `mask`."""
    log_ratio = (current - behaviour).float()
    return masked_mean(torch.expm1(log_ratio) - log_ratio, mask)


ImportanceLevel = Literal["token", "sequence", "geometric"]
ImportanceMode = Literal["truncate", "mask"]


@dataclass(frozen=True)
class ImportanceWeights:
    """How decoupled PPO weights each token by `proximal / behaviour` (see the module docstring).

    Raises `ValueError` on a level, mode or cap it does not know, saying what to use.
    """

    level: ImportanceLevel = "token"
    """`token`: each token its own ratio; `sequence`: one a sample, the product of its tokens' ratios (their sum of
    log ratios); `geometric`: one a sample, their geometric mean (the mean log ratio: independent of length)."""
    mode: ImportanceMode = "truncate"
    """`truncate`: a weight over `cap` counts as `cap` (TIS); `mask`: a token (or sample) whose weight is over `cap`
    is left out of the loss (MIS)."""
    cap: float = 2.0
    """The largest weight kept; > 1."""

    def __post_init__(self) -> None:
        if self.level not in ("token", "sequence", "geometric"):
            raise ValueError(f"importance level {self.level!r}: use 'token', 'sequence' or 'geometric'")
        if self.mode not in ("truncate", "mask"):
            raise ValueError(f"importance mode {self.mode!r}: use 'truncate' (TIS) or 'mask' (MIS)")
        if not self.cap > 1.0:
            raise ValueError(f"importance cap must be > 1 (a weight of 1 is on-policy), got {self.cap}")

    def weights(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From `log_ratio = log proximal - log behaviour` (`[batch, seq]`): each token's weight (no gradient),
        the tokens still in the loss (`mask`, less what `mask` mode leaves out), and those whose weight was over the
        cap."""
        mask = mask.bool()
        log_ratio = torch.where(mask, log_ratio.detach().float(), 0.0)
        if self.level != "token":
            per_sample = log_ratio.sum(-1)
            if self.level == "geometric":
                per_sample = per_sample / mask.sum(-1).clamp(min=1)
            log_ratio = per_sample[:, None].expand_as(log_ratio)
        over = mask & (log_ratio > math.log(self.cap))
        weights = torch.exp(log_ratio.clamp(max=math.log(self.cap)))
        if self.mode == "truncate":
            return weights, mask, over
        kept = mask & ~over
        return torch.where(kept, weights, 0.0), kept, over


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    """Scalar to call `.backward()` on."""
    clip_fraction: float
    """Share of completion tokens whose ratio was clipped (and so gave no gradient)."""
    ratio_mean: float
    """Mean of the ratio the clip looks at: current / proximal (decoupled), current / behaviour (naive PPO)."""
    kl: float
    """KL(behaviour ‖ current) before the step (see `kl_behaviour_current`)."""
    is_weight_mean: float
    """Mean importance weight over the tokens in the loss (1.0 without `proximal`)."""
    is_capped_fraction: float
    """Share of completion tokens whose weight was over the cap: truncated (TIS) or left out (MIS)."""


def policy_loss(
    current: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    proximal: torch.Tensor | None = None,
    importance: ImportanceWeights | None = None,
) -> PolicyLoss:
    """The PPO-clipped policy loss over completion tokens; see the module docstring for the choices.

    `current`: the trainer's logprobs with gradient (`token_logprobs`); `behaviour`: the published ones;
    `advantages`: one a sample (`group_advantages`), `[batch]`; `mask`: `loss_mask`. With `proximal` (decoupled
    PPO) the clip is centred on it and tokens are weighted by `importance` (default: token level, truncated at 2).
    """
    mask = mask.bool()
    anchor = behaviour if proximal is None else proximal.detach()
    ratio = torch.exp(current - anchor)
    per_sample = advantages[:, None].to(current.dtype)
    high = clip_low if clip_high is None else clip_high
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + high)
    surrogate = torch.minimum(ratio * per_sample, clipped * per_sample)
    weights, kept, capped = torch.ones_like(current), mask, torch.zeros_like(mask)
    if proximal is not None:
        weights, kept, capped = (importance or ImportanceWeights()).weights(proximal - behaviour, mask)
    loss = -(surrogate * weights * kept).sum() / mask.sum().clamp(min=1)
    with torch.no_grad():
        was_clipped = (ratio * per_sample) > (clipped * per_sample)
        return PolicyLoss(
            loss=loss,
            clip_fraction=float(masked_mean(was_clipped.float(), mask)),
            ratio_mean=float(masked_mean(ratio, mask)),
            kl=float(kl_behaviour_current(current.detach(), behaviour, mask)),
            is_weight_mean=float(masked_mean(weights, kept)),
            is_capped_fraction=float(masked_mean(capped.float(), mask)),
        )


def staleness_stats(token_versions: torch.Tensor, mask: torch.Tensor, trainer_version: int) -> dict[str, float]:
    """Staleness (trainer version - the version that produced a token) over the completion tokens."""
    stale = (trainer_version - token_versions)[mask.bool()]
    if stale.numel() == 0:
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    return {"staleness_mean": float(stale.float().mean()), "staleness_max": float(stale.max())}

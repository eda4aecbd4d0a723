"""What the trainer receives: whole groups of rollouts (`Group`), batches of them (`Batch`, `to_arrays`), how stale
their tokens are (`SampleStaleness`), the opt-in parking bound (`ParkingBound`), and the dedupe and assembly of samples
into whole groups that the live client (`producers.client.RolloutClient`) and the offline replay (`producers.replay`)
share (`GroupAssembler`, `whole_batches`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeline.wire import Rollout


@dataclass
class Group:
    """All `n` samples of one prompt, in sample order."""

    prompt_id: str
    rollouts: list[Rollout]
    entry_ids: list[bytes] = field(default_factory=list, repr=False)
    trainer_version: int | None = None
    """The policy version the staleness bound was checked against when handed over (None: no bound)."""

    @property
    def rewards(self) -> list[float | None]:
        """Each sample's `reward` from the scoring stage (None: unscored, or see `reward_error`)."""
        return [r.reward for r in self.rollouts]

    @property
    def reward_error(self) -> str | None:
        """Why the scoring stage gave this group no rewards (its function raised, hung, or kept losing workers)."""
        return next((r.reward_error for r in self.rollouts if r.reward_error), None)

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter its prompt named (None: the base model): its versions are that adapter's."""
        return self.rollouts[0].adapter

    def staleness(self, trainer_version: int) -> int:
        """How many versions its oldest sample's first token is behind `trainer_version` (the base model's, or the
        group's adapter's)."""
        return max(trainer_version - r.version for r in self.rollouts)

    def stale_share(self, trainer_version: int, max_age: int) -> float:
        """The largest share, over its samples, of a sample's tokens more than `max_age` versions behind
        `trainer_version` (0 for a sample with no tokens)."""
        return max(
            (sum(end - start for version, start, end in r.spans if trainer_version - version > max_age) / r.n_tokens)
            if r.n_tokens
            else 0.0
            for r in self.rollouts
        )


@dataclass(frozen=True)
class ParkingBound:
    """Park a group, whole, when one of its samples has more than `max_share` of its tokens more than `max_age` policy
    versions behind the trainer; opt-in (`RolloutClient(park=...)`, or per call). `ParkingBound(k)` parks a group
    with any token older than k versions, i.e. whose oldest sample's first token is: what `max_staleness=k` meant
    before nothing was parked by default. What it parks goes to `{ns}:stale`, counted (`client.stats["stale"]`).

    Raises `ValueError` on a negative age or a share outside [0, 1).
    """

    max_age: int
    max_share: float = 0.0

    def __post_init__(self) -> None:
        if self.max_age < 0:
            raise ValueError(f"a parking bound's max_age must be >= 0 versions, got {self.max_age}")
        if not 0.0 <= self.max_share < 1.0:
            raise ValueError(f"a parking bound's max_share must be in [0, 1), got {self.max_share}")

    def parks(self, group: Group, trainer_version: int) -> bool:
        if self.max_share == 0.0:
            return group.staleness(trainer_version) > self.max_age
        return group.stale_share(trainer_version, self.max_age) > self.max_share


@dataclass(frozen=True)
class SampleStaleness:
    """How many policy versions a sample's tokens are behind the trainer's: its first token's, its last's, and the
    mean over its tokens (from its `spans`)."""

    first: int
    last: int
    mean: float

    @classmethod
    def of(cls, rollout: Rollout, trainer_version: int) -> SampleStaleness:
        spans = rollout.spans or [(rollout.version, 0, rollout.n_tokens)]
        tokens = sum(end - start for _, start, end in spans)
        weighted = sum((trainer_version - version) * (end - start) for version, start, end in spans)
        first = trainer_version - rollout.version
        return cls(first=first, last=trainer_version - rollout.version_end, mean=weighted / tokens if tokens else first)


@dataclass
class Batch:
    groups: list[Group]
    trainer_version: int | None = None
    """The policy version the staleness bound was checked against (None: no bound); staleness = this - version."""

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]

    def staleness(self, trainer_version: int) -> dict[str, float]:
        """Staleness against `trainer_version`, for a step's log: each sample's first, last and mean (over its tokens)
        averaged over the batch's samples, the mean over all its tokens, and the largest of any token."""
        samples = [SampleStaleness.of(r, trainer_version) for r in self.rollouts]
        if not samples:
            return {"first": 0.0, "last": 0.0, "sample_mean": 0.0, "token_mean": 0.0, "max": 0.0}
        tokens = [r.n_tokens for r in self.rollouts]
        return {
            "first": float(np.mean([s.first for s in samples])),
            "last": float(np.mean([s.last for s in samples])),
            "sample_mean": float(np.mean([s.mean for s in samples])),
            "token_mean": float(np.average([s.mean for s in samples], weights=tokens)) if sum(tokens) else 0.0,
            "max": float(max(s.first for s in samples)),
        }

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Right-padded arrays for a trainer (`torch.from_numpy` takes them as they are).

        `input_ids` is prompt + completion; `loss_mask` marks the completion tokens the model wrote (all of
        them, except in a gateway session's trajectory, whose template, tool and user tokens between turns
        are not: the rollout's `mask`); `logprobs` and `token_versions` are aligned with `input_ids` (0 and -1
        on prompt, padding and tokens outside the mask). When a rollout carries routed experts, `routed_experts`
        `[rows, width, layers, top_k]` (int16) holds them aligned with `input_ids` too (-1 where there are none:
        another rollout's, the last token, padding), for `producers.routing.routes_replayed`; `ValueError` if they
        differ in layers or top-k (rollouts of several models).
        """
        rollouts = self.rollouts
        width = max(len(r.prompt_tokens) + len(r.tokens) for r in rollouts)
        shape = (len(rollouts), width)
        arrays: dict[str, np.ndarray] = {
            "input_ids": np.zeros(shape, np.int64),
            "attention_mask": np.zeros(shape, np.int64),
            "loss_mask": np.zeros(shape, np.int64),
            "logprobs": np.zeros(shape, np.float32),
            "token_versions": np.full(shape, -1, np.int64),
        }
        for row, r in enumerate(rollouts):
            p, t = len(r.prompt_tokens), len(r.tokens)
            arrays["input_ids"][row, :p] = r.prompt_tokens
            arrays["input_ids"][row, p : p + t] = r.tokens
            arrays["attention_mask"][row, : p + t] = 1
            written = r.model_token_mask()
            arrays["loss_mask"][row, p : p + t] = written
            arrays["logprobs"][row, p : p + t] = np.where(written, r.logprobs, 0.0)
            for version, start, end in r.spans:
                arrays["token_versions"][row, p + start : p + end] = version
            arrays["token_versions"][row, p : p + t][~written] = -1
        routed = [r.routed_experts for r in rollouts if r.routed_experts is not None]
        if routed:
            kinds = sorted({tuple(r.shape[1:]) for r in routed})
            if len(kinds) > 1:
                raise ValueError(f"the batch's routed experts have several [layers, top_k]: {kinds} (several models?)")
            routes = arrays["routed_experts"] = np.full((*shape, *kinds[0]), -1, np.int16)
            for row, r in enumerate(rollouts):
                if r.routed_experts is not None:
                    routes[row, : len(r.routed_experts)] = r.routed_experts
        return arrays


class GroupAssembler:
    """Dedupe on rollout id and hold samples until their group is whole; the live client and the offline
    replay (`producers.replay`) share it, so that both hand over the same groups."""

    def __init__(self, remember_ids: int = 1_000_000) -> None:
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._remember_ids = remember_ids
        self.open: dict[str, dict[int, tuple[Rollout, bytes]]] = {}
        """Groups still missing samples: prompt id -> sample -> (rollout, entry id)."""

    def seen(self, rollout_id: str) -> bool:
        """Whether this id was added before (one of the last `remember_ids`): a duplicate."""
        return rollout_id in self._seen

    def remember(self, rollout_id: str) -> None:
        """Count this id as seen from now on (one of the last `remember_ids`)."""
        self._seen[rollout_id] = None
        if len(self._seen) > self._remember_ids:
            self._seen.popitem(last=False)

    def add(self, rollout: Rollout, entry_id: bytes = b"") -> Group | None:
        """File a rollout that was not `seen`; returns its group once that is whole."""
        self.remember(rollout.id)
        samples = self.open.setdefault(rollout.prompt_id, {})
        samples[rollout.sample] = (rollout, entry_id)
        if len(samples) < rollout.n:
            return None
        del self.open[rollout.prompt_id]
        ordered = [samples[k] for k in sorted(samples)]
        return Group(rollout.prompt_id, [r for r, _ in ordered], [e for _, e in ordered])


def whole_batches(
    groups: Iterable[Group], groups_per_batch: int, fresh: Callable[[list[Group]], list[Group]] | None = None
) -> Iterator[Batch]:
    """Batches of `groups_per_batch` groups. With `fresh` (the staleness bound), a full batch is checked once,
    and what it drops is made up with the next groups; its groups' `trainer_version` is the batch's."""
    pending: list[Group] = []
    for group in groups:
        pending.append(group)
        if len(pending) < groups_per_batch:
            continue
        if fresh is not None:
            pending = fresh(pending)
            if len(pending) < groups_per_batch:
                continue
        batch, pending = Batch(pending, trainer_version=pending[0].trainer_version), []
        yield batch

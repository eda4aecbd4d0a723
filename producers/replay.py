"""Recorded rollouts in the trainer API's own shapes: debug or re-run a trainer with no worker and no GPU.

`Recording(DIR)` reads the Parquet files that `rollouts record` writes and hands over what
`RolloutClient` hands over: whole groups (`Group`), batches of them (`Batch`, so `to_arrays()` is
the very same), each rollout id once (a recorder killed between writing a file and acking it
records some entries twice), and with `max_staleness` only groups within that many versions of a
trainer version that you give: a number, or a function read once per group or batch (the step of
the run you re-play, say). Over-stale groups are counted in `stats["stale"]` and named in `stale`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from pipeline.recording import read_recording
from pipeline.wire import Rollout
from producers.groups import Batch, Group, GroupAssembler, whole_batches

TrainerVersion = int | Callable[[], int]


class Recording:
    """A recording on disk (a directory of Parquet files, one file, or a list of files), read as a trainer reads.

    Every iteration reads the files again from the start, so a recording can be re-played any number of times.
    """

    def __init__(
        self,
        path: str | Path | Sequence[str | Path],
        *,
        ns: str | None = None,
        max_staleness: int | None = None,
        trainer_version: TrainerVersion | None = None,
    ) -> None:
        """`ns`: only the rollouts recorded from this namespace (a directory may hold several). `max_staleness`
        and `trainer_version`: the default bound of `groups`/`batches`/`collect`, as on `RolloutClient`."""
        self.path = path
        self.ns = ns
        self.max_staleness = max_staleness
        self.trainer_version = trainer_version
        self.stats = {"received": 0, "duplicates": 0, "groups": 0, "stale": 0}
        """Of the last pass: rollouts handed in, duplicates skipped, whole groups, over-stale rollouts left out."""
        self.stale: list[str] = []
        """Prompt ids of the groups the bound left out in the last pass."""
        self.incomplete: dict[str, list[int]] = {}
        """After a pass: prompt id -> the samples recorded of a group that never became whole (a run cut short)."""

    def rollouts(self) -> Iterator[Rollout]:
        """Each recorded rollout once, in recording order, without waiting for groups."""
        seen: set[str] = set()
        for recorded in read_recording(self.path):
            if (self.ns is None or recorded.ns == self.ns) and recorded.rollout.id not in seen:
                seen.add(recorded.rollout.id)
                yield recorded.rollout

    def groups(
        self, max_staleness: int | None = None, trainer_version: TrainerVersion | None = None
    ) -> Iterator[Group]:
        """Each prompt's group once all its samples were read, each sample once; with a bound, fresh groups only
        (the trainer version is read once per group)."""
        fresh = self._freshness(max_staleness, trainer_version)
        for group in self._whole_groups():
            if fresh is None or fresh([group]):
                yield group

    def batches(
        self, groups_per_batch: int, max_staleness: int | None = None, trainer_version: TrainerVersion | None = None
    ) -> Iterator[Batch]:
        """Batches of whole groups, as `RolloutClient.batches` makes them: with a bound, the trainer version is read
        once per full batch and over-stale groups are replaced by the next ones. A last batch short of
        `groups_per_batch` groups is not handed over (a live trainer would wait for more)."""
        if groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be >= 1, got {groups_per_batch}")
        fresh = self._freshness(max_staleness, trainer_version)
        yield from whole_batches(self._whole_groups(), groups_per_batch, fresh)

    def collect(
        self, n_groups: int, max_staleness: int | None = None, trainer_version: TrainerVersion | None = None
    ) -> list[Group]:
        """The first `n_groups` whole groups (fewer if the recording has fewer)."""
        got: list[Group] = []
        if n_groups <= 0:
            return got
        for group in self.groups(max_staleness, trainer_version):
            got.append(group)
            if len(got) == n_groups:
                break
        return got

    def _whole_groups(self) -> Iterator[Group]:
        self.stats = dict.fromkeys(self.stats, 0)
        self.stale = []
        assembler = GroupAssembler(remember_ids=2**62)  # a file is finite: remember every id
        self.incomplete = {}
        for recorded in read_recording(self.path):
            if self.ns is not None and recorded.ns != self.ns:
                continue
            rollout = recorded.rollout
            if assembler.seen(rollout.id):
                self.stats["duplicates"] += 1
                continue
            self.stats["received"] += 1
            group = assembler.add(rollout, recorded.entry_id.encode())
            if group is not None:
                self.stats["groups"] += 1
                yield group
        self.incomplete = {prompt_id: sorted(samples) for prompt_id, samples in assembler.open.items()}

    def _freshness(
        self, max_staleness: int | None, trainer_version: TrainerVersion | None
    ) -> Callable[[list[Group]], list[Group]] | None:
        """The staleness check of one read of the trainer version, or None without a bound."""
        bound = self.max_staleness if max_staleness is None else max_staleness
        version_of = self.trainer_version if trainer_version is None else trainer_version
        if bound is None:
            return None
        if bound < 0:
            raise ValueError(f"max_staleness must be >= 0, got {bound}")
        if version_of is None:
            raise ValueError("a staleness bound needs trainer_version: the policy version to measure staleness from")

        def fresh(groups: list[Group]) -> list[Group]:
            version = version_of() if callable(version_of) else version_of
            kept = []
            for group in groups:
                if group.staleness(version) > bound:
                    self.stats["stale"] += len(group.rollouts)
                    self.stale.append(group.prompt_id)
                else:
                    group.trainer_version = version
                    kept.append(group)
            return kept

        return fresh

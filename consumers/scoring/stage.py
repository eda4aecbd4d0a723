"""The scoring stage: read `{ns}:scoring`, assemble whole groups, score them, forward them to `{ns}:rollouts`.

One process at a time reads (it holds `{ns}:scorer:lease`, a redis-py `Lock` it keeps renewing);
others stand by and take over when the lease runs out. All read as the one consumer `scorer`, so a
successor re-reads what a dead predecessor had taken (its pending entries) and scores those groups
again: a scorer that dies loses nothing. One reader suffices: it only moves entries and waits on
the backend, where the reward functions run (threads, or a pool of RQ workers).

A group is forwarded in one atomic step (`ScoringStreams.forward_scored`: ack what was read, add the
scored rollouts), each rollout with `reward`, or with `reward_error` when the function failed for
the group: the trainer always gets the whole group, never a stuck one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from redis.exceptions import LockError
from redis.lock import Lock

from consumers.scoring.backend import Outcome, ScoringBackend
from consumers.scoring.job import RolloutView, rollout_view
from consumers.scoring.text import Decode
from pipeline.streams import Entry, Streams, trim_consumed
from pipeline.wire import Rollout, WireError

log = logging.getLogger(__name__)


@dataclass
class StageSettings:
    lease_s: float = 5.0
    """A reader that stops renewing its lease for this long is replaced by a standby."""
    block_ms: int = 200
    """How long one read waits for new rollouts (also the pace of polling the backend)."""
    read_count: int = 512
    heartbeat_s: float = 1.0
    trim_every_s: float = 10.0
    remember_ids: int = 100_000
    """Forwarded rollout ids kept, to ack a late duplicate at once instead of opening a group for it."""


@dataclass
class _OpenGroup:
    rollouts: dict[int, Rollout] = field(default_factory=dict)
    entry_ids: list[bytes] = field(default_factory=list)
    submitted: bool = False


class ScoringStage:
    def __init__(
        self,
        streams: Streams,
        backend: ScoringBackend,
        name: str,
        settings: StageSettings | None = None,
        decode: Decode | None = None,
    ) -> None:
        """`decode`: the replies' tokens to text (`consumers.scoring.text.load_decoder`), for reward functions that
        read `text`; without it the views have none."""
        self.streams = streams
        self.backend = backend
        self.decode = decode
        self.name = name
        self.settings = settings or StageSettings()
        self.leading = False
        self._lease = Lock(streams.redis, streams.keys.scorer_lease, timeout=self.settings.lease_s, thread_local=False)
        self._open: dict[str, _OpenGroup] = {}
        self._forwarded: OrderedDict[str, None] = OrderedDict()
        self._last_beat = 0.0
        self._last_trim = time.monotonic()

    def run(self, stop: threading.Event) -> None:
        self.streams.scoring.ensure_scoring_group()
        try:
            while not stop.is_set():
                if not self._lead():
                    self._beat()
                    stop.wait(self.settings.lease_s / 5)
                    continue
                self._step()
        finally:
            self.backend.close()
            if self.leading:
                self._lease.release()
            self.leading = False
            self._beat(force=True)

    def _lead(self) -> bool:
        """Hold the lease: take it when free, renew it when ours; False (and forget all state) when lost."""
        if self.leading:
            try:
                self._lease.reacquire()
                return True
            except LockError:
                log.warning("%s: lost the scorer lease; standing by", self.name)
                self.leading = False
                self._open.clear()
                return False
        if not self._lease.acquire(blocking=False):
            return False
        self.leading = True
        log.info("%s: holds the scorer lease; re-reading what a predecessor left", self.name)
        after = b"0"
        while entries := self.streams.scoring.read_scoring(self.settings.read_count, None, pending_after=after):
            self._file(entries)
            after = entries[-1].id
        return True

    def _step(self) -> None:
        self._file(self.streams.scoring.read_scoring(self.settings.read_count, self.settings.block_ms))
        for outcome in self.backend.poll():
            self._forward(outcome)
        self._beat()
        if time.monotonic() - self._last_trim > self.settings.trim_every_s:
            self._last_trim = time.monotonic()
            trim_consumed(self.streams.redis, self.streams.keys.scoring)

    def _file(self, entries: list[Entry]) -> None:
        for entry in entries:
            try:
                rollout = Rollout.from_fields(entry.fields)
                if not rollout.reward_fn:
                    raise WireError("no reward_fn: nothing to score it with")
            except WireError as exc:
                log.warning("%s: dead letter %s: %s", self.name, entry.id, exc)
                self.streams.dead_letter(entry, str(exc), "score-decode")
                continue
            if rollout.id in self._forwarded:  # a late duplicate of a group already forwarded
                self.streams.scoring.forward_scored([], [entry.id])
                continue
            group = self._open.setdefault(rollout.prompt_id, _OpenGroup())
            group.entry_ids.append(entry.id)  # a duplicate's entry is acked with its group
            group.rollouts.setdefault(rollout.sample, rollout)
            if not group.submitted and len(group.rollouts) == rollout.n:  # whole: score it now, once
                ordered = [group.rollouts[k] for k in sorted(group.rollouts)]
                self.backend.submit(rollout.prompt_id, rollout.reward_fn, [self._view(r) for r in ordered])
                group.submitted = True

    def _view(self, rollout: Rollout) -> RolloutView:
        text = self.decode(rollout.tokens.tolist()) if self.decode is not None else None
        return rollout_view(rollout, text=text)

    def _forward(self, outcome: Outcome) -> None:
        group = self._open.pop(outcome.key, None)
        if group is None:
            return
        ordered = [group.rollouts[k] for k in sorted(group.rollouts)]
        rewards = outcome.rewards if outcome.error is None and outcome.rewards is not None else None
        for i, rollout in enumerate(ordered):
            if rewards is None:
                rollout.reward_error = outcome.error or "the scorer returned no rewards"
            else:
                rollout.reward = rewards[i]
        added = self.streams.scoring.forward_scored(ordered, group.entry_ids)
        for rollout in ordered:
            self._forwarded[rollout.id] = None
        while len(self._forwarded) > self.settings.remember_ids:
            self._forwarded.popitem(last=False)
        counters = {"groups": 1, "rollouts": max(added, 0), "reward_errors": int(rewards is None)}
        pipe = self.streams.redis.pipeline(transaction=False)
        for name, amount in counters.items():
            pipe.hincrby(self.streams.keys.scorer, name, amount)
        pipe.execute()
        if rewards is None:
            log.warning("%s: group %s: reward error: %s", self.name, outcome.key, outcome.error)

    def _beat(self, force: bool = False) -> None:
        """The status hash `{ns}:scorer`: who leads, in which mode, what is open and running; counters beside."""
        now = time.time()
        if not force and now - self._last_beat < self.settings.heartbeat_s:
            return
        self._last_beat = now
        if not self.leading and self.streams.redis.get(self.streams.keys.scorer_lease) is not None:
            return  # the leader writes the status; a standby stays quiet
        status = {
            "leader": self.name if self.leading else "",
            "mode": self.backend.mode,
            "open_groups": len(self._open),
            "ts": round(now, 3),
            **self.backend.stats(),
        }
        self.streams.redis.hset(self.streams.keys.scorer, mapping={k: str(v) for k, v in status.items()})

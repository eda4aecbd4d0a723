"""The two gates that bound staleness: admission of prompts, and parking of over-stale rollouts.

Admission (the producer's gate, as in AReaL): at policy version `v`, the samples in use — submitted
and not parked as stale, i.e. accepted by the trainer or still in flight — must stay within
`(max_staleness + v + 1) * batch_size`. So the producer is held back before a GPU generates
a sample that could only come out too stale to train on. The check, the counter and the XADD of
the prompts run in one Lua script: two producers can never overshoot the capacity together.

Parking (the trainer's gate): a rollout whose staleness (trainer version - `rollout.version`)
exceeds the bound is never handed to the trainer; its whole group goes to `{ns}:stale` with
`staleness` and `trainer_version` added, is counted, and is acked on `{ns}:rollouts`, in one Lua
script, so nothing is lost and nothing is counted twice. Parked samples leave the admission
count (`used = submitted - stale`), as AReaL's rejected rollouts do: otherwise a trainer that
parks rollouts would wait for samples the producer is no longer allowed to submit.

`{ns}:state` fields (plain text): `version` (written by the manager), `submitted` (samples ever
admitted), `stale` (samples ever parked), `max_staleness` and `batch_size` (the limits that the
last limited producer enforced; shown by `rollouts top`). Both gates move prompt and rollout
fields through as opaque bytes; the only field written into a prompt is `submitted_version`.

A LoRA adapter has its own accounting: prompts that name it are admitted against its own state hash
(`{ns}:adapter:NAME:state`: its version, its `submitted` and `stale`), and its rollouts are parked by its own
version, so one tenant's slow trainer holds back only that tenant's producer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from pipeline.lua import register_all
from pipeline.wire import Fields, Keys

SCRIPTS = Path(__file__).with_name("lua")
"""Where `admit.lua` and `park.lua` live."""


SUBMISSION_TTL_S = 3600
"""How long an admitted submission is remembered (`{ns}:admitted:{id}`): a retry within it is a no-op."""


class SubmissionTooLarge(ValueError):
    """One submission asks for more samples than admission can ever let in at once."""


class AdmissionTimeout(TimeoutError):
    """Admission stayed full for the whole timeout: the policy version did not move on."""


@dataclass(frozen=True)
class AdmissionLimits:
    """`max_staleness` (η, in policy versions) and `batch_size` (B, samples per training step)."""

    max_staleness: int
    batch_size: int

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def capacity(self, version: int) -> int:
        """Samples that may be in use (accepted or in flight) at policy `version`: (η + v + 1) * B."""
        return (self.max_staleness + version + 1) * self.batch_size

    @property
    def window(self) -> int:
        """The most samples ever free at once, (η + 1) * B: the trainer cannot run ahead of what it received."""
        return (self.max_staleness + 1) * self.batch_size


@dataclass(frozen=True)
class Usage:
    """What the admission script saw, in samples."""

    admitted: bool
    repeat: bool
    """Admitted before, not now: the same submission (its prompt ids) within `SUBMISSION_TTL_S`; nothing queued."""
    submitted: int
    stale: int
    capacity: int | None
    version: int
    control_id: bytes = b"0-0"
    entry_ids: tuple[bytes, ...] = ()

    @property
    def used(self) -> int:
        """Accepted or in flight: submitted and not parked as stale."""
        return self.submitted - self.stale


class Admission:
    """The producer's gate on one namespace; without `limits` it only counts what it admits."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        limits: AdmissionLimits | None = None,
        min_wait_s: float = 0.05,
        max_wait_s: float = 0.5,
        adapter: str | None = None,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.state = keys.state_of(adapter)
        """Where the counters live: `{ns}:state`, or the adapter's own state hash."""
        self.limits = limits
        self.min_wait_s = min_wait_s
        self.max_wait_s = max_wait_s
        self._admit = register_all(client, SCRIPTS)["admit"]

    def publish_limits(self) -> None:
        """Write the limits into `{ns}:state`, so that `rollouts top` shows the capacity before the first submit."""
        if self.limits is not None:
            self.redis.hset(
                self.state,
                mapping={"max_staleness": self.limits.max_staleness, "batch_size": self.limits.batch_size},
            )

    def count(self, samples: int) -> None:
        """Count samples that entered `{ns}:rollouts` without a prompt (a gateway session's trajectory), so that
        parking them as stale later leaves `used` (submitted - stale) right."""
        self.redis.hincrby(self.state, "submitted", samples)

    def try_admit(self, prompts: Sequence[Fields], samples: int, submission: str | None = None) -> Usage:
        """One attempt: admit and XADD all of `prompts` (`samples` in total), or none of them.

        `submission` names this submission (default: a fresh one); one already admitted within
        `SUBMISSION_TTL_S` is not queued again and its first reply comes back."""
        args: list[bytes | str | int] = [samples]
        args += [self.limits.max_staleness, self.limits.batch_size] if self.limits else ["", ""]
        args.append(len(prompts))
        for fields in prompts:
            args.append(2 * len(fields))
            for name, value in fields.items():
                args.extend((name, value))
        args.append(SUBMISSION_TTL_S)
        marker = self.keys.admitted(submission or uuid.uuid4().hex)
        reply = self._admit(keys=[self.state, self.keys.prompts, self.keys.control, marker], args=args)
        admitted, submitted, stale, capacity, version, control_id, *entry_ids = reply
        return Usage(
            admitted=bool(admitted),
            repeat=int(admitted) == 2,
            submitted=int(submitted),
            stale=int(stale),
            capacity=None if int(capacity) < 0 else int(capacity),
            version=int(version),
            control_id=control_id or b"0-0",
            entry_ids=tuple(entry_ids),
        )

    def admit(self, prompts: Sequence[Fields], samples: int, timeout: float, submission: str | None = None) -> Usage:
        """Admit `prompts`, waiting while the capacity is used up; raises `AdmissionTimeout` after `timeout` s.

        `submission` (see `try_admit`) is the same for every attempt, so that an attempt that ran but whose
        reply was lost (redis-py retries it) is not counted twice.

        A refusal returns the last id on `{ns}:control`; waiting is an XREAD BLOCK after that id, so
        a version change (its `resume` command) wakes us at once, and parked rollouts (which free
        capacity without a command) are seen within `max_wait_s`.
        """
        if self.limits is not None and samples > self.limits.window:
            raise SubmissionTooLarge(self._too_large(samples))
        deadline = time.monotonic() + timeout
        wait_s = self.min_wait_s
        submission = submission or uuid.uuid4().hex
        while True:
            usage = self.try_admit(prompts, samples, submission)
            if usage.admitted:
                return usage
            left = deadline - time.monotonic()
            if left <= 0:
                raise AdmissionTimeout(self._timed_out(usage, samples, timeout))
            block_ms = max(1, int(1000 * min(wait_s, left)))
            self.redis.xread({self.keys.control: usage.control_id}, count=1, block=block_ms)
            wait_s = min(2 * wait_s, self.max_wait_s)

    def usage(self) -> Usage:
        """The counters as they are now (read-only)."""
        version, submitted, stale = self.redis.hmget(self.state, ["version", "submitted", "stale"])
        v = int(version or 0)
        return Usage(
            admitted=True,
            repeat=False,
            submitted=int(submitted or 0),
            stale=int(stale or 0),
            capacity=self.limits.capacity(v) if self.limits else None,
            version=v,
        )

    def _too_large(self, samples: int) -> str:
        assert self.limits is not None
        eta, b = self.limits.max_staleness, self.limits.batch_size
        return (
            f"one submission of {samples} samples can never be admitted: at most (max_staleness + 1) * batch_size"
            f" = ({eta} + 1) * {b} = {self.limits.window} samples are ever free at once. Submit fewer samples"
            " per call, or raise max_staleness or batch_size."
        )

    def _timed_out(self, usage: Usage, samples: int, timeout: float) -> str:
        assert self.limits is not None
        eta, b = self.limits.max_staleness, self.limits.batch_size
        return (
            f"admission full for {timeout:g}s: {usage.used} samples in use (submitted {usage.submitted}"
            f" - stale {usage.stale}) + {samples} asked > capacity {usage.capacity} at policy version"
            f" {usage.version} (capacity = (max_staleness + version + 1) * batch_size = ({eta} + {usage.version}"
            f" + 1) * {b}). The version moves on when the trainer publishes new weights (publish_weights):"
            " train on what arrived and publish, or raise max_staleness (more off-policy samples allowed)."
        )


class StaleRollouts:
    """The trainer's gate: parks over-stale rollouts on `{ns}:stale`, counted, acked, atomically."""

    def __init__(self, client: redis.Redis, keys: Keys, group: str) -> None:
        self.redis = client
        self.keys = keys
        self.group = group
        self._park = register_all(client, SCRIPTS)["park"]

    def trainer_version(self, adapter: str | None = None) -> int:
        """The policy version the trainer is at: `{ns}:state` `version` (0 before the first publish), or the
        adapter's own."""
        return int(self.redis.hget(self.keys.state_of(adapter), "version") or 0)

    def park(self, trainer_version: int, rollouts: Sequence[tuple[bytes, int]], adapter: str | None = None) -> int:
        """Move `(entry id, staleness)` rollouts off `{ns}:rollouts`; returns how many were still pending and moved.
        They are counted as `stale` in the state they were admitted against (the adapter's, for an adapter's)."""
        if not rollouts:
            return 0
        args: list[bytes | str | int] = [self.group, trainer_version]
        for entry_id, staleness in rollouts:
            args.extend((entry_id, staleness))
        keys = [self.keys.rollouts, self.keys.stale, self.keys.state_of(adapter)]
        return int(self._park(keys=keys, args=args))

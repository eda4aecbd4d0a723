"""Score on RQ: one job per group on a queue that a pool of `rollouts score-worker`s (RQ workers) drains.

Jobs go in and out as JSON (`rq.serializers.JSONSerializer`: RQ pickles by default, and nothing of
ours is pickled). The job (`consumers.scoring.job.score_group`) catches the reward function's own
failures, RQ's timeout included, and returns them as a result; so a job that *fails* means its
worker died under it (RQ fails the job when its work-horse dies) and is retried, up to `attempts`
times in all. A job that stays started longer than its timeout plus `grace_s` is taken to be lost
with a worker killed outright (whose RQ registration outlives it for minutes) and is retried too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue, Worker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from consumers.scoring.backend import Outcome
from consumers.scoring.job import RolloutView, score_group

FAILED = {JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED}


@dataclass
class _Tracked:
    job_id: str
    reward_fn: str
    rollouts: list[RolloutView]
    attempt: int
    started_seen: float | None = None
    """When this backend first saw the job started (its own clock: RQ's clock may be another machine's)."""


class RQBackend:
    def __init__(
        self, connection: redis.Redis, queue: str, timeout_s: float, attempts: int, grace_s: float | None = None
    ) -> None:
        self.mode = f"rq:{queue}"
        self.connection = connection
        self.queue = Queue(queue, connection=connection, serializer=JSONSerializer)
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.grace_s = max(5.0, 0.5 * timeout_s) if grace_s is None else grace_s
        self._tracked: dict[str, _Tracked] = {}
        self._retries = 0

    def submit(self, key: str, reward_fn: str, rollouts: list[RolloutView]) -> None:
        self._tracked[key] = _Tracked(self._enqueue(key, reward_fn, rollouts), reward_fn, rollouts, attempt=1)

    def _enqueue(self, key: str, reward_fn: str, rollouts: list[RolloutView]) -> str:
        job = self.queue.enqueue(
            score_group,
            reward_fn,
            rollouts,
            job_timeout=max(1, round(self.timeout_s)),
            result_ttl=600,
            failure_ttl=3600,
            description=f"score group {key} with {reward_fn}",
        )
        return job.id

    def poll(self) -> list[Outcome]:
        if not self._tracked:
            return []
        keys = list(self._tracked)
        jobs = Job.fetch_many([self._tracked[k].job_id for k in keys], self.connection, serializer=JSONSerializer)
        now = time.monotonic()
        done = []
        for key, job in zip(keys, jobs, strict=True):
            tracked = self._tracked[key]
            status = job.get_status(refresh=False) if job is not None else None
            if status == JobStatus.FINISHED:
                result = job.return_value() if job is not None else None
                if isinstance(result, dict):
                    done.append(Outcome(key, rewards=result.get("rewards"), error=result.get("error")))
                else:
                    done.append(Outcome(key, error=f"the scoring job returned {result!r:.60}, not a result"))
            elif status is None or status in FAILED:
                done.extend(self._retry(key, tracked, _why_failed(job)))
            elif status == JobStatus.STARTED:
                tracked.started_seen = tracked.started_seen or now
                if now - tracked.started_seen > self.timeout_s + self.grace_s:
                    if job is not None:
                        job.delete()  # an orphaned work-horse may still finish it: nobody reads that
                    lost = f"no answer {self.timeout_s + self.grace_s:g} s after it started (its worker died?)"
                    done.extend(self._retry(key, tracked, lost))
        for outcome in done:
            self._tracked.pop(outcome.key, None)
        return done

    def _retry(self, key: str, tracked: _Tracked, reason: str) -> list[Outcome]:
        if tracked.attempt >= self.attempts:
            return [Outcome(key, error=f"scoring failed {tracked.attempt} times, last: {reason}")]
        self._retries += 1
        tracked.attempt += 1
        tracked.started_seen = None
        tracked.job_id = self._enqueue(key, tracked.reward_fn, tracked.rollouts)
        return []

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self._tracked),
            "retries": self._retries,
            "queued": self.queue.count,
            "rq_workers": Worker.count(connection=self.connection, queue=self.queue),
        }

    def close(self) -> None:
        """Jobs still out are left to finish; a successor stage re-reads their groups and scores them again."""


def _why_failed(job: Job | None) -> str:
    if job is None:
        return "the job is gone from RQ (deleted or expired)"
    result = job.latest_result()
    text = (result.exc_string if result is not None else None) or job.get_status(refresh=False)
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "failed"

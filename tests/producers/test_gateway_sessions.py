"""Sessions and placement on a real Redis, without HTTP: pins, idle release, groups, the trajectory's contract."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from pipeline.streams import Streams
from pipeline.wire import Rollout
from producers.client import RolloutClient
from producers.gateway.openai_api import FinishRequest, OpenAIError
from producers.gateway.placement import candidates, place
from producers.gateway.sessions import SessionStore, Trajectory
from tests.fixtures import wait_until


def reply(tokens: list[int], version: int = 0) -> Rollout:
    return Rollout(
        prompt_id="turn",
        sample=0,
        n=1,
        version=version,
        version_end=version,
        finish_reason="stop",
        worker="w1",
        prompt_tokens=[1],
        tokens=tokens,
        logprobs=[-0.5] * len(tokens),
        spans=[(version, 0, len(tokens))] if tokens else [],
    )


def store(client: redis.Redis, ns: str, ttl_s: float = 60.0) -> SessionStore:
    streams = Streams(client, ns)
    streams.ensure_groups()
    return SessionStore(streams, idle_ttl_s=ttl_s, busy_timeout_s=30.0)


def test_sticky_placement_spreads_new_sessions_and_keeps_old_ones(real_redis: redis.Redis, ns: str) -> None:
    sessions = store(real_redis, ns)
    live = {"w1": 5, "w2": 0, "w3": 0}
    first = [place("sticky", sessions, f"s{k}", live) for k in range(6)]
    assert sorted(first) == ["w1", "w1", "w2", "w2", "w3", "w3"]  # fewest pins first, then fewest in flight
    assert first[0] == "w2", "a tie on pins goes to the worker with fewer samples in flight"
    assert [place("sticky", sessions, f"s{k}", {"w1": 0, "w2": 9, "w3": 9}) for k in range(6)] == first
    moved = place("sticky", sessions, "s0", {"w1": 0, "w3": 0})  # s0's worker w2 is gone
    assert moved in ("w1", "w3") and moved != first[0]
    assert place("hash", sessions, "h", live) == place("hash", sessions, "h", live)


def test_candidates_are_live_serving_workers() -> None:
    beats = {
        "a": {"status": "serving", "inflight": "3"},
        "b": {"status": "paused", "inflight": "x"},
        "c": {"status": "awaiting weights", "inflight": "0"},
        "d": {"status": "stopping"},
        "e": {"status": "idle", "inflight": "0"},  # --lazy: the first turn sent to it starts its engine
        "f": {"status": "released", "inflight": "0"},
    }
    assert candidates(beats) == {"a": 3, "b": 0, "e": 0, "f": 0}


def test_an_idle_session_is_released_by_its_ttl(real_redis: redis.Redis, ns: str) -> None:
    sessions = store(real_redis, ns, ttl_s=1.0)
    session = sessions.begin("idle", "call-1")
    session.worker = sessions.pin("idle", {"w1": 0})
    session.trajectory = Trajectory(prompt_tokens=np.array([1, 2], np.int32))
    session.trajectory.add_turn([], reply([5, 6]))
    session.turns = 1
    sessions.commit(session, "call-1")
    keys = sessions.keys
    assert real_redis.zcount(keys.pins("w1"), time.time(), "+inf") == 1
    wait_until(lambda: not real_redis.exists(keys.session("idle")), 10, "the session to expire")
    assert real_redis.zcount(keys.pins("w1"), time.time(), "+inf") == 0, "an expired session still counts as load"
    assert sessions.begin("idle", "call-2").turns == 0  # the id starts afresh
    with pytest.raises(OpenAIError) as caught:
        sessions.finish("gone", FinishRequest(), version=0)
    assert caught.value.status == 404


def test_one_turn_at_a_time_and_groups_fill_once(real_redis: redis.Redis, ns: str) -> None:
    sessions = store(real_redis, ns)
    for k in range(3):
        session = sessions.begin(f"g{k}", "call")
        with pytest.raises(OpenAIError) as busy:
            sessions.begin(f"g{k}", "other")
        assert busy.value.code == "session_busy"
        session.trajectory = Trajectory(prompt_tokens=np.array([1], np.int32))
        session.trajectory.add_turn([], reply([7, 8], version=k))
        session.trajectory.add_turn([3, 4, 5], reply([9], version=k + 1))
        session.turns, session.workers = 2, ["w1", "w1"]
        sessions.commit(session, "call")
    asked = FinishRequest(reward=1.0, group="task", group_size=2)
    a = sessions.finish("g0", asked, version=2)
    assert sessions.finish("g0", asked, version=2).sample == a.sample == 0  # retried: same place, nothing added
    with pytest.raises(OpenAIError) as other_size:
        sessions.finish("g1", FinishRequest(group="task", group_size=3), version=2)
    assert other_size.value.code == "group_conflict"
    assert sessions.finish("g1", asked, version=2).sample == 1
    with pytest.raises(OpenAIError) as full:
        sessions.finish("g2", asked, version=2)
    assert full.value.code == "group_conflict" and "2 sessions" in full.value.message
    [group] = RolloutClient(real_redis, ns).collect(1, timeout=10)
    first = group.rollouts[0]
    assert first.tokens.tolist() == [7, 8, 3, 4, 5, 9] and first.mask == [(0, 2), (5, 6)]
    assert first.spans == [(0, 0, 5), (1, 5, 6)], "tokens between replies carry the version before them"
    assert first.logprobs.tolist() == [-0.5, -0.5, 0, 0, 0, -0.5]
    assert real_redis.hget(sessions.keys.state, "submitted") == b"2"  # counted for admission's books

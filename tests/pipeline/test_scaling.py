"""`rollouts_workers_needed`: what an autoscaler sizes the fleet by, from what Redis holds (`pipeline.scaling`). Real
workers (synthetic engines, each taking at most 2 prompts) under a backlog, read as the exporter reads them."""

from __future__ import annotations

from pipeline.exporter import families
from pipeline.local import RedisServer
from pipeline.scaling import Need, need
from pipeline.top import snapshot
from producers.client import RolloutClient
from tests.fixtures import StartWorker, wait_until

SLOW = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 20}', "--max-inflight", "2")


def test_a_backlog_asks_for_the_workers_that_would_hold_it_and_a_drained_queue_for_none(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    client = RolloutClient(redis_server.url, ns)
    workers("w1", *SLOW)
    workers("w2", *SLOW)
    ids = [client.submit(tokens=[4, 5, k], n=1, max_tokens=40, seed=k) for k in range(20)]

    seen: list[Need] = []

    def holding() -> bool:
        fleet = need(snapshot(client.streams))
        seen[:] = [fleet] if fleet is not None else []
        return fleet is not None and fleet.held == 4 and fleet.waiting == 16

    wait_until(holding, 60, "both workers holding 2 entries, 16 waiting")
    [fleet] = seen
    assert fleet.workers == 2 and fleet.per_worker == 2.0
    assert fleet.needed == 10  # 20 entries, 2 a worker
    exported = {m.name: m.samples[0].value for m in families(snapshot(client.streams))}
    assert exported["rollouts_workers_needed"] >= 1 and "rollouts_entries_waiting" in exported
    assert sorted(g.prompt_id for g in client.collect(len(ids), timeout=120)) == sorted(ids)
    wait_until(lambda: (n := need(snapshot(client.streams))) is not None and n.needed == 0, 30, "nothing left")


def test_work_with_no_live_worker_asks_for_one_and_none_asks_for_none() -> None:
    assert Need(waiting=3, held=0, per_worker=None, workers=0).needed == 1
    assert Need(waiting=0, held=0, per_worker=None, workers=0).needed == 0
    assert Need(waiting=5, held=3, per_worker=4.0, workers=2).needed == 2

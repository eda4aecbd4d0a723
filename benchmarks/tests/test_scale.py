"""`rollouts scale`, short, as a person runs it: 50 real workers in two processes on its own Redis, one JSON report.

The long run (100, 300 and 1,000 workers) is for the README; this one checks, in well under a minute, that the
fleet really comes up and works at the rate asked, that weight syncs go through all of it, and that the report
carries every number the README quotes (latencies, stall, Redis CPU, memory, clients) and the PNG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis

from benchmarks.cpu import pin
from benchmarks.scale import Cores, command_name, fleet_procs, script_names, slow_pings, split_cores

WORKERS = 50


def test_fifty_workers_publish_at_the_rate_asked_and_take_every_sync(tmp_path: Path) -> None:
    plot = tmp_path / "scale.png"
    args = ["--workers", str(WORKERS), "--rate", "2", "--procs", "1", "--warmup-s", "2", "--measure-s", "8"]
    args += ["--sync-every-s", "2.5", "--lengths", "uniform:900-1024", "--plot", str(plot)]
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "scale", *args], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    (row,) = report["sizes"]

    assert row["workers"] == WORKERS and row["asked_rollouts_per_s"] == 100 and row["procs"] == 1
    assert report["load"]["pause_mode"] == "abort" and report["load"]["engine_args"]["lengths"] == "uniform:900-1024"
    assert row["redis_clients"] > WORKERS, "each worker has connections of its own"
    assert 0.5 * row["asked_rollouts_per_s"] < row["rollouts_per_s"] < 1.5 * row["asked_rollouts_per_s"]
    assert row["delivery"] == {"duplicates": 0, "dead": 0, "malformed_groups": 0}
    # One publish per prompt (its n samples together), from every process, the probe's among them. (Until workers
    # continued interrupted samples in place, each abort sync added a publish of partials per prompt in flight.)
    prompts = row["rollouts_per_s"] * row["measured_s"] / report["load"]["n"]
    assert row["publish_ms_client"]["count"] > 0.5 * prompts
    assert row["publish_ms_probe"]["count"] >= 1
    # The pinger publishes beside the fleet every 20 ms: enough publishes for a p99 that is not one publish.
    assert row["publish_ms_ping"]["count"] > 100 and 0 < row["publish_ms_ping"]["p50"] <= row["publish_ms_ping"]["p99"]
    # ... in a process of its own, its publishes told apart by whether a weight sync was under way.
    during, between = row["publish_ms_ping_during_syncs"], row["publish_ms_ping_between_syncs"]
    assert during["count"] > 0 and between["count"] > 0
    assert during["count"] + between["count"] == row["publish_ms_ping"]["count"]
    # The slow ones, slowest first, each placed in the course of the sync it followed (None: before any sync).
    slow = row["slow_pings"]
    assert all(ms > 5 and (since is None or since >= 0) for ms, since in slow) and len(slow) <= 40
    assert [ms for ms, _ in slow] == sorted((ms for ms, _ in slow), reverse=True)
    assert row["redis_slow_commands"]["over_us"] == 2000
    assert all(isinstance(name, str) and us > 2000 for name, us in row["redis_slow_commands"]["slowest"])
    assert 0 < row["publish_ms_client"]["p50"] <= row["publish_ms_client"]["p99"]
    # Redis gets a core of its own (the default --redis-cores 1) only where 2 are left for the rest; the JSON says.
    cores = split_cores(os.sched_getaffinity(0), 1)
    assert report["cores"] == (cores and {name: sorted(cpus) for name, cpus in cores._asdict().items()})
    assert report["redis"].startswith("redis-server 7") and row["publish_ms_server"]["p99"] > 0
    # Every sync reached all 50 workers: none evicted, none failed.
    assert row["sync_stall_s"]["count"] >= 2 and row["syncs_evicted"] == 0 and row["sync_failure"] is None
    assert 0 < row["sync_stall_s"]["p50"] < 5
    assert 0 < row["redis_cpu_cores"]["median"] < 1 and row["redis_used_memory_mb"] > 0
    assert row["fleet_cpu_cores"] > 0
    # Where Redis's time went: the publish script (by its SHA) among the costliest commands, each with its rate.
    top = {c["command"]: c for c in row["redis_top_commands"]}
    assert "evalsha" in top and top["evalsha"]["calls_per_s"] > 0 and top["evalsha"]["usec_per_call"] > 0
    # ... and while the syncs were under way, so that a sync's cost to Redis is told apart from the rest. Workers
    # continue their interrupted samples in place: an abort sync no longer adds a publish script a worker (50 here),
    # only the fleet's ordinary publishes over the sync's window (its publish to its resume rung to every worker),
    # the ack each worker sends (a heartbeat, which moves its deadline: `lua/beat.lua`) and the take each worker asks
    # for as it resumes (`lua/share.lua`, a count): two scripts a worker at most.
    during_syncs = row["redis_during_syncs"]
    assert during_syncs["syncs"] == row["sync_stall_s"]["count"] and during_syncs["cpu_cores"] > 0
    assert during_syncs["seconds_per_sync"] > 0
    assert all(c["calls_per_sync"] > 0 and c["usec_per_call"] > 0 for c in during_syncs["commands"])
    scripts = {c["command"]: c for c in during_syncs["commands"]}.get("evalsha", {"calls_per_sync": 0})
    ordinary = top["evalsha"]["calls_per_s"] * during_syncs["seconds_per_sync"]
    assert scripts["calls_per_sync"] - ordinary < 2 * WORKERS, (scripts, ordinary)
    assert plot.stat().st_size > 10_000


def test_bad_lengths_and_pause_modes_say_what_to_fix() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "scale", "--lengths", "uniform:9-3"], capture_output=True, text=True
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    assert "--lengths" in output and "uniform:LOW-HIGH (1 <= LOW <= HIGH)" in output, output
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "scale", "--pause-mode", "hold"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--pause-mode must be abort or keep, not 'hold'" in result.stderr, result.stderr


def test_slow_commands_name_each_script_by_its_file() -> None:
    """`redis_slow_commands` names a slow `EVALSHA` by the script it ran (`evalsha:publish`), or a SHA prefix."""
    scripts = script_names(redis.Redis())  # no round trip: redis-py computes each SHA-1 itself
    publish = next(sha for sha, name in scripts.items() if name == "publish")
    assert command_name(f"EVALSHA {publish} 3 a b c".encode(), scripts) == "evalsha:publish"
    assert {"publish", "claim", "admit", "begin_sync", "finish_sync"} <= set(scripts.values())
    assert command_name(b"EVALSHA 0123456789abcdef 0", scripts) == "evalsha:01234567"
    assert command_name("XTRIM k MINID ~ 1-0 LIMIT 500", scripts) == "xtrim"


def test_a_fleet_is_spread_at_about_sixteen_workers_a_process_unless_told() -> None:
    """With ~67 workers a process the fleet's own queueing made the tail at 1,000 workers; by default a size gets about
    16 a process, at most 4 processes a core, and never more processes than workers."""
    assert fleet_procs(1000, 0, cores=16) == 63
    assert fleet_procs(1000, 0, cores=2) == 8
    assert fleet_procs(100, 0, cores=16) == 7
    assert fleet_procs(3, 0, cores=16) == 1
    assert fleet_procs(1000, 15, cores=2) == 15  # asked for: as asked
    assert fleet_procs(3, 15, cores=16) == 3


def test_redis_and_the_measuring_processes_get_cores_of_their_own_only_where_two_are_left() -> None:
    assert split_cores(set(range(16)), 1) == Cores(redis={15}, measure={14}, rest=set(range(14)))
    assert split_cores({0, 1, 2, 3, 4}, 2) == Cores(redis={3, 4}, measure={2}, rest={0, 1})
    assert split_cores({0, 1, 2}, 1) is None, "fewer than 2 cores would be left for the fleet"
    assert split_cores({0, 1}, 1) is None, "a 2-core machine shares its cores, as before"
    assert split_cores(set(range(16)), 0) is None


def test_pin_moves_every_thread_of_a_process() -> None:
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); print(1, flush=True)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"1\n"  # its second thread is running
        tids = [int(t) for t in os.listdir(f"/proc/{process.pid}/task")]
        assert len(tids) == 2
        pin(process.pid, {0})
        assert [os.sched_getaffinity(tid) for tid in tids] == [{0}, {0}]
    finally:
        process.kill()
        process.wait()


def test_a_slow_ping_is_listed_only_if_it_is_slower_than_the_bound_as_printed() -> None:
    """A publish of 5.004 ms printed as 5.0 is not slower than 5 ms: the report never lists a ping at the bound."""
    timed = [(10.0, 5.004), (10.5, 5.006), (11.0, 7.5), (9.0, 6.0), (12.0, 1.0)]
    assert slow_pings(timed, syncs=[(10.2, 10.4)]) == [[7.5, 800.0], [6.0, None], [5.01, 300.0]]

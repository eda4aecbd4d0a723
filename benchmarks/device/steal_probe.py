"""Sample, every 20 ms for DURATION seconds, each CPU's steal time (the hypervisor ran something else on it) and
redis-server's run-queue wait (/proc/PID/schedstat: runnable but not running), to tell a Redis held off its CPU by
the host from one held off by this machine's own processes. Prints one JSON line.
    python benchmarks/device/steal_probe.py 40 > steal.json
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def steal() -> dict[str, int]:
    with open("/proc/stat") as f:
        return {p[0]: int(p[8]) for p in (line.split() for line in f) if p[0].startswith("cpu") and p[0] != "cpu"}


def wait_ns(pid: int) -> int:
    """Nanoseconds `pid` has spent runnable but not running (the second of /proc/PID/schedstat's three numbers)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[1])


def tasks() -> list[tuple[str, str]]:
    """Every thread on the machine as (its /proc/PID/task/TID path, its name)."""
    found: list[tuple[str, str]] = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for t in os.listdir(f"/proc/{d}/task"):
                path = f"/proc/{d}/task/{t}"
                with open(f"{path}/comm") as f:
                    found.append((path, f.read().strip()))
        except OSError:
            pass
    return found


def allowed_on(path: str, cpu: int) -> bool:
    with open(f"{path}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return any(_in(part, cpu) for part in line.split(":")[1].strip().split(","))
    return False


def _in(part: str, cpu: int) -> bool:
    lo, _, hi = part.partition("-")
    return int(lo) <= cpu <= int(hi or lo)


def scan(cpu: int) -> tuple[list[int], list[tuple[str, str]]]:
    """One pass over every thread: Redis's processes (a main thread named redis-server*, which a wrapper's
    `redis-server.bin` is too), and, for `cpu` >= 0, the other threads that may run on `cpu`."""
    redis: list[int] = []
    others: list[tuple[str, str]] = []
    for path, comm in tasks():
        _, _, pid, _, tid = path.split("/")
        if comm.startswith("redis-server"):
            if pid == tid:
                redis.append(int(pid))
            continue
        try:
            if cpu >= 0 and allowed_on(path, cpu):
                others.append((path, comm))
        except OSError:
            pass
    return redis, others


def running_there(cands: list[tuple[str, str]], cpu: int, seen: dict[str, int]) -> None:
    """Count each candidate found runnable on `cpu` now (stat field 3 is the state, field 39 the last CPU)."""
    for path, comm in cands:
        try:
            with open(f"{path}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "R" and int(fields[36]) == cpu:
            name = re.sub(r"[0-9]+", "N", comm)
            seen[name] = seen.get(name, 0) + 1


def main(duration: float) -> None:
    end = time.monotonic() + duration
    last_steal = steal()
    total = dict.fromkeys(last_steal, 0)
    worst = dict.fromkeys(last_steal, 0)
    waits: dict[int, list[int]] = {}
    last_wait: dict[int, int] = {}
    cpu = int(os.environ.get("REDIS_CPU", "-1"))
    seen: dict[str, int] = {}
    redis: list[int] = []
    cands: list[tuple[str, str]] = []
    rescan = 0.0
    while time.monotonic() < end:
        time.sleep(0.02)
        if time.monotonic() > rescan:  # every 2 s, not every sample: a pass reads every thread's files
            (redis, cands), rescan = scan(cpu), time.monotonic() + 2
        if cpu >= 0:
            running_there(cands, cpu, seen)
        now = steal()
        for name, v in now.items():
            d = v - last_steal[name]
            total[name] += d
            worst[name] = max(worst[name], d)
        last_steal = now
        for pid in redis:
            try:
                wait = wait_ns(pid)
            except OSError:
                continue
            if pid in last_wait:
                waits.setdefault(pid, []).append(wait - last_wait[pid])
            last_wait[pid] = wait
    report = {
        "steal_ms_per_cpu": {c: round(v * TICK_MS) for c, v in total.items()},
        "worst_20ms_steal_ms_per_cpu": {c: round(v * TICK_MS) for c, v in worst.items()},
        "runnable_on_redis_cpu": dict(sorted(seen.items(), key=lambda kv: -kv[1])[:15]),
        "neighbours_allowed": len(cands),
        "redis_runqueue_wait": {
            str(pid): {
                "total_ms": round(sum(w) / 1e6, 1),
                "worst_20ms_ms": round(max(w) / 1e6, 2),
                "intervals_over_1ms": sum(x > 1e6 for x in w),
            }
            for pid, w in waits.items()
            if w
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(float(sys.argv[1]))

"""Processes and their CPUs, from Linux's `/proc`: where a benchmark's time went on a machine with no core to spare,
which cores a process may run on, and at what priority.

A ratio of wall-clock times cannot tell a slower engine from a busier machine; the CPU each process used in the
same window can. Processes that are gone read 0.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str, tid: int | None = None) -> float:
    """utime + stime of a process (Linux `/proc/PID/stat`), or of one of its threads (`/proc/PID/task/TID/stat`),
    0 once it is gone. `pid` may be `"self"`."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path, encoding="ascii") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def descendants(root: int) -> set[int]:
    """The PIDs of `root`'s children, their children, and so on (one pass over `/proc`)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                    ppid = int(stat.read().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone since the listing
            children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto `cpus` (`sched_setaffinity` moves one thread; threads and processes started
    later inherit their parent's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


def lower_priority(pid: int, nice: int = 19) -> None:
    """Every thread of a process at `nice` (`setpriority` on a thread id sets that thread's; threads started later
    inherit their creator's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # a thread that just ended
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def command_line(pid: int) -> list[str]:
    """A process's arguments as it shows them (`/proc/PID/cmdline`: a title it set itself, e.g. vLLM's
    `VLLM::EngineCore`, in place of its argv); [] once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return [part.decode(errors="replace") for part in cmdline.read().split(b"\0") if part]
    except (FileNotFoundError, ProcessLookupError):
        return []


class CpuRoles:
    """CPU-seconds per role, each role a set of processes: `read()` twice around a window, `spent` the difference."""

    def __init__(self, roles: Mapping[str, Iterable[int]]) -> None:
        self.roles = {name: sorted(pids) for name, pids in roles.items()}

    def read(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in self.roles.items()}

    @staticmethod
    def spent(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
        return {name: after[name] - before[name] for name in before}

"""Child processes that must not outlive their worker.

vLLM 0.32 starts `EngineCore` (and its `Worker`s) as child processes that do not watch their parent:
when a worker is killed with SIGKILL, they keep running, and polling, for ever. `reap_on_death()`
starts one small watchdog process per engine. While the worker lives, the watchdog notes its
descendants every half second; once the worker is gone, it kills the ones it noted.
"""

from __future__ import annotations

import os
import subprocess
import sys

_WATCHDOG = r"""
import os, signal, sys, time

def descendants(root):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child != os.getpid():
                found.add(child)
                todo.append(child)
    return found

worker = int(sys.argv[1])
noted = set()
while os.getppid() == worker:
    noted = descendants(worker)
    time.sleep(0.5)
for pid in noted:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


def reap_on_death() -> subprocess.Popen[bytes] | None:
    """Start a watchdog for this process: its descendants die with it, even after a SIGKILL (Linux only).

    Stop the watchdog (`kill()`) once those descendants were shut down cleanly.
    """
    if not os.path.isdir("/proc"):
        return None
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

"""Child processes that must not outlive their worker.

vLLM 0.32 starts `EngineCore` (and its `Worker`s) as child processes that do not watch their parent:
when a worker is killed with SIGKILL, they keep running, and polling, for ever. `reap_on_death()`
starts one small watchdog process per engine (`python -m consumers.orphans PID`, nothing heavy imported).
While the worker lives, the watchdog notes its descendants every half second; once the worker is gone, or
when the watchdog gets SIGTERM (`reap_now`), it kills the ones it noted that are still alive. A process
noted once stays noted while it lives, even after its parent died: vLLM's `Worker` outlives an
`EngineCore` killed at the end of its shutdown grace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from types import FrameType


def reap_on_death() -> subprocess.Popen[bytes] | None:
    """Start a watchdog for this process: its descendants die with it, even after a SIGKILL (Linux only).

    Once those descendants were asked to stop, `reap_now` the watchdog: it kills those still there and exits.
    """
    if not os.path.isdir("/proc"):
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "consumers.orphans", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def reap_now(watchdog: subprocess.Popen[bytes]) -> None:
    """Have the watchdog kill the descendants it noted that are still alive, and wait for it to exit."""
    watchdog.terminate()
    watchdog.wait()


def watch(worker: int) -> None:
    """The watchdog's loop: note `worker`'s descendants until it is gone or SIGTERM comes, then kill them."""
    noted: set[int] = set()

    def reap(signum: int | None = None, frame: FrameType | None = None) -> None:
        for pid in noted:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, reap)
    while os.getppid() == worker:
        noted = {pid for pid in noted if _alive(pid)} | descendants(worker)
        time.sleep(0.5)
    reap()


def descendants(root: int) -> set[int]:
    """The processes below `root`, from /proc (this watchdog excepted)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child != os.getpid():
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet waited for
    except (OSError, IndexError):
        return False


if __name__ == "__main__":
    watch(int(sys.argv[1]))

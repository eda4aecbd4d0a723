"""`pipeline.fast_exit.leave`: a process ends with its code, its output and exit handlers kept, its threads awaited."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(body: str) -> subprocess.CompletedProcess[str]:
    script = "import atexit, sys, threading, time\nfrom pipeline.fast_exit import leave\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_leave_keeps_the_exit_code_the_output_and_the_exit_handlers() -> None:
    result = run(
        """
        atexit.register(lambda: print("handler ran"))
        sys.stdout.write("unflushed line")
        sys.stderr.write("unflushed error")
        leave(3)
        """
    )
    assert result.returncode == 3
    assert result.stdout == "unflushed linehandler ran\n" and result.stderr == "unflushed error"


def test_leave_waits_for_a_non_daemon_thread_as_the_ordinary_exit_does() -> None:
    result = run(
        """
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished"))).start()
        leave(4)
        """
    )
    assert (result.returncode, result.stdout) == (4, "thread finished\n")

"""How a process of ours ends once its work is done: `leave`, without the interpreter's teardown."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """End this process with `code` now that its work is done, without the interpreter's teardown.

    Why: with torch loaded, and vLLM most of all, CPython's final garbage collections walk millions of objects only
    to free memory the OS takes back anyway: seconds of a process that imported vLLM. When its
    command returns, a process has done what it owes the world (its engine shut down, rollouts published and acked,
    its heartbeat gone); the exit handlers still run (logging's flush, multiprocessing's, `weakref.finalize`'s) and
    stdout and stderr are flushed. With the teardown skipped, native modules also stop reporting objects they could
    not free (triton's nanobind prints "leaked N instances!"). A process that left a non-daemon thread running gets
    the ordinary exit, which waits for that thread.
    """
    main = threading.main_thread()
    if any(not t.daemon and t is not main for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # the handlers Python runs at exit, before its teardown
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)

"""`rollouts ARGS` run in the test process, by the typer app, as `python -m rollouts` runs it (`rollouts_here`), and
how a command ended (`Ran`), whether it ran here or as a process of its own: a process a run costs ~0.6 s of imports.
Where the process is the point (a package not installed, a signal, what a user's shell sees), tests run one."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import dataclass

from typer.testing import CliRunner

from rollouts import app


@dataclass(frozen=True)
class Ran:
    """How a command ended: its exit code, stdout, stderr (run here, with the log records a process would have
    printed there), and whether it ended cleanly (by `SystemExit` or returning, no traceback printed)."""

    code: int
    stdout: str
    stderr: str
    clean: bool

    @classmethod
    def of(cls, done: subprocess.CompletedProcess[str]) -> Ran:
        """A process's end: clean when it printed no traceback."""
        return cls(done.returncode, done.stdout, done.stderr, "Traceback" not in done.stderr + done.stdout)

    def __str__(self) -> str:
        return f"exit {self.code}{'' if self.clean else ' (uncaught)'}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


def without_our_env(extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str | None]:
    """The environment changes of a run: no `ROLLOUTS_*` from outside (no --redis or --ns), then `extra`."""
    return {**{k: None for k in os.environ if k.startswith("ROLLOUTS_")}, **dict(extra)}


class Printed(logging.Handler):
    """The log records a command's process would print on stderr (at its default level, info), one line each."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        if record.exc_info:
            self.lines.append("Traceback")


def rollouts_here(*args: str, env: tuple[tuple[str, str], ...] = ()) -> Ran:
    """`rollouts ARGS` run in this process by the typer app, as `python -m rollouts` runs it, without `ROLLOUTS_*`
    from outside and with `env`: its stderr with the log records a process would have printed there; the signal
    handlers and the root logger left as they were."""
    root, printed = logging.getLogger(), Printed()
    handlers, level = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}, root.level
    root.addHandler(printed)
    root.setLevel(min(level or logging.WARNING, logging.INFO))
    try:
        result = CliRunner().invoke(app, list(args), env=without_our_env(env))
    finally:
        root.removeHandler(printed)
        root.setLevel(level)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    stderr = result.stderr + "".join(f"{line}\n" for line in printed.lines)
    clean = result.exception is None or isinstance(result.exception, SystemExit)
    return Ran(result.exit_code, result.stdout, stderr, clean and "Traceback" not in stderr + result.stdout)

"""The lab's commands refuse a bad engine flag as the product's do: one line on stderr that says what to fix, exit 2,
before any worker, model or server is started (they build their own model, so only the flags are checked).

Each case runs in this process, through the lab's typer app as its command line runs it (`lab_here`): a process a case
cost ~2-3 s of imports. The command line itself, a process of its own, is checked once here and once a command where
its tests check its own flags (test_bench_rl.py, test_bench_lora.py)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

CASES = [
    (("bench", "--engine", "nope"), "unknown engine 'nope'; choose one of torch"),
    (("bench", "--dtype", "fp8"), "unknown --dtype 'fp8'"),
    (("bench-sync", "--engine", "nope"), "unknown engine 'nope'"),
    (("bench-sync", "--dtype", "fp8"), "unknown --dtype 'fp8'"),
    (("bench-sync", "--deltas"), "--deltas measures real training steps of a real model: give --model"),
    (("bench-rl", "--engine", "nope"), "--engine must be torch or vllm, not 'nope'"),
    (("bench-lora", "--engine", "nope"), "--engine must be torch or vllm, not 'nope'"),
    (("bench-gateway", "--engine", "nope"), "unknown engine 'nope'"),
]


def lab_here(*args: str) -> Any:
    """`python -m benchmarks ARGS` run in this process by the lab's typer app, as its command line runs it (typer's
    `Result`: the exit code, stdout, stderr and the exception it ended with)."""
    from typer.testing import CliRunner

    from benchmarks.cli import lab

    return CliRunner().invoke(lab, list(args))


def assert_refused_in_one_line(result: Any, says: str, code: int | None = None) -> None:
    """A refusal: a non-zero exit (`code`, if given) by `SystemExit` (a clean exit, not an uncaught error with its
    traceback), nothing on stdout and one line on stderr, `error: ...`, that says `says`."""
    report = f"exit {result.exit_code} ({result.exception!r})\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), report
    assert code is None or result.exit_code == code, report
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0] and result.stdout == "", report


def assert_the_command_line_refuses(args: list[str], says: str) -> None:
    """`python -m benchmarks ARGS`, a process of its own: exit 2, one line on stderr that says `says`, no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    report = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, report
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], report
    assert result.returncode == 2 and result.stdout == "", report


@pytest.mark.parametrize(("args", "says"), CASES, ids=[" ".join(args) for args, _ in CASES])
def test_a_lab_command_given_a_bad_engine_flag_says_so_in_one_line_and_exits_2(
    args: tuple[str, ...], says: str
) -> None:
    assert_refused_in_one_line(lab_here(*args), says, code=2)


def test_on_the_command_line_a_bad_engine_flag_is_one_line_and_exit_2() -> None:
    assert_the_command_line_refuses(list(CASES[0][0]), CASES[0][1])

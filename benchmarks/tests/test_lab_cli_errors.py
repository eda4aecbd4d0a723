"""The lab's commands refuse a bad engine flag as the product's do: one line on stderr that says what to fix, exit 2,
before any worker, model or server is started (they build their own model, so only the flags are checked)."""

from __future__ import annotations

import subprocess
import sys

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


@pytest.mark.parametrize(("args", "says"), CASES, ids=[" ".join(args) for args, _ in CASES])
def test_a_lab_command_given_a_bad_engine_flag_says_so_in_one_line_and_exits_2(
    args: tuple[str, ...], says: str
) -> None:
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
    assert result.returncode == 2, report

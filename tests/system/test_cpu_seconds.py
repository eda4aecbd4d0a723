"""Each test's CPU seconds (`tests/cpu_seconds.py`): a real xdist run of stand-in tests, one of which starts a process
that burns CPU and one that burns none, read back from the JUnit XML and the run's summary."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BURNS = """import subprocess, sys


def test_burns():
    code = "import time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_idle():
    pass
"""


def test_a_test_is_charged_the_cpu_of_the_processes_it_ran_and_the_costliest_are_listed(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.cpu_seconds"]\n')
    (tmp_path / "test_burn.py").write_text(BURNS)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "--junitxml", "out.xml",
         "-o", "junit_family=xunit1", "."],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cpu = {
        case.get("name"): float(prop.get("value", "nan"))
        for case in ET.parse(tmp_path / "out.xml").iter("testcase")
        for prop in case.iter("property")
        if prop.get("name") == "cpu_s"
    }
    assert cpu.keys() == {"test_burns", "test_idle"}, cpu
    assert 0.9 <= cpu["test_burns"] < 5 and cpu["test_idle"] < 0.5, cpu  # its child's second of CPU, reaped
    lines = result.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if "most CPU: 2 of 2 tests" in line)
    assert "test_burn.py::test_burns" in lines[head + 1] and "test_burn.py::test_idle" in lines[head + 2], lines[head:]

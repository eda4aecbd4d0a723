"""The device machines' scripts (`benchmarks/device/*.sh`) as far as this machine allows: each parses, and each is
listed in the device README, whose tables are what the next person reads before spending device time."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[1] / "device"
SCRIPTS = sorted(DEVICE.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_each_device_script_parses_and_the_device_readme_names_it(script: Path) -> None:
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert parsed.returncode == 0, parsed.stderr
    assert f"`{script.name}" in (DEVICE / "README.md").read_text(), f"{script.name} is not in the device README"

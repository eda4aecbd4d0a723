"""The pip line that installs an extra of this package, as the person reading an error can run it."""

from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
"""The folder this package runs from: a checkout (an editable install) where it holds `pyproject.toml`."""


def pip_install(extras: str) -> str:
    """`pip install 'rollout-streams[EXTRAS]'`, or from a checkout `pip install -e 'CHECKOUT[EXTRAS]'` (PyPI's name
    would install another copy, or nothing where no index is reachable)."""
    if (CHECKOUT / "pyproject.toml").is_file():
        return f"pip install -e '{CHECKOUT}[{extras}]'"
    return f"pip install 'rollout-streams[{extras}]'"

"""The packages' layering (docs/architecture.md, "Packages and import rules"): importing a package pulls in nothing
of a package above it.

`pipeline` is the ground floor and imports none of the others; `staleness` imports `pipeline` only; `producers` and
`consumers` never import each other; the shell (`rollouts`) stands on top, and none of the four imports it; nothing
imports the lab (`benchmarks`). Each package's every module is imported in a fresh interpreter of its own, and
`sys.modules` is checked after each import, so that a failure names the module that reached up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

SHELL = "rollouts"
LAB = "benchmarks"
RULES: dict[str, tuple[str, ...]] = {
    "pipeline": ("producers", "consumers", "staleness", SHELL, LAB),
    "staleness": ("producers", "consumers", SHELL, LAB),
    "producers": ("consumers", SHELL, LAB),
    "consumers": ("producers", SHELL, LAB),
}
"""Each package, and the packages (or modules) that importing any of its modules must not load."""

VERL_PLUGIN = "producers.integrations.verl"
SKIPPED = {"producers": (VERL_PLUGIN,)}
"""Modules not imported here: verl's plugin needs verl, installed in a venv of its own (tests/producers/test_verl.py
checks that module's layering there)."""

PROBE = r"""
import importlib, json, pkgutil, sys

package, forbidden, skipped, deep = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "deep"


def under(name, prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def walk(name):
    module = importlib.import_module(name)
    yield name
    if not deep:
        return
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        child = f"{name}.{info.name}"
        if under(child, skipped):
            continue
        if info.ispkg:
            yield from walk(child)
        else:
            importlib.import_module(child)
            yield child


imported, reached = [], {}
for name in walk(package):
    imported.append(name)
    for loaded in list(sys.modules):
        if loaded not in reached and under(loaded, forbidden):
            reached[loaded] = name
print(json.dumps({"imported": imported, "reached": reached}))
"""


def import_all(
    package: str,
    forbidden: tuple[str, ...],
    skipped: tuple[str, ...] = (),
    deep: bool = True,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Import every module of `package` (`deep`; else the package alone) in a fresh interpreter (`python`); what it
    imported, and which forbidden modules got loaded (each with the module whose import loaded it)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    args = [package, json.dumps(forbidden), json.dumps(skipped), "deep" if deep else "shallow"]
    done = subprocess.run(
        [python, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("package", list(RULES))
def test_a_package_imports_nothing_above_it(package: str) -> None:
    result = import_all(package, RULES[package], SKIPPED.get(package, ()))
    imported = result["imported"]
    assert isinstance(imported, list) and len(imported) > 3, f"{package}: found only {imported}"
    reached = result["reached"]
    assert not reached, f"{package} reaches above its layer: " + ", ".join(
        f"{module} (loaded by importing {importer})" for module, importer in sorted(reached.items())
    )


def test_the_shell_imports_no_lab() -> None:
    """`rollouts` (the shell) finds the lab's commands through an entry point, never by importing it (its commands as
    they run: tests/cli/test_lab_apart.py)."""
    result = import_all(SHELL, (LAB,), deep=False)
    assert not result["reached"], f"the shell imports the lab: {result['reached']}"

"""The lab (`benchmarks/`) is no part of the product: the product's wheel holds none of it, the lab's own distribution
(`benchmarks/pyproject.toml`) holds it, `rollouts` imports none of it unless one of its commands runs, and the
examples a user copies import none of it.

The import checks run the command as `python -m rollouts ARGS` does, in a fresh interpreter whose first import
finder writes the name of every module looked for to stderr as it goes (before `rollouts` leaves through
`os._exit`): the check is deep, so whatever `main`, the app or a command's own code imports at run time, by an
`import` statement or by `importlib` (as entry points are loaded), is seen, not only what `import rollouts`
pulls in.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB = "benchmarks"
PRODUCT = ("pipeline", "producers", "consumers", "staleness", "rollouts")


RUNNER = r"""
import runpy, sys


class Seen:
    def find_spec(self, name, path=None, target=None):
        sys.stderr.write(f"importing: {name}\n")
        return None  # the next finder finds it


sys.meta_path.insert(0, Seen())
sys.argv = ["rollouts", *sys.argv[1:]]
runpy.run_module("rollouts", run_name="__main__", alter_sys=True)
"""


def imported_by(*args: str) -> set[str]:
    """Every module `python -m rollouts ARGS` (the `rollouts` command) imports, run from the checkout's root,
    where the lab's folder is importable too; the command must exit 0."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {line.removeprefix("importing: ") for line in done.stderr.splitlines() if line.startswith("importing: ")}


def under(modules: set[str], package: str) -> list[str]:
    return sorted(m for m in modules if m == package or m.startswith(package + "."))


@pytest.mark.parametrize("args", [["--help"], ["worker", "--help"], ["top", "--help"], ["tiny-model", "--help"]])
def test_the_products_commands_import_nothing_of_the_lab(args: list[str]) -> None:
    modules = imported_by(*args)
    assert "rollouts.app" in modules, "the probe saw no import of the shell"
    assert not under(modules, LAB), f"`rollouts {' '.join(args)}` imports the lab: {under(modules, LAB)}"


def test_a_lab_command_under_rollouts_loads_the_lab_then() -> None:
    """`rollouts bench --help` (hidden) reaches the lab through its `rollouts.commands` entry point, installed with
    the lab (`pip install -e ./benchmarks`)."""
    assert f"{LAB}.cli" in imported_by("bench", "--help")


def test_the_lab_runs_from_a_checkout_with_nothing_installed_as_python_m_benchmarks() -> None:
    done = subprocess.run(
        [sys.executable, "-m", LAB, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(name in done.stdout for name in ("bench-rl", "bench-broker", "soak", "scale", "chaos")), done.stdout


def build_wheel(project: Path, out: Path) -> zipfile.ZipFile:
    """The wheel of `project` (a folder with a pyproject.toml), built with the setuptools installed here."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(project)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the working tree (less caches and stored results), to build in: setuptools writes `build/` and
    `*.egg-info` beside the sources it builds."""
    copy = tmp_path_factory.mktemp("checkout") / "tree"
    skipped = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".*cache", "results")
    shutil.copytree(ROOT, copy, ignore=skipped)
    return copy


def test_the_products_wheel_holds_the_product_and_nothing_of_the_lab(checkout: Path, tmp_path: Path) -> None:
    wheel = build_wheel(checkout, tmp_path)
    names = wheel.namelist()
    tops = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert tops == set(PRODUCT), tops
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    declared = wheel.read(entry_points).decode()
    assert "rollouts = rollouts:main" in declared
    assert LAB not in declared and "rollouts.commands" not in declared, declared


def test_the_labs_wheel_holds_the_lab_its_command_and_its_entry_point(checkout: Path, tmp_path: Path) -> None:
    wheel = build_wheel(checkout / LAB, tmp_path)
    names = wheel.namelist()
    tops = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {LAB} and f"{LAB}/cli.py" in names and f"{LAB}/__main__.py" in names, tops
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    declared = wheel.read(entry_points).decode()
    assert "rollouts-bench = benchmarks.cli:main" in declared, declared
    assert "[rollouts.commands]" in declared and "lab = benchmarks.cli:register" in declared, declared


def test_the_examples_import_nothing_of_the_lab() -> None:
    """What users copy uses the product alone (an example that loads the lab by path would show here too, as the
    lab's folder name)."""
    for example in sorted((ROOT / "examples").glob("*.py")):
        source = example.read_text()
        tree = ast.parse(source)
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not under(names, LAB), f"{example.name} imports the lab: {under(names, LAB)}"
        assert f'"{LAB}"' not in source and f"'{LAB}'" not in source, f"{example.name} names the lab's folder"

"""The opt-in two-worker run (`python -m pytest -n 2 --dist loadgroup`, README) keeps its groups: every `vllm` test in
one xdist group, the Ray module in another, the rest in none, as `tests/fixtures.py`'s hook marks them."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_under_two_xdist_workers_vllm_tests_and_the_ray_module_each_run_as_one_group(tmp_path: Path) -> None:
    """A real xdist run of stand-in tests under this suite's hook; xdist names each test's group in its node id. A test
    that closes the session's shared engine (`closes_shared_engine`), first in its file, runs after the others of its
    group."""
    (tmp_path / "conftest.py").write_text("from tests.fixtures import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "tests" / "consumers").mkdir(parents=True)
    (tmp_path / "tests" / "consumers" / "test_ray_launcher.py").write_text("def test_ray_one():\n    pass\n")
    (tmp_path / "test_mixed.py").write_text(
        "import pytest\n\n\n@pytest.mark.vllm\n@pytest.mark.closes_shared_engine\ndef test_closes():\n    pass\n\n\n"
        "@pytest.mark.vllm\ndef test_on_vllm():\n    pass\n\n\n"
        "class TestOnVllmToo:\n    pytestmark = pytest.mark.vllm\n\n    def test_it(self):\n        pass\n\n\n"
        "def test_plain():\n    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider", "-p",
         "no:randomly", "-W", "ignore::pytest.PytestUnknownMarkWarning", "."],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    order = [line.split("PASSED ")[1].strip() for line in result.stdout.splitlines() if "PASSED " in line]
    passed = set(order)
    # pytest-xdist 3.8 names the group by setting `item._nodeid`, which pytest 9.2 no longer reads (its node ids are
    # `item._id`): under that pair no test has a group, whatever order the hooks run in. constraints.txt pins 9.1.1.
    pair = f"pytest {pytest.__version__}, pytest-xdist {version('pytest-xdist')}"
    assert any("@" in nodeid for nodeid in passed), f"xdist named no group ({pair}): {passed}"
    assert passed == {
        "test_mixed.py::test_closes@vllm",
        "test_mixed.py::test_on_vllm@vllm",
        "test_mixed.py::TestOnVllmToo::test_it@vllm",
        "tests/consumers/test_ray_launcher.py::test_ray_one@ray",
        "test_mixed.py::test_plain",
    }, result.stdout
    vllm_group = [nodeid for nodeid in order if nodeid.endswith("@vllm")]
    assert vllm_group[-1] == "test_mixed.py::test_closes@vllm", result.stdout

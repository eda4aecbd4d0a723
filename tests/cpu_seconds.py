"""CPU seconds a test costs, its own and its processes': what decides the suite's time on a 2-core CI machine, where
every core is busy and a test's wall time says more about its neighbours than about itself.

Each test's CPU (this process's, plus every child process it started and reaped: workers, servers, drivers) is added to
its report as the user property `cpu_s` (JUnit XML writes it: `--junitxml`), and the end of the run lists the tests that
cost the most, as `--durations` lists the slowest. The children's share counts only processes reaped by the time the
test's teardown ends (the fixtures stop theirs by PID); a session-scoped server is charged to no test.
"""

from __future__ import annotations

import resource
from collections.abc import Generator
from typing import Any

import pytest

from tests.forkserver import forked_cpu

SHOWN = 20
"""Tests listed at the end of a run, most CPU first."""

_started: dict[str, float] = {}
_costs: list[tuple[float, str]] = []


def _cpu_s() -> float:
    """CPU seconds, user and system, of this process and of its reaped children so far (those the tests' fork server
    reaped too: `tests.forkserver`)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked_cpu[0]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _started[item.nodeid] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    if call.when == "teardown" and item.nodeid in _started:  # the teardown has run: its reaped processes count
        item.user_properties.append(("cpu_s", round(_cpu_s() - _started.pop(item.nodeid), 2)))
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the process that reports (under xdist, the controller): the cost that came with the teardown's report."""
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "cpu_s" and isinstance(value, float | int):
                _costs.append((float(value), report.nodeid))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _costs:
        return
    total = sum(cost for cost, _ in _costs)
    shown = min(SHOWN, len(_costs))
    terminalreporter.write_sep("=", f"most CPU: {shown} of {len(_costs)} tests, {total:.0f} CPU s in all")
    for cost, nodeid in sorted(_costs, reverse=True)[:shown]:
        terminalreporter.write_line(f"{cost:8.1f}s cpu  {nodeid}")

"""`rollouts failover-chaos` as a person runs it, short: a primary, two replicas and three Sentinels, synthetic workers,
the manager and the chaos trainer given only the Sentinels in the `replica` mode, and the primary failed by each kind
(kill -9, SIGSTOP past down-after, a crash that loses its AOF's tail, and where the run may make network namespaces, a
partition of the primary and one worker from the rest). The long run (over 20 failovers a mode, both
modes) is in benchmarks/results; this one checks in about a minute that nothing acknowledged was lost, nothing trained
twice and no version reused."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from benchmarks import netns
from benchmarks.failover_chaos import DEFAULT_KINDS, KINDS
from tests.fixtures import wait_until


def test_a_short_failover_run_in_the_replica_mode_loses_nothing_acknowledged(tmp_path: Path) -> None:
    """Every kind of fault once, a partition too where this machine lets the run make network namespaces (root)."""
    kinds = KINDS if netns.why_not() is None else DEFAULT_KINDS
    args = ["--modes", "replica", "--duration-s", str(8 * len(kinds)), "--every-s", "5", "--workers", "2"]
    args += ["--kinds", ",".join(kinds), "--drain-timeout-s", "150"]
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "failover-chaos", *args, "--keep-logs", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = json.loads(result.stdout)["runs"]
    assert run["mode"] == "replica" and set(run["faults"]) == set(kinds)
    assert run["failovers"] == sum(run["faults"].values()) >= 3
    assert run["acknowledged_lost"] == [] and run["groups_trained"] == run["prompts_submitted"] > 0
    assert run["duplicates_trained"] == 0 and run["versions_reused"] == [] and run["syncs"] >= 2
    assert run["unrecovered"] == 0 and run["recovery_s"]["max"] < 30
    goals = run["goals"]
    assert goals["none_lost"] and goals["no_duplicate_trained"] and goals["no_version_reused"]


def test_failover_chaos_refuses_a_mode_or_a_fault_it_does_not_know() -> None:
    for args, says in ((["--modes", "fsync"], "unknown durability modes"), (["--kinds", "meteor"], "unknown fault")):
        result = subprocess.run(
            [sys.executable, "-m", "rollouts", "failover-chaos", *args], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2 and says in result.stderr, result.stderr


def test_a_failover_run_stopped_by_sigterm_leaves_no_server_sentinel_worker_or_namespace(tmp_path: Path) -> None:
    """SIGTERM unwinds a lab command as Ctrl-C does: its Redis servers, Sentinels, workers, manager and trainer stop,
    and a partition run's network namespaces go (where this machine lets the run make them)."""
    kinds = KINDS if netns.why_not() is None else DEFAULT_KINDS
    args = ["--modes", "replica", "--duration-s", "120", "--workers", "2", "--kinds", ",".join(kinds)]
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "failover-chaos", *args],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "run.log").open("wb"),
    )
    children: list[psutil.Process] = []

    def started() -> bool:
        nonlocal children
        children = psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []
        names = " ".join(command_line(child) for child in children)
        return process.poll() is not None or all(part in names for part in ("[sentinel]", " worker ", "chaos-trainer"))

    try:
        wait_until(started, 120, "the run's servers, Sentinels, workers and trainer")
        assert process.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        namespaces = run_namespaces(process.pid)
        assert kinds == DEFAULT_KINDS or namespaces, "a partition run makes a namespace a server"
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [command_line(p) for p in alive]
        if kinds != DEFAULT_KINDS:
            assert not run_namespaces(process.pid), namespaces
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # its own cleanup first: a kill leaves its namespaces behind
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def command_line(process: psutil.Process) -> str:
    """Its command line ("" once it has exited: a zombie has none)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def run_namespaces(pid: int) -> list[str]:
    """The network namespaces that the run of process `pid` made (other runs may make theirs meanwhile)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    tag = netns.process_tag(pid)  # then a letter a network: rs123 is not rs1234's
    return [name for name in listed if name.startswith(tag) and name[len(tag) : len(tag) + 1].isalpha()]

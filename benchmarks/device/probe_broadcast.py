"""The nccl transport's own pieces on two GPUs, with no worker process: per model size of `rollouts bench-sync`,
a bare NCCL broadcast of the model's bytes, `NcclTransport.broadcast` to a receiver thread (on `--target`) at each
bucket size given, and the host and GPU time of packing every bucket (`pack_bucket`). JSON lines on stdout.

    python benchmarks/device/probe_broadcast.py --sizes large,xl --buckets-mib 256,1024

The receiver is a thread of this process, so its Python shares the GIL with the trainer's: `transfer_ms` here reads
higher than `rollouts bench-sync`'s `broadcast_s`, where the worker is a process of its own. Compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_sync import SIZES, bare_broadcast_gb_per_s
from benchmarks.transport_state import drop_groups
from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import free_port
from staleness.weights import buckets, nccl
from staleness.weights.sources import read_checkpoint


def transfer(named: dict[str, torch.Tensor], bucket_bytes: int, target: str, rounds: int) -> dict[str, float]:
    """Medians over `rounds` broadcasts after two that build and warm the group."""
    trainer = nccl.NcclTransport("127.0.0.1", free_port(), bucket_bytes=bucket_bytes, timeout_s=60)
    stats = []
    for epoch in range(1, rounds + 3):
        uri = trainer.publish(named, version=epoch)

        def receive(uri: str = uri, epoch: int = epoch) -> None:
            torch.cuda.set_device(target)
            link = nccl.join_broadcast(uri, epoch, epoch, timeout_s=60, member="probe")
            nccl.prepare_receiver(link, 0, target)
            for _ in nccl.receive_broadcast(link, 0, target):
                pass

        thread = threading.Thread(target=receive)
        thread.start()
        stats.append(trainer.broadcast(epoch, 1))
        thread.join()
    drop_groups()
    later = stats[2:]
    return {
        "transfer_ms": round(1000 * statistics.median(s.transfer_s for s in later), 3),
        "ready_ms": round(1000 * statistics.median(s.ready_s for s in later), 3),
        "gb_per_s": round(statistics.median(s.gb_per_s for s in later), 1),
    }


def packing(named: dict[str, torch.Tensor], bucket_bytes: int, rounds: int) -> dict[str, float]:
    """Host time to launch every bucket's packing, and until the GPU finished it (medians)."""
    device = next(iter(named.values())).device
    metas = [buckets.TensorMeta(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in named.items()]
    tensors = list(named.values())
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    padding = torch.zeros(buckets.ALIGN, dtype=torch.uint8, device=device)
    launched, finished = [], []
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for bucket in buckets.plan_buckets(metas, bucket_bytes):
            if len(bucket) > 1:  # a tensor alone in its bucket is sent as it is
                size = buckets.bucket_size(metas, bucket)
                buckets.pack_bucket(bucket, tensors, buffer[:size], padding)
        launched.append(time.perf_counter() - started)
        torch.cuda.synchronize(device)
        finished.append(time.perf_counter() - started)
    return {
        "pack_launch_ms": round(1000 * statistics.median(launched), 3),
        "pack_total_ms": round(1000 * statistics.median(finished), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="large,xl")
    parser.add_argument("--buckets-mib", default="256")
    parser.add_argument("--source", default="cuda:0")
    parser.add_argument("--target", default="cuda:1")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for size in args.sizes.split(","):
        hidden, layers = SIZES[size]
        model = build_tiny_model(Path(tempfile.mkdtemp()) / size, seed=0, hidden_size=hidden, num_layers=layers)
        named = {k: t.to(args.source) for k, t in read_checkpoint(model).items()}
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        row: dict[str, Any] = {"size": size, "tensors": len(named), "bytes": nbytes}
        row["bare_gb_per_s"] = round(bare_broadcast_gb_per_s(nbytes, args.source, [args.target]), 1)
        for mib in (int(m) for m in args.buckets_mib.split(",")):
            row[f"bucket_{mib}MiB"] = transfer(named, mib << 20, args.target, args.rounds)
        row |= packing(named, nccl.DEFAULT_BUCKET_BYTES, args.rounds)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Ways to move a model's tensors from one GPU to another over NCCL, side by side in one process (two threads,
a process group each, as `bare_broadcast_gb_per_s` does), with no rendezvous, worker or loading: JSON lines.

- `bare`: one broadcast of the model's bytes from one flat buffer (the ceiling);
- `chunks_MiB`: the same flat buffer in slices of that size, one broadcast each (NCCL's per-call cost);
- `packed_MiB`: the transport's buckets, packed on the sender (`pack_bucket`, double buffered), one broadcast each;
- `per_tensor`: one broadcast a tensor, from the tensor itself (no copy), into views of the receiver's buffers;
- `grouped_MiB`: the same, inside one NCCL group (`_start_coalescing` .. `_end_coalescing`) per bucket of that size;
- `grouped_all`: every tensor's broadcast in one NCCL group;
- `transport_MiB`: the transport's own `_send_buckets` and its receivers' parts (`bucket_parts`, `_broadcast_parts`);
  `transport-whole_MiB` the same with every bucket whole (as over gloo).

The receiver posts every receive first; the sender's clock starts once it has (`posted`), as a worker posts its
receives before the trainer sends. `median_ms`: from the first launch until the sender's GPU finished; `ratio`:
bare's time over the mode's. Medians of `--rounds` after two warm-up rounds.

    python benchmarks/device/probe_strategies.py --sizes large,xl --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from benchmarks.bench_sync import SIZES
from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import free_port
from staleness.weights import buckets, nccl, nccl_group
from staleness.weights.sources import read_checkpoint

Plan = list[list[tuple[int, int]]]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def receiver_buffers(metas: list[buckets.TensorMeta], plan: Plan, device: str) -> list[torch.Tensor]:
    return [torch.empty(buckets.bucket_size(metas, b), dtype=torch.uint8, device=device) for b in plan]


def post(group: dist.ProcessGroup, tensors: list[torch.Tensor], grouped: bool, device: str) -> list[dist.Work]:
    """Broadcast each of `tensors` (rank 0 sends, others receive), inside one NCCL group if `grouped`."""
    if not grouped:
        return [group.broadcast([t], dist.BroadcastOptions()) for t in tensors]
    group._start_coalescing()  # type: ignore[call-arg]  # the stub wants a device; the backend's own is used
    for t in tensors:
        group.broadcast([t], dist.BroadcastOptions())
    return [group._end_coalescing()]  # type: ignore[call-arg]  # as _start_coalescing


def run_mode(
    mode: str, rank: int, group: dist.ProcessGroup, named: dict[str, torch.Tensor], device: str
) -> Callable[[], list[dist.Work]]:
    """A function that launches this rank's side of `mode` once and returns what to wait on."""
    metas = [buckets.TensorMeta(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in named.items()]
    nbytes = sum(m.nbytes for m in metas)
    kind, _, size = mode.partition("_")
    bucket = (int(size) << 20) if size.isdigit() else nccl.DEFAULT_BUCKET_BYTES
    plan = buckets.plan_buckets(metas, bucket)
    if kind in ("bare", "chunks"):
        buffer = torch.ones(nbytes, dtype=torch.uint8, device=device)
        step = nbytes if kind == "bare" else bucket
        slices = [buffer[i : i + step] for i in range(0, nbytes, step)]
        return lambda: post(group, slices, False, device)
    if kind in ("transport", "transport-whole"):  # the transport's own functions, parts grouped or buckets whole
        backend = "nccl" if kind == "transport" else "gloo"
        if rank == 0:
            sender = nccl.NcclTransport("127.0.0.1", 1, bucket_bytes=bucket)
            outgoing = nccl._Outgoing.of(named, bucket, backend)  # laid out at publish, as staged

            def send() -> list[dist.Work]:
                sender._send_buckets(group, outgoing)
                return []

            return send
        buffers = receiver_buffers(metas, plan, device)
        grouped = nccl_group.grouped(backend)

        def receive() -> list[dist.Work]:
            works = []
            for buffer, b in zip(buffers, plan, strict=True):
                parts = buckets.bucket_parts(metas, b, grouped, buckets.COPY_FROM)
                works += nccl_group.broadcast_parts(group, [buffer[p.start : p.end] for p in parts])
            return works

        return receive
    if rank == 0:
        tensors = [named[m.name] for m in metas]
        if kind == "packed":
            buffers = [torch.empty(bucket, dtype=torch.uint8, device=device) for _ in range(2)]
            padding = torch.zeros(buckets.ALIGN, dtype=torch.uint8, device=device)

            def packed() -> list[dist.Work]:
                works: list[dist.Work | None] = [None, None]
                for k, b in enumerate(plan):
                    slot = k % 2
                    pending = works[slot]
                    if pending is not None:
                        pending.wait()
                    if len(b) == 1:
                        payload = flat(tensors[b[0][0]])
                    else:
                        payload = buffers[slot][: buckets.bucket_size(metas, b)]
                        buckets.pack_bucket(b, tensors, payload, padding)
                    works[slot] = group.broadcast([payload], dist.BroadcastOptions())
                return [w for w in works if w is not None]

            return packed
        per_bucket = [[flat(tensors[i]) for i, _ in b] for b in plan]
    else:
        buffers = receiver_buffers(metas, plan, device)
        if kind == "packed":
            return lambda: post(group, buffers, False, device)
        per_bucket = [
            [buckets.tensor_view(buf, metas[i], off).reshape(-1).view(torch.uint8) for i, off in b]
            for buf, b in zip(buffers, plan, strict=True)
        ]
    if kind == "per":
        everything = [t for b in per_bucket for t in b]
        return lambda: post(group, everything, False, device)
    if mode == "grouped_all":
        everything = [t for b in per_bucket for t in b]
        return lambda: post(group, everything, True, device)
    return lambda: [w for b in per_bucket for w in post(group, b, True, device)]


def measure(
    label: str, named: dict[str, torch.Tensor], source: str, target: str, modes: list[str], rounds: int
) -> dict:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
    keys = [m if m not in modes[:i] else f"{m}#{modes[:i].count(m) + 1}" for i, m in enumerate(modes)]
    results: dict[str, list[float]] = {k: [] for k in keys}
    errors: dict[str, str] = {}
    posted = threading.Event()
    done = threading.Barrier(2, timeout=120)
    receiver_named = {k: torch.empty_like(t, device=target) for k, t in named.items()}

    def side(rank: int, device: str) -> None:
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
        prefixed = dist.PrefixStore("probe/", client)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
            # torch's stubs type the backends as Backends, not ProcessGroups; Options() is the 3-argument default
            group = cast(dist.ProcessGroup, dist.ProcessGroupNCCL(prefixed, rank, 2, dist.ProcessGroupNCCL.Options()))
        else:  # gloo on the CPU: only to try this script where there is no GPU
            group = cast(dist.ProcessGroup, dist.ProcessGroupGloo(prefixed, rank, 2, timedelta(seconds=60)))
        group.broadcast([torch.zeros(1, device=device)], dist.BroadcastOptions()).wait()
        sync(device)
        if rank == 0:
            print(
                json.dumps({"label": label, "supports_coalescing": getattr(group, "supports_coalescing", None)}),
                flush=True,
            )
        for mode, key in zip(modes, keys, strict=True):
            try:
                launch: Callable[[], list[dist.Work]] | None = run_mode(
                    mode, rank, group, named if rank == 0 else receiver_named, device
                )
            except Exception as exc:  # a mode this torch cannot run: the others still go
                errors[key] = f"{type(exc).__name__}: {exc}"
                launch = None
            done.wait()
            if key in errors or launch is None:  # None: its error is in errors
                continue
            for r in range(rounds + 2):
                sync(device)
                done.wait()
                try:
                    if rank == 1:
                        works = launch()
                        posted.set()
                    else:
                        posted.wait()
                        posted.clear()
                        started = time.perf_counter()
                        works = launch()
                except Exception as exc:
                    errors[key] = f"{type(exc).__name__}: {exc}"
                    print(json.dumps({"label": label, "mode": key, "error": errors[key]}), flush=True)
                    raise
                for w in works:
                    w.wait()
                sync(device)
                if rank == 0 and r >= 2:
                    results[key].append(time.perf_counter() - started)
                done.wait()
            if rank == 0:  # as it comes: a mode that hangs leaves the ones before it on record
                ms = [round(1000 * s, 3) for s in results[key]]
                print(
                    json.dumps({"label": label, "mode": key, "median_ms": statistics.median(ms), "ms": ms}), flush=True
                )
        group.shutdown()

    threads = [threading.Thread(target=side, args=(i, d), daemon=True) for i, d in enumerate((source, target))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20 + 15 * len(modes)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():  # a side failed and the other waits on NCCL for ever: report what there is and go
            print(json.dumps({"label": label, "stuck": True, "errors": errors}), flush=True)
            os._exit(1)
    del server
    medians = {m: statistics.median(v) for m, v in results.items() if v}
    bare = medians.get("bare")
    out: dict = {
        m: {"median_ms": round(1000 * s, 3)} | ({"ratio": round(bare / s, 3)} if bare else {})
        for m, s in medians.items()
    }
    return out | {"errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="large,xl")
    parser.add_argument(
        "--modes",
        default="bare,chunks_256,packed_256,per_tensor,grouped_256,grouped_1024,grouped_all,packed_1024,bare",
    )
    parser.add_argument("--source", default="cuda:0")
    parser.add_argument("--target", default="cuda:1")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    modes = args.modes.split(",")
    for size in args.sizes.split(","):
        hidden, layers = SIZES[size]
        model = build_tiny_model(Path(tempfile.mkdtemp()) / size, seed=0, hidden_size=hidden, num_layers=layers)
        named = {k: t.to(args.source) for k, t in read_checkpoint(model).items()}
        row = {"size": size, "tensors": len(named), "bytes": sum(t.numel() * t.element_size() for t in named.values())}
        row |= measure(size, named, args.source, args.target, modes, args.rounds)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

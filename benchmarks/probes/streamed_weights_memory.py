"""What publishing a generator of weights holds in the trainer's memory, per transport (issue 44 item 3; results:
benchmarks/results/2026-11-29-streamed-weights.md).

A fresh Python process (`MEASURE`) connects a `RolloutClient`, resets its peak resident memory
(`/proc/self/clear_refs`), publishes a generator of N tensors of SIZE bytes, each made when asked for (`torch.full`:
every page written), with `bucket_bytes=BUCKET` and no worker live, and prints the rise of `VmHWM` over the `VmRSS`
before, with `last_publish`. `control` holds the generator's tensors instead.
`tests/staleness/test_streamed_weights.py` runs the same script and asserts on it; this probe runs every variant a few
times side by side (Linux only: `/proc`).

    PYTHONPATH=$PWD python benchmarks/probes/streamed_weights_memory.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = """
import json, re, sys
import torch
from producers.client import RolloutClient

url, ns, target, n, size, bucket = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])

def status(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\\s+(\\d+) kB", f.read(), re.M).group(1)) << 10

def model():
    for i in range(n):
        yield f"layer{i}.weight", torch.full((size // 4,), float(i))  # every page written

client = RolloutClient(url, ns)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak starts again from what is resident now
before = status("VmRSS")
if target == "control":
    held = list(model())
else:
    client.publish_weights(model(), transport=target, bucket_bytes=bucket)
stats = client.last_publish
print(json.dumps({"growth": status("VmHWM") - before,
                  "buffered": stats.peak_buffered_bytes if stats else None, "bytes": stats.bytes if stats else None}))
"""

HIREDIS_PACKER = MEASURE.replace(
    "client = RolloutClient(url, ns)",
    "import staleness.weights.redis_store as rs\nrs._zero_copy_client = lambda c: c\nclient = RolloutClient(url, ns)",
)
"""The same, with chunks sent through the client as it is (hiredis's packer copies each one twice)."""


def measure(url: str, ns: str, target: str, n: int, size: int, bucket: int, script: str = MEASURE) -> dict[str, int]:
    """One fresh process's peak memory rise (`growth`), and its `last_publish` (`buffered`, `bytes`)."""
    done = subprocess.run(
        [sys.executable, "-c", script, url, ns, target, str(n), str(size), str(bucket)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    from pipeline.local import RedisServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--size", type=int, default=8 << 20)
    parser.add_argument("--bucket", type=int, default=16 << 20)
    args = parser.parse_args()
    results: dict[str, list[int]] = {}
    with RedisServer() as server, tempfile.TemporaryDirectory() as root:
        for run in range(args.rounds):
            variants = [
                ("control", "control", MEASURE),
                ("redis", "redis://", MEASURE),
                ("fs", f"fs://{root}/r{run}", MEASURE),
                ("redis-hiredis-packer", "redis://", HIREDIS_PACKER),
            ]
            for name, target, script in variants:
                got = measure(server.url, f"mem{run}{len(results.get(name, []))}{name[:2]}", target, args.tensors,
                              args.size, args.bucket, script)  # fmt: skip
                results.setdefault(name, []).append(got["growth"] >> 20)
                print(json.dumps({"variant": name, "growth_mib": got["growth"] >> 20, **got}), flush=True)
    print(json.dumps({"growth_mib": results}))


if __name__ == "__main__":
    main()

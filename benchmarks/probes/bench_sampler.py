"""The torch engine's sampler, old against new, side by side on one device; JSON on stdout.

    python benchmarks/probes/bench_sampler.py --device cuda:0

Old: a `torch.Generator` per row and an exponential race (one kernel per row per token). New: one
uniform per row for all rows at once (`consumers.engines.torch_scheduler.sampling_uniform`) and an inverse-CDF
pick. Each is timed end to end (down to the token ids on the host), median of `--rounds` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from consumers.engines.torch_scheduler import sampling_uniform


def median_ms(f: Callable[[], object], rounds: int) -> float:
    for _ in range(5):
        f()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        f()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 3)


def compare(device: str, rows: int, vocab: int, rounds: int) -> dict[str, float]:
    probs = torch.rand(rows, vocab, device=device)
    generators = [torch.Generator(device=device).manual_seed(i) for i in range(rows)]

    def old() -> list[int]:
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=g) for g in generators])
        return (probs / noise).argmax(dim=-1).tolist()

    def new() -> list[int]:
        seeds = torch.tensor(range(rows), device=device)
        steps = torch.zeros(rows, dtype=torch.long, device=device)
        cdf = probs.double().cumsum(dim=-1)
        u = sampling_uniform(seeds, steps) * cdf[:, -1]
        return torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=vocab - 1).tolist()

    result = {"rows": rows, "vocab": vocab, "old_ms": median_ms(old, rounds), "new_ms": median_ms(new, rounds)}
    result["speedup"] = round(result["old_ms"] / result["new_ms"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    shapes = [(64, 1000), (256, 1000), (64, 151_936), (256, 151_936)]
    results = [compare(args.device, rows, vocab, args.rounds) for rows, vocab in shapes]
    print(json.dumps({"device": name, "torch": torch.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    main()

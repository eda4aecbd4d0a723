"""How small a delta sync is on the real model's training steps (issue 66 item 5): what changes between two versions
of SmolLM2-135M-Instruct's bf16 weights after an AdamW step, and what `staleness.weights.delta` sends for it.

Each step is a real optimizer step on the real model (`benchmarks.training_steps.TrainingSteps`: AdamW, the real
demo's 2e-5, betas 0.9/0.99, cross-entropy on the answers of one-digit sums, 8 problems a step). Two trainers:

- `bf16`: the parameters themselves in bf16 (as `bench-rl --trainer-dtype bfloat16` trains them): a step moves an
  element only where the update passes half its ULP;
- `fp32-master`: fp32 parameters, published as bf16 casts: an element changes when its fp32 value crosses a bf16
  rounding boundary.

Per step: the share of 16-bit words that changed, the delta's bytes against the full version's (`ratio`), its
encoding, the time to encode and to apply, and whether the applied delta equals the version bit for bit (the apply
checks the SHA-256). A JSON report on stdout, progress on stderr.

    python benchmarks/probes/delta_sync.py --steps 8 > delta.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def flat_bf16(model: torch.nn.Module) -> np.ndarray:
    """The model's parameters as bf16, laid out one after another (the buffer a stored transport writes)."""
    parts = [p.detach().to(torch.bfloat16).contiguous().view(torch.int16).flatten() for p in model.parameters()]
    return torch.cat(parts).numpy().view(np.uint8)


def run(model_dir: Path, trainer: str, steps: int, lr: float, seed: int, threads: int) -> dict[str, Any]:
    from benchmarks.training_steps import TrainingSteps
    from staleness.weights.delta import apply, encode

    training = TrainingSteps(model_dir, torch.bfloat16 if trainer == "bf16" else torch.float32, lr=lr, seed=seed)
    model = training.model
    previous = flat_bf16(model)
    rows: list[dict[str, Any]] = []
    for step in range(steps):
        began = time.perf_counter()
        loss = training.step()
        step_s = time.perf_counter() - began
        current = flat_bf16(model)
        began = time.perf_counter()
        delta = encode(previous, current, step, step + 1, full_ratio=1.0, threads=threads)
        encode_s = time.perf_counter() - began
        assert delta is not None
        began = time.perf_counter()
        exact = bool(np.array_equal(apply(previous, delta, threads), current))
        apply_s = time.perf_counter() - began
        row = {
            "step": step + 1, "loss": round(loss, 4),
            "changed": round(delta.changed / (current.size // 2), 5),
            "ratio": round(delta.nbytes / current.size, 5), "encodings": delta.encodings, "bytes": delta.nbytes,
            "full_bytes": int(current.size), "encode_s": round(encode_s, 3), "apply_s": round(apply_s, 3),
            "exact": exact, "step_s": round(step_s, 2),
        }  # fmt: skip
        rows.append(row)
        print(f"[{trainer}] step {step + 1}/{steps}: {row['changed']:.2%} of words changed, delta "
              f"{row['ratio']:.2%} of the full version {delta.encodings}, encoded in {encode_s:.2f} s, applied in "
              f"{apply_s:.2f} s, exact {exact}", file=sys.stderr)  # fmt: skip
        previous = current
    return {
        "trainer": trainer, "steps": rows,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "median_changed": statistics.median(r["changed"] for r in rows),
        "max_ratio": max(r["ratio"] for r in rows), "all_exact": all(r["exact"] for r in rows),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="The model folder (default: the built SmolLM2).")
    parser.add_argument("--trainers", default="bf16,fp32-master")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch's threads, and the delta's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from consumers.engines.pretrained import build_pretrained

        model = build_pretrained("smollm2")
    report = {"model": str(model), "lr": args.lr, "runs": []}
    for trainer in args.trainers.split(","):
        if trainer not in ("bf16", "fp32-master"):
            parser.error(f"--trainers: bf16 or fp32-master, not {trainer!r}")
        report["runs"].append(run(model, trainer, args.steps, args.lr, args.seed, args.threads))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

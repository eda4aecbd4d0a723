"""What an `inflight` weight sync costs in off-policyness, and what a `keep` sync costs in recompute (tiny model).

    python benchmarks/probes/inflight_offpolicy.py [--samples 16 --swap-at 32 --max-tokens 128]

A fresh tiny model (seed 0) is version 0. For each new version (v0 plus Gaussian noise of a relative size, each
tensor's own std times `--scales`, and an unrelated model: the seed-1 weights) and each mode (`keep`, `inflight`), one
`TorchEngine` samples `--samples` seeded samples (temperature 1) and is synced to v1 once every row has `--swap-at`
tokens. Then, with plain transformers passes over each sample's tokens after the swap:

- `kl_inflight`: KL(inflight || v1), per token, between the distribution the token was sampled from (v1 over the KV
  cache v0 wrote for the prompt and the tokens before the swap) and a full v1 recompute (what `keep` samples from and
  what a trainer at v1 computes): the off-policyness the mode adds, which the spans (v1) do not show;
- `kl_update`: KL(v0 || v1) over the same prefixes: how far the sync moved the policy, for scale (`ratio`: the
  first over this one);
- `|dlogp|`: the sampled tokens' logprob gap between the two (the log importance ratio a trainer at v1 sees);
- `engine_vs_reference`: the engine's own logprobs against the reference of its mode (a sanity check, ~1e-6);
- `recomputed_tokens`: tokens the engine ran through a prefill again at the sync (0 for `inflight`).

Prints one JSON line per (version, mode) and a markdown table. Results: benchmarks/results/2026-11-28-inflight-mode.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from consumers.engines.base import Generation
from consumers.engines.tiny_model import build_tiny_model
from consumers.engines.torch_engine import TorchEngine
from pipeline.wire import PauseMode, Sampling


def perturbed(state: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    """Each floating tensor plus Gaussian noise of `scale` times its own std (a stand-in for a training step)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        std = float(tensor.float().std()) if tensor.numel() > 1 else 0.0
        noise = torch.randn(tensor.shape, generator=gen) * std * scale
        out[name] = tensor + noise.to(tensor.dtype)
    return out


def log_softmax_kept(models: list[torch.nn.Module], prompt: list[int], tokens: list[int], swap: int) -> torch.Tensor:
    """Next-token log-distributions of `tokens` when `models[0]` ran the prompt and tokens[:swap - 1] and `models[1]`
    the rest over that cache (the engine feeds token swap-1 in the first call after the swap)."""
    cut = len(prompt) + swap - 1
    ids = prompt + tokens[:-1]
    with torch.inference_mode():
        first = models[0](input_ids=torch.tensor([ids[:cut]]), past_key_values=DynamicCache(), use_cache=True)
        second = models[1](input_ids=torch.tensor([ids[cut:]]), past_key_values=first.past_key_values, use_cache=True)
    logits = torch.cat([first.logits[0], second.logits[0]]).float()
    return torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)


def log_softmax_full(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1], dim=-1)


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from log-probabilities."""
    return (p.exp() * (p - q)).sum(-1)


async def sample(
    model_dir: Path, v1: dict[str, torch.Tensor], mode: PauseMode, args: argparse.Namespace
) -> tuple[list[list[int]], list[Generation], dict[str, int], float]:
    """Generate with a sync to `v1` (mode `mode`) once the rows have `swap_at` tokens on average; returns the prompts,
    the samples, the engine's prefill counters over the sync and the wall time."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(6, 512, size=int(rng.integers(8, 24)), dtype=np.int32) for _ in range(args.samples)]
    async with TorchEngine(model_dir, num_threads=1, max_batch=args.samples) as engine:
        began = time.perf_counter()
        tasks = [
            asyncio.ensure_future(
                engine.generate(f"s{i}", p, Sampling(max_tokens=args.max_tokens, temperature=1.0, seed=i))
            )
            for i, p in enumerate(prompts)
        ]
        while engine.generated_tokens < args.samples * args.swap_at:
            await asyncio.sleep(0.001)
        await engine.pause(mode)
        before = engine.stats()
        await engine.load_tensors(v1, version=1)
        await engine.resume()
        gens = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - began
        stats = engine.stats()
    counters = {k: stats[k] - before[k] for k in ("recomputed_tokens", "prefill_tokens")}
    return [p.tolist() for p in prompts], gens, counters, wall


def measure(
    model_dir: Path, v0: torch.nn.Module, name: str, v1_state: dict[str, torch.Tensor], args: argparse.Namespace
) -> list[dict[str, Any]]:
    v1 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    v1.load_state_dict(v1_state)
    rows = []
    modes: tuple[PauseMode, ...] = ("keep", "inflight")
    for mode in modes:
        prompts, gens, stats, wall = asyncio.run(sample(model_dir, v1_state, mode, args))
        kl_mode, kl_update, gaps, check = [], [], [], []
        for prompt, gen in zip(prompts, gens, strict=True):
            tokens = gen.tokens.tolist()
            if len(gen.spans) < 2:
                continue  # ended before the swap
            swap = gen.spans[1][1]
            index = torch.tensor(tokens)[:, None]
            full_v1 = log_softmax_full(v1, prompt, tokens)
            full_v0 = log_softmax_full(v0, prompt, tokens)
            behaviour = log_softmax_kept([v0, v1], prompt, tokens, swap) if mode == "inflight" else full_v1
            after = slice(swap, len(tokens))
            kl_mode.append(kl(behaviour[after], full_v1[after]))
            kl_update.append(kl(full_v0[after], full_v1[after]))
            picked_b = behaviour.gather(1, index)[:, 0]
            gaps.append((picked_b - full_v1.gather(1, index)[:, 0])[after].abs())
            # The engine's logprobs: v0's before the swap, then the mode's behaviour distribution.
            reference = torch.cat([full_v0.gather(1, index)[:swap, 0], picked_b[swap:]])
            check.append(float((torch.from_numpy(gen.logprobs) - reference).abs().max()))
        kl_all, upd, gap = torch.cat(kl_mode), torch.cat(kl_update), torch.cat(gaps)
        first8 = torch.cat([k[:8] for k in kl_mode])
        rows.append(
            {
                "v1": name,
                "mode": mode,
                "samples_cut": len(kl_mode),
                "tokens_after_swap": int(kl_all.numel()),
                "kl_inflight_mean": float(kl_all.mean()),
                "kl_inflight_first8_mean": float(first8.mean()),
                "kl_inflight_max": float(kl_all.max()),
                "kl_update_mean": float(upd.mean()),
                "dlogp_mean": float(gap.mean()),
                "dlogp_max": float(gap.max()),
                "engine_vs_reference": max(check),
                "recomputed_tokens": stats["recomputed_tokens"],
                "wall_s": round(wall, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--swap-at", type=int, default=32, help="Tokens every row has when the sync comes.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--scales", default="0.001,0.01,0.1", help="Noise sizes of the new versions (x tensor std).")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "v0", seed=0)
        other = build_tiny_model(Path(tmp) / "seed1", seed=1)
        v0 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        state = {k: v.clone() for k, v in v0.state_dict().items()}
        versions = [(f"v0 + {s} x std noise", perturbed(state, float(s), seed=1)) for s in args.scales.split(",")]
        unrelated = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).state_dict()
        versions.append(("seed-1 weights (unrelated)", dict(unrelated)))
        rows = [row for name, v1 in versions for row in measure(model_dir, v0, name, v1, args)]
    print()
    print(
        "| new version | mode | tokens after swap | KL(behaviour ‖ v1) mean (first 8) | max | KL(v0 ‖ v1) mean "
        "| ratio | \\|Δlogp\\| mean / max | engine vs its reference | tokens recomputed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['v1']} | {r['mode']} | {r['tokens_after_swap']} | {r['kl_inflight_mean']:.2e} "
            f"({r['kl_inflight_first8_mean']:.2e}) | {r['kl_inflight_max']:.2e} | {r['kl_update_mean']:.2e} "
            f"| {r['kl_inflight_mean'] / r['kl_update_mean']:.2f} "
            f"| {r['dlogp_mean']:.2e} / {r['dlogp_max']:.2e} | {r['engine_vs_reference']:.1e} "
            f"| {r['recomputed_tokens']} |"
        )


if __name__ == "__main__":
    main()

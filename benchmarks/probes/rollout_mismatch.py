"""How far an engine's logprobs are from the trainer's, and how fast it samples: FP8 rollouts against bf16 ones.

This runs one of our engines in process on MODEL (`--engine vllm --engine-args '{"quantization": "fp8"}'` is
FlashRL's setting: vLLM quantizes the bf16 checkpoint to FP8 as it loads it). It samples `--prompts` prompts, then
loads new weights (the model's own, perturbed by `--step` relative noise, seeded) as version 1, as a weight sync
does, and samples again: an engine that did not re-quantize what it loaded would drift from the trainer here. Each
sample's tokens are scored by the trainer's forward pass (transformers, `--trainer-dtype` on `--trainer-device`),
at temperature 1 and top-p 1, where raw and processed logprobs are the same.

For each version, over all sampled tokens, with r = trainer logprob - engine logprob:
- `kl_k1`: the mean of -r, an estimate of KL(engine || trainer), the samples being the engine's;
- `kl_k3`: the mean of exp(r) - 1 - r (non-negative, lower variance);
- `max_abs`, `mean_abs`: of r;
- `is_capped_fraction`: the share of tokens whose importance weight exp(r) exceeds `--is-cap`, which the trainer's
  truncated importance sampling (`--is-mode truncate --is-cap`) clips;
- `tokens_per_s`: generated tokens over the wall time of the whole batch.

JSON on stdout. Run it once per setting and compare, e.g. on a GPU machine:

    python benchmarks/probes/rollout_mismatch.py MODEL --engine vllm --dtype bfloat16 --trainer-device cuda
    python benchmarks/probes/rollout_mismatch.py MODEL --engine vllm --dtype bfloat16 --trainer-device cuda \
        --engine-args '{"quantization": "fp8"}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from consumers.engines import create_engine
from consumers.engines.base import Engine
from pipeline.wire import Sampling


def perturbed(tensors: dict[str, torch.Tensor], step: float, seed: int) -> dict[str, torch.Tensor]:
    """Each floating tensor plus noise of `step` times its own standard deviation: a training step's worth of change."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.numel() > 1:
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            tensor = (tensor.float() + step * tensor.float().std() * noise).to(tensor.dtype)
        out[name] = tensor
    return out


async def sample(engine: Engine, prompts: list[np.ndarray], max_tokens: int, tag: str) -> tuple[list[Any], float]:
    began = time.perf_counter()
    outs = await asyncio.gather(
        *[engine.generate(f"{tag}-{i}", prompt, Sampling(max_tokens=max_tokens, seed=i)) for i, prompt in
          enumerate(prompts)]
    )  # fmt: skip
    return list(outs), time.perf_counter() - began


def trainer_logprobs(model: Any, prompt: np.ndarray, tokens: np.ndarray, device: str) -> np.ndarray:
    ids = torch.tensor([np.concatenate([prompt, tokens]).tolist()], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(tokens) - 1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    return np.asarray(picked.cpu(), dtype=np.float64)


def mismatch(outs: list[Any], prompts: list[np.ndarray], model: Any, device: str, is_cap: float) -> dict[str, Any]:
    pairs = [(p, o) for p, o in zip(prompts, outs, strict=True) if len(o.tokens)]
    r = np.concatenate([trainer_logprobs(model, p, o.tokens, device) - o.logprobs.astype(np.float64) for p, o in pairs])
    return {
        "tokens": int(r.size),
        "kl_k1": float(np.mean(-r)),
        "kl_k3": float(np.mean(np.expm1(r) - r)),
        "max_abs": float(np.max(np.abs(r))),
        "mean_abs": float(np.mean(np.abs(r))),
        "is_capped_fraction": float(np.mean(np.exp(r) > is_cap)),
    }


def task_prompts(model_dir: Path, task: str, count: int, seed: int) -> list[np.ndarray]:
    """`count` train problems of `task` (`producers.tasks`) through the model's chat template: what a real run samples
    (the real model's replies end at its EOS, so their lengths are the model's own)."""
    from transformers import AutoTokenizer

    from producers.tasks import get_task

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = get_task(task).problems("train", count, seed=seed)
    rendered = [tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
                for p in problems]  # fmt: skip
    return [np.asarray(ids, dtype=np.int64) for ids in rendered]


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(args.model)
    options: dict[str, Any] = {"dtype": args.dtype}
    if args.engine == "vllm":
        options["engine_args"] = json.loads(args.engine_args)
    elif args.engine_args != "{}":
        raise SystemExit("--engine-args is for --engine vllm")
    else:
        options["device"] = args.engine_device
    engine = create_engine(args.engine, str(model_dir), **options)
    began = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - began
    dtype = getattr(torch, args.trainer_dtype)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.trainer_device).eval()
    rng = np.random.default_rng(args.seed)
    vocab = min(engine.vocab_size, trainer.config.vocab_size)
    if args.task:
        prompts = task_prompts(model_dir, args.task, args.prompts, args.seed)
    else:
        prompts = [rng.integers(3, vocab, size=args.prompt_len).astype(np.int64) for _ in range(args.prompts)]
    await sample(engine, prompts[:4], 4, "warm")  # compile and capture before anything is timed
    rows = []
    for version in (0, 1):
        if version:
            weights = perturbed(load_file(str(model_dir / "model.safetensors")), args.step, args.seed)
            await engine.pause("abort")
            await engine.load_tensors(weights, version)
            await engine.resume()
            trainer.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
        outs, wall = await sample(engine, prompts, args.max_tokens, f"v{version}")
        row = {"version": version, "tokens_per_s": sum(len(o.tokens) for o in outs) / wall, "wall_s": wall}
        row.update(mismatch(outs, prompts, trainer, args.trainer_device, args.is_cap))
        rows.append(row)
    await engine.shutdown()
    return {
        "engine": args.engine,
        "dtype": args.dtype,
        "engine_args": json.loads(args.engine_args),
        "trainer": f"{args.trainer_dtype} on {args.trainer_device}",
        "prompts": args.prompts,
        "task": args.task or None,
        "max_tokens": args.max_tokens,
        "start_s": start_s,
        "versions": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a safetensors checkpoint directory (tiny-model, or a random Qwen2)")
    parser.add_argument("--engine", choices=["vllm", "torch"], default="vllm")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype")
    parser.add_argument("--engine-args", default="{}", help="vLLM's engine arguments as JSON")
    parser.add_argument("--engine-device", default="cpu", help="the torch engine's device")
    parser.add_argument("--trainer-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--trainer-device", default="cpu")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--task", default="", help="chat prompts of this task (e.g. arithmetic:sum-1d), not random ids")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--step", type=float, default=0.01, help="the weight change of the sync, relative")
    parser.add_argument("--is-cap", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    print(json.dumps(asyncio.run(probe(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()

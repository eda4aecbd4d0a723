"""Rollout routing replay's question, asked of a vLLM build: does the engine return each token's routed experts,
and how often does the trainer's forward pass route a token to other experts than the engine did?

    python benchmarks/probes/moe_routing.py build DIR --hidden 1024 --layers 8 --experts 16 --top-k 2
    python benchmarks/probes/moe_routing.py run DIR --dtype bfloat16 --trainer-device cuda --prompts 64
    python benchmarks/probes/moe_routing.py reload DIR DIR_V1 --trainer-device cuda

`build` writes a random Qwen2-MoE with the shared tokenizer (`build_tiny_model(experts=...)`); run it in a process of
its own (a process that built a model with transformers and then started vLLM has hung on the device). `run` starts
vLLM's `LLM` with `enable_return_routed_experts` (and `enable_expert_parallel` with `--ep`), samples `--prompts`
sequences of `--max-tokens`, then runs transformers' model (`--trainer-dtype` on `--trainer-device`) over the same
tokens with `output_router_logits` and compares, token by token and layer by layer, the engine's experts with the
trainer's top-k. JSON on stdout: whether the build exposes the experts (and vLLM's refusal if not), the array's
shape against [sequence, layers, top_k], the share of (token, layer) pairs routed alike, and the engine's tokens/s.
`reload` asks whether the build reloads MoE weights right: vLLM (fp32, with the project's worker extension) serves
DIR, loads DIR_V1's tensors as a weight sync does (`rollouts_load_safetensors`), and the largest difference between
its logprobs and the trainer's forward pass is reported before (against DIR) and after (against DIR_V1). vLLM 0.32's
CPU build gets it wrong, which is why `VllmEngine` refuses a MoE reload on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def build(args: argparse.Namespace) -> dict[str, Any]:
    from consumers.engines.tiny_model import build_tiny_model

    build_tiny_model(
        Path(args.dir),
        seed=args.seed,
        hidden_size=args.hidden,
        num_layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
    )
    return {"built": args.dir, "hidden": args.hidden, "layers": args.layers, "experts": args.experts}


def sample(args: argparse.Namespace) -> tuple[list[tuple[list[int], list[int], Any]], float]:
    """Each sequence's prompt, generated tokens and routed experts (None when not returned); the engine's tokens/s."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args: dict[str, Any] = {
        "dtype": args.dtype,
        "max_model_len": 512,
        "enforce_eager": not args.cuda_graphs,
        "skip_tokenizer_init": True,
        "enable_return_routed_experts": True,
        "kv_cache_memory_bytes": args.kv_cache_bytes,
    }
    if args.ep:
        engine_args["enable_expert_parallel"] = True
    llm = LLM(model=args.dir, **engine_args)
    prompts = [[5 + i % 50, 6 + i % 7, 7, 8] for i in range(args.prompts)]
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i) for i in range(args.prompts)]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(requests[:1], params[0])  # warm-up
    began = time.perf_counter()
    outputs = llm.generate(requests, params)
    elapsed = time.perf_counter() - began
    rows = [(list(o.prompt_token_ids or []), list(o.outputs[0].token_ids), o.outputs[0].routed_experts)
            for o in outputs]  # fmt: skip
    return rows, sum(len(r[1]) for r in rows) / elapsed


def trainer_routes(model: Any, tokens: list[int]) -> Any:
    """The trainer's top-k experts per token and layer, [len(tokens), layers, top_k], each row sorted."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([tokens], device=model.device), output_router_logits=True)
    top_k = model.config.num_experts_per_tok
    per_layer = [logits.float().topk(top_k, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits]
    return torch.stack(per_layer, dim=1).cpu().numpy()


def trainer_model(directory: str, dtype: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers mistypes .to()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    config = json.loads((Path(args.dir) / "config.json").read_text())
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    report: dict[str, Any] = {"settings": vars(args), "expected_shape": ["sequence", layers, top_k]}
    try:
        rows, tokens_per_s = sample(args)
    except Exception as exc:  # the build refuses the setting: that is the answer
        return report | {"exposed": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    report["tokens_per_s"] = tokens_per_s
    routed = [r[2] for r in rows]
    if any(r is None for r in routed):
        return report | {"exposed": False, "error": "vLLM started, but its outputs carry no routed_experts"}
    report |= {"exposed": True, "shapes": sorted({tuple(int(d) for d in r.shape) for r in routed})[:5]}
    report["routed_alike"] = {}
    for dtype in args.trainer_dtype.split(","):
        model = trainer_model(args.dir, dtype, args.trainer_device)
        same = total = 0
        for prompt, generated, experts in rows:
            mine = trainer_routes(model, prompt + generated)
            theirs = np.sort(np.asarray(experts), axis=-1)
            length = min(len(mine), len(theirs))  # the last sampled token is never run forward by the engine
            matched = (mine[:length] == theirs[:length]).all(axis=-1)
            same += int(matched.sum())
            total += int(matched.size)
        report["routed_alike"][dtype] = same / total if total else None
        report["token_layers"] = total
    return report


def forward_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> Any:
    """The trainer's log-probability of each of `tokens` after `prompt` (raw: temperature 1)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + tokens], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None])[:, 0]
    return picked.cpu().numpy()


def reload(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from safetensors.torch import save
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from staleness.weights.sources import read_checkpoint

    llm = LLM(
        model=args.dir,
        dtype=args.dtype,
        max_model_len=512,
        enforce_eager=True,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        worker_extension_cls="consumers.engines.vllm_extension.RolloutsWorkerExtension",
    )
    prompts = [[5 + i, 6, 7, 8] for i in range(args.prompts)]

    def worst(directory: str) -> float:
        params = [SamplingParams(max_tokens=args.max_tokens, logprobs=0, seed=i) for i in range(len(prompts))]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        model = trainer_model(directory, args.trainer_dtype, args.trainer_device)
        gap = 0.0
        for prompt, output in zip(prompts, outputs, strict=True):
            sample = output.outputs[0]
            chosen = zip(sample.logprobs or [], sample.token_ids, strict=True)
            engine = np.array([entry[t].logprob for entry, t in chosen if entry is not None])
            gap = max(gap, float(np.abs(engine - forward_logprobs(model, prompt, list(sample.token_ids))).max()))
        return gap

    before = worst(args.dir)
    llm.collective_rpc("rollouts_load_safetensors", args=(save(read_checkpoint(Path(args.to))),))
    llm.reset_prefix_cache()
    after = worst(args.to)
    # Right: the reloaded engine matches the new version as closely as the fresh one matched the first (a GPU's fp32
    # kernels are not the trainer's: tens of millinats apart either way); a wrong reload is off by nats.
    return {
        "settings": vars(args),
        "max_abs_before": before,
        "max_abs_after": after,
        "reload_right": after <= max(1e-3, 2 * before),
    }


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the report's
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("build", help="write a random Qwen2-MoE to DIR")
    made.add_argument("dir")
    made.add_argument("--hidden", type=int, default=64)
    made.add_argument("--layers", type=int, default=2)
    made.add_argument("--experts", type=int, default=8)
    made.add_argument("--top-k", type=int, default=2)
    made.add_argument("--seed", type=int, default=0, help="the weights' seed (a second version: another seed)")
    ran = commands.add_parser("run", help="sample with vLLM, compare routes with the trainer's")
    ran.add_argument("dir")
    ran.add_argument("--dtype", default="float32", help="the engine's")
    ran.add_argument("--trainer-dtype", default="float32", help="one or more, by commas: each compared")
    ran.add_argument("--trainer-device", default="cpu")
    ran.add_argument("--prompts", type=int, default=4)
    ran.add_argument("--max-tokens", type=int, default=16)
    ran.add_argument("--kv-cache-bytes", type=int, default=1 << 28)
    ran.add_argument("--ep", action="store_true", help="vLLM's enable_expert_parallel")
    ran.add_argument("--cuda-graphs", action="store_true")
    reloaded = commands.add_parser("reload", help="serve DIR with vLLM, load TO's weights, compare before and after")
    reloaded.add_argument("dir")
    reloaded.add_argument("to")
    reloaded.add_argument("--dtype", default="float32", help="the engine's and the trainer's")
    reloaded.add_argument("--trainer-device", default="cpu")
    reloaded.add_argument("--prompts", type=int, default=4)
    reloaded.add_argument("--max-tokens", type=int, default=16)
    reloaded.add_argument("--kv-cache-bytes", type=int, default=1 << 28)
    args = parser.parse_args()
    if args.command == "reload":
        args.trainer_dtype = args.dtype
    command = {"build": build, "run": run, "reload": reload}[args.command]
    print(json.dumps(command(args), indent=2, default=str))


if __name__ == "__main__":
    main()

"""An independent reference: plain transformers forward passes, nothing from the engines."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from pipeline.wire import Rollout, Sampling


@cache
def load_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def forward_logprobs(model_dir: Path, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log p(tokens[i] | prompt + tokens[:i]) under the model's raw distribution, one forward pass."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.inference_mode():
        logits = load_model(Path(model_dir))(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logprobs[positions, torch.tensor(tokens, dtype=torch.long)].numpy()


def forward_routes(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """The experts each position of `tokens` is routed to in every layer of a mixture of experts, one forward pass:
    `[len(tokens), layers, top_k]`, each row sorted (the order within a top-k is the engine's own)."""
    model = load_model(Path(model_dir))
    with torch.inference_mode():
        out = model(torch.tensor([list(tokens)]), output_router_logits=True)
    config: Any = model.config  # a transformers model's
    top_k = int(config.num_experts_per_tok)
    layers = [logits.float().topk(top_k, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits]
    return torch.stack(layers, dim=1).numpy()


def forward_distributions(
    model_dir: Path, prompt: list[int], tokens: list[int], temperature: float = 0.0, top_p: float = 1.0
) -> torch.Tensor:
    """The next-token log-distribution before each of `tokens`, `[len(tokens), vocab]`, one forward pass over prompt +
    tokens: raw (log_softmax of the logits) or, with a temperature, processed: log_softmax(logits / temperature), then
    top-p (a token is dropped when the probability mass ranked above it already reaches `top_p`; the first always
    stays; -inf where dropped) and renormalized over what it kept."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.inference_mode():
        logits = load_model(Path(model_dir))(ids).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1]
    if not temperature:
        return torch.log_softmax(logits, dim=-1)
    scaled = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1:
        ranked, order = scaled.exp().sort(dim=-1, descending=True)
        dropped = torch.zeros_like(ranked, dtype=torch.bool).scatter(1, order, ranked.cumsum(-1) - ranked >= top_p)
        scaled = scaled.masked_fill(dropped, float("-inf"))
        scaled = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
    return scaled


def processed_logprobs(
    model_dir: Path, prompt: list[int], tokens: list[int], temperature: float, top_p: float = 1.0
) -> np.ndarray:
    """log p(tokens[i] | prompt + tokens[:i]) under the distribution each token was sampled from
    (`forward_distributions`). Greedy (temperature 0): the raw ones, nothing being applied (as vLLM's
    `processed_logprobs` reports them)."""
    if temperature == 0:
        return forward_logprobs(model_dir, prompt, tokens)
    scaled = forward_distributions(model_dir, prompt, tokens, temperature, top_p)
    return scaled[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].numpy()


def knob_distributions(
    model_dir: Path, prompt: list[int], tokens: list[int], sampling: Sampling, stop_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-token distributions before each of `tokens` (`[len(tokens), vocab]`, log-probabilities), one forward
    pass, with a `pipeline.wire.Sampling`'s knobs applied position by position as vLLM 0.32's sampler defines them
    (written out from its `Sampler`, `apply_penalties`, `MinPLogitsProcessor`, `apply_top_k_top_p`; nothing from the
    engines): `(raw, processed)`.

    At position i: `stop_ids` at -inf while i < `min_tokens`; every token of the prompt or of `tokens[:i]` has its
    logit divided by `repetition_penalty` when positive, multiplied when not; `frequency_penalty` times its count in
    `tokens[:i]` and `presence_penalty` (once, if there) subtracted. Greedy (temperature 0) stops there. Else the
    logits are divided by the temperature; `min_p` drops what is below `min_p` times the top probability; `top_k`
    drops what is below the k-th largest logit; `top_p` drops a token when the mass ranked above it reaches `top_p`."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.inference_mode():
        logits = load_model(Path(model_dir))(ids).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1]
    raw = torch.log_softmax(logits, dim=-1)
    rows = []
    for i in range(len(tokens)):
        row = logits[i].clone()
        if i < sampling.min_tokens:
            row[list(stop_ids)] = float("-inf")
        made = Counter(tokens[:i])
        for token in set(prompt) | set(made):
            value = float(row[token])
            row[token] = value / sampling.repetition_penalty if value > 0 else value * sampling.repetition_penalty
        for token, count in made.items():
            row[token] -= sampling.frequency_penalty * count + sampling.presence_penalty
        if sampling.temperature > 0:
            row = row / sampling.temperature
            if sampling.min_p > 0:
                probs = torch.softmax(row, dim=-1)
                row[probs < sampling.min_p * probs.max()] = float("-inf")
            if sampling.top_k > 0:
                kth = row.sort(descending=True).values[sampling.top_k - 1]
                row[row < kth] = float("-inf")
            if sampling.top_p < 1:
                probs = torch.softmax(row, dim=-1)
                ranked, order = probs.sort(descending=True)
                row[order[ranked.cumsum(-1) - ranked >= sampling.top_p]] = float("-inf")
        rows.append(torch.log_softmax(row, dim=-1))
    return raw, torch.stack(rows)


def knob_logprobs(
    model_dir: Path, prompt: list[int], tokens: list[int], sampling: Sampling, stop_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """`(raw, processed)` log p of each of `tokens` under `knob_distributions`."""
    picked = torch.tensor(tokens, dtype=torch.long)[:, None]
    raw, processed = knob_distributions(model_dir, prompt, tokens, sampling, stop_ids)
    return raw.gather(1, picked)[:, 0].numpy(), processed.gather(1, picked)[:, 0].numpy()


def kept_cache_log_softmax(
    weights: Mapping[int, Path], prompt: list[int], tokens: list[int], spans: Sequence[tuple[int, int, int]]
) -> torch.Tensor:
    """The next-token distributions (log_softmax, one row per token) of an engine that swaps weights between decode
    steps and keeps its KV cache (`pause("inflight")`), written out without any engine code.

    The model call that samples token i runs under token i's version (its span's) and feeds token i-1 (the whole
    prompt, for token 0) over the keys and values that the earlier calls wrote under their own versions. So each
    input position is run by the version of the token predicted from it, the prompt by the first token's, and a
    model of each version continues the `DynamicCache` the one before built: one pass per stretch of one version.
    """
    from transformers import DynamicCache

    version_of = [v for v, start, end in spans for _ in range(start, end)]
    assert len(version_of) == len(tokens), (spans, len(tokens))
    ids = list(prompt) + list(tokens[:-1])
    run_by = [version_of[0]] * len(prompt) + version_of[1:]  # position j of `ids` feeds the call predicting j + 1
    cache = DynamicCache()
    logits: list[torch.Tensor] = []
    start = 0
    with torch.inference_mode():
        while start < len(ids):
            end = start
            while end < len(ids) and run_by[end] == run_by[start]:
                end += 1
            out = load_model(Path(weights[run_by[start]]))(
                input_ids=torch.tensor([ids[start:end]]), past_key_values=cache, use_cache=True
            )
            cache = out.past_key_values
            logits.append(out.logits[0].float())
            start = end
    return torch.log_softmax(torch.cat(logits)[len(prompt) - 1 :], dim=-1)


def recomputed_log_softmax(model_dir: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The next-token distributions of `tokens` under one version over the whole prefix (a full recompute)."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.inference_mode():
        logits = load_model(Path(model_dir))(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1], dim=-1)


def random_prompts(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    """Token-id prompts of the given lengths (ids 6..511: no special tokens of the tiny model)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(6, 512, size=n, dtype=np.int32) for n in lengths]


def merged_model_dir(base_dir: Path, tensors: dict[str, torch.Tensor], config: dict, out_dir: Path) -> Path:
    """A plain transformers checkpoint of `base_dir` with a PEFT LoRA adapter merged in (W + alpha/r * B @ A), for
    `forward_logprobs`: the math written out here, independent of the engines' LoRA code."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    weights = model.state_dict()
    scale = float(config["lora_alpha"]) / int(config["r"])
    with torch.no_grad():
        for name, a in tensors.items():
            if not name.endswith(".lora_A.weight"):
                continue
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            weights[f"{module}.weight"] += scale * (b.float() @ a.float())
    model.load_state_dict(weights)
    model.save_pretrained(out_dir)
    return out_dir


def check_spans_and_logprobs(rollout: Rollout, weights: dict[int, Path]) -> None:
    """Spans cover every token in order, versions never go back, and each span's logprobs are its weights'."""
    assert rollout.spans[0][1] == 0 and rollout.spans[-1][2] == rollout.n_tokens
    for (v1, _, e1), (v2, s2, _) in zip(rollout.spans, rollout.spans[1:], strict=False):
        assert e1 == s2 and v1 < v2
    prompt, tokens = rollout.prompt_tokens.tolist(), rollout.tokens.tolist()
    for version, start, end in rollout.spans:
        expected = forward_logprobs(weights[version], prompt, tokens[:end])[start:end]
        np.testing.assert_allclose(rollout.logprobs[start:end], expected, atol=1e-4, err_msg=f"span {version}")


def check_kept_cache_spans(rollout: Rollout, weights: dict[int, Path]) -> None:
    """For samples of `inflight` syncs: spans cover every token in order, versions never go back, and the logprobs
    are those of each token's version over a KV cache that each earlier version wrote for its own stretch."""
    assert rollout.spans[0][1] == 0 and rollout.spans[-1][2] == rollout.n_tokens
    for (v1, _, e1), (v2, s2, _) in zip(rollout.spans, rollout.spans[1:], strict=False):
        assert e1 == s2 and v1 < v2
    tokens = rollout.tokens.tolist()
    mixed = kept_cache_log_softmax(weights, rollout.prompt_tokens.tolist(), tokens, rollout.spans)
    expected = mixed.gather(1, torch.tensor(tokens)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(rollout.logprobs, expected, atol=1e-4, err_msg=f"spans {rollout.spans}")

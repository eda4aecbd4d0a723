"""A tiny Qwen2 causal LM and byte-level BPE tokenizer, built locally for tests and the demo.

No run of this project downloads weights: tests, the demo and benchmarks build this model
in a temporary directory in well under a second. It is a real `Qwen2ForCausalLM` saved with
safetensors, loadable by `transformers` (`AutoModelForCausalLM`/`AutoTokenizer`) and by vLLM,
with a head size of 32 (the smallest vLLM's CPU attention accepts).

The tokenizer is the same for every `seed` (trained on fixed generated text), so checkpoints
of different seeds are interchangeable weight versions of one policy. The random init is
scaled up so that next-token distributions are peaked: a logprob check against a flat
distribution would pass for almost any bug.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

PAD, BOS, EOS = "<|endoftext|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)
VOCAB_SIZE = 512
TOKENIZER_SEED = 1234
"""Fixed: the tokenizer must not depend on the weights' seed."""
INIT_SCALE = 4.0
"""Multiplies every initialised weight matrix, so that logits are far from flat."""
LM_HEAD_SCALE = 4.0
"""And the output projection once more: next-token entropy ~3.4 nats against log(512) = 6.2."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_SUBJECTS = ["the cat", "a dog", "my friend", "the robot", "our teacher", "a bird", "the model", "she", "he", "they"]
_VERBS = ["sees", "likes", "counts", "finds", "reads", "writes", "moves", "paints", "builds", "opens"]
_OBJECTS = ["a red ball", "the old book", "three apples", "a small box", "the blue door", "many stars", "the river"]
_ENDINGS = ["today", "at night", "in the park", "slowly", "again", "with care", "before lunch", "."]
_SYLLABLES = ["ka", "lo", "mi", "ren", "sto", "va", "qui", "ber", "dan", "fel", "gor", "hu", "jin", "pra", "zel", "tor"]


def corpus(n_lines: int = 3000, seed: int = TOKENIZER_SEED) -> list[str]:
    """Deterministic English-ish sentences and arithmetic to train the tokenizer on."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        roll = rng.random()
        if roll < 0.3:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            op = rng.choice("+-*")
            value = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"What is {a} {op} {b}? The answer is {value}.")
        elif roll < 0.5:
            words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(rng.randint(3, 8))]
            lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
        else:
            sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
            lines.append(sentence[0].upper() + sentence[1:])
    return lines


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus()`; identical on every call (fixed text, deterministic trainer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # The same normalizer and pre-tokenizer as transformers' `Qwen2Tokenizer`, which `AutoTokenizer`
    # picks for a `qwen2` config whatever `tokenizer_class` says: both classes then encode alike.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    experts: int = 0,
    top_k: int = 2,
    init_scale: float = INIT_SCALE,
) -> Path:
    """Write a tiny Qwen2 causal LM (weights from `seed`) and the shared tokenizer into `out_dir`.

    `AutoTokenizer.from_pretrained(out_dir)` and `AutoModelForCausalLM.from_pretrained(out_dir)`
    both work offline; vLLM loads it too. Returns `out_dir`. `hidden_size` (a multiple of 32: one
    attention head per 32) and `num_layers` make larger random models, for benchmarks of size. With `experts`, a
    Qwen2-MoE instead: every layer's MLP is that many experts (each `hidden_size` wide), `top_k` of them per token,
    beside a shared expert. `init_scale` multiplies transformers' initial weights: the default makes sharp,
    varied next-token distributions in a small model; a large model (hidden 2048, 16 layers) built so is chaotic
    (bf16 rounding alone moves its logprobs by ~1 nat), and 1.0 is the setting for measuring numerics there.
    """
    if hidden_size % 32:
        raise ValueError(f"hidden_size must be a multiple of 32 (the head size), got {hidden_size}")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = cast(list[int], tokenizer.convert_tokens_to_ids([PAD, BOS, EOS]))  # a list of tokens: a list of ids
    moe: dict[str, Any] = (
        {
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": hidden_size,
            "shared_expert_intermediate_size": 2 * hidden_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": False,
        }
        if experts
        else {}
    )
    config = (Qwen2MoeConfig if experts else Qwen2Config)(
        **moe,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=hidden_size // 32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        pad_token_id=ids[0],
        bos_token_id=ids[1],
        eos_token_id=ids[2],
    )
    model_class = Qwen2MoeForCausalLM if experts else Qwen2ForCausalLM
    config.architectures = [model_class.__name__]
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)  # type: ignore[arg-type]  # transformers mistypes .to()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.ndim >= 2:  # 3: transformers 5's fused experts
                    param.mul_(init_scale * (LM_HEAD_SCALE if name == "lm_head.weight" else 1.0))
                elif name.endswith(".bias"):
                    param.normal_(0.0, 0.1)
    model.generation_config.bos_token_id = ids[1]
    model.generation_config.eos_token_id = ids[2]
    model.generation_config.pad_token_id = ids[0]
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _add_legacy_keys(out_dir / "config.json")
    return out_dir


def _add_legacy_keys(config_path: Path) -> None:
    """Write transformers 4's `torch_dtype` and `rope_theta` beside 5's `dtype` and `rope_parameters`.

    Readers that know only the old keys (older vLLM or transformers) then load the same model;
    transformers 5 folds them back into the new ones.
    """
    config = json.loads(config_path.read_text())
    config.setdefault("dtype", "float32")
    config.setdefault("torch_dtype", config["dtype"])
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make_adapter(
    model_dir: Path,
    favoured: Sequence[int],
    *,
    rank: int = 4,
    alpha: float = 8.0,
    target_modules: Sequence[str] = ("o_proj", "down_proj"),
    steps: int = 60,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train a LoRA adapter of the model in `model_dir` that strongly prefers the `favoured` token ids.

    Tests need adapters whose effect anyone can see: two adapters made with disjoint `favoured` sets
    generate clearly different tokens, each mostly from its own set (the tests tell them apart by that),
    and neither looks like the base model. Only the LoRA parameters train (plain torch, no peft: forward
    hooks add `scale * B(A x)` to the target layers), with Adam for `steps` steps on random token
    sequences, maximising the probability mass on `favoured` at every position; about a second on a CPU for the
    tiny model (a hidden-1024 24-layer one takes minutes there: `device="cuda"` trains it on a GPU). The random
    draws are the CPU's on every device. Returns PEFT-named float32 tensors on the CPU and an
    `adapter_config.json`-style dict (`save_adapter` writes both).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from consumers.engines.lora import is_target

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
    model.to(torch.device(device))
    generator = torch.Generator().manual_seed(seed)
    scale = alpha / rank
    params: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_target(path, tuple(target_modules)):
            bound = 1.0 / module.in_features**0.5  # PEFT's init: A uniform (kaiming), B zero
            a = ((torch.rand(rank, module.in_features, generator=generator) * 2 - 1) * bound).to(device)
            a.requires_grad_()
            b = torch.zeros(module.out_features, rank, device=device, requires_grad=True)
            params[path] = (a, b)
            hooks.append(module.register_forward_hook(_lora_training_hook(a, b, scale)))
    if not params:
        raise ValueError(f"no nn.Linear of {model_dir} matches target_modules {list(target_modules)}")
    try:
        _train_towards(model, params, torch.tensor(sorted(set(favoured)), device=device), steps, generator)
    finally:
        for hook in hooks:
            hook.remove()
    tensors = {}
    for path, (a, b) in params.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = a.detach().cpu().clone()
        tensors[f"base_model.model.{path}.lora_B.weight"] = b.detach().cpu().clone()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }
    return tensors, config


def _lora_training_hook(a: torch.Tensor, b: torch.Tensor, scale: float) -> Any:
    """A forward hook adding the LoRA term out of place (autograd sees it)."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return output + scale * (args[0] @ a.T) @ b.T

    return hook


def _train_towards(
    model: PreTrainedModel,
    params: dict[str, tuple[torch.Tensor, torch.Tensor]],
    favoured: torch.Tensor,
    steps: int,
    generator: torch.Generator,
) -> None:
    """Adam on the LoRA params: loss = -log P(next token in `favoured`), averaged over every position."""
    import torch

    optimizer = torch.optim.Adam([t for pair in params.values() for t in pair], lr=0.02)
    first = len(SPECIAL_TOKENS)  # ordinary tokens only: special ones never appear inside a text
    for _ in range(steps):
        ids = torch.randint(first, model.config.vocab_size, (16, 24), generator=generator).to(model.device)
        logprobs = model(input_ids=ids).logits.log_softmax(-1)
        loss = -logprobs[..., favoured].logsumexp(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-model")
    print(build_tiny_model(target, seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0))

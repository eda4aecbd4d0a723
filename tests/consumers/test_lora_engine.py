"""LoRA adapters in the `torch` engine against an independent reference: plain transformers models with
the adapter merged into the weights (`merged_state_dict`), one forward pass over prompt + tokens.

Every row of a batch, base or under any adapter, must get exactly its own model's logprobs; pausing,
aborting and replacing one adapter must leave every other request alone, and each token's version span
must name the adapter version it was generated under.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from consumers.engines.base import EngineClosedError, EngineInputError, Generation
from consumers.engines.lora import linear_shapes, merged_state_dict, parse_adapter, save_adapter
from consumers.engines.tiny_model import make_adapter
from consumers.engines.torch_engine import TorchEngine
from pipeline.wire import Sampling
from tests.engine_loop import wait_until_async
from tests.reference import load_model, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
"""As the base model's parity tests: fp32 engine against a fresh fp32 forward pass."""
FAV_A = frozenset(range(100, 108))
FAV_B = frozenset(range(300, 308))
FAV_A2 = frozenset(range(200, 208))
"""Version 2 of adapter "a" favours other tokens: which weights made a token shows in the tokens too."""
PROMPT = np.arange(10, 20, dtype=np.int32)
EOS = 2


@dataclass
class Lora:
    """An adapter made for the tests, with its reference: the base model with it merged in."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    favoured: frozenset[int]
    base_dir: Path

    @cached_property
    def reference(self) -> torch.nn.Module:
        return merged_model(self.base_dir, self)

    def on(self, base_dir: Path) -> torch.nn.Module:
        """The reference on other base weights (the adapter is the same tensors)."""
        return self.reference if base_dir == self.base_dir else merged_model(base_dir, self)


def merged_model(base_dir: Path, lora: Lora) -> torch.nn.Module:
    base = load_model(base_dir)
    parsed = parse_adapter(lora.tensors, lora.config, linear_shapes(base))
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model.load_state_dict(merged_state_dict(base.state_dict(), parsed))
    return model


def make(model_dir: Path, favoured: frozenset[int], seed: int) -> Lora:
    tensors, config = make_adapter(model_dir, sorted(favoured), seed=seed)
    return Lora(tensors, config, favoured, model_dir)


@pytest.fixture(scope="module")
def lora_a(tiny_model_dir: Path) -> Lora:
    return make(tiny_model_dir, FAV_A, seed=0)


@pytest.fixture(scope="module")
def lora_b(tiny_model_dir: Path) -> Lora:
    return make(tiny_model_dir, FAV_B, seed=1)


@pytest.fixture(scope="module")
def lora_a2(tiny_model_dir: Path) -> Lora:
    return make(tiny_model_dir, FAV_A2, seed=2)


def run(
    go: Callable[[TorchEngine], Awaitable[Any]],
    model_dir: Path,
    loras: Mapping[str, tuple[Lora, int]] | None = None,
    **engine_kwargs: Any,
) -> Any:
    """Run `go(engine)` on a fresh engine with these adapters loaded (name -> (adapter, version)), then shut down."""

    async def main() -> Any:
        async with TorchEngine(model_dir, num_threads=1, **engine_kwargs) as engine:
            for name, (lora, version) in (loras or {}).items():
                await engine.load_adapter(name, lora.tensors, lora.config, version)
            return await go(engine)

    return asyncio.run(main())


def model_logprobs(model: torch.nn.Module, prompt: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log p(tokens[i] | prompt + tokens[:i]) under `model`, one forward pass."""
    ids = torch.tensor([prompt.tolist() + tokens.tolist()])
    with torch.inference_mode():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logprobs[positions, torch.from_numpy(tokens.astype(np.int64))].numpy()


def assert_matches(
    model: torch.nn.Module, prompt: np.ndarray, gen: Generation, start: int = 0, end: int | None = None
) -> None:
    end = len(gen.tokens) if end is None else end
    expected = model_logprobs(model, prompt, gen.tokens[:end])[start:end]
    np.testing.assert_allclose(gen.logprobs[start:end], expected, rtol=0, atol=ATOL)


def greedy_reference(model: torch.nn.Module, prompt: np.ndarray, max_tokens: int) -> list[int]:
    """Token-by-token argmax over full forward passes (no cache, no batch, no hooks)."""
    ids = prompt.tolist()
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < max_tokens and (not out or out[-1] != EOS):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def share(tokens: np.ndarray, favoured: frozenset[int]) -> float:
    return float(np.isin(tokens, list(favoured)).mean())


# -- parity: each row is its own model --------------------------------------------------------------


def test_each_row_of_a_mixed_batch_equals_its_own_merged_model(
    tiny_model_dir: Path, lora_a: Lora, lora_b: Lora
) -> None:
    """Base, "a" and "b" rows in one batch, admitted into a running batch (max_batch 4 < 9 requests)."""
    adapters: list[str | None] = [None, "a", "b"] * 3
    prompts = random_prompts([3, 17, 40, 1, 9, 25, 60, 5, 12], seed=7)
    samplings = [
        Sampling(max_tokens=20 + 2 * i, temperature=0.0 if i % 4 == 0 else 1.0, seed=i) for i in range(len(prompts))
    ]

    async def go(engine: TorchEngine) -> list[Generation]:
        return await asyncio.gather(
            *[
                engine.generate(f"r{i}", p, s, adapter=a)
                for i, (p, s, a) in enumerate(zip(prompts, samplings, adapters, strict=True))
            ]
        )

    gens = run(go, tiny_model_dir, {"a": (lora_a, 1), "b": (lora_b, 5)}, max_batch=4)
    references = {None: load_model(tiny_model_dir), "a": lora_a.reference, "b": lora_b.reference}
    versions = {None: 0, "a": 1, "b": 5}
    for prompt, sampling, adapter, gen in zip(prompts, samplings, adapters, gens, strict=True):
        assert gen.spans == [(versions[adapter], 0, len(gen.tokens))]
        assert_matches(references[adapter], prompt, gen)
        if sampling.temperature == 0:
            assert gen.tokens.tolist() == greedy_reference(references[adapter], prompt, sampling.max_tokens)
    # Not vacuous: adapter rows are far from what the base model generates.
    assert min(share(g.tokens, FAV_A) for a, g in zip(adapters, gens, strict=True) if a == "a") > 0.8
    assert max(share(g.tokens, FAV_A | FAV_B) for a, g in zip(adapters, gens, strict=True) if a is None) < 0.2


def test_adapters_with_disjoint_favoured_sets_generate_their_own_tokens(
    tiny_model_dir: Path, lora_a: Lora, lora_b: Lora
) -> None:
    prompts = random_prompts([8, 8, 30, 30], seed=11)
    sampling = Sampling(max_tokens=24, temperature=1.0, seed=3)

    async def go(engine: TorchEngine) -> dict[str | None, list[Generation]]:
        runs = {
            adapter: [engine.generate(f"{adapter}-{i}", p, sampling, adapter=adapter) for i, p in enumerate(prompts)]
            for adapter in (None, "a", "b")
        }
        return {adapter: list(await asyncio.gather(*coros)) for adapter, coros in runs.items()}

    gens = run(go, tiny_model_dir, {"a": (lora_a, 1), "b": (lora_b, 1)})
    for gen_a, gen_b, gen_base in zip(gens["a"], gens["b"], gens[None], strict=True):
        assert gen_a.tokens.tolist() != gen_b.tokens.tolist()  # same prompt, same seed: only the adapter differs
        assert share(gen_a.tokens, FAV_A) > 0.8 and share(gen_a.tokens, FAV_B) < 0.05
        assert share(gen_b.tokens, FAV_B) > 0.8 and share(gen_b.tokens, FAV_A) < 0.05
        assert share(gen_base.tokens, FAV_A | FAV_B) < 0.2


def test_base_weight_load_recomputes_adapter_rows_under_the_new_base_keeping_the_adapter_version(
    tiny_model_dir: Path, tiny_model_dir_v1: Path, lora_a: Lora
) -> None:
    """Adapter versions are their own: a new base version changes the weights under an adapter row, not its label."""

    async def go(engine: TorchEngine) -> tuple[Generation, int]:
        request = asyncio.ensure_future(
            engine.generate("a", PROMPT, Sampling(max_tokens=300, temperature=1.0, seed=5), adapter="a")
        )
        await wait_until_async(lambda: engine.generated_tokens >= 5)
        await engine.pause("keep")
        k = engine.generated_tokens  # the only row: its tokens so far
        await engine.load_weights(str(tiny_model_dir_v1), version=1)
        await engine.resume()
        return await request, k

    gen, k = run(go, tiny_model_dir, {"a": (lora_a, 3)})
    assert gen.spans == [(3, 0, len(gen.tokens))] and 5 <= k < len(gen.tokens)
    assert_matches(lora_a.reference, PROMPT, gen, 0, k)
    assert_matches(lora_a.on(tiny_model_dir_v1), PROMPT, gen, k)


# -- pausing one adapter --------------------------------------------------------------------------


def test_pause_adapter_abort_ends_only_that_adapters_requests(tiny_model_dir: Path, lora_a: Lora, lora_b: Lora) -> None:
    long = Sampling(max_tokens=400, temperature=1.0, seed=9)
    short = Sampling(max_tokens=40, temperature=1.0, seed=10)
    order = [("a1", "a", long), ("b", "b", short), ("base", None, short), ("a2", "a", long), ("a3", "a", long)]

    async def go(engine: TorchEngine) -> tuple[dict[str, Generation], Generation]:
        tasks = {rid: asyncio.ensure_future(engine.generate(rid, PROMPT, s, adapter=a)) for rid, a, s in order}
        await wait_until_async(lambda: engine.generated_tokens >= 8)  # 4 rows run, "a3" waits (max_batch=4)
        await engine.pause_adapter("a", "abort")
        ended = {rid: await tasks[rid] for rid in ("a1", "a2", "a3")}  # settled as the pause returns
        others = {rid: await tasks[rid] for rid in ("b", "base")}
        gated = asyncio.ensure_future(engine.generate("a4", PROMPT, Sampling(max_tokens=5, seed=1), adapter="a"))
        await engine.generate("b-after", PROMPT, short, adapter="b")  # b goes on while "a" stays paused
        assert not gated.done()
        await engine.resume_adapter("a")
        assert len((await gated).tokens) == 5
        return {**ended, **others}, await engine.generate("base-after", PROMPT, short)

    gens, _ = run(go, tiny_model_dir, {"a": (lora_a, 1), "b": (lora_b, 1)}, max_batch=4)
    for rid in ("a1", "a2"):
        assert gens[rid].finish_reason == "abort" and 2 <= len(gens[rid].tokens) < 400
        assert gens[rid].spans == [(1, 0, len(gens[rid].tokens))]
        assert_matches(lora_a.reference, PROMPT, gens[rid])
    assert gens["a3"].finish_reason == "abort" and len(gens["a3"].tokens) == 0 and gens["a3"].spans == []
    for rid, model in (("b", lora_b.reference), ("base", load_model(tiny_model_dir))):
        assert gens[rid].finish_reason in ("length", "stop")
        assert_matches(model, PROMPT, gens[rid])


def test_pause_adapter_keep_reload_resume_continues_under_the_new_version(
    tiny_model_dir: Path, lora_a: Lora, lora_a2: Lora, lora_b: Lora
) -> None:
    fresh_prompt = random_prompts([6], seed=12)[0]

    async def go(engine: TorchEngine) -> tuple[Generation, Generation, int]:
        kept = asyncio.ensure_future(
            engine.generate("kept", PROMPT, Sampling(max_tokens=300, temperature=1.0, seed=7), adapter="a")
        )
        await wait_until_async(lambda: engine.generated_tokens >= 5)
        await engine.pause_adapter("a", "keep")
        k = engine.generated_tokens
        assert engine.stats()["held"] == 1 and engine.stats()["running"] == 0
        fresh = asyncio.ensure_future(
            engine.generate("fresh", fresh_prompt, Sampling(max_tokens=20, temperature=1.0, seed=8), adapter="a")
        )
        # While "a" is paused, "b" requests queued behind "fresh" run to the end; nothing of "a" moves.
        b_gens = await asyncio.gather(
            *[engine.generate(f"b{i}", PROMPT, Sampling(max_tokens=15), "b") for i in range(3)]
        )
        assert engine.generated_tokens - sum(len(g.tokens) for g in b_gens) == k
        assert not kept.done() and not fresh.done() and engine.stats()["waiting"] == 1
        await engine.load_adapter("a", lora_a2.tensors, lora_a2.config, version=2)
        assert engine.adapters() == {"a": 2, "b": 1}
        await engine.resume_adapter("a")
        return await kept, await fresh, k

    kept, fresh, k = run(go, tiny_model_dir, {"a": (lora_a, 1), "b": (lora_b, 1)})
    n = len(kept.tokens)
    assert kept.spans == [(1, 0, k), (2, k, n)] and 5 <= k < n, kept.spans
    assert_matches(lora_a.reference, PROMPT, kept, 0, k)  # v1 for the tokens before the pause
    assert_matches(lora_a2.reference, PROMPT, kept, k, n)  # v2 over prompt + tokens so far, after it
    assert share(kept.tokens[:k], FAV_A) > 0.8 and share(kept.tokens[k:], FAV_A2) > 0.8
    assert fresh.spans == [(2, 0, len(fresh.tokens))]
    assert_matches(lora_a2.reference, fresh_prompt, fresh)


def test_held_requests_end_on_abort_global_pause_and_shutdown(tiny_model_dir: Path, lora_a: Lora) -> None:
    long = Sampling(max_tokens=400, temperature=1.0, seed=9)

    async def go(engine: TorchEngine) -> None:
        first, second = (asyncio.ensure_future(engine.generate(r, PROMPT, long, adapter="a")) for r in ("h1", "h2"))
        await wait_until_async(lambda: engine.generated_tokens >= 6)
        await engine.pause_adapter("a", "keep")
        held = engine.generated_tokens
        await engine.abort(["h1"])
        one = await first
        assert one.finish_reason == "abort" and len(one.tokens) > 0 and one.spans == [(1, 0, len(one.tokens))]
        await engine.pause("abort")  # the global abort-pause ends held requests too
        two = await second
        assert two.finish_reason == "abort" and len(one.tokens) + len(two.tokens) == held
        assert engine.stats()["held"] == 0
        await engine.resume()
        await engine.resume_adapter("a")
        third = asyncio.ensure_future(engine.generate("h3", PROMPT, long, adapter="a"))
        await wait_until_async(lambda: engine.generated_tokens >= held + 3)
        await engine.pause_adapter("a", "keep")
        await engine.shutdown()
        with pytest.raises(EngineClosedError):
            await third

    run(go, tiny_model_dir, {"a": (lora_a, 1)})


# -- limits and refusals ----------------------------------------------------------------------------


def test_max_loras_and_remove_adapter_rules(tiny_model_dir: Path, lora_a: Lora, lora_b: Lora) -> None:
    async def go(engine: TorchEngine) -> None:
        with pytest.raises(ValueError, match=r"max_loras=2 slots hold adapters \['a', 'b'\]"):
            await engine.load_adapter("c", lora_a.tensors, lora_a.config, version=1)
        assert engine.adapters() == {"a": 1, "b": 1}
        await engine.load_adapter("b", lora_b.tensors, lora_b.config, version=2)  # replacing takes no new slot
        with pytest.raises(EngineInputError, match=r"adapter 'c' is not loaded; loaded: \['a', 'b'\]"):
            await engine.generate("c", PROMPT, Sampling(), adapter="c")
        live = asyncio.ensure_future(engine.generate("live", PROMPT, Sampling(max_tokens=400, seed=4), adapter="a"))
        await wait_until_async(lambda: engine.generated_tokens >= 2)
        with pytest.raises(ValueError, match=r"adapter 'a' has 1 requests in flight \(\['live'\]\)"):
            await engine.remove_adapter("a")
        await engine.pause_adapter("a", "keep")
        with pytest.raises(ValueError, match="in flight"):  # held is in flight too
            await engine.remove_adapter("a")
        await engine.abort(["live"])
        assert (await live).finish_reason == "abort"
        await engine.remove_adapter("a")
        await engine.remove_adapter("never-loaded")
        # numpy arrays load as well as torch tensors.
        await engine.load_adapter("c", {k: v.numpy() for k, v in lora_a.tensors.items()}, lora_a.config, version=3)
        assert engine.adapters() == {"b": 2, "c": 3}
        gen = await engine.generate("c", PROMPT, Sampling(max_tokens=8, temperature=1.0, seed=2), adapter="c")
        assert gen.spans == [(3, 0, 8)]
        assert_matches(lora_a.reference, PROMPT, gen)

    run(go, tiny_model_dir, {"a": (lora_a, 1), "b": (lora_b, 1)}, max_loras=2)


def test_an_engine_without_adapter_slots_refuses_adapters(tiny_model_dir: Path, lora_a: Lora) -> None:
    engine = TorchEngine(tiny_model_dir, max_loras=0)
    assert engine.max_loras == 0
    with pytest.raises(EngineInputError, match=r"serves no adapters \(max_loras=0\)"):
        asyncio.run(engine.generate("x", PROMPT, Sampling(), adapter="a"))
    with pytest.raises(ValueError, match=r"serves no adapters \(max_loras=0\)"):
        asyncio.run(engine.load_adapter("a", lora_a.tensors, lora_a.config, version=1))


A_O0 = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
B_O0 = "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"
A_DOWN1 = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"


def _renamed(tensors: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    return {new if k == old else k: v for k, v in tensors.items()}


BAD_ADAPTERS: list[tuple[str, Callable[[dict, dict], tuple[dict, dict]], str]] = [
    ("missing B", lambda t, c: ({k: v for k, v in t.items() if k != B_O0}, c), rf"'{A_O0}' has no matching .*lora_B"),
    (
        "unknown module",
        lambda t, c: (_renamed(t, A_DOWN1, A_DOWN1.replace("layers.1", "layers.9")), c),
        r"layers\.9\.mlp\.down_proj.lora_A.weight': the model has no module 'model\.layers\.9\.mlp\.down_proj'",
    ),
    (
        "not a Linear",
        lambda t, c: ({**t, "base_model.model.model.norm.lora_A.weight": torch.zeros(4, 64)}, c),
        r"'base_model\.model\.model\.norm\.lora_A\.weight': module 'model\.norm' is a Qwen2RMSNorm, not an nn\.Linear",
    ),
    (
        "not PEFT names",
        lambda t, c: (_renamed(t, A_O0, A_O0.removeprefix("base_model.model.")), c),
        r"'model\.layers\.0\.self_attn\.o_proj\.lora_A\.weight' is not named like a PEFT LoRA tensor",
    ),
    (
        "in_features",
        lambda t, c: ({**t, A_DOWN1: torch.zeros(4, 64)}, c),
        rf"'{A_DOWN1}' has shape \[4, 64\], expected \[r=4, in_features=128\]",
    ),
    (
        "rank of B",
        lambda t, c: ({**t, B_O0: torch.zeros(64, 3)}, c),
        rf"'{B_O0}' has shape \[64, 3\], expected \[out_features=64, r=4\]",
    ),
    (
        "not targeted",
        lambda t, c: ({**t, A_O0.replace("o_proj", "q_proj"): torch.zeros(4, 64)}, c),
        r"module 'model\.layers\.0\.self_attn\.q_proj' is not among target_modules",
    ),
    ("r < 1", lambda t, c: (t, {**c, "r": 0}), r"r must be an integer >= 1, got 0"),
    ("alpha", lambda t, c: (t, {**c, "lora_alpha": "8"}), r"lora_alpha must be a finite number, got '8'"),
]


def test_bad_adapters_are_refused_naming_what_is_wrong(tiny_model_dir: Path, lora_a: Lora) -> None:
    async def go(engine: TorchEngine) -> Generation:
        for case, mutate, message in BAD_ADAPTERS:
            tensors, config = mutate(dict(lora_a.tensors), dict(lora_a.config))
            with pytest.raises(ValueError, match=message):
                await engine.load_adapter("a", tensors, config, version=2)
            assert engine.adapters() == {"a": 1}, case  # nothing loaded, nothing replaced
        return await engine.generate("ok", PROMPT, Sampling(max_tokens=10, temperature=1.0, seed=1), adapter="a")

    gen = run(go, tiny_model_dir, {"a": (lora_a, 1)})
    assert gen.spans == [(1, 0, 10)]
    assert_matches(lora_a.reference, PROMPT, gen)


def test_save_adapter_writes_peft_files(tiny_model_dir: Path, lora_a: Lora, tmp_path: Path) -> None:
    out = save_adapter(lora_a.tensors, lora_a.config, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == ["o_proj", "down_proj"]
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert tensors.keys() == lora_a.tensors.keys()
    assert all(torch.equal(tensors[k], v) and v.dtype == torch.float32 for k, v in lora_a.tensors.items())
    assert len(parse_adapter(tensors, config, linear_shapes(load_model(tiny_model_dir))).modules) == 4

"""The synthetic engine: the whole engine protocol with no model, for soak, chaos and scale runs.

It must behave like an engine where the pipeline can tell: seeded samples are the same on any
worker and in any batch, lengths follow the distribution asked for, it cannot generate faster than
its pace, both pause modes keep every token with the version that made it, and through a real
worker it serves prompts and takes weight syncs from every transport like the others.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import consumers.engines.model_files as model_files
from consumers.engines import create_engine
from consumers.engines.base import EngineInputError
from consumers.engines.model_files import _plain_text_config, read_model_limits
from consumers.engines.synthetic_engine import SyntheticEngine, parse_lengths
from pipeline.local import RedisServer, free_port
from pipeline.wire import Sampling
from producers.client import RolloutClient
from tests.engine_loop import wait_until_async
from tests.fixtures import StartWorker, wait_until

PROMPT = np.array([5, 6, 7], dtype=np.int32)


def run(coro_fn, **options):
    async def main():
        async with SyntheticEngine(**options) as engine:
            return await coro_fn(engine)

    return asyncio.run(main())


def test_seeded_samples_are_the_same_alone_and_in_a_batch_and_lengths_follow_the_spec() -> None:
    async def go(engine: SyntheticEngine):
        alone = await engine.generate("a", PROMPT, Sampling(max_tokens=64, seed=7))
        batch = await asyncio.gather(
            *(engine.generate(f"b{i}", PROMPT, Sampling(max_tokens=64, seed=i)) for i in range(20))
        )
        return alone, batch

    alone, batch = run(go, steps_per_s=5000, lengths="pareto:1.2", min_tokens=4, seed=0)
    assert np.array_equal(alone.tokens, batch[7].tokens) and np.array_equal(alone.logprobs, batch[7].logprobs)
    lengths = [len(g.tokens) for g in batch]
    assert min(lengths) >= 4 and max(lengths) <= 64 and len(set(lengths)) > 3, lengths
    for g in batch:  # a short sample ends with eos; a full one on max_tokens; logprobs are real logprobs
        assert g.finish_reason == ("length" if len(g.tokens) == 64 else "stop")
        assert (g.finish_reason == "stop") == (g.tokens[-1] == 2) and (g.logprobs <= 0).all()
        assert g.spans == [(0, 0, len(g.tokens))]
    rng = np.random.default_rng(0)
    assert {parse_lengths("uniform:3-5", 1)(rng, 100) for _ in range(200)} == {3, 4, 5}
    assert parse_lengths("max", 1)(rng, 37) == 37
    for bad in ("pareto:-1", "uniform:5-3", "gauss", "max:2"):
        with pytest.raises(ValueError, match="use max, pareto"):
            parse_lengths(bad, 1)


def test_it_keeps_its_pace_and_both_pause_modes_keep_every_token_with_its_version() -> None:
    async def go(engine: SyntheticEngine):
        started = time.monotonic()
        paced = await engine.generate("paced", PROMPT, Sampling(max_tokens=50, seed=1))
        took = time.monotonic() - started
        kept = asyncio.ensure_future(engine.generate("keep", PROMPT, Sampling(max_tokens=300, seed=2)))
        await wait_until_async(lambda: engine.tokens_so_far("keep") >= 20)  # some tokens under version 0
        await engine.pause("keep")
        await engine.load_tensors({"w": np.zeros(2)}, 1)
        await engine.resume()
        whole = await kept
        cut = asyncio.ensure_future(engine.generate("abort", PROMPT, Sampling(max_tokens=300, seed=2)))
        await wait_until_async(lambda: engine.tokens_so_far("abort") >= 20)
        await engine.pause("abort")
        partial = await cut
        await engine.resume()
        return took, paced, whole, partial

    took, paced, whole, partial = run(go, steps_per_s=500, seed=0)
    assert len(paced.tokens) == 50 and took >= 50 / 500 * 0.9, "never faster than its pace"
    assert whole.finish_reason == "length" and len(whole.tokens) == 300
    assert [v for v, _, _ in whole.spans] == [0, 1] and whole.spans[-1][2] == 300 and whole.spans[0][1] == 0
    assert whole.spans[0][2] == whole.spans[1][1] > 0, "tokens before the pause are version 0's"
    assert partial.finish_reason == "abort" and 0 < len(partial.tokens) < 300
    assert np.array_equal(partial.tokens, whole.tokens[: len(partial.tokens)]), "same seed, same sample"
    assert partial.spans == [(1, 0, len(partial.tokens))]


def test_bad_requests_and_options_are_refused_with_what_to_fix(tmp_path: Path) -> None:
    async def go(engine: SyntheticEngine):
        with pytest.raises(EngineInputError, match="token ids must be in"):
            await engine.generate("x", np.array([5, 10**6]), Sampling())
        with pytest.raises(EngineInputError, match="max_tokens must be >= 1"):
            await engine.generate("y", PROMPT, Sampling(max_tokens=0))
        with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
            await engine.load_weights(str(tmp_path / "missing"), 3)

    run(go)
    with pytest.raises(ValueError, match="steps_per_s must be > 0"):
        create_engine("synthetic", "synthetic", steps_per_s=0)


@pytest.mark.fresh_processes  # what it checks is what the process imports
def test_a_synthetic_worker_serves_prompts_and_takes_weight_syncs(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    tmp_path: Path,
) -> None:
    """Through the real CLI (`--engine synthetic`), with the tiny model's directory only for its limits. It never
    imports torch (1.5-2.5 s of a start) until a sync brings it tensors."""
    pace = '{"steps_per_s": 100, "lengths": "uniform:150-200"}'
    worker = workers("syn", "--engine", "synthetic", "--engine-args", pace)
    client = RolloutClient(redis_server.url, ns)
    client.submit(tokens=[4, 9], n=1, max_tokens=4, seed=0)
    assert len(client.collect(1, timeout=30)) == 1
    assert not holds_torch(worker.pid), "the synthetic worker imported torch to start, serve and publish"
    assert client.publish_weights(tiny_model_dir, transport="redis://") == 1
    assert holds_torch(worker.pid), "a sync's tensors, loaded: torch (and the check sees it)"
    ids = [client.submit(tokens=[5 + i, 9], n=2, max_tokens=200, seed=i) for i in range(8)]
    wait_until(lambda: int(client.streams.redis.hget(client.streams.keys.worker("syn"), "inflight") or 0) > 0, 30,
               "generation to start")  # fmt: skip
    assert client.publish_weights(tiny_model_dir_v1, transport="redis://", mode="abort") == 2
    assert client.publish_weights(tiny_model_dir, transport=f"fs://{tmp_path / 'w'}", mode="keep") == 3
    assert client.publish_weights(tiny_model_dir_v1, transport=f"nccl://127.0.0.1:{free_port()}") == 4
    groups = client.collect(len(ids), timeout=120)
    rollouts = [r for g in groups for r in g.rollouts]
    assert sorted(g.prompt_id for g in groups) == sorted(ids) and client.stats["duplicates"] == 0
    for r in rollouts:
        assert 150 <= r.n_tokens <= 200 and r.spans[0][1] == 0 and r.spans[-1][2] == r.n_tokens
        assert all(a[2] == b[1] for a, b in zip(r.spans, r.spans[1:], strict=False)), r.spans
    assert any(len(r.spans) >= 2 for r in rollouts), "samples ran across the syncs"
    assert client.streams.redis.hget(client.streams.keys.worker("syn"), "version") == b"4"


def holds_torch(pid: int) -> bool:
    """Whether process `pid` imported torch: its native library is mapped in the process (Linux's /proc)."""
    return "/libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_model_limits_come_from_the_config_file_as_transformers_reads_them(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synthetic or remote worker reads its model's limits from `config.json` without importing transformers
    (which took ~5 s of its start), and gets what transformers would say; a config the file alone cannot answer
    (an aliased field, a class default, a composite model) goes to transformers."""
    probe = (
        "import sys; from pathlib import Path; from consumers.engines.model_files import read_model_limits; "
        f"print(repr(read_model_limits(Path({str(tiny_model_dir)!r}), None))); print('transformers' in sys.modules)"
    )
    run_probe = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run_probe.returncode == 0, run_probe.stderr
    from_file, imported = run_probe.stdout.splitlines()
    assert imported == "False", "reading the limits imported transformers"

    gpt2 = tmp_path / "gpt2"  # `n_positions` stands for max_position_embeddings, and pad_token_id is a default
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64, "vocab_size": 100}))
    composite = tmp_path / "composite"  # the text decoder's config is nested in the model's
    composite.mkdir()
    text = json.loads((tiny_model_dir / "config.json").read_text()) | {"max_position_embeddings": 96}
    outer = {"max_position_embeddings": 8, "vocab_size": 7, "eos_token_id": 1, "pad_token_id": 0}  # not the text's
    (composite / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text} | outer))
    assert _plain_text_config(gpt2) is None and _plain_text_config(composite) is None
    assert (read_model_limits(gpt2, None).max_model_len, read_model_limits(gpt2, 32).max_model_len) == (64, 32)
    nested = read_model_limits(composite, None)
    assert (nested.max_model_len, nested.vocab_size) == (96, 512)

    monkeypatch.setattr(model_files, "_plain_text_config", lambda model_dir: None)  # every field from transformers
    assert from_file == repr(read_model_limits(tiny_model_dir, None))

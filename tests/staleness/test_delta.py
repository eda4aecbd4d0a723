"""Delta syncs (`staleness.weights.delta`): what changed since a version a worker holds, applied bit for bit."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.local import RedisServer
from pipeline.wire import Control, Rollout
from producers.client import RolloutClient
from staleness.weights import open_transport, transport_of
from staleness.weights.base import Fetched, Receiving, parse_uri
from staleness.weights.delta import CHUNK_WORDS, Delta, DeltaError, HeldWeights, apply, chain, encode
from staleness.weights.fs_delta import PAYLOAD
from staleness.weights.sources import read_checkpoint
from tests.fixtures import StartWorker, wait_until


def buffers(words: int, changed: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A buffer of bf16-like words and a copy with a share `changed` of them moved by a few low bits."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0x3A00, 0x3F00, size=words, dtype=np.uint16)  # bf16 values ~0.0005-0.5
    new = old.copy()
    moved = rng.random(words) < changed
    new[moved] ^= rng.integers(1, 4, size=int(moved.sum()), dtype=np.uint16)
    return old.view(np.uint8), new.view(np.uint8)


@settings(max_examples=25, deadline=None)
@given(
    words=st.integers(0, 3 * 4096 + 7), changed=st.sampled_from([0.0, 0.001, 0.04, 0.3, 1.0]), seed=st.integers(0, 9)
)
def test_a_delta_applied_to_its_base_is_the_new_version_bit_for_bit(words: int, changed: float, seed: int) -> None:
    old, new = buffers(words, changed, seed)
    delta = encode(old, new, 3, 4, full_ratio=10.0, chunk_words=4096)  # several chunks, the last one short
    assert delta is not None and np.array_equal(apply(old, delta), new)
    again = Delta.read(delta.header(), delta.payload())
    assert again == delta and np.array_equal(apply(old, again), new)


def test_a_few_percent_changed_costs_a_few_percent_and_nearly_all_changed_is_sent_whole() -> None:
    old, new = buffers(CHUNK_WORDS + 1000, 0.04)
    delta = encode(old, new, 0, 1)
    assert delta is not None and delta.nbytes < 0.1 * new.size and abs(delta.changed / (new.size // 2) - 0.04) < 0.01
    rng = np.random.default_rng(0)
    old, new = (rng.integers(0, 2**16, size=1000, dtype=np.uint16).view(np.uint8) for _ in range(2))
    assert encode(old, new, 0, 1) is None, "a delta larger than half the version: send it whole"


def test_a_delta_applied_to_another_base_or_corrupted_is_refused_not_loaded() -> None:
    old, new = buffers(5000, 0.05, seed=1)
    other, _ = buffers(5000, 0.05, seed=2)
    delta = encode(old, new, 7, 8)
    assert delta is not None
    with pytest.raises(DeltaError, match="not version 7's"):
        apply(other, delta)
    with pytest.raises(DeltaError, match="another layout"):
        apply(old[:-2], delta)
    header, payload = delta.header(), bytearray(delta.payload())
    payload[len(payload) // 2] ^= 0xFF
    with pytest.raises(DeltaError):
        apply(old, Delta.read(header, bytes(payload)))
    with pytest.raises(DeltaError, match="the header says"):
        Delta.read(header, bytes(payload) + b"x")
    with pytest.raises(DeltaError, match="not a delta header"):
        Delta.read(b"{}", b"")


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().to(torch.bfloat16).view(torch.int16).flatten() for p in model.parameters()]).numpy()


def test_a_chain_of_deltas_over_real_adamw_steps_equals_the_last_version_and_a_broken_chain_is_refused(
    tiny_model_dir: Path,
) -> None:
    """Real optimizer steps of the tiny model in bf16 (AdamW at 2e-5, the real demo's): each version's delta from the
    one before, applied in turn to version 0, is the last version bit for bit."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    versions = [flat(model).view(np.uint8)]
    for _ in range(4):
        ids = torch.randint(0, model.config.vocab_size, (4, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        versions.append(flat(model).view(np.uint8))
    steps = [encode(a, b, v, v + 1, full_ratio=1.0) for v, (a, b) in enumerate(itertools.pairwise(versions))]
    assert all(d is not None and d.changed > 0 for d in steps), "every step changes something"
    assert np.array_equal(chain(versions[0], [d for d in steps if d is not None]), versions[-1])
    with pytest.raises(DeltaError, match="a chain breaks"):
        chain(versions[0], [d for d in steps[:1] + steps[2:] if d is not None])


def drifting_versions(count: int) -> list[dict[str, torch.Tensor]]:
    """`count` versions of two bf16 tensors, each with ~3 % of its elements moved by a step from the one before."""
    generator = torch.Generator().manual_seed(0)
    current = {"a.weight": torch.randn(96, 160, generator=generator).to(torch.bfloat16),
               "b.bias": torch.randn(1001, generator=generator).to(torch.bfloat16)}  # fmt: skip
    versions = []
    for _ in range(count):
        current = {name: torch.where(torch.rand(t.shape, generator=generator) < 0.03, t * 1.01, t).to(torch.bfloat16)
                   for name, t in current.items()}  # fmt: skip
        versions.append(current)
    return versions


def loaded(fetched: Fetched) -> dict[str, torch.Tensor]:
    return read_checkpoint(fetched) if isinstance(fetched, Path) else fetched


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


@pytest.mark.parametrize("scheme", ["redis", "fs"])
def test_the_chain_is_cut_every_full_every_and_a_worker_that_missed_a_sync_loads_the_whole_version_bit_for_bit(
    scheme: str, redis_server: RedisServer, ns: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Seven versions published with deltas and `full_every=3`: versions 1, 4 and 7 go whole only (no delta: a
    worker applies at most two in a row), the others with their delta from the one before. A worker that follows
    every version reads those deltas; one that missed versions 3 and 4 (it holds 2) reads version 5 whole, though
    5 has a delta (from 4), then 6 by its delta; each gets every version bit for bit."""
    client = RolloutClient(redis_server.url, ns).streams.redis
    spec = "redis://" if scheme == "redis" else f"fs://{tmp_path / 'versions'}"
    trainer = HeldWeights(full_every=3)
    versions = drifting_versions(7)
    uris, sent = [], []
    for number, tensors in enumerate(versions, 1):
        store = open_transport(spec, redis_client=client, ns=ns, held=trainer)
        uris.append(store.publish(tensors, number))
        assert store.last_publish is not None
        sent.append(store.last_publish.delta_bytes is not None)
    assert sent == [False, True, True, False, True, True, False], "the chain is cut at every third version"

    def fetch(number: int, held: HeldWeights) -> tuple[dict[str, torch.Tensor], bool]:
        caplog.clear()
        uri = uris[number - 1]
        with caplog.at_level(logging.INFO, logger="staleness.weights"):
            got = loaded(transport_of(uri).fetch_received(parse_uri(uri), number, Receiving(client, held=held)))
        assert same(got, versions[number - 1]), f"version {number} bit for bit"
        return got, f"weights version {number}: its delta from version {number - 1} applied" in caplog.text

    follower = HeldWeights()
    by_delta = [fetch(number, follower)[1] for number in range(1, 8)]
    assert by_delta == sent, "every delta sent is the one read, and only those"
    assert follower.version == 7 and follower.chain == 0
    behind = HeldWeights()
    assert [fetch(number, behind)[1] for number in (1, 2, 5, 6)] == [False, True, False, True]


def test_an_fs_delta_that_does_not_check_is_not_loaded_and_the_version_is_read_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer, worker = HeldWeights(), HeldWeights()
    versions = drifting_versions(2)
    for number, tensors in enumerate(versions, 1):
        open_transport(f"fs://{tmp_path}", held=trainer).publish(tensors, number)
    payload = tmp_path / "v2" / PAYLOAD
    corrupted = bytearray(payload.read_bytes())
    corrupted[len(corrupted) // 2] ^= 0xFF
    payload.write_bytes(bytes(corrupted))
    for number in (1, 2):
        uri = parse_uri(f"fs://{tmp_path}/v{number}")
        got = transport_of(uri).fetch_received(uri, number, Receiving(held=worker))
        assert isinstance(got, Path) and same(read_checkpoint(got), versions[number - 1])
    assert "weights version 2: its delta did not apply" in caplog.text and worker.version == 2


@pytest.mark.parametrize("transport", ["redis://", "fs"])
def test_workers_that_hold_the_last_version_read_only_its_delta_and_serve_what_a_full_load_serves(
    transport: str, redis_server: RedisServer, ns: str, tiny_model_dir: Path, workers: StartWorker, tmp_path: Path
) -> None:
    """`publish_weights(..., deltas=True)` by `redis://` and `fs://` from real AdamW steps of a bf16 model: the first
    version goes whole; each worker that holds it reads only the next one's delta (a few percent of it, its log says
    so); a greedy sample from that worker equals, token for token and logprob for logprob, one from a worker that
    started after and loaded the version whole."""
    transport = transport if transport != "fs" else f"fs://{tmp_path / 'versions'}"
    from transformers import AutoModelForCausalLM

    bf16 = ("--dtype", "bfloat16", "--engine", "torch")
    workers.many(("w1", *bf16), ("w2", *bf16))
    client = RolloutClient(redis_server.url, ns)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)

    def step() -> None:
        ids = torch.randint(0, model.config.vocab_size, (4, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    assert client.publish_weights(model, transport=transport, deltas=True) == 1
    assert client.last_publish is not None and client.last_publish.delta_bytes is None, "no base yet: whole"
    step()
    assert client.publish_weights(model, transport=transport, deltas=True) == 2
    stats = client.last_publish
    assert stats is not None and stats.delta_bytes is not None and stats.delta_bytes < 0.2 * stats.bytes, stats
    for name in ("w1", "w2"):
        assert "weights version 2: its delta from version 1 applied" in (tmp_path / f"{name}.log").read_text()

    def greedy(prompt_id: str) -> Rollout:
        client.submit(tokens=[5, 9, 11], n=1, max_tokens=12, temperature=0.0, id=prompt_id)
        (group,) = client.collect(1, timeout=60)
        return group.rollouts[0]

    by_delta = greedy("by-delta")
    workers("w3", *bf16)  # loads version 2 whole at its start
    for name in ("w1", "w2"):
        client.streams.control.send(Control(cmd="drain", worker=name))
    wait_until(lambda: client.streams.registry.live_worker_names() == ["w3"], 30, "w1 and w2 to leave")
    whole = greedy("whole")
    assert by_delta.worker in ("w1", "w2") and whole.worker == "w3"
    assert by_delta.version == whole.version == 2
    assert by_delta.tokens.tolist() == whole.tokens.tolist()
    assert np.array_equal(by_delta.logprobs, whole.logprobs), "the same weights, bit for bit"


def test_deltas_by_a_transport_that_sends_whole_versions_or_for_an_adapter_are_refused_before_anything_is_published(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    client = RolloutClient(redis_server.url, ns)
    with pytest.raises(ValueError, match="sends whole versions only; deltas go by fs:// or redis://"):
        client.publish_weights(tiny_model_dir, transport="nccl://127.0.0.1:1", deltas=True)
    with pytest.raises(ValueError, match="is for the base model"):
        client.publish_weights(
            {}, adapter="a", adapter_config={"r": 8}, transport=f"fs://{tmp_path / 'w'}", deltas=True
        )
    with pytest.raises(ValueError, match="full_every must be an integer >= 1, got 0"):
        client.publish_weights(tiny_model_dir, transport=f"fs://{tmp_path / 'w'}", deltas=True, full_every=0)
    with pytest.raises(ValueError, match="pass deltas=True"):
        client.publish_weights(tiny_model_dir, transport=f"fs://{tmp_path / 'w'}", full_every=4)
    assert not (tmp_path / "w").exists() and client.streams.redis.hget(client.streams.keys.state, "version") is None

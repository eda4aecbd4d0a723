"""Adapters on the wire and in the transports: prompts and rollouts name their LoRA adapter, each adapter's
versions live in a place of their own (fs and redis), bad names are refused with a clear error, and each
adapter's samples are admitted and bounded by its own version."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from rich.console import Console

from pipeline.codec import as_entries
from pipeline.local import RedisServer
from pipeline.recording import from_batch, to_table
from pipeline.streams import Streams
from pipeline.top import render, snapshot
from pipeline.wire import Control, Keys, Prompt, Rollout, WireError, ack_field
from producers.client import RolloutClient
from staleness.admission import AdmissionTimeout
from staleness.weights import fetch_adapter, open_transport
from staleness.weights.base import parse_uri
from staleness.weights.sources import read_adapter

CONFIG = {"r": 2, "lora_alpha": 4.0, "target_modules": ["o_proj"], "peft_type": "LORA"}


def adapter_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.o_proj"
    return {
        f"{prefix}.lora_A.weight": torch.randn(2, 64, generator=g),
        f"{prefix}.lora_B.weight": torch.randn(64, 2, generator=g),
    }


def test_prompts_and_rollouts_carry_their_adapter_and_the_base_model_reads_as_before() -> None:
    prompt = Prompt(id="p", n=1, tokens=[5, 6], adapter="tenant-a.v2")
    assert Prompt.from_fields(prompt.to_fields()).adapter == "tenant-a.v2"
    base = Prompt(id="p", n=1, tokens=[5, 6])
    assert b"adapter" not in base.to_fields() and Prompt.from_fields(base.to_fields()).adapter is None
    rollout = Rollout(
        prompt_id="p", sample=0, n=1, version=3, version_end=4, finish_reason="stop", worker="w",
        prompt_tokens=[5], tokens=[7, 8], logprobs=[-0.1, -0.2], spans=[(3, 0, 1), (4, 1, 2)], adapter="a",
    )  # fmt: skip
    assert Rollout.from_fields(rollout.to_fields()).adapter == "a"
    command = Control(cmd="weights", epoch=2, version=3, uri="redis://x/adapters/a/v3", adapter="a")
    assert Control.from_fields(command.to_fields()).adapter == "a"
    assert b"adapter" not in Control(cmd="resume", epoch=1).to_fields()
    assert ack_field(None) == "epoch" and ack_field("a") == "epoch@a"
    assert Keys("ns").state_of("a") == "{ns}:adapter:a:state" and Keys("ns").state_of(None) == "{ns}:state"


@pytest.mark.parametrize("name", ["", "a:b", "a b", "{x}", "x" * 65, "a@b"])
def test_a_bad_adapter_name_is_a_wire_error_that_names_the_field(name: str) -> None:
    fields = Prompt(id="p", n=1, tokens=[5]).to_fields() | {b"adapter": name.encode()}
    with pytest.raises(WireError, match="adapter"):
        Prompt.from_fields(fields)


def test_adapter_versions_round_trip_through_fs_and_redis_in_peft_layout(
    real_redis: redis.Redis, tmp_path: Path, ns: str
) -> None:
    tensors = adapter_tensors(0)
    fs = open_transport(f"fs://{tmp_path}", adapter="a")
    uri = fs.publish(tensors, 1, adapter_config=CONFIG)
    assert uri == f"fs://{tmp_path}/adapters/a/v1"
    assert sorted(p.name for p in (tmp_path / "adapters/a/v1").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    store = open_transport("redis://", redis_client=real_redis, ns=ns, adapter="a")
    redis_uri = store.publish(tensors, 1, adapter_config=CONFIG)
    assert redis_uri == f"redis://{ns}/adapters/a/v1" and parse_uri(redis_uri).adapter == "a"
    assert real_redis.exists(f"{{{ns}}}:adapter:a:weights:1:manifest")
    assert not real_redis.exists(f"{{{ns}}}:weights:1:manifest")  # the base model's versions are elsewhere
    for where in (uri, redis_uri):
        got, config = fetch_adapter(where, 1, real_redis)
        assert config == CONFIG
        assert set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)
    got, config = read_adapter(str(tmp_path / "adapters/a/v1"))  # a PEFT directory as a trainer passes it
    assert config == CONFIG and set(got) == set(tensors)


def test_adapters_are_refused_where_they_cannot_go(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="adapter name"):
        open_transport(f"fs://{tmp_path}", adapter="a/../b")
    with pytest.raises(ValueError, match="adapter name"):
        parse_uri("redis://ns/adapters/a:b/v1")
    with pytest.raises(ValueError, match="config"):
        read_adapter(adapter_tensors(0))
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        read_adapter(str(tmp_path))


def rollout_of(prompt_id: str, version: int, adapter: str | None) -> Rollout:
    return Rollout(
        prompt_id=prompt_id, sample=0, n=1, version=version, version_end=version, finish_reason="stop", worker="w",
        prompt_tokens=[5], tokens=[7], logprobs=[-0.1], spans=[(version, 0, 1)], adapter=adapter,
    )  # fmt: skip


def test_each_adapter_has_its_own_admission_count_and_staleness_bound(redis_server: RedisServer, ns: str) -> None:
    client = RolloutClient(redis_server.url, ns, max_staleness=0, batch_size=2)
    with pytest.raises(ValueError, match="name the adapter"):  # an adapter's config without its name
        client.publish_weights(adapter_tensors(0), adapter_config=CONFIG)
    client.submit(tokens=[5, 6], n=2, adapter="a")  # a's capacity at version 0: (0 + 0 + 1) * 2 = 2, now used up
    with pytest.raises(AdmissionTimeout, match="admission full"):
        client.submit(tokens=[5, 6], n=1, adapter="a", timeout=0.3)
    client.submit(tokens=[5, 6], n=2, adapter="b", timeout=0.3)  # b counts its own samples
    client.submit(tokens=[5, 6], n=2, timeout=0.3)  # and so does the base model
    assert client.admission_usage("a").used == 2 and client.admission_usage("b").used == 2
    assert client.admission_usage().used == 2

    # Staleness against each adapter's own version: a is at version 3, b and the base model at 0.
    client.streams.redis.hset(client.streams.keys.state_of("a"), "version", 3)
    client.streams.writer.add_rollouts(
        [rollout_of("old-a", 2, "a"), rollout_of("new-b", 0, "b"), rollout_of("base", 0, None)]
    )
    groups = client.collect(2, timeout=10, max_staleness=0)
    assert sorted((g.prompt_id, g.adapter, g.trainer_version) for g in groups) == [
        ("base", None, 0),
        ("new-b", "b", 0),
    ]
    parked = as_entries(client.streams.redis.xrange(client.streams.keys.stale))
    assert [(f[b"prompt_id"], f[b"staleness"], f[b"trainer_version"]) for _, f in parked] == [(b"old-a", b"1", b"3")]
    assert client.admission_usage("a").stale == 1 and client.admission_usage().stale == 0


def test_a_recording_keeps_each_rollouts_adapter_and_top_shows_each_adapters_policy(
    real_redis: redis.Redis, ns: str
) -> None:
    rollouts = [rollout_of("a-1", 2, "a"), rollout_of("base-1", 0, None)]
    table = to_table(rollouts, ns, ["1-0", "1-1"])
    back = [r.rollout for r in from_batch(table.to_batches()[0], "memory")]
    assert [r.adapter for r in back] == ["a", None] and back[0].to_fields() == rollouts[0].to_fields()

    streams = Streams(real_redis, ns)
    real_redis.sadd(streams.keys.adapters, "a")
    real_redis.hset(streams.keys.state_of("a"), mapping={"version": 4, "epoch": 3, "submitted": 6, "stale": 1})
    snap = snapshot(streams)
    assert snap["adapters"]["a"]["version"] == 4 and snap["adapters"]["a"]["epoch"] == 3
    assert snap["adapters"]["a"]["used"] == 5 and snap["policy"]["version"] == 0
    console = Console(width=160, record=True)
    console.print(render(snap))
    assert "adapter a" in console.export_text()

"""The `nccl://` broadcast protocol (`staleness.weights.nccl`) between a trainer and receivers, here over gloo.

The same code runs NCCL when the trainer's tensors are on a GPU (measured on the device machine, see
README); here receivers are threads of this process, each with its own store client and group, so
that bytes, layout and the join rules are checked quickly. Across processes and with both engines,
`test_weight_sync.py` runs it inside real syncs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from benchmarks.transport_state import drop_groups, groups_built
from pipeline.local import free_port
from staleness.weights.buckets import ALIGN, TensorMeta, plan_buckets
from staleness.weights.nccl import (
    BroadcastLink,
    BroadcastStats,
    NcclTransport,
    join_broadcast,
    receive_broadcast,
)


def sample_tensors() -> dict[str, torch.Tensor]:
    """Every layout case: dtypes of 1, 2, 4 and 8 bytes, a scalar, an empty tensor, one bigger than a bucket."""
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(3, generator=g).to(torch.float16),
        "mask": torch.rand(7, generator=g) > 0.5,
        "step": torch.tensor(12345678901, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "big": torch.randn(300, generator=g),  # 1200 bytes: its own bucket
        "tail.weight": torch.randn(5, 5, generator=g).to(torch.float64),
    }


def run_receivers(
    uri: str,
    epoch: int,
    count: int,
    check: Callable[[dict[str, tuple[int, ...]], str], None] | None = None,
    version: int = 1,
    names: str = "r",
) -> tuple[list[threading.Thread], list[Any]]:
    """`count` receivers (workers `{names}0`, `{names}1`, ...), each joining then draining the broadcast in its own
    thread; results in order."""
    results: list[Any] = [None] * count

    def receive(i: int) -> None:
        try:
            link = join_broadcast(uri, epoch, version=version, timeout_s=20, check=check, member=f"{names}{i}")
            results[i] = dict(receive_broadcast(link))
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, results


def test_plan_buckets_packs_in_order_aligned_and_gives_big_tensors_their_own() -> None:
    metas = [
        TensorMeta("a", "float32", (3,)),  # 12 bytes
        TensorMeta("b", "bfloat16", (5,)),  # 10 bytes, aligned to 16
        TensorMeta("empty", "float32", (0,)),
        TensorMeta("big", "float32", (40,)),  # 160 bytes > bucket
        TensorMeta("c", "int64", (2,)),
    ]
    buckets = plan_buckets(metas, bucket_bytes=64)
    assert buckets == [[(0, 0), (1, 16)], [(3, 0)], [(4, 0)]]
    assert all(offset % ALIGN == 0 for bucket in buckets for _, offset in bucket)


@pytest.mark.parametrize("copy_from", [0, 64, 10**9], ids=["each-copied", "mixed", "all-concatenated"])
def test_a_bucket_packs_the_same_bytes_by_copies_or_by_concatenation(copy_from: int) -> None:
    from staleness.weights.buckets import bucket_size, pack_bucket

    named = sample_tensors()
    tensors = list(named.values())
    metas = [TensorMeta(k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in named.items()]
    for bucket in plan_buckets(metas, bucket_bytes=4096):
        payload = torch.full((bucket_size(metas, bucket),), 255, dtype=torch.uint8)
        pack_bucket(bucket, tensors, payload, torch.zeros(ALIGN, dtype=torch.uint8), copy_from=copy_from)
        for index, offset in bucket:
            raw = tensors[index].reshape(-1).view(torch.uint8)
            assert torch.equal(payload[offset : offset + raw.numel()], raw), metas[index].name


def test_a_bucket_goes_as_its_big_tensors_alone_and_its_runs_of_small_ones_when_grouped() -> None:
    from staleness.weights.buckets import bucket_parts

    metas = [
        TensorMeta("s1", "float32", (3,)),  # 12 bytes
        TensorMeta("s2", "float32", (2,)),  # 8 bytes, at 16
        TensorMeta("big1", "float32", (25,)),  # 100 bytes, at 32
        TensorMeta("big2", "float32", (30,)),  # 120 bytes, at 144
        TensorMeta("s3", "int64", (1,)),  # 8 bytes, at 272
        TensorMeta("s4", "int8", (5,)),  # 5 bytes, at 288
        TensorMeta("big3", "float32", (16,)),  # 64 bytes, at 304
        TensorMeta("s5", "float32", (1,)),  # 4 bytes, at 368
    ]
    (bucket,) = plan_buckets(metas, bucket_bytes=4096)
    grouped = bucket_parts(metas, bucket, grouped=True, copy_from=64)
    assert [(p.start, p.end, [i for i, _ in p.members], p.alone) for p in grouped] == [
        (0, 24, [0, 1], False),
        (32, 132, [2], True),
        (144, 264, [3], True),
        (264, 293, [4, 5], False),  # from the end of big2: the zeros that align s3 go with it
        (304, 368, [6], True),
        (368, 372, [7], True),  # a run of one: no copy
    ]
    (whole,) = bucket_parts(metas, bucket, grouped=False, copy_from=64)
    assert (whole.start, whole.end, [i for i, _ in whole.members], whole.alone) == (0, 372, list(range(8)), False)
    for copy_from in (64, 10**9):  # a bucket of one tensor is that tensor, however small
        (alone,) = bucket_parts(metas, [(0, 0)], grouped=False, copy_from=copy_from)
        assert alone.alone and (alone.start, alone.end) == (0, 12)


def test_every_tensor_arrives_bit_exact_when_buckets_go_as_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's layout (big tensors from their own memory, runs of small ones packed, each part a broadcast of its own)
    over gloo, which has no NCCL groups, so each part is a call: the bytes land where the receiver's views are."""
    import staleness.weights.nccl as broadcast
    import staleness.weights.nccl_group as group
    import staleness.weights.nccl_receive as receiving

    monkeypatch.setattr(group, "grouped", lambda backend: True)  # the trainer's layout
    monkeypatch.setattr(receiving, "grouped", lambda backend: True)  # and the receivers'
    monkeypatch.setattr(broadcast, "COPY_FROM", 1000)  # "embed" (3,200 bytes) and "big" (1,200) go alone
    sent = sample_tensors()
    trainer = NcclTransport("127.0.0.1", free_port(), bucket_bytes=4096, timeout_s=20)
    uri = trainer.publish(sent, version=1)
    threads, results = run_receivers(uri, epoch=2, count=2)
    stats = trainer.broadcast(epoch=2, workers=2)
    for t in threads:
        t.join(30)
    assert stats.ranks == 2
    for got in results:
        assert not isinstance(got, Exception), got
        for name, tensor in sent.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL between two GPUs (run on the device machine: README, nccl)"
)


@TWO_GPUS
@pytest.mark.parametrize("copy_from", [1000, 10**9], ids=["parts", "packed-runs"])
def test_over_nccl_every_tensor_arrives_bit_exact_sync_after_sync(
    monkeypatch: pytest.MonkeyPatch, copy_from: int
) -> None:
    """The NCCL layout for real: each bucket's parts (big tensors from their own memory, packed runs) in one NCCL
    group, from `cuda:0` to a receiver on `cuda:1` that posted its receives first; twice, the second on the kept
    group."""
    import staleness.weights.nccl as broadcast

    monkeypatch.setattr(broadcast, "COPY_FROM", copy_from)
    sent = {k: t.to("cuda:0") for k, t in sample_tensors().items()}
    trainer = NcclTransport("127.0.0.1", free_port(), bucket_bytes=4096, timeout_s=30)
    try:
        for version in (1, 2):
            uri = trainer.publish(sent, version=version)
            got: list[Any] = []

            def receive(uri: str = uri, version: int = version, got: list[Any] = got) -> None:
                try:
                    link = join_broadcast(uri, version, version=version, timeout_s=30, member="gpu1")
                    broadcast.prepare_receiver(link, 0, "cuda:1")
                    got.append({k: t.cpu() for k, t in receive_broadcast(link, 0, "cuda:1")})
                except Exception as exc:
                    got.append(exc)

            thread = threading.Thread(target=receive)
            thread.start()
            stats = trainer.broadcast(epoch=version, workers=1)
            thread.join(60)
            assert stats.backend == "nccl" and stats.ranks == 1 and stats.reused == (version == 2)
            assert len(got) == 1 and not isinstance(got[0], Exception), got
            for name, tensor in sent.items():
                assert got[0][name].dtype == tensor.dtype and torch.equal(got[0][name], tensor.cpu()), name
    finally:
        drop_groups()


@pytest.mark.parametrize("receivers", [1, 2])
def test_every_tensor_arrives_bit_exact(receivers: int) -> None:
    port = free_port()
    sent = sample_tensors()
    trainer = NcclTransport("127.0.0.1", port, bucket_bytes=256, timeout_s=20)
    uri = trainer.publish(sent, version=1)
    assert uri == f"nccl://127.0.0.1:{port}/v1"
    threads, results = run_receivers(uri, epoch=5, count=receivers)
    stats = trainer.broadcast(epoch=5, workers=receivers)
    for t in threads:
        t.join(30)
    assert isinstance(stats, BroadcastStats) and stats.backend == "gloo"
    assert (stats.workers, stats.ranks) == (receivers, receivers)
    assert stats.bytes >= sum(t.numel() * t.element_size() for t in sent.values())
    for got in results:
        assert not isinstance(got, Exception), got
        assert list(got) == [k for k in sent if k != "empty"] + ["empty"]
        for name, tensor in sent.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert torch.equal(got[name], tensor), name


def test_a_prepared_receiver_gets_every_byte_before_it_asks_for_them() -> None:
    """A worker posts its receives before it pauses (`prepare_receiver`): the trainer's broadcast completes while
    the worker has not yet called `receive_broadcast` (it still generates), and the tensors are then there."""
    from staleness.weights.nccl import prepare_receiver

    sent = many_tensors(3)
    trainer = NcclTransport("127.0.0.1", free_port(), bucket_bytes=256, timeout_s=20)
    uri = trainer.publish(sent, version=3)
    sent_all = threading.Event()
    got: list[Any] = []

    def worker() -> None:
        link = join_broadcast(uri, 1, version=3, timeout_s=20, member="w")
        prepare_receiver(link)
        if not sent_all.wait(30):  # "generating": no receive_broadcast until the trainer is done
            got.append(TimeoutError("the trainer never finished without the worker receiving"))
            return
        got.append(dict(receive_broadcast(link)))

    thread = threading.Thread(target=worker)
    thread.start()
    stats = trainer.broadcast(epoch=1, workers=1)
    sent_all.set()
    thread.join(30)
    assert stats.ranks == 1 and stats.transfer_s > 0 and stats.ready_s >= 0
    assert not isinstance(got[0], Exception), got[0]
    assert all(torch.equal(got[0][name], tensor) for name, tensor in sent.items())


def test_receives_posted_but_never_taken_are_freed_when_the_worker_forgets_the_group() -> None:
    from staleness.weights import nccl_receive as broadcast

    trainer = NcclTransport("127.0.0.1", free_port(), bucket_bytes=256, timeout_s=20)
    uri = trainer.publish(many_tensors(1), version=1)
    links: list[BroadcastLink] = []

    def join() -> None:
        links.append(join_broadcast(uri, 1, version=1, timeout_s=20, member="w"))
        broadcast.prepare_receiver(links[0])

    thread = threading.Thread(target=join)
    thread.start()
    trainer.broadcast(epoch=1, workers=1)
    thread.join(30)
    assert len(broadcast._POSTED) == 1  # the worker's load failed before it received: it forgets its group
    links[0].forget()
    assert broadcast._POSTED == {}, "a model's worth of receive buffers outlived the failed load"


def test_a_receiver_whose_model_does_not_fit_declines_and_the_others_do_not_wait_for_it() -> None:
    sent = sample_tensors()
    trainer = NcclTransport("127.0.0.1", free_port(), timeout_s=20)
    uri = trainer.publish(sent, version=1)
    fits = run_receivers(uri, 1, 1)

    def refuse(shapes: dict[str, tuple[int, ...]], source: str) -> None:
        raise ValueError(f"checkpoint {source} does not fit the model: shape mismatches {list(shapes)[:1]}")

    misfits = run_receivers(uri, 1, 1, check=refuse, names="misfit")
    stats = trainer.broadcast(epoch=1, workers=2)
    for t in fits[0] + misfits[0]:
        t.join(30)
    assert stats.join_s < 10, "the trainer waited for a receiver that declined"
    assert (stats.workers, stats.ranks) == (1, 1)
    assert torch.equal(fits[1][0]["embed.weight"], sent["embed.weight"])
    assert isinstance(misfits[1][0], ValueError) and "does not fit the model" in str(misfits[1][0])


def test_a_receiver_that_comes_after_the_trainer_gave_up_is_told_so() -> None:
    trainer = NcclTransport("127.0.0.1", free_port(), timeout_s=2)
    uri = trainer.publish(sample_tensors(), version=1)
    stats = trainer.broadcast(epoch=3, workers=1)  # nobody joined: the trainer gave up waiting
    assert (stats.workers, stats.ranks, stats.bytes) == (0, 0, 0)
    with pytest.raises(TimeoutError, match=r"no answer from the trainer's rendezvous"):
        join_broadcast(uri, 3, version=1, timeout_s=1)  # the epoch's keys are gone


def test_a_receiver_expecting_another_version_declines() -> None:
    trainer = NcclTransport("127.0.0.1", free_port(), timeout_s=20)
    uri = trainer.publish(sample_tensors(), version=2)
    threads, results = run_receivers(uri.removesuffix("/v2"), 9, 1)  # asks for version 1
    stats = trainer.broadcast(epoch=9, workers=1)
    threads[0].join(30)
    assert stats.ranks == 0 and stats.join_s < 10
    assert isinstance(results[0], ValueError) and "broadcasts version 2" in str(results[0])


def test_broadcast_link_crosses_as_plain_data() -> None:
    link = BroadcastLink("10.0.0.1", 29500, 4, 2, 3, 5, 60.0, '{"v":1}')
    assert BroadcastLink.from_dict(link.to_dict()) == link


def test_nothing_staged_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"publish\(\) a version first"):
        NcclTransport("127.0.0.1", free_port()).broadcast(epoch=1, workers=1)


@pytest.fixture(autouse=True)
def fresh_groups() -> None:
    """Each test starts with no kept group (they are per process, by port: ports are fresh anyway)."""
    drop_groups()


def many_tensors(version: int) -> dict[str, torch.Tensor]:
    """40 small tensors whose values name their version: with 256-byte buckets, about 20 packed buckets."""
    return {f"layer.{i}.weight": torch.arange(24, dtype=torch.float32) + 1000 * version + i for i in range(40)}


def sync_once(
    trainer: NcclTransport, epoch: int, version: int, count: int, names: str = "r"
) -> tuple[BroadcastStats, list[Any]]:
    """One broadcast of `many_tensors(version)` to `count` receivers; every receiver got it bit-exact."""
    sent = many_tensors(version)
    uri = trainer.publish(sent, version=version)
    threads, results = run_receivers(uri, epoch, count, version=version, names=names)
    stats = trainer.broadcast(epoch=epoch, workers=count)
    for t in threads:
        t.join(30)
    for got in results:
        assert not isinstance(got, Exception), got
        assert all(torch.equal(got[name], tensor) for name, tensor in sent.items()), f"version {version} garbled"
    return stats, results


def test_the_group_is_kept_across_syncs_while_the_workers_stay_and_rebuilt_when_they_change() -> None:
    trainer = NcclTransport("127.0.0.1", free_port(), bucket_bytes=256, timeout_s=20)
    built = groups_built()
    first, _ = sync_once(trainer, epoch=1, version=1, count=2)
    assert (first.reused, first.generation, first.ranks) == (False, 1, 2)
    for epoch in (2, 3):  # double buffered over ~20 buckets, the same group each time
        kept, _ = sync_once(trainer, epoch=epoch, version=epoch, count=2)
        assert (kept.reused, kept.generation, kept.setup_s) == (True, 1, 0.0)
    assert groups_built()["trainer"] - built["trainer"] == 1
    assert groups_built()["receiver"] - built["receiver"] == 2, "a receiver built a second group for the same members"
    joined, _ = sync_once(trainer, epoch=4, version=4, count=3)  # r2 joins
    assert (joined.reused, joined.generation, joined.ranks) == (False, 4, 3) and joined.setup_s > 0
    left, _ = sync_once(trainer, epoch=5, version=5, count=1)  # r1 and r2 left (or died: no heartbeat, not counted)
    assert (left.reused, left.generation, left.ranks) == (False, 5, 1)
    again, _ = sync_once(trainer, epoch=6, version=6, count=1)
    assert (again.reused, again.generation) == (True, 5)
    assert groups_built()["trainer"] - built["trainer"] == 3


def test_a_worker_that_lost_its_group_or_is_new_under_an_old_name_makes_the_trainer_rebuild() -> None:
    from staleness.weights.nccl import forget_group

    trainer = NcclTransport("127.0.0.1", free_port(), bucket_bytes=256, timeout_s=20)
    sync_once(trainer, epoch=1, version=1, count=2)
    forget_group(trainer.uri_of(1), "r1")  # its load failed: it reports no group at the next sync
    rebuilt, _ = sync_once(trainer, epoch=2, version=2, count=2)
    assert (rebuilt.reused, rebuilt.generation) == (False, 2)
    kept, _ = sync_once(trainer, epoch=3, version=3, count=2)
    assert kept.reused

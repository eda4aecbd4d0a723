"""The trainer's side of the pipeline: submit prompts, receive whole groups of rollouts.

`RolloutClient` deduplicates on rollout id (delivery is at-least-once; the trainer sees each
sample once), holds rollouts until their group is whole, and acks entries only once it has
handed them over, so that a trainer that dies re-reads what it never got to use.

With `max_staleness` (η) and `batch_size` it bounds staleness where it is cheap, at admission (see
`staleness.admission`): `submit` holds the producer back while the samples in use would exceed
(η + v + 1) * `batch_size` at policy version v. Nothing admitted is thrown away by default: a sample that
outlived a weight sync carries tokens of several versions (its `spans`), and the trainer corrects each token
by importance weights (`producers.rl`). Parking is an opt-in bound the caller names (`ParkingBound`, e.g. on
the share of a sample's tokens older than k versions): groups over it go whole to `{ns}:stale`, counted.

Prompts may name a LoRA adapter (`submit(..., adapter="a")`): each adapter has its own policy version
(`publish_weights(tensors, adapter="a", adapter_config=...)` moves only it), its own admission count and its own
staleness (a group of adapter a is as stale as a's version minus its oldest sample's). Rollouts of every adapter
arrive on the one `{ns}:rollouts`; a group says its `adapter`.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

import numpy as np
import redis

from pipeline.connections import RedisUnreachable, connect, retried_failures
from pipeline.streams import Entry, Streams, trim_consumed
from pipeline.wire import (
    ADAPTER_PATTERN,
    REWARD_FN_PATTERN,
    TRAINER,
    LogprobsMode,
    PauseMode,
    Prompt,
    Rollout,
    Sampling,
    WireError,
    knobs_given,
)
from producers.groups import Batch, Group, GroupAssembler, ParkingBound, SampleStaleness, whole_batches
from staleness.admission import Admission, AdmissionLimits, StaleRollouts, Usage
from staleness.driver import PublishOptions, SyncDriver
from staleness.manager import SyncReport

if TYPE_CHECKING:
    from staleness.weights.base import PublishStats
    from staleness.weights.nccl import BroadcastStats
    from staleness.weights.sources import WeightSource

__all__ = ["Batch", "Group", "GroupAssembler", "ParkingBound", "RolloutClient", "SampleStaleness", "whole_batches"]
"""What the trainer imports from here: the client, and the groups and batches it hands over (`producers.groups`)."""

log = logging.getLogger(__name__)

READ_BYTES = 1 << 20
"""A read of `{ns}:rollouts` asks for about this many bytes at most (`read_count` is the cap in entries): Redis builds
a reply in one go, and while it builds a large one every other client waits, a publishing worker too."""
MIN_READ = 16
NO_WORKER_NOTICE_S = 10.0
"""A read that has waited this long for rollouts checks for live workers, and warns once if there is none."""
"""However big the rollouts, a read asks for at least this many (unless `read_count` is smaller)."""


def _where(redis_url: str | redis.Redis) -> str:
    if isinstance(redis_url, str):
        return redis_url
    kwargs = redis_url.connection_pool.connection_kwargs
    return str(kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}")


def check_tokenizer(tokenizer: str | Path | None) -> None:
    """`ValueError` for a tokenizer given as a local path that is no folder (a name like `org/model` is left to
    transformers, which fetches it from a hub where one is reachable)."""
    if tokenizer is None or Path(tokenizer).expanduser().is_dir():
        return
    text = str(tokenizer)
    if isinstance(tokenizer, Path) or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ValueError(
            f"tokenizer {text}: no such folder; pass a local model folder (its tokenizer.json and chat template), "
            "or None to submit token ids only"
        )


class RolloutClient:
    """Submit prompts and iterate over finished groups of one pipeline namespace."""

    def __init__(
        self,
        redis_url: str | redis.Redis,
        ns: str,
        *,
        tokenizer: str | Path | None = None,
        consumer: str = "trainer-0",
        read_count: int = 512,
        remember_ids: int = 1_000_000,
        trim_every_s: float = 10.0,
        max_staleness: int | None = None,
        batch_size: int | None = None,
        submit_timeout_s: float = 300.0,
        park: ParkingBound | None = None,
    ) -> None:
        """`max_staleness` (η, in policy versions) with `batch_size` (B, samples per policy version: per training
        step, or per sync when the trainer publishes every k steps) turn on admission control in `submit` (which then
        waits up to `submit_timeout_s`). `park` is the default parking bound of `groups`/`batches`/`collect` (None:
        nothing is parked). Without them nothing is limited."""
        if (max_staleness is None) != (batch_size is None):
            raise ValueError(
                "admission control needs both max_staleness and batch_size (samples per training step), or neither"
            )
        try:
            client = connect(redis_url, ns=ns) if isinstance(redis_url, str) else redis_url
            self.streams = Streams(client, ns)
            self.streams.ensure_groups()
        except redis.AuthenticationError:
            raise
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # one line, not redis-py's frames
            raise RedisUnreachable.at(_where(redis_url), exc) from None
        check_tokenizer(tokenizer)
        self.consumer = consumer
        self.read_count = read_count
        self.stats = {"received": 0, "duplicates": 0, "dead": 0, "groups": 0, "stale": 0}
        self.max_staleness = max_staleness
        self.park = park
        self.submit_timeout_s = submit_timeout_s
        limits = None
        if max_staleness is not None and batch_size is not None:
            limits = AdmissionLimits(max_staleness, batch_size)
        self.admission = Admission(client, self.streams.keys, limits)
        self.admission.publish_limits()
        self._adapter_admissions: dict[str, Admission] = {}
        """Each adapter's own admission count (same limits), made when a prompt first names it."""
        self._stale = StaleRollouts(client, self.streams.keys, TRAINER)
        self._tokenizer_path = tokenizer
        self._tokenizer: Any = None
        self._groups = GroupAssembler(remember_ids)
        self._whole: deque[Group] = deque()
        """Groups made whole and not yet handed over: one read can complete more than the caller asked for."""
        self._pending_after: bytes | None = b"0"
        """First re-read what this consumer was handed before a restart, from this id on (None: done)."""
        self._rereading = False
        """Re-reading what is pending on us mid-run (after a retried read): seen ids are skipped, not acked."""
        self._syncs = SyncDriver(self.streams)
        """Publishes weights and drives the fleet's syncs and sleeps (`staleness.driver`)."""
        self._trim_every_s = trim_every_s
        self._last_trim = time.monotonic()
        self._entry_bytes = 0
        """The size of the last rollout entry read (its fields' bytes), which sizes the next read (`_count`)."""

    # -- submitting ----------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | np.ndarray | None = None,
        n: int = 1,
        max_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        meta: dict[str, Any] | None = None,
        id: str | None = None,
        chat: bool = True,
        reward_fn: str | None = None,
        timeout: float | None = None,
        adapter: str | None = None,
        logprobs_mode: LogprobsMode = "raw",
        routed_experts: bool = False,
        top_logprobs: int = 0,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        min_tokens: int | None = None,
    ) -> str:
        """Queue one prompt (text through the tokenizer and its chat template, or token ids); returns its id.

        With admission control, waits while the capacity is used up (`timeout`: default `submit_timeout_s`).
        With `reward_fn` (`module:function`), its rollouts reach `groups`/`batches` scored by the scoring
        stage (`rollouts scorer`): `reward` set, or `reward_error` saying why not. With `adapter`, it is
        generated under that LoRA adapter (published with `publish_weights(..., adapter=...)`).

        `top_k`, `min_p`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `min_tokens`: vLLM's knobs,
        with vLLM's meanings and order (`pipeline.wire.Sampling`); None leaves one off (the wire's default). Both the
        torch and vLLM engines apply them. Out of range: a `ValueError` that names the field.

        `logprobs_mode`: what the rollouts' `logprobs` are (`pipeline.wire.LogprobsMode`): `raw` (the default),
        log_softmax of the model's logits; `processed`, of the distribution sampled from (every knob above,
        temperature and top-p applied). The torch engine serves either per request; a vLLM worker reports the one its
        engine was started with (vLLM sets it per engine) and answers a prompt that asks for the other with an error
        rollout.

        `routed_experts`: the rollouts carry the experts a mixture-of-experts policy routed each position to
        (`Rollout.routed_experts`, int16 `[prompt + tokens - 1, layers, top_k]`) for rollout routing replay. Served
        by the torch engine (transformers' Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) and by vLLM started with
        `enable_return_routed_experts` (its CUDA build); any other worker answers with an error rollout that says so.

        `top_logprobs`: the rollouts carry the k most likely tokens at each generated position with their logprobs
        (`Rollout.top_token_ids`, `Rollout.top_logprobs`, `[n_tokens, k]`; at most `MAX_TOP_LOGPROBS`), in the same
        `logprobs_mode`. Served by the torch and vLLM engines; the others answer with an error rollout.
        """
        item = self.make_prompt(
            prompt,
            tokens=tokens,
            n=n,
            sampling=Sampling(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                stop_token_ids=list(stop_token_ids),
                seed=seed,
                logprobs_mode=logprobs_mode,
                routed_experts=routed_experts,
                top_logprobs=top_logprobs,
                **knobs_given(
                    top_k=top_k,
                    min_p=min_p,
                    repetition_penalty=repetition_penalty,
                    presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty,
                    min_tokens=min_tokens,
                ),
            ),
            meta=meta,
            id=id,
            chat=chat,
            reward_fn=reward_fn,
            adapter=adapter,
        )
        self.submit_prompts([item], timeout=timeout)
        return item.id

    def make_prompt(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | np.ndarray | None = None,
        n: int = 1,
        sampling: Sampling | None = None,
        meta: dict[str, Any] | None = None,
        id: str | None = None,
        chat: bool = True,
        reward_fn: str | None = None,
        adapter: str | None = None,
    ) -> Prompt:
        """Build and check a prompt without sending it; raises `ValueError` saying what to fix."""
        if (prompt is None) == (tokens is None):
            raise ValueError("give exactly one of `prompt` (text) or `tokens` (token ids)")
        if reward_fn is not None and not re.match(REWARD_FN_PATTERN, reward_fn):
            raise ValueError(f"reward_fn {reward_fn!r} is not an import path like 'my_rewards:exact_match'")
        if adapter is not None and not re.match(ADAPTER_PATTERN, adapter):
            raise ValueError(f"adapter {adapter!r}: a name of 1-64 letters, digits, '_', '.' or '-'")
        sampling = sampling or Sampling()
        problems = sampling.problems()
        if problems:
            raise ValueError("; ".join(problems))
        if tokens is None:
            tokens = self.tokenize(prompt or "", chat=chat)
        return Prompt(
            id=id or uuid.uuid4().hex,
            n=n,
            tokens=tokens,
            sampling=sampling,
            meta=meta or {},
            reward_fn=reward_fn,
            adapter=adapter,
        )

    def submit_prompts(self, prompts: Sequence[Prompt], *, timeout: float | None = None) -> int:
        """Queue many prompts in one round trip, all or none, through admission control; returns how many were
        queued by this call (fewer than given only where they repeat a submission, below).

        Without limits they go in at once (and are counted in `{ns}:state` `submitted`). With limits,
        waits while they do not fit; raises `SubmissionTooLarge` at once if they never can, and
        `AdmissionTimeout` (a `TimeoutError`) when the policy version did not move on in `timeout` s.

        Safe to repeat: the same prompt ids submitted again within an hour (a call retried after a lost
        reply, a producer restarted from its checkpoint) are not queued or counted twice; they count as not queued
        in the returned number.

        Prompts of different adapters are admitted each against their own adapter's count, one adapter after
        the other (all or none per adapter, not across adapters).
        """
        by_adapter: dict[str | None, list[Prompt]] = {}
        for prompt in prompts:
            by_adapter.setdefault(prompt.adapter, []).append(prompt)
        wait = self.submit_timeout_s if timeout is None else timeout
        queued = 0
        for adapter, some in by_adapter.items():
            samples = sum(p.n for p in some)
            submission = hashlib.sha1("\n".join(p.id for p in some).encode()).hexdigest()
            usage = self._admission(adapter).admit([p.to_fields() for p in some], samples, wait, submission)
            queued += 0 if usage.repeat else len(some)
        return queued

    def _admission(self, adapter: str | None) -> Admission:
        if adapter is None:
            return self.admission
        if adapter not in self._adapter_admissions:
            admission = Admission(self.streams.redis, self.streams.keys, self.admission.limits, adapter=adapter)
            admission.publish_limits()
            self._adapter_admissions[adapter] = admission
        return self._adapter_admissions[adapter]

    def admission_usage(self, adapter: str | None = None) -> Usage:
        """Samples submitted, parked as stale and in use, the policy version and the capacity now (of the base
        model, or of `adapter`)."""
        return self._admission(adapter).usage()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (transformers), loaded on first use."""
        if self._tokenizer is None:
            if self._tokenizer_path is None:
                raise ValueError(
                    "text prompts need a tokenizer: pass tokenizer=MODEL_DIR (on the command line: --model DIR)"
                )
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self._tokenizer_path))
        return self._tokenizer

    def tokenize(self, text: str, chat: bool = True) -> list[int]:
        tok = self.tokenizer
        if chat and tok.chat_template:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            return list(ids)
        return list(tok.encode(text, add_special_tokens=False))

    # -- publishing weights ----------------------------------------------------------------------

    def publish_weights(self, source: WeightSource, **options: Unpack[PublishOptions]) -> int:
        """Make `source` the next policy version on every worker; returns that version. The options, all keywords
        (`staleness.driver.PublishOptions`): `transport` ("redis://"), `mode` ("abort"), `ack_timeout_s` (60),
        `adapter` and `adapter_config` (None: the base model), `bucket_bytes` (None: the transport's), `deltas`
        (False), `full_every` (None: `staleness.weights.delta.DEFAULT_FULL_EVERY`).

        `source`: a torch module, a state dict, a safetensors checkpoint directory, or an iterable of `(name,
        tensor)` pairs in the model's checkpoint names (a generator that gathers one tensor at a time, as FSDP and
        Megatron trainers do: `((n, gather(p)) for n, p in model.named_parameters())`). An iterable is consumed once,
        as it comes: over `redis://` and `fs://` the trainer holds about one bucket of it at a time (`bucket_bytes`,
        see `staleness.weights.open_transport`), never the whole model; `nccl://` and `ipc://` keep the version where
        its tensors are until the sync (yield them on the GPU). `last_publish` says what was held.

        Before any worker pauses, each tensor's name and shape is checked as it passes against the models of the live
        workers (each advertises its own): one no worker takes raises `WeightsMismatch` (a `ValueError`, one line
        that says what to fix), what was written of the version is deleted, no sync begins, and every worker keeps
        serving the version it has. So does an error the iterable raises itself.

        With `adapter`, `source` is LoRA adapter `adapter`'s tensors (PEFT names: `...lora_A.weight`,
        `...lora_B.weight`) with `adapter_config` (`r`, `lora_alpha`, `target_modules`), or a PEFT directory
        (`adapter_model.safetensors` + `adapter_config.json`); it becomes that adapter's next version, and only
        its requests pause (the others and the base model go on). Adapters travel by `redis://`, `fs://` or `nccl://`.

        The tensors go through `transport` (`redis://`: chunks in this Redis; `fs://DIR`: shared
        storage; `nccl://HOST:PORT`: broadcast from this process, over NCCL from GPU tensors, gloo from
        CPU ones, during the sync; `ipc://`: a GPU buffer that workers on the same GPU open), then the manager
        pauses every live worker (`mode`), waits for each to load and ack, evicts one that does not within
        `ack_timeout_s`, and resumes them. Older versions are deleted from the transport once every live worker
        has moved on. The sync is driven by `staleness.driver.SyncDriver`.

        `deltas` (`redis://`, `fs://`, the base model): beside each version, still written whole, what changed since
        the last one this client published (`staleness.weights.delta`: ~6 % of a bf16 version after an AdamW step of
        the real model); a worker that holds that one reads only the delta, and checks what it makes of it against the
        version's sha256; any other loads the version whole. Every `full_every`-th version goes whole only (the chain
        of deltas is cut). The trainer holds its last version whole on the host (one copy of the model), and so does
        each worker.
        """
        return self._syncs.publish(source, **options)

    @property
    def last_sync(self) -> SyncReport | None:
        """What the last `publish_weights` did: who acked, who was evicted, how long workers stood still."""
        return self._syncs.last_sync

    @property
    def last_broadcast(self) -> BroadcastStats | None:
        """What the last publish by a transport that pushes (`nccl://`) moved, and how fast; None after one that
        stores."""
        return self._syncs.last_push  # what the transport's push returned

    @property
    def last_publish(self) -> PublishStats | None:
        """What the last `publish_weights` put in its transport: tensors, bytes, the most it held at once."""
        return self._syncs.last_publish

    def sleep(self, level: int = 1, mode: PauseMode = "abort", ack_timeout_s: float = 60.0) -> SyncReport:
        """Put every worker's engine to sleep before a training step on the GPUs they share (colocated), freeing
        their memory: each pauses (`mode`: `abort` or `keep`), sleeps at `level` (1: KV cache freed, weights offloaded
        to host memory; 2: both freed) and acks. They stay asleep until `publish_weights` (which wakes each before it
        loads, the usual way to end a step) or `wake()`. Returns who acked, who was evicted and who could not sleep
        (`awake`: its engine has no sleep mode; it paused all the same). Raises `ValueError` for a bad level or mode,
        `SyncError` while a sync or another sleep is under way."""
        return self._syncs.sleep(level, mode, ack_timeout_s)

    def wake(self) -> SyncReport | None:
        """End a `sleep` without publishing: the workers wake and go on with the version they have. None if the fleet
        was not asleep."""
        return self._syncs.wake()

    def settle(self) -> None:
        """Wait until the last `publish_weights`'s resume has been rung to every worker: it returns once the resume is
        written, and the ring goes on in a thread, longer the more workers there are."""
        self._syncs.settle()

    # -- receiving -----------------------------------------------------------------------------

    def mark_seen(self, rollout_ids: Iterable[str]) -> None:
        """Rollouts that a trainer restored from its checkpoint already trained on.

        Acks are sent when the trainer comes back for more, so a trainer that dies after its step and
        before that re-reads the step's rollouts on restart; met again, they are acked and skipped as
        duplicates. Keep the ids of each step in the checkpoint and pass them here before reading."""
        for rollout_id in rollout_ids:
            self._groups.remember(rollout_id)

    def groups(
        self, timeout: float | None = None, max_staleness: int | None = None, park: ParkingBound | None = None
    ) -> Generator[Group, None, None]:
        """Yield each prompt's group once all its samples arrived; each sample exactly once.

        A group's entries are acked when the caller comes back for the next one (or stops).
        Raises `TimeoutError` when no new rollout arrived for `timeout` seconds. With a parking bound
        (`park`, default the client's; `max_staleness=k` is `park=ParkingBound(k)`), a group over it is parked on
        `{ns}:stale` instead (the trainer version is read once per group).
        """
        bound = self._bound(max_staleness, park)
        for group in self._whole_groups(timeout):
            if bound is not None and not self._fresh([group], bound):
                continue
            try:
                yield group
            finally:
                self._ack(group.entry_ids)

    def batches(
        self,
        groups_per_batch: int,
        timeout: float | None = None,
        max_staleness: int | None = None,
        park: ParkingBound | None = None,
    ) -> Generator[Batch, None, None]:
        """Yield batches of whole groups; a batch is acked when the caller comes back for the next.

        Nothing is parked unless a parking bound is named (`park`, default the client's; `max_staleness=k` is
        `park=ParkingBound(k)`). With one, the trainer version is read once per batch, when it is full: groups over
        the bound are parked on `{ns}:stale` and the batch is filled up with the next groups.
        """
        bound = self._bound(max_staleness, park)
        fresh = None if bound is None else lambda groups: self._fresh(groups, bound)
        for batch in whole_batches(self._whole_groups(timeout), groups_per_batch, fresh):
            try:
                yield batch
            finally:
                self._ack([e for g in batch.groups for e in g.entry_ids])

    def collect(
        self,
        n_groups: int,
        timeout: float | None = 60.0,
        max_staleness: int | None = None,
        park: ParkingBound | None = None,
    ) -> list[Group]:
        """The next `n_groups` whole groups, all acked in one round trip once they are here; a convenience for scripts
        and tests. (Through `groups()`, each group's ack is a round trip of its own, which a burst of groups finishing
        together, as vLLM's last step of a batch makes, would wait for.) A timeout leaves the groups
        it gathered pending, so that a client started again reads them back, rather than acked and lost; this client's
        next call returns them first. Groups one read made whole beyond `n_groups` wait for the next call."""
        got: list[Group] = []
        if n_groups <= 0:
            return got
        bound = self._bound(max_staleness, park)
        try:
            for group in self._whole_groups(timeout):
                if bound is not None and not self._fresh([group], bound):
                    continue
                got.append(group)
                if len(got) == n_groups:
                    break
        except TimeoutError:
            self._whole.extendleft(reversed(got))
            raise
        self._ack([entry for group in got for entry in group.entry_ids])
        return got

    def _bound(self, max_staleness: int | None, park: ParkingBound | None) -> ParkingBound | None:
        if max_staleness is not None and park is not None:
            raise ValueError("give a parking bound as park=ParkingBound(...) or max_staleness=k, not both")
        if max_staleness is not None:
            if max_staleness < 0:
                raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
            return ParkingBound(max_staleness)
        return self.park if park is None else park

    def _fresh(self, groups: list[Group], bound: ParkingBound) -> list[Group]:
        """Keep the groups within `bound`; park the others whole.

        One read of the trainer version (of the base model, and of each adapter the groups name) for all of
        `groups`; it is stamped on the groups kept.
        """
        versions: dict[str | None, int] = {}
        fresh: list[Group] = []
        parked: dict[str | None, list[tuple[bytes, int]]] = {}
        for group in groups:
            if group.adapter not in versions:
                versions[group.adapter] = self._stale.trainer_version(group.adapter)
            version = versions[group.adapter]
            if bound.parks(group, version):
                parked.setdefault(group.adapter, []).extend(
                    (e, version - r.version) for r, e in zip(group.rollouts, group.entry_ids, strict=True)
                )
            else:
                group.trainer_version = version
                fresh.append(group)
        for adapter, rollouts in parked.items():
            moved = self._stale.park(versions[adapter], rollouts, adapter)
            self.stats["stale"] += moved
            log.info(
                "parked %d rollouts%s on %s: over %s at trainer version %d",
                moved,
                f" of adapter {adapter}" if adapter else "",
                self.streams.keys.stale,
                bound,
                versions[adapter],
            )
        return fresh

    def _ack(self, entry_ids: list[bytes]) -> None:
        """Ack what was handed over; now and then drop what every group on `rollouts` is done with."""
        self.streams.trainer.ack_rollouts(entry_ids)
        if time.monotonic() - self._last_trim >= self._trim_every_s:
            self._last_trim = time.monotonic()
            trim_consumed(self.streams.redis, self.streams.keys.rollouts)

    def _whole_groups(self, timeout: float | None, block_ms: int = 500) -> Iterator[Group]:
        """Whole groups as they come, each handed over once: those a read completed beyond what the caller took
        wait in `_whole` for its next call."""
        last_news = time.monotonic()
        checked = False  # for live workers, once a silence
        while True:
            while self._whole:
                yield self._whole.popleft()
            entries = self._read(block_ms)
            silent_s = time.monotonic() - last_news
            if entries:
                last_news, checked = time.monotonic(), False
            elif timeout is not None and silent_s > timeout:
                raise TimeoutError(
                    f"no rollout arrived in {timeout:.0f}s; {len(self._groups.open)} groups are incomplete. "
                    f"Is a worker running on this namespace (`rollouts top`)?{self._scoring_hint()}"
                )
            elif silent_s > NO_WORKER_NOTICE_S and not checked:
                checked = True
                self._warn_if_no_worker(silent_s, timeout)
            self._whole.extend(self._take(entries))

    def _warn_if_no_worker(self, silent_s: float, timeout: float | None) -> None:
        """Say so (a warning on this module's logger) when no worker is alive to send the rollouts being waited for."""
        if self.streams.registry.live_worker_names():
            return
        keys = self.streams.keys
        log.warning(
            "no rollout for %.0f s and no worker is alive on namespace %s: start one (`rollouts worker --ns %s ...`); "
            "%s",
            silent_s,
            keys.ns,
            keys.ns,
            "this read has no timeout and waits until rollouts come" if timeout is None else f"timeout {timeout:g} s",
        )

    def _scoring_hint(self) -> str:
        keys = self.streams.keys
        waiting = self.streams.redis.xlen(keys.scoring)
        if not waiting:
            return ""
        return f" {waiting} rollouts wait on {keys.scoring} for a reward: is `rollouts scorer --ns {keys.ns}` running?"

    def _read(self, block_ms: int) -> list[Entry]:
        if self._pending_after is not None:  # page through them: they stay pending until their group is used
            after = self._pending_after
            entries = self.streams.trainer.read_rollouts(self.consumer, self._count(), None, pending=True, after=after)
            if entries:
                self._pending_after = entries[-1].id
                return entries
            self._pending_after = None
            self._rereading = False
        retried = retried_failures(self.streams.redis)
        entries = self.streams.trainer.read_rollouts(self.consumer, self._count(), block_ms)
        if retried_failures(self.streams.redis) != retried:
            # A dropped connection was retried: if the read had run, its reply (entries now pending on this
            # consumer, never handed to us) was lost. Re-read what is pending on us; what we hold is skipped.
            self._pending_after, self._rereading = b"0", True
        if entries:
            self._entry_bytes = sum(len(k) + len(v) for k, v in entries[-1].fields.items())
        return entries

    def _count(self) -> int:
        """How many entries the next read asks for: `read_count`, or fewer if that many would pass `READ_BYTES` at
        the size of the last entry read (~120 rollouts of 1k tokens, all 512 of 64)."""
        if not self._entry_bytes:
            return self.read_count
        return min(self.read_count, max(MIN_READ, READ_BYTES // self._entry_bytes))

    def _take(self, entries: list[Entry]) -> list[Group]:
        """Decode, dedupe and file entries by group; return the groups that became whole."""
        whole = []
        duplicates = []
        for entry in entries:
            try:
                rollout = Rollout.from_fields(entry.fields)
            except WireError as exc:
                self.streams.dead_letter(entry, str(exc), "trainer-decode")
                self.stats["dead"] += 1
                continue
            if self._groups.seen(rollout.id):
                if not self._rereading:  # re-read mid-run, a seen id may be one we hold (acked when handed over)
                    duplicates.append(entry.id)
                continue
            self.stats["received"] += 1
            group = self._groups.add(rollout, entry.id)
            if group is not None:
                whole.append(group)
        self.stats["duplicates"] += len(duplicates)
        self.streams.trainer.ack_rollouts(duplicates)
        self.stats["groups"] += len(whole)
        return whole

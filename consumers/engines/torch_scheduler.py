"""Continuous batching for the torch engine: one thread owns the model and runs it one step at a time.

Between decode steps the scheduler thread admits waiting requests into the running batch, left-pads them with an
attention mask and per-row position ids, prefills them, and decodes all rows one token per step from a
`DynamicCache`. Callers on other threads only queue requests and wait for futures that the thread resolves on their
event loops (`settle`), so an event loop never waits on compute.

Rows of one batch never influence each other's tokens: each row's sampling noise is a function of its own seed and
position (`sampling_uniform`), so a seeded request gives the same tokens alone or in any batch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from consumers.engines.base import Generation
from pipeline.wire import FinishReason, Sampling


@functools.cache
def _forward_takes_cache(forward: Any) -> bool:
    return "cache" in inspect.signature(forward).parameters


def cache_name(model: Any) -> str:
    """What a transformers model calls its KV cache, as an argument and on its output: `cache` where its `forward`
    takes it (transformers 5.2x renamed it, and warns on every worker's first step for the old name), else the
    `past_key_values` of the releases before."""
    return "cache" if _forward_takes_cache(type(model).forward) else "past_key_values"

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    """One request's state; after admission it is owned by the scheduler thread."""

    id: str
    prompt: list[int]
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Generation]
    seed: int
    """Fixes the row's sampling noise (see `sampling_uniform`): its tokens do not depend on the other rows."""
    stop_ids: frozenset[int]
    adapter: str | None = None
    """The LoRA adapter it generates under (None: the base model)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    """When asked (`sampling.routed_experts`): the routed experts of each position the model read, `[n, layers,
    top_k]` per model call (a prefill replaces them: it reads every position again)."""
    top_ids: list[np.ndarray] = field(default_factory=list)
    """When asked (`sampling.top_logprobs` = k): each generated token's k most likely tokens (and `top_logprobs` their
    logprobs), one array a token."""
    top_logprobs: list[np.ndarray] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.tokens)

    def append(
        self, token: int, logprob: float, version: int, top: tuple[np.ndarray, np.ndarray] | None = None
    ) -> None:
        n = len(self.tokens)
        if top is not None:
            self.top_ids.append(top[0])
            self.top_logprobs.append(top[1])
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = n + 1
        else:
            self.spans.append([version, n, n + 1])
        self.tokens.append(token)
        self.logprobs.append(logprob)

    def result(self, finish_reason: FinishReason) -> Generation:
        return Generation(
            tokens=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            finish_reason=finish_reason,
            spans=[(v, s, e) for v, s, e in self.spans],
            routed_experts=np.concatenate(self.routes) if self.sampling.routed_experts and self.tokens else None,
            top_token_ids=np.stack(self.top_ids).astype(np.int32) if self.top_ids else None,
            top_logprobs=np.stack(self.top_logprobs).astype(np.float32) if self.top_logprobs else None,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """What a `BatchScheduler` runs under (the engine's choices and its model's limits)."""

    device: torch.device
    """Where the model runs."""
    dtype: torch.dtype
    """The precision the model runs in."""
    max_batch: int
    """Most requests decoded together; more wait for a free row."""
    max_model_len: int
    """Cap on prompt + generation; a row that reaches it ends with "length"."""
    pad_id: int
    """The token id under the left padding of a prefill (masked out)."""
    num_threads: int | None
    """Intra-op threads of the scheduler thread (set in that thread only); None: torch's default."""


class BatchScheduler:
    """The requests' queue, the running batch and its KV cache, and the thread that runs them over the model, under
    `config` (`SchedulerConfig`).

    A base class: the engine that extends it loads the model into `_model`, starts `_run` on a thread of its own, and
    says what a model call adds (`_lora_hooks`) and which version each token is of (`_version_of`).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.device = config.device
        self.max_batch = config.max_batch
        self.max_model_len = config.max_model_len
        self.num_threads = config.num_threads
        """The config's, until the engine chooses it for the model it loads."""
        self.config = config
        self._model: Any = None
        """The causal LM the steps call (None until the engine loads it)."""
        # `_cv` guards the queue and flags (held for microseconds, also by the event loop);
        # `_step_lock` guards the model and the running batch (held by a whole step, never by the loop).
        # Lock order: `_step_lock`, then `_cv`. Other threads take `_step_lock` through `_between_steps`.
        self._cv = threading.Condition()
        self._step_lock = threading.Lock()
        self._step_lock_waiters = 0
        """Threads waiting for `_step_lock` (under `_cv`): the scheduler lets them in before its next step."""
        self._waiting: collections.deque[Request] = collections.deque()
        self._live: dict[str, Request] = {}
        self._aborts: set[Request] = set()
        """Requests to end at the next step boundary (objects, not ids: a reused id is never hit)."""
        self._paused = False
        self._closing = False
        # Running batch, owned by the scheduler thread under `_step_lock`. Invariant: the cache holds
        # every token of each row except its last sampled one, which the next decode step feeds.
        self._rows: list[Request] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._stale = False
        """Weights changed under the running rows: their cache is recomputed before the next token."""
        # `_paused_adapters` and `_held` (rows of adapters paused with "keep", out of the batch with their tokens)
        # change under `_cv`.
        self._paused_adapters: set[str] = set()
        self._held: list[Request] = []
        self._routers: list[torch.nn.Module] = []
        """The model's mixture-of-experts routers, by layer (`_route_hooks`)."""
        self.generated_tokens = 0
        """Tokens sampled since start (a counter for throughput metrics)."""
        self.prefill_tokens = 0
        """Tokens run through a prefill since start: new requests' prompts (and tokens so far), and recomputes."""
        self.recomputed_tokens = 0
        """Of those, the tokens of running rows whose cache a weight load made stale (`keep` mode's re-prefill)."""

    # -- scheduler thread ------------------------------------------------------------------------

    def _run(self) -> None:
        """The scheduler loop: sleep until there is work, then run one step at a time."""
        if self.num_threads:
            torch.set_num_threads(self.num_threads)  # affects this thread only
        while True:
            with self._cv:
                while not self._closing and (self._step_lock_waiters or not self._has_step()):
                    self._cv.wait()
                if self._closing:
                    return
            with self._step_lock:
                self._apply_aborts()
                with self._cv:
                    if self._paused:
                        continue
                    admitted = self._admit(self.max_batch - len(self._rows))
                if not (self._rows or admitted):
                    continue
                try:
                    with torch.inference_mode():
                        self._step(admitted)
                except Exception as exc:  # a failed step must not kill the engine: fail its requests, go on
                    log.exception("torch engine step failed")
                    failed = [*self._rows, *[r for r in admitted if r not in self._rows]]
                    self._rows, self._cache, self._mask, self._stale = [], None, None, False
                    with self._cv:
                        for req in failed:
                            self._live.pop(req.id, None)
                    settle([(req, RuntimeError(f"torch engine step failed: {exc!r}")) for req in failed])

    def _has_step(self) -> bool:
        """Aborts to apply, or (unpaused) rows to decode or a waiting request that may start (caller holds `_cv`)."""
        if self._aborts:
            return True
        if self._paused:
            return False
        return bool(self._rows) or any(r.adapter not in self._paused_adapters for r in self._waiting)

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold the step lock between two steps, for a thread other than the scheduler.

        A plain lock is not fair: the scheduler thread takes it back right after each step, and a
        caller could wait hundreds of steps. So the scheduler waits while someone is queued here.
        """
        with self._cv:
            self._step_lock_waiters += 1
        try:
            with self._step_lock:
                yield
        finally:
            with self._cv:
                self._step_lock_waiters -= 1
                self._cv.notify_all()

    def _admit(self, room: int) -> list[Request]:
        """Take up to `room` requests from the queue in order, passing over those of paused adapters
        (caller holds `_cv`): a paused adapter must not hold up the base model or other adapters."""
        if not self._paused_adapters:
            return [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        admitted: list[Request] = []
        passed: list[Request] = []
        while self._waiting and len(admitted) < room:
            req = self._waiting.popleft()
            (passed if req.adapter in self._paused_adapters else admitted).append(req)
        self._waiting.extendleft(reversed(passed))
        return admitted

    def _apply_aborts(self) -> None:
        """End aborted requests, running, held or waiting (caller holds `_step_lock`), and resolve them in that order:
        a caller that continues each after a pause (the worker) then queues the samples that had rows ahead of those
        that never started, so that they get rows first again."""
        with self._cv:
            aborts, self._aborts = self._aborts, set()
            if not aborts:
                return
            ended = [r for r in self._rows if r in aborts]
            ended += [r for r in self._held if r in aborts]
            self._held = [r for r in self._held if r not in aborts]
            waiting = [r for r in self._waiting if r in aborts]
            for req in waiting:
                self._waiting.remove(req)
            ended += waiting
        keep = [i for i, r in enumerate(self._rows) if r not in aborts]
        if len(keep) < len(self._rows):
            self._select_rows(keep)
        self._finish([(r, "abort") for r in ended])

    def _step(self, admitted: list[Request]) -> None:
        """One token for every running row: decode the cached rows, prefill the new (or stale) ones."""
        model = self._model
        logits = []
        if self._stale:
            self.recomputed_tokens += sum(r.length for r in self._rows)
            admitted = self._rows + admitted
            self._rows, self._cache, self._mask, self._stale = [], None, None, False
        if self._rows:
            assert self._mask is not None  # a running batch has its attention mask
            batch = len(self._rows)
            mask = torch.cat([self._mask, self._mask.new_ones(batch, 1)], dim=1)
            with self._lora_hooks(self._rows), self._route_hooks(self._rows) as picked:
                out = model(
                    input_ids=torch.tensor([[r.tokens[-1]] for r in self._rows], device=self.device),
                    position_ids=torch.tensor([[r.length - 1] for r in self._rows], device=self.device),
                    attention_mask=mask,
                    **{cache_name(model): self._cache},
                    use_cache=True,
                )
            self._keep_routes(self._rows, picked, 1)
            self._mask = mask
            logits.append(out.logits[:, -1])
        if admitted:
            self.prefill_tokens += sum(r.length for r in admitted)
            width = max(r.length for r in admitted)
            ids = torch.full((len(admitted), width), self.config.pad_id, dtype=torch.long)
            mask = torch.zeros((len(admitted), width), dtype=torch.long)
            for i, r in enumerate(admitted):
                ids[i, width - r.length :] = torch.tensor(r.prompt + r.tokens)
                mask[i, width - r.length :] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            with self._lora_hooks(admitted), self._route_hooks(admitted) as picked:
                out = model(
                    input_ids=ids,
                    position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    attention_mask=mask,
                    use_cache=True,
                    logits_to_keep=1,
                )
            self._keep_routes(admitted, picked, width)
            logits.append(out.logits[:, -1])
            self._merge(admitted, getattr(out, cache_name(model)), mask)
        tokens, logprobs, tops = self._sample(torch.cat(logits).float())
        self.generated_tokens += len(tokens)
        finished: list[tuple[Request, FinishReason]] = []
        keep = []
        for i, (req, token, logprob, top) in enumerate(zip(self._rows, tokens, logprobs, tops, strict=True)):
            req.append(token, logprob, self._version_of(req), top)
            if token in req.stop_ids:
                finished.append((req, "stop"))
            elif len(req.tokens) >= req.sampling.max_tokens or req.length >= self.max_model_len:
                finished.append((req, "length"))
            else:
                keep.append(i)
        if finished:
            self._select_rows(keep)
            self._finish(finished)

    @contextlib.contextmanager
    def _route_hooks(self, rows: Sequence[Request]) -> Iterator[list[torch.Tensor]]:
        """For one model call over `rows`: the experts each router picks (one `[rows x positions, top_k]` tensor a
        layer, in layer order), if a row asked for them; no hook at all otherwise."""
        picked: list[torch.Tensor] = []
        if not any(r.sampling.routed_experts for r in rows):
            yield picked
            return

        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
            picked.append(output[-1].to(torch.int16))  # (logits, scores, indices): `routers` takes no other kind

        handles = [router.register_forward_hook(hook) for router in self._routers]
        try:
            yield picked
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def _keep_routes(rows: Sequence[Request], picked: list[torch.Tensor], width: int) -> None:
        """Give each row that asked its positions' experts from one model call over `width` positions a row (left
        padded): a decode call (width 1) adds its last token's, a prefill (every position) replaces them."""
        if not picked:
            return
        routes_np = torch.stack(picked).view(len(picked), len(rows), width, -1).permute(1, 2, 0, 3).cpu().numpy()
        for i, req in enumerate(rows):
            if not req.sampling.routed_experts:
                continue
            if width == 1:
                req.routes.append(routes_np[i].copy())  # not a view: the batch's array goes with this step
            else:
                req.routes = [routes_np[i, width - req.length :].copy()]

    def _take_rows(self, indices: list[int]) -> list[Request]:
        """Take these rows out of the running batch (their tokens and spans stay with the requests)."""
        if not indices:
            return []
        taken = set(indices)
        rows = [self._rows[i] for i in indices]
        self._select_rows([i for i in range(len(self._rows)) if i not in taken])
        return rows

    def _requeue(self, indices: list[int]) -> None:
        """Send these rows to the queue's front: prefilled again (prompt + tokens so far) under current weights."""
        rows = self._take_rows(indices)
        with self._cv:
            self._waiting.extendleft(reversed(rows))
            self._cv.notify_all()

    def _sample(
        self, logits: torch.Tensor
    ) -> tuple[list[int], list[float], list[tuple[np.ndarray, np.ndarray] | None]]:
        """Pick each row's token, in vLLM's order (`pipeline.wire.Sampling`): the `min_tokens` mask and the penalties
        (`_adjust`), then greedy, or the temperature, `min_p`, `top_k` and `top_p` (`_truncate`) and a draw with noise
        fixed by the row's seed.

        The logprob is the row's `logprobs_mode`'s: `raw`, that of the model's distribution (before anything was
        applied), as vLLM reports by default and as the trainer recomputes; `processed`, that of the distribution the
        token was drawn from, log_softmax of the logits after every step (-inf where a token was dropped; vLLM's
        `processed_logprobs`). A greedy row's processed ones are after the mask and the penalties only (its raw ones
        when it has neither), as vLLM's. A row that asked for alternatives (`top_logprobs` = k) gets the k most likely
        tokens of that same distribution and their logprobs, else None.
        """
        rows = self._rows
        logprobs_all = torch.log_softmax(logits, dim=-1)
        adjusted = _adjust(rows, logits)
        tokens = adjusted.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if r.sampling.temperature > 0]
        shaped: torch.Tensor | None = None
        """The sampled rows' logits after every step (-inf where dropped), a row each of `sampled`."""
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            shaped, probs = _truncate([rows[i].sampling for i in sampled], adjusted[index])
            # Inverse CDF: one uniform draw per row, for all rows at once, each from its own seed and position.
            seeds = torch.tensor([rows[i].seed for i in sampled], device=logits.device)
            steps = torch.tensor([len(rows[i].tokens) for i in sampled], device=logits.device)
            cdf = probs.double().cumsum(dim=-1)
            u = sampling_uniform(seeds, steps) * cdf[:, -1]  # top-p left the rows unnormalized
            picked = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1)
            tokens[index] = picked.clamp(max=probs.shape[1] - 1)
        reported = logprobs_all
        """The distribution each row's logprobs are of (its processed one replaces a processed row's)."""
        processed = [i for i, r in enumerate(rows) if r.sampling.logprobs_mode == "processed"]
        if processed:
            which = torch.tensor(processed, device=logits.device)
            dist = torch.log_softmax(adjusted[which], dim=-1)  # greedy rows: the mask and the penalties only
            if shaped is not None:
                at = {row: k for k, row in enumerate(sampled)}
                drawn = [j for j, i in enumerate(processed) if i in at]
                if drawn:
                    rows_of = torch.tensor([at[processed[j]] for j in drawn], device=logits.device)
                    dist[torch.tensor(drawn, device=logits.device)] = torch.log_softmax(shaped[rows_of], dim=-1)
            reported = logprobs_all.index_put((which,), dist)
        chosen = reported.gather(1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), chosen.tolist(), _alternatives(rows, reported)

    def _merge(self, new_rows: list[Request], cache: Any, mask: torch.Tensor) -> None:
        """Append freshly prefilled rows to the running batch, left-padding the shorter cache."""
        if not self._rows:
            self._rows, self._cache, self._mask = list(new_rows), cache, mask
            return
        assert self._mask is not None  # a running batch has its attention mask
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers, strict=True):
            old_layer.keys = torch.cat([_pad_left(old_layer.keys, width), _pad_left(new_layer.keys, width)])
            old_layer.values = torch.cat([_pad_left(old_layer.values, width), _pad_left(new_layer.values, width)])
        self._mask = torch.cat([_pad_left(self._mask, width), _pad_left(mask, width)])
        self._rows += new_rows

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only these rows of the batch, and drop cache columns no remaining row attends to."""
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._cache = self._mask = None
            return
        assert self._mask is not None  # a running batch has its attention mask
        index = torch.tensor(keep, device=self.device)
        mask = self._mask.index_select(0, index)
        start = int(mask.any(dim=0).int().argmax())
        self._mask = mask[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]

    def _finish(self, ended: list[tuple[Request, FinishReason]]) -> None:
        with self._cv:
            for req, _ in ended:
                self._live.pop(req.id, None)
        settle([(req, req.result(reason)) for req, reason in ended])

    def _require_model(self) -> None:
        """`RuntimeError` until the engine has loaded the model."""
        if self._model is None:
            raise RuntimeError("start() the engine before loading weights")

    # -- what the engine adds to a model call ----------------------------------------------------

    def _version_of(self, req: Request) -> int:
        """The version a row's token is of."""
        raise NotImplementedError

    def _lora_hooks(self, rows: Sequence[Request]) -> contextlib.AbstractContextManager[None]:
        """For one model call over `rows`: the context in which the model adds each adapter row's LoRA term."""
        raise NotImplementedError


def _adjust(rows: Sequence[Request], logits: torch.Tensor) -> torch.Tensor:
    """The logits after what applies to greedy and sampled rows alike, in vLLM's order: the stop tokens at -inf while a
    row has fewer than `min_tokens` tokens, then `repetition_penalty` (over the prompt and the tokens so far: a positive
    logit divided by it, another multiplied), `frequency_penalty` (times each token's count so far) and
    `presence_penalty` (once for each token generated so far). `logits` itself when no row asks for any."""
    masked = [i for i, r in enumerate(rows) if len(r.tokens) < r.sampling.min_tokens]
    penalized = [i for i, r in enumerate(rows) if _penalized(r.sampling)]
    if not (masked or penalized):
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in masked:
        stops = [t for t in rows[i].stop_ids if t < vocab]
        logits[i, torch.tensor(stops, dtype=torch.long, device=logits.device)] = float("-inf")
    if not penalized:
        return logits
    device = logits.device
    index = torch.tensor(penalized, device=device)
    counts = torch.zeros((len(penalized), vocab), device=device)
    seen = torch.zeros((len(penalized), vocab), dtype=torch.bool, device=device)
    for j, i in enumerate(penalized):
        req = rows[i]
        if req.tokens:
            counts[j] = torch.bincount(torch.tensor(req.tokens, device=device), minlength=vocab)[:vocab].float()
        seen[j, torch.tensor(req.prompt, dtype=torch.long, device=device)] = True
    made = counts > 0
    sampling = [rows[i].sampling for i in penalized]
    repetition = torch.tensor([s.repetition_penalty for s in sampling], device=device)[:, None]
    frequency = torch.tensor([s.frequency_penalty for s in sampling], device=device)[:, None]
    presence = torch.tensor([s.presence_penalty for s in sampling], device=device)[:, None]
    rows_logits = logits[index]
    penalty = torch.where(seen | made, repetition, 1.0)
    rows_logits = rows_logits * torch.where(rows_logits > 0, 1.0 / penalty, penalty)
    rows_logits = rows_logits - frequency * counts - presence * made.float()
    logits[index] = rows_logits
    return logits


def _penalized(sampling: Sampling) -> bool:
    return sampling.repetition_penalty != 1 or sampling.frequency_penalty != 0 or sampling.presence_penalty != 0


def _truncate(samplings: Sequence[Sampling], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled rows' logits (after `_adjust`) through the temperature, `min_p`, `top_k` and `top_p`, in that order, each
    over what the one before kept: the logits with -inf where a token was dropped, and the probabilities to draw from
    (0 where dropped; unnormalized after top-p).

    `min_p`: a token is dropped when its probability is below `min_p` times the most likely one's. `top_k`: every token
    whose logit is below the k-th largest is dropped (ties with it stay). `top_p`: a token is dropped when the mass
    ranked above it already reaches `top_p` (the first always stays)."""
    device = logits.device
    temps = torch.tensor([s.temperature for s in samplings], device=device)
    scaled = logits / temps[:, None]
    min_p = torch.tensor([s.min_p for s in samplings], device=device)
    if bool((min_p > 0).any()):
        probs = torch.softmax(scaled, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    vocab = scaled.shape[1]
    top_k = torch.tensor([s.top_k if 0 < s.top_k < vocab else 0 for s in samplings], device=device)
    if bool((top_k > 0).any()):
        ranked = scaled.topk(int(top_k.max()), dim=-1).values
        kth = ranked.gather(1, (top_k.clamp(min=1) - 1)[:, None])
        kth = kth.masked_fill((top_k == 0)[:, None], float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    top_p = torch.tensor([s.top_p for s in samplings], device=device)
    if bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass ranked above it already reaches top_p (the first always stays).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        dropped = torch.zeros_like(drop).scatter(1, order, drop)
        probs = probs.masked_fill(dropped, 0.0)
        scaled = scaled.masked_fill(dropped, float("-inf"))
    return scaled, probs


def _alternatives(rows: Sequence[Request], logprobs: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Each row's `top_logprobs` most likely tokens of its distribution `logprobs` (a row each) and their logprobs,
    most likely first; None for a row that did not ask. One `topk` for the rows that asked."""
    tops: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(rows)
    asked = [i for i, r in enumerate(rows) if r.sampling.top_logprobs > 0]
    if not asked:
        return tops
    most = max(rows[i].sampling.top_logprobs for i in asked)
    values, ids = logprobs[torch.tensor(asked, device=logprobs.device)].topk(most, dim=-1)
    values_np, ids_np = values.cpu().numpy().astype(np.float32), ids.cpu().numpy().astype(np.int32)
    for j, i in enumerate(asked):
        k = rows[i].sampling.top_logprobs
        tops[i] = (ids_np[j, :k].copy(), values_np[j, :k].copy())
    return tops


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xorshift-multiply rounds) on int64 tensors; products stay below 2**63."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def sampling_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A uniform draw in [0, 1) for each row, a pure function of (row seed, step): float64.

    Counter-based, like Philox: one batched computation for every row. A row's draw depends only on its own seed
    and position, so its tokens are the same alone or in any batch.
    """
    row = _hash32(_hash32(seeds) ^ _hash32((seeds >> 32) + 0x632BE5AB))
    high = _hash32(row + _hash32(steps + 0x1B873593))
    low = _hash32(high ^ 0x5BD1E995)
    return (high.double() * 2**21 + (low >> 11).double()) / 2**53  # 53 random bits


def settle(outcomes: Sequence[tuple[Request, Generation | BaseException]]) -> None:
    """Resolve requests' futures on their own event loops, from any thread: one wake-up per loop for the batch.

    A step ends many requests at once (a batch started together ends together): each loop gets one
    `call_soon_threadsafe` for all of its requests, not one a request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, Generation | BaseException]]] = {}
    for req, outcome in outcomes:
        by_loop.setdefault(req.loop, []).append((req, outcome))

    def apply(batch: list[tuple[Request, Generation | BaseException]]) -> None:
        for req, outcome in batch:
            if req.future.done():  # cancelled by its caller
                continue
            if isinstance(outcome, BaseException):
                req.future.set_exception(outcome)
            else:
                req.future.set_result(outcome)

    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(apply, batch)


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the sequence axis (dim 2 of a [batch, heads, seq, dim] cache, dim 1 of a mask) on the left."""
    axis = 2 if tensor.ndim == 4 else 1
    missing = width - tensor.shape[axis]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=axis)

"""LoRA adapters on the `vllm` engine (`VllmAdapters`, mixed into `VllmEngine`): vLLM's own, each (adapter, version)
with a private PEFT directory and a `LoRARequest` whose id and `lora_name` are never reused (vLLM keys its active
adapters and its prefix-cache hashes by `lora_name`), so two versions never serve each other's weights or KV blocks; a
replaced version is removed once no request of it runs. `pause_adapter` holds the adapter's new requests and aborts
its running ones; under `keep`, a sample continues after `resume_adapter` as a new vLLM request (prompt + tokens so
far, the remaining `max_tokens`) under the adapter's version of then."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.lora.request import LoRARequest

from consumers.engines.base import (
    EngineClosedError,
    EngineInputError,
    Generation,
    continuation_seed,
    continued,
)
from consumers.engines.lora import parse_adapter, save_adapter
from consumers.engines.model_files import checkpoint_shapes
from consumers.engines.vllm_common import VLLM_FINISH_REASONS
from consumers.engines.vllm_requests import EMPTY_LOGPROBS, add_span, alternatives, routes_of
from pipeline.wire import PAUSE_MODES, FinishReason, PauseMode, Sampling

log = logging.getLogger(__name__)

PAUSE_ABORT_RETRY_S = 0.05
"""How often `pause_adapter` aborts again a request of the adapter that is still in vLLM: an abort that reaches
vLLM before the request itself (just submitted) is a no-op there."""


@dataclass(eq=False)
class LoadedAdapter:
    """One loaded adapter version: its vLLM `LoRARequest` (own id and name) and its private PEFT directory."""

    version: int
    request: LoRARequest
    path: Path


@dataclass(eq=False)
class AdapterRequest:
    """A `generate` call under an adapter, followed by `pause_adapter`, `abort` and `shutdown`."""

    adapter: str
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to end it with the tokens so far (abort, abort-pauses, shutdown), even while it waits for a resume."""
    segment: asyncio.Future[Any] | None = None
    """Its vLLM request now (one per stretch between pauses)."""
    kept: bool = False
    """Its segment was aborted by `pause_adapter(keep)`: go on after `resume_adapter`."""


class VllmAdapters:
    """The adapter half of `Engine` on vLLM (`max_loras > 0`): slots, loads and removals, per-adapter pauses, and a
    request under an adapter, continued across `keep` pauses. Mixed into `VllmEngine`, whose vLLM and requests it
    uses."""

    # What `VllmEngine` provides, declared for the type checker only (annotations define no class attribute).
    model_dir: Path
    max_model_len: int
    max_loras: int
    max_lora_rank: int
    _llm: Any
    _live: set[str]
    _closing: bool
    _died: asyncio.Future[None] | None
    _run: Callable[..., Awaitable[tuple[list[int], np.ndarray, Any, int | None]]]
    """One vLLM request to its end: `(llm, prompt, params, request_id, lora, tracked)` -> tokens, logprobs, its final
    output, the prompt tokens it found cached."""
    if TYPE_CHECKING:

        async def _started(self) -> Any: ...

        def _sampling_params(self, prompt_len: int, sampling: Sampling) -> Any: ...

    def __init__(self) -> None:
        self._adapters: dict[str, LoadedAdapter] = {}
        self._adapter_lock = asyncio.Lock()
        self._adapter_requests: dict[str, AdapterRequest] = {}
        self._adapter_pauses: dict[str, asyncio.Event] = {}
        """Paused adapters, each with the event `resume_adapter` sets."""
        self._lora_ids = itertools.count(1)
        self._lora_users: Counter[int] = Counter()
        """vLLM requests running now per LoRA id."""
        self._retired: dict[int, Path] = {}
        """LoRA ids of replaced or removed versions, removed from vLLM once no request of them runs."""
        self._lora_dir: Path | None = None
        self._linears: dict[str, tuple[int, int]] | None = None

    def _end_adapter_requests(self, request_ids: list[str] | None = None) -> None:
        """End these adapter requests (None: all) with their tokens so far, those waiting for `resume_adapter` too."""
        for request_id, request in self._adapter_requests.items():
            if request_ids is None or request_id in request_ids:
                request.ended.set()

    def adapters(self) -> dict[str, int]:
        """The adapters loaded now, name -> version."""
        return {name: a.version for name, a in self._adapters.items()}

    async def load_adapter(
        self, name: str, tensors: Mapping[str, Any], config: Mapping[str, Any], version: int
    ) -> None:
        """Load LoRA adapter `name` (PEFT tensors and config) at `version`, or replace the one of that name.

        Checked against the model's Linear shapes (from its checkpoint) before vLLM sees it; a bad or surplus
        adapter raises `ValueError` and loads nothing. A replaced version keeps serving the requests that run
        under it now (vLLM cannot swap an adapter under a running request); new requests get the new one.
        """
        if not self.max_loras:
            raise ValueError(f"this engine serves no adapters (max_loras=0); cannot load {name!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        self._check_slot(name)
        parsed = await asyncio.to_thread(parse_adapter, tensors, config, self._linear_shapes())
        if parsed.rank > self.max_lora_rank:
            raise ValueError(
                f"adapter {name!r} has rank {parsed.rank}; this engine's max_lora_rank is {self.max_lora_rank}"
            )
        llm = await self._started()
        async with self._adapter_lock:
            self._check_slot(name)  # another load may have taken the last slot meanwhile
            lora_id = next(self._lora_ids)
            if self._lora_dir is None:
                self._lora_dir = Path(tempfile.mkdtemp(prefix="rollouts-lora-"))
            path = self._lora_dir / str(lora_id)
            torch_tensors = {
                k: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v.detach().cpu())
                for k, v in tensors.items()
            }
            await asyncio.to_thread(save_adapter, torch_tensors, dict(config), path)
            request = LoRARequest(f"{name}@{version}#{lora_id}", lora_id, str(path))
            try:
                added = await llm.add_lora(request)
            except Exception as exc:  # vLLM's loader refused it (e.g. a module it cannot adapt)
                shutil.rmtree(path, ignore_errors=True)
                raise ValueError(f"vLLM refused adapter {name!r}: {exc}") from exc
            if not added:
                shutil.rmtree(path, ignore_errors=True)
                raise ValueError(f"vLLM did not load adapter {name!r}")
            old = self._adapters.get(name)
            self._adapters[name] = LoadedAdapter(version, request, path)
            if old is not None:
                await self._retire(old)
        log.info("loaded adapter %r version %d (vLLM LoRA id %d)", name, version, lora_id)

    def _check_slot(self, name: str) -> None:
        if name not in self._adapters and len(self._adapters) >= self.max_loras:
            raise ValueError(
                f"all max_loras={self.max_loras} slots hold adapters {sorted(self._adapters)}; remove one first"
            )

    def _linear_shapes(self) -> dict[str, tuple[int, int]]:
        """The model's 2-D weights (Linear layers) by module path, `(out_features, in_features)`, from the checkpoint
        headers: what `parse_adapter` checks an adapter against without loading a model here."""
        if self._linears is None:
            self._linears = {
                key.removesuffix(".weight"): (shape[0], shape[1])
                for key, shape in checkpoint_shapes(self.model_dir).items()
                if key.endswith(".weight") and len(shape) == 2 and "embed" not in key
            }
        return self._linears

    async def remove_adapter(self, name: str) -> None:
        """Free adapter `name`'s slot; `ValueError` while any request of it is in flight (waiting ones included)."""
        async with self._adapter_lock:
            if name not in self._adapters:
                return
            live = sorted(rid for rid, r in self._adapter_requests.items() if r.adapter == name)
            if live:
                raise ValueError(
                    f"adapter {name!r} has {len(live)} requests in flight ({live[:5]}); "
                    "abort them (or pause_adapter(name, 'abort')) before removing it"
                )
            await self._retire(self._adapters.pop(name))

    async def _retire(self, adapter: LoadedAdapter) -> None:
        """Remove a version from vLLM now, or once its last running request ends (`_release_lora`)."""
        self._retired[adapter.request.lora_int_id] = adapter.path
        if not self._lora_users[adapter.request.lora_int_id]:
            await self._release_lora(adapter.request.lora_int_id, use=0)

    async def _release_lora(self, lora_id: int, use: int = 1) -> None:
        """One vLLM request of `lora_id` ended; a retired id with none left leaves vLLM and its files go."""
        self._lora_users[lora_id] -= use
        if self._lora_users[lora_id] > 0 or lora_id not in self._retired:
            return
        del self._lora_users[lora_id]
        path = self._retired.pop(lora_id)
        if self._llm is not None and not self._closing:
            with contextlib.suppress(Exception):  # an engine going down frees it anyway
                await self._llm.remove_lora(lora_id)
        shutil.rmtree(path, ignore_errors=True)

    async def pause_adapter(self, name: str, mode: PauseMode) -> None:
        """Stop generating for adapter `name` only (loaded or not); returns once no request of it is in vLLM.

        vLLM has no per-adapter pause, so its running requests are aborted in vLLM. `abort`: their `generate`
        calls return the tokens so far; `keep`: they wait for `resume_adapter` and then go on as new vLLM requests
        (see `_generate_adapter`); `inflight` does as `keep` (vLLM cannot swap an adapter under a running request).
        Either way its new requests wait in `generate`.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        self._adapter_pauses.setdefault(name, asyncio.Event())
        mine = [(rid, r) for rid, r in self._adapter_requests.items() if r.adapter == name]
        for _, request in mine:
            if mode == "abort":
                request.ended.set()
            else:
                request.kept = True
        running = {rid: r.segment for rid, r in mine if r.segment is not None and not r.segment.done()}
        while running and self._llm is not None:
            await self._llm.abort(list(running))
            await asyncio.wait(running.values(), timeout=PAUSE_ABORT_RETRY_S)
            running = {rid: seg for rid, seg in running.items() if not seg.done()}

    async def resume_adapter(self, name: str) -> None:
        """Let adapter `name` generate again: its kept requests go on under its version of now."""
        resumed = self._adapter_pauses.pop(name, None)
        if resumed is not None:
            resumed.set()

    async def _generate_adapter(self, request_id: str, prompt: np.ndarray, sampling: Sampling, name: str) -> Generation:
        """A request under adapter `name`: one vLLM request, or several when `pause_adapter(keep)` cut it.

        Each stretch runs under the adapter's version current when it starts; its tokens get that version's span.
        A continuation is prompt + tokens so far with the remaining `max_tokens` and, for a seeded request, a seed
        derived from the seed and the tokens so far (`continuation_seed`), so it stays reproducible.
        """
        if name not in self._adapters:
            raise EngineInputError(f"adapter {name!r} is not loaded; loaded: {sorted(self._adapters)}")
        llm = self._llm if self._llm is not None else await self._started()
        if request_id in self._live:
            raise EngineInputError(f"request id {request_id!r} is already in flight on this engine")
        self._live.add(request_id)
        tracked = self._adapter_requests[request_id] = AdapterRequest(name)
        tokens: list[int] = []
        logprobs: list[np.ndarray] = []
        spans: list[tuple[int, int, int]] = []
        cached: int | None = None
        finish: FinishReason = "abort"
        routes: np.ndarray | None = None
        tops: list[tuple[np.ndarray, np.ndarray]] = []
        try:
            while await self._adapter_ready(tracked):
                adapter = self._adapters[name]  # `remove_adapter` refuses while this request is in flight
                done = len(tokens)
                left = min(sampling.max_tokens, self.max_model_len - len(prompt)) - done
                if left <= 0:
                    finish = "length"
                    break
                seg_prompt = np.concatenate([prompt.astype(np.int64), np.asarray(tokens, dtype=np.int64)])
                seg_sampling = (
                    sampling
                    if not done
                    else continued(sampling, done).model_copy(
                        update={"max_tokens": left, "seed": continuation_seed(sampling.seed, done)}
                    )
                )
                params = self._sampling_params(len(seg_prompt), seg_sampling)
                lora_id = adapter.request.lora_int_id
                self._lora_users[lora_id] += 1
                tracked.kept = False
                try:
                    seg_tokens, seg_logprobs, last, seg_cached = await self._run(
                        llm, seg_prompt, params, request_id, adapter.request, tracked
                    )
                finally:
                    tracked.segment = None
                    await self._release_lora(lora_id)
                if not done:
                    cached = seg_cached
                if seg_tokens:
                    tokens += seg_tokens
                    logprobs.append(seg_logprobs)
                    top = alternatives(seg_tokens, last.logprobs, sampling.top_logprobs)
                    if top is not None:
                        tops.append(top)
                    add_span(spans, adapter.version, done, len(tokens))
                    routes = routes_of(last, sampling, len(prompt), len(tokens), request_id)  # the whole sample's
                finish = VLLM_FINISH_REASONS[last.finish_reason]
                if finish != "abort" or not tracked.kept or tracked.ended.is_set() or self._closing:
                    break
        finally:
            self._live.discard(request_id)
            self._adapter_requests.pop(request_id, None)
        if self._closing and finish == "abort":
            raise EngineClosedError(f"engine shut down before request {request_id!r} finished")
        return Generation(
            tokens=np.asarray(tokens, dtype=np.int32),
            logprobs=np.concatenate(logprobs) if logprobs else EMPTY_LOGPROBS,
            finish_reason=finish,
            spans=spans,
            cached_tokens=cached,
            routed_experts=routes,
            top_token_ids=np.concatenate([t[0] for t in tops]) if tops else None,
            top_logprobs=np.concatenate([t[1] for t in tops]) if tops else None,
        )

    async def _adapter_ready(self, tracked: AdapterRequest) -> bool:
        """Wait while the request's adapter is paused; False once the request was ended (or vLLM died) instead.

        Returns True with no await after its last check, so the caller's submission sees the pause state of now.
        """
        while not tracked.ended.is_set():
            resumed = self._adapter_pauses.get(tracked.adapter)
            if resumed is None:
                return True
            assert self._died is not None
            waits = {asyncio.ensure_future(resumed.wait()), asyncio.ensure_future(tracked.ended.wait())}
            try:
                any_of: set[asyncio.Future[Any]] = {*waits, self._died}
                await asyncio.wait(any_of, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
            if self._died.done():
                raise EngineClosedError(f"the vLLM engine died while adapter {tracked.adapter!r} was paused")
        return False

    def _drop_lora_dir(self) -> None:
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None

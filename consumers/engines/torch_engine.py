"""`torch` engine: batched decode with a KV cache on plain PyTorch + transformers.

It is the reference for correctness (fp32 logprobs equal a plain forward pass) and the engine
for machines without vLLM. One scheduler thread owns the model: it admits waiting requests
into the running batch between decode steps (continuous batching), left-pads them with an
attention mask and per-row position ids, prefills them, and decodes all rows one token per
step from a `DynamicCache`. The asyncio side only enqueues requests and awaits futures that
the thread resolves with `loop.call_soon_threadsafe`, so the event loop never waits on compute.

Rows of one batch never influence each other's tokens: each request samples with its own
`torch.Generator`, so a seeded request gives the same tokens alone or in any batch.

LoRA adapters (up to `max_loras`, PEFT format, `consumers.engines.lora`) are served side by side in one batch,
as vLLM's multi-LoRA does: the base weights stay as they are, and during a model call that has rows of
some adapter, forward hooks on the adapted `nn.Linear` layers add each row's own `scale * B(A x)`.
Base rows get nothing added, and a step without adapter rows runs with no hook at all.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consumers.engines.base import (
    WAKE_ALL,
    EngineClosedError,
    EngineInputError,
    EngineLifecycle,
    Generation,
    LoadsIpcInProcess,
    WakePart,
    check_request,
)
from consumers.engines.lora import LoraModule, ParsedAdapter, linear_shapes, module_types, parse_adapter
from consumers.engines.model_files import WeightLayout, read_model_limits
from pipeline.wire import PAUSE_MODES, SLEEP_LEVELS, FinishReason, PauseMode, Sampling
from staleness.weights.fused import ROUTER_MODELS, routers, to_checkpoint, to_module
from staleness.weights.nccl import BroadcastLink, prepare_receiver, receive_broadcast

log = logging.getLogger(__name__)

SMALL_MODEL_PARAMS = 100_000_000
"""Below this size a CPU engine decodes on one thread (see `TorchEngine`'s `num_threads`)."""


@dataclass(eq=False)
class _Request:
    """One request's state; after admission it is owned by the scheduler thread."""

    id: str
    prompt: list[int]
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Generation]
    seed: int
    """Fixes the row's sampling noise (see `sampling_noise`): its tokens do not depend on the other rows."""
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


@dataclass(frozen=True, eq=False)
class _Adapter:
    """A loaded adapter: its version (what its rows' spans say) and its tensors on the engine's device."""

    version: int
    weights: ParsedAdapter


class TorchEngine(LoadsIpcInProcess, EngineLifecycle):
    """The `Engine` protocol on a transformers causal LM (full attention models).

    Args:
        model_dir: a directory `AutoModelForCausalLM.from_pretrained` can load offline.
        version: policy version of the weights in `model_dir`.
        dtype: torch dtype (or its name) to run in; float32 by default, so logprobs are exact.
        device: where the model runs ("cpu", "cuda", "cuda:1", ...).
        max_batch: most requests decoded together; more wait for a free row.
        max_model_len: cap on prompt + generation; the model's `max_position_embeddings` by default.
        seed: seeds the generators of requests without `sampling.seed` (None: fresh randomness).
        attn_implementation: passed to transformers ("sdpa" or "eager").
        num_threads: intra-op threads of the scheduler thread (set in that thread only). None: 1 for a
            model under 100M parameters on CPU, where thread sync costs more than it saves and, on a
            busy machine, spinning OpenMP threads make a step 30x slower; torch's default otherwise.
        max_loras: LoRA adapters held at once (`load_adapter`); 0 serves the base model only.
    """

    name = "torch"
    weight_receivers = 1
    """Processes that take a rank in an nccl broadcast: this one."""
    max_batch_tokens: int | None = None
    """No token limit: its cache grows with the rows it runs (`max_batch` bounds them)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        version: int = 0,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_batch: int = 64,
        max_model_len: int | None = None,
        seed: int | None = None,
        attn_implementation: str = "sdpa",
        num_threads: int | None = None,
        max_loras: int = 4,
    ) -> None:
        from transformers import AutoConfig

        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {max_loras}")
        self.max_loras = max_loras
        self.model_dir = Path(model_dir)
        self.version = version
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.attn_implementation = attn_implementation
        self.num_threads = num_threads
        # The config alone (cheap) gives the limits the worker checks before `start()` loads weights.
        layer_types = getattr(AutoConfig.from_pretrained(self.model_dir).get_text_config(), "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"TorchEngine supports full-attention models only; {self.model_dir} has {layer_types}")
        limits = read_model_limits(self.model_dir, max_model_len)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self._eos_ids = limits.eos_ids
        self._pad_id = limits.pad_id
        self._seeds = random.Random(seed)

        self._model: Any = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # `_cv` guards the queue and flags (held for microseconds, also by the event loop);
        # `_step_lock` guards the model and the running batch (held by a whole step, never by the loop).
        # Lock order: `_step_lock`, then `_cv`. Other threads take `_step_lock` through `_between_steps`.
        self._cv = threading.Condition()
        self._step_lock = threading.Lock()
        self._step_lock_waiters = 0
        """Threads waiting for `_step_lock` (under `_cv`): the scheduler lets them in before its next step."""
        self._waiting: collections.deque[_Request] = collections.deque()
        self._live: dict[str, _Request] = {}
        self._aborts: set[_Request] = set()
        """Requests to end at the next step boundary (objects, not ids: a reused id is never hit)."""
        self._paused = False
        self._closing = False
        self._closed = False
        # Running batch, owned by the scheduler thread under `_step_lock`. Invariant: the cache holds
        # every token of each row except its last sampled one, which the next decode step feeds.
        self._rows: list[_Request] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._stale = False
        """Weights changed under the running rows: their cache is recomputed before the next token."""
        self._asleep = 0
        """The level of `sleep` (under `_step_lock`); 0: awake."""
        self._shapes: list[tuple[torch.nn.Parameter, torch.Size]] = []
        """A level-2 sleep's emptied parameters and their shapes, for `wake_up`."""
        self._keep_cache = False
        """Set by `pause("inflight")` until `resume` (under `_cv`): a load leaves the running rows' cache as it is."""
        # Adapters: `_adapters` changes under both locks (read under either); `_paused_adapters` and `_held`
        # (rows of adapters paused with "keep", out of the batch with their tokens) under `_cv`.
        self._adapters: dict[str, _Adapter] = {}
        self._paused_adapters: set[str] = set()
        self._held: list[_Request] = []
        self._linears: dict[str, torch.nn.Module] = {}
        self._module_types: dict[str, str] = {}
        self._routers: list[torch.nn.Module] = []
        """The model's mixture-of-experts routers, by layer (`_route_hooks`)."""
        self.generated_tokens = 0
        """Tokens sampled since start (a counter for throughput metrics)."""
        self.prefill_tokens = 0
        """Tokens run through a prefill since start: new requests' prompts (and tokens so far), and recomputes."""
        self.recomputed_tokens = 0
        """Of those, the tokens of running rows whose cache a weight load made stale (`keep` mode's re-prefill)."""

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (off the event loop) and start the scheduler thread. Idempotent."""
        await asyncio.to_thread(self._start_sync)

    def _start_sync(self) -> None:
        from transformers import AutoModelForCausalLM

        with self._start_lock:
            if self._closed or self._closing:
                raise EngineClosedError("the engine was shut down")
            if self._thread is not None:
                return
            model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=self.dtype, attn_implementation=self.attn_implementation
            )
            model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]  # transformers mistypes .to()
            self._linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            self._module_types = module_types(model)
            self._routers = routers(model)
            if self.num_threads is None and self.device.type == "cpu":
                self.num_threads = 1 if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS else None
            self._model = model
            self._thread = threading.Thread(target=self._run, name=f"torch-engine-{self.model_dir.name}", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the scheduler thread; requests still pending fail with `EngineClosedError`."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)
        with self._step_lock, self._cv:
            pending = list(self._live.values())
            self._live.clear()
            self._waiting.clear()
            self._held = []
            self._adapters.clear()
            self._rows = []
            self._cache = self._mask = None
            self._model = None
            self._closed = True
        _settle([(req, EngineClosedError(f"engine shut down before request {req.id!r} finished")) for req in pending])

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling, adapter: str | None = None
    ) -> Generation:
        """Generate one sample from `prompt_tokens`, under LoRA `adapter` if given (its spans then carry the
        adapter's versions); raises `EngineInputError` for a request it cannot serve. A request of a paused
        adapter waits for `resume_adapter`."""
        prompt = np.asarray(prompt_tokens)
        if sampling.routed_experts and self._thread is None:
            await self.start()  # whether the model has routers is known once it is loaded
        check_request(prompt, sampling, self.max_model_len, self.vocab_size, no_routes=self._no_routes())
        if adapter is not None and self.max_loras == 0:
            raise EngineInputError(f"adapter {adapter!r} asked of an engine that serves no adapters (max_loras=0)")
        if self._thread is None:
            await self.start()
        loop = asyncio.get_running_loop()
        req = _Request(
            id=request_id,
            prompt=prompt.astype(np.int64).tolist(),
            sampling=sampling,
            loop=loop,
            future=loop.create_future(),
            seed=sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63),
            stop_ids=frozenset(sampling.stop_token_ids) | self._eos_ids,
            adapter=adapter,
        )
        with self._cv:
            if self._closing:
                raise EngineClosedError("the engine was shut down")
            if request_id in self._live:
                raise EngineInputError(f"request id {request_id!r} is already in flight on this engine")
            if adapter is not None and adapter not in self._adapters:
                raise EngineInputError(f"adapter {adapter!r} is not loaded; loaded: {sorted(self._adapters)}")
            self._live[request_id] = req
            self._waiting.append(req)
            self._cv.notify_all()
        try:
            return await req.future
        except asyncio.CancelledError:
            # The caller gave up: free the row rather than generate for nobody.
            with self._cv:
                if self._live.get(request_id) is req:
                    self._aborts.add(req)
                self._cv.notify_all()
            raise

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests at the next step boundary; their `generate` returns the tokens so far."""
        with self._cv:
            self._aborts.update(self._live[i] for i in request_ids if i in self._live)
            self._cv.notify_all()

    async def pause(self, mode: PauseMode) -> None:
        """Stop decoding between steps; returns once no step runs. `abort` also ends every request now; `keep`
        holds them, and a load then recomputes their cache; `inflight` holds them, and they keep their cache across
        a load (tokens after it are sampled by the new weights over keys and values partly of the old ones)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        with self._cv:
            self._paused = True
            self._keep_cache = mode == "inflight"
            self._cv.notify_all()
        await asyncio.to_thread(self._wait_step, mode == "abort")

    def _wait_step(self, abort_all: bool) -> None:
        """Take the step lock once (the step in progress ends), aborting everything on the way if asked."""
        with self._between_steps():
            if abort_all:
                with self._cv:
                    self._aborts.update(self._live.values())
                self._apply_aborts()

    async def resume(self) -> None:
        """Continue decoding (requests kept by `pause("keep")` or `pause("inflight")` go on where they stopped)."""
        with self._cv:
            self._paused = False
            self._keep_cache = False
            self._cv.notify_all()

    # -- LoRA adapters ---------------------------------------------------------------------------

    def adapters(self) -> dict[str, int]:
        """The adapters loaded now, name -> version."""
        with self._cv:
            return {name: a.version for name, a in self._adapters.items()}

    async def load_adapter(
        self, name: str, tensors: Mapping[str, Any], config: Mapping[str, Any], version: int
    ) -> None:
        """Load LoRA adapter `name` (PEFT tensors and config) at `version`, or replace the one of that name.

        Checked against the model's Linear layers off the event loop before anything changes: a bad or
        surplus adapter raises `ValueError` and loads nothing. Running rows of a replaced adapter go back
        to the queue's front and are prefilled again under the new weights, so each token is of one version.
        """
        if self.max_loras == 0:
            raise ValueError(f"this engine serves no adapters (max_loras=0); cannot load {name!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        self._require_model()
        with self._cv:
            self._check_slot(name)
        parsed = await asyncio.to_thread(self._parse_adapter, tensors, config)
        await asyncio.to_thread(self._install_adapter, name, _Adapter(version, parsed))

    def _parse_adapter(self, tensors: Mapping[str, Any], config: Mapping[str, Any]) -> ParsedAdapter:
        parsed = parse_adapter(tensors, config, linear_shapes(self._model), modules=self._module_types)
        return parsed.to(self.device, self.dtype)

    def _check_slot(self, name: str) -> None:
        """`ValueError` if `name` would need a slot and all are taken (caller holds `_cv`)."""
        if name not in self._adapters and len(self._adapters) >= self.max_loras:
            raise ValueError(
                f"cannot load adapter {name!r}: all max_loras={self.max_loras} slots hold adapters "
                f"{sorted(self._adapters)}; remove_adapter one first"
            )

    def _install_adapter(self, name: str, adapter: _Adapter) -> None:
        """Put the adapter in its slot between two steps; a replaced adapter's running rows are prefilled again."""
        with self._between_steps():
            with self._cv:
                self._check_slot(name)
                replaced = name in self._adapters
                self._adapters[name] = adapter
            if replaced:
                self._requeue([i for i, r in enumerate(self._rows) if r.adapter == name])
        log.info("loaded adapter %r version %d (%d modules)", name, adapter.version, len(adapter.weights.modules))

    async def remove_adapter(self, name: str) -> None:
        """Free adapter `name`'s slot; `ValueError` while any request of it is waiting, running or held."""
        await asyncio.to_thread(self._remove_adapter_sync, name)

    def _remove_adapter_sync(self, name: str) -> None:
        with self._between_steps(), self._cv:
            if name not in self._adapters:
                return
            live = sorted(r.id for r in self._live.values() if r.adapter == name)
            if live:
                raise ValueError(
                    f"adapter {name!r} has {len(live)} requests in flight ({live[:5]}); "
                    "abort them (or pause_adapter(name, 'abort')) before removing it"
                )
            del self._adapters[name]

    async def pause_adapter(self, name: str, mode: PauseMode) -> None:
        """Stop generating for adapter `name` only (loaded or not); returns once no step runs with it.

        `abort` ends its requests now (waiting, running or held) with their tokens so far; `keep` takes
        its running rows out of the batch, tokens and spans kept, until `resume_adapter`; `inflight` does as
        `keep` (an adapter's rows are prefilled again under its new version). Either way its new requests wait,
        without holding up the requests queued behind them.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        with self._cv:
            self._paused_adapters.add(name)
            self._cv.notify_all()
        await asyncio.to_thread(self._pause_adapter_sync, name, mode == "abort")

    def _pause_adapter_sync(self, name: str, abort: bool) -> None:
        """Take the step lock once (no step of the adapter runs after it), ending or holding its rows."""
        with self._between_steps():
            if abort:
                with self._cv:
                    self._aborts.update(r for r in self._live.values() if r.adapter == name)
                self._apply_aborts()
                return
            held = self._take_rows([i for i, r in enumerate(self._rows) if r.adapter == name])
            with self._cv:
                self._held.extend(held)

    async def resume_adapter(self, name: str) -> None:
        """Let adapter `name` generate again: its held rows go first, prefilled again under its weights of now."""
        with self._cv:
            self._paused_adapters.discard(name)
            back = [r for r in self._held if r.adapter == name]
            self._held = [r for r in self._held if r.adapter != name]
            self._waiting.extendleft(reversed(back))
            self._cv.notify_all()

    async def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors checkpoint (a directory or one file) in place, then tag new tokens `version`.

        Tensors are read and checked before the model is touched: a bad checkpoint raises
        `ValueError` and leaves the old weights serving. Running requests continue under the
        new weights with their cache recomputed, so every token is exactly of one version; after
        `pause("inflight")` they keep their cache instead (no recompute).
        """
        await asyncio.to_thread(self._load_weights_sync, Path(path), version)

    def _load_weights_sync(self, path: Path, version: int) -> None:
        from staleness.weights.base import read_checkpoint

        self._require_model()
        self._load_tensors_sync(read_checkpoint(path), version, path)

    async def load_tensors(
        self, named_tensors: Mapping[str, torch.Tensor | np.ndarray] | Iterable[tuple[str, Any]], version: int
    ) -> None:
        """Load weights from memory (torch tensors or numpy arrays, in checkpoint names), then tag `version`.

        The same path as `load_weights` (a weight transport that fetched tensors need not write a file):
        names and shapes are checked first, running requests continue with their cache recomputed.
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        tensors = {
            name: torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t for name, t in items
        }
        await asyncio.to_thread(self._load_tensors_sync, tensors, version, "the tensors given")

    async def prepare_broadcast(self, link: BroadcastLink) -> None:
        """Build (or find) this engine's group of the broadcast on a thread, while the batch loop goes on."""
        await asyncio.to_thread(prepare_receiver, link, 0, self.device)

    async def load_broadcast(self, link: BroadcastLink) -> None:
        """Receive an `nccl://` broadcast onto this engine's device (`staleness.weights.nccl`), then load it."""

        def receive() -> dict[str, torch.Tensor]:
            return dict(receive_broadcast(link, 0, self.device))

        started = time.monotonic()
        tensors = await asyncio.to_thread(receive)
        received = time.monotonic()
        await asyncio.to_thread(self._load_tensors_sync, tensors, link.version, f"the broadcast from {link.host}")
        log.info(
            "broadcast of version %d: received in %.3f s, loaded in %.3f s",
            link.version,
            received - started,
            time.monotonic() - received,
        )

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes cannot be loaded into the model."""
        self.weight_layout().check(shapes, source)

    def weight_layout(self) -> WeightLayout:
        """The model's tensor names, shapes and tied storage (for a `check_fits` made elsewhere)."""
        self._require_model()
        return WeightLayout.of(to_checkpoint(self._model, self._model.state_dict()))

    def _require_model(self) -> None:
        if self._model is None:
            raise RuntimeError("start() the engine before loading weights")

    def _load_tensors_sync(self, tensors: Mapping[str, torch.Tensor], version: int, source: object) -> None:
        """Check names and shapes against the model, then copy in place between two steps (the one load path)."""
        self.check_fits({k: tuple(v.shape) for k, v in tensors.items()}, source)
        tensors = to_module(self._model, tensors)  # checkpoint names; a fused parameter (a MoE's experts) merged
        targets = self._model.state_dict()
        with self._between_steps(), torch.no_grad():
            for name, tensor in tensors.items():
                targets[name].copy_(tensor)
            self.version = version
            with self._cv:
                keep_cache = self._keep_cache
            if not keep_cache:  # `inflight`: the next step feeds each row's last token to the new weights, cache kept
                self._stale = bool(self._rows)
        log.info("loaded weights version %d from %s", version, source)

    async def reset_prefix_cache(self) -> None:
        """No prefix cache here (every request prefills its own prompt): nothing to reset."""

    async def sleep(self, level: int) -> None:
        """Free the running rows' KV cache (recomputed after `wake_up`, as after a load) and the weights' device memory:
        level 1 moves them to host memory, level 2 empties them (`wake_up` gives them fresh, undefined memory of their
        shapes for the next load to fill). Buffers (rotary tables) stay. Call it paused."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {', '.join(map(str, SLEEP_LEVELS))}, got {level!r}")
        await asyncio.to_thread(self._sleep_sync, level)

    def _sleep_sync(self, level: int) -> None:
        self._require_model()
        with self._between_steps(), torch.no_grad():
            if self._asleep:
                return
            self._cache = self._mask = None
            self._stale = bool(self._rows)
            for param in self._model.parameters():  # tied weights are one parameter: moved once
                if level == 1:
                    param.data = param.data.to("cpu")
                else:  # an empty tensor of the same kind (torch refuses another device or dtype under `.data`)
                    self._shapes.append((param, param.shape))
                    param.data = param.data.new_empty(0)
            self._asleep = level
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def wake_up(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        """Take the weights back (`parts` with "weights"); the KV cache is rebuilt by the next step, not woken."""
        if "weights" in parts:
            await asyncio.to_thread(self._wake_sync)

    def _wake_sync(self) -> None:
        with self._between_steps(), torch.no_grad():
            if not self._asleep or self._model is None:
                return
            if self._asleep == 1:
                for param in self._model.parameters():
                    param.data = param.data.to(self.device)
            for param, shape in self._shapes:
                param.data = param.data.new_empty(shape)
            self._shapes = []
            self._asleep = 0

    @property
    def asleep(self) -> int:
        """The level of the sleep the engine is in; 0: awake."""
        return self._asleep

    def stats(self) -> dict[str, int]:
        """Counters for heartbeats and metrics."""
        with self._cv:
            return {
                "running": len(self._rows),
                "waiting": len(self._waiting),
                "generated_tokens": self.generated_tokens,
                "version": self.version,
                "adapters": len(self._adapters),
                "held": len(self._held),
                "prefill_tokens": self.prefill_tokens,
                "recomputed_tokens": self.recomputed_tokens,
            }

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
                    _settle([(req, RuntimeError(f"torch engine step failed: {exc!r}")) for req in failed])

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

    def _admit(self, room: int) -> list[_Request]:
        """Take up to `room` requests from the queue in order, passing over those of paused adapters
        (caller holds `_cv`): a paused adapter must not hold up the base model or other adapters."""
        if not self._paused_adapters:
            return [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        admitted: list[_Request] = []
        passed: list[_Request] = []
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

    def _step(self, admitted: list[_Request]) -> None:
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
                    past_key_values=self._cache,
                    use_cache=True,
                )
            self._keep_routes(self._rows, picked, 1)
            self._mask = mask
            logits.append(out.logits[:, -1])
        if admitted:
            self.prefill_tokens += sum(r.length for r in admitted)
            width = max(r.length for r in admitted)
            ids = torch.full((len(admitted), width), self._pad_id, dtype=torch.long)
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
            self._merge(admitted, out.past_key_values, mask)
        tokens, logprobs, tops = self._sample(torch.cat(logits).float())
        self.generated_tokens += len(tokens)
        finished: list[tuple[_Request, FinishReason]] = []
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

    def _no_routes(self) -> str | None:
        """Why this engine returns no routed experts (`check_request`), None when its model has routers."""
        if self._routers:
            return None
        return (
            f"the model has no mixture-of-experts routers that the torch engine reads (those of transformers' "
            f"{ROUTER_MODELS}): serve it with vllm workers started with --engine-args "
            "'{\"enable_return_routed_experts\": true}' (a mixture of experts), or do not ask for them"
        )

    @contextlib.contextmanager
    def _route_hooks(self, rows: Sequence[_Request]) -> Iterator[list[torch.Tensor]]:
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
    def _keep_routes(rows: Sequence[_Request], picked: list[torch.Tensor], width: int) -> None:
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

    def _version_of(self, req: _Request) -> int:
        """The version a row's token is of: its adapter's (per-adapter versions), or the base model's."""
        return self.version if req.adapter is None else self._adapters[req.adapter].version

    @contextlib.contextmanager
    def _lora_hooks(self, rows: Sequence[_Request]) -> Iterator[None]:
        """For one model call over `rows`: hooks adding each adapter row's LoRA term, none if no row has one."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(rows):
            if req.adapter is not None:
                groups.setdefault(req.adapter, []).append(i)
        if not groups:
            yield
            return
        per_module: dict[str, list[tuple[slice | torch.Tensor, LoraModule]]] = {}
        for name, indices in groups.items():
            index = _row_index(indices, len(rows), self.device)
            for path, module in self._adapters[name].weights.modules.items():
                per_module.setdefault(path, []).append((index, module))
        handles = [self._linears[path].register_forward_hook(_lora_hook(terms)) for path, terms in per_module.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _take_rows(self, indices: list[int]) -> list[_Request]:
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
        """Pick each row's token (greedy, or temperature + top-p with noise fixed by the row's seed).

        The logprob is the row's `logprobs_mode`'s: `raw`, that of the model's distribution (before temperature and
        top-p), as vLLM reports by default and as the trainer recomputes; `processed`, that of the distribution the
        token was drawn from, log_softmax(logits / temperature) renormalized over the tokens top-p kept (vLLM's
        `processed_logprobs`). A greedy row's are raw either way (as vLLM's: nothing was applied). A row that asked
        for alternatives (`top_logprobs` = k) gets the k most likely tokens of that same distribution and their
        logprobs (tokens top-p dropped have -inf, as vLLM's processed ones), else None.
        """
        rows = self._rows
        logprobs_all = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if r.sampling.temperature > 0]
        processed: list[int] = []
        """Positions in `sampled` of the rows that want processed logprobs."""
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            temps = torch.tensor([rows[i].sampling.temperature for i in sampled], device=logits.device)
            probs = torch.softmax(logits[index] / temps[:, None], dim=-1)
            top_p = torch.tensor([rows[i].sampling.top_p for i in sampled], device=logits.device)
            dropped: torch.Tensor | None = None
            if bool((top_p < 1).any()):
                sorted_probs, order = probs.sort(dim=-1, descending=True)
                # Drop a token when the mass ranked above it already reaches top_p (the first always stays).
                drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
                dropped = torch.zeros_like(drop).scatter(1, order, drop)
                probs = probs.masked_fill(dropped, 0.0)
            # Inverse CDF: one uniform draw per row, for all rows at once, each from its own seed and position.
            seeds = torch.tensor([rows[i].seed for i in sampled], device=logits.device)
            steps = torch.tensor([len(rows[i].tokens) for i in sampled], device=logits.device)
            cdf = probs.double().cumsum(dim=-1)
            u = sampling_uniform(seeds, steps) * cdf[:, -1]  # top-p left the rows unnormalized
            picked = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1)
            tokens[index] = picked.clamp(max=probs.shape[1] - 1)
            processed = [k for k, i in enumerate(sampled) if rows[i].sampling.logprobs_mode == "processed"]
        chosen = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
        reported = logprobs_all
        """The distribution each row's logprobs are of (its processed one replaces a processed row's)."""
        if processed:
            which = torch.tensor(processed, device=logits.device)
            at = index[which]
            scaled = torch.log_softmax(logits[at] / temps[which, None], dim=-1)
            if dropped is not None:  # renormalized over what top-p kept
                scaled = scaled.masked_fill(dropped[which], float("-inf"))
                scaled = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
            chosen[at] = scaled.gather(1, tokens[at][:, None]).squeeze(1)
            reported = logprobs_all.index_put((at,), scaled)
        return tokens.tolist(), chosen.tolist(), _alternatives(rows, reported)

    def _merge(self, new_rows: list[_Request], cache: Any, mask: torch.Tensor) -> None:
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

    def _finish(self, ended: list[tuple[_Request, FinishReason]]) -> None:
        with self._cv:
            for req, _ in ended:
                self._live.pop(req.id, None)
        _settle([(req, req.result(reason)) for req, reason in ended])


def _alternatives(rows: Sequence[_Request], logprobs: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray] | None]:
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

    Counter-based, like Philox: one batched computation for every row, where a `torch.Generator` per
    row cost one kernel per row per token (on a GPU the engine then mostly waited on Python). A row's
    draw depends only on its own seed and position, so its tokens are the same alone or in any batch.
    """
    row = _hash32(_hash32(seeds) ^ _hash32((seeds >> 32) + 0x632BE5AB))
    high = _hash32(row + _hash32(steps + 0x1B873593))
    low = _hash32(high ^ 0x5BD1E995)
    return (high.double() * 2**21 + (low >> 11).double()) / 2**53  # 53 random bits


def _row_index(indices: list[int], batch: int, device: torch.device) -> slice | torch.Tensor:
    """Rows of one adapter as a slice when they are contiguous (a view, no gather), else an index tensor."""
    if indices[-1] - indices[0] + 1 == len(indices):
        return slice(indices[0], indices[-1] + 1)
    return torch.tensor(indices, device=device)


def _lora_hook(terms: list[tuple[slice | torch.Tensor, LoraModule]]) -> Callable[..., torch.Tensor]:
    """A forward hook on one `nn.Linear`: each adapter's rows of the output gain `scale * (x A^T) B^T`."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        for rows, lora in terms:
            output[rows] += lora.scale * ((x[rows] @ lora.a.T) @ lora.b.T)
        return output

    return hook


def _settle(outcomes: Sequence[tuple[_Request, Generation | BaseException]]) -> None:
    """Resolve requests' futures on their own event loops, from any thread: one wake-up per loop for the batch.

    A step ends many requests at once (a batch started together ends together). One `call_soon_threadsafe` per
    request cost a write to the loop's self-pipe each, and each write handed the GIL to the woken loop while this
    thread still had the step to finish: in a worker, whose loop then builds and publishes a rollout, that was a
    GIL hand-off per request (see README, Benchmarks)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, Generation | BaseException]]] = {}
    for req, outcome in outcomes:
        by_loop.setdefault(req.loop, []).append((req, outcome))

    def apply(batch: list[tuple[_Request, Generation | BaseException]]) -> None:
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

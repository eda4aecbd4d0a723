"""`torch` engine: the `Engine` protocol on plain PyTorch + transformers.

It is the reference for correctness (fp32 logprobs equal a plain forward pass) and the engine for machines without
vLLM. This module is its async API: start and shutdown, requests, pause and resume, weight loads, sleep. It composes
the scheduler thread that batches requests over the model (`consumers.engines.torch_scheduler`) and the LoRA
adapters served beside the base model (`consumers.engines.torch_lora`). The asyncio side only queues requests and
awaits futures that the scheduler thread resolves, so the event loop never waits on compute.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from consumers.engines.base import (
    WAKE_ALL,
    EngineClosedError,
    EngineInputError,
    EngineLifecycle,
    Generation,
    HandsOverInProcess,
    WakePart,
    check_request,
)
from consumers.engines.model_files import WeightLayout, read_model_limits
from consumers.engines.torch_lora import LoraAdapters
from consumers.engines.torch_scheduler import Request, SchedulerConfig, settle
from pipeline.wire import PAUSE_MODES, SLEEP_LEVELS, PauseMode, Sampling
from staleness.weights.fused import ROUTER_MODELS, routers, to_checkpoint, to_module
from staleness.weights.handover import Placement

if TYPE_CHECKING:
    from staleness.weights.nccl import BroadcastStats, PeerPush

log = logging.getLogger(__name__)

SMALL_MODEL_PARAMS = 100_000_000
"""Below this size a CPU engine decodes on one thread (see `TorchEngine`'s `num_threads`)."""


class TorchEngine(LoraAdapters, HandsOverInProcess, EngineLifecycle):
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
            model under 100M parameters on CPU, where thread sync costs more than it saves; torch's default
            otherwise.
        max_loras: LoRA adapters held at once (`load_adapter`); 0 serves the base model only.
    """

    name = "torch"
    weight_receivers = 1
    """Processes that hold the weights (and take a rank in an nccl broadcast): this one."""
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
        self.model_dir = Path(model_dir)
        self.version = version
        self.attn_implementation = attn_implementation
        # The config alone (cheap) gives the limits the worker checks before `start()` loads weights.
        layer_types = getattr(AutoConfig.from_pretrained(self.model_dir).get_text_config(), "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"TorchEngine supports full-attention models only; {self.model_dir} has {layer_types}")
        limits = read_model_limits(self.model_dir, max_model_len)
        super().__init__(
            SchedulerConfig(
                device=torch.device(device),
                dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
                max_batch=max_batch,
                max_model_len=limits.max_model_len,
                pad_id=limits.pad_id,
                num_threads=num_threads,
            ),
            max_loras=max_loras,
        )
        self.vocab_size = limits.vocab_size
        self._eos_ids = limits.eos_ids
        self._seeds = random.Random(seed)

        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self._asleep = 0
        """The level of `sleep` (under `_step_lock`); 0: awake."""
        self._shapes: list[tuple[torch.nn.Parameter, torch.Size]] = []
        """A level-2 sleep's emptied parameters and their shapes, for `wake_up`."""
        self._keep_cache = False
        """Set by `pause("inflight")` until `resume` (under `_cv`): a load leaves the running rows' cache as it is."""

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
                self.model_dir, dtype=self.config.dtype, attn_implementation=self.attn_implementation
            )
            model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]  # transformers mistypes .to()
            self._find_adapter_targets(model)
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
        settle([(req, EngineClosedError(f"engine shut down before request {req.id!r} finished")) for req in pending])

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
        req = Request(
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

    def _no_routes(self) -> str | None:
        """Why this engine returns no routed experts (`check_request`), None when its model has routers."""
        if self._routers:
            return None
        return (
            f"the model has no mixture-of-experts routers that the torch engine reads (those of transformers' "
            f"{ROUTER_MODELS}): serve it with vllm workers started with --engine-args "
            "'{\"enable_return_routed_experts\": true}' (a mixture of experts), or do not ask for them"
        )

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

    # -- weights and memory ----------------------------------------------------------------------

    async def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors checkpoint (a directory or one file) in place, then tag new tokens `version`.

        Tensors are read and checked before the model is touched: a bad checkpoint raises
        `ValueError` and leaves the old weights serving. Running requests continue under the
        new weights with their cache recomputed, so every token is exactly of one version; after
        `pause("inflight")` they keep their cache instead (no recompute).
        """
        await asyncio.to_thread(self._load_weights_sync, Path(path), version)

    def _load_weights_sync(self, path: Path, version: int) -> None:
        from staleness.weights.sources import read_checkpoint

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

    @property
    def placement(self) -> Placement:
        """In the worker's process, on its device: a handover is opened there (`HandsOverInProcess`)."""
        return Placement(self.name, "worker", str(self.device))

    @property
    def receiving_device(self) -> torch.device:
        return self.device

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes cannot be loaded into the model."""
        self.weight_layout().check(shapes, source)

    @property
    def shares_weights(self) -> bool:
        """A worker that joins mid-run may take this engine's version from it (`consumers.peer`): its model holds the
        checkpoint's values, in its own process, once started."""
        return self._model is not None

    @property
    def weights_gpu(self) -> str:
        """The CUDA UUID of its GPU, "" on the CPU (`consumers.engines.base.weights_gpu`)."""
        return str(torch.cuda.get_device_properties(self.device).uuid) if self.device.type == "cuda" else ""

    async def push_weights(self, push: PeerPush, staged: Callable[[], None]) -> BroadcastStats:
        """Push the weights it holds to the joiners of `push` from this process (`push_from_peer`, on a thread:
        its steps go on), as views of its parameters, or host copies of them when `push.on_host`."""
        from staleness.weights.nccl import push_from_peer  # only a peer needs it

        return await asyncio.to_thread(lambda: push_from_peer(push, self.export_weights(), staged))

    def export_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights it holds, in checkpoint names, as the model holds them (views, not copies); tied names once
        (a tied `lm_head` is the embedding: loading one loads both, `WeightLayout.check`)."""
        self._require_model()
        seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
        named = []
        for name, tensor in to_checkpoint(self._model, self._model.state_dict()).items():
            storage = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if storage not in seen or not tensor.numel():
                seen.add(storage)
                named.append((name, tensor))
        return named

    def weight_layout(self) -> WeightLayout:
        """The model's tensor names, shapes and tied storage (for a `check_fits` made elsewhere)."""
        self._require_model()
        return WeightLayout.of(to_checkpoint(self._model, self._model.state_dict()))

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

    # -- what the scheduler asks of the engine ---------------------------------------------------

    def _version_of(self, req: Request) -> int:
        """The version a row's token is of: its adapter's (per-adapter versions), or the base model's."""
        return self.version if req.adapter is None else self._adapters[req.adapter].version

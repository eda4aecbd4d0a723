"""`vllm` engine: the `Engine` protocol on vLLM's v1 `AsyncLLM`.

vLLM runs the model in its own processes (an engine core, one worker per tensor-parallel rank); this object is the
client side, on the caller's event loop. It is token-in, token-out (`skip_tokenizer_init`: no tokenizer, no text),
and its stop tokens are `TorchEngine`'s (the model config's and generation config's `eos_token_id`, plus each
request's `stop_token_ids`), kept in the tokens with `finish_reason="stop"`.

- Logprobs are each sampled token's, under the raw model distribution (vLLM's default `raw_logprobs`; in fp32 they
  equal a plain transformers forward pass) or, with `logprobs_mode="processed"`, under the distribution sampled from
  (temperature, then top-p, renormalized). vLLM sets the mode per engine: a request that asks for the other is
  refused (`EngineInputError`), never served with the wrong kind. `Sampling.top_logprobs` = k is sent as vLLM's
  `logprobs=k`: the k most likely tokens of the same distribution become `Generation.top_token_ids` / `top_logprobs`.
- A request returns once, when it ends, aborted ones included (`RequestOutputKind.FINAL_ONLY`, `flat_logprobs`);
  `generated_tokens` reads vLLM's own per-request token counts.
- Policy versions are vLLM's weight-version labels (`update_weight_version`); its per-token
  `CompletionOutput.weight_versions` spans become `Generation.spans`.
- LoRA adapters (`max_loras > 0`) are vLLM's own. Each (adapter, version) gets a private PEFT directory and a
  `LoRARequest` whose id and `lora_name` are never reused (vLLM keys its active adapters and its prefix-cache hashes
  by `lora_name`), so two versions never serve each other's weights or KV blocks; a replaced version is removed once
  no request of it runs. `pause_adapter` holds the adapter's new requests in `generate` and aborts its running ones;
  under `keep`, a sample continues after `resume_adapter` as a new vLLM request (prompt + tokens so far, the
  remaining `max_tokens`) under the adapter's version of then. On CPU, `start` has every worker keep base-model rows
  out of the adapters' terms (`RolloutsWorkerExtension.rollouts_mask_base_lora_rows`).
- `load_weights` reloads a safetensors checkpoint in place (`collective_rpc("reload_weights")`); `load_tensors` and
  `load_handover` (a version each worker process opens where it is: a rank in an `nccl://` broadcast, the trainer's
  CUDA IPC handle on their shared GPU for `ipc://`; the transport's to know which) go through
  `RolloutsWorkerExtension` (vLLM's `worker_extension_cls`). Names and shapes are checked first (by the transport, for
  a handover): a reload that fails half way leaves vLLM's model unusable. A load runs paused (`keep`) and drops the
  KV and prefix caches, so every token is of one version; after `pause("inflight")` running requests keep their KV
  blocks and go on over them under the new weights. A request's prefix-cache hashes are salted with the version it
  was submitted at (`cache_salt`): no request started later finds blocks another version computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import vllm
from safetensors.torch import save, save_file
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.logprobs import FlatLogprobs
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from consumers.engines.base import (
    WAKE_ALL,
    EngineClosedError,
    EngineInputError,
    EngineLifecycle,
    Generation,
    SleepNotSupported,
    WakePart,
    check_request,
    continuation_seed,
    continued,
    engine_logprobs_mode,
    refuse_adapter,
    refuse_logprobs_mode,
    top_k_within,
)
from consumers.engines.lora import parse_adapter, save_adapter
from consumers.engines.model_files import (
    WeightLayout,
    as_cpu_tensors,
    checkpoint_layout,
    checkpoint_shapes,
    read_model_limits,
)
from consumers.engines.vllm_common import VLLM_FINISH_REASONS, vllm_spans
from consumers.orphans import reap_on_death
from pipeline.wire import PAUSE_MODES, FinishReason, PauseMode, Sampling
from staleness.weights.handover import Handover, Placement

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 256 << 20
"""KV cache size on CPU (vLLM needs an explicit size there); plenty for small models."""

CPU_BATCHED_TOKENS = 8192
"""Prompt tokens one CPU engine step may prefill (chunked prefill is off there, see `__init__`)."""

EXTENSION = "consumers.engines.vllm_extension.RolloutsWorkerExtension"
"""Qualified name vLLM imports in its worker processes (`worker_extension_cls`): a small module of its own, so that
those processes do not import this one."""

DEATH_CHECK_S = 1.0
"""How often the engine's monitor looks whether vLLM died."""

SHUTDOWN_GRACE_S = 1.0
"""How long `shutdown` lets vLLM's `EngineCore` exit after SIGTERM before vLLM kills it and its `Worker`s (vLLM's
default: 5 s)."""

_EMPTY_LOGPROBS = np.zeros(0, dtype=np.float32)


RPC_LIMIT = 2**32 - 1
"""The most bytes one argument of vLLM's `collective_rpc` carries (its msgpack encoder's limit)."""
STAGING_DIRS = ("/dev/shm",)
"""Where a version sent as tensors is staged for vLLM's worker processes to read: memory first, then the temp dir."""


def staging_dir(nbytes: int) -> str | None:
    """A folder on this host with room for a version of `nbytes` (and a tenth more): `/dev/shm` (memory; a container's
    is often 64 MB), else the temp dir; None if neither has room. vLLM's worker processes run on this host and read the
    file there, in place of a blob through its RPC (which stops at 4 GiB and moved ~250 MB/s on an H100)."""
    for folder in (*STAGING_DIRS, tempfile.gettempdir()):
        with contextlib.suppress(OSError):
            if Path(folder).is_dir() and shutil.disk_usage(folder).free > nbytes * 1.1:
                return folder
    return None


PAUSE_ABORT_RETRY_S = 0.05
"""How often `pause_adapter` aborts again a request of the adapter that is still in vLLM: an abort that reaches
vLLM before the request itself (just submitted) is a no-op there."""


@dataclass(eq=False)
class _Adapter:
    """One loaded adapter version: its vLLM `LoRARequest` (own id and name) and its private PEFT directory."""

    version: int
    request: LoRARequest
    path: Path


@dataclass(eq=False)
class _AdapterRequest:
    """A `generate` call under an adapter, followed by `pause_adapter`, `abort` and `shutdown`."""

    adapter: str
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to end it with the tokens so far (abort, abort-pauses, shutdown), even while it waits for a resume."""
    segment: asyncio.Future[Any] | None = None
    """Its vLLM request now (one per stretch between pauses)."""
    kept: bool = False
    """Its segment was aborted by `pause_adapter(keep)`: go on after `resume_adapter`."""


class VllmEngine(EngineLifecycle):
    """The `Engine` protocol on `vllm.v1.engine.async_llm.AsyncLLM`.

    Args:
        model_dir: a local Hugging Face model directory vLLM can load.
        version: policy version of the weights in `model_dir`.
        dtype: vLLM's `dtype` ("float32" by default, so logprobs are exact; "auto", "bfloat16", ...).
        max_model_len: cap on prompt + generation; the model's `max_position_embeddings` by default.
        kv_cache_bytes: KV cache size (`kv_cache_memory_bytes`). None: 256 MiB on CPU (where vLLM needs a
            size), vLLM's own sizing from `gpu_memory_utilization` on GPUs.
        tensor_parallel_size: GPUs per engine.
        enforce_eager: no CUDA graphs / torch.compile (the right choice on CPU; False on GPU for speed).
        seed: vLLM's global seed (None: 0; requests with `sampling.seed` use their own generator).
        max_loras: LoRA adapters held at once; 0 (the default): none, and vLLM is built without LoRA (LoRA's
            kernels and a patch of vLLM's CPU LoRA ops come only with adapters asked for).
            vLLM keeps twice as many on CPU (`max_cpu_loras`), so a replaced version stays loaded while its
            requests finish.
        max_lora_rank: the largest adapter rank accepted (vLLM's `max_lora_rank`: 1, 8, 16, 32, 64, ...).
        logprobs_mode: `raw` (vLLM's default `raw_logprobs`) or `processed` (`processed_logprobs`): what every
            request's logprobs are; a request that asks for the other is refused. `engine_args` may name it too,
            in vLLM's words.
        engine_args: more `AsyncEngineArgs` fields (e.g. from JSON on the command line); they win
            over the arguments above (`max_model_len` there also sets this object's).
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        version: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        seed: int | None = 0,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        logprobs_mode: str = "raw",
        engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        if max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {max_loras}")
        extra = dict(engine_args or {})
        if unknown := sorted(set(extra) - {f.name for f in fields(AsyncEngineArgs)}):
            raise ValueError(f"engine_args: vLLM's AsyncEngineArgs has no {', '.join(unknown)} (check their names)")
        max_model_len = extra.pop("max_model_len", max_model_len)
        self.model_dir = Path(model_dir)
        self.version = version
        # The config alone (cheap) gives the limits the worker checks before `start()` builds vLLM.
        limits = read_model_limits(self.model_dir, max_model_len)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self._eos_ids = limits.eos_ids
        self._experts = limits.experts
        self.args: dict[str, Any] = {
            "model": str(self.model_dir),
            "dtype": dtype,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            "seed": 0 if seed is None else seed,  # vLLM needs one (tensor-parallel ranks must agree)
            "skip_tokenizer_init": True,
            "worker_extension_cls": EXTENSION,
            "disable_log_stats": True,
        }
        if current_platform.is_cpu():
            kv_cache_bytes = DEFAULT_KV_CACHE_BYTES if kv_cache_bytes is None else kv_cache_bytes
            # vLLM 0.32 on CPU kills its engine when a seeded request's prefill is chunked ("CPU Generator
            # does not use offset"): prefill whole prompts instead, with a step budget that fits the longest.
            self.args["enable_chunked_prefill"] = False
            self.args["max_num_batched_tokens"] = max(self.max_model_len, CPU_BATCHED_TOKENS)
        if kv_cache_bytes is not None:
            self.args["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        if max_loras:
            self.args.update(
                enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=2 * max_loras
            )
        self.args["logprobs_mode"] = f"{engine_logprobs_mode(logprobs_mode, self.name)}_logprobs"
        self.args.update(extra)
        self.logprobs_mode = engine_logprobs_mode(str(self.args["logprobs_mode"]), self.name)
        """What every request's logprobs are (vLLM's `logprobs_mode`, per engine)."""
        self.args["logprobs_mode"] = f"{self.logprobs_mode}_logprobs"  # vLLM's word, whichever `engine_args` used
        self.max_loras = int(self.args.get("max_loras", max_loras)) if self.args.get("enable_lora") else 0
        self.max_lora_rank = int(self.args.get("max_lora_rank", max_lora_rank))

        self._llm: Any = None
        self._start_lock = asyncio.Lock()
        self._load_lock = asyncio.Lock()
        self._live: set[str] = set()
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._died: asyncio.Future[None] | None = None
        """Resolved once vLLM is gone (`_watch_engine`): requests waiting on it stop waiting."""
        self._monitor: asyncio.Task[None] | None = None
        self._paused = False
        self._keep_cache = False
        """Paused with `inflight` (until `resume`): a load keeps the running requests' KV blocks."""
        self._asleep: set[WakePart] = set()
        """The parts of a sleep not woken yet (`wake_up`)."""
        self._closing = False
        self.load_path: str | None = None
        """How vLLM's worker processes load a version, once started: "direct" or "layerwise: WHY"
        (`RolloutsWorkerExtension.rollouts_load_path`)."""
        self._reference: WeightLayout | bool | None = False
        """Tensor names and shapes of the model's own checkpoint: what a new one must match."""
        self._finished_tokens = 0
        """Tokens of the requests that ended since start (see `generated_tokens`)."""
        self._adapters: dict[str, _Adapter] = {}
        self._adapter_lock = asyncio.Lock()
        self._adapter_requests: dict[str, _AdapterRequest] = {}
        self._adapter_pauses: dict[str, asyncio.Event] = {}
        """Paused adapters, each with the event `resume_adapter` sets."""
        self._lora_ids = itertools.count(1)
        self._lora_users: Counter[int] = Counter()
        """vLLM requests running now per LoRA id."""
        self._retired: dict[int, Path] = {}
        """LoRA ids of replaced or removed versions, removed from vLLM once no request of them runs."""
        self._lora_dir: Path | None = None
        self._linears: dict[str, tuple[int, int]] | None = None

    # -- capacity (what a worker takes at once) ----------------------------------------------------

    @property
    def max_batch(self) -> int | None:
        """vLLM's `max_num_seqs`: as started, else as asked in the engine args (None: vLLM picks it at start)."""
        if self._llm is not None:
            return int(self._llm.vllm_config.scheduler_config.max_num_seqs)
        asked = self.args.get("max_num_seqs")
        return int(asked) if asked else None

    @property
    def max_batch_tokens(self) -> int | None:
        """Tokens vLLM's KV cache holds (its blocks times their size), known once started; None before."""
        if self._llm is None:
            return None
        cache = self._llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks * cache.block_size) if cache.num_gpu_blocks else None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the `AsyncLLM` (its processes start off the event loop). Idempotent."""
        async with self._start_lock:
            if self._closing:
                raise EngineClosedError("the engine was shut down")
            if self._llm is not None:
                return
            self._watchdog = reap_on_death()  # vLLM's processes do not watch this one: they must not outlive a SIGKILL
            llm = await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**self.args))
            try:
                await llm.update_weight_version(str(self.version))
                if self.max_loras and current_platform.is_cpu():
                    await llm.collective_rpc("rollouts_mask_base_lora_rows")
                self.load_path = " / ".join(sorted(set(await llm.collective_rpc("rollouts_load_path"))))
            except BaseException:
                await asyncio.to_thread(llm.shutdown)
                raise
            self._llm = llm
            del llm  # only `self._llm` may hold it: `shutdown` must be able to free it
            self._died = asyncio.get_running_loop().create_future()
            self._monitor = asyncio.create_task(self._watch_engine(self._died))
            log.info(
                "vLLM engine on %s started (version %d); versions load %s", self.model_dir, self.version, self.load_path
            )

    async def _watch_engine(self, died: asyncio.Future[None]) -> None:
        """Resolve `died` once the engine errored or was shut down.

        A request added just as `EngineCore` died may never hear of it from vLLM.
        """
        while self._llm is not None and not self._llm.errored:
            await asyncio.sleep(DEATH_CHECK_S)
        if not died.done():
            died.set_result(None)

    async def _started(self) -> Any:
        await self.start()
        if self._llm is None:
            raise EngineClosedError("the engine was shut down")
        return self._llm

    async def shutdown(self) -> None:
        """Stop vLLM's processes; requests still pending fail with `EngineClosedError`. Idempotent."""
        async with self._start_lock:
            self._closing = True
            llm, self._llm = self._llm, None
        for request in self._adapter_requests.values():
            request.ended.set()  # those waiting for `resume_adapter` end too (`EngineClosedError`)
        if llm is None:
            self._drop_lora_dir()
            return
        if self._live:
            with contextlib.suppress(Exception):
                await llm.abort(list(self._live))
            await asyncio.sleep(0)  # let the aborted `generate` calls see their last output
        if self._monitor is not None:
            self._monitor.cancel()
        if llm.output_handler is not None:  # it would log the engine's exit as a failure
            llm.output_handler.cancel()
        # SIGTERM to `EngineCore`, then vLLM kills its process tree after the grace (`SHUTDOWN_GRACE_S`).
        await asyncio.to_thread(llm.shutdown, SHUTDOWN_GRACE_S)
        # `AsyncLLM.__del__` shuts down again: let it run now (a no-op), not at interpreter exit where it fails.
        del llm
        gc.collect()
        if self._watchdog is not None:  # vLLM's processes are gone: nothing left to guard
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None
        self._drop_lora_dir()

    def _drop_lora_dir(self) -> None:
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling, adapter: str | None = None
    ) -> Generation:
        """Generate one sample from `prompt_tokens`, under LoRA `adapter` if given; raises `EngineInputError` for a
        request it cannot serve (an adapter that is not loaded among them)."""
        if not self.max_loras:
            refuse_adapter(self.name, adapter)
        prompt = np.asarray(prompt_tokens)
        check_request(prompt, sampling, self.max_model_len, self.vocab_size, no_routes=self._no_routes())
        if adapter is not None:
            return await self._generate_adapter(request_id, prompt, sampling, adapter)
        params = self._sampling_params(len(prompt), sampling)
        llm = self._llm if self._llm is not None else await self._started()
        if request_id in self._live:
            raise EngineInputError(f"request id {request_id!r} is already in flight on this engine")
        self._live.add(request_id)
        try:
            tokens, logprobs, last, cached = await self._run(llm, prompt, params, request_id)
        finally:
            self._live.discard(request_id)
        if self._closing and last.finish_reason == "abort":
            raise EngineClosedError(f"engine shut down before request {request_id!r} finished")
        top = _alternatives(tokens, last.logprobs, sampling.top_logprobs)
        return Generation(
            tokens=np.asarray(tokens, dtype=np.int32),
            logprobs=logprobs,
            finish_reason=VLLM_FINISH_REASONS[last.finish_reason],
            spans=self._spans(last.weight_versions, len(tokens)),
            cached_tokens=cached,
            routed_experts=_routes(last, sampling, len(prompt), len(tokens), request_id),
            top_token_ids=None if top is None else top[0],
            top_logprobs=None if top is None else top[1],
        )

    async def _run(
        self,
        llm: Any,
        prompt: np.ndarray,
        params: Any,
        request_id: str,
        lora: LoRARequest | None = None,
        tracked: _AdapterRequest | None = None,
    ) -> tuple[list[int], np.ndarray, Any, int | None]:
        """One vLLM request to its end (`_stream`), or `EngineClosedError` once vLLM died; its final output checked.

        `tracked.segment` is set before any await, so `pause_adapter` sees every request of its adapter in vLLM.
        """
        stream = asyncio.ensure_future(self._stream(llm, prompt, params, request_id, lora))
        if tracked is not None:
            tracked.segment = stream
        try:
            assert self._died is not None  # set with `_llm`
            either: set[asyncio.Future[Any]] = {stream, self._died}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not stream.done():
                raise EngineClosedError(f"the vLLM engine died while request {request_id!r} was in flight")
            tokens, logprobs, last, cached = stream.result()
        finally:
            if not stream.done():
                stream.cancel()  # vLLM aborts the request when its generator is cancelled
        if last is None or last.finish_reason is None:
            raise RuntimeError(f"vLLM ended request {request_id!r} without a final output")
        if last.finish_reason not in VLLM_FINISH_REASONS:  # "error": an engine-side failure, not the prompt's fault
            raise RuntimeError(f"vLLM failed request {request_id!r}: finish_reason={last.finish_reason}")
        return tokens, logprobs, last, cached

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
        tracked = self._adapter_requests[request_id] = _AdapterRequest(name)
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
                    top = _alternatives(seg_tokens, last.logprobs, sampling.top_logprobs)
                    if top is not None:
                        tops.append(top)
                    _add_span(spans, adapter.version, done, len(tokens))
                    routes = _routes(last, sampling, len(prompt), len(tokens), request_id)  # the whole sample's
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
            logprobs=np.concatenate(logprobs) if logprobs else _EMPTY_LOGPROBS,
            finish_reason=finish,
            spans=spans,
            cached_tokens=cached,
            routed_experts=routes,
            top_token_ids=np.concatenate([t[0] for t in tops]) if tops else None,
            top_logprobs=np.concatenate([t[1] for t in tops]) if tops else None,
        )

    async def _adapter_ready(self, tracked: _AdapterRequest) -> bool:
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

    async def _stream(
        self, llm: Any, prompt: np.ndarray, params: Any, request_id: str, lora: LoRARequest | None = None
    ) -> tuple[list[int], np.ndarray, Any, int | None]:
        """Run one request through vLLM; returns its tokens, their logprobs, the last output and the prompt
        tokens it found in its prefix cache.

        vLLM's errors become ours: `EngineInputError` (the request's fault), `EngineClosedError` (no engine).
        """
        tokens: list[int] = []
        logprobs = _EMPTY_LOGPROBS
        last = None
        cached = None
        try:
            # Salted with the version: a later version never reuses blocks of this one (kept by `inflight` syncs).
            inputs = tokens_input(prompt.astype(np.int64).tolist(), cache_salt=f"v{self.version}")
            async for out in llm.generate(inputs, params, request_id, lora_request=lora):
                cached = out.num_cached_tokens if out.num_cached_tokens is not None else cached
                last = out.outputs[0]
            if last is not None:  # FINAL_ONLY: one output, the whole sample
                tokens = list(last.token_ids)
                logprobs = _sampled_logprobs(tokens, last.logprobs)
                self._finished_tokens += len(tokens)
        except VLLMClientError as exc:
            raise EngineInputError(str(exc)) from exc
        except EngineGenerateError as exc:
            if last is None and isinstance(exc.__cause__, (ValueError, TypeError)):
                raise EngineInputError(str(exc.__cause__)) from exc
            raise
        except EngineDeadError as exc:
            if self._closing:
                raise EngineClosedError(f"engine shut down before request {request_id!r} finished") from exc
            raise EngineClosedError(f"the vLLM engine died: {exc}") from exc
        return tokens, logprobs, last, cached

    def _sampling_params(self, prompt_len: int, sampling: Sampling) -> Any:
        """Our `Sampling` as vLLM `SamplingParams`; values vLLM refuses raise `EngineInputError`, and so does a
        `logprobs_mode` other than the engine's."""
        refuse_logprobs_mode(self.name, self.logprobs_mode, sampling)
        max_tokens = min(sampling.max_tokens, self.max_model_len - prompt_len)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=top_k_within(sampling, self.vocab_size),
                min_p=sampling.min_p,
                repetition_penalty=sampling.repetition_penalty,
                presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty,
                min_tokens=min(sampling.min_tokens, max_tokens),  # the context may end first: then it ends the sample
                seed=sampling.seed,
                stop_token_ids=sorted(set(sampling.stop_token_ids) | set(self._eos_ids)),
                logprobs=sampling.top_logprobs,  # the sampled token's logprob first, then the k most likely
                flat_logprobs=True,  # plain lists, not a dict of `Logprob` objects per token
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request (see the module docstring)
            )
        except (ValueError, VLLMClientError) as exc:  # vLLM's own range checks (e.g. temperature <= 2)
            raise EngineInputError(str(exc)) from exc

    def _no_routes(self) -> str | None:
        """Why this engine returns no routed experts (`check_request`), None when it does."""
        if not self._experts:
            return "the model is not a mixture of experts (its config names no experts): it routes nothing"
        if self.args.get("enable_return_routed_experts"):
            return None
        return (
            "this vllm worker's engine does not return them: start it with --engine-args "
            "'{\"enable_return_routed_experts\": true}' (vLLM's CUDA build; a mixture-of-experts model)"
        )

    def _spans(self, weight_versions: list[Any] | None, n_tokens: int) -> list[tuple[int, int, int]]:
        """vLLM's per-token weight-version spans as `[(version, start, end), ...]` covering `[0, n_tokens)`."""
        return vllm_spans(((s.version, s.start, s.end) for s in weight_versions or ()), n_tokens, self.version)

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now; their `generate` returns the tokens so far with `abort`. Unknown ids are ignored."""
        ids = [i for i in request_ids if i in self._live]
        for i in ids:
            if i in self._adapter_requests:  # also ends one waiting for `resume_adapter`
                self._adapter_requests[i].ended.set()
        if ids and self._llm is not None:
            await self._llm.abort(ids)

    async def pause(self, mode: PauseMode) -> None:
        """Stop scheduling; returns once no step runs. `abort` ends every request now with its partial tokens;
        `keep` freezes them (their KV cache is dropped by the next load and recomputed on resume, under the weights
        loaded then); `inflight` freezes them with their KV cache, which they go on with after a load (not
        recomputed). Requests that arrive while paused wait for `resume`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        llm = await self._started()
        self._paused = True
        self._keep_cache = mode == "inflight"
        if mode == "abort":  # adapter requests waiting for `resume_adapter` end as well
            for request in self._adapter_requests.values():
                request.ended.set()
        # The KV and prefix caches are dropped once, by the load that follows (`_load`; never for `inflight`):
        # resetting them walks the whole block pool.
        await llm.pause_generation(mode="keep" if mode == "inflight" else mode, clear_cache=False)

    # -- LoRA adapters ---------------------------------------------------------------------------

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
            self._adapters[name] = _Adapter(version, request, path)
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

    async def _retire(self, adapter: _Adapter) -> None:
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

    async def resume(self) -> None:
        """Continue scheduling (requests kept by `pause("keep")` or `pause("inflight")` go on where they stopped)."""
        async with self._load_lock:  # a load in progress finishes first
            self._paused = False
            self._keep_cache = False
            if self._llm is not None:
                await self._llm.resume_generation()

    async def sleep(self, level: int) -> None:
        """vLLM's sleep (`AsyncLLM.sleep`): level 1 frees the KV cache and offloads the weights to host memory, level 2
        frees both. Needs vLLM's sleep mode, which is CUDA's (`--engine-args '{"enable_sleep_mode": true}'`)."""
        if not self.args.get("enable_sleep_mode"):
            raise SleepNotSupported(
                "this vLLM engine was started without sleep mode: start the worker with --engine-args "
                "'{\"enable_sleep_mode\": true}' (vLLM's sleep mode needs CUDA)"
            )
        llm = await self._started()
        async with self._load_lock:
            if self._asleep == set(WAKE_ALL):
                return
            if self._asleep:  # half awake (a sync's load before its resume): whole again, then asleep
                await llm.wake_up([part for part in WAKE_ALL if part in self._asleep])
            # Paused already, in the caller's mode; vLLM's own default ("abort") would end the requests `keep` holds.
            await llm.sleep(level, mode="keep")
            self._asleep = set(WAKE_ALL)

    async def wake_up(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        """vLLM's `wake_up(tags)` for the `parts` still asleep. vLLM schedules again only once both are awake, so a
        load between the weights' wake and the KV cache's runs paused, and without the cache's memory."""
        waking = [part for part in WAKE_ALL if part in parts and part in self._asleep]
        if self._llm is not None and waking:
            async with self._load_lock:
                await self._llm.wake_up(waking)
                self._asleep.difference_update(waking)

    async def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors checkpoint (a directory or one file) in place, then tag new tokens `version`.

        The checkpoint's tensor names and shapes are checked against the model's own first: a bad one
        raises `ValueError` (`FileNotFoundError` if there is none) and leaves the old weights serving.
        """
        target = Path(path)
        shapes = checkpoint_shapes(target)
        self.check_fits(shapes, target)
        if target.is_dir():
            await self._load(version, "reload_weights", kwargs={"weights_path": str(target)})
        else:  # one file's bytes are a safetensors blob already
            await self._load(version, "rollouts_load_safetensors", args=(await asyncio.to_thread(target.read_bytes),))
        log.info("loaded weights version %d from %s", version, target)

    async def load_tensors(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Load weights from memory (torch tensors or numpy arrays, in checkpoint names) and tag `version`.

        They are written as one safetensors file where this host has room (`staging_dir`: memory first) and every
        vLLM worker process reads it (`RolloutsWorkerExtension`); where none has, they go as a blob through vLLM's RPC
        (under 4 GiB). Names and shapes are checked as in `load_weights`.
        """
        tensors = as_cpu_tensors(named_tensors)
        self.check_fits({k: tuple(v.shape) for k, v in tensors.items()}, "the tensors given")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        staging = staging_dir(nbytes)
        if staging is None:  # nowhere on this host with room: the bytes go through vLLM's RPC (under 4 GiB only)
            if nbytes >= RPC_LIMIT:
                raise ValueError(
                    f"version {version} is {nbytes / 2**30:.1f} GiB, more than vLLM's RPC carries (4 GiB), and neither "
                    f"/dev/shm nor {tempfile.gettempdir()} has room to stage it: free some, or sync by fs:// or nccl://"
                )
            blob = await asyncio.to_thread(save, tensors)
            await self._load(version, "rollouts_load_safetensors", args=(blob,))
        else:
            with tempfile.TemporaryDirectory(prefix="rollouts-version-", dir=staging) as folder:
                path = str(Path(folder) / "model.safetensors")
                await asyncio.to_thread(save_file, tensors, path)
                await self._load(version, "rollouts_load_safetensors_file", args=(path,))
        log.info("loaded weights version %d from %d tensors", version, len(tensors))

    @property
    def placement(self) -> Placement:
        """In vLLM's worker processes, one per GPU (on the CPU with vLLM's CPU build)."""
        return Placement(self.name, "processes", on_cpu=current_platform.is_cpu())

    @property
    def weight_receivers(self) -> int:
        """vLLM's worker processes, each of which opens a handover (and takes a rank in an nccl broadcast)."""
        return int(self.args.get("tensor_parallel_size", 1)) * int(self.args.get("pipeline_parallel_size", 1))

    async def prepare_handover(self, handover: Handover) -> None:
        """Have every vLLM worker process get ready to open the handover on a thread of its own (an nccl group built,
        its receives posted), so that vLLM's steps go on meanwhile; `load_handover` waits for it."""
        llm = await self._started()
        await llm.collective_rpc("rollouts_prepare_handover", args=(handover.to_dict(),))

    async def load_handover(self, handover: Handover) -> None:
        """Have every vLLM worker process open the handover where it is (its GPU) and reload from it in place
        (`RolloutsWorkerExtension.rollouts_load_handover`: a broadcast's rank, the trainer's GPU buffer; no byte through
        this process). The transport checked, before anything was opened, that it can reach these processes and that
        the model takes its tensors (`Transport.check_placement`); a worker process on another GPU than an ipc://
        trainer's refuses before it opens anything, and vLLM passes that on as its own error, with our line in it."""
        await self._load(handover.version, "rollouts_load_handover", args=(handover.to_dict(),))
        log.info("loaded weights version %d from %s", handover.version, handover.source or f"{handover.scheme}://")

    async def _load(self, version: int, method: str, **rpc: Any) -> None:
        """Run a reload on every worker while paused (pausing with `keep` if not paused), then relabel. Paused with
        `inflight`, running requests keep their KV blocks (the prefix cache cannot be reset while they hold blocks;
        later requests miss them anyway, their hashes salted with the new version)."""
        llm = await self._started()
        if current_platform.is_cpu() and llm.model_config.is_moe:
            raise ValueError(
                f"vLLM's CPU build reloads a mixture of experts' weights wrongly (vLLM {vllm.__version__}: the "
                "logprobs after a reload match neither version), so this worker does not take version "
                f"{version}: sync a MoE policy into torch workers (--engine torch), or vLLM on a GPU"
            )
        async with self._load_lock:
            if not self._paused:
                await llm.pause_generation(mode="keep", clear_cache=False)  # the reset below drops the caches
            try:
                await llm.collective_rpc(method, **rpc)
                await llm.update_weight_version(str(version))
                self.version = version
                if not (self._paused and self._keep_cache):
                    # Nothing computed under the old weights may be reused: the one reset of a sync.
                    await llm.reset_prefix_cache(reset_running_requests=True)
            finally:
                if not self._paused:  # paused here, not by the caller (who may also have paused meanwhile)
                    await llm.resume_generation()

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes do not match the model's own checkpoint."""
        layout = self.weight_layout()
        if layout is not None:
            layout.check(shapes, source)

    def weight_layout(self) -> WeightLayout | None:
        """The tensors of the model's own checkpoint (`checkpoint_layout`); None when it has none (not safetensors:
        nothing to compare with)."""
        if self._reference is False:
            self._reference = checkpoint_layout(self.model_dir)
        return self._reference if isinstance(self._reference, WeightLayout) else None

    async def reset_prefix_cache(self) -> None:
        """Drop every cached KV block (running requests recompute theirs)."""
        if self._llm is not None:
            await self._llm.reset_prefix_cache(reset_running_requests=True)

    @property
    def generated_tokens(self) -> int:
        """Tokens generated since start, those of requests still running included (for metrics and tests).

        Requests report only when they end (FINAL_ONLY), so the running ones are counted from vLLM's
        output processor, which holds every request's tokens so far. A request that just ended may be
        missing from both for a moment, until its `generate` call has taken its final output.
        """
        running = 0
        if self._llm is not None:
            states = getattr(self._llm.output_processor, "request_states", {})
            running = sum(s.detokenizer.num_output_tokens() for s in list(states.values()) if s.detokenizer)
        return self._finished_tokens + running

    def stats(self) -> dict[str, int]:
        """Counters for heartbeats and metrics (`running`: requests in flight, queued ones included)."""
        return {"running": len(self._live), "generated_tokens": self.generated_tokens, "version": self.version}


def _routes(output: Any, sampling: Sampling, prompt_len: int, n_tokens: int, request_id: str) -> np.ndarray | None:
    """The routed experts of a final output as int16 `[prompt_len + n_tokens - 1, layers, top_k]` when the request
    asked; None when it did not, generated nothing or was aborted (its continuation reads the whole sample again),
    and, logged, when vLLM's do not cover the sample one route a position (the tokens are kept all the same)."""
    positions = prompt_len + n_tokens - 1
    if not sampling.routed_experts or not n_tokens or output.finish_reason == "abort":
        return None
    routes = getattr(output, "routed_experts", None)
    shape = None if routes is None else np.shape(routes)
    if shape is None or len(shape) != 3 or shape[0] != positions:
        log.warning(
            "request %s: vLLM's routed experts are of shape %s, not [%d, layers, top_k]; its rollout carries none",
            request_id, shape, positions,
        )  # fmt: skip
        return None
    return np.asarray(routes, dtype=np.int16)


def _add_span(spans: list[tuple[int, int, int]], version: int, start: int, end: int) -> None:
    """Append `(version, start, end)`, merged into the last span when that one is of the same version."""
    if spans and spans[-1][0] == version and spans[-1][2] == start:
        spans[-1] = (version, spans[-1][1], end)
    else:
        spans.append((version, start, end))


def _alternatives(tokens: list[int], flat: FlatLogprobs | None, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The k most likely tokens of each position and their logprobs, `[len(tokens), k]` int32 / float32, from vLLM's
    flat logprobs of a request with `logprobs=k`; None when k is 0 or there are no tokens.

    vLLM's sampler gives each position the sampled token first, then the top k in rank order (`gather_logprobs`; the
    sampled token again among them if it is one), of the same distribution as the sampled token's logprob (the
    engine's `logprobs_mode`)."""
    if not k or not tokens:
        return None
    if flat is None or len(flat.start_indices) != len(tokens):
        raise RuntimeError(f"vLLM returned logprobs for {0 if flat is None else len(flat)} of {len(tokens)} tokens")
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    if not np.array_equal(np.asarray(flat.end_indices, dtype=np.int64) - starts, np.full(len(tokens), k + 1)):
        raise RuntimeError(f"vLLM did not return the sampled token and {k} alternatives at every position")
    index = (starts[:, None] + 1 + np.arange(k)[None, :]).reshape(-1)
    ids = np.asarray(flat.token_ids, dtype=np.int32)[index].reshape(len(tokens), k)
    return ids, np.asarray(flat.logprobs, dtype=np.float32)[index].reshape(len(tokens), k)


def _sampled_logprobs(tokens: list[int], flat: FlatLogprobs | None) -> np.ndarray:
    """The logprob of each sampled token, as float32, from vLLM's flat logprobs (`logprobs=0`, `flat_logprobs`).

    Each position's entries begin with the sampled token (vLLM's sampler puts it first; a top-0 request
    adds no others, a top-k one its k alternatives after it), so its logprob is the one at the position's start
    index.
    """
    if not tokens:
        return _EMPTY_LOGPROBS
    if flat is None or len(flat.start_indices) != len(tokens):
        raise RuntimeError(f"vLLM returned logprobs for {0 if flat is None else len(flat)} of {len(tokens)} tokens")
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    if not np.array_equal(np.asarray(flat.token_ids, dtype=np.int64)[starts], np.asarray(tokens, dtype=np.int64)):
        raise RuntimeError("vLLM's logprobs are not those of the sampled tokens")
    return np.asarray(flat.logprobs, dtype=np.float32)[starts]

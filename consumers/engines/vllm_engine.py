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
- LoRA adapters (`max_loras > 0`) are vLLM's own (`consumers.engines.vllm_lora`: a version never reused, a sample
  continued across an adapter's `keep` pause). On CPU, `start` has every worker keep base-model rows
  out of the adapters' terms (`RolloutsWorkerExtension.rollouts_mask_base_lora_rows`).
- `load_weights` reloads a safetensors checkpoint in place (`collective_rpc("reload_weights")`); `load_tensors` and
  `load_handover` (a version each worker process opens where it is: a rank in an `nccl://` broadcast, the trainer's
  CUDA IPC handle on their shared GPU for `ipc://`; the transport's to know which) go through
  `RolloutsWorkerExtension` (vLLM's `worker_extension_cls`). Names and shapes are checked first (by the transport, for
  a handover): a reload that fails half way leaves vLLM's model unusable. A load runs paused (`keep`) and drops the
  KV and prefix caches, so every token is of one version; after `pause("inflight")` running requests keep their KV
  blocks and go on over them under the new weights. A request's prefix-cache hashes are salted with the version it
  was submitted at (`cache_salt`): no request started later finds blocks another version computed.
- A worker that joins mid-run may take the version it holds (`push_weights`, `consumers.peer`): its worker process
  pushes its parameters, split into the checkpoint's names (`vllm_extension.checkpoint_views`), on a thread there.
  Only where they are the checkpoint's values exactly (versions load directly: a GPU, unquantized, no LoRA; one rank):
  on the CPU vLLM repacks its weights after loading (`shares_weights` False, `cannot_share` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import vllm
from safetensors.torch import save, save_file
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
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
    engine_logprobs_mode,
    refuse_adapter,
)
from consumers.engines.model_files import (
    WeightLayout,
    as_cpu_tensors,
    checkpoint_layout,
    checkpoint_shapes,
    read_model_limits,
)
from consumers.engines.vllm_common import VLLM_FINISH_REASONS, vllm_spans
from consumers.engines.vllm_lora import AdapterRequest, VllmAdapters
from consumers.engines.vllm_requests import EMPTY_LOGPROBS, alternatives, routes_of, sampled_logprobs, sampling_params
from consumers.orphans import reap_on_death
from pipeline.wire import PAUSE_MODES, PauseMode, Sampling
from staleness.weights.handover import Handover, Placement

if TYPE_CHECKING:
    from staleness.weights.nccl import BroadcastStats, PeerPush

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

PUSH_POLL_S = 0.02
"""How often a push to joiners asks vLLM's worker process how it goes (`push_weights`)."""

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


class VllmEngine(VllmAdapters, EngineLifecycle):
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
        self.weights_gpu = ""
        """The CUDA UUID of the GPU its worker process holds the weights on, once started; "" on the CPU, before the
        start, or over several ranks (`consumers.engines.base.weights_gpu`)."""
        self.cannot_share = "not started"
        """Why it cannot push the version it holds to a joiner ("": it can; `rollouts_share_info`)."""
        self.load_path: str | None = None
        """How vLLM's worker processes load a version, once started: "direct" or "layerwise: WHY"
        (`RolloutsWorkerExtension.rollouts_load_path`)."""
        self._reference: WeightLayout | bool | None = False
        """Tensor names and shapes of the model's own checkpoint: what a new one must match."""
        self._finished_tokens = 0
        """Tokens of the requests that ended since start (see `generated_tokens`)."""
        VllmAdapters.__init__(self)

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
                try:
                    self._share_info(await llm.collective_rpc("rollouts_share_info"))
                except Exception as exc:  # it serves all the same: joiners go to the store or the next sync
                    self.cannot_share = f"its worker process could not say what it would push ({exc})"
                    log.warning("this vLLM engine pushes no version to joiners: %s", self.cannot_share)
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

    def _share_info(self, infos: list[dict[str, Any]]) -> None:
        """Whether it can push its version to joiners (`cannot_share`, `weights_gpu`), from each worker process's
        `rollouts_share_info`: one process, whose parameters are the checkpoint's values, and whose checkpoint names
        and shapes are the model's own checkpoint's."""
        self.weights_gpu = str(infos[0]["gpu"]) if len(infos) == 1 else ""
        why = "its weights are split over several worker processes" if len(infos) != 1 else str(infos[0]["why_not"])
        layout = self.weight_layout()
        if not why and layout is None:
            why = "its model has no safetensors checkpoint to check the names it would push against"
        if not why and layout is not None:
            try:
                layout.check({k: tuple(v) for k, v in infos[0]["shapes"].items()}, "the weights it would push")
            except ValueError as exc:
                why = str(exc)
        self.cannot_share = why
        if why:
            log.info("this vLLM engine pushes no version to joiners: %s", why)

    @property
    def shares_weights(self) -> bool:
        """Whether it can push the version it holds to a worker that joins mid-run (`consumers.peer`): started, and
        its one worker process's parameters hold the checkpoint's values (a GPU, unquantized, no LoRA, one rank)."""
        return self._llm is not None and not self.cannot_share and not self._asleep and not self._closing

    async def push_weights(self, push: PeerPush, staged: Callable[[], None]) -> BroadcastStats:
        """Push the version it holds to the joiners of `push` from vLLM's worker process, where the weights are
        (`RolloutsWorkerExtension.rollouts_push_weights`: on a thread there, so that vLLM's engine core goes on
        stepping while joiners join and the bytes cross), polling its state: once staged, `staged()` (the joiners are
        told), once done its stats. Host copies over gloo when `push.on_host`, else NCCL from its GPU."""
        from staleness.weights.nccl import BroadcastStats

        if not self.shares_weights:
            raise RuntimeError(f"this vLLM engine cannot push its weights: {self.cannot_share or 'not awake'}")
        llm = await self._started()
        await llm.collective_rpc("rollouts_push_weights", args=(push.to_dict(),))
        told: BaseException | bool = False
        while True:
            (state,) = await llm.collective_rpc("rollouts_push_state")
            if state["staged"] and told is False:
                try:
                    await asyncio.to_thread(staged)
                    told = True
                except Exception as exc:  # the push ends on its own: nobody joins it, its wait times out
                    told = exc
            if state["done"]:
                if isinstance(told, BaseException):
                    raise told
                if state["error"]:
                    raise RuntimeError(f"vLLM's worker process could not push its weights: {state['error']}")
                return BroadcastStats(**state["stats"])
            await asyncio.sleep(PUSH_POLL_S)

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
        self._end_adapter_requests()  # those waiting for `resume_adapter` end too (`EngineClosedError`)
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
        top = alternatives(tokens, last.logprobs, sampling.top_logprobs)
        return Generation(
            tokens=np.asarray(tokens, dtype=np.int32),
            logprobs=logprobs,
            finish_reason=VLLM_FINISH_REASONS[last.finish_reason],
            spans=self._spans(last.weight_versions, len(tokens)),
            cached_tokens=cached,
            routed_experts=routes_of(last, sampling, len(prompt), len(tokens), request_id),
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
        tracked: AdapterRequest | None = None,
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

    async def _stream(
        self, llm: Any, prompt: np.ndarray, params: Any, request_id: str, lora: LoRARequest | None = None
    ) -> tuple[list[int], np.ndarray, Any, int | None]:
        """Run one request through vLLM; returns its tokens, their logprobs, the last output and the prompt
        tokens it found in its prefix cache.

        vLLM's errors become ours: `EngineInputError` (the request's fault), `EngineClosedError` (no engine).
        """
        tokens: list[int] = []
        logprobs = EMPTY_LOGPROBS
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
                logprobs = sampled_logprobs(tokens, last.logprobs)
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
        """Our `Sampling` as vLLM `SamplingParams` for this engine (`vllm_requests.sampling_params`)."""
        return sampling_params(
            sampling,
            prompt_len,
            engine=self.name,
            logprobs_mode=self.logprobs_mode,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_ids=self._eos_ids,
        )

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
        self._end_adapter_requests(ids)  # also ends one waiting for `resume_adapter`
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
            self._end_adapter_requests()
        # The KV and prefix caches are dropped once, by the load that follows (`_load`; never for `inflight`):
        # resetting them walks the whole block pool.
        await llm.pause_generation(mode="keep" if mode == "inflight" else mode, clear_cache=False)

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

"""`vllm` engine: the `Engine` protocol on vLLM's v1 `AsyncLLM` (checked against vLLM 0.32).

vLLM runs the model in its own processes (an engine core and one worker per tensor-parallel
rank); this object is the client side and lives on the caller's event loop. The engine is
token-in, token-out: it is built with `skip_tokenizer_init`, so no tokenizer is loaded and no
text is detokenized, and the stop tokens are exactly those of `TorchEngine` (the model config's
and generation config's `eos_token_id`, plus each request's `stop_token_ids`), included in the
tokens with `finish_reason="stop"`.

- Logprobs are vLLM's default `raw_logprobs`: the log-probability of each sampled token under
  the raw model distribution (before temperature and top-p), read from vLLM's flat per-position
  lists by the sampled token id. In fp32 they equal a plain transformers forward pass.
- Each request asks for its final output only (`RequestOutputKind.FINAL_ONLY`, `flat_logprobs`):
  the whole sample arrives once, when it ends (aborted or paused-and-aborted ones included). A
  streamed delta per token cost a `RequestOutput`, a `Logprob` per token and a wake-up of the
  request's coroutine at every engine step, in the process that also feeds the engine: on a
  2-core machine that was CPU taken from the engine itself. Progress stays visible through
  `generated_tokens`, which reads vLLM's own per-request token counts.
- Policy versions are vLLM's own weight-version labels (`update_weight_version`), reported per
  token as `CompletionOutput.weight_versions` spans, which become `Generation.spans`.
- `load_weights` reloads a safetensors checkpoint in place (`collective_rpc("reload_weights")`),
  `load_tensors` sends tensors through `RolloutsWorkerExtension` (vLLM's `worker_extension_cls`).
  Both check names and shapes against the model's own checkpoint first, since a reload that fails
  half way leaves vLLM's model unusable. Loads happen while the scheduler is paused (`keep`), with
  the KV and prefix caches dropped, so every token is exactly of one version.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import subprocess
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load, save
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.logprobs import FlatLogprobs
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from consumers.engine import (
    EngineClosedError,
    EngineInputError,
    EngineLifecycle,
    Generation,
    PauseMode,
    ServesNoAdapters,
    check_checkpoint_fits,
    check_request,
    read_model_limits,
    refuse_adapter,
)
from consumers.orphans import reap_on_death
from pipeline.wire import FinishReason, Sampling
from staleness.broadcast import BroadcastLink, prepare_receiver, receive_broadcast

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 256 << 20
"""KV cache size on CPU (vLLM needs an explicit size there); plenty for small models."""

CPU_BATCHED_TOKENS = 8192
"""Prompt tokens one CPU engine step may prefill (chunked prefill is off there, see `__init__`)."""

EXTENSION = "consumers.vllm_engine.RolloutsWorkerExtension"
"""Qualified name vLLM imports in its worker processes (`worker_extension_cls`)."""

DEATH_CHECK_S = 1.0
"""How often the engine's monitor looks whether vLLM died."""

_EMPTY_LOGPROBS = np.zeros(0, dtype=np.float32)

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


class VllmEngine(ServesNoAdapters, EngineLifecycle):
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
        engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        extra = dict(engine_args or {})
        max_model_len = extra.pop("max_model_len", max_model_len)
        self.model_dir = Path(model_dir)
        self.version = version
        # The config alone (cheap) gives the limits the worker checks before `start()` builds vLLM.
        limits = read_model_limits(self.model_dir, max_model_len)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self._eos_ids = limits.eos_ids
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
        self.args.update(extra)

        self._llm: Any = None
        self._start_lock = asyncio.Lock()
        self._load_lock = asyncio.Lock()
        self._live: set[str] = set()
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._died: asyncio.Future[None] | None = None
        """Resolved once vLLM is gone (`_watch_engine`): requests waiting on it stop waiting."""
        self._monitor: asyncio.Task[None] | None = None
        self._paused = False
        self._closing = False
        self._reference: dict[str, tuple[int, ...]] | None = None
        """Tensor names and shapes of the model's own checkpoint: what a new one must match."""
        self._finished_tokens = 0
        """Tokens of the requests that ended since start (see `generated_tokens`)."""

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the `AsyncLLM` (its processes start off the event loop, ~20 s on a small CPU). Idempotent."""
        async with self._start_lock:
            if self._closing:
                raise EngineClosedError("the engine was shut down")
            if self._llm is not None:
                return
            self._watchdog = reap_on_death()  # vLLM's processes do not watch this one: they must not outlive a SIGKILL
            llm = await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**self.args))
            try:
                await llm.update_weight_version(str(self.version))
            except BaseException:
                await asyncio.to_thread(llm.shutdown)
                raise
            self._llm = llm
            del llm  # only `self._llm` may hold it: `shutdown` must be able to free it
            self._died = asyncio.get_running_loop().create_future()
            self._monitor = asyncio.create_task(self._watch_engine(self._died))
            log.info("vLLM engine on %s started (version %d)", self.model_dir, self.version)

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
        if llm is None:
            return
        if self._live:
            with contextlib.suppress(Exception):
                await llm.abort(list(self._live))
            await asyncio.sleep(0)  # let the aborted `generate` calls see their last output
        if self._monitor is not None:
            self._monitor.cancel()
        if llm.output_handler is not None:  # it would log the engine's exit as a failure
            llm.output_handler.cancel()
        # Waits for the engine processes to exit (SIGTERM, then SIGKILL after a grace period).
        await asyncio.to_thread(llm.shutdown)
        # `AsyncLLM.__del__` shuts down again: let it run now (a no-op), not at interpreter exit where it fails.
        del llm
        gc.collect()
        if self._watchdog is not None:  # vLLM's processes are gone: nothing left to guard
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling, adapter: str | None = None
    ) -> Generation:
        """Generate one sample from `prompt_tokens`; raises `EngineInputError` for a request it cannot serve."""
        refuse_adapter(self.name, adapter)
        prompt = np.asarray(prompt_tokens)
        check_request(prompt, sampling, self.max_model_len, self.vocab_size)
        params = self._sampling_params(len(prompt), sampling)
        llm = self._llm if self._llm is not None else await self._started()
        if request_id in self._live:
            raise EngineInputError(f"request id {request_id!r} is already in flight on this engine")
        self._live.add(request_id)
        stream = asyncio.ensure_future(self._stream(llm, prompt, params, request_id))
        try:
            assert self._died is not None  # set with `_llm`
            await asyncio.wait({stream, self._died}, return_when=asyncio.FIRST_COMPLETED)
            if not stream.done():
                raise EngineClosedError(f"the vLLM engine died while request {request_id!r} was in flight")
            tokens, logprobs, last, cached = stream.result()
        finally:
            if not stream.done():
                stream.cancel()  # vLLM aborts the request when its generator is cancelled
            self._live.discard(request_id)
        if last is None or last.finish_reason is None:
            raise RuntimeError(f"vLLM ended request {request_id!r} without a final output")
        if last.finish_reason not in _FINISH_REASONS:  # "error": an engine-side failure, not the prompt's fault
            raise RuntimeError(f"vLLM failed request {request_id!r}: finish_reason={last.finish_reason}")
        if self._closing and last.finish_reason == "abort":
            raise EngineClosedError(f"engine shut down before request {request_id!r} finished")
        return Generation(
            tokens=np.asarray(tokens, dtype=np.int32),
            logprobs=logprobs,
            finish_reason=_FINISH_REASONS[last.finish_reason],
            spans=self._spans(last.weight_versions, len(tokens)),
            cached_tokens=cached,
        )

    async def _stream(
        self, llm: Any, prompt: np.ndarray, params: Any, request_id: str
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
            async for out in llm.generate(tokens_input(prompt.astype(np.int64).tolist()), params, request_id):
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
        """Our `Sampling` as vLLM `SamplingParams`; values vLLM refuses raise `EngineInputError`."""
        try:
            return SamplingParams(
                max_tokens=min(sampling.max_tokens, self.max_model_len - prompt_len),
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=sampling.seed,
                stop_token_ids=sorted(set(sampling.stop_token_ids) | set(self._eos_ids)),
                logprobs=0,  # the sampled token's logprob only
                flat_logprobs=True,  # plain lists, not a dict of `Logprob` objects per token
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request (see the module docstring)
            )
        except (ValueError, VLLMClientError) as exc:  # vLLM's own range checks (e.g. temperature <= 2)
            raise EngineInputError(str(exc)) from exc

    def _spans(self, weight_versions: list[Any] | None, n_tokens: int) -> list[tuple[int, int, int]]:
        """vLLM's per-token weight-version spans as `[(version, start, end), ...]` covering `[0, n_tokens)`."""
        if not n_tokens:
            return []
        if not weight_versions:  # no label reported (not expected): the version loaded now
            return [(self.version, 0, n_tokens)]
        spans = [(int(s.version), int(s.start), int(s.end)) for s in weight_versions if s.end > s.start]
        if spans[0][1] != 0 or spans[-1][2] != n_tokens or any(a[2] != b[1] for a, b in itertools.pairwise(spans)):
            raise RuntimeError(f"vLLM weight-version spans {spans} do not cover {n_tokens} tokens")
        return spans

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now; their `generate` returns the tokens so far with `abort`. Unknown ids are ignored."""
        ids = [i for i in request_ids if i in self._live]
        if ids and self._llm is not None:
            await self._llm.abort(ids)

    async def pause(self, mode: PauseMode) -> None:
        """Stop scheduling; returns once no step runs. `abort` ends every request now with its partial tokens;
        `keep` freezes them (their KV cache is dropped and recomputed on resume, under the weights loaded then).
        Requests that arrive while paused wait for `resume`."""
        if mode not in ("abort", "keep"):
            raise ValueError(f"pause mode must be 'abort' or 'keep', got {mode!r}")
        llm = await self._started()
        self._paused = True
        await llm.pause_generation(mode=mode, clear_cache=True)

    async def resume(self) -> None:
        """Continue scheduling (requests kept by `pause("keep")` go on where they stopped)."""
        async with self._load_lock:  # a load in progress finishes first
            self._paused = False
            if self._llm is not None:
                await self._llm.resume_generation()

    async def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors checkpoint (a directory or one file) in place, then tag new tokens `version`.

        The checkpoint's tensor names and shapes are checked against the model's own first: a bad one
        raises `ValueError` (`FileNotFoundError` if there is none) and leaves the old weights serving.
        """
        target = Path(path)
        shapes = _checkpoint_shapes(target)
        self.check_fits(shapes, target)
        if target.is_dir():
            await self._load(version, "reload_weights", kwargs={"weights_path": str(target)})
        else:  # one file's bytes are a safetensors blob already
            await self._load(version, "rollouts_load_safetensors", args=(await asyncio.to_thread(target.read_bytes),))
        log.info("loaded weights version %d from %s", version, target)

    async def load_tensors(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Load weights from memory (torch tensors or numpy arrays, in checkpoint names) and tag `version`.

        They go to every vLLM worker as one safetensors blob through `RolloutsWorkerExtension`; names and
        shapes are checked as in `load_weights`.
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        tensors = {
            name: (torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t.detach())
            .to("cpu")
            .contiguous()
            for name, t in items
        }
        self.check_fits({k: tuple(v.shape) for k, v in tensors.items()}, "the tensors given")
        blob = await asyncio.to_thread(save, tensors)
        await self._load(version, "rollouts_load_safetensors", args=(blob,))
        log.info("loaded weights version %d from %d tensors", version, len(tensors))

    @property
    def weight_receivers(self) -> int:
        """vLLM's worker processes, each of which takes a rank in an nccl broadcast."""
        return int(self.args.get("tensor_parallel_size", 1)) * int(self.args.get("pipeline_parallel_size", 1))

    async def prepare_broadcast(self, link: BroadcastLink) -> None:
        """Have every vLLM worker process build (or find) its group of the broadcast on a thread of its own, so that
        vLLM's steps go on meanwhile; `load_broadcast` waits for it."""
        llm = await self._started()
        await llm.collective_rpc("rollouts_prepare_broadcast", args=(link.to_dict(),))

    async def load_broadcast(self, link: BroadcastLink) -> None:
        """Receive an `nccl://` broadcast in every vLLM worker process (onto its GPU) and load it in place.

        The names and shapes were checked when the worker joined (`join_broadcast` calls `check_fits`).
        """
        await self._load(link.version, "rollouts_receive_broadcast", args=(link.to_dict(),))

    async def _load(self, version: int, method: str, **rpc: Any) -> None:
        """Run a reload on every worker while paused (pausing with `keep` if not paused), then relabel."""
        llm = await self._started()
        async with self._load_lock:
            if not self._paused:
                await llm.pause_generation(mode="keep", clear_cache=True)
            try:
                await llm.collective_rpc(method, **rpc)
                await llm.update_weight_version(str(version))
                self.version = version
                # Nothing computed under the old weights may be reused (`pause` dropped it already).
                await llm.reset_prefix_cache(reset_running_requests=True)
            finally:
                if not self._paused:  # paused here, not by the caller (who may also have paused meanwhile)
                    await llm.resume_generation()

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes do not match the model's own checkpoint."""
        if self._reference is None:
            try:
                self._reference = _checkpoint_shapes(self.model_dir)
            except FileNotFoundError:
                self._reference = {}  # not a safetensors model: nothing to compare with
        if self._reference:
            check_checkpoint_fits(shapes, self._reference, source)

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


class RolloutsWorkerExtension:
    """Mixed into vLLM's worker class in every worker process (`worker_extension_cls`).

    Method names carry a `rollouts_` prefix: vLLM refuses an extension that shadows a worker attribute.
    """

    def rollouts_load_safetensors(self, blob: bytes) -> int:
        """Load weights (checkpoint names) from a safetensors blob in place; returns how many tensors."""
        tensors = load(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)

    def rollouts_prepare_broadcast(self, link: dict[str, Any]) -> int:
        """Build this process's group of the broadcast on a thread, and return at once (vLLM's steps go on)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts-broadcast")
        rank, device = self.rank, self.device  # type: ignore[attr-defined]
        self._rollouts_prepared = pool.submit(prepare_receiver, BroadcastLink.from_dict(link), rank, device)
        pool.shutdown(wait=False)
        return 0

    def rollouts_receive_broadcast(self, link: dict[str, Any]) -> int:
        """Take this process's rank in the trainer's broadcast (`staleness.broadcast`) and load what arrives."""
        prepared: Future[Any] | None = getattr(self, "_rollouts_prepared", None)
        self._rollouts_prepared = None
        if prepared is not None:
            prepared.result()  # the group is built (or its error raised here)
        rank = self.rank  # type: ignore[attr-defined]
        device = self.device  # type: ignore[attr-defined]
        tensors = dict(receive_broadcast(BroadcastLink.from_dict(link), rank, device))
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)


def _sampled_logprobs(tokens: list[int], flat: FlatLogprobs | None) -> np.ndarray:
    """The logprob of each sampled token, as float32, from vLLM's flat logprobs (`logprobs=0`, `flat_logprobs`).

    Each position's entries begin with the sampled token (vLLM's sampler puts it first; a top-0 request
    adds no others), so its logprob is the one at the position's start index.
    """
    if not tokens:
        return _EMPTY_LOGPROBS
    if flat is None or len(flat.start_indices) != len(tokens):
        raise RuntimeError(f"vLLM returned logprobs for {0 if flat is None else len(flat)} of {len(tokens)} tokens")
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    if not np.array_equal(np.asarray(flat.token_ids, dtype=np.int64)[starts], np.asarray(tokens, dtype=np.int64)):
        raise RuntimeError("vLLM's logprobs are not those of the sampled tokens")
    return np.asarray(flat.logprobs, dtype=np.float32)[starts]


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors checkpoint (a directory or one file), from the headers only."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes

"""`remote` engine: the `Engine` protocol on a vLLM server someone else runs (`vllm serve`).

Many teams run vLLM as a server (in Kubernetes, behind a router) and will not hand it to our worker. This engine
drives such a server over HTTP with the server's own endpoints, so the worker, the sync protocol and the wire are
unchanged:

- Generation is token in, token out: `POST /inference/v1/generate` (vLLM's scale-out API: `--enable-scale-out`) with
  prompt token ids, `logprobs=0` (the sampled token's logprob under the raw distribution, as the in-process engine
  reports by default; under the processed one when the server runs with `--logprobs-mode processed_logprobs` and this
  engine is told so, `logprobs_mode`), and the server's per-token `weight_versions` spans, which become
  `Generation.spans`.
- Pause, resume and versions are the RL endpoints of vLLM's development mode (`VLLM_SERVER_DEV_MODE=1`): `/pause`
  (`abort` ends requests with their tokens so far, `keep` freezes them), `/resume`, `/update_weight_version`,
  `/weight_info`, `/reset_prefix_cache`; one request is aborted by `/inference/v1/abort_requests`, and its
  `generate` call returns the tokens so far.
- Weights load in place through `/collective_rpc`: `reload_weights(weights_path=...)` reads a safetensors directory,
  so the server must see the path (the same host, or a shared volume: `staging_dir` for tensors that arrive in
  memory through `redis://`). A version opened where the weights live (a `Handover`: `nccl://`, `ipc://`) is refused
  by its transport, from this engine's `Placement` (`server`): a broadcast needs a rank in each of the server's worker
  processes, which vLLM's own NCCL weight transfer provides on GPUs (not wired here).

Several workers may share one server. A pause, a load or a resume acts on the whole server: each worker records its
pause in Redis (`consumers.engines.shared_server`), and the server resumes only when no live worker holds it paused,
so a slow worker's late resume of one sync cannot run the server while another worker loads the next. A worker that
finds the server already labelled with the version it is asked to load (another worker loaded it) loads nothing.

The server checks little: an out-of-vocabulary token id kills vLLM 0.32's engine core. Every request is checked here
first (`check_request`, against the model's config and the server's context length), as the in-process engines do.
A server that cannot be reached, or whose engine failed, is `EngineClosedError`: the worker stops, and its work is
claimed by another worker. A connection that breaks while the server still answers `/health` is not a dead server:
the request is sent once more on a new connection (`_send`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import numpy as np

from consumers.engines.base import (
    WAKE_ALL,
    EngineClosedError,
    EngineInputError,
    EngineLifecycle,
    Generation,
    ServesNoAdapters,
    SleepNotSupported,
    WakePart,
    engine_logprobs_mode,
    refuse_logprobs_mode,
    top_k_within,
)
from consumers.engines.model_files import (
    WeightLayout,
    as_cpu_tensors,
    checkpoint_layout,
    checkpoint_shapes,
    read_model_limits,
)
from consumers.engines.vllm_common import VLLM_FINISH_REASONS, vllm_spans
from pipeline.wire import PAUSE_MODES, PauseMode, Sampling

if TYPE_CHECKING:
    from staleness.weights.handover import Handover, Placement

log = logging.getLogger(__name__)

SERVER_REQUEST_PREFIX = "generate-tokens-"
"""vLLM 0.32's `/inference/v1/generate` runs a request under this prefix + the id it was given: what an abort names."""

START_TIMEOUT_S = 600.0
"""How long `start` waits for a server that is still coming up (loading a large model takes minutes)."""

CONNECT_TIMEOUT_S = 60.0
"""A server that takes longer to accept a connection is taken for dead (one refusing it is dead at once)."""
KEEPALIVE_EXPIRY_S = 2.0
"""An idle pooled connection is closed by this client after this long: below the server's keep-alive (vLLM's
`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s by default). At httpx's default (also 5 s) a request could go out on a connection
at the moment the server closed it as idle, and fail with `ReadError('')`, which would be taken for a dead
server."""

BROKEN_CONNECTION = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""Failures of a connection that was open (a pooled one the server closed, a reset): the server may still be up, so
`_send` asks `/health` on a new connection before it takes the server for dead. A refused or timed-out connect is not
in here: that server is gone (or not there), at once."""
HEALTH_CHECK_S = 10.0
"""How long `_send` waits for `/health` after a broken connection before it takes the server for dead."""

HEALTH_POLL_S = 0.5
UNSTICK_S = 2.0
"""How often an engine on a shared server looks whether it was left paused by a worker that died holding it."""
ABORT_RETRY_S = 0.05
"""An abort sent before the server has added the request is a no-op there: it is sent again until the request ends."""

NO_HANDOVER = (
    "the remote engine's weights live in a server this worker reaches over HTTP, where no version can be opened in "
    "place: publish with fs:// (a directory the server sees) or redis://"
)
NO_ROUTES = (
    "the remote engine does not ask its server for them (its completions return no routed experts): serve these "
    "prompts with vllm workers started with --engine-args '{\"enable_return_routed_experts\": true}', or torch ones"
)
NO_ALTERNATIVES = (
    "the remote engine does not ask its server for them (it reads the sampled token's logprob only): serve these "
    "prompts with vllm or torch workers"
)


class PauseHolders(Protocol):
    """Who holds a shared server paused (`consumers.engines.shared_server.SharedPause` keeps them in Redis)."""

    async def pause(self, call: Callable[[], Awaitable[object]]) -> None:
        """Record this worker as a holder, then pause the server (`call`)."""
        ...

    async def resume(self, call: Callable[[], Awaitable[object]]) -> bool:
        """Drop this worker's hold; resume the server (`call`) only if no live worker holds it."""
        ...


def http_client(url: str, headers: Mapping[str, str]) -> httpx.AsyncClient:
    """The engine's connections to its server: no read timeout (a generation may take minutes), a connect timeout
    (a loaded server may take seconds to accept), and idle connections dropped before the server drops them."""
    return httpx.AsyncClient(
        base_url=url,
        headers=dict(headers),
        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_EXPIRY_S),
    )


class RemoteVllmEngine(ServesNoAdapters, EngineLifecycle):
    """The `Engine` protocol on a running vLLM OpenAI-compatible server.

    Args:
        model_dir: the served model's directory, or a copy of its config files: its `config.json` and
            `generation_config.json` give the vocabulary and stop tokens (its weights are not loaded; if its
            safetensors are there, new weights are checked against their names and shapes before a load).
        url: the server, e.g. `http://127.0.0.1:8000`.
        version: the policy version of the weights the server was started with (used when its label is vLLM's
            default; a server already labelled with a number keeps its label).
        max_model_len: cap on prompt + generation; the smaller of this and the server's own.
        seed: ignored (the server has its own); accepted so every engine takes the same flags.
        staging_dir: where tensors that arrive in memory are written for the server to read (default: a private
            temporary directory, which works when the server runs on this host).
        start_timeout_s: how long `start` waits for the server to answer.
        api_key: the server's `--api-key`, if it has one.
        pauses: the pause holders of a server shared with other workers (`consumers.engines.shared_server`; the worker
            command passes one): the server resumes only when no worker holds it paused.
        max_batch: the server's `--max-num-seqs` (workers sharing a server: each its share), if the worker is to take no
            more samples than that (the server does not say it; None: unknown, and the worker takes its default).
        max_batch_tokens: a token budget for the samples this worker sends the server at once (prompt + `max_tokens`
            each; None: none).
        logprobs_mode: the server's `--logprobs-mode` (`raw`, the default, or `processed`; vLLM's names too): what
            every request's logprobs are. The server does not say; a request that asks for the other is refused.
    """

    name = "remote"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        url: str,
        version: int = 0,
        max_model_len: int | None = None,
        seed: int | None = None,
        dtype: str | None = None,
        staging_dir: str | Path | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        api_key: str | None = None,
        pauses: PauseHolders | None = None,
        max_batch: int | None = None,
        max_batch_tokens: int | None = None,
        logprobs_mode: str = "raw",
    ) -> None:
        del seed, dtype  # the server's own
        self.logprobs_mode = engine_logprobs_mode(logprobs_mode, self.name)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the remote engine's url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.model_dir = Path(model_dir)
        self.version = version
        limits = read_model_limits(self.model_dir, max_model_len)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self._eos_ids = limits.eos_ids
        self.weight_receivers = 1
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self._staging_dir = Path(staging_dir) if staging_dir is not None else None
        self._start_timeout_s = start_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._tag = uuid.uuid4().hex[:8]
        """Prefixes this engine's request ids: workers sharing a server may serve samples of the same id."""
        self._pauses = pauses
        self._monitor: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None
        self._start_lock = asyncio.Lock()
        self._load_lock = asyncio.Lock()
        self._live: dict[str, asyncio.Task[httpx.Response]] = {}
        self._paused = False
        self._closing = False
        self._reference: WeightLayout | bool | None = False
        self._finished_tokens = 0

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Wait for the server, check it has the endpoints this engine needs, and read its version. Idempotent."""
        async with self._start_lock:
            if self._closing:
                raise EngineClosedError("the engine was shut down")
            if self._http is not None:
                return
            http = http_client(self.url, self._headers)
            try:
                await self._wait_until_up(http)
                await self._check_server(http)
            except BaseException:
                await http.aclose()
                raise
            self._http = http
            if self._pauses is not None:
                self._monitor = asyncio.create_task(self._unstick(http))
            log.info("remote vLLM engine on %s started (version %d)", self.url, self.version)

    async def _wait_until_up(self, http: httpx.AsyncClient) -> None:
        """Poll `/health` until the server answers 200 (it may still be loading its model), up to the timeout."""
        deadline = time.monotonic() + self._start_timeout_s
        said = 0.0
        while True:
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/health")).status_code == 200:
                    return
            now = time.monotonic()
            if now > deadline:
                raise EngineClosedError(
                    f"no vLLM server answered at {self.url}/health within {self._start_timeout_s:g} s: check --url, "
                    "or give a server that is slow to come up more time (start_timeout_s in --engine-args)"
                )
            if now - said > 10:
                log.info("waiting for the vLLM server at %s to come up", self.url)
                said = now
            await asyncio.sleep(HEALTH_POLL_S)

    async def _check_server(self, http: httpx.AsyncClient) -> None:
        """The server's context length, its RL endpoints, its token endpoint, and its weight version."""
        models = await self._call(http, "GET", "/v1/models")
        served = int(models["data"][0].get("max_model_len") or self.max_model_len)
        self.max_model_len = min(self.max_model_len, served)
        if (await http.get("/is_paused")).status_code == 404:
            raise EngineClosedError(
                f"the vLLM server at {self.url} has no RL endpoints (/pause, /resume, /update_weight_version): "
                "start it with VLLM_SERVER_DEV_MODE=1 in its environment"
            )
        probe = await http.post("/inference/v1/generate", json=self._body("probe-" + self._tag, [0], 1, Sampling()))
        if probe.status_code != 200:
            raise EngineClosedError(
                f"the vLLM server at {self.url} refused token-in generation ({_error_text(probe)}): "
                "start it with --enable-scale-out"
            )
        label = (await self._call(http, "GET", "/weight_info"))["weight_version"]
        if str(label).isdigit():
            self.version = int(label)
        else:  # vLLM's "default": nobody labelled it yet
            await self._call(http, "POST", "/update_weight_version", json={"new_version": str(self.version)})

    async def _started(self) -> httpx.AsyncClient:
        await self.start()
        if self._http is None:
            raise EngineClosedError("the engine was shut down")
        return self._http

    async def shutdown(self) -> None:
        """Abort this engine's requests on the server and close the connections (the server keeps running)."""
        async with self._start_lock:
            self._closing = True
            http, self._http = self._http, None
        if self._monitor is not None:
            self._monitor.cancel()
        if http is None:
            return
        if self._live:
            with contextlib.suppress(httpx.HTTPError):
                await http.post("/inference/v1/abort_requests", json={"request_ids": self._server_ids(self._live)})
            if self._live:
                await asyncio.wait(list(self._live.values()), timeout=5)
        await http.aclose()

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling, adapter: str | None = None
    ) -> Generation:
        """Generate one sample on the server; `EngineInputError` for a request it cannot serve."""
        prompt = self._checked_prompt(prompt_tokens, sampling, adapter, NO_ROUTES, NO_ALTERNATIVES)
        refuse_logprobs_mode(self.name, self.logprobs_mode, sampling)
        http = self._http if self._http is not None else await self._started()
        if request_id in self._live:
            raise EngineInputError(f"request id {request_id!r} is already in flight on this engine")
        body = self._body(self._local_id(request_id), prompt.tolist(), len(prompt), sampling)
        # One task for the request and its resend: an abort sent meanwhile waits for (and aborts) both.
        task = asyncio.ensure_future(self._send(http, "POST", "/inference/v1/generate", json=body))
        self._live[request_id] = task
        try:
            response = await task
        finally:
            self._live.pop(request_id, None)
        return self._generation(request_id, response)

    def _body(self, local_id: str, prompt: list[int], prompt_len: int, sampling: Sampling) -> dict[str, Any]:
        max_tokens = max(1, min(sampling.max_tokens, self.max_model_len - prompt_len))
        return {
            "request_id": local_id,
            "token_ids": prompt,
            "sampling_params": {
                "max_tokens": max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": top_k_within(sampling, self.vocab_size),
                "min_p": sampling.min_p,
                "repetition_penalty": sampling.repetition_penalty,
                "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty,
                "min_tokens": min(sampling.min_tokens, max_tokens),
                "seed": sampling.seed,
                "stop_token_ids": sorted(set(sampling.stop_token_ids) | set(self._eos_ids)),
                "logprobs": 0,  # the sampled token's logprob only
                "detokenize": False,
            },
        }

    def _generation(self, request_id: str, response: httpx.Response) -> Generation:
        """A finished request's response as a `Generation`; the server's refusals and failures as our errors."""
        if 400 <= response.status_code < 500:
            raise EngineInputError(f"the vLLM server refused request {request_id!r}: {_error_text(response)}")
        if response.status_code != 200:  # vLLM answers 500 once its engine core died
            raise EngineClosedError(f"the vLLM server at {self.url} failed: {_error_text(response)}")
        body = response.json()
        choice = body["choices"][0]
        reason = choice.get("finish_reason")
        if reason not in VLLM_FINISH_REASONS:
            raise RuntimeError(f"vLLM failed request {request_id!r}: finish_reason={reason}")
        if self._closing and reason == "abort":
            raise EngineClosedError(f"engine shut down before request {request_id!r} finished")
        tokens = np.asarray(choice.get("token_ids") or [], dtype=np.int32)
        self._finished_tokens += len(tokens)
        usage = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        return Generation(
            tokens=tokens,
            logprobs=_sampled_logprobs(tokens, choice.get("logprobs")),
            finish_reason=VLLM_FINISH_REASONS[reason],
            spans=self._spans(choice.get("weight_versions"), len(tokens)),
            cached_tokens=usage.get("cached_tokens"),
        )

    def _spans(self, weight_versions: list[dict[str, Any]] | None, n_tokens: int) -> list[tuple[int, int, int]]:
        """The server's per-token version labels as `[(version, start, end), ...]` covering `[0, n_tokens)`."""
        labelled = ((s["version"], s["start"], s["end"]) for s in weight_versions or ())
        return vllm_spans(labelled, n_tokens, self.version)

    def _local_id(self, request_id: str) -> str:
        return f"{self._tag}-{request_id}"

    def _server_ids(self, request_ids: Iterable[str]) -> list[str]:
        return [SERVER_REQUEST_PREFIX + self._local_id(i) for i in request_ids]

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now; their `generate` returns the tokens so far with `abort`. Unknown ids are ignored."""
        tasks = {i: self._live[i] for i in request_ids if i in self._live}
        http = self._http
        while tasks and http is not None:
            with contextlib.suppress(httpx.HTTPError):
                await http.post("/inference/v1/abort_requests", json={"request_ids": self._server_ids(tasks)})
            await asyncio.wait(list(tasks.values()), timeout=ABORT_RETRY_S)
            tasks = {i: t for i, t in tasks.items() if not t.done()}

    async def pause(self, mode: PauseMode) -> None:
        """Pause the server: `abort` ends every request now with its partial tokens, `keep` freezes them. Requests
        that arrive while paused wait for `resume` on the server. `inflight` pauses as `keep` here (the KV cache is
        recomputed after a load): keeping it on a server is not wired yet."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        http = await self._started()
        self._paused = True
        await self._pause_server(http, "keep" if mode == "inflight" else mode)

    async def resume(self) -> None:
        async with self._load_lock:
            self._paused = False
            if self._http is not None:
                await self._resume_server(self._http)

    async def _pause_server(self, http: httpx.AsyncClient, mode: PauseMode) -> None:
        call = functools.partial(self._call, http, "POST", "/pause", params={"mode": mode})
        await (call() if self._pauses is None else self._pauses.pause(call))

    async def _resume_server(self, http: httpx.AsyncClient) -> None:
        """Resume the server, unless another worker sharing it holds it paused (it resumes it when it is done)."""
        call = functools.partial(self._call, http, "POST", "/resume")
        await (call() if self._pauses is None else self._pauses.resume(call))

    async def _unstick(self, http: httpx.AsyncClient) -> None:
        """Resume a shared server left paused by a worker that died holding it, while this one is not paused."""
        while True:
            await asyncio.sleep(UNSTICK_S)
            with contextlib.suppress(httpx.HTTPError, EngineClosedError, ValueError):
                if not self._paused and (await self._call(http, "GET", "/is_paused"))["is_paused"]:
                    async with self._load_lock:
                        if not self._paused:
                            await self._resume_server(http)

    # -- weights ---------------------------------------------------------------------------------

    async def load_weights(self, path: str, version: int) -> None:
        """Have the server reload a safetensors checkpoint directory (a path it sees) in place, tagged `version`."""
        target = Path(path)
        if target.exists():  # the same host or a shared volume: check it first, as the in-process engines do
            self.check_fits(checkpoint_shapes(target), target)
        if not target.is_dir():
            target = target.parent
        await self._load(version, "reload_weights", kwargs={"weights_path": str(target)})
        log.info("the server at %s loaded weights version %d from %s", self.url, version, target)

    async def load_tensors(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """Write tensors that arrived in memory to `staging_dir` as safetensors, and have the server reload them."""
        from safetensors.torch import save_file

        tensors = as_cpu_tensors(named_tensors)
        self.check_fits({k: tuple(v.shape) for k, v in tensors.items()}, "the tensors given")
        staged = Path(tempfile.mkdtemp(prefix=f"rollouts-v{version}-", dir=self._staging_dir))
        try:
            await asyncio.to_thread(save_file, tensors, str(staged / "model.safetensors"))
            await self._load(version, "reload_weights", kwargs={"weights_path": str(staged)})
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        log.info(
            "the server at %s loaded weights version %d: %d tensors staged in %s",
            self.url,
            version,
            len(tensors),
            staged.parent,
        )

    @property
    def placement(self) -> Placement:
        """In a server reached over HTTP: a transport that opens a version where the weights live refuses it."""
        from staleness.weights.handover import Placement

        return Placement(self.name, "server")

    async def prepare_handover(self, handover: Handover) -> None:
        raise ValueError(NO_HANDOVER)

    async def load_handover(self, handover: Handover) -> None:
        raise ValueError(NO_HANDOVER)

    async def _load(self, version: int, method: str, **rpc: Any) -> None:
        """Run a reload on the server while paused (pausing with `keep` if not paused), then relabel.

        A server already labelled `version` (another worker sharing it loaded it) loads nothing."""
        http = await self._started()
        async with self._load_lock:
            if not self._paused:
                await self._pause_server(http, "keep")
            try:
                label = (await self._call(http, "GET", "/weight_info"))["weight_version"]
                if label != str(version):
                    await self._rpc(http, method, **rpc)
                    await self._call(http, "POST", "/update_weight_version", json={"new_version": str(version)})
                    # Nothing computed under the old weights may be reused: kept requests recompute their KV.
                    await self._call(http, "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
                self.version = version
            finally:
                if not self._paused:
                    await self._resume_server(http)

    async def _rpc(self, http: httpx.AsyncClient, method: str, **rpc: Any) -> None:
        """`/collective_rpc`: a method of every server worker process, with string arguments only (vLLM's rule)."""
        response = await self._send(http, "POST", "/collective_rpc", json={"method": method, **rpc})
        if response.status_code != 200:
            raise ValueError(f"the vLLM server at {self.url} could not run {method}: {_error_text(response)}")

    async def _send(self, http: httpx.AsyncClient, verb: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; `EngineClosedError` if the server is gone. A connection that breaks under it while the server
        still answers `/health` (a pooled connection the server closed as idle in the instant it was reused; a reset)
        is not a dead server: the request goes once more, on a new connection. Every request sent here is safe to
        send again: the control calls are idempotent, and vLLM aborts a generation whose client went away (the
        resend runs under a request id of its own inside vLLM, so the two never collide)."""
        try:
            return await http.request(verb, path, **kwargs)
        except BROKEN_CONNECTION as exc:
            if self._closing or not await self._answers():
                raise self._gone(path, exc) from exc
            log.warning("a connection to the vLLM server at %s broke (%s %s: %r); sending it again", self.url, verb,
                        path, exc)  # fmt: skip
        except httpx.TransportError as exc:
            raise self._gone(path, exc) from exc
        try:
            return await http.request(verb, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._gone(path, exc) from exc

    def _gone(self, path: str, exc: Exception) -> EngineClosedError:
        return EngineClosedError(f"the vLLM server at {self.url} is gone ({path}): {exc!r}")

    async def _answers(self) -> bool:
        """The server answers `/health` with 200 on a connection of its own (not one from the pool that just broke)."""
        async with httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=HEALTH_CHECK_S) as probe:
            try:
                return (await probe.get("/health")).status_code == 200
            except httpx.TransportError:
                return False

    async def _call(self, http: httpx.AsyncClient, verb: str, path: str, **kwargs: Any) -> Any:
        """One control call; the server's refusal as `EngineClosedError` that names the endpoint."""
        response = await self._send(http, verb, path, **kwargs)
        if response.status_code == 401:
            raise EngineClosedError(
                f"the vLLM server at {self.url} wants its API key ({verb} {path}: {_error_text(response)}): "
                'give it as api_key in --engine-args, e.g. \'{"api_key": "..."}\''
            )
        if response.status_code != 200:
            raise EngineClosedError(f"the vLLM server at {self.url} refused {verb} {path}: {_error_text(response)}")
        return response.json() if response.content else None

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes do not match the model's checkpoint, when the
        model directory given has one (a directory of config files only: nothing to compare with)."""
        layout = self.weight_layout()
        if layout is not None:
            layout.check(shapes, source)

    def weight_layout(self) -> WeightLayout | None:
        """The tensors of the model directory's checkpoint (`checkpoint_layout`); None when it has none."""
        if self._reference is False:
            self._reference = checkpoint_layout(self.model_dir)
        return self._reference if isinstance(self._reference, WeightLayout) else None

    async def reset_prefix_cache(self) -> None:
        if self._http is not None:
            await self._call(self._http, "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})

    async def sleep(self, level: int) -> None:
        raise SleepNotSupported(
            "the remote engine does not put its server to sleep (a server may be shared by several workers): run the "
            "engine in the worker (--engine vllm --engine-args '{\"enable_sleep_mode\": true}') to free its GPU"
        )

    async def wake_up(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        """Nothing: it never sleeps."""

    @property
    def generated_tokens(self) -> int:
        """Tokens of the requests that ended (the server reports a request's tokens when it ends)."""
        return self._finished_tokens

    def stats(self) -> dict[str, int]:
        return {"running": len(self._live), "generated_tokens": self._finished_tokens, "version": self.version}


def _sampled_logprobs(tokens: np.ndarray, logprobs: dict[str, Any] | None) -> np.ndarray:
    """The logprob of each sampled token, from the server's per-position entries (the sampled token's own)."""
    content = (logprobs or {}).get("content") or []
    if len(content) != len(tokens):
        raise RuntimeError(f"the vLLM server returned logprobs for {len(content)} of {len(tokens)} tokens")
    if any(entry["token_id"] != token for entry, token in zip(content, tokens.tolist(), strict=True)):
        raise RuntimeError("the vLLM server's logprobs are not those of the sampled tokens")
    return np.asarray([entry["logprob"] for entry in content], dtype=np.float32)


def _error_text(response: httpx.Response) -> str:
    """The message of a server's error answer (OpenAI's shape, FastAPI's `detail`, or the raw text)."""
    with contextlib.suppress(ValueError):
        body = response.json()
        if isinstance(body, dict):
            error = body.get("error")
            if isinstance(error, dict):
                return f"{response.status_code} {error.get('message')}"
            return f"{response.status_code} {error or body.get('detail') or body}"
    return f"{response.status_code} {response.text[:300]}"

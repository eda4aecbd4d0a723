"""verl 0.9 generates and syncs weights through Rollout Streams: a rollout replica, a checkpoint engine and a checkpoint
manager, registered as `rollout_streams` in verl's own registries. verl loads this module in every process that
imports it (the `verl.plugins` entry point of this package), so three lines of verl's config select it:

    actor_rollout_ref.rollout.name=rollout_streams
    actor_rollout_ref.rollout.checkpoint_engine.backend=rollout_streams
    actor_rollout_ref.rollout.checkpoint_manager_class=producers.integrations.verl.RolloutStreamsCheckpointManager

with where the fleet is: `actor_rollout_ref.rollout.engine_kwargs.rollout_streams.gateway=http://GATEWAY:8000` (a
`rollouts gateway`) and `actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_streams.redis=redis://...`
(and `.ns`, `.transport`, `.mode`). docs/guide/verl.md says what works and what does not.

- `RolloutStreamsReplica`: no engine of verl's. One small Ray actor (`RolloutStreamsServer`, no GPU) answers verl's
  token-in/token-out `generate` through the gateway's `/inference/v1/generate`; the workers behind the gateway's queue
  generate. `server_address` is the gateway, for verl's OpenAI-style agent loops.
- `RolloutStreamsCheckpointEngine`: the actor's rank 0 publishes the `(name, tensor)` stream verl hands it with
  `RolloutClient.publish_weights` (bucketed, any transport), which pauses, syncs and resumes the fleet; the other
  ranks iterate theirs (an FSDP gather is collective) and send nothing. The rollout side receives nothing: the
  workers load from the transport.
- `RolloutStreamsCheckpointManager`: verl's manager aborts the replicas' requests, builds a process group with their
  engine workers and resumes them; the sync does all of that to the fleet here, so this one only has the actor send.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from pipeline.wire import PauseMode
from producers.client import RolloutClient

NAME = "rollout_streams"
"""The name in both registries: `rollout.name` and `rollout.checkpoint_engine.backend`."""

LOGPROBS_MODES = {"raw_logprobs", "processed_logprobs"}
"""verl's `rollout.logprobs_mode` values the engines can report (verl's default is `processed_logprobs`)."""


class GatewayRefused(RuntimeError):
    """The gateway answered a `generate` with an error (OpenAI's shape): its message, and what the call asked."""


def _settings(engine_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    found = dict((engine_kwargs or {}).get(NAME) or {})
    if not found.get("gateway"):
        raise ValueError(
            "rollout_streams needs the gateway that fronts its workers: set "
            "actor_rollout_ref.rollout.engine_kwargs.rollout_streams.gateway=http://HOST:PORT (a `rollouts gateway`)"
        )
    return found


class RolloutStreamsServer:
    """verl's server handle for one replica (a Ray actor): `generate` is vLLM's server's signature, answered by a
    `rollouts gateway`. The control calls verl makes around a weight sync (abort, resume, sleep, the KV cache's) do
    nothing here, because `publish_weights` pauses and resumes the fleet itself and a paused sample resumes where it
    stopped: verl never sees an aborted one."""

    def __init__(
        self,
        gateway: str,
        *,
        prompt_length: int,
        response_length: int,
        logprobs_mode: str | None = "processed_logprobs",
        timeout_s: float = 3600.0,
        model: str | None = None,
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            reported = " or ".join(sorted(LOGPROBS_MODES))
            raise ValueError(f"rollout.logprobs_mode={logprobs_mode!r}: rollout_streams reports {reported}")
        self.gateway = gateway.rstrip("/")
        self.prompt_length, self.response_length = prompt_length, response_length
        self.logprobs_mode = logprobs_mode
        self.model = model
        self._http = httpx.AsyncClient(base_url=self.gateway, timeout=timeout_s)

    async def ready(self) -> str:
        """The gateway's first model name, once it answers (`launch_servers` waits on this)."""
        answer = await self._http.get("/v1/models")
        answer.raise_for_status()
        return str(answer.json()["data"][0]["id"])

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> TokenOutput:
        """One sample of `prompt_ids`: its tokens, their logprobs if `sampling_params["logprobs"]`, and in
        `extra_fields` the policy versions that wrote it (`global_steps`: the last token's; `min_global_steps`,
        `max_global_steps`; `weight_version_spans`: `[version, start, end]` per span).

        Raises `ValueError` for inputs the workers cannot take (images, video, audio, priorities, disaggregated
        prefill), and `GatewayRefused` with the gateway's reason for a sampling field it does not honour."""
        unsupported = {
            "image_data": image_data,
            "video_data": video_data,
            "audio_data": audio_data,
            "mm_processor_kwargs": mm_processor_kwargs,
            "kv_transfer_params": kv_transfer_params,
        }
        for name, value in unsupported.items():
            if value:
                raise ValueError(f"rollout_streams takes token ids only: {name} is not supported")
        if priority:
            raise ValueError(f"priority={priority}: rollout_streams serves its queue first in, first out")
        tokens = [int(t) for t in prompt_ids]
        params = dict(sampling_params)
        max_tokens = params.pop("max_tokens", None) or params.pop("max_new_tokens", None)
        if max_tokens is None:  # as verl's vLLM server: the response length, within the prompt + response budget
            max_tokens = min(self.response_length, self.prompt_length + self.response_length - len(tokens))
        logprobs = bool(params.pop("logprobs", False))
        params.update(max_tokens=max(1, int(max_tokens)), logprobs=0 if logprobs else None, n=1)
        params["logprobs_mode"] = self.logprobs_mode
        body = {"token_ids": tokens, "sampling_params": params, "request_id": request_id[:256]}
        if self.model:
            body["model"] = self.model
        answer = await self._http.post("/inference/v1/generate", json=body)
        if answer.status_code != 200:
            raise GatewayRefused(f"the gateway at {self.gateway} answered {answer.status_code}: {_reason(answer)}")
        (choice,) = answer.json()["choices"]
        spans = [list(span) for span in choice["spans"]]
        versions = [span[0] for span in spans]
        finish = choice.get("finish_reason")
        return TokenOutput(
            token_ids=choice["token_ids"],
            log_probs=[entry["logprob"] for entry in choice["logprobs"]["content"]] if logprobs else None,
            stop_reason="completed" if finish in ("stop", "length") else finish,
            extra_fields={
                "global_steps": versions[-1] if versions else None,
                "min_global_steps": min(versions) if versions else None,
                "max_global_steps": max(versions) if versions else None,
                "weight_version_spans": spans,
            },
        )

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> None:
        """Nothing: the sync pauses the workers (its `mode`), and a paused sample resumes where it stopped."""

    async def resume_generation(self) -> None:
        """Nothing: the sync resumes the workers."""

    async def wake_up(self) -> None:
        """Nothing: the workers hold their engines (see `rollouts worker --lazy --release-after-s`)."""

    async def sleep(self) -> None:
        """Nothing: the workers hold their engines (see `rollouts worker --lazy --release-after-s`)."""

    async def clear_kv_cache(self) -> None:
        """Nothing: a sync resets the workers' prefix caches (or salts them by version, in `inflight`)."""

    async def release_kv_cache(self) -> None:
        """Nothing: the workers' engines keep their caches through a sync."""

    async def resume_kv_cache(self) -> None:
        """Nothing: the workers' engines keep their caches through a sync."""

    async def set_global_steps(self, global_steps: int) -> None:
        """Nothing: each token's version comes from the worker that wrote it."""

    async def start_profile(self, **kwargs: Any) -> None:
        """Nothing: the workers are profiled with `rollouts top` and their Prometheus metrics."""

    async def stop_profile(self) -> None:
        """Nothing (see `start_profile`)."""


def _reason(answer: httpx.Response) -> str:
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.text[:500]


class RolloutStreamsReplica(RolloutReplica):
    """A verl rollout replica served by a Rollout Streams fleet. Whatever verl's mode (hybrid, colocated, standalone),
    it starts no engine and takes no GPUs: it launches one `RolloutStreamsServer` actor, verl's server handle."""

    async def init_hybrid(self, worker_group: Any) -> None:
        await self.launch_servers()

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        await self.launch_servers()

    async def init_colocated(self, resource_pool: Any) -> None:
        await self.launch_servers()

    async def init_standalone(self) -> None:
        await self.launch_servers()

    async def launch_servers(self) -> None:
        """Start this replica's server actor (named, so a driver that comes back finds it) and wait until the gateway
        answers. Raises `ValueError` when the config does not say where the gateway is."""
        settings = _settings(self.config.engine_kwargs)
        remote = ray.remote(RolloutStreamsServer).options(
            name=f"{NAME}_server_{self.replica_rank}{self.name_suffix}",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=self.max_concurrency,
        )
        server: Any = remote.remote(
            settings["gateway"],
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            logprobs_mode=self.config.logprobs_mode,
            timeout_s=float(settings.get("timeout_s", 3600.0)),
            model=settings.get("model"),
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = urlsplit(settings["gateway"]).netloc  # host:port, as verl's vLLM replica gives it

    def rollout_worker_use_gpu(self) -> bool:
        return False


class RolloutStreamsCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine for a Rollout Streams fleet: on the actor's rank 0 (`is_master`), `send_weights`
    publishes verl's `(name, tensor)` stream as the next policy version; its keyword arguments come from
    `checkpoint_engine.engine_kwargs.rollout_streams`: `redis` (required), `ns`, `transport`, `mode`,
    `ack_timeout_s` (as `RolloutClient.publish_weights` takes them). Raises `ValueError` without `redis`."""

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        redis: str | None = None,
        ns: str = "rollouts",
        transport: str = "redis://",
        mode: PauseMode = "abort",
        ack_timeout_s: float = 60.0,
    ) -> None:
        if not redis:
            raise ValueError(
                "the rollout_streams checkpoint engine publishes to the fleet's Redis: set actor_rollout_ref.rollout."
                "checkpoint_engine.engine_kwargs.rollout_streams.redis=redis://HOST:PORT (and .ns)"
            )
        self.bucket_size, self.is_master = bucket_size, is_master
        self.redis, self.ns, self.transport, self.mode, self.ack_timeout_s = redis, ns, transport, mode, ack_timeout_s
        self._client: RolloutClient | None = None

    @property
    def client(self) -> RolloutClient:
        if self._client is None:
            self._client = RolloutClient(self.redis, self.ns)
        return self._client

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}  # no process group of verl's: the transport is the fleet's

    def init_process_group(self, **kwargs: Any) -> None:
        pass

    def finalize(self) -> None:
        pass

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Publish `weights` (a generator or async generator of `(name, tensor)`) and return the sync's figures as
        verl's metrics: `rollout_streams/version`, `/publish_s`, `/acked`, `/evicted`. Raises what `publish_weights`
        raises (`WeightsMismatch` for a tensor no worker's model takes, `SyncError` while another sync is under way)."""
        if not self.is_master:
            async for _ in _aiter(weights):
                pass  # each rank's part of a gather; rank 0's stream is the whole model
            return {}
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        version = await asyncio.to_thread(
            self.client.publish_weights,
            _in_thread(weights, loop),
            transport=self.transport,
            mode=self.mode,
            ack_timeout_s=self.ack_timeout_s,
            bucket_bytes=self.bucket_size,
        )
        sync = self.client.last_sync
        return {
            f"{NAME}/version": version,
            f"{NAME}/publish_s": time.monotonic() - began,
            f"{NAME}/acked": len(sync.acked) if sync else 0,
            f"{NAME}/evicted": len(sync.evicted) if sync else 0,
        }

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Nothing arrives here: the workers load each version from the transport."""
        return
        yield  # an async generator that yields nothing


async def _aiter(weights: Any) -> AsyncIterator[Any]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _in_thread(weights: Any, loop: asyncio.AbstractEventLoop) -> Iterable[tuple[str, torch.Tensor]]:
    """`weights` for `publish_weights`, which runs in a thread: an async generator is stepped on `loop`."""
    if not hasattr(weights, "__aiter__"):
        return weights

    def pulled() -> Iterator[tuple[str, torch.Tensor]]:
        iterator = weights.__aiter__()
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(iterator.__anext__(), loop).result()
            except StopAsyncIteration:
                return

    return pulled()


class RolloutStreamsCheckpointManager(CheckpointEngineManager):
    """verl's `CheckpointEngineManager` for a Rollout Streams fleet (`rollout.checkpoint_manager_class`): a weight
    update is the actor's `send_weights` and nothing else, because `publish_weights` pauses, syncs and resumes every
    worker. Returns the sync's metrics (the checkpoint engine's)."""

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        refs = self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
        results = await asyncio.to_thread(ray.get, refs)
        metrics: dict[str, Any] = {}
        for result in results if isinstance(results, list) else [results]:
            if isinstance(result, dict):
                metrics.update(result)
        return metrics


RolloutReplicaRegistry.register(NAME, lambda: RolloutStreamsReplica)
CheckpointEngineRegistry.register(NAME)(RolloutStreamsCheckpointEngine)

"""vLLM's RL control routes on the gateway: a pause as a hold on new calls, and weight updates as `publish_weights`.

**Pause.** A vLLM server pauses its engine; a gateway fronts a fleet whose workers pause only inside a weight sync
(pause → load → ack → resume, driven by the staleness manager). So `POST /pause?mode=M` sets a *hold*
(`{ns}:gateway:hold`, seen by every replica): no replica queues a new call until `POST /resume` (calls wait, as
vLLM's do, up to `--pause-timeout-s`, then 503), and `M` becomes the mode of the next weight sync the weight routes
run: vLLM's `keep` is ours (requests freeze in the engine and continue in place), vLLM's `abort` is ours (interrupted
samples are continued by the worker: the caller still gets one whole answer, where vLLM would end it with
`finish_reason="abort"`), our `inflight` may be asked too; vLLM's `wait` (let running requests finish on the old
weights) has no counterpart, since a sync never waits for requests, and is refused. The samples already in flight go
on generating under the old version until the sync itself pauses the workers; their `spans` say which tokens came
from which version. A hold expires after `--rl-pause-ttl-s`, so a trainer that died paused does not stop the fleet.

**Weights.** `/init_weight_transfer_engine` → `/start_weight_update` → `/update_weights` (any number of times) →
`/finish_weight_update` publishes what arrived as the next policy version, through `RolloutClient.publish_weights`
and the transport `init_info.transport` names (default `--weights-transport`): every live worker pauses (the hold's
mode), loads, acks and resumes. What `/update_weights` takes: the tensors themselves, vLLM's `names`, `dtype_names`,
`shapes` plus `data` (each tensor's raw little-endian bytes, base64), or `weights_path`, a safetensors checkpoint
directory this gateway can read. vLLM's own backends move tensors outside HTTP, and cannot reach our workers: NCCL
(a process group of the trainer and the vLLM workers), CUDA IPC (pickled handles to one GPU's memory), SkyRL's
`delta` checkpoints and sharded RDT are refused with a 400 that says so. One update at a time per namespace
(`{ns}:gateway:weights`); the tensors of an open update are held in this process's memory until its finish.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.codec import as_text
from pipeline.streams import Streams
from pipeline.wire import PAUSE_MODES, PauseMode
from producers.gateway.openai_api import OpenAIError
from staleness.weights.base import takes_host_tensors

if TYPE_CHECKING:
    import torch

    from producers.client import RolloutClient

GUIDE = "docs/guide/vllm-routes.md"


# -- the hold -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hold:
    mode: PauseMode
    by: str
    ts: float


def read_hold(streams: Streams) -> Hold | None:
    """The pause a caller set (`POST /pause`), if one is in force. Blocking."""
    fields = {as_text(k): as_text(v) for k, v in streams.redis.hgetall(streams.keys.gateway_hold).items()}
    mode = fields.get("mode")
    if mode not in PAUSE_MODES:
        return None
    return Hold(mode, fields.get("by", ""), float(fields.get("ts") or 0))


def set_hold(streams: Streams, mode: PauseMode, by: str, ttl_s: float) -> None:
    pipe = streams.redis.pipeline(transaction=True)
    pipe.hset(streams.keys.gateway_hold, mapping={"mode": mode, "by": by, "ts": repr(time.time())})
    pipe.expire(streams.keys.gateway_hold, max(1, int(ttl_s)))
    pipe.execute()


def clear_hold(streams: Streams) -> bool:
    return bool(streams.redis.delete(streams.keys.gateway_hold))


def pause_mode(mode: str) -> PauseMode:
    """vLLM's `/pause` mode as ours: `abort` and `keep` are ours, `inflight` ours too; `wait` is refused."""
    if mode == "wait":
        raise OpenAIError(
            400,
            "mode=wait (running requests finish on the old weights first) has no counterpart here: a weight sync never "
            "waits for requests; use mode=keep (they freeze and continue in place) or mode=abort (they are continued "
            "after the sync), both losing no token",
            code="unsupported_pause_mode",
            param="mode",
        )
    if mode not in PAUSE_MODES:
        raise OpenAIError(400, f"mode must be one of abort, keep, inflight; not {mode!r}", param="mode")
    return mode


# -- what frameworks send --------------------------------------------------------------------------------

FOREIGN_INIT: list[tuple[frozenset[str], str]] = [
    (
        frozenset({"master_address", "master_port", "world_size", "rank_offset"}),
        "NCCL weight transfer (vLLM's, SkyRL's `nccl` backend, TRL's `init_communicator`) joins the trainer and the "
        "vLLM server's own GPU workers in one process group: Rollout Streams' workers are not in it and cannot join "
        "from here. Publish from the trainer with RolloutClient.publish_weights(model, transport='nccl://HOST:PORT'), "
        'or send the tensors to /update_weights (init_info {"transport": "redis://"})',
    ),
    (
        frozenset({"base_model_path", "local_checkpoint_dir", "checkpoint_load_format"}),
        "SkyRL's `delta` weight sync (compressed checkpoint deltas fetched by /fetch_weights) is not read by the "
        'gateway; send the tensors to /update_weights, or a whole checkpoint as update_info {"weights_path": DIR}',
    ),
    (
        frozenset({"replica_rank", "num_replicas"}),
        "sharded RDT weight transfer (inference workers pulling slices over NIXL) cannot reach Rollout Streams' "
        "workers; send the tensors to /update_weights",
    ),
    (
        frozenset({"packed", "packed_buffer_size_bytes", "packed_num_buffers"}),
        "a packed NCCL or CUDA IPC weight transfer moves tensors outside HTTP, where Rollout Streams' workers cannot "
        'take them; send the tensors themselves to /update_weights (init_info {"transport": "redis://"})',
    ),
]
INIT_FIELDS = {"transport": str, "ack_timeout_s": (int, float)}

FOREIGN_UPDATE: list[tuple[frozenset[str], str]] = [
    (
        frozenset({"ipc_handles", "ipc_handles_pickled"}),
        "CUDA IPC weight transfer sends pickled handles to one GPU's memory: no pickle is taken here, and the workers "
        "are not on the trainer's GPU; send the tensors' bytes as `data`",
    ),
    (
        frozenset({"target_version", "sync_dir", "uri"}),
        "SkyRL's `delta` checkpoints are not read by the gateway; send the tensors as `data`, or `weights_path`",
    ),
]
UPDATE_FIELDS = ("names", "dtype_names", "shapes", "data", "weights_path", "packed", "is_checkpoint_format")

DTYPES = (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
)  # fmt: skip


def _check_info(
    info: dict[str, Any], foreign: list[tuple[frozenset[str], str]], fields: Iterable[str], what: str, takes: str
) -> None:
    """Refuse another backend's `init_info`/`update_info` (saying why it cannot reach our workers), then any field
    this gateway does not take."""
    for keys, why in foreign:
        if keys & set(info):
            raise OpenAIError(400, f"{what}: {why} (see {GUIDE})", code="unsupported_weight_transfer", param=what)
    unknown = sorted(set(info) - set(fields))
    if unknown:
        raise OpenAIError(
            400, f"{what}: unknown field(s) {', '.join(unknown)}; this gateway takes {takes} (see {GUIDE})", param=what
        )


def decode_tensors(info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`names`, `dtype_names`, `shapes`, `data` (raw little-endian bytes, base64) as named CPU tensors."""
    import torch

    names, dtypes, shapes, data = (info.get(k) for k in ("names", "dtype_names", "shapes", "data"))
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise OpenAIError(400, "update_info needs names, dtype_names and shapes (lists)", param="update_info")
    if data is None:
        raise OpenAIError(
            400,
            "update_info has names, dtype_names and shapes but no `data`: in vLLM's protocol the tensors travel over "
            f"NCCL, which cannot reach Rollout Streams' workers; send each tensor's raw bytes as base64 in `data` "
            f"(see {GUIDE})",
            code="unsupported_weight_transfer",
            param="update_info.data",
        )
    if not isinstance(data, list) or not len(names) == len(dtypes) == len(shapes) == len(data):
        raise OpenAIError(400, "names, dtype_names, shapes and data must be lists of one length", param="update_info")
    out: dict[str, torch.Tensor] = {}
    for name, dtype_name, shape, blob in zip(names, dtypes, shapes, data, strict=True):
        dtype_key = str(dtype_name).removeprefix("torch.")
        if dtype_key not in DTYPES:
            raise OpenAIError(
                400, f"{name}: dtype {dtype_name!r} is not one of {', '.join(DTYPES)}", param="dtype_names"
            )
        dtype = getattr(torch, dtype_key)
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise OpenAIError(400, f"{name}: shape must be a list of sizes, not {shape!r}", param="shapes")
        try:
            raw = base64.b64decode(blob, validate=True)
        except (ValueError, TypeError):
            raise OpenAIError(400, f"{name}: data is not base64", param="update_info.data") from None
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * torch.empty(0, dtype=dtype).element_size()
        if len(raw) != expected:
            raise OpenAIError(
                400, f"{name}: {len(raw)} bytes of data for shape {shape} in {dtype_key} ({expected} expected)",
                param="update_info.data",
            )  # fmt: skip
        out[str(name)] = (
            torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
        )
    return out


def checkpoint_layout(model_dir: Path) -> dict[str, list[int]]:
    """Tensor names and shapes of the safetensors checkpoint in `model_dir` (read from the files' headers); empty if
    it has none."""
    files = sorted(model_dir.glob("*.safetensors"))
    layout: dict[str, list[int]] = {}
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                layout[name] = list(entry["shape"])
    return layout


# -- one replica's weight updates ---------------------------------------------------------------------------


class WeightUpdates:
    """The weight-transfer routes of one gateway replica: an update is opened, filled and published here."""

    def __init__(
        self,
        streams: Streams,
        replica: str,
        transport: str,
        model_dir: Path | None,
        ack_timeout_s: float = 60.0,
        lock_ttl_s: float = 3600.0,
    ) -> None:
        self.streams = streams
        self.replica = replica
        self.transport = transport
        self.ack_timeout_s = ack_timeout_s
        self.lock_ttl_s = lock_ttl_s
        self._model_dir = model_dir
        self._layout: dict[str, list[int]] | None = None
        self._tensors: dict[str, torch.Tensor] | None = None
        """The open update's tensors so far (None: no update open)."""
        self._path: str | None = None
        self._client: RolloutClient | None = None
        self._lock = asyncio.Lock()

    def init(self, info: dict[str, Any]) -> None:
        """`/init_weight_transfer_engine`: refuse other backends' rendezvous; take our transport's settings."""
        _check_info(
            info,
            FOREIGN_INIT,
            INIT_FIELDS,
            "init_info",
            "`transport` (redis://, fs:///DIR, nccl://HOST:PORT) and `ack_timeout_s`",
        )
        transport = info.get("transport", self.transport)
        if not isinstance(transport, str) or not takes_host_tensors(transport):
            raise OpenAIError(
                400, f"init_info.transport must be redis://, fs:///DIR or nccl://HOST:PORT, not {transport!r}"
            )
        timeout = info.get("ack_timeout_s", self.ack_timeout_s)
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise OpenAIError(400, f"init_info.ack_timeout_s must be > 0, not {timeout!r}", param="init_info")
        self.transport, self.ack_timeout_s = transport, float(timeout)

    async def start(self) -> None:
        async with self._lock:
            if self._tensors is not None or self._path is not None:
                raise OpenAIError(409, "a weight update is open already: /finish_weight_update it first", code="busy")
            await asyncio.to_thread(self._take_lock)
            self._tensors = {}

    async def update(self, info: dict[str, Any]) -> int:
        """Add the tensors of one `/update_weights` to the open update; returns how many it holds."""
        async with self._lock:
            if self._tensors is None:
                raise OpenAIError(409, "no weight update is open: call /start_weight_update first", code="no_update")
            takes = "names, dtype_names, shapes and data (the tensors), or weights_path (a checkpoint directory)"
            _check_info(info, FOREIGN_UPDATE, UPDATE_FIELDS, "update_info", takes)
            if info.get("weights_path") is not None:
                return self._set_path(info)
            tensors = await asyncio.to_thread(decode_tensors, info)
            self._check_fits(tensors)
            if self._path is not None:
                raise OpenAIError(400, "this update has a weights_path already: tensors cannot join it")
            again = sorted(set(tensors) & set(self._tensors))
            if again:
                raise OpenAIError(400, f"update_info: {again[0]} was sent already in this update", param="names")
            self._tensors.update(tensors)
            return len(self._tensors)

    async def finish(self, weight_version: str | None, mode: PauseMode) -> dict[str, Any]:
        """Publish the open update as the next policy version (pausing the workers in `mode`)."""
        async with self._lock:
            if self._tensors is None:
                raise OpenAIError(409, "no weight update is open: call /start_weight_update first", code="no_update")
            source: Any = self._path if self._path is not None else self._tensors
            if not source:
                raise OpenAIError(400, "nothing to publish: /update_weights sent no tensors in this update")
            from staleness.state import read_state

            state = await asyncio.to_thread(read_state, self.streams.redis, self.streams.keys)
            if weight_version is not None and weight_version != str(state.version + 1):
                raise OpenAIError(
                    400,
                    f"weight_version {weight_version!r} is not the next policy version ({state.version + 1}): versions "
                    "are assigned here (+1 a publish); leave weight_version out",
                    param="weight_version",
                )
            try:
                client, version = await asyncio.to_thread(self._publish, source, mode)
            except Exception as exc:
                from staleness.manager import SyncError

                if isinstance(exc, SyncError):
                    raise OpenAIError(409, f"the weights were not published: {exc}", code="sync_refused") from None
                raise
            finally:
                self._close()
            report = client.last_sync
            assert report is not None  # publish_weights sets it
            return {
                "message": "Weight update finished",
                "version": version,
                "weight_version": str(version),
                "mode": mode,
                "acked": report.acked,
                "evicted": report.evicted,
                "stall_s": round(report.stall_s, 4),
            }

    async def shutdown(self) -> None:
        async with self._lock:
            self._close()

    # -- internals --------------------------------------------------------------------------------------

    def _set_path(self, info: dict[str, Any]) -> int:
        path = Path(str(info["weights_path"]))
        if not path.is_dir() or not any(path.glob("*.safetensors")):
            raise OpenAIError(
                400, f"weights_path {path} is not a safetensors checkpoint directory this gateway can read"
            )
        assert self._tensors is not None
        if self._tensors or self._path is not None:
            raise OpenAIError(400, "weights_path is a whole version: send it alone in its update", param="weights_path")
        self._check_fits({name: shape for name, shape in checkpoint_layout(path).items()})
        self._path = str(path)
        return 1

    def _check_fits(self, tensors: dict[str, Any]) -> None:
        """Every tensor must be one of the served checkpoint's, in its shape: a worker that cannot load a version is
        evicted, so a misnamed tensor is refused here, before anything is published."""
        if self._layout is None:
            self._layout = checkpoint_layout(self._model_dir) if self._model_dir is not None else {}
        if not self._layout:
            return
        for name, value in tensors.items():
            shape = list(value.shape) if hasattr(value, "shape") else list(value)
            if name not in self._layout:
                raise OpenAIError(400, f"{name} is not a tensor of the served model's checkpoint", param="names")
            if shape != self._layout[name]:
                raise OpenAIError(
                    400, f"{name}: shape {shape}, the checkpoint's is {self._layout[name]}", param="shapes"
                )

    def _take_lock(self) -> None:
        key = self.streams.keys.gateway_weights
        if self.streams.redis.set(key, self.replica, nx=True, ex=max(1, int(self.lock_ttl_s))):
            return
        holder = as_text(self.streams.redis.get(key) or b"")
        if holder != self.replica:
            raise OpenAIError(
                409,
                f"gateway replica {holder!r} has a weight update open on this namespace; list one gateway as the "
                "control plane (SkyRL's external_server_urls), or wait for its finish",
                code="weight_update_elsewhere",
            )

    def _close(self) -> None:
        self._tensors, self._path = None, None
        key = self.streams.keys.gateway_weights
        if as_text(self.streams.redis.get(key) or b"") == self.replica:
            self.streams.redis.delete(key)

    def _publish(self, source: Any, mode: PauseMode) -> tuple[RolloutClient, int]:
        """`RolloutClient.publish_weights` (blocking: the whole sync)."""
        if self._client is None:
            from producers.client import RolloutClient

            self._client = RolloutClient(self.streams.redis, self.streams.keys.ns, consumer=f"gateway-{self.replica}")
        version = self._client.publish_weights(
            source, transport=self.transport, mode=mode, ack_timeout_s=self.ack_timeout_s
        )
        return self._client, version

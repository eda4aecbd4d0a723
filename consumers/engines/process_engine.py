"""An engine in a process of its own (`create_engine(kind, model, process=True)`, `rollouts worker --engine-process`).

The torch engine runs its steps on a thread of the worker's process, so every bit of Python the worker runs beside
it (reading work, building and encoding rollouts, Redis I/O, heartbeats) holds the GIL its steps need, and the
engine stands off the CPU for more of its steps than it does alone. Here the engine runs in
`consumers.engines.engine_host`, as vLLM's `EngineCore` runs apart from its `AsyncLLM` client, and this class is the
worker's narrow client of it: the same `Engine` protocol, each call a message on the channel
(`consumers.engines.engine_channel`).

What stays here: the engine's name and limits (from an unstarted copy of it built here, which reads only the model's
config and checks the options, so a bad option fails at once and a lazy worker knows its limits before any start),
its version (the process answers each load with it), and `check_fits` (from the model's `WeightLayout`, sent at
start). What crosses: token ids and logprobs as raw bytes, an adapter's tensors as one safetensors blob, a model's
as the path of a safetensors file (`load_tensors`), a `Handover` as plain data (the process opens it itself: an nccl
broadcast's rank). Its weights live apart (`Placement` `apart`), so `ipc://` refuses it: it opens the trainer's GPU
buffer in the worker's process, not the engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from consumers.engines.base import (
    WAKE_ALL,
    Engine,
    EngineClosedError,
    EngineLifecycle,
    Generation,
    WakePart,
    check_request,
)
from consumers.engines.engine_channel import (
    Channel,
    error_from_wire,
    generation_from_wire,
    pack_tensors,
    save_tensors,
)
from consumers.engines.model_files import WeightLayout
from pipeline.wire import PauseMode, Sampling

if TYPE_CHECKING:
    from staleness.weights.handover import Handover, Placement

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0
"""How long a shutdown waits for the engine process to exit before it is killed."""

EXIT_CODE_WAIT_S = 2.0
"""How long the end of the channel waits for the process's exit code, which names why it ended ("exited (code -9)")."""


class ProcessEngine(EngineLifecycle):
    """The `Engine` protocol, served by engine `kind` in a child process (see the module)."""

    def __init__(self, kind: str, model: str, options: Mapping[str, Any]) -> None:
        from consumers.engines import create_engine

        self.kind, self.model = kind, model
        self.options = {k: _plain(v) for k, v in options.items()}
        local: Engine = create_engine(kind, model, **self.options)  # unstarted: its constructor only reads config
        self.name = local.name
        self.version = local.version
        self.max_model_len = local.max_model_len
        self.vocab_size = local.vocab_size
        self.weight_receivers = local.weight_receivers
        self.max_loras = local.max_loras
        self.max_batch = local.max_batch
        self.max_batch_tokens = local.max_batch_tokens
        self.generated_tokens = 0
        self._layout: WeightLayout | None = None
        self._adapters: dict[str, int] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._reader: asyncio.Task[None] | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        self._start_lock = asyncio.Lock()
        self._closed: str | None = None
        """Why the engine serves no more (None: it may)."""

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine's process and the engine in it (loading the model). Idempotent."""
        async with self._start_lock:
            if self._closed is not None:
                raise EngineClosedError(self._closed)
            if self._channel is not None:
                return
            ours, theirs = socket.socketpair()
            with theirs:
                command = [sys.executable, "-m", "consumers.engines.engine_host", "--fd", str(theirs.fileno())]
                self._process = subprocess.Popen(
                    [*command, "--log-level", _level()],
                    pass_fds=[theirs.fileno()],
                    env=_child_env(),
                )
            self._channel = await Channel.over(ours)
            self._reader = asyncio.create_task(self._read(self._channel))
            self._channel.send([self.kind, self.model, self.options])
            try:
                info = await self._call("start")
            except BaseException:
                await self._abandon()  # as an engine whose start failed: unstarted, and may be started again
                raise
            self.version = int(info["version"])
            self._layout = None if info["layout"] is None else WeightLayout.from_dict(info["layout"])
            log.info("%s engine started in process %d", self.name, self._process.pid)

    async def shutdown(self) -> None:
        """Shut the engine down and wait for its process to exit (killed after `SHUTDOWN_TIMEOUT_S`)."""
        if self._closed is None and self._channel is not None:
            with contextlib.suppress(EngineClosedError):
                await self._call("shutdown")
        self._close("the engine was shut down")
        await self._reap(SHUTDOWN_TIMEOUT_S)

    async def _abandon(self) -> None:
        """Kill a process whose engine did not start, and forget it."""
        await self._reap(0)
        self._process = self._channel = self._reader = None
        self._closed = None

    async def _reap(self, wait_s: float) -> None:
        """Close the channel, give the process `wait_s` to exit (then kill it) and let the reader end."""
        if self._channel is not None:
            await self._channel.close()
        if self._process is not None and await self._exit_code(wait_s) is None:
            if wait_s:
                log.warning("engine process %d did not exit in %.0f s: killed", self._process.pid, wait_s)
            self._process.kill()
            await asyncio.to_thread(self._process.wait)
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    # -- the channel -----------------------------------------------------------------------------

    async def _read(self, channel: Channel) -> None:
        """Hand each answer to its call; once the process is gone, fail every call still waiting."""
        try:
            async for call_id, ok, value in channel.messages():
                future = self._calls.pop(call_id, None)
                if future is None or future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(error_from_wire(value))
        finally:
            code = await self._exit_code(EXIT_CODE_WAIT_S)
            self._close("the engine process is gone" if code is None else f"the engine process exited (code {code})")

    async def _exit_code(self, wait_s: float) -> int | None:
        """The process's exit code, waiting up to `wait_s` for it: a killed process's socket closes before the process
        can be reaped, so the channel's end is often seen first."""
        if self._process is None:
            return None
        try:
            return await asyncio.to_thread(self._process.wait, wait_s)
        except subprocess.TimeoutExpired:
            return None

    def _close(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineClosedError(self._closed))

    async def _call(self, method: str, *args: Any) -> Any:
        if self._closed is not None:
            raise EngineClosedError(self._closed)
        if self._channel is None:
            await self.start()
            assert self._channel is not None
        call_id = self._next_id = self._next_id + 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._channel.send([call_id, method, list(args)])
        try:
            return await future
        except asyncio.CancelledError:
            if self._calls.pop(call_id, None) is not None and self._closed is None:
                self._channel.send([0, "cancel", [call_id]])  # the engine frees the request's row
            raise

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling, adapter: str | None = None
    ) -> Generation:
        """As the engine's own `generate`; its errors keep their class (`EngineInputError` among them)."""
        prompt = np.asarray(prompt_tokens)
        # Before the ids are cut to int32; the engine in its process says whether its model has routers.
        check_request(prompt, sampling, self.max_model_len, self.vocab_size, no_routes=None)
        wire = await self._call(
            "generate", request_id, prompt.astype("<i4").tobytes(), sampling.model_dump(mode="json"), adapter
        )
        generation = generation_from_wire(wire)
        self.generated_tokens += len(generation.tokens)
        return generation

    async def abort(self, request_ids: list[str]) -> None:
        await self._call("abort", list(request_ids))

    async def pause(self, mode: PauseMode) -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def reset_prefix_cache(self) -> None:
        await self._call("reset_prefix_cache")

    async def sleep(self, level: int) -> None:
        await self._call("sleep", level)

    async def wake_up(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        await self._call("wake_up", list(parts))

    # -- weights ---------------------------------------------------------------------------------

    async def load_weights(self, path: str, version: int) -> None:
        self.version = await self._call("load_weights", str(path), version)

    async def load_tensors(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> None:
        """The tensors cross as a safetensors file in a temporary directory of this worker, which the engine's process
        reads, not as a message: written on a thread without the GIL, it never holds the worker's event loop (its
        heartbeat), which packing and queueing a model's worth of bytes did for seconds."""
        with tempfile.TemporaryDirectory(prefix="rollouts-weights-") as folder:
            path = Path(folder) / "weights.safetensors"
            await asyncio.to_thread(save_tensors, named_tensors, path)
            self.version = await self._call("load_tensors", str(path), version)

    @property
    def placement(self) -> Placement:
        """In a process of its own (`staleness.weights.ipc` refuses it by this)."""
        from staleness.weights.handover import Placement

        return Placement(self.name, "apart")

    async def prepare_handover(self, handover: Handover) -> None:
        await self._call("prepare_handover", handover.to_dict())

    async def load_handover(self, handover: Handover) -> None:
        self.version = await self._call("load_handover", handover.to_dict())

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Checked here, against the layout the engine sent at start (None: it has no model; anything fits)."""
        if self._channel is None:
            raise RuntimeError("start() the engine before loading weights")
        if self._layout is not None:
            self._layout.check(shapes, source)

    def weight_layout(self) -> WeightLayout | None:
        """The layout the engine's process sent at start (None: it has no model)."""
        return self._layout

    # -- adapters --------------------------------------------------------------------------------

    def adapters(self) -> dict[str, int]:
        """As the engine answered after the last load or removal (only those change it)."""
        return dict(self._adapters)

    async def _refresh_adapters(self) -> None:
        self._adapters = dict(await self._call("adapters"))

    async def load_adapter(
        self, name: str, tensors: Mapping[str, Any], config: Mapping[str, Any], version: int
    ) -> None:
        blob = await asyncio.to_thread(pack_tensors, tensors)
        try:
            await self._call("load_adapter", name, blob, dict(config), version)
        finally:
            await self._refresh_adapters()

    async def remove_adapter(self, name: str) -> None:
        try:
            await self._call("remove_adapter", name)
        finally:
            await self._refresh_adapters()

    async def pause_adapter(self, name: str, mode: PauseMode) -> None:
        await self._call("pause_adapter", name, mode)

    async def resume_adapter(self, name: str) -> None:
        await self._call("resume_adapter", name)


def _child_env() -> dict[str, str]:
    """This environment, with the checkout this code came from first on the path: the engine's process runs the
    same code as its worker, however the worker found it (an editable install, a Ray working dir, `-m` in a
    checkout)."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return os.environ | {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _level() -> str:
    """The worker's log level, for the engine's process (its lines go to the worker's stderr)."""
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())


def _plain(value: Any) -> Any:
    """An option as msgpack carries it (a torch dtype by its name)."""
    if type(value).__module__ == "torch":
        return str(value).removeprefix("torch.")
    return value

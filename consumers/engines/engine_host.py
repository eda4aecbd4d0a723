"""The engine's own process (`python -m consumers.engines.engine_host --fd N`): it builds the engine its worker asks
for and serves the `Engine` protocol over the channel (`consumers.engines.engine_channel`), as vLLM's `EngineCore`
serves its client.

Only the engine's work runs here: the worker's reads, rollout building, encoding and Redis I/O stay in the worker, so
they never take the GIL the engine's steps need. It lives as long as its channel: when the worker closes it or dies
(even by `kill -9`: the kernel closes its end), the engine is shut down and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from consumers.engines import create_engine
from consumers.engines.base import Engine
from consumers.engines.engine_channel import (
    Channel,
    error_to_wire,
    generation_to_wire,
    load_tensors_file,
    unpack_tensors,
)
from pipeline.fast_exit import leave
from pipeline.wire import Sampling
from staleness.weights.handover import Handover

log = logging.getLogger("consumers.engines.engine_host")


class Host:
    """Runs each call of the worker as a task of its own, so that a `generate` never holds up a `pause`."""

    def __init__(self, engine: Engine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._methods: dict[str, Callable[..., Awaitable[Any]]] = {
            "start": self._start,
            "generate": self._generate,
            "abort": engine.abort,
            "pause": engine.pause,
            "resume": engine.resume,
            "load_weights": self._versioned(engine.load_weights),
            "load_tensors": self._versioned(self._load_tensors),
            "prepare_handover": self._prepare_handover,
            "load_handover": self._versioned(self._load_handover),
            "adapters": self._adapters,
            "load_adapter": self._load_adapter,
            "remove_adapter": engine.remove_adapter,
            "pause_adapter": engine.pause_adapter,
            "resume_adapter": engine.resume_adapter,
            "reset_prefix_cache": engine.reset_prefix_cache,
            "sleep": engine.sleep,
            "wake_up": engine.wake_up,
        }

    async def serve(self) -> None:
        """Answer calls until the worker asks to shut down or its end of the channel closes."""
        try:
            async for call_id, method, args in self.channel.messages():
                if method == "shutdown":
                    await self._finish(call_id)
                    return
                if method == "cancel":  # the worker gave up on a call: it waits for no answer
                    if (cancelled := self._calls.get(args[0])) is not None:
                        cancelled.cancel()
                    continue
                task = asyncio.create_task(self._answer(call_id, method, args))
                self._calls[call_id] = task

                def forget(_: asyncio.Task[None], c: int = call_id) -> None:
                    self._calls.pop(c, None)

                task.add_done_callback(forget)
            log.info("the worker closed the channel: shutting the engine down")
        finally:
            for task in list(self._calls.values()):
                task.cancel()
            await self.engine.shutdown()

    async def _finish(self, call_id: int) -> None:
        await self.engine.shutdown()
        self.channel.send([call_id, True, None])
        await self.channel.drain()

    async def _answer(self, call_id: int, method: str, args: list[Any]) -> None:
        try:
            handler = self._methods.get(method)
            if handler is None:
                raise NotImplementedError(f"no engine call {method!r}")
            value = await handler(*args)
        except asyncio.CancelledError:
            return  # the worker cancelled it (`cancel`): it expects no answer
        except Exception as exc:
            self.channel.send([call_id, False, error_to_wire(exc)])
        else:
            self.channel.send([call_id, True, value])

    def _versioned(self, load: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[int]]:
        """A load, answered with the engine's version after it."""

        async def call(*args: Any) -> int:
            await load(*args)
            return self.engine.version

        return call

    async def _start(self) -> dict[str, Any]:
        await self.engine.start()
        layout = getattr(self.engine, "weight_layout", lambda: None)()
        return {"version": self.engine.version, "layout": None if layout is None else layout.to_dict()}

    async def _generate(
        self, request_id: str, prompt: bytes, sampling: dict[str, Any], adapter: str | None
    ) -> list[Any]:
        tokens = np.frombuffer(prompt, dtype="<i4")
        generation = await self.engine.generate(request_id, tokens, Sampling.model_validate(sampling), adapter)
        return generation_to_wire(generation)

    async def _load_tensors(self, path: str, version: int) -> None:
        await self.engine.load_tensors(await asyncio.to_thread(load_tensors_file, path), version)

    async def _prepare_handover(self, handover: dict[str, Any]) -> None:
        await self.engine.prepare_handover(Handover.from_dict(handover))

    async def _load_handover(self, handover: dict[str, Any]) -> None:
        await self.engine.load_handover(Handover.from_dict(handover))

    async def _adapters(self) -> dict[str, int]:
        return self.engine.adapters()

    async def _load_adapter(self, name: str, blob: bytes, config: dict[str, Any], version: int) -> None:
        await self.engine.load_adapter(name, unpack_tensors(blob), config, version)


async def run(fd: int) -> None:
    channel = await Channel.over(socket.socket(fileno=fd))
    async for kind, model, options in channel.messages():  # the first message says which engine
        engine = create_engine(kind, model, **options)
        break
    else:
        return
    await Host(engine, channel).serve()
    await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the channel")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(args.fd))
    leave(0)  # seconds sooner than the teardown with an engine's modules loaded


if __name__ == "__main__":
    main()

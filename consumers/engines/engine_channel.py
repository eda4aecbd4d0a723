"""The channel between a worker and its engine's process (`consumers.engines.process_engine`,
`consumers.engines.engine_host`).

One Unix socket pair, msgpack messages back to back (msgpack needs no framing), no pickle:
- a call is `[call_id, method, args]`, its answer `[call_id, True, value]` or `[call_id, False, [error, message]]`;
  `cancel` (args: the call to give up on) gets no answer, `shutdown` one once the engine is down;
- token ids and logprobs go as raw little-endian int32 / float32 bytes, as on the wire contract (the alternatives of
  each token, `top_token_ids` / `top_logprobs`, too, with their k);
- an adapter's tensors go as one safetensors blob (`pack_tensors`); a model's weights (`load_tensors`) as the path of a
  safetensors file (`save_tensors`, `load_tensors_file`): packing and queueing hundreds of MB as a message held the
  worker's event loop, and its heartbeat, for seconds.

Writes are gathered: everything sent in one turn of the event loop leaves in one `write` (a step that ends 64
samples is one syscall, not 64).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from consumers.engines.base import EngineClosedError, EngineInputError, Generation, SleepNotSupported

READ_CHUNK = 1 << 20
MAX_MESSAGE = 2**32 - 1
"""msgpack's own limit of a message (an adapter's blob; a model's weights cross as a file, whatever their size)."""

ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        EngineInputError,
        EngineClosedError,
        SleepNotSupported,
        ValueError,
        FileNotFoundError,
        TimeoutError,
        RuntimeError,
        KeyError,
        TypeError,
        NotImplementedError,
    )
}
"""The errors an engine raises that keep their class across the channel (the worker tells them apart)."""


class Channel:
    """msgpack messages over one connected Unix socket, in both directions."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_MESSAGE)
        self._pending: list[bytes] = []
        self._packer = msgpack.Packer()

    @classmethod
    async def over(cls, sock: socket.socket) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=READ_CHUNK)
        return cls(reader, writer)

    def send(self, message: Any) -> None:
        """Queue `message`; all queued in this turn of the loop go out together, in order."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(self._packer.pack(message))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not self._writer.is_closing():
            self._writer.write(b"".join(pending))

    async def drain(self) -> None:
        """Wait until what was sent has left (back-pressure, and before closing)."""
        self._flush()
        await self._writer.drain()

    async def messages(self) -> AsyncIterator[Any]:
        """Every message the other side sends, until it closes (or dies: the same EOF)."""
        while True:
            for message in self._unpacker:  # first what an earlier read left
                yield message
            chunk = await self._reader.read(READ_CHUNK)
            if not chunk:
                return
            self._unpacker.feed(chunk)

    async def close(self) -> None:
        self._flush()
        self._writer.close()
        with contextlib.suppress(ConnectionError):  # the other side died first
            await self._writer.wait_closed()


def error_to_wire(exc: BaseException) -> list[str]:
    return [type(exc).__name__, str(exc)]


def error_from_wire(data: list[str]) -> Exception:
    """The engine process's error as the worker would have seen it in process (an unknown kind: `RuntimeError`)."""
    name, message = data
    cls = ERRORS.get(name)
    return cls(message) if cls is not None else RuntimeError(f"{name} in the engine process: {message}")


def generation_to_wire(generation: Generation) -> list[Any]:
    routes = generation.routed_experts
    top_ids, top_logprobs = generation.top_token_ids, generation.top_logprobs
    alternatives = None
    if top_ids is not None and top_logprobs is not None:
        alternatives = [
            np.ascontiguousarray(top_ids, dtype="<i4").tobytes(),
            np.ascontiguousarray(top_logprobs, dtype="<f4").tobytes(),
            int(top_ids.shape[1]),
        ]
    return [
        np.ascontiguousarray(generation.tokens, dtype="<i4").tobytes(),
        np.ascontiguousarray(generation.logprobs, dtype="<f4").tobytes(),
        generation.finish_reason,
        [list(span) for span in generation.spans],
        generation.cached_tokens,
        None if routes is None else [np.ascontiguousarray(routes, dtype="<i2").tobytes(), list(routes.shape)],
        alternatives,
    ]


def generation_from_wire(data: list[Any]) -> Generation:
    tokens, logprobs, finish_reason, spans, cached, routes, alternatives = data
    top_ids = top_logprobs = None
    if alternatives is not None:
        ids, lps, k = alternatives
        top_ids, top_logprobs = np.frombuffer(ids, dtype="<i4").reshape(-1, k), np.frombuffer(lps, "<f4").reshape(-1, k)
    return Generation(
        tokens=np.frombuffer(tokens, dtype="<i4"),
        logprobs=np.frombuffer(logprobs, dtype="<f4"),
        finish_reason=finish_reason,
        spans=[(int(v), int(s), int(e)) for v, s, e in spans],
        cached_tokens=cached,
        routed_experts=None if routes is None else np.frombuffer(routes[0], dtype="<i2").reshape(routes[1]),
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def pack_tensors(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> bytes:
    """Named torch tensors or numpy arrays as one safetensors blob (`ValueError` past msgpack's 4 GiB)."""
    from safetensors.torch import save

    from consumers.engines.model_files import as_cpu_tensors

    blob = save(as_cpu_tensors(named_tensors))
    if len(blob) > MAX_MESSAGE:
        raise ValueError(
            f"{len(blob)} bytes of weights are too many to hand to an engine process in one message: "
            "use fs:// or nccl:// with --engine-process"
        )
    return blob


def save_tensors(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], path: Path) -> None:
    """Named torch tensors or numpy arrays as one safetensors file (written without holding the GIL)."""
    from safetensors.torch import save_file

    from consumers.engines.model_files import as_cpu_tensors

    save_file(as_cpu_tensors(named_tensors), str(path))


def load_tensors_file(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path)


def unpack_tensors(blob: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    return load(blob)

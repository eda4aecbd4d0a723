"""Generation engines: the factory (`create_engine`, by name) on top of the protocol (`consumers.engines.base`).

Each engine lives in a module of its own and is imported only when asked for, so that torch and vLLM stay off the
import path of a worker that runs another engine (and of the CLI)."""

from __future__ import annotations

from typing import Any

from consumers.engines.base import Engine

ENGINES = ("torch", "vllm", "synthetic", "remote")


IN_PROCESS_ONLY = ("vllm", "remote")
"""Engines whose compute already runs outside the worker's process (vLLM's `EngineCore`, a server)."""


def create_engine(kind: str, model: str, *, process: bool = False, **options: Any) -> Engine:
    """Build an engine by name; heavy imports happen only for the engine asked for. `process`: run it in a process
    of its own (`consumers.engines.process_engine`), so that the worker's Python never holds the GIL its steps need.
    `options` go to the engine's constructor as they are (its keyword arguments differ by engine: typed there, and
    one it does not take is its TypeError), hence `Any` here."""
    if process:
        if kind in IN_PROCESS_ONLY:
            raise ValueError(f"the {kind} engine already runs its compute outside the worker: drop --engine-process")
        from consumers.engines.process_engine import ProcessEngine

        return ProcessEngine(kind, model, options)
    if kind == "torch":
        from consumers.engines.torch_engine import TorchEngine

        return TorchEngine(model, **options)
    if kind == "vllm":
        from consumers.engines.vllm_engine import VllmEngine

        return VllmEngine(model, **options)
    if kind == "synthetic":
        from consumers.engines.synthetic_engine import SyntheticEngine

        return SyntheticEngine(model, **options)
    if kind == "remote":
        from consumers.engines.remote_engine import RemoteVllmEngine

        return RemoteVllmEngine(model, **options)
    raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")

"""What a transport needs of an engine, in terms of no transport: the engine loads a version from one of three sources,
and says where it holds its weights.

- a checkpoint's files (`LoadsWeights.load_weights`: a directory or one safetensors file; `fs://`);
- named tensors in the worker's process (`LoadsWeights.load_tensors`: CPU or device tensors; `redis://`, a copy
  received earlier);
- a `Handover`: a version that each process holding the engine's weights opens where it is, by its transport's class
  (`Transport.open_handover`): device handles of the trainer's GPU memory (`ipc://`), or the receives of a collective
  (`nccl://`). It is plain data, so that it crosses to vLLM's worker processes and to an engine's own process; the
  engine never looks at what is inside (`LoadsWeights.prepare_handover`, `LoadsWeights.load_handover`).

Where the weights live (`Placement`: the worker's process, the engine's own processes, one process apart, a server)
is what a transport asks before it opens anything there (`Transport.check_placement`), and it words its own refusal
("ipc:// needs the trainer and the worker on the same GPU, but ..."). This module imports no engine and no transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Where = Literal["worker", "processes", "apart", "server"]


@dataclass(frozen=True)
class Placement:
    """Where an engine holds its weights, for a transport that opens a version there (`Transport.check_placement`)."""

    engine: str
    """The engine's name (`torch`, `vllm`, ...), for messages."""
    where: Where
    """`worker`: in the worker's own process (torch, synthetic); `processes`: in processes of the engine's own, one per
    GPU, reached by RPC (vLLM's workers); `apart`: in one process of its own (`--engine-process`); `server`: in a
    server reached over HTTP (remote)."""
    device: str | None = None
    """Where weights in the worker's process live (`cpu`, `cuda:0`); None: nowhere there (no model), or not known."""
    on_cpu: bool = False
    """The processes that hold the weights run on the CPU (`processes`: vLLM's CPU build)."""


@dataclass(frozen=True)
class Handover:
    """A version that each process holding an engine's weights opens where it is (`Transport.open_handover`, found by
    `scheme`), rather than bytes the worker hands its engine. `data` is the transport's own (an nccl broadcast's link,
    an ipc manifest), plain JSON, opaque to the engine."""

    scheme: str
    version: int
    data: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""
    """Where it comes from, in words, for logs: `the broadcast from HOST:PORT`, the trainer's GPU memory."""

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "version": self.version, "data": dict(self.data), "source": self.source}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Handover:
        return cls(str(data["scheme"]), int(data["version"]), dict(data["data"]), str(data.get("source", "")))


class LoadsWeights(Protocol):
    """What a transport needs of an engine (`consumers.engines.base.Engine` has it all)."""

    @property
    def weight_receivers(self) -> int:
        """Processes that hold the weights, each of which opens a handover (and takes a rank in an nccl broadcast)."""
        ...

    @property
    def placement(self) -> Placement: ...

    async def load_weights(self, path: str, version: int) -> None: ...

    async def load_tensors(self, named_tensors: Mapping[str, Any], version: int) -> None: ...

    async def prepare_handover(self, handover: Handover) -> None:
        """Before the pause, while generation goes on: each receiving process readies itself
        (`Transport.prepare_handover`: an nccl group built, its receives posted)."""
        ...

    async def load_handover(self, handover: Handover) -> None:
        """Each process that holds the weights opens the handover (`Transport.open_handover`) and loads from it in
        place, then the engine tags what follows with `handover.version`."""
        ...

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
        """Raise `ValueError` if tensors of these names and shapes cannot be loaded into the model."""
        ...

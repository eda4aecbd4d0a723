"""LoRA adapters on the torch engine: slots, the adapter half of `Engine`, and the hooks that apply them per row.

Adapters (up to `max_loras`, PEFT format, checked by `consumers.engines.lora`) are served side by side in one batch,
as vLLM's multi-LoRA does: the base weights stay as they are, and during a model call that has rows of some adapter,
forward hooks on the adapted `nn.Linear` layers add each row's own `scale * B(A x)`. Base rows get nothing added, and
a step without adapter rows runs with no hook at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from consumers.engines.lora import LoraModule, ParsedAdapter, linear_shapes, module_types, parse_adapter
from consumers.engines.torch_scheduler import BatchScheduler, Request, SchedulerConfig
from pipeline.wire import PAUSE_MODES, PauseMode

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class _Adapter:
    """A loaded adapter: its version (what its rows' spans say) and its tensors on the engine's device."""

    version: int
    weights: ParsedAdapter


class LoraAdapters(BatchScheduler):
    """A `BatchScheduler` whose rows may run under LoRA adapters: their slots, the adapter half of `Engine`, and the
    forward hooks that add each adapter row's term to a model call.

    `max_loras`: LoRA adapters held at once (`load_adapter`); 0 serves the base model only. `config` is the
    `BatchScheduler`'s.
    """

    def __init__(self, config: SchedulerConfig, *, max_loras: int) -> None:
        super().__init__(config)
        self.max_loras = max_loras
        # `_adapters` changes under both locks (`_step_lock`, then `_cv`) and is read under either.
        self._adapters: dict[str, _Adapter] = {}
        self._linears: dict[str, torch.nn.Module] = {}
        """The model's `nn.Linear` layers by module path: where an adapter's hooks go (`_find_adapter_targets`)."""
        self._module_types: dict[str, str] = {}
        """The model's modules by path, with their class names (`consumers.engines.lora.module_types`)."""

    def _find_adapter_targets(self, model: torch.nn.Module) -> None:
        """Note the loaded model's `nn.Linear` layers (where adapters' hooks go) and its modules' kinds."""
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self._module_types = module_types(model)

    def adapters(self) -> dict[str, int]:
        """The adapters loaded now, name -> version."""
        with self._cv:
            return {name: a.version for name, a in self._adapters.items()}

    async def load_adapter(
        self, name: str, tensors: Mapping[str, Any], config: Mapping[str, Any], version: int
    ) -> None:
        """Load LoRA adapter `name` (PEFT tensors and config) at `version`, or replace the one of that name.

        Checked against the model's Linear layers off the event loop before anything changes: a bad or
        surplus adapter raises `ValueError` and loads nothing. Running rows of a replaced adapter go back
        to the queue's front and are prefilled again under the new weights, so each token is of one version.
        """
        if self.max_loras == 0:
            raise ValueError(f"this engine serves no adapters (max_loras=0); cannot load {name!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        self._require_model()
        with self._cv:
            self._check_slot(name)
        parsed = await asyncio.to_thread(self._parse_adapter, tensors, config)
        await asyncio.to_thread(self._install_adapter, name, _Adapter(version, parsed))

    def _parse_adapter(self, tensors: Mapping[str, Any], config: Mapping[str, Any]) -> ParsedAdapter:
        parsed = parse_adapter(tensors, config, linear_shapes(self._model), modules=self._module_types)
        return parsed.to(self.device, self.config.dtype)

    def _check_slot(self, name: str) -> None:
        """`ValueError` if `name` would need a slot and all are taken (caller holds `_cv`)."""
        if name not in self._adapters and len(self._adapters) >= self.max_loras:
            raise ValueError(
                f"cannot load adapter {name!r}: all max_loras={self.max_loras} slots hold adapters "
                f"{sorted(self._adapters)}; remove_adapter one first"
            )

    def _install_adapter(self, name: str, adapter: _Adapter) -> None:
        """Put the adapter in its slot between two steps; a replaced adapter's running rows are prefilled again."""
        with self._between_steps():
            with self._cv:
                self._check_slot(name)
                replaced = name in self._adapters
                self._adapters[name] = adapter
            if replaced:
                self._requeue([i for i, r in enumerate(self._rows) if r.adapter == name])
        log.info("loaded adapter %r version %d (%d modules)", name, adapter.version, len(adapter.weights.modules))

    async def remove_adapter(self, name: str) -> None:
        """Free adapter `name`'s slot; `ValueError` while any request of it is waiting, running or held."""
        await asyncio.to_thread(self._remove_adapter_sync, name)

    def _remove_adapter_sync(self, name: str) -> None:
        with self._between_steps(), self._cv:
            if name not in self._adapters:
                return
            live = sorted(r.id for r in self._live.values() if r.adapter == name)
            if live:
                raise ValueError(
                    f"adapter {name!r} has {len(live)} requests in flight ({live[:5]}); "
                    "abort them (or pause_adapter(name, 'abort')) before removing it"
                )
            del self._adapters[name]

    async def pause_adapter(self, name: str, mode: PauseMode) -> None:
        """Stop generating for adapter `name` only (loaded or not); returns once no step runs with it.

        `abort` ends its requests now (waiting, running or held) with their tokens so far; `keep` takes
        its running rows out of the batch, tokens and spans kept, until `resume_adapter`; `inflight` does as
        `keep` (an adapter's rows are prefilled again under its new version). Either way its new requests wait,
        without holding up the requests queued behind them.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        with self._cv:
            self._paused_adapters.add(name)
            self._cv.notify_all()
        await asyncio.to_thread(self._pause_adapter_sync, name, mode == "abort")

    def _pause_adapter_sync(self, name: str, abort: bool) -> None:
        """Take the step lock once (no step of the adapter runs after it), ending or holding its rows."""
        with self._between_steps():
            if abort:
                with self._cv:
                    self._aborts.update(r for r in self._live.values() if r.adapter == name)
                self._apply_aborts()
                return
            held = self._take_rows([i for i, r in enumerate(self._rows) if r.adapter == name])
            with self._cv:
                self._held.extend(held)

    async def resume_adapter(self, name: str) -> None:
        """Let adapter `name` generate again: its held rows go first, prefilled again under its weights of now."""
        with self._cv:
            self._paused_adapters.discard(name)
            back = [r for r in self._held if r.adapter == name]
            self._held = [r for r in self._held if r.adapter != name]
            self._waiting.extendleft(reversed(back))
            self._cv.notify_all()

    @contextlib.contextmanager
    def _lora_hooks(self, rows: Sequence[Request]) -> Iterator[None]:
        """For one model call over `rows`: hooks adding each adapter row's LoRA term, none if no row has one."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(rows):
            if req.adapter is not None:
                groups.setdefault(req.adapter, []).append(i)
        if not groups:
            yield
            return
        per_module: dict[str, list[tuple[slice | torch.Tensor, LoraModule]]] = {}
        for name, indices in groups.items():
            index = _row_index(indices, len(rows), self.device)
            for path, module in self._adapters[name].weights.modules.items():
                per_module.setdefault(path, []).append((index, module))
        handles = [self._linears[path].register_forward_hook(_lora_hook(terms)) for path, terms in per_module.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _row_index(indices: list[int], batch: int, device: torch.device) -> slice | torch.Tensor:
    """Rows of one adapter as a slice when they are contiguous (a view, no gather), else an index tensor."""
    if indices[-1] - indices[0] + 1 == len(indices):
        return slice(indices[0], indices[-1] + 1)
    return torch.tensor(indices, device=device)


def _lora_hook(terms: list[tuple[slice | torch.Tensor, LoraModule]]) -> Callable[..., torch.Tensor]:
    """A forward hook on one `nn.Linear`: each adapter's rows of the output gain `scale * (x A^T) B^T`."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        for rows, lora in terms:
            output[rows] += lora.scale * ((x[rows] @ lora.a.T) @ lora.b.T)
        return output

    return hook

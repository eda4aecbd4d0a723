"""The half of the `vllm` engine that runs inside vLLM's worker processes: `RolloutsWorkerExtension`, mixed into
vLLM's worker class (`worker_extension_cls`, named by `vllm_engine.EXTENSION`). It loads weights sent as a
safetensors blob, receives `nccl://` broadcasts, opens `ipc://` handovers, and masks base-model rows in vLLM's CPU
LoRA ops. Kept apart from `vllm_engine` so that every vLLM worker process imports only this and what it needs."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load, load_file

from staleness.weights.ipc import Manifest, opened
from staleness.weights.nccl import BroadcastLink, prepare_receiver, receive_broadcast


class RolloutsWorkerExtension:
    """Mixed into vLLM's worker class in every worker process (`worker_extension_cls`).

    Method names carry a `rollouts_` prefix: vLLM refuses an extension that shadows a worker attribute.
    """

    # What vLLM's worker (the class this is mixed into) provides, declared for the type checker only: annotations
    # and a TYPE_CHECKING method define no class attribute, so they shadow nothing of the worker's.
    rank: int
    device: torch.device
    if TYPE_CHECKING:

        def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None) -> None: ...

    _rollouts_prepared: Future[torch.distributed.ProcessGroup] | None
    """The group of a broadcast being built on a thread of its own (`rollouts_prepare_broadcast`)."""

    def rollouts_load_safetensors(self, blob: bytes) -> int:
        """Load weights (checkpoint names) from a safetensors blob in place; returns how many tensors."""
        tensors = load(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)

    def rollouts_load_safetensors_file(self, path: str) -> int:
        """Load weights (checkpoint names) from a safetensors file on this host in place (a version staged in memory
        by the engine, `/dev/shm` where it has room); returns how many tensors."""
        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)

    def rollouts_load_ipc(self, manifest: str, version: int) -> int:
        """Open version `version`, which a trainer on this GPU hands over by CUDA IPC (`staleness.weights.ipc`'s JSON
        manifest), and reload from it in place: a device-to-device copy, waited for before this returns (the trainer
        may free the buffer once the worker acks). `ValueError` if this process's GPU is not the trainer's."""
        with opened(Manifest.from_json(manifest, "the manifest sent", version), self.device) as tensors:
            self.reload_weights(weights_iterator=iter(tensors.items()))
            return len(tensors)

    def rollouts_mask_base_lora_rows(self) -> int:
        """Make vLLM's CPU LoRA ops leave base-model rows alone in a batch with adapter rows (vLLM 0.32).

        `vllm.lora.ops.torch_ops` selects each row's adapter weights as `stacked[index]`, and a row without an
        adapter has index -1: Python indexing gives it the last slot's adapter, silently. Zeroing those rows' shrink
        output (`x @ A.T`) zeroes their whole LoRA term, since every CPU LoRA path (linear, logits) expands that
        output next. Idempotent; returns 1 once patched.
        """
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu

        if not getattr(lora_ops.bgmv_shrink, "_rollouts_masked", False):
            masked = _mask_base_rows(lora_ops.bgmv_shrink)
            lora_ops.bgmv_shrink = masked  # `sgmv_shrink` calls it through the module
            punica_cpu.bgmv_shrink = masked  # imported by name there
        return 1

    def rollouts_prepare_broadcast(self, link: dict[str, Any]) -> int:
        """Build this process's group of the broadcast on a thread, and return at once (vLLM's steps go on)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts-broadcast")
        rank, device = self.rank, self.device
        self._rollouts_prepared = pool.submit(prepare_receiver, BroadcastLink.from_dict(link), rank, device)
        pool.shutdown(wait=False)
        return 0

    def rollouts_receive_broadcast(self, link: dict[str, Any]) -> int:
        """Take this process's rank in the trainer's broadcast (`staleness.weights.nccl`) and load what arrives."""
        prepared: Future[Any] | None = getattr(self, "_rollouts_prepared", None)
        self._rollouts_prepared = None
        if prepared is not None:
            prepared.result()  # the group is built (or its error raised here)
        rank = self.rank
        device = self.device
        tensors = dict(receive_broadcast(BroadcastLink.from_dict(link), rank, device))
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)


def _mask_base_rows(shrink: Any) -> Any:
    """`shrink` (vLLM's `bgmv_shrink`), with the output of rows without an adapter (index < 0) set to zero."""

    def run(
        inputs: torch.Tensor,
        lora_a_weights: torch.Tensor,
        output_tensor: torch.Tensor,
        lora_indices_tensor: torch.Tensor,
        scaling: float = 1.0,
    ) -> None:
        shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        base_rows = lora_indices_tensor < 0
        n = min(base_rows.shape[0], output_tensor.shape[0])
        output_tensor[:n][base_rows[:n]] = 0

    run._rollouts_masked = True  # type: ignore[attr-defined]  # a marker on the function object (getattr reads it)
    return run

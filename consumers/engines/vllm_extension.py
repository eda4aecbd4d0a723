"""The half of the `vllm` engine that runs inside vLLM's worker processes: `RolloutsWorkerExtension`, mixed into
vLLM's worker class (`worker_extension_cls`, named by `vllm_engine.EXTENSION`). It loads weights sent as a
safetensors blob or file, opens handovers where the weights live (an `nccl://` broadcast's rank, an `ipc://` GPU
buffer: `staleness.weights.base.opened_handover`, by the handover's transport), pushes the version it holds to
workers that join mid-run where its parameters are the checkpoint's values (`rollouts_push_weights`), and masks
base-model rows in vLLM's CPU LoRA ops. Kept apart from `vllm_engine` so that every vLLM worker process imports only
this and what it needs."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load, load_file

from staleness.weights.base import opened_handover, prepare_handover
from staleness.weights.handover import Handover


class RolloutsWorkerExtension:
    """Mixed into vLLM's worker class in every worker process (`worker_extension_cls`).

    Method names carry a `rollouts_` prefix: vLLM refuses an extension that shadows a worker attribute.
    """

    # What vLLM's worker (the class this is mixed into) provides, declared for the type checker only: annotations
    # and a TYPE_CHECKING method define no class attribute, so they shadow nothing of the worker's.
    rank: int
    device: torch.device
    model_runner: Any
    vllm_config: Any
    if TYPE_CHECKING:

        def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None) -> None: ...

    _rollouts_prepared: Future[None] | None
    """A handover being prepared on a thread of its own (`rollouts_prepare_handover`: an nccl group built)."""

    _rollouts_layerwise: str | None
    """Why this process reloads through vLLM's layerwise `reload_weights` ("" until asked: `rollouts_load_path`)."""

    def rollouts_load_path(self) -> str:
        """How this process loads a version: "direct" (straight into the model's parameters through its own
        `load_weights`) or "layerwise: WHY" (vLLM's `reload_weights`). Decided once, from the loaded model."""
        reason = getattr(self, "_rollouts_layerwise", "")
        if reason == "":
            reason = self._rollouts_layerwise = layerwise_reason(
                self.model_runner.get_model(),
                self.device.type,
                self.vllm_config.model_config.quantization,
                self.vllm_config.lora_config is not None,
                str(self.vllm_config.cache_config.cache_dtype),
            )
        return "direct" if reason is None else f"layerwise: {reason}"

    def rollouts_reload(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-named tensors in place. Where no layer processes its weights after loading (unquantized,
        no LoRA, on a GPU: `layerwise_reason`), through the model's own `load_weights`, which copies each tensor into
        its parameter (q/k/v and gate/up into their stacked slices): the copies alone, ~0.4 ms a tensor less than
        vLLM's `reload_weights`, which rebuilds every layer (its parameters on the meta device, its weight loaders
        wrapped, its processed values copied back) whatever the weights. Elsewhere, `reload_weights`."""
        if self.rollouts_load_path() == "direct":
            self.model_runner.get_model().load_weights(weights=tensors)
        else:
            self.reload_weights(weights_iterator=tensors)

    def rollouts_load_safetensors(self, blob: bytes) -> int:
        """Load weights (checkpoint names) from a safetensors blob in place; returns how many tensors."""
        tensors = load(blob)
        self.rollouts_reload(iter(tensors.items()))
        return len(tensors)

    def rollouts_load_safetensors_file(self, path: str) -> int:
        """Load weights (checkpoint names) from a safetensors file on this host in place (a version staged in memory
        by the engine, `/dev/shm` where it has room); returns how many tensors."""
        tensors = load_file(path)
        self.rollouts_reload(iter(tensors.items()))
        return len(tensors)

    def rollouts_load_handover(self, handover: dict[str, Any]) -> int:
        """Open a version handed over where this process's weights are (`staleness.weights.handover.Handover`, as
        plain data: an nccl broadcast's rank, the trainer's GPU buffer by CUDA IPC) and reload from it in place; what
        was opened is let go, the copies out of it waited for, before this returns (an ipc trainer may free its buffer
        once the worker acks). Waits first for `rollouts_prepare_handover` if it ran. `ValueError` if this process
        cannot open it (ipc: its GPU is not the trainer's)."""
        prepared: Future[Any] | None = getattr(self, "_rollouts_prepared", None)
        self._rollouts_prepared = None
        if prepared is not None:
            prepared.result()  # ready (or its error raised here)
        with opened_handover(Handover.from_dict(handover), self.rank, self.device) as opened:
            tensors = dict(opened)  # a broadcast is drained (every rank must), a buffer viewed
            try:
                self.rollouts_reload(iter(tensors.items()))
                return len(tensors)
            finally:
                tensors.clear()  # nothing of the handover held once it is let go

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

    def rollouts_prepare_handover(self, handover: dict[str, Any]) -> int:
        """Get ready to open a handover on a thread (an nccl group built, its receives posted), and return at once
        (vLLM's steps go on)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts-handover")
        rank, device = self.rank, self.device
        self._rollouts_prepared = pool.submit(prepare_handover, Handover.from_dict(handover), rank, device)
        pool.shutdown(wait=False)
        return 0

    _rollouts_push: Future[dict[str, Any]] | None
    """A push to joiners running on a thread of its own (`rollouts_push_weights`), until its result is taken."""
    _rollouts_staged: threading.Event
    """Set once that push's tensors are staged and its rendezvous listens."""

    def rollouts_share_info(self) -> dict[str, Any]:
        """What a peer needs to know of this process: `gpu`, its GPU's CUDA UUID ("" on the CPU); `why_not`, why it
        cannot push the version it holds ("" where it can: its parameters hold the checkpoint's values exactly, which
        is where versions load directly, `rollouts_load_path`, and with one rank); `shapes`, the checkpoint names and
        shapes it would push (`checkpoint_views`), for the engine to check against the model's checkpoint."""
        gpu = str(torch.cuda.get_device_properties(self.device).uuid) if self.device.type == "cuda" else ""
        path, why, shapes = self.rollouts_load_path(), "", {}
        ranks = int(self.vllm_config.parallel_config.world_size)
        if path != "direct":
            why = f"its parameters are not the checkpoint's values (versions load {path})"
        elif ranks != 1:
            why = f"its weights are split over {ranks} ranks"
        else:
            try:
                shapes = {name: list(t.shape) for name, t in checkpoint_views(self.model_runner.get_model())}
            except ValueError as exc:
                why = str(exc)
        return {"gpu": gpu, "why_not": why, "shapes": shapes}

    def rollouts_push_weights(self, push: dict[str, Any]) -> int:
        """Start pushing the version this process holds to a peer's joiners (`staleness.weights.nccl.PeerPush`, as
        plain data) on a thread, and return at once: vLLM's steps go on while joiners join and the bytes cross (the
        weights are only read). `rollouts_push_state` follows it. `RuntimeError` if a push is under way."""
        from staleness.weights.nccl import PeerPush, push_from_peer

        running: Future[Any] | None = getattr(self, "_rollouts_push", None)
        if running is not None and not running.done():
            raise RuntimeError("a push to joiners is under way in this process")
        spec, device, model = PeerPush.from_dict(push), self.device, self.model_runner.get_model()
        staged = self._rollouts_staged = threading.Event()

        def run() -> dict[str, Any]:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            return asdict(push_from_peer(spec, checkpoint_views(model), staged.set))

        pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts-push")
        self._rollouts_push = pool.submit(run)
        pool.shutdown(wait=False)
        return 0

    def rollouts_push_state(self) -> dict[str, Any]:
        """The push's state, without waiting: `staged` (its joiners may be told), `done`, and once done `stats` (the
        broadcast's, as plain data) or `error`; a result is handed out once."""
        running: Future[dict[str, Any]] | None = getattr(self, "_rollouts_push", None)
        if running is None:
            return {"staged": False, "done": True, "stats": None, "error": "no push under way in this process"}
        done = running.done()
        state: dict[str, Any] = {"staged": self._rollouts_staged.is_set(), "done": done, "stats": None, "error": ""}
        if done:
            self._rollouts_push = None
            error = running.exception()
            if error is None:
                state["stats"] = running.result()
            else:
                state["error"] = f"{type(error).__name__}: {error}"
        return state


def checkpoint_views(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters of a vLLM model (one rank, unquantized: as a direct load leaves them) under their checkpoint
    names, as views (nothing copied): a stacked parameter (`qkv_proj`, `gate_up_proj`: the model's
    `packed_modules_mapping`) split along its output dimension by its layer's `output_sizes` into the checkpoint's
    tensors (`q_proj`, `k_proj`, `v_proj`, ...), a vocabulary padded for its kernels cut back to the checkpoint's
    rows; tied parameters once (vLLM's `named_parameters` yields a tied `lm_head` as the embedding). `ValueError`
    where a stacked parameter does not add up."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    modules = dict(model.named_modules())
    views: list[tuple[str, torch.Tensor]] = []
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        parent, _, short = owner.rpartition(".")
        module, tensor = modules.get(owner), param.data
        parts = packed.get(short)
        if parts:
            sizes = [int(size) for size in getattr(module, "output_sizes", ())]
            if len(sizes) != len(parts) or sum(sizes) != tensor.shape[0]:
                raise ValueError(
                    f"{name} {list(tensor.shape)} does not split into {', '.join(parts)} by its layer's output sizes "
                    f"{sizes}"
                )
            offset = 0
            for part, size in zip(parts, sizes, strict=True):
                split = f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}"
                views.append((split, tensor.narrow(0, offset, size)))
                offset += size
            continue
        rows = getattr(module, "org_vocab_size", None)
        if isinstance(rows, int) and tensor.dim() and rows < tensor.shape[0]:
            tensor = tensor.narrow(0, 0, rows)  # vLLM pads the vocabulary; the checkpoint has its own rows
        views.append((name, tensor))
    return views


NO_OP_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
"""vLLM's weight methods whose `process_weights_after_loading` does nothing on a GPU (on a CPU they repack)."""
NO_OP_IMPLS = frozenset({"AttentionImplBase", "AttentionImpl"})
"""vLLM's attention implementation bases whose `process_weights_after_loading` is a no-op (FlashAttention keeps it;
FlashInfer's sinks and MLA's absorbed projections are derived from the weights, so they override it)."""


def layerwise_reason(
    model: torch.nn.Module, device_type: str, quantization: str | None, lora: bool, cache_dtype: str
) -> str | None:
    """Why a version must load through vLLM's layerwise `reload_weights` into `model` (None: the model's own
    `load_weights` alone leaves it exactly as a fresh load would). vLLM's loader runs `process_weights_after_loading`
    after a load: every layer whose weight method or attention implementation does something there keeps values derived
    from the weights (repacked, quantized, absorbed), which a plain load would leave stale."""
    if device_type != "cuda":
        return f"vLLM repacks weights after loading them on {device_type}"
    if quantization:
        return f"the model is quantized ({quantization})"
    if lora:
        return "LoRA wraps the model's layers"
    if cache_dtype != "auto":
        return f"the KV cache is {cache_dtype}"
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in NO_OP_METHODS:
            return f"{name}'s {type(method).__name__} processes its weights after loading"
        if hasattr(module, "process_weights_after_loading") and method is None:
            impl = getattr(module, "impl", None)
            owner = _defined_by(impl, "process_weights_after_loading") if impl is not None else ""
            if type(module).__name__ != "Attention" or owner not in NO_OP_IMPLS:
                return f"{name} ({type(module).__name__}) processes its weights after loading"
    return None


def _defined_by(obj: object, method: str) -> str:
    """The name of the class in `obj`'s MRO that defines `method` ("" if none)."""
    return next((c.__name__ for c in type(obj).__mro__ if method in vars(c)), "")


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

"""`rollouts bench-sync`: how long workers stand still when the trainer publishes new weights.

For each model size and transport, one worker generates steadily while the trainer publishes a
new version again and again. Each publish is timed in parts: `publish_s` (the tensors into the
transport), `sync_s` (the manager's `weights` command to its `resume`: join, pause, load, ack),
`publish_to_serving_s` (from the `publish_weights` call until the worker reports it serves the new
version) and `stall_s`, the time the worker stood still: from its pause to its resume, as its heartbeat
reports it. With nccl a worker joins the broadcast, and builds its group, before it pauses, so the
join and a new group's setup count in `sync_s` but not in `stall_s`.
The trainer holds both versions in memory (on `trainer_device`), as a training loop would, and publishes first
once the worker has served a batch of short groups (`warm_up`), as a training loop publishes after its first
batch. `idle` leaves the worker without requests during the syncs: the transfer alone, with no generation
beside it on the worker's GPU. `workers` > 1 runs that many workers (each busy as the one is): `stall_s` is then the
median over the workers of each sync and `stall_max_s` the slowest worker's, `publish_to_serving_s` until the last
serves; by `redis://` every worker reads the whole version from the one Redis (W x the model's bytes a sync).

`nccl` also reports the broadcast's own figures (`setup_s`; `ready_s`, the wait until every receiver
posted its receives; `broadcast_s`, from then until the last byte landed; `gb_per_s`) and, when both
sides are on GPUs, a bare NCCL broadcast of the same bytes between the same two GPUs in this
process (`bare_gb_per_s`): the ceiling the transport is compared with (`ratio`). The first publish is
reported on its own (`first_stall_s`, `first_setup_s`, ...), the others as medians; JSON out.

`ipc` (colocated handoff) needs the trainer's weights and the worker on the same GPU (`--device cuda:0
--trainer-device cuda:0`); it also reports the GPU memory the trainer holds for the workers (`trainer_held_mib`).
A transport that cannot run with the devices given is not run: its row says why (`skipped`), e.g. nccl with
both sides on one GPU, where NCCL cannot put two ranks.

Real shapes: `--model DIR` measures a real model (a Hugging Face folder, e.g. `rollouts pretrained smollm2`'s), the
trainer holding it and a second version (each weight x 1.01); the sizes in `SHAPES` are real configurations
(`qwen2.5-1.5b`, `qwen2.5-7b`) built here as random Qwen2 models, no download: the worker's folder holds the config, a
tokenizer and a zero-filled checkpoint (a sparse file: the header is real, the data a hole), and the trainer draws its
versions at random on its own device, in the engine's dtype. A trainer on a GPU holds two versions when they take at
most a fifth of its memory, else one, negated in place before each publish (`trainer_copies`: 7B on an 80 GB GPU).
`--one-worker` syncs one worker a size by every transport in turn: one engine start a size, not one a transport.

Deltas (`--deltas`, with `--model`): the trainer's versions are real training steps of the model
(`benchmarks.training_steps.TrainingSteps`, one AdamW step before each publish, not timed), and each transport that
sends deltas (`Transport.sends_deltas`: redis, fs) is measured twice on the same worker, side by side: whole
(`deltas: false`) and with `deltas=True` (its first publish goes whole: no base yet; the medians are of the later
ones). Each row adds `read_bytes` (median: what a worker that holds the version before reads: the delta, or the whole
version) and, for redis, `redis_out_bytes` (median: what Redis sent during the sync, every reply, by `INFO`).

Beside the stall (median and p90 over the rounds after the first): the floor, one device-to-device copy of the
model's bytes at the rate a torch copy of a 1 GiB buffer measures on the trainer's GPU in the same run
(`copy_tb_per_s` counts the bytes read and written, so `floor_s` = 2 x bytes / that rate), `stall_over_floor`, and
`per_tensor_copy_s`, one `copy_` per tensor of the version into tensors of its own (a loader's least cost). And where
the stall went, read from the worker's log (one worker): `pause_s` (the engine's pause), `load_s` (the version loaded
and acked), `resume_s` (the rest: the ack, the manager's resume, the engine's resume), `fetch_s` (before the pause:
a redis:// prefetch). A vLLM worker runs `TimedWorkerExtension`, which splits its load: `engine_open_s` (ipc:// the
handle opened; the others: the blob read into tensors), `engine_reload_s` (vLLM's `reload_weights`: its per-tensor
loaders until the last copy is queued), `engine_wait_s` (the GPU finishing those copies) and `engine_rest_s` (the
rest of `load_s`: the call into vLLM's process and back, the version tag, the prefix cache's reset, the ack).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress
from safetensors.torch import load

from benchmarks.sync_deltas import Variant, read_bytes, variants
from consumers.engines.tiny_model import build_tiny_model
from consumers.engines.vllm_extension import RolloutsWorkerExtension
from pipeline.local import RedisServer, free_port
from pipeline.processes import start_worker, stop_process, wait_for_worker
from pipeline.wire import PauseMode
from producers.client import RolloutClient
from rollouts.engine_spec import EngineSpec
from staleness.weights import open_transport
from staleness.weights.base import opened_handover
from staleness.weights.handover import Handover
from staleness.weights.sources import checkpoint_files, read_checkpoint

NS = "bench-sync"
SIZES = {
    "tiny": (64, 2),
    "small": (256, 4),
    "medium": (512, 8),
    "large": (1024, 8),
    "xl": (2048, 16),
    "7b": (4096, 44),
}
"""name -> (hidden size, layers) of the random Qwen2 models compared. `7b`: 7.4 B parameters (an MLP of twice the hidden
size, a tiny vocabulary), 13.8 GiB in bf16: the size issue 45 names for NCCL into vLLM."""


@dataclass(frozen=True)
class Qwen2Shape:
    """A Qwen2 configuration's shapes: what a random model of a real model's size is built from."""

    hidden_size: int
    num_layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    vocab_size: int
    tied: bool
    """`tie_word_embeddings`: no `lm_head.weight` of its own."""
    max_position_embeddings: int = 32768


SHAPES = {
    "qwen2-tiny": Qwen2Shape(64, 2, 2, 1, 160, 1024, tied=True),
    "smollm2-135m": Qwen2Shape(576, 30, 9, 3, 1536, 49152, tied=True),
    "qwen2.5-1.5b": Qwen2Shape(1536, 28, 12, 2, 8960, 151936, tied=True),
    "qwen2.5-7b": Qwen2Shape(3584, 28, 28, 4, 18944, 152064, tied=False),
}
"""Real configurations, built as random Qwen2 models (`build_shaped_model`): Qwen2.5-1.5B's (1.54 B parameters, 2.9 GiB
in bf16) and Qwen2.5-7B's (7.62 B, 14.2 GiB); `smollm2-135m`, SmolLM2-135M's shapes (a Llama; as Qwen2 it has q/k/v
biases besides: 134.5 M parameters, 257 MiB), where the real model cannot travel; `qwen2-tiny` has their features
(grouped KV heads, biases, tied embeddings) at a size for tests."""

TRANSPORTS = ("redis", "fs", "nccl", "ipc")
COPY_BYTES = 2**30
"""The buffer of the device-to-device copy whose rate sets the floor."""
TWO_COPIES_SHARE = 0.2
"""A trainer on a GPU holds two versions when both take at most this share of its memory, else one."""
TIMED_EXTENSION = "benchmarks.bench_sync.TimedWorkerExtension"


def size_names() -> list[str]:
    return [*SIZES, *SHAPES]


def run_bench_sync(
    console: Console,
    spec: EngineSpec,
    sizes: list[str],
    transports: list[str],
    rounds: int,
    mode: PauseMode,
    trainer_device: str = "cpu",
    logs: Path | None = None,
    idle: bool = False,
    workers: int = 1,
    model: Path | None = None,
    one_worker: bool = False,
    deltas: bool = False,
) -> dict[str, Any]:
    """`model`: a real model's folder, measured before `sizes` (its row's size is its name); `deltas`: its versions
    from real training steps, and each transport that sends deltas measured whole and with them."""
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-sync-"))
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    if spec.kind == "vllm":  # the lab's subclass of the engine's extension: it times the load in vLLM's process
        spec.engine_args.setdefault("worker_extension_cls", TIMED_EXTENSION)
    results: list[dict[str, Any]] = []
    copy = gpu_copy_rate(trainer_device) if _gpu(trainer_device) is not None else None
    dtype = getattr(torch, spec.dtype)  # the trainer publishes in the engine's dtype (bf16: half the bytes)
    measured: list[tuple[str, Path | None]] = [(model_name(model), model)] if model is not None else []
    measured += [(size, None) for size in sizes]
    stopped = False  # a SIGTERM or Ctrl-C ends the run, and the report keeps what ran (`INTERRUPTED`)
    try:
        with Progress(console=console) as progress:
            task = progress.add_task("publish rounds", total=len(measured) * len(transports) * rounds)
            for size, folder in measured:
                if stopped:
                    results += [{"size": size, "transport": t, "skipped": "not run: interrupted"} for t in transports]
                    continue
                folder, versions, first = _sources(tmp, size, folder, dtype, trainer_device, deltas)
                params = _parameters(folder)
                nbytes = params * torch.empty(0, dtype=dtype).element_size()
                base = {"size": size, "parameters": params, "bytes": nbytes, "trainer_copies": versions.copies}
                floor = _floor(first, nbytes, copy)
                runnable: list[Variant] = []
                for transport in transports:
                    if reason := cannot_run(transport, spec, trainer_device):
                        results.append(base | {"transport": transport, "skipped": reason})
                        progress.advance(task, rounds)
                    else:
                        runnable += variants(transport, _uri(transport, tmp / size), deltas)
                groups = [runnable] if one_worker and runnable else _by_transport(runnable)
                for group in groups:
                    if stopped:
                        results += [base | {"transport": v.transport, "skipped": "not run: interrupted"} for v in group]
                        continue
                    name = size if one_worker else f"{size}-{group[0].transport}"
                    log = (logs or tmp) / f"{name}.log"
                    rows = _measure(spec, folder, versions, group, rounds, mode, log, progress, task, idle, workers)
                    for (transport, *_), row in zip(group, rows, strict=True):
                        if transport == "nccl" and _both_on_gpus(spec, trainer_device) and "gb_per_s" in row:
                            receivers = [str(gpu) for gpu in worker_gpus(spec.device)]
                            bare = bare_broadcast_gb_per_s(nbytes, trainer_device, receivers)
                            row |= {"bare_gb_per_s": round(bare, 2), "ratio": round(row["gb_per_s"] / bare, 3)}
                        results.append(base | {"transport": transport} | row | _beside_floor(row, floor))
                        stopped = stopped or row.get("error") == INTERRUPTED
                del versions, first
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "engine": spec.kind,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "device": spec.device,
        "trainer_device": trainer_device,
        "dtype": spec.dtype,
        "mode": mode,
        "rounds": rounds,
        "workers": workers,
        "one_worker": one_worker,
        "deltas": deltas,
        "vllm_extension": spec.engine_args.get("worker_extension_cls") if spec.kind == "vllm" else None,
        "gpu": torch.cuda.get_device_name(_gpu(trainer_device)) if _gpu(trainer_device) is not None else None,
        "copy_tb_per_s": None if copy is None else round(copy / 1e12, 3),
        "results": results,
    }


def model_name(folder: Path) -> str:
    """A real model's name in the report: its title where `rollouts pretrained` built it, else the folder's name."""
    try:
        return str(json.loads((folder / "rollouts-model.json").read_text())["title"])
    except (OSError, ValueError, KeyError):
        return folder.name


def _uri(transport: str, where: Path) -> str:
    return {
        "redis": "redis://",
        "fs": f"fs://{where / 'published'}",
        "nccl": f"nccl://127.0.0.1:{free_port()}",
        "ipc": "ipc://",
    }[transport]


def _both_on_gpus(spec: EngineSpec, trainer_device: str) -> bool:
    return trainer_device.startswith("cuda") and spec.device.startswith("cuda")


def _by_transport(runnable: list[Variant]) -> list[list[Variant]]:
    """One worker a transport: its whole and delta variants on the same one, side by side."""
    groups: dict[str, list[Variant]] = {}
    for variant in runnable:
        groups.setdefault(variant.transport, []).append(variant)
    return list(groups.values())


class _Versions:
    """What each publish sends (`next(publish)`): the trainer's versions in turn, or a real training step's."""

    def __init__(self, weights: list[dict[str, torch.Tensor]] | None = None, steps: Any = None) -> None:
        self.weights, self.steps = weights or [], steps
        self.copies = len(self.weights) if steps is None else 1

    def next(self, publish: int) -> Any:
        if self.steps is None:
            return _next_version(self.weights, publish)
        self.steps.step()
        return self.steps.model


def _sources(
    tmp: Path, size: str, folder: Path | None, dtype: torch.dtype, trainer_device: str, deltas: bool
) -> tuple[Path, _Versions, dict[str, torch.Tensor]]:
    """The worker's model folder, the trainer's versions, and the first's tensors (for the floor)."""
    if deltas and folder is not None:  # real training steps of the real model
        from benchmarks.training_steps import TrainingSteps

        steps = TrainingSteps(folder, dtype, trainer_device)
        return folder, _Versions(steps=steps), dict(steps.model.state_dict())
    folder, weights = _versions(tmp, size, folder, dtype, trainer_device)
    return folder, _Versions(weights), weights[0]


def _versions(
    tmp: Path, size: str, folder: Path | None, dtype: torch.dtype, trainer_device: str
) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """The worker's model folder and the trainer's versions (two, or one where two would not fit: `copies`)."""
    if folder is not None:  # a real model: its weights, and a second version of each weight x 1.01
        first = {k: t.to(trainer_device, dtype) for k, t in read_checkpoint(folder).items()}
        if copies(_bytes_of(first), trainer_device) == 1:
            return folder, [first]
        return folder, [first, {k: (t.float() * 1.01).to(dtype) for k, t in first.items()}]
    if size in SHAPES:
        folder = build_shaped_model(tmp / size, SHAPES[size])
        shapes = shaped_tensors(SHAPES[size])
        nbytes = sum(math.prod(shape) for _, shape in shapes) * torch.empty(0, dtype=dtype).element_size()
        seeds = range(copies(nbytes, trainer_device))
        return folder, [random_version(shapes, dtype, trainer_device, seed) for seed in seeds]
    hidden, layers = SIZES[size]
    models = [build_tiny_model(tmp / size / f"seed{s}", seed=s, hidden_size=hidden, num_layers=layers) for s in (0, 1)]
    weights = [{k: t.to(trainer_device, dtype) for k, t in read_checkpoint(models[0]).items()}]
    if copies(_bytes_of(weights[0]), trainer_device) == 2:
        weights.append({k: t.to(trainer_device, dtype) for k, t in read_checkpoint(models[1]).items()})
    return models[0], weights


def copies(nbytes: int, trainer_device: str) -> int:
    """How many versions the trainer holds: two, unless they would take more than `TWO_COPIES_SHARE` of its GPU."""
    gpu = _gpu(trainer_device)
    if gpu is None:
        return 2
    return 2 if 2 * nbytes <= TWO_COPIES_SHARE * torch.cuda.get_device_properties(gpu).total_memory else 1


def _bytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def _next_version(weights: list[dict[str, torch.Tensor]], publish: int) -> dict[str, torch.Tensor]:
    """What publish number `publish` (0, 1, ...) sends: the two versions in turn, never the one the worker has; with one
    version held, that one negated in place first (each publish then differs from the last)."""
    if len(weights) == 1:
        torch._foreach_neg_(list(weights[0].values()))
        return weights[0]
    return weights[(publish + 1) % 2]


def shaped_tensors(shape: Qwen2Shape) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors of a Qwen2 model of `shape`, in order: transformers' own, built on the meta device (no
    memory), a tied `lm_head` left out as a checkpoint leaves it out."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(_qwen2_config(shape))
    return [(name, tuple(param.shape)) for name, param in model.named_parameters()]


def _qwen2_config(shape: Qwen2Shape, ids: tuple[int, int, int] = (0, 1, 2)) -> Any:
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=shape.tied,
        use_sliding_window=False,
        pad_token_id=ids[0],
        bos_token_id=ids[1],
        eos_token_id=ids[2],
    )
    config.architectures = ["Qwen2ForCausalLM"]
    config.dtype = torch.bfloat16
    return config


def build_shaped_model(out_dir: Path, shape: Qwen2Shape) -> Path:
    """A Qwen2 model folder of `shape` that any engine loads: config, the tiny model's tokenizer (its ids fit any
    vocabulary) and `model.safetensors` in bf16 with every weight zero, written as a sparse file (a real header, the
    data a hole): a 7B folder costs no disk and no time. The trainer's versions are drawn elsewhere
    (`random_version`); a worker generates uniformly random tokens until the first sync."""
    from consumers.engines.tiny_model import BOS, EOS, PAD, _add_legacy_keys, build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = cast(list[int], tokenizer.convert_tokens_to_ids([PAD, BOS, EOS]))
    config = _qwen2_config(shape, (ids[0], ids[1], ids[2]))
    config.save_pretrained(out_dir)
    _add_legacy_keys(out_dir / "config.json")
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids[1], "eos_token_id": ids[2], "pad_token_id": ids[0]}) + "\n"
    )
    tokenizer.save_pretrained(out_dir)
    write_sparse_safetensors(out_dir / "model.safetensors", shaped_tensors(shape), "BF16", 2)
    return out_dir


def write_sparse_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: str, itemsize: int) -> None:
    """A safetensors file of zeros: the header written, the data left a hole (read back as zeros)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = math.prod(shape) * itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)


def random_version(
    shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, device: str, seed: int
) -> dict[str, torch.Tensor]:
    """A version of a model of these tensors drawn on `device` in `dtype`: weights N(0, 0.02), norms one."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            tensors[name] = torch.randn(shape, generator=generator, dtype=dtype, device=device).mul_(0.02)
    return tensors


# -- the floor ---------------------------------------------------------------------------------


def gpu_copy_rate(device: str, nbytes: int = COPY_BYTES, repeats: int = 20) -> float:
    """Bytes read and written per second by a device-to-device `copy_` of an `nbytes` buffer on `device` (after two
    warm-up copies; CUDA events around `repeats` copies)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def per_tensor_copy_s(tensors: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Seconds of one `copy_` per tensor into tensors of its own on the same GPU (median of `repeats`): the least a
    loader that takes a version tensor by tensor costs there."""
    targets = [torch.empty_like(t) for t in tensors.values()]
    seconds = []
    for _ in range(repeats + 1):  # the first allocates nothing new but warms the copy kernels
        torch.cuda.synchronize()
        began = time.perf_counter()
        for target, tensor in zip(targets, tensors.values(), strict=True):
            target.copy_(tensor)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    del targets
    torch.cuda.empty_cache()
    return statistics.median(seconds[1:])


def _floor(tensors: dict[str, torch.Tensor], nbytes: int, copy: float | None) -> dict[str, float]:
    """The floor of a sync of these tensors on their GPU (none off a GPU, or without a measured rate)."""
    first = next(iter(tensors.values()), None)
    if copy is None or first is None or first.device.type != "cuda":
        return {}
    return {"floor_s": round(2 * nbytes / copy, 6), "per_tensor_copy_s": round(per_tensor_copy_s(tensors), 6)}


def _beside_floor(row: dict[str, Any], floor: dict[str, float]) -> dict[str, Any]:
    if not floor or "stall_s" not in row:
        return floor
    return floor | {"stall_over_floor": round(row["stall_s"] / floor["floor_s"], 1)}


# -- the lab's worker extension -----------------------------------------------------------------


class TimedWorkerExtension(RolloutsWorkerExtension):
    """The engine's vLLM worker extension with its loads timed, each line on stderr (the worker's log) for
    `read_breakdown`: what was opened or read, vLLM's `reload_weights` until it returns, the wait for the GPU. The
    bodies are `RolloutsWorkerExtension`'s with the clocks between their steps (a test keeps the two in step)."""

    def rollouts_load_handover(self, handover: dict[str, Any]) -> int:
        prepared: Future[Any] | None = getattr(self, "_rollouts_prepared", None)
        self._rollouts_prepared = None
        if prepared is not None:
            prepared.result()
        began = time.perf_counter()
        given = Handover.from_dict(handover)
        with opened_handover(given, self.rank, self.device) as opened:
            tensors = dict(opened)  # a broadcast is drained (every rank must), a buffer viewed
            was_open = time.perf_counter()
            try:
                self.rollouts_reload(iter(tensors.items()))
                reloaded = time.perf_counter()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                waited = time.perf_counter() - reloaded
                _say_load(given.scheme, given.version, was_open - began, reloaded - was_open, waited, tensors)
                return len(tensors)
            finally:
                tensors.clear()

    def rollouts_load_safetensors(self, blob: bytes) -> int:
        began = time.perf_counter()
        tensors = load(blob)
        was_open = time.perf_counter()
        self.rollouts_reload(iter(tensors.items()))
        reloaded = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        _say_load("blob", -1, was_open - began, reloaded - was_open, time.perf_counter() - reloaded, tensors)
        return len(tensors)


class TimedLayerwiseExtension(TimedWorkerExtension):
    """`TimedWorkerExtension` held to vLLM's layerwise `reload_weights`, the load every version took before the
    engine's direct one: `--engine-args '{"worker_extension_cls": "benchmarks.bench_sync.TimedLayerwiseExtension"}'`
    measures the two side by side."""

    _rollouts_layerwise = "held to it by bench-sync (TimedLayerwiseExtension)"


def _say_load(kind: str, version: int, open_s: float, reload_s: float, wait_s: float, tensors: dict[str, Any]) -> None:
    print(
        f"bench-sync engine load: {kind} version {version} open_s {open_s:.6f} reload_s {reload_s:.6f} "
        f"wait_s {wait_s:.6f} tensors {len(tensors)}",
        file=sys.stderr,
        flush=True,
    )


SYNC_LINE = re.compile(
    r"sync (\d+): fetched or joined in ([\d.]+) s, paused in ([\d.]+) s, version (\d+) loaded and acked in ([\d.]+) s"
)
ENGINE_LINE = re.compile(r"bench-sync engine load: (\w+) version (-?\d+) open_s ([\d.]+) reload_s ([\d.]+) "
                         r"wait_s ([\d.]+) tensors (\d+)")  # fmt: skip


def read_breakdown(log: Path) -> dict[int, dict[str, float]]:
    """Per version the worker synced to: its log's timings of that sync (`fetch_s`, `pause_s`, `load_s`) and, from a
    vLLM worker running `TimedWorkerExtension`, its load's (`engine_open_s`, `engine_reload_s`, `engine_wait_s`). The
    extension's lines are matched to the syncs in order (one load a sync)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    syncs = [m.groups() for m in SYNC_LINE.finditer(text)]
    loads = [m.groups() for m in ENGINE_LINE.finditer(text)]
    found: dict[int, dict[str, float]] = {}
    for i, (_, fetch, pause, version, load_s) in enumerate(syncs):
        timing = {"fetch_s": float(fetch), "pause_s": float(pause), "load_s": float(load_s)}
        if len(loads) == len(syncs):
            _, _, open_s, reload_s, wait_s, _ = loads[i]
            timing |= {
                "engine_open_s": float(open_s),
                "engine_reload_s": float(reload_s),
                "engine_wait_s": float(wait_s),
            }
            timing["engine_rest_s"] = timing["load_s"] - sum(float(v) for v in (open_s, reload_s, wait_s))
        found[int(version)] = timing
    return found


def breakdown_rounds(
    stalls: list[float], versions: list[int], found: dict[int, dict[str, float]]
) -> dict[str, list[float]]:
    """The breakdown's lists over the rounds (versions `versions`, stalls `stalls`), with `resume_s`: the stall less
    its pause and load. Empty when a round's sync is not in the log."""
    if not versions or any(v not in found for v in versions):
        return {}
    rounds: dict[str, list[float]] = {}
    for stall, version in zip(stalls, versions, strict=True):
        timing = found[version] | {"resume_s": stall - found[version]["pause_s"] - found[version]["load_s"]}
        for name, value in timing.items():
            rounds.setdefault(name, []).append(value)
    return rounds


def cannot_run(transport: str, spec: EngineSpec, trainer_device: str) -> str | None:
    """Why `transport` cannot run between a trainer on `trainer_device` and this worker (None: it can)."""
    trainer, workers = _gpu(trainer_device), worker_gpus(spec.device)
    worker = workers[0] if workers else None
    if transport == "nccl" and trainer is not None and trainer in workers:
        return (
            f"the trainer and the worker are both on {trainer}, and NCCL cannot put two ranks on one GPU "
            "(use two GPUs, or ipc:// on one)"
        )
    if transport == "ipc" and (
        trainer is None or trainer != worker or len(workers) != 1 or spec.kind not in IPC_ENGINES
    ):
        return (
            "ipc:// needs the trainer's weights and a torch or vllm worker on the same one GPU; here: trainer on "
            f"{trainer_device}, {spec.kind} worker on {spec.device}"
        )
    return None


IPC_ENGINES = ("torch", "vllm")
"""The engines that open an ipc:// version: torch in the worker's process, vLLM in its worker process (one GPU)."""


def _gpu(device: str) -> torch.device | None:
    """A CUDA device with its index (`cuda` is `cuda:0` here), or None for any other device."""
    parsed = torch.device(device)
    return torch.device("cuda", parsed.index or 0) if parsed.type == "cuda" else None


def worker_gpus(device: str) -> list[torch.device]:
    """The worker's CUDA devices: `cuda:1,2` (a vLLM worker of tensor parallel 2) is two; none for the CPU."""
    kind, _, indices = device.partition(":")
    if kind != "cuda" or "," not in indices:
        gpu = _gpu(device)
        return [gpu] if gpu is not None else []
    return [torch.device("cuda", int(i)) for i in indices.split(",")]


def _measure(
    spec: EngineSpec,
    model: Path,
    versions: _Versions,
    transports: list[Variant],
    rounds: int,
    mode: PauseMode,
    log: Path,
    progress: Progress,
    task: Any,
    idle: bool = False,
    workers: int = 1,
) -> list[dict[str, Any]]:
    """Start the workers on `model`, keep them busy, and publish `rounds` versions by each of `transports` (each
    whole or with deltas) in turn; one row per variant. A failure (a worker that exits, a sync that fails) ends the
    measurement: the row says why (`error`), with what its rounds so far measured, and those after it did not run."""
    from benchmarks.bench_rl import load_trainer  # the reference trainer's `gpu_of`: vLLM takes the first GPU it sees

    rows: list[dict[str, Any]] = []
    with RedisServer() as server:
        url = server.url
        gpus = (load_trainer().gpu_of(spec.device) or {}) if spec.kind == "vllm" else {}
        env = {"COLUMNS": "250"} | gpus  # the worker's log lines unwrapped, for `read_breakdown`
        names = ["bench-sync-worker"] if workers == 1 else [f"bench-sync-worker-{i}" for i in range(workers)]
        logs = [log] if workers == 1 else [log.with_name(f"{log.stem}-{i}{log.suffix}") for i in range(workers)]
        started_workers: list[Any] = []
        published = 0
        try:
            for name, worker_log in zip(names, logs, strict=True):
                started_workers.append(
                    start_worker(url, NS, model, name, *spec.worker_args(), log_file=worker_log, env=env)
                )
            client = RolloutClient(url, NS)
            for name, worker in zip(names, started_workers, strict=True):
                wait_for_worker(client.streams.redis, NS, name, worker, timeout_s=600)
            warm_up(client, groups=64 * workers)
            for i in range(0 if idle else 64 * workers):  # keep the workers busy: a sync interrupts real generation
                client.submit(tokens=[5 + i % 100, 6, 7, 8], n=2, max_tokens=400, seed=i)
            heartbeats = [client.streams.keys.worker(name) for name in names]
            for transport, uri, deltas in transports:
                run = _Rounds(workers, deltas)
                try:
                    for _ in range(rounds):
                        run.publish(client, versions.next(published), uri, mode, heartbeats, started_workers, logs)
                        published += 1
                        progress.advance(task)
                    rows.append(run.row(_held(transport)))
                except (Exception, KeyboardInterrupt) as exc:  # the row says why; what ran so far stays in it
                    rows.append(run.row({}) | {"error": why(exc)})
                    break
            _forget_exports(client, [uri for _, uri, _ in transports])
        except (Exception, KeyboardInterrupt) as exc:  # starting the workers, or after the rounds: a row says why
            if not rows or "error" not in rows[-1]:
                rows[-1:] = [(rows[-1:] or [{}])[0] | {"error": why(exc)}]
        finally:
            for worker in started_workers:
                stop_process(worker)
    failed = next((str(row["error"]) for row in rows if "error" in row), "")
    rows += [{"skipped": f"not run: the worker failed before ({failed})"} for _ in transports[len(rows) :]]
    if workers == 1:  # where the stall went, from the worker's log (complete once it stopped)
        found = read_breakdown(log)
        for row in rows:
            if rounds_of := breakdown_rounds(row.pop("_stalls", []), row.pop("_versions", []), found):
                row |= summarize(rounds_of, keep=())
    for row in rows:
        row.pop("_stalls", None)
        row.pop("_versions", None)
    return rows


INTERRUPTED = "interrupted (SIGTERM or Ctrl-C): the rounds before are kept"


def why(exc: BaseException) -> str:
    """A failure as a row's `error`."""
    return INTERRUPTED if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"


class _Rounds:
    """One transport's publishes and what each measured."""

    def __init__(self, workers: int, deltas: bool | None = None) -> None:
        self.workers = workers
        self.deltas = deltas
        """None: not asked (no `--deltas`); else whether this variant publishes with deltas."""
        self.bytes: dict[str, list[float]] = {"read_bytes": [], "redis_out_bytes": []}
        self.timings: dict[str, list[float]] = {
            "publish_s": [],
            "sync_s": [],
            "publish_to_serving_s": [],
            "stall_s": [],
        }
        if workers > 1:
            self.timings["stall_max_s"] = []
        self.broadcasts: dict[str, list[float]] = {
            "join_s": [],
            "setup_s": [],
            "ready_s": [],
            "broadcast_s": [],
            "gb_per_s": [],
        }
        self.versions: list[int] = []

    def publish(
        self,
        client: RolloutClient,
        tensors: Any,
        transport: str,
        mode: PauseMode,
        heartbeats: list[str],
        started_workers: list[Any],
        logs: list[Path],
    ) -> None:
        sent_before = client.streams.redis.info("stats")["total_net_output_bytes"]
        started = time.perf_counter()
        version = client.publish_weights(tensors, transport=transport, mode=mode, deltas=bool(self.deltas))
        published = time.perf_counter()
        stalls: dict[int, float] = {}
        while len(stalls) < self.workers:  # every worker serving the new version, each with its own stall
            for index, heartbeat in enumerate(heartbeats):
                if index in stalls:
                    continue
                status, served, stall = client.streams.redis.hmget(heartbeat, "status", "version", "stall_s")
                if (status, served) == (b"serving", str(version).encode()):
                    stalls[index] = float(stall or 0.0)
                elif started_workers[index].poll() is not None:
                    code = started_workers[index].returncode
                    raise RuntimeError(f"a worker exited with code {code}; its log: {logs[index]}")
            time.sleep(0.001)
        resumed = time.perf_counter()
        if self.deltas is not None:
            self.bytes["read_bytes"].append(read_bytes(client.last_publish))
            if transport.startswith("redis://"):
                sent = client.streams.redis.info("stats")["total_net_output_bytes"] - sent_before
                self.bytes["redis_out_bytes"].append(sent)
        sync_s = client.last_sync.stall_s if client.last_sync else 0.0
        self.versions.append(version)
        self.timings["sync_s"].append(sync_s)
        self.timings["publish_s"].append(published - started - sync_s)
        self.timings["publish_to_serving_s"].append(resumed - started)
        self.timings["stall_s"].append(statistics.median(stalls.values()))
        if self.workers > 1:
            self.timings["stall_max_s"].append(max(stalls.values()))
        if transport.startswith("nccl://") and client.last_broadcast is not None:
            stats = client.last_broadcast
            self.broadcasts["join_s"].append(stats.join_s)
            self.broadcasts["setup_s"].append(stats.setup_s)
            self.broadcasts["ready_s"].append(stats.ready_s)
            self.broadcasts["broadcast_s"].append(stats.transfer_s)
            self.broadcasts["gb_per_s"].append(stats.gb_per_s)

    def row(self, held: dict[str, Any]) -> dict[str, Any]:
        summary = summarize(self.timings | self.broadcasts | self.bytes) if self.timings["stall_s"] else {}
        asked = {} if self.deltas is None else {"deltas": self.deltas}
        return asked | summary | held | {"_stalls": self.timings["stall_s"], "_versions": self.versions}


def warm_up(client: RolloutClient, groups: int = 64, timeout_s: float = 600.0) -> None:
    """Have the worker generate `groups` short groups (batched as the measured work is) and take them, before the
    first publish: a training loop publishes after training on rollouts, so its first sync never meets an engine
    still in its first steps (CUDA kernels and their plans chosen on first use), and neither should the bench's."""
    for i in range(groups):
        client.submit(tokens=[5 + i % 100, 6, 7, 8], n=2, max_tokens=16, seed=10_000 + i)
    client.collect(groups, timeout=timeout_s)


def _held(transport: str) -> dict[str, Any]:
    """For ipc: how much GPU memory the trainer holds for the workers now (its last two versions' buffers)."""
    if transport != "ipc":
        return {}
    from benchmarks.transport_state import held_bytes

    return {"trainer_held_mib": round(held_bytes() / 2**20, 1)}


def _forget_exports(client: RolloutClient, uris: list[str]) -> None:
    """Free what ipc:// holds for the workers (the next run starts at v1 again)."""
    for uri in uris:
        if uri.startswith("ipc://"):
            exports = open_transport(uri, redis_client=client.streams.redis, ns=NS)
            for version in exports.versions():
                exports.remove(version)


def summarize(
    rounds: dict[str, list[float]], keep: Iterable[str] = ("stall_s", "publish_to_serving_s", "setup_s")
) -> dict[str, Any]:
    """The first sync on its own (`first_*`: it may build what later ones keep), medians of the later ones, the stall's
    p90 over them, and every round's values of `keep`."""
    later = {name: values[1:] or values for name, values in rounds.items() if values}
    summary: dict[str, Any] = {name: round(statistics.median(values), 4) for name, values in later.items()}
    if "stall_s" in later:
        summary["stall_p90_s"] = round(p90(later["stall_s"]), 4)
    summary |= {f"first_{name}": round(values[0], 4) for name, values in rounds.items() if values}
    for name in keep:
        if rounds.get(name):
            summary[f"{name}_rounds"] = [round(v, 4) for v in rounds[name]]
    return summary


def p90(values: list[float]) -> float:
    """The 90th percentile (linear between the order statistics; one value: itself)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def bare_broadcast_gb_per_s(nbytes: int, source: str, targets: list[str], repeats: int = 5) -> float:
    """GB/s of one plain NCCL broadcast of `nbytes` from GPU `source` to the GPUs `targets` (median of `repeats`).

    One thread of this process per GPU, one process group each: the ceiling for the nccl transport, with no
    rendezvous, bucketing or loading.
    """
    ranks = [source, *targets]
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
    seconds: list[float] = []

    def rank(index: int, device: str) -> None:
        torch.cuda.set_device(device)
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
        # torch's stubs type the backend as a Backend, not a ProcessGroup; Options() is the 3-argument default
        options = dist.ProcessGroupNCCL.Options()
        prefixed = dist.PrefixStore("bare/", client)
        group = cast(dist.ProcessGroup, dist.ProcessGroupNCCL(prefixed, index, len(ranks), options))
        buffer = torch.ones(nbytes, dtype=torch.uint8, device=device)
        for _ in range(repeats + 1):  # the first builds the communicator
            group.broadcast([buffer], dist.BroadcastOptions()).wait()
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            group.broadcast([buffer], dist.BroadcastOptions()).wait()
            torch.cuda.synchronize(device)
            if index == 0:
                seconds.append(time.perf_counter() - started)
        group.shutdown()

    threads = [threading.Thread(target=rank, args=(i, d)) for i, d in enumerate(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    del store
    return nbytes / statistics.median(seconds) / 1e9


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    count = 0
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as handle:
            count += sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())  # noqa: SIM118
    return count


def plot_bench_sync(result: dict[str, Any], path: Path) -> None:
    """Stall per model size, one line per transport (the transports that ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    measured = [row for row in result["results"] if "skipped" not in row]

    def line(row: dict[str, Any]) -> str:
        return row["transport"] + (" (deltas)" if row.get("deltas") else "")

    for name in sorted({line(row) for row in measured}):
        rows = [row for row in measured if line(row) == name]
        ax.plot([row["bytes"] / 2**20 for row in rows], [row["stall_s"] for row in rows], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"weights (MiB, {result.get('dtype', 'float32')})")
    ax.set_ylabel("stall (s, median)")
    ax.set_title(f"{result['engine']} worker: how long it stood still in a sync ({result['mode']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

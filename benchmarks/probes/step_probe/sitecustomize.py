"""A probe for `benchmarks/probes/bench_ab.py`, `rounds.py` and `paired.py`: times every engine step in each process.

Put this folder on `PYTHONPATH` and `STEP_PROBE=DIR` in the environment. Nothing happens without `STEP_PROBE`.
A measuring tool, not part of the product.

- **torch**: every process that imports `consumers.engines.torch_engine` wraps `TorchEngine._step` and writes
  `DIR/PID.json` at exit (`argv`, and `[wall_s, cpu_s, admitted]` per step). The direct side of `rollouts bench`
  and its worker process both get it, so their engines' steps can be compared: the same steps taking more wall
  time in the worker, for the same CPU time, is time the engine thread stood off the CPU (the GIL, or the
  runqueue).
- **vLLM**: every process that imports `vllm.v1.engine.core` (the `EngineCore` of each side) wraps
  `EngineCore.step` and appends to `DIR/PID.jsonl`: a first line naming the process's parent (the bench for
  the direct side, the worker for the pipeline's), then `[start, wall_s, cpu_s, new_requests, tokens]` for each
  step that ran the model. Lines, not a dump at exit: vLLM's processes are killed, not exited.
- **the bench's rounds**: `rollouts bench` appends `["direct"|"pipeline", start, end, offset]` for each round to
  `DIR/bench-rounds.jsonl`, on the same clock as the steps (`perf_counter`, the system's monotonic clock; `offset`
  turns it into wall time), so that `rounds.py` can tell the time before an engine's first step from the time after
  its last. The trainer's client adds `["take", wall time, finished]` for each read that made groups whole
  (`finished`: the latest of their samples' `timing["finished"]`, when the worker had each sample), which splits
  the time after the last step into the worker's part and the delivery's.

- **requests, for `paired.py`**: every request of an engine that `create_engine` made, both sides' (`["request",
  side, called, returned]`), the trainer's `submit_prompts` returning (`["submitted", t]`) and each read of work by
  the worker that brought some (`["read", t, entries]`), all on `perf_counter`, in the same file.
- **the pipeline's tail, for `paired.py`**: each batch the worker's publisher sends (`["publish", called, returned,
  prompts]`), each read of rollouts that brought some, in whichever process reads them (`["rread", called, returned,
  entries]`), and every garbage collection over 0.2 ms in a process that runs our code (`["gc", pid, generation,
  start, seconds]`), all on `perf_counter` (the host's monotonic clock: the same in every process).

`after_import` is also what `benchmarks/device/vllm026/sitecustomize.py` patches vLLM 0.26 with.
"""

from __future__ import annotations

import atexit
import importlib.abc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_PATCHES: dict[str, list[Callable[[ModuleType], None]]] = {}


def after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call `patch(module)` once module `name` has run (at once if it already has)."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        _PATCHES.setdefault(name, []).append(patch)


class _Patcher(importlib.abc.MetaPathFinder):
    """Finds the modules in `_PATCHES` through the other finders, and patches each once it has run."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module: ModuleType, run: Callable[[ModuleType], None] = run) -> None:
                    run(module)
                    for patch in _PATCHES.pop(module.__name__, []):
                        patch(module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # the hook: patch once it has run
                return spec
        return None


sys.meta_path.insert(0, _Patcher())


def _probe_torch(torch_engine: ModuleType) -> None:
    steps: list[tuple[float, float, int]] = []
    step = torch_engine.TorchEngine._step

    def timed_step(self: Any, admitted: list[Any]) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            step(self, admitted)
        finally:
            steps.append((time.perf_counter() - wall, time.thread_time() - cpu, len(admitted)))

    def dump() -> None:
        with open(os.path.join(os.environ["STEP_PROBE"], f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv, "steps": steps}, f)

    torch_engine.TorchEngine._step = timed_step
    atexit.register(dump)


def _parent_cmdline() -> str:
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()


def _probe_vllm(core: ModuleType) -> None:
    step = core.EngineCore.step
    out: list[Any] = []  # the file, opened in the engine's own process at its first step
    scheduled: list[Any] = []  # what the scheduler gave the step under way

    def watch(engine: Any) -> None:
        """At the first step: open the file, and keep what each `schedule()` returns (one engine a process)."""
        out.append(open(os.path.join(os.environ["STEP_PROBE"], f"{os.getpid()}.jsonl"), "a", buffering=1))  # noqa: SIM115 (open for the process)
        out[0].write(json.dumps({"parent": _parent_cmdline()}) + "\n")
        schedule = engine.scheduler.schedule

        def seen(*args: Any, **kwargs: Any) -> Any:
            scheduled.append(schedule(*args, **kwargs))
            return scheduled[-1]

        engine.scheduler.schedule = seen

    def timed_step(self: Any) -> Any:
        if not out:
            watch(self)
        scheduled.clear()
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return step(self)
        finally:
            if scheduled and scheduled[0].total_num_scheduled_tokens:
                wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
                new, tokens = len(scheduled[0].scheduled_new_reqs), scheduled[0].total_num_scheduled_tokens
                out[0].write(json.dumps([round(start, 6), round(wall, 6), round(cpu, 6), new, tokens]) + "\n")

    core.EngineCore.step = timed_step


_bench_lines: list[Any] = []  # the bench's file, opened at its first line


def _bench_line(record: list[Any]) -> None:
    if not _bench_lines:
        path = os.path.join(os.environ["STEP_PROBE"], "bench-rounds.jsonl")
        _bench_lines.append(open(path, "a", buffering=1))  # noqa: SIM115 (open for the process)
    _bench_lines[0].write(json.dumps(record) + "\n")


def _probe_bench(bench: ModuleType) -> None:
    """Each round: `[side, start, end, wall clock - perf_counter]`, the last to compare with rollouts' timings."""
    direct_round, pipeline_round = bench._direct_round, bench.pipeline_round

    def record(side: str, start: float) -> None:
        _bench_line([side, round(start, 6), round(time.perf_counter(), 6), time.time() - time.perf_counter()])

    async def timed_direct(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return await direct_round(*args)
        finally:
            record("direct", start)

    def timed_pipeline(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return pipeline_round(*args)
        finally:
            record("pipeline", start)

    bench._direct_round, bench.pipeline_round = timed_direct, timed_pipeline  # type: ignore[attr-defined]  # the probe patches the module


def _probe_client(client: ModuleType) -> None:
    """Each read that made groups whole: `["take", wall time, the latest `finished` of their samples]`."""
    take = client.RolloutClient._take

    def timed_take(self: Any, entries: list[Any]) -> Any:
        groups = take(self, entries)
        if groups:
            finished = max(r.timing.get("finished", 0.0) for g in groups for r in g.rollouts)
            _bench_line(["take", time.time(), finished])
        return groups

    client.RolloutClient._take = timed_take


def _probe_requests(engine: ModuleType) -> None:
    """Each request of an engine that `create_engine` made: `["request", side, called, returned]` (`perf_counter`;
    side `pipeline` for the worker's ids, `prompt@entry:sample`, else `direct`), for `paired.py`."""
    create = engine.create_engine

    def created(*args: Any, **kwargs: Any) -> Any:
        made = create(*args, **kwargs)
        generate = made.generate

        async def timed(request_id: str, *more: Any, **named: Any) -> Any:
            called = time.perf_counter()
            try:
                return await generate(request_id, *more, **named)
            finally:
                side = "pipeline" if "@" in request_id else "direct"
                _bench_line(["request", side, round(called, 6), round(time.perf_counter(), 6)])

        made.generate = timed
        return made

    engine.create_engine = created  # type: ignore[attr-defined]  # the probe patches the module


def _probe_streams(streams: ModuleType) -> None:
    """The worker's reads of work that brought some: `["read", perf_counter, entries]`, for `paired.py`."""
    read_work = streams.WorkReader.read_work

    def timed_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        entries = read_work(self, *args, **kwargs)
        if entries:
            _bench_line(["read", round(time.perf_counter(), 6), len(entries)])
        return entries

    streams.WorkReader.read_work = timed_read


def _probe_submit(client: ModuleType) -> None:
    """The trainer's submits: `["submitted", perf_counter]` once `submit_prompts` returns, for `paired.py`."""
    submit = client.RolloutClient.submit_prompts

    def timed_submit(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return submit(self, *args, **kwargs)
        finally:
            _bench_line(["submitted", round(time.perf_counter(), 6)])

    client.RolloutClient.submit_prompts = timed_submit


def _probe_publisher(publisher: ModuleType) -> None:
    """Each batch the worker publishes: `["publish", called, returned, prompts]` (`perf_counter`)."""
    publish_many = publisher.Publisher._publish_many

    async def timed(self: Any, publishes: list[Any]) -> Any:
        called = time.perf_counter()
        try:
            return await publish_many(self, publishes)
        finally:
            _bench_line(["publish", round(called, 6), round(time.perf_counter(), 6), len(publishes)])

    publisher.Publisher._publish_many = timed


def _probe_rollout_reads(streams: ModuleType) -> None:
    """Each read of rollouts that brought some: `["rread", called, returned, entries]` (`perf_counter`)."""
    read_rollouts = streams.RolloutReader.read_rollouts

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        called = time.perf_counter()
        entries = read_rollouts(self, *args, **kwargs)
        if entries:
            _bench_line(["rread", round(called, 6), round(time.perf_counter(), 6), len(entries)])
        return entries

    streams.RolloutReader.read_rollouts = timed


def _probe_gc(_: ModuleType) -> None:
    """Every garbage collection over 0.2 ms in this process: `["gc", pid, generation, start, seconds]`."""
    import gc

    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            started[0] = now
        elif now - started[0] > 0.0002:
            _bench_line(["gc", os.getpid(), info["generation"], round(started[0], 6), round(now - started[0], 6)])

    gc.callbacks.append(timed)


if os.environ.get("STEP_PROBE"):
    after_import("benchmarks.bench", _probe_bench)
    after_import("pipeline.publisher", _probe_publisher)
    after_import("pipeline.streams", _probe_rollout_reads)
    after_import("pipeline.streams", _probe_gc)  # the processes that run our code, not vLLM's engine cores
    after_import("producers.client", _probe_client)
    after_import("producers.client", _probe_submit)
    after_import("consumers.engines", _probe_requests)
    after_import("pipeline.streams", _probe_streams)
    after_import("consumers.engines.torch_engine", _probe_torch)
    after_import("vllm.v1.engine.core", _probe_vllm)

"""`rollouts bench`: the engine called directly vs the whole pipeline, side by side in one run.

Both sides get the same prompts with the same per-sample seeds, so they generate the
same tokens: the difference is what Redis, the worker loop and the client cost. Rounds
alternate, and so does which side goes first in a round (direct-pipeline, pipeline-direct,
...), so that noise on a shared machine, and whatever one side leaves behind for the next,
hits both; medians are reported.

Around each side of a round, the CPU-seconds of every process involved are read (`cpu_s`, per role: this
process, the direct engine's processes, the worker, the worker's engine processes, Redis): on a machine with no
core to spare, what the pipeline side's own processes spend beyond the direct side's (`pipeline_extra_cpu_s`, see
`own_cpu`) is taken from the engine, and that moves far less from run to run than the wall-clock ratio does.

Each side is timed only after the other has settled (`SETTLE_S`): an idle vLLM engine is not
idle for a while after its last step (its processes poll their shared-memory queue, see
`SETTLE_S`), and two engines share this machine here, one per side.

With `--paired` both sides run at once on one engine (`SharedEngine.paired_round`), half the prompts each, so that
the engine's own round-to-round noise (±20 % a round on vLLM) hits both alike; rounds alternate which side goes
first, and the ratio is the geometric mean of the two kinds' medians (`balanced_ratio`). It measures the time the
pipeline adds to a round, not the CPU it takes from the engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress

from benchmarks.cpu import CpuRoles, descendants
from consumers.engines import create_engine
from consumers.engines.base import Engine
from consumers.engines.tiny_model import build_tiny_model
from consumers.lifecycle import WorkerStatus, freeze_heap
from consumers.worker import Worker, WorkerSettings
from pipeline.connections import connect
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_process, wait_for_worker
from pipeline.streams import Streams
from pipeline.wire import Prompt, Sampling
from producers.client import RolloutClient
from rollouts.engine_spec import EngineSpec

NS = "bench"

SETTLE_S = 1.5
"""Pause before each timed side when the engine is vLLM. vLLM's engine processes keep polling their
shared-memory queue (`sched_yield` in a loop) for 1 s after their last step (`shm_broadcast`, `busy_loop_s`):
without a pause, the side just measured takes 0.15-0.25 CPU-seconds from the next one, on 2 cores."""


def make_prompts(count: int, n: int, max_tokens: int, vocab: int, tag: str) -> list[Prompt]:
    """Random token prompts of 8-32 tokens, seeded per prompt so both sides generate the same samples."""
    rng = random.Random(1234)
    return [
        Prompt(
            id=f"{tag}-{i}",
            n=n,
            tokens=[rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))],
            sampling=Sampling(max_tokens=max_tokens, temperature=1.0, seed=1000 * i),
        )
        for i in range(count)
    ]


Measured = tuple[float, list[list[int]]]
"""One side of a round: its seconds and the tokens of its samples, in prompt order."""


async def _loop_turns(turns: int = 4) -> None:
    """Let what is ready on this event loop run, and what that makes ready, `turns` deep: requests queued as tasks
    (a sample's task, then the engine's own for the request) reach the engine."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def _direct_round(engine: Engine, prompts: list[Prompt]) -> Measured:
    def sampling(p: Prompt, k: int) -> Sampling:
        seed = p.sampling.seed  # the worker's per-sample seed: the prompt's + k (None: unseeded)
        return p.sampling.model_copy(update={"seed": None if seed is None else seed + k})

    started = time.perf_counter()
    generations = await asyncio.gather(
        *(engine.generate(f"{p.id}:{k}", p.tokens, sampling(p, k)) for p in prompts for k in range(p.n))
    )
    return time.perf_counter() - started, [g.tokens.tolist() for g in generations]


class WorkerProcess:
    """The pipeline side as a user runs it: `rollouts worker` in its own process with its own engine, and the
    trainer's client in this process."""

    def __init__(self, url: str, spec: EngineSpec, log_file: Path) -> None:
        self.process = start_worker(url, NS, spec.model, "bench-worker", *spec.worker_args(), log_file=log_file)
        self.client = RolloutClient(url, NS)

    def ready(self, loop: asyncio.AbstractEventLoop) -> None:
        wait_for_worker(self.client.streams.redis, NS, "bench-worker", self.process, timeout_s=300)

    def roles(self, redis_server: int | None) -> CpuRoles:
        """This process (the direct side's engine client, and the trainer's client on the pipeline side), the
        processes it started for its engine (vLLM's), the worker, the worker's children (vLLM's, or
        `--engine-process`), Redis."""
        worker_engine = descendants(self.process.pid)
        redis = [redis_server] if redis_server else []
        return CpuRoles(
            {
                "bench": [os.getpid()],
                "direct_engine": descendants(os.getpid()) - {self.process.pid, *worker_engine, *redis},
                "worker": [self.process.pid],
                "worker_engine": worker_engine,
                "redis": redis,
            }
        )

    def round(self, loop: asyncio.AbstractEventLoop, batch: list[Prompt], tag: str) -> Measured:
        return pipeline_round(self.client, batch)

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        stop_process(self.process)


class SharedEngine:
    """`--one-engine`: the pipeline side's worker runs in this process on the direct side's engine, and the
    trainer's client in a process of its own (`bench_trainer`).

    With two engines, one a side, a difference between the two instances would count as the pipeline's. With one,
    both sides step on the same engine (on a 16-core host its rounds still varied by ±20 %: that noise is the
    engine's own, README *One engine for both sides*). This process is then what `rollouts worker` is (the
    engine's client and the worker's loop), and the trainer is elsewhere, as in a real run. `round` sends the
    trainer the round's tag and shape, from which it makes the same prompts (`make_prompts` is seeded)."""

    def __init__(self, url: str, engine: Engine, shape: dict[str, int], log_file: Path) -> None:
        self.worker = Worker(Streams(connect(url, ns=NS), NS), engine, "bench-worker", WorkerSettings())
        self.task: asyncio.Task[None] | None = None
        self.shape = shape
        self.log_file = log_file
        with log_file.open("ab") as log:
            self.trainer = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.bench_trainer", url],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    def ready(self, loop: asyncio.AbstractEventLoop) -> None:
        self.task = loop.create_task(self.worker.run())
        loop.run_until_complete(self._serving(timeout_s=300))

    async def _serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.worker.state.status is not WorkerStatus.SERVING:
            if self.task is not None and self.task.done():
                raise RuntimeError(f"the bench's worker stopped before serving: {self.worker.failure or 'see its log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the bench's worker did not serve within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    def roles(self, redis_server: int | None) -> CpuRoles:
        """This process (the engine's client, and the worker on the pipeline side), the engine's processes (vLLM's),
        the trainer, Redis."""
        redis = [redis_server] if redis_server else []
        return CpuRoles(
            {
                "bench": [os.getpid()],
                "engine": descendants(os.getpid()) - {self.trainer.pid, *redis},
                "trainer": [self.trainer.pid],
                "redis": redis,
            }
        )

    def round(self, loop: asyncio.AbstractEventLoop, batch: list[Prompt], tag: str) -> Measured:
        """The trainer's round, while this loop serves the worker."""
        self.send(tag)
        return loop.run_until_complete(asyncio.to_thread(self.answer))

    async def paired_round(self, engine: Engine, batch: list[Prompt], tag: str, first: str) -> dict[str, Measured]:
        """`--paired`: the trainer's round and the direct one (`batch`, the same prompts) at once, on this engine.

        One side goes `first`; the other starts once the first's requests are in the engine. Each side's work
        before the engine (the worker's read and decode, the direct side's calls) runs on this process's event
        loop, so started together, one would wait for the other's. Each side times itself from its own start, the
        trainer from before its submit; rounds alternate which side goes first."""
        samples = sum(p.n for p in batch)
        if first == "direct":
            direct = asyncio.create_task(_direct_round(engine, batch))
            await _loop_turns()
            self.send(tag)
            return {"pipeline": await asyncio.to_thread(self.answer), "direct": await direct}
        self.send(tag)
        await self._taken(samples)
        await _loop_turns()
        return {"direct": await _direct_round(engine, batch), "pipeline": await asyncio.to_thread(self.answer)}

    async def _taken(self, samples: int, timeout_s: float = 300) -> None:
        """Until the worker has decoded `samples` samples of work."""
        deadline = time.monotonic() + timeout_s
        while self.worker.state.inflight_samples < samples:
            if (self.task is not None and self.task.done()) or time.monotonic() > deadline:
                raise RuntimeError(f"the bench's worker did not take the round's {samples} samples: see its log")
            await asyncio.sleep(0.0005)

    def send(self, tag: str) -> None:
        """Start the trainer's round `tag` (the prompts of `make_prompts` at `shape`)."""
        assert self.trainer.stdin is not None
        self.trainer.stdin.write(json.dumps(self.shape | {"tag": tag}) + "\n")
        self.trainer.stdin.flush()

    def answer(self) -> Measured:
        """The trainer's round once it ends: its seconds (from its submit to its last group) and its tokens."""
        answer = self._line()
        return answer["seconds"], answer["tokens"]

    def _line(self) -> dict[str, Any]:
        """The trainer's next line."""
        assert self.trainer.stdout is not None
        line = self.trainer.stdout.readline()
        if not line:  # its log is in the bench's temporary directory, gone once the bench ends: quote its end
            said = self.log_file.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"the bench's trainer exited with code {self.trainer.wait()}: {' | '.join(said)}")
        return json.loads(line)

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        """The trainer first (its stdin closed: it ends), then the worker, which shuts the engine down."""
        if self.trainer.stdin is not None:
            self.trainer.stdin.close()
        stop_process(self.trainer)
        if self.task is not None:
            self.worker.stop(drain=False)
            loop.run_until_complete(self.task)


NOT_OWN = frozenset({"direct_engine", "worker_engine", "engine", "total"})
"""`cpu_s` entries that `own_cpu` leaves out: the engines' processes (`WorkerProcess.roles`, `SharedEngine.roles`)
and the sum of all roles."""


def own_cpu(spent: dict[str, float]) -> float:
    """CPU-seconds of a side's own processes (this one, the worker, the trainer, Redis), its engine processes left
    out: vLLM's spin while they wait for each other, so their CPU grows with the wall time whatever the work, up to
    every idle core."""
    return sum(seconds for role, seconds in spent.items() if role not in NOT_OWN)


def pipeline_round(client: RolloutClient, prompts: list[Prompt]) -> Measured:
    started = time.perf_counter()
    client.submit_prompts(prompts)
    groups = {g.prompt_id: g for g in client.collect(len(prompts), timeout=300)}
    elapsed = time.perf_counter() - started
    return elapsed, [r.tokens.tolist() for p in prompts for r in groups[p.id].rollouts]


def plot_bench(result: dict[str, Any], path: Path) -> None:
    """Per-round rollouts/s of both sides, with their medians: the comparison at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result.get("prompts_per_side", result["prompts"]) * result["n"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, side in ((-0.2, "direct"), (0.2, "pipeline")):
        rates = [samples / t for t in result[side]["seconds"]]
        label = f"{side} (median {result[side]['rollouts_per_s']:.1f}/s)"
        ax.bar([i + 1 + offset for i in range(len(rates))], rates, width=0.4, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("rollouts/s")
    ax.set_title(f"{result['engine']} engine: direct vs pipeline, ratio {result['ratio']:.3f}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def settle_s(engine: str) -> float:
    """How long the idle side needs before the other is timed (see `SETTLE_S`): only vLLM's processes poll."""
    return SETTLE_S if engine == "vllm" else 0.0


def balanced_ratio(ratios: list[float]) -> tuple[dict[str, float], float]:
    """`--paired`: the per-round ratios' medians by which side went first (rounds 1, 3, ...: the pipeline; 2, 4, ...:
    the direct side), and the geometric mean of the two.

    The side that goes second joins an engine already running and takes ~1 % less time than it would have first (on
    vLLM its requests join together at one step, where the first side's trickle in over the first steps). With the
    ratio `(1 - o) / (1 + p)` in one kind of round and `1 / ((1 - o)(1 + p))` in the other, for an order effect `o`
    and a pipeline cost `p`, the geometric mean is `1 / (1 + p)`: the order effect cancels."""
    by_first = {
        side: float(np.median(ratios[start::2])) for side, start in (("pipeline", 0), ("direct", 1)) if ratios[start::2]
    }
    balanced = float(np.prod(list(by_first.values())) ** (1 / len(by_first)))
    return {side: round(r, 4) for side, r in by_first.items()}, round(balanced, 4)


def room_for_both(spec: EngineSpec, samples: int) -> EngineSpec:
    """`--paired`: an engine that runs both sides' `samples` in the same steps. With less room the side that goes
    second would wait for the first side's samples to finish (measured on vLLM's default of 128 sequences: the second
    side took ~1.7x as long)."""
    if spec.kind == "vllm":
        seqs = spec.engine_args.get("max_num_seqs", samples)
        if seqs < samples:
            raise ValueError(f"--paired runs both sides' {samples} samples at once: max_num_seqs {seqs} is too small")
        return replace(spec, engine_args=spec.engine_args | {"max_num_seqs": seqs})
    return replace(spec, max_batch=max(spec.max_batch, samples))


def run_bench(
    console: Console,
    spec: EngineSpec,
    build_model: bool,
    prompts: int,
    n: int,
    max_tokens: int,
    rounds: int,
    one_engine: bool = False,
    paired: bool = False,
) -> dict[str, Any]:
    """Alternate rounds of the engine called directly (in this process) and of the pipeline (a worker process, or
    with `one_engine` a worker in this process on the same engine: `SharedEngine`). With `paired` (one engine), each
    round runs both sides at once, half the prompts each, in the same engine steps."""
    if paired and prompts < 2:
        raise ValueError(f"--paired splits a round's prompts between the two sides: give at least 2, not {prompts}")
    one_engine = one_engine or paired
    per_side = prompts // 2 if paired else prompts
    if paired:
        spec = room_for_both(spec, 2 * per_side * n)
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    try:
        if build_model:
            spec = replace(spec, model=build_tiny_model(tmp / "model", seed=0))
        direct = create_engine(spec.kind, str(spec.model), **spec.in_process_options())
        times: dict[str, list[float]] = {"direct": [], "pipeline": []}
        tokens: dict[str, list[int]] = {"direct": [], "pipeline": []}
        cpu: dict[str, list[dict[str, float]]] = {"direct": [], "pipeline": [], "paired": []}
        same_tokens = True
        settle = settle_s(spec.kind)
        with RedisServer() as server:
            url, served_by = server.url, server.binary.describe()
            shape = {"prompts": per_side, "n": n, "max_tokens": max_tokens, "vocab": direct.vocab_size}
            side_b: WorkerProcess | SharedEngine = (
                SharedEngine(url, direct, shape, tmp / "trainer.log")
                if one_engine
                else WorkerProcess(url, spec, tmp / "worker.log")
            )
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(direct.start())
                freeze_heap()  # as `rollouts worker` does once its engine is up: the direct side gets it too
                side_b.ready(loop)
                roles = side_b.roles(server.process.pid if server.process else None)

                def play(name: str, batch: list[Prompt], r: int) -> dict[str, Measured]:
                    """One side of round `r`, or both (`paired`; the direct side first in even rounds)."""
                    if name == "paired":
                        assert isinstance(side_b, SharedEngine)
                        first = "direct" if r % 2 == 0 else "pipeline"
                        return loop.run_until_complete(side_b.paired_round(direct, batch, f"r{r}", first))
                    if name == "direct":
                        return {"direct": loop.run_until_complete(_direct_round(direct, batch))}
                    return {"pipeline": side_b.round(loop, batch, f"r{r}")}

                with Progress(console=console) as progress:
                    task = progress.add_task("bench rounds", total=rounds + 1)
                    for r in range(rounds + 1):  # round 0 warms both sides up and is not counted
                        batch = make_prompts(per_side, n, max_tokens, direct.vocab_size, tag=f"r{r}")
                        measured: dict[str, Measured] = {}
                        for name in ("paired",) if paired else ("direct", "pipeline")[:: 1 if r % 2 == 0 else -1]:
                            time.sleep(settle)
                            before = roles.read()
                            measured |= play(name, batch, r)
                            if r > 0:
                                spent = CpuRoles.spent(before, roles.read())
                                cpu[name].append(spent | {"total": sum(spent.values())})
                        same_tokens &= measured["direct"][1] == measured["pipeline"][1]
                        if r > 0:
                            for name, (took, toks) in measured.items():
                                times[name].append(took)
                                tokens[name].append(sum(map(len, toks)))
                        progress.advance(task)
            finally:
                side_b.close(loop)
                loop.run_until_complete(direct.shutdown())
                # The worker's control reads run on the loop's threads: wait for them while Redis is up (a read
                # left blocked when Redis stops retries for `RECONNECT_S`, and the exit waits for it).
                loop.run_until_complete(loop.shutdown_default_executor())
                loop.close()

        def medians(spends: list[dict[str, float]]) -> dict[str, float]:
            return {role: round(statistics.median(spent[role] for spent in spends), 3) for role in spends[0]}

        def side(name: str) -> dict[str, Any]:
            rates = [per_side * n / t for t in times[name]]
            token_rates = [k / t for k, t in zip(tokens[name], times[name], strict=True)]
            return {
                "rollouts_per_s": round(statistics.median(rates), 2),
                "tokens_per_s": round(statistics.median(token_rates), 1),
                "seconds": [round(t, 6) for t in times[name]],  # a small round takes milliseconds
            } | ({} if paired else {"cpu_s": medians(cpu[name])})

        result: dict[str, Any] = {
            "engine": spec.kind,
            "options": {k: v for k, v in spec.options().items() if v is not None},
            "redis": served_by,
            "prompts": prompts,
            "prompts_per_side": per_side,
            "n": n,
            "max_tokens": max_tokens,
            "rounds": rounds,
            "settle_s": settle,
            "one_engine": one_engine,
            "paired": paired,
            "direct": side("direct"),
            "pipeline": side("pipeline"),
            "same_tokens": same_tokens,
        }
        ratios = np.array(times["direct"]) / np.array(times["pipeline"])
        result["ratio"] = round(float(np.median(ratios)), 4)
        result["ratios"] = [round(float(x), 4) for x in ratios]
        if paired:
            result["ratio_by_first"], result["ratio"] = balanced_ratio(result["ratios"])
        result["pipeline_overhead_pct"] = round(100 * (1 - result["ratio"]), 2)
        if paired:  # both sides in the same seconds: the CPU of the round, not of a side
            result["cpu_s"], result["pipeline_extra_cpu_s"] = medians(cpu["paired"]), None
        else:
            extra = [own_cpu(p) - own_cpu(d) for d, p in zip(cpu["direct"], cpu["pipeline"], strict=True)]
            result["pipeline_extra_cpu_s"] = round(statistics.median(extra), 3)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

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
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress

from consumers.engine import Engine, create_engine
from consumers.tiny_model import build_tiny_model
from pipeline.cli.cpu import CpuRoles, descendants
from pipeline.cli.engine_spec import EngineSpec
from pipeline.cli.processes import start_worker, stop_process, wait_for_worker
from pipeline.local import RedisServer
from pipeline.wire import Prompt, Sampling
from producers.client import RolloutClient

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


async def _direct_round(engine: Engine, prompts: list[Prompt]) -> tuple[float, list[list[int]]]:
    def sampling(p: Prompt, k: int) -> Sampling:
        return p.sampling.model_copy(update={"seed": p.sampling.seed + k})  # the worker's per-sample seed

    started = time.perf_counter()
    generations = await asyncio.gather(
        *(engine.generate(f"{p.id}:{k}", p.tokens, sampling(p, k)) for p in prompts for k in range(p.n))
    )
    return time.perf_counter() - started, [g.tokens.tolist() for g in generations]


def cpu_roles(worker: int, redis_server: int | None) -> CpuRoles:
    """This process (the direct side's engine client, and the trainer's client on the pipeline side), the processes
    it started for its engine (vLLM's), the worker, the worker's children (vLLM's, or `--engine-process`), Redis."""
    worker_engine = descendants(worker)
    redis = [redis_server] if redis_server else []
    return CpuRoles(
        {
            "bench": [os.getpid()],
            "direct_engine": descendants(os.getpid()) - {worker, *worker_engine, *redis},
            "worker": [worker],
            "worker_engine": worker_engine,
            "redis": redis,
        }
    )


def own_cpu(spent: dict[str, float]) -> float:
    """CPU-seconds of a side's own processes (this one, the worker, Redis), its engine processes left out: vLLM's spin
    while they wait for each other, so their CPU grows with the wall time whatever the work, up to every idle core."""
    return spent["bench"] + spent["worker"] + spent["redis"]


def _pipeline_round(client: RolloutClient, prompts: list[Prompt]) -> tuple[float, list[list[int]]]:
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

    samples = result["prompts"] * result["n"]
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


def run_bench(
    console: Console, spec: EngineSpec, build_model: bool, prompts: int, n: int, max_tokens: int, rounds: int
) -> dict[str, Any]:
    """Alternate rounds of the engine called directly (in this process) and of the pipeline (a worker process)."""
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    try:
        if build_model:
            spec = replace(spec, model=build_tiny_model(tmp / "model", seed=0))
        direct = create_engine(spec.kind, str(spec.model), **spec.in_process_options())
        samples = prompts * n
        times: dict[str, list[float]] = {"direct": [], "pipeline": []}
        tokens: dict[str, list[int]] = {"direct": [], "pipeline": []}
        cpu: dict[str, list[dict[str, float]]] = {"direct": [], "pipeline": []}
        same_tokens = True
        settle = settle_s(spec.kind)
        with RedisServer() as server:
            url, served_by = server.url, server.binary.describe()
            worker = start_worker(url, NS, spec.model, "bench-worker", *spec.worker_args(), log_file=tmp / "worker.log")
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(direct.start())
                client = RolloutClient(url, NS)
                wait_for_worker(client.streams.redis, NS, "bench-worker", worker, timeout_s=300)
                roles = cpu_roles(worker.pid, server.process.pid if server.process else None)
                with Progress(console=console) as progress:
                    task = progress.add_task("bench rounds", total=rounds + 1)
                    for r in range(rounds + 1):  # round 0 warms both sides up and is not counted
                        batch = make_prompts(prompts, n, max_tokens, direct.vocab_size, tag=f"r{r}")
                        measured: dict[str, tuple[float, list[list[int]]]] = {}
                        for name in ("direct", "pipeline") if r % 2 == 0 else ("pipeline", "direct"):
                            time.sleep(settle)
                            before = roles.read()
                            if name == "direct":
                                measured[name] = loop.run_until_complete(_direct_round(direct, batch))
                            else:
                                measured[name] = _pipeline_round(client, batch)
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
                loop.run_until_complete(direct.shutdown())
                loop.close()
                stop_process(worker)

        def side(name: str) -> dict[str, Any]:
            rates = [samples / t for t in times[name]]
            token_rates = [k / t for k, t in zip(tokens[name], times[name], strict=True)]
            return {
                "rollouts_per_s": round(statistics.median(rates), 2),
                "tokens_per_s": round(statistics.median(token_rates), 1),
                "seconds": [round(t, 6) for t in times[name]],  # a small round takes milliseconds
                "cpu_s": {
                    role: round(statistics.median(spent[role] for spent in cpu[name]), 3) for role in cpu[name][0]
                },
            }

        result = {
            "engine": spec.kind,
            "options": {k: v for k, v in spec.options().items() if v is not None},
            "redis": served_by,
            "prompts": prompts,
            "n": n,
            "max_tokens": max_tokens,
            "rounds": rounds,
            "settle_s": settle,
            "direct": side("direct"),
            "pipeline": side("pipeline"),
            "same_tokens": same_tokens,
        }
        ratios = np.array(times["direct"]) / np.array(times["pipeline"])
        result["ratio"] = round(float(np.median(ratios)), 4)
        result["ratios"] = [round(float(x), 4) for x in ratios]
        result["pipeline_overhead_pct"] = round(100 * (1 - result["ratio"]), 2)
        extra = [own_cpu(p) - own_cpu(d) for d, p in zip(cpu["direct"], cpu["pipeline"], strict=True)]
        result["pipeline_extra_cpu_s"] = round(statistics.median(extra), 3)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

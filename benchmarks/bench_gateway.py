"""`rollouts bench-gateway`: multi-turn sessions through the gateway, per placement policy, and against the engine.

An agent's session resends its whole history every turn, so what a turn costs depends on where it runs:
on the worker that served the previous turn, the history is in vLLM's prefix cache and only the new
tokens are prefilled. The benchmark runs N concurrent sessions of T turns each (every turn resends the
history, the reply as returned and a new user message of a few dozen tokens; seeds fixed) and measures,
side by side in one run, on the same workers:

1. placement `sticky` vs `hash` vs `random` (one gateway process each, all on the same workers; every
   policy and round gets its own conversations, so no run finds another's prefix in the cache):
   prefix-cache hit rate (cached / prompt tokens over the turns after the first), time per turn
   (median, p90) and the wall time of all sessions;
2. the gateway's overhead: the same turns (the same token ids, the same seeds) through the gateway with
   one worker vs the engine called in this process. Rounds alternate where the engine and the workers
   fit on the machine together; a vLLM engine never runs beside vLLM workers (a small CPU machine fits
   two engines at most), so there the gateway's rounds run first, then the engine's.

Round 0 of each warms up and is not counted; medians over the other rounds. JSON on stdout.

vLLM caches whole KV blocks only, and on CPU a block is 128 tokens unless asked otherwise: a turn's last
partial block is always recomputed, which caps the hit rate of short sessions. `--engine-args
'{"block_size": 32}'` shows what finer blocks give. The torch and synthetic engines report no cache (0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
import redis
import typer

from pipeline.processes import start_command, start_worker, stop_processes, wait_for_worker
from rollouts.app import check_engine, console, fail, user_errors
from rollouts.engine_spec import (
    DeviceOpt,
    DtypeOpt,
    EagerOpt,
    EngineArgsOpt,
    EngineOpt,
    EngineSpec,
    KvCacheOpt,
    MaxBatchOpt,
    MaxLenOpt,
    ThreadsOpt,
    TpOpt,
)

if TYPE_CHECKING:
    import openai
    from rich.console import Console

    from consumers.engines.base import Engine

NS = "bench-gateway"
SERVED = "bench"
"""The model name the gateways serve (what each call names)."""
POLICIES = ("sticky", "hash", "random")
SYSTEM = "You are a terse assistant. Reply in a few words."
USER_SENTENCES = 3
"""Sentences per user message: ~35 tokens of the tiny model's tokenizer."""
TEMPERATURE = 1.0


# -- the workload -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """N sessions of T user messages, the same for every policy and round (only a tag in the system message
    differs, so each run's prefixes are its own); the seed of turn t of session i is fixed too."""

    sessions: int
    turns: int
    max_tokens: int
    messages: list[list[str]]
    """The user's message of each turn of each session."""

    @classmethod
    def build(cls, sessions: int, turns: int, max_tokens: int) -> Workload:
        from consumers.engines.tiny_model import corpus

        lines = corpus(500, seed=20261122)
        messages = []
        for i in range(sessions):
            rng = random.Random(f"bench-gateway-{i}")
            messages.append([" ".join(rng.sample(lines, USER_SENTENCES)) for _ in range(turns)])
        return cls(sessions, turns, max_tokens, messages)

    @staticmethod
    def seed(session: int, turn: int) -> int:
        return 1000 * session + turn

    def system(self, tag: str, session: int) -> dict[str, str]:
        return {"role": "system", "content": f"{SYSTEM} Conversation {tag}/{session}."}

    def check_fits(self, model: Path, max_model_len: int | None) -> None:
        """Refuse, before any process starts, sessions whose last turn cannot fit the model's context."""
        from transformers import AutoTokenizer

        from consumers.engines.model_files import read_model_limits
        from producers.gateway.chat import ChatRenderer

        limit = read_model_limits(model, max_model_len).max_model_len
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(model)))
        for i in range(self.sessions):
            history = [self.system("random-r999", i)]  # the longest tag a run uses, near enough
            for text in self.messages[i]:
                history += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
            # Every reply at most max_tokens, the last one included: an upper bound of the last turn's length.
            needed = len(renderer.first_prompt(history[:-1], None)) + self.turns * self.max_tokens
            if needed > limit:
                raise ValueError(
                    f"{self.turns} turns with --max-tokens {self.max_tokens} need up to {needed} tokens of context, "
                    f"but the model's is {limit}: pass fewer --turns or a smaller --max-tokens"
                )


@dataclass
class TurnResult:
    session: int
    turn: int
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    prompt_ids: list[int]
    reply_ids: list[int]


@dataclass
class Run:
    """All sessions of one round under one policy (or the engine called directly)."""

    tag: str
    wall_s: float
    turns: list[TurnResult]
    workers: list[list[str]] = field(default_factory=list)
    """The worker of each turn, per session (gateway runs)."""


# -- one round through a gateway ------------------------------------------------------------------------


async def _session(client: openai.AsyncOpenAI, work: Workload, tag: str, i: int, session_id: str) -> list[TurnResult]:
    """One session's turns in order, each resending the history and the reply exactly as it was returned."""
    messages: list[dict[str, Any]] = [work.system(tag, i)]
    done = []
    for t, text in enumerate(work.messages[i]):
        messages.append({"role": "user", "content": text})
        started = time.perf_counter()
        answer = await client.chat.completions.create(
            model=SERVED,
            messages=messages,  # type: ignore[arg-type]  # plain dicts (Workload.system's too); openai's are TypedDicts
            max_tokens=work.max_tokens,
            temperature=TEMPERATURE,
            seed=work.seed(i, t),
            extra_headers={"X-Session-ID": session_id},
            extra_body={"return_token_ids": True},
        )
        took = time.perf_counter() - started
        choice = answer.choices[0]
        details = answer.usage.prompt_tokens_details if answer.usage else None
        done.append(
            TurnResult(
                session=i,
                turn=t,
                seconds=took,
                prompt_tokens=answer.usage.prompt_tokens if answer.usage else 0,
                cached_tokens=(details.cached_tokens if details else 0) or 0,
                prompt_ids=list((answer.model_extra or {})["prompt_token_ids"]),
                reply_ids=list((choice.model_extra or {})["token_ids"]),
            )
        )
        messages.append({"role": "assistant", "content": choice.message.content or ""})
    return done


async def _gateway_round(client: openai.AsyncOpenAI, work: Workload, tag: str, redis_url: str) -> Run:
    """All sessions at once; then (untimed) finish each one and read which worker served each turn."""
    import httpx

    from pipeline.wire import Keys

    ids = [f"{tag}-s{i}" for i in range(work.sessions)]
    started = time.perf_counter()
    sessions = await asyncio.gather(*(_session(client, work, tag, i, ids[i]) for i in range(work.sessions)))
    wall = time.perf_counter() - started
    async with httpx.AsyncClient(base_url=str(client.base_url), timeout=60) as http:
        for sid in ids:
            finished = await http.post(f"sessions/{sid}/finish", json={"reward": 0.0})
            finished.raise_for_status()
            if finished.json()["turns"] != work.turns:
                raise RuntimeError(f"session {sid} finished with {finished.json()['turns']} turns, not {work.turns}")
    with contextlib.closing(redis.Redis.from_url(redis_url)) as r:
        workers = [json.loads(r.hget(Keys(NS).session(sid), "workers") or b"[]") for sid in ids]
    return Run(tag, wall, [t for s in sessions for t in s], workers)


# -- the same turns on the engine in this process --------------------------------------------------------


async def _direct_round(engine: Engine, work: Workload, recorded: Run) -> Run:
    """Replay a gateway round's prompts (its exact token ids and seeds) on the engine, sessions concurrently."""
    from pipeline.wire import Sampling

    async def session(turns: list[TurnResult]) -> list[TurnResult]:
        done = []
        for turn in turns:
            sampling = Sampling(
                max_tokens=work.max_tokens, temperature=TEMPERATURE, seed=work.seed(turn.session, turn.turn)
            )
            prompt = np.asarray(turn.prompt_ids, np.int32)
            started = time.perf_counter()
            made = await engine.generate(f"direct-{recorded.tag}-{turn.session}-{turn.turn}", prompt, sampling)
            took = time.perf_counter() - started
            reply = made.tokens.tolist()
            done.append(replace(turn, seconds=took, cached_tokens=made.cached_tokens or 0, reply_ids=reply))
        return done

    by_session: dict[int, list[TurnResult]] = {}
    for turn in recorded.turns:
        by_session.setdefault(turn.session, []).append(turn)
    started = time.perf_counter()
    sessions = await asyncio.gather(*(session(turns) for turns in by_session.values()))
    return Run(f"direct-{recorded.tag}", time.perf_counter() - started, [t for s in sessions for t in s])


# -- processes -------------------------------------------------------------------------------------------


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait_for_gateway(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> None:
    """Until its /health answers 200, which it does once a worker serves (start the workers first); fail early, with
    its log, if its process died."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {process.returncode}:\n{_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway at {url} did not answer within {timeout_s:.0f}s:\n{_tail(log)}")
        time.sleep(0.2)


def _wait_for_single_worker(redis_url: str, name: str, timeout_s: float = 30) -> None:
    """Until `name` is the only worker a gateway would place a session on (the others stopped)."""
    from pipeline.streams import Streams
    from producers.gateway.placement import candidates

    streams = Streams(redis.Redis.from_url(redis_url), NS)
    deadline = time.monotonic() + timeout_s
    while set(candidates(streams.registry.live_workers())) != {name}:
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers other than {name} still take sessions after {timeout_s:.0f}s")
        time.sleep(0.1)
    streams.redis.close()


# -- the report ---------------------------------------------------------------------------------------


def _cached_share(turns: list[TurnResult]) -> float:
    prompt = sum(t.prompt_tokens for t in turns)
    return round(sum(t.cached_tokens for t in turns) / prompt, 4) if prompt else 0.0


def _hit_rate(turns: list[TurnResult]) -> float:
    """Cached prompt tokens over prompt tokens, of the turns after the first (a first turn has no history)."""
    return _cached_share([t for t in turns if t.turn > 0])


def _summary(runs: list[Run], turns_per_session: int) -> dict[str, Any]:
    """Hit rate and times of the counted rounds of one side."""
    turns = [t for run in runs for t in run.turns]
    later = [t for t in turns if t.turn > 0]
    seconds = np.array([t.seconds for t in turns])
    summary: dict[str, Any] = {
        "hit_rate": _hit_rate(turns),
        "hit_rate_rounds": [_hit_rate(run.turns) for run in runs],
        "prompt_tokens": sum(t.prompt_tokens for t in later),
        "cached_tokens": sum(t.cached_tokens for t in later),
        "turn_s": {"median": round(float(np.median(seconds)), 4), "p90": round(float(np.percentile(seconds, 90)), 4)},
        "wall_s": round(statistics.median(run.wall_s for run in runs), 4),
        "wall_s_rounds": [round(run.wall_s, 4) for run in runs],
        "turns_answered": len(turns),
        "reply_tokens": sum(len(t.reply_ids) for t in turns),
        "by_turn": [
            {
                "turn": k + 1,
                "hit_rate": _cached_share([t for t in turns if t.turn == k]),
                "median_s": round(float(np.median([t.seconds for t in turns if t.turn == k])), 4),
                "prompt_tokens": round(float(np.mean([t.prompt_tokens for t in turns if t.turn == k])), 1),
            }
            for k in range(turns_per_session)
        ],
    }
    if any(run.workers for run in runs):
        served = [w for run in runs for session in run.workers for w in session]
        moves = sum(a != b for run in runs for s in run.workers for a, b in pairwise(s))
        summary["turns_per_worker"] = dict(sorted(Counter(served).items()))
        summary["moves"] = moves  # turns on another worker than the session's previous turn: a cold prefix
    return summary


def plot_bench_gateway(result: dict[str, Any], path: Path) -> None:
    """Hit rate and time per turn, by turn of the session, per policy; and the gateway against the engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (hits, times, bars) = plt.subplots(1, 3, figsize=(15, 4.2))
    for policy, row in result["placement"].items():
        turns = [b["turn"] for b in row["by_turn"]]
        label = f"{policy} ({100 * row['hit_rate']:.0f}% hits)"
        hits.plot(turns[1:], [100 * b["hit_rate"] for b in row["by_turn"][1:]], marker="o", label=label)
        times.plot(turns, [1000 * b["median_s"] for b in row["by_turn"]], marker="o", label=policy)
    hits.set(xlabel="turn of the session", ylabel="prefix-cache hits (% of prompt tokens)", ylim=(0, 100))
    hits.set_title(f"{result['workers']} workers, {result['sessions']} concurrent sessions")
    times.set(xlabel="turn of the session", ylabel="median time per turn (ms)")
    times.set_title(f"{result['engine']} engine, {result['max_tokens']} tokens per reply")
    overhead = result["overhead"]
    sides = {**result["placement"], "gateway\n1 worker": overhead["gateway"], "engine\ndirect": overhead["direct"]}
    x = np.arange(len(sides))
    bars.bar(x - 0.2, [1000 * s["turn_s"]["median"] for s in sides.values()], width=0.4, label="median")
    bars.bar(x + 0.2, [1000 * s["turn_s"]["p90"] for s in sides.values()], width=0.4, label="p90")
    bars.set_xticks(x, list(sides), fontsize=8)
    bars.set(ylabel="time per turn (ms)")
    bars.set_title(f"gateway vs engine: ratio {overhead['ratio']:.3f}")
    for ax in (hits, times, bars):
        ax.legend(fontsize=8)
    for ax in (hits, times):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the benchmark ---------------------------------------------------------------------------------------


def run_bench_gateway(
    console: Console,
    spec: EngineSpec,
    build_model: bool,
    sessions: int,
    turns: int,
    workers: int,
    max_tokens: int,
    rounds: int,
) -> dict[str, Any]:
    """Start a private Redis, the workers and one gateway per policy; run both comparisons; stop all by PID."""
    from consumers.engines.tiny_model import build_tiny_model
    from pipeline.local import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-gateway-"))
    try:
        if build_model:
            spec = replace(spec, model=build_tiny_model(tmp / "model", seed=0))
        work = Workload.build(sessions, turns, max_tokens)
        work.check_fits(spec.model, spec.max_model_len)
        with RedisServer() as server:
            bench = _Bench(console, spec, work, workers, rounds, server.url, tmp)
            try:
                placed, through, direct = bench.run()
            finally:
                bench.close()
            served_by = server.binary.describe()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    same = [
        a.reply_ids == b.reply_ids
        for g, d in zip(through, direct, strict=True)
        for a, b in zip(g.turns, d.turns, strict=True)
    ]
    ratios = [d.wall_s / g.wall_s for g, d in zip(through, direct, strict=True)]
    gateway_side, direct_side = _summary(through, turns), _summary(direct, turns)
    return {
        "engine": spec.kind,
        "options": {k: v for k, v in spec.options().items() if v is not None},
        "redis": served_by,
        "sessions": sessions,
        "turns": turns,
        "workers": workers,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "engine_reports_cache": spec.kind == "vllm",
        "placement": {p: _summary(placed[p], turns) for p in POLICIES},
        "overhead": {
            "workers": 1,
            "alternated": spec.kind != "vllm",
            "gateway": gateway_side,
            "direct": direct_side,
            "ratio": round(statistics.median(ratios), 4),
            "gateway_overhead_pct": round(100 * (1 - statistics.median(ratios)), 2),
            "per_turn_overhead_ms": round(
                1000 * (gateway_side["turn_s"]["median"] - direct_side["turn_s"]["median"]), 2
            ),
            "same_tokens": all(same),
        },
    }


class _Bench:
    """The processes, clients and engine of one benchmark run, and the order in which they are used."""

    def __init__(
        self, console: Console, spec: EngineSpec, work: Workload, workers: int, rounds: int, url: str, tmp: Path
    ) -> None:
        self.console, self.spec, self.work, self.rounds, self.url, self.tmp = console, spec, work, rounds, url, tmp
        self.names = [f"bench-w{k}" for k in range(workers)]
        self.workers: list[subprocess.Popen[bytes]] = []
        self.gateways: list[subprocess.Popen[bytes]] = []
        self.clients: dict[str, openai.AsyncOpenAI] = {}
        self.loop = asyncio.new_event_loop()
        self.engine: Engine | None = None

    def run(self) -> tuple[dict[str, list[Run]], list[Run], list[Run]]:
        """Counted runs: per policy; the gateway's with one worker; the engine's on the same turns."""
        from rich.progress import Progress

        with Progress(console=self.console) as progress:
            starting = progress.add_task(f"starting {len(self.names)} {self.spec.kind} workers and the gateways")
            self._start()
            progress.remove_task(starting)

            # 1. Placement: every policy every round, in a rotating order so that none always goes first.
            placed: dict[str, list[Run]] = {p: [] for p in POLICIES}
            task = progress.add_task("placement rounds", total=(self.rounds + 1) * len(POLICIES))
            for r in range(self.rounds + 1):  # round 0 warms up and is not counted
                for policy in POLICIES[r % 3 :] + POLICIES[: r % 3]:
                    run = self._gateway_round(policy, f"{policy}-r{r}")
                    if r > 0:
                        placed[policy].append(run)
                    progress.advance(task)

            # 2. Overhead: the gateway with one worker vs the engine in this process, on the same turns.
            stop_processes(self.workers[1:])
            _wait_for_single_worker(self.url, self.names[0])
            task = progress.add_task("gateway vs engine rounds", total=2 * (self.rounds + 1))
            alternate = self.spec.kind != "vllm"  # a vLLM engine here only once the vLLM workers are gone
            through: list[Run] = []
            direct: list[Run] = []
            if alternate:
                self._start_engine()
            for r in range(self.rounds + 1):
                through.append(self._gateway_round("sticky", f"one-r{r}"))
                progress.advance(task)
                if alternate:
                    direct.append(self._direct_round(through[-1]))
                    progress.advance(task)
            if not alternate:
                self.stop_processes()
                self._start_engine()
                for recorded in through:
                    direct.append(self._direct_round(recorded))
                    progress.advance(task)
        return placed, through[1:], direct[1:]

    def _start(self) -> None:
        import openai

        from pipeline.local import free_port

        spec = self.spec
        for name in self.names:
            log = self.tmp / f"{name}.log"
            self.workers.append(start_worker(self.url, NS, spec.model, name, *spec.worker_args(), log_file=log))
        urls = {}
        for policy in POLICIES:
            port = free_port()
            args = ["gateway", "--redis", self.url, "--ns", NS, "--model", str(spec.model), "--port", str(port)]
            args += ["--served-model-name", SERVED, "--placement", policy, "--name", f"bench-{policy}"]
            args += ["--log-level", "warning"]
            self.gateways.append(start_command(*args, log_file=self.tmp / f"gateway-{policy}.log"))
            urls[policy] = f"http://127.0.0.1:{port}"
        with contextlib.closing(redis.Redis.from_url(self.url)) as client:
            for name, process in zip(self.names, self.workers, strict=True):
                try:
                    wait_for_worker(client, NS, name, process, timeout_s=300)
                except (RuntimeError, TimeoutError) as exc:
                    raise RuntimeError(f"{exc}; its log ends:\n{_tail(self.tmp / f'{name}.log')}") from None
        for (policy, url), process in zip(urls.items(), self.gateways, strict=True):
            _wait_for_gateway(url, process, self.tmp / f"gateway-{policy}.log")
            self.clients[policy] = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600)

    def _start_engine(self) -> None:
        from consumers.engines import create_engine

        self.engine = create_engine(self.spec.kind, str(self.spec.model), **self.spec.options())
        self.loop.run_until_complete(self.engine.start())

    def _gateway_round(self, policy: str, tag: str) -> Run:
        return self.loop.run_until_complete(_gateway_round(self.clients[policy], self.work, tag, self.url))

    def _direct_round(self, recorded: Run) -> Run:
        assert self.engine is not None
        return self.loop.run_until_complete(_direct_round(self.engine, self.work, recorded))

    def stop_processes(self) -> None:
        """Stop every process this run started, by PID: the gateways first, so nothing waits on a worker."""
        for client in self.clients.values():
            self.loop.run_until_complete(client.close())
        self.clients.clear()
        stop_processes(self.gateways)
        stop_processes(self.workers)  # a process already stopped is skipped

    def close(self) -> None:
        try:
            self.stop_processes()
            if self.engine is not None:
                engine, self.engine = self.engine, None
                self.loop.run_until_complete(engine.shutdown())
        finally:
            self.loop.close()


def bench_gateway(
    ctx: typer.Context,
    engine: EngineOpt = "vllm",
    model: Annotated[Path | None, typer.Option(help="Model directory; default: a fresh tiny model.")] = None,
    sessions: Annotated[int, typer.Option(min=1, help="Sessions at once.")] = 8,
    turns: Annotated[int, typer.Option(min=2, help="Turns per session (the history grows every turn).")] = 6,
    workers: Annotated[int, typer.Option(min=1, help="Workers the sessions are placed on.")] = 2,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per reply, at most.")] = 24,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds of each; medians are reported.")] = 3,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    max_batch: MaxBatchOpt = 64,
    num_threads: ThreadsOpt = None,
    max_model_len: MaxLenOpt = None,
    kv_cache_bytes: KvCacheOpt = None,
    tensor_parallel_size: TpOpt = 1,
    enforce_eager: EagerOpt = True,
    engine_args: EngineArgsOpt = None,
    plot: Annotated[
        Path | None, typer.Option(help="Also draw hit rate and time per turn per policy to this PNG.")
    ] = None,
) -> None:
    """Multi-turn sessions through the gateway: prefix-cache hits and time per turn under sticky, hash and random
    placement, and the gateway's overhead against the engine called directly; JSON out."""
    with user_errors():
        spec = EngineSpec.from_flags(ctx.params, model or Path("tiny-model"))
    check_engine(spec, has_model=model is not None)  # without --model, the model is built later
    try:
        import openai  # the sessions speak through the official client, as agent code does
    except ImportError:
        fail("rollouts bench-gateway drives the gateway with the openai client: pip install openai")
    import httpx

    with user_errors():
        try:
            result = run_bench_gateway(console, spec, model is None, sessions, turns, workers, max_tokens, rounds)
        except (RuntimeError, TimeoutError) as exc:
            fail(str(exc))
        except (openai.APIError, httpx.HTTPError) as exc:
            fail(f"a call to the gateway failed: {exc}")
        if plot is not None:
            plot_bench_gateway(result, plot)
            console.print(f"plot written to {plot}")
    print(json.dumps(result, indent=2))

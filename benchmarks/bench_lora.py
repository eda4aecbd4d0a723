"""`rollouts bench-lora`: adapter B's generation while adapter A syncs, against no sync at all (issue 14, item 5).

One worker process (`--engine torch` on the CPU by default, or `--engine vllm` on a GPU; `--max-loras 2`) serves two
LoRA adapters of one base model, `a` and `b`, on a private `redis-server`. After an unmeasured warm-up phase (both
adapters loaded, the same work run once), each round runs two phases, in alternating order (quiet first in even
rounds, syncing first in odd ones, so that drift on a shared machine hits both sides):

- `quiet`: the same fixed work for B (`--b-prompts` prompts) and for A (`--a-prompts`), no sync;
- `syncing`: the same work, while a thread publishes new versions of adapter `a` back to back (or `--sync-gap-s`
  apart; two prebuilt versions in turn, so that every publish is a real change), from the submit until every B
  group arrived.

B's throughput is B's generated tokens over the time from the submit to its last group; A's groups are collected
too before the next phase begins, so nothing carries over. Prompts are greedy (temperature 0) with fresh ids each
phase, so both phases generate the same tokens. The ratio is the median over rounds of each round's
syncing / quiet; the goal is >= 0.95. Each adapter sync's `stall_s` (its `weights` command to its `resume`: how
long A stood still) is reported as p50/p90/max.

Back to back is the worst case for the rate of syncs; `--sync-gap-s` sets a trainer's cadence instead. Two
figures help read the ratio: `b_ms_lost_per_sync` (B's extra time in the syncing phase over its syncs), and the CPU
cores the worker, this process (the trainer side, publishing) and Redis used while B ran: whether the machine,
rather than the worker, was short. A sync costs B in the worker itself: A's rows leave the batch and come back,
prefilled again under A's new version (keep), or end and come back as partials (abort), in the same engine as B's
rows. That re-prefill grows with A's rows' length, so a sync after a longer gap costs B more than one back to back:
the loss per sync does not carry over from one gap to another.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.console import Console
from rich.progress import Progress

from benchmarks.cpu import CpuRoles
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_process, wait_for_worker
from pipeline.wire import PauseMode, Sampling
from rollouts.app import check_engine, console, fail, user_errors
from rollouts.engine_spec import DeviceOpt, DtypeOpt, EagerOpt, EngineArgsOpt, EngineSpec, KvCacheOpt

if TYPE_CHECKING:
    import torch

    from producers.client import Group, RolloutClient

NS = "bench-lora"
WORKER = "bench-lora-worker"
FAVOURED = {"a1": range(100, 140), "a2": range(200, 240), "b": range(300, 340)}
"""The tokens each adapter version is trained to prefer: `a1`/`a2` are adapter a's two versions, published in turn."""
PROMPT_TOKENS = 8
TINY_MAX_POSITIONS = 512
"""The tiny model's longest sequence (`consumers.engines.tiny_model.build_tiny_model`): prompt + tokens must fit."""
COLLECT_TIMEOUT_S = 300.0
"""Give up on a phase when no rollout arrived for this long (the worker's log says why)."""

Adapter = tuple[dict[str, "torch.Tensor"], dict[str, Any]]


@dataclass(frozen=True)
class Work:
    """The fixed work of one phase: the same prompt tokens every phase, fresh ids."""

    b_prompts: int
    a_prompts: int
    n: int
    tokens: int
    prompts: list[list[int]] = field(repr=False)
    """`b_prompts + a_prompts` token lists: B's first, then A's."""


@dataclass(frozen=True)
class Settings:
    """How the bench runs, besides the work: checked by the command before anything starts."""

    model: Path | None
    """The base model; None: a tiny one built for the run."""
    rounds: int
    mode: PauseMode
    """Pause mode of adapter a's syncs: keep or abort."""
    max_batch: int
    sync_gap_s: float
    """Seconds between one sync's end and the next publish (0: back to back, the worst case)."""
    engine: EngineSpec | None = None
    """The worker's engine (`max_loras` 2 and `max_batch` set here); None: torch on the CPU in float32."""

    def worker_args(self) -> list[str]:
        spec = self.engine or EngineSpec("torch", Path("."))
        return replace(spec, max_loras=2, max_batch=self.max_batch).worker_args()


@dataclass
class Phase:
    """What one phase measured."""

    b_seconds: float
    b_tokens: int
    seconds: float
    """From the submit until A's last group too."""
    stalls: list[float]
    exactly_once: bool
    errors: int
    cores: dict[str, float]
    """CPU cores each process used while B generated (CPU seconds over B's seconds): worker, bench, redis."""

    @property
    def b_tokens_per_s(self) -> float:
        return self.b_tokens / self.b_seconds


class AdapterSyncs:
    """Publishes adapter a's next version from a thread, back to back (or `gap_s` apart), while a phase lasts.

    Its own `RolloutClient` (the main thread's one is reading rollouts meanwhile); which of the two versions goes
    next carries over from phase to phase, so that every publish changes the adapter's weights."""

    def __init__(self, url: str, versions: list[Adapter], mode: PauseMode, gap_s: float) -> None:
        from producers.client import RolloutClient

        self.client = RolloutClient(url, NS, consumer="bench-lora-publisher")
        self.versions = versions
        self.mode = mode
        self.gap_s = gap_s
        self.published = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stalls: list[float] = []
        self._error: BaseException | None = None

    def start(self) -> None:
        self._stop.clear()
        self._stalls, self._error = [], None
        self._thread = threading.Thread(target=self._run, name="bench-lora-syncs", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """No new sync after the one under way (B's work is done: the phase's syncing is over)."""
        self._stop.set()

    def join(self) -> list[float]:
        """Wait for the sync under way (adapter a is not left paused), then hand back each sync's stall."""
        self.finish()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        return self._stalls

    def _run(self) -> None:
        """At least one sync per phase: the phase is about syncs, however short its B work."""
        try:
            while True:
                tensors, config = self.versions[self.published % len(self.versions)]
                self.client.publish_weights(tensors, adapter="a", adapter_config=config, mode=self.mode)
                self.published += 1
                self._stalls.append(self.client.last_sync.stall_s if self.client.last_sync else 0.0)
                if self._stop.wait(self.gap_s):  # 0: no wait at all
                    return
        except BaseException as exc:  # raised again in the main thread by `join`
            self._error = exc


def make_work(b_prompts: int, a_prompts: int, n: int, tokens: int, vocab: int) -> Work:
    """Random 8-token prompts from a fixed seed: every phase and round submits the same ones."""
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(b_prompts + a_prompts)]
    return Work(b_prompts, a_prompts, n, tokens, prompts)


def run_phase(client: RolloutClient, work: Work, tag: str, syncs: AdapterSyncs | None, cpu: CpuRoles) -> Phase:
    """Submit A's and B's work at once (A's first: in flight when the first sync pauses it), time B's last group,
    stop the syncs there, then take A's remaining groups; every rollout id is counted."""
    prompts = [
        client.make_prompt(tokens=tokens, n=work.n, sampling=_greedy(work.tokens), id=f"{tag}-{side}{i}", adapter=side)
        for i, tokens in enumerate(work.prompts)
        for side in [_side(i, work)]
    ]
    b_ids = {p.id for p in prompts if p.adapter == "b"}
    duplicates_before = client.stats["duplicates"]
    cpu_before, cpu_at_b = cpu.read(), dict[str, float]()

    def b_finished() -> None:
        cpu_at_b.update(cpu.read())
        if syncs is not None:
            syncs.finish()

    started = time.perf_counter()
    client.submit_prompts([p for p in prompts if p.adapter == "a"] + [p for p in prompts if p.adapter == "b"])
    if syncs is not None:
        syncs.start()
    stalls: list[float] = []
    try:
        groups, b_done = _take_groups(client, len(prompts), b_ids, started, b_finished)
    finally:
        if syncs is not None:
            stalls = syncs.join()
    seconds = time.perf_counter() - started
    seen = Counter(r.id for g in groups for r in g.rollouts)
    wanted = {f"{p.id}:{k}" for p in prompts for k in range(p.n)}
    once = set(seen) == wanted and all(c == 1 for c in seen.values())
    return Phase(
        b_seconds=b_done,
        b_tokens=sum(r.n_tokens for g in groups if g.prompt_id in b_ids for r in g.rollouts),
        seconds=seconds,
        stalls=stalls,
        exactly_once=once and client.stats["duplicates"] == duplicates_before,
        errors=sum(r.finish_reason == "error" for g in groups for r in g.rollouts),
        cores={name: spent / b_done for name, spent in CpuRoles.spent(cpu_before, cpu_at_b).items()},
    )


def _take_groups(
    client: RolloutClient, count: int, b_ids: set[str], started: float, b_finished: Callable[[], None]
) -> tuple[list[Group], float]:
    """Every group of the phase, and the seconds from `started` to B's last one (then `b_finished` is called)."""
    groups: list[Group] = []
    b_left, b_done = len(b_ids), 0.0
    for group in client.groups(timeout=COLLECT_TIMEOUT_S):
        groups.append(group)
        if group.prompt_id in b_ids:
            b_left -= 1
            if b_left == 0:
                b_done = time.perf_counter() - started
                b_finished()
        if len(groups) == count:
            break
    return groups, b_done


def _greedy(max_tokens: int) -> Sampling:
    return Sampling(max_tokens=max_tokens, temperature=0.0)


def _side(index: int, work: Work) -> str:
    """Whose prompt `work.prompts[index]` is: B's come first."""
    return "b" if index < work.b_prompts else "a"


def build_adapters(model: Path) -> dict[str, Adapter]:
    """Adapter b, and adapter a's two versions (each trained towards its own tokens: a real change each publish), on
    a GPU where there is one (a larger base model's take minutes on a CPU), before the worker starts."""
    import torch

    from consumers.engines.tiny_model import make_adapter

    device = "cuda" if torch.cuda.is_available() else "cpu"
    favoured = enumerate(FAVOURED.items())
    adapters = {key: make_adapter(model, list(tokens), seed=i, device=device) for i, (key, tokens) in favoured}
    if device == "cuda":
        torch.cuda.empty_cache()  # the worker's engine has the GPU to itself
    return adapters


def run_bench_lora(out: Console, settings: Settings, work: Work) -> dict[str, Any]:
    """Set up (model, Redis, worker, adapters), run the warm-up and the rounds, and clean up whatever happens."""
    import torch

    torch.set_num_threads(1)  # this process only trains 3 tiny adapters and publishes them; the worker has the cores
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-lora-"))
    try:
        model = settings.model
        if model is None:
            from consumers.engines.tiny_model import build_tiny_model

            model = build_tiny_model(tmp / "model", seed=0)
        adapters = build_adapters(model)
        (tmp / "redis").mkdir()
        with RedisServer(data_dir=tmp / "redis") as server:  # its data dir goes with ours
            log = tmp / "worker.log"
            worker = start_worker(server.url, NS, model, WORKER, *settings.worker_args(), log_file=log)
            try:
                result = _bench(out, server, worker, log, adapters, settings, work)
            finally:
                stop_process(worker)
            return {"config": _config(settings, work) | {"redis": server.binary.describe()}} | result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bench(
    out: Console,
    server: RedisServer,
    worker: subprocess.Popen[bytes],
    log: Path,
    adapters: dict[str, Adapter],
    settings: Settings,
    work: Work,
) -> dict[str, Any]:
    """Publish a and b, wait for the worker, warm it up, then the rounds of both phases in alternating order."""
    from producers.client import RolloutClient
    from staleness.state import read_state

    client = RolloutClient(server.url, NS, consumer="bench-lora-trainer")
    client.publish_weights(adapters["a1"][0], adapter="a", adapter_config=adapters["a1"][1])
    client.publish_weights(adapters["b"][0], adapter="b", adapter_config=adapters["b"][1])
    try:
        wait_for_worker(client.streams.redis, NS, WORKER, worker, timeout_s=300)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; its log ends: {_tail(log)}") from None
    base_before = read_state(client.streams.redis, client.streams.keys).version
    syncs = AdapterSyncs(server.url, [adapters["a2"], adapters["a1"]], settings.mode, settings.sync_gap_s)
    rounds = settings.rounds
    phases: dict[str, list[Phase]] = {"quiet": [], "syncing": []}
    with Progress(console=out) as progress:
        task = progress.add_task("warm-up", total=2 * rounds + 1)
        redis = [server.process.pid] if server.process is not None else []  # none: not ours to read (reads as 0 s)
        # Whether the syncing phase was short of CPU (the trainer side publishing, Redis moving the tensors) tells a
        # sync's cost to the worker apart from the machine's.
        cpu = CpuRoles({"worker": [worker.pid], "bench": [os.getpid()], "redis": redis})
        run_phase(client, work, "warmup", None, cpu)  # whole: a shorter one left round 1's first phase slow
        progress.advance(task)
        for r in range(rounds):
            for name in ("quiet", "syncing") if r % 2 == 0 else ("syncing", "quiet"):
                progress.update(task, description=f"round {r + 1}/{rounds} {name}")
                _check_alive(worker, log)
                phases[name].append(run_phase(client, work, f"r{r}-{name}", syncs if name == "syncing" else None, cpu))
                progress.advance(task)
            _print_round(out, r, rounds, phases)
    base_after = read_state(client.streams.redis, client.streams.keys).version
    versions = {"base": base_after, "a": read_state(client.streams.redis, client.streams.keys, "a").version}
    versions["b"] = read_state(client.streams.redis, client.streams.keys, "b").version
    return summarize(phases, versions, base_unchanged=base_before == base_after == 0)


def summarize(phases: dict[str, list[Phase]], versions: dict[str, int], base_unchanged: bool) -> dict[str, Any]:
    """Per-round B tokens/s of both phases, their medians, the median per-round ratio, and the syncs' stalls."""
    quiet = [p.b_tokens_per_s for p in phases["quiet"]]
    syncing = [p.b_tokens_per_s for p in phases["syncing"]]
    ratios = [s / q for s, q in zip(syncing, quiet, strict=True)]
    stalls = sorted(s for p in phases["syncing"] for s in p.stalls)
    every = [*phases["quiet"], *phases["syncing"]]
    return {
        "b_tokens_per_s": {
            "quiet": round(statistics.median(quiet), 1),
            "syncing": round(statistics.median(syncing), 1),
            "quiet_rounds": [round(v, 1) for v in quiet],
            "syncing_rounds": [round(v, 1) for v in syncing],
        },
        "b_tokens": {name: [p.b_tokens for p in rows] for name, rows in phases.items()},
        "ratio": round(statistics.median(ratios), 4),
        "ratios": [round(v, 4) for v in ratios],
        "goal": 0.95,
        "adapter_syncs": {
            "count": len(stalls),
            "per_round": [len(p.stalls) for p in phases["syncing"]],
            "stall_s": {
                "p50": round(_percentile(stalls, 50), 4),
                "p90": round(_percentile(stalls, 90), 4),
                "max": round(max(stalls), 4),
            },
            "a_paused_share": [round(sum(p.stalls) / p.b_seconds, 3) for p in phases["syncing"]],
            "b_ms_lost_per_sync": round(1000 * statistics.median(_lost_per_sync(phases)), 2),
        },
        "cpu_cores_while_b_ran": {name: _median_cores(rows) for name, rows in phases.items()},
        "versions": versions,
        "base_version_unchanged": base_unchanged,
        "error_rollouts": sum(p.errors for p in every),
        "exactly_once": all(p.exactly_once for p in every),
    }


def _lost_per_sync(phases: dict[str, list[Phase]]) -> list[float]:
    """Per round: B's extra seconds in the syncing phase over its syncs (what one sync costs B at this gap: A's
    rows are prefilled again after each, so it grows with how far they got since the last)."""
    return [
        (s.b_seconds - q.b_seconds) / max(1, len(s.stalls))
        for q, s in zip(phases["quiet"], phases["syncing"], strict=True)
    ]


def _median_cores(rows: list[Phase]) -> dict[str, float]:
    return {name: round(statistics.median(p.cores[name] for p in rows), 3) for name in rows[0].cores}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: a value that was measured)."""
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def _config(settings: Settings, work: Work) -> dict[str, Any]:
    model = settings.model
    return {
        "rounds": settings.rounds,
        "mode": settings.mode,
        "sync_gap_s": settings.sync_gap_s,
        "b_prompts": work.b_prompts,
        "a_prompts": work.a_prompts,
        "n": work.n,
        "tokens": work.tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "engine": settings.engine.kind if settings.engine else "torch",
        "worker_args": settings.worker_args(),
        "max_loras": 2,
        "max_batch": settings.max_batch,
        "model": str(model) if model is not None else "tiny (built for the run)",
    }


def _check_alive(worker: subprocess.Popen[bytes], log: Path) -> None:
    if worker.poll() is not None:
        raise RuntimeError(f"the worker exited with code {worker.returncode}; its log ends: {_tail(log)}")


def _tail(log: Path, chars: int = 400) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return " | ".join(text[-chars:].splitlines())


def _print_round(out: Console, r: int, rounds: int, phases: dict[str, list[Phase]]) -> None:
    quiet, syncing = phases["quiet"][-1], phases["syncing"][-1]
    out.print(
        f"round {r + 1}/{rounds}: B {quiet.b_tokens_per_s:,.0f} tok/s quiet, {syncing.b_tokens_per_s:,.0f} tok/s "
        f"while a synced {len(syncing.stalls)}x (ratio {syncing.b_tokens_per_s / quiet.b_tokens_per_s:.3f})"
    )


def plot_bench_lora(result: dict[str, Any], path: Path) -> None:
    """B's tokens/s per round, quiet beside syncing, with the median ratio in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = result["b_tokens_per_s"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, name in ((-0.2, "quiet"), (0.2, "syncing")):
        values = rates[f"{name}_rounds"]
        label = f"{name} (median {rates[name]:,.0f})"
        ax.bar([i + 1 + offset for i in range(len(values))], values, width=0.4, label=label)
    stall = result["adapter_syncs"]["stall_s"]
    ax.set_xlabel("round")
    ax.set_ylabel("adapter B tokens/s")
    ax.set_title(
        f"B while A syncs ({result['config']['mode']}): ratio {result['ratio']:.3f}, "
        f"A stall p50 {stall['p50'] * 1000:.0f} ms"
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_lora(
    ctx: typer.Context,
    model: Annotated[Path | None, typer.Option(help="Base model directory; default: a fresh tiny model.")] = None,
    rounds: Annotated[int, typer.Option(help="Rounds of both phases; medians are reported.")] = 5,
    b_prompts: Annotated[int, typer.Option(help="Adapter B's prompts per phase (B is measured).")] = 8,
    a_prompts: Annotated[int, typer.Option(help="Adapter A's prompts per phase (A is synced).")] = 8,
    n: Annotated[int, typer.Option(help="Samples per prompt.")] = 4,
    tokens: Annotated[int, typer.Option(help="Tokens per sample (greedy).")] = 448,
    mode: Annotated[str, typer.Option(help="Pause mode of A's syncs: keep or abort.")] = "keep",
    sync_gap_s: Annotated[
        float, typer.Option(help="Seconds from one sync of A to its next publish (0: back to back).")
    ] = 0.0,
    max_batch: Annotated[int, typer.Option(help="The worker's largest decode batch.")] = 64,
    engine: Annotated[str, typer.Option(help="The worker's engine: torch or vllm (vLLM's own LoRA).")] = "torch",
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    kv_cache_bytes: KvCacheOpt = None,
    enforce_eager: EagerOpt = True,
    engine_args: EngineArgsOpt = None,
    plot: Annotated[Path | None, typer.Option(help="Also draw B's tokens/s per round to this PNG.")] = None,
) -> None:
    """Adapter B's tokens/s while adapter A syncs back to back, against no sync (goal >= 0.95), and the stall of
    each adapter sync; one worker, JSON out."""
    if engine not in ("torch", "vllm"):
        fail(f"--engine must be torch or vllm, not {engine!r}")
    with user_errors():
        spec = EngineSpec.from_flags(ctx.params, Path("."))  # the model is the run's (Settings.model)
    check_engine(spec, has_model=False)
    settings = Settings(model, rounds, cast(PauseMode, mode), max_batch, sync_gap_s, spec)  # _check_options checks it
    vocab, longest = _check_options(settings, b_prompts, a_prompts, n, tokens)
    if tokens + PROMPT_TOKENS > longest:
        fail(f"--tokens {tokens} + a {PROMPT_TOKENS}-token prompt is longer than the model takes ({longest})")
    with user_errors():
        try:
            result = run_bench_lora(console, settings, make_work(b_prompts, a_prompts, n, tokens, vocab))
        except (RuntimeError, TimeoutError) as exc:  # the worker died or stopped answering: its log's end says why
            fail(str(exc))
        if plot is not None:
            plot_bench_lora(result, plot)
            console.print(f"plot written to {plot}")
    print(json.dumps(result, indent=2))


def _check_options(settings: Settings, b_prompts: int, a_prompts: int, n: int, tokens: int) -> tuple[int, int]:
    """One line per mistake, before anything is built or started; the model's vocabulary size and longest
    sequence (the tiny model's when none is given)."""
    counts = {"--rounds": settings.rounds, "--b-prompts": b_prompts, "--a-prompts": a_prompts, "--n": n}
    for flag, value in (counts | {"--tokens": tokens, "--max-batch": settings.max_batch}).items():
        if value < 1:
            fail(f"{flag} must be at least 1, not {value}")
    if settings.sync_gap_s < 0:
        fail(f"--sync-gap-s must be 0 or more, not {settings.sync_gap_s:g}")
    if settings.mode not in ("keep", "abort"):
        fail(f"--mode must be keep or abort, not {settings.mode!r}")
    if settings.model is None:
        from consumers.engines.tiny_model import VOCAB_SIZE

        return VOCAB_SIZE, TINY_MAX_POSITIONS
    if not (settings.model / "config.json").is_file():
        fail(f"no model at {settings.model} (config.json missing). Build a tiny one with: rollouts tiny-model DIR")
    config = json.loads((settings.model / "config.json").read_text())
    return int(config.get("vocab_size", 512)), int(config.get("max_position_embeddings", TINY_MAX_POSITIONS))

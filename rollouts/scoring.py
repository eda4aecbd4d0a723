"""`rollouts scorer` and `rollouts score-worker`: the scoring stage and the RQ workers it feeds."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from pipeline.registry import default_name
from rollouts.app import (
    DEFAULT_NS,
    DEFAULT_REDIS,
    TOKENIZER_FILES,
    NsOpt,
    RedisOpt,
    app,
    console,
    fail,
    open_streams,
    require,
    setup_logging,
    user_errors,
)

DEFAULT_QUEUE = "rewards"


@app.command()
def scorer(
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    rq: Annotated[
        bool, typer.Option("--rq", help="Run reward functions as RQ jobs (on `rollouts score-worker`s), not inline.")
    ] = False,
    queue: Annotated[str, typer.Option(help="RQ queue of the scoring jobs.")] = DEFAULT_QUEUE,
    timeout_s: Annotated[float, typer.Option(help="A group's reward call longer than this is a reward error.")] = 60.0,
    attempts: Annotated[int, typer.Option(help="RQ: jobs whose worker died are retried up to this many times.")] = 3,
    threads: Annotated[int, typer.Option(help="Inline: reward calls at once.")] = 4,
    lease_s: Annotated[float, typer.Option(help="A scorer silent this long is replaced by a standby.")] = 5.0,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="A local model or tokenizer directory: reward functions get each reply decoded as `text` "
            "(the task library's `producers.tasks.rewards` need it)."
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Name in the scorer's status; default host-pid.")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning.")] = "info",
) -> None:
    """Score the rollouts of prompts that name a `reward_fn` and forward them to the trainer, until interrupted.

    Start more than one for a standby: one reads at a time (a lease), the next takes over in `--lease-s`.
    """
    from consumers.scoring.backend import make_backend
    from consumers.scoring.stage import ScoringStage, StageSettings
    from consumers.scoring.text import Decode, load_decoder

    if rq:
        require("rq", purpose="rollouts scorer --rq")
    for flag, value, least in (("--timeout-s", timeout_s, 0), ("--lease-s", lease_s, 0)):
        if not value > least:
            fail(f"{flag} must be > {least}, not {value:g}")
    for flag, count in (("--attempts", attempts), ("--threads", threads)):
        if count < 1:
            fail(f"{flag} must be at least 1, not {count}")
    if rq and not queue:
        fail("--queue must name an RQ queue")
    decode: Decode | None = None
    if tokenizer is not None:
        require("transformers", purpose="rollouts scorer --tokenizer")
        if not tokenizer.is_dir():
            fail(f"--tokenizer {tokenizer}: no such directory (a local model or tokenizer directory)")
        if not any((tokenizer / file).is_file() for file in TOKENIZER_FILES):
            fail(f"--tokenizer {tokenizer}: no tokenizer there ({' or '.join(TOKENIZER_FILES)} missing)")
        try:
            decode = load_decoder(tokenizer)
        except (OSError, ValueError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            fail(f"--tokenizer {tokenizer}: cannot load its tokenizer: {reason}")
    setup_logging(log_level)
    streams = open_streams(redis_url, ns)
    with user_errors(redis_url):
        backend = make_backend(
            "rq" if rq else "inline",
            connection=streams.redis,
            queue=queue,
            timeout_s=timeout_s,
            attempts=attempts,
            threads=threads,
        )
        stage = ScoringStage(streams, backend, name or default_name(), StageSettings(lease_s=lease_s), decode=decode)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        decoding = f", decoding with {tokenizer}" if tokenizer is not None else ""
        console.print(f"scorer {stage.name} on {streams.keys.scoring} ({backend.mode}{decoding})")
        stage.run(stop)
    console.print(f"scorer {stage.name} stopped")


@app.command("score-worker")
def score_worker(
    redis_url: RedisOpt = DEFAULT_REDIS,
    queue: Annotated[str, typer.Option(help="RQ queue to score from.")] = DEFAULT_QUEUE,
    name: Annotated[str | None, typer.Option(help="RQ worker name; default host-pid.")] = None,
    burst: Annotated[bool, typer.Option(help="Stop once the queue is empty.")] = False,
    log_level: Annotated[str, typer.Option(help="debug, info, warning.")] = "info",
) -> None:
    """An RQ worker for scoring jobs, with RQ's JSON serializer (same as `rq worker --serializer json QUEUE`).

    The reward functions' modules must be importable here (PYTHONPATH or installed).
    """
    require("rq", purpose="rollouts score-worker")
    if not queue:
        fail("--queue must name an RQ queue")
    from rq import Queue, Worker
    from rq.serializers import JSONSerializer

    from pipeline.connections import connect

    with user_errors(redis_url):
        connection = connect(redis_url)
        jobs = Queue(queue, connection=connection, serializer=JSONSerializer)
        worker = Worker([jobs], connection=connection, serializer=JSONSerializer, name=name or default_name())
        console.print(f"score-worker {worker.name} on RQ queue {queue!r}")
        worker.work(burst=burst, logging_level=log_level.upper(), with_scheduler=False)

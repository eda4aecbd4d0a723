"""`rollouts record` and `rollouts replay`: a namespace's rollouts to Parquet files, and back onto a namespace."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from pipeline.wire import RECORDER
from rollouts.app import (
    DEFAULT_NS,
    DEFAULT_REDIS,
    NsOpt,
    RedisOpt,
    app,
    check_output_dir,
    console,
    fail,
    open_streams,
    setup_logging,
    user_errors,
)


@app.command()
def record(
    to: Annotated[Path, typer.Option("--to", help="Directory for the Parquet files (made if missing).")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    group: Annotated[
        str, typer.Option(help="Consumer group on {ns}:rollouts; a second recorder of every rollout needs another.")
    ] = RECORDER,
    roll_mb: Annotated[float, typer.Option(help="Close a file once it holds this many MiB ...")] = 64.0,
    roll_s: Annotated[
        float, typer.Option(help="... or once it is this many seconds old (its entries are acked only then).")
    ] = 60.0,
    log_level: Annotated[str, typer.Option(help="debug, info (a line per file), warning.")] = "info",
) -> None:
    """Record every rollout of the namespace to Parquet files, until interrupted (SIGINT/SIGTERM finish the open file).

    Crash-safe: a file is flushed and renamed before its entries are acked, so a recorder killed at any
    moment loses nothing (restart it on the same directory); at worst an entry is in two files.
    """
    from pipeline.recording import Recorder, RecorderSettings

    setup_logging(log_level)
    if not (roll_mb > 0 and roll_s > 0):
        fail(f"--roll-mb and --roll-s must be > 0, got {roll_mb} and {roll_s}")
    check_output_dir(to, "--to")
    streams = open_streams(redis_url, ns)
    with user_errors(redis_url):
        settings = RecorderSettings(group=group, roll_bytes=max(1, int(roll_mb * 2**20)), roll_s=roll_s)
        recorder = Recorder(streams, to, settings)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        console.print(f"recording {streams.keys.rollouts} (group {group}) to {to}", soft_wrap=True)
        stats = recorder.run(stop)
    skipped = f"; {stats.bad} entries that break the wire contract skipped" if stats.bad else ""
    files = f"{len(stats.files)} file{'' if len(stats.files) == 1 else 's'}"
    console.print(f"recorded {stats.rollouts} rollouts in {files} to {to}{skipped}", soft_wrap=True)


@app.command()
def replay(
    recording: Annotated[Path, typer.Argument(help="The recording's directory, or one of its files.", metavar="DIR")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    rate: Annotated[float | None, typer.Option(help="Rollouts per second (default: as fast as Redis goes).")] = None,
) -> None:
    """Put recorded rollouts back on {ns}:rollouts with their ids unchanged: ids already published there are skipped,
    so replaying into a namespace that has them adds nothing."""
    from pipeline.recording import count_rows
    from pipeline.recording import replay as replay_recording

    if rate is not None and not rate > 0:
        fail(f"--rate is rollouts per second and must be > 0, not {rate}")
    if not recording.exists():
        fail(f"no recording at {recording}")
    streams = open_streams(redis_url, ns)
    with user_errors(redis_url):
        total = count_rows(recording)
        columns = (TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("replay", total=total)
            stats = replay_recording(streams, recording, rate, progress=lambda rows: progress.advance(task, rows))
    console.print(
        f"replayed {stats.read} recorded rows onto {streams.keys.rollouts}: {stats.added} added, "
        f"{stats.present} already there, {stats.duplicates} recorded twice",
        soft_wrap=True,
    )

"""`rollouts demo`: the whole pipeline on an embedded default, in one command."""

from __future__ import annotations

import contextlib
import random
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from consumers.tiny_model import build_tiny_model
from pipeline.cli.processes import start_worker, stop_process, wait_for_worker
from pipeline.local import RedisServer, find_redis_cli
from producers.client import Group, RolloutClient

NS = "demo"


def run_demo(console: Console, prompts: int, n: int, max_tokens: int, keep: bool) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-demo-"))
    with RedisServer() as server:
        url = server.url
        console.print(f"[bold]Redis[/]: private {server.binary.describe()} at {url}", soft_wrap=True)
        with console.status("building the tiny model and tokenizer"):
            model = build_tiny_model(tmp / "model", seed=0)
        console.print(f"[bold]model[/]: tiny Qwen2 at {model}")
        log_file = tmp / "worker.log"
        worker = start_worker(url, NS, model, "demo-worker", "--log-level", "warning", log_file=log_file)
        try:
            client = RolloutClient(url, NS, tokenizer=model)
            with console.status("starting the worker (torch engine)"):
                wait_for_worker(client.streams.redis, NS, "demo-worker", worker, timeout_s=120)
            rng = random.Random(0)
            started = time.monotonic()
            for i in range(prompts):
                a, b = rng.randint(1, 99), rng.randint(1, 99)
                client.submit(
                    f"what is {a} + {b}?", n=n, max_tokens=max_tokens, seed=i, meta={"answer": a + b}, id=f"demo-{i}"
                )
            groups = _receive(console, client, prompts)
            elapsed = time.monotonic() - started
            _summary(console, client, groups, elapsed, server)
            if keep:
                console.print("[bold]--keep[/]: Redis and the worker stay up; Ctrl-C to stop.")
                with contextlib.suppress(KeyboardInterrupt):
                    worker.wait()
        finally:
            stop_process(worker)
    shutil.rmtree(tmp, ignore_errors=True)


def _receive(console: Console, client: RolloutClient, prompts: int) -> list[Group]:
    columns = [TextColumn("groups"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    groups: list[Group] = []
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("groups", total=prompts)
        for group in client.groups(timeout=120):
            groups.append(group)
            progress.advance(task)
            if len(groups) == prompts:
                break
    return groups


def _summary(console: Console, client: RolloutClient, groups: list[Group], elapsed: float, server: RedisServer) -> None:
    rollouts = [r for g in groups for r in g.rollouts]
    tokens = sum(r.n_tokens for r in rollouts)
    table = Table(title="demo summary", show_header=False)
    table.add_row("groups / rollouts", f"{len(groups)} / {len(rollouts)}")
    table.add_row("generated tokens", str(tokens))
    table.add_row("wall time", f"{elapsed:.2f} s")
    table.add_row("throughput", f"{len(rollouts) / elapsed:.1f} rollouts/s, {tokens / elapsed:.0f} tokens/s")
    table.add_row("duplicates dropped", str(client.stats["duplicates"]))
    first = rollouts[0]
    table.add_row("a rollout", f"{first.id}: {first.n_tokens} tokens, finish={first.finish_reason}")
    table.add_row("its text", repr(client.tokenizer.decode(first.tokens.tolist()))[:100])
    table.add_row("mean logprob", f"{float(first.logprobs.mean()):.3f}")
    console.print(table)
    keys = client.streams.keys
    cli = f"{shlex.quote(find_redis_cli())} -p {server.port}"  # the bundled one's full path when none is on PATH
    console.print("[bold]Look inside[/] (while it runs: rollouts demo --keep):")
    for command in (
        f"{cli} XLEN '{keys.rollouts}'",
        f"{cli} XRANGE '{keys.rollouts}' - + COUNT 1",
        f"{cli} XINFO GROUPS '{keys.prompts}'",
        f"{cli} HGETALL '{keys.worker('demo-worker')}'",
        f"rollouts top --redis {server.url} --ns {NS}",
    ):
        console.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)

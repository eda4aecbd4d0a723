"""`rollouts drain`: take workers out of a running fleet, as a planned scale-down or ahead of a preemption."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from pipeline.wire import Control
from rollouts.app import DEFAULT_NS, DEFAULT_REDIS, NsOpt, RedisOpt, app, console, fail, open_streams, user_errors

DRAIN_POLL_S = 0.2
"""How often `rollouts drain --wait` looks at the registry."""


@app.command()
def drain(
    names: Annotated[list[str], typer.Argument(help="The workers to drain, by name (`rollouts top` lists them).")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    ns: NsOpt = DEFAULT_NS,
    grace_s: Annotated[
        float | None,
        typer.Option(
            "--grace-s",
            min=0.0,
            help="A deadline: each worker exits within this many seconds, handing what would not finish to any "
            "worker through {ns}:partials. Default: the worker's own (its --grace-s, else a drain of 30 s).",
        ),
    ] = None,
    wait: Annotated[bool, typer.Option(help="Wait until each has left the registry, showing what it holds.")] = True,
    timeout_s: Annotated[float, typer.Option(min=0.0, help="With --wait: give up after this many seconds.")] = 120.0,
) -> None:
    """Drain workers: each takes no more work, lets what it runs finish (or, past its deadline, hands it on with its
    tokens so far) and exits; `top` shows it `stopping` meanwhile."""
    streams = open_streams(redis_url, ns)
    with user_errors(redis_url):
        live = streams.registry.live_workers()
        unknown = [name for name in names if name not in live]
        if unknown:
            known = ", ".join(sorted(live)) or "none"
            fail(f"no live worker named {', '.join(unknown)} on namespace {ns!r} (live: {known})")
        for name in names:
            streams.control.send(Control(cmd="drain", worker=name, grace_s=grace_s or 0.0))
            console.print(f"{name}: asked to drain" + (f" within {grace_s:g} s" if grace_s is not None else ""))
        if not wait:
            return
        began = time.monotonic()
        left: set[str] = set()
        while len(left) < len(names):
            if time.monotonic() - began > timeout_s:
                still = ", ".join(n for n in names if n not in left)
                fail(f"{still} still registered after {timeout_s:g} s: see each worker's log, or `rollouts top`")
            held = streams.registry.live_workers_with("held")
            for name in names:
                if name not in held and name not in left:
                    left.add(name)
                    console.print(f"{name}: left after {time.monotonic() - began:.1f} s")
            time.sleep(DRAIN_POLL_S)

"""The flags of a worker process, declared once for `rollouts worker` and `rollouts launch` (typer has no shared
parameter object): the engine's (`rollouts.engine_spec`, their defaults `EngineSpec`'s) and the worker loop's
(`WorkerSettings` fields by their names, their defaults `consumers.settings.DEFAULTS`). `worker_flags` adds them to a
command, which reads them from `ctx.params` (`EngineSpec.from_flags`, `worker_settings`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Collection
from typing import Annotated, Any, TypeVar

import typer

from consumers.settings import DEFAULTS, JOIN_FROM, WorkerSettings
from rollouts.engine_spec import ENGINE_OPTIONS, EngineSpec

MaxInflightOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Samples in flight on the engine at once. Default: as many as the engine decodes at once (torch and "
        "synthetic: --max-batch; vLLM: its max_num_seqs; 256 where the engine does not say); a value given here wins.",
    ),
]
MaxInflightTokensOpt = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="Tokens in flight at once, each sample counted as prompt + max_tokens. Default: the engine's (vLLM: its "
        "KV cache; none on the others); a value given here wins; 0: no limit.",
    ),
]
ClaimIdleOpt = Annotated[int, typer.Option(help="Claim work untouched this long (a dead worker's).")]
HeartbeatOpt = Annotated[float, typer.Option(help="Heartbeat period in seconds.")]
MaxDeliveriesOpt = Annotated[
    int,
    typer.Option(
        min=1,
        help="An entry handed out this many times without finishing runs alone; if two such runs die with their "
        "worker, it goes to {ns}:dead.",
    ),
]
LazyOpt = Annotated[
    bool, typer.Option(help="Start the engine when the first work arrives (heartbeat status `idle` until then).")
]
ReleaseAfterOpt = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        help="Shut the engine down after this many seconds without work (status `released`); work starts it again.",
    ),
]
HandOffOpt = Annotated[
    bool,
    typer.Option(
        help="In an abort sync, hand interrupted samples to any worker through {ns}:partials (durable, the prompt "
        "acked) instead of continuing them here after the resume (nothing through Redis).",
    ),
]
GraceOpt = Annotated[
    float | None,
    typer.Option(
        "--grace-s",
        min=0.0,
        help="A stop notice's deadline (SIGTERM, `rollouts drain`, --notice-file): exit within this many seconds, "
        "handing what would not finish to any worker through {ns}:partials with its tokens so far.",
    ),
]
NoticeFileOpt = Annotated[
    str | None,
    typer.Option(
        help="A file whose appearance is a stop notice (with --grace-s's deadline), as a node agent writes on a "
        "preemption notice."
    ),
]
JoinFromOpt = Annotated[
    str,
    typer.Option(
        help="Where a worker that starts mid-run takes the current version: auto (a live peer that holds it, else the "
        "store, else the next sync), peer (a peer, else the next sync), store (the store, else the next sync), sync.",
    ),
]
ShareWindowOpt = Annotated[
    float,
    typer.Option(
        min=0.0,
        help="As a peer: joiners whose requests arrive within this many seconds of the first are sent the version in "
        "one push.",
    ),
]
DedupeTtlOpt = Annotated[
    int,
    typer.Option(
        min=1,
        help="How long a published rollout id is remembered, so that the same id from another entry (a prompt "
        "submitted twice, a replay) is not published again; Redis holds ~22 B per rollout for this long.",
    ),
]

WORKER_OPTIONS: dict[str, Any] = {
    "max_inflight": MaxInflightOpt,
    "max_inflight_tokens": MaxInflightTokensOpt,
    "claim_idle_ms": ClaimIdleOpt,
    "heartbeat_s": HeartbeatOpt,
    "max_deliveries": MaxDeliveriesOpt,
    "dedupe_ttl_s": DedupeTtlOpt,
    "lazy": LazyOpt,
    "release_after_s": ReleaseAfterOpt,
    "hand_off_partials": HandOffOpt,
    "grace_s": GraceOpt,
    "notice_file": NoticeFileOpt,
    "join_from": JoinFromOpt,
    "share_window_s": ShareWindowOpt,
}
"""The worker loop's options, each named as the `WorkerSettings` field it sets."""
WORKER_FLAGS = tuple(WORKER_OPTIONS)
WORKER_DEFAULTS: dict[str, Any] = {name: getattr(DEFAULTS, name) for name in WORKER_FLAGS}
"""Their defaults, the settings' own (an option that is no `WorkerSettings` field fails here, at import)."""

ENGINE_DEFAULTS: dict[str, Any] = {
    field.name: field.default for field in dataclasses.fields(EngineSpec) if field.name in ENGINE_OPTIONS
} | {"engine": "torch", "engine_args": None}
"""Their defaults: `EngineSpec`'s, the torch engine, no `--engine-args`."""

Command = TypeVar("Command", bound=Callable[..., None])


def worker_flags(*, leave_out: Collection[str] = ()) -> Callable[[Command], Command]:
    """Add the engine's options, then the worker loop's, to a typer command (less those named in `leave_out`), after
    its own, each with its default. The command is not given them as arguments: it reads them from `ctx.params`."""
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=option, default=defaults[name])
        for options, defaults in ((ENGINE_OPTIONS, ENGINE_DEFAULTS), (WORKER_OPTIONS, WORKER_DEFAULTS))
        for name, option in options.items()
        if name not in leave_out
    ]
    names = {parameter.name for parameter in added}

    def add(command: Command) -> Command:
        own = inspect.signature(command, eval_str=True)

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> None:
            command(*args, **{name: value for name, value in kwargs.items() if name not in names})

        run.__signature__ = own.replace(parameters=[*own.parameters.values(), *added])  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]  # a command of more options, that typer reads from its signature

    return add


def worker_settings(params: dict[str, Any]) -> WorkerSettings:
    """The settings of a worker process of its own from a command's parameters (`ctx.params`): its `WORKER_FLAGS`,
    and what `WorkerSettings.for_process` derives from them. A `--join-from` not among `JOIN_FROM` is a CLI error."""
    from rollouts.app import fail

    if params["join_from"] not in JOIN_FROM:
        fail(f"unknown --join-from {params['join_from']!r}; choose one of {', '.join(JOIN_FROM)}")
    return WorkerSettings.for_process(**{name: params[name] for name in WORKER_FLAGS})

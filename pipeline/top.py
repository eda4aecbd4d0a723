"""What `rollouts top` shows: depth, lag and pending of every stream, live workers, state.

`scorer` is the scoring stage's status hash (`{ns}:scorer`): who holds the lease, the mode, groups
open and running, RQ jobs queued and RQ workers, and the counters `groups`, `rollouts`,
`reward_errors`; its `age_s` says how long ago the leader last wrote it. The scoring lag is the
`scoring` stream's row: rollouts not yet read (`lag`) and read but not yet forwarded (`pending`).
`scoring` sums them up: `waiting` (rollouts on `{ns}:scoring` not yet forwarded to the trainer), `scorer_alive`
(a scorer holds `{ns}:scorer:lease`, see `ScoringStreams.scorer_alive`) and `warning` (a line, or None) when rollouts
wait and no scorer is alive: nothing will score them, and their trainer waits.

`policy` reads `{ns}:state` as numbers: the policy version and sync epoch, and the admission
counters (see `staleness.admission`, which owns them; the capacity formula is repeated here
because `pipeline` imports no other package): samples `submitted`, parked as `stale`, in `used`,
and the `capacity` (η + v + 1) * B with `free` = capacity - used when a producer set limits.
`adapters` holds the same numbers for each LoRA adapter ever published (`{ns}:adapters`), from its own state
hash; each worker's `adapters` field lists the adapters it holds, `name=version`.

A worker's `status` is one of `consumers.lifecycle.WorkerStatus`: `starting`, `serving`, `paused` (in a weight
sync), `awaiting weights` (its version was broadcast before it could receive it), `stopping`, and, for workers run
with `--lazy` / `--release-after-s`, `idle` (no engine started yet) and `released` (engine shut down when idle);
`starts` shows how often its engine started and how long the last start took (to serving the current version).

One snapshot is a plain dict (the `--once --json` output, for scripts); `render` draws it.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group as RichGroup
from rich.table import Table
from rich.text import Text

from pipeline.streams import Streams
from pipeline.wire import SCORERS


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def snapshot(streams: Streams) -> dict[str, Any]:
    """Everything `top` shows, read in a few pipelined round trips (workers from the registry `{ns}:workers`)."""
    keys = streams.keys
    client = streams.redis
    names = {"prompts": keys.prompts, "partials": keys.partials, "scoring": keys.scoring, "rollouts": keys.rollouts}
    names["dead"] = keys.dead
    names["control"] = keys.control
    names["stale"] = keys.stale
    pipe = client.pipeline(transaction=False)
    for key in names.values():
        pipe.exists(key)
        pipe.xlen(key)
    pipe.hgetall(keys.state)
    pipe.hgetall(keys.scorer)
    pipe.smembers(keys.adapters)
    replies = pipe.execute()
    adapters = sorted(_text(name) for name in replies.pop())
    scorer = {_text(k): _text(v) for k, v in replies.pop().items()}
    state = replies.pop()
    result: dict[str, Any] = {"ns": keys.ns, "ts": time.time(), "streams": {}, "workers": {}}
    scoring_groups: list[dict[str, Any]] = []
    for (label, key), exists, length in zip(names.items(), replies[::2], replies[1::2], strict=True):
        if label == "scoring" and not exists:
            continue  # no prompt ever named a reward_fn here
        groups = client.xinfo_groups(key) if exists else []
        if label == "scoring":
            scoring_groups = groups
        result["streams"][label] = {
            "length": length,
            "groups": {  # `lag` is None on Redis 6.2 (7.0 added it) and where 7.x cannot tell it
                _text(g["name"]): {"lag": g.get("lag"), "pending": g["pending"], "consumers": g["consumers"]}
                for g in groups
            },
        }
    result["scoring"] = scoring_backlog(streams, result["streams"].get("scoring"), scoring_groups)
    result["workers"] = streams.registry.live_workers()
    pipe = client.pipeline(transaction=False)
    for name in result["workers"]:
        pipe.zcount(keys.pins(name), result["ts"], "+inf")
    for w, sessions in zip(result["workers"].values(), pipe.execute(), strict=True):
        w["sessions"] = str(sessions)  # gateway sessions pinned to it now (see producers.gateway)
    result["state"] = {_text(k): _text(v) for k, v in state.items()}
    if scorer:
        scorer["age_s"] = round(result["ts"] - float(scorer.get("ts") or 0), 1)
    result["scorer"] = scorer
    result["policy"] = policy(result["state"])
    pipe = client.pipeline(transaction=False)
    for name in adapters:
        pipe.hgetall(keys.state_of(name))
    result["adapters"] = {
        name: policy({_text(k): _text(v) for k, v in fields.items()})
        for name, fields in zip(adapters, pipe.execute(), strict=True)
    }
    return result


UNREAD_SCAN = 1000
"""Where Redis reports no lag (6.2), `top` counts the unread entries of `{ns}:scoring` by reading them, at most this
many a refresh (a lower bound past it): rollouts are kilobytes each."""


def scoring_backlog(streams: Streams, row: dict[str, Any] | None, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """`waiting`, `scorer_alive` and `warning` of the scoring stage, from the `scoring` row of `snapshot` and the
    stream's `XINFO GROUPS`."""
    keys = streams.keys
    waiting = 0
    if row is not None:
        group = next((g for g in groups if _text(g["name"]) == SCORERS), None)
        if group is None:  # no scorer ever read it: all of it waits
            waiting = int(row["length"])
        else:
            unread = group.get("lag")
            if unread is None:  # Redis 6.2 (or a lag 7.x cannot tell): count what follows the last entry read,
                after = "(" + _text(group["last-delivered-id"])  # at most UNREAD_SCAN of them (whole entries)
                unread = len(streams.redis.xrange(keys.scoring, after, "+", count=UNREAD_SCAN) or [])
            waiting = int(unread) + int(group["pending"])
    alive = streams.scoring.scorer_alive()
    warning = None
    if waiting and not alive:
        warning = (
            f"{waiting} rollouts wait on {keys.scoring} for a reward and no scorer is alive (no {keys.scorer_lease}): "
            f"start `rollouts scorer --ns {keys.ns}`"
        )
    return {"waiting": waiting, "scorer_alive": alive, "warning": warning}


def policy(state: dict[str, str]) -> dict[str, Any]:
    """The state's version, sync and admission counters as numbers (`capacity` and `free` None without limits)."""

    def number(name: str) -> int:
        try:
            return int(state.get(name) or 0)
        except ValueError:
            return 0

    version, submitted, stale = number("version"), number("submitted"), number("stale")
    limited = bool(state.get("max_staleness")) and bool(state.get("batch_size"))
    capacity = (number("max_staleness") + version + 1) * number("batch_size") if limited else None
    return {
        "version": version,
        "epoch": number("epoch"),
        "paused": state.get("paused") == "1",
        "submitted": submitted,
        "stale": stale,
        "used": submitted - stale,
        "max_staleness": number("max_staleness") if limited else None,
        "batch_size": number("batch_size") if limited else None,
        "capacity": capacity,
        "free": None if capacity is None else capacity - (submitted - stale),
    }


def render(snap: dict[str, Any]) -> RichGroup:
    streams = Table(title=f"rollouts top — namespace {snap['ns']}", expand=True)
    for column in ("stream", "length", "group", "lag", "pending", "consumers"):
        streams.add_column(column, justify="left" if column in ("stream", "group") else "right")
    for label, info in snap["streams"].items():
        groups = info["groups"] or {"-": {"lag": "", "pending": "", "consumers": ""}}
        for i, (group, g) in enumerate(groups.items()):
            streams.add_row(
                label if i == 0 else "",
                str(info["length"]) if i == 0 else "",
                group,
                "-" if g["lag"] is None else str(g["lag"]),  # Redis 6.2 reports no lag
                str(g["pending"]),
                str(g["consumers"]),
            )
    workers = Table(title=f"workers ({len(snap['workers'])} live)", expand=True)
    columns: tuple[str, ...] = ("worker", "status", "engine", "starts", "version", "adapters", "inflight", "sessions")
    columns += ("published", "tokens/s")
    for column in columns:
        workers.add_column(column, justify="left" if column in ("worker", "status", "engine", "adapters") else "right")
    for name, w in sorted(snap["workers"].items()):
        workers.add_row(
            name,
            w.get("status", "?"),
            w.get("engine", "?"),
            _starts(w),
            w.get("version", "?"),
            w.get("adapters") or "-",
            w.get("inflight", "?"),
            w.get("sessions", "0"),
            w.get("published", "?"),
            w.get("tokens_per_s", "?"),
        )
    p = snap.get("policy") or policy(snap.get("state", {}))
    limits = "no admission limit"
    if p["capacity"] is not None:
        limits = f"max_staleness={p['max_staleness']}, batch_size={p['batch_size']}"
    counters = Table(title=f"policy and admission ({limits})", expand=True)
    adapters = snap.get("adapters") or {}
    columns = ("model", "version", "epoch", "paused", "submitted", "stale", "in use", "capacity", "free")
    for column in columns if adapters else columns[1:]:  # a row per adapter, when there are any
        counters.add_column(column, justify="left" if column == "model" else "right")
    rows = {"base": p} | {f"adapter {name}": a for name, a in adapters.items()}
    for label, q in rows.items():
        counters.add_row(
            *([label] if adapters else []),
            str(q["version"]),
            str(q["epoch"]),
            "yes" if q["paused"] else "no",
            str(q["submitted"]),
            str(q["stale"]),
            str(q["used"]),
            "-" if q["capacity"] is None else str(q["capacity"]),
            "-" if q["free"] is None else str(q["free"]),
        )
    parts: list[Table | Text] = [streams, counters, workers]
    if snap.get("scorer"):
        parts.append(_scorer_table(snap["scorer"]))
    scoring = snap.get("scoring") or {}
    if scoring.get("warning"):
        parts.append(Text(f"warning: {scoring['warning']}", style="bold yellow"))
    elif "scoring" in snap["streams"]:
        alive = "a scorer is alive" if scoring.get("scorer_alive") else "no scorer alive"
        parts.append(Text(f"scoring: {scoring.get('waiting', 0)} rollouts wait for a reward; {alive}"))
    return RichGroup(*parts)


def _starts(worker: dict[str, Any]) -> str:
    """Engine starts and the last one's seconds, e.g. `2 (31.4 s)`; `0` for a lazy worker not started yet."""
    starts = worker.get("engine_starts")
    if starts is None:
        return "?"  # a worker of an older version
    return f"{starts} ({float(worker.get('cold_start_s') or 0):.1f} s)" if starts != "0" else "0"


def _scorer_table(scorer: dict[str, Any]) -> Table:
    leader = scorer.get("leader") or "none"
    table = Table(title=f"scoring stage (leader {leader}, {scorer.get('mode', '?')}, {scorer['age_s']} s ago)")
    columns = ("open groups", "running", "rq queued", "rq workers", "retries", "scored groups", "reward errors")
    names = ("open_groups", "running", "queued", "rq_workers", "retries", "groups", "reward_errors")
    for column in columns:
        table.add_column(column, justify="right")
    table.add_row(*(scorer.get(name, "-") for name in names))
    return table

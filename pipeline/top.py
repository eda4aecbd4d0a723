"""What `rollouts top` shows: depth, lag and pending of every stream, live workers, state.

One snapshot is a plain dict (the `--once --json` output, for scripts); `render` draws it.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group as RichGroup
from rich.table import Table

from pipeline.streams import Streams


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def snapshot(streams: Streams) -> dict[str, Any]:
    """Everything `top` shows, read in one pipelined round trip plus one per worker key scan."""
    keys = streams.keys
    client = streams.redis
    names = {"prompts": keys.prompts, "partials": keys.partials, "rollouts": keys.rollouts, "dead": keys.dead}
    names["control"] = keys.control
    pipe = client.pipeline(transaction=False)
    for key in names.values():
        pipe.exists(key)
        pipe.xlen(key)
    pipe.hgetall(keys.state)
    replies = pipe.execute()
    state = replies.pop()
    result: dict[str, Any] = {"ns": keys.ns, "ts": time.time(), "streams": {}, "workers": {}}
    for (label, key), exists, length in zip(names.items(), replies[::2], replies[1::2], strict=True):
        groups = client.xinfo_groups(key) if exists else []
        result["streams"][label] = {
            "length": length,
            "groups": {
                _text(g["name"]): {"lag": g.get("lag"), "pending": g["pending"], "consumers": g["consumers"]}
                for g in groups
            },
        }
    worker_keys = list(client.scan_iter(match=keys.worker_prefix + "*", count=1000))
    pipe = client.pipeline(transaction=False)
    for key in worker_keys:
        pipe.hgetall(key)
    for key, fields in zip(worker_keys, pipe.execute(), strict=True):
        if fields:
            name = _text(key)[len(keys.worker_prefix) :]
            result["workers"][name] = {_text(k): _text(v) for k, v in fields.items()}
    result["state"] = {_text(k): _text(v) for k, v in state.items()}
    return result


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
                str(g["lag"]),
                str(g["pending"]),
                str(g["consumers"]),
            )
    workers = Table(title=f"workers ({len(snap['workers'])} live)", expand=True)
    for column in ("worker", "status", "engine", "version", "inflight", "published", "tokens/s"):
        workers.add_column(column, justify="left" if column in ("worker", "status", "engine") else "right")
    for name, w in sorted(snap["workers"].items()):
        workers.add_row(
            name,
            w.get("status", "?"),
            w.get("engine", "?"),
            w.get("version", "?"),
            w.get("inflight", "?"),
            w.get("published", "?"),
            w.get("tokens_per_s", "?"),
        )
    return RichGroup(streams, workers)

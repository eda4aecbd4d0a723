"""What runs a reward function over one group: import it by path, call it, check what it returned.

The same function runs on RQ workers (`score_group` is the job; its arguments and result are JSON,
never pickle) and inline, so that both modes score alike. A reward function takes one rollout (a
dict, see `rollout_view`) and returns a number, or, marked with `group_reward`, takes the whole
group (a list of those dicts) and returns one number per sample. Either may be `async def`. Where the stage has a
tokenizer, each dict has the reply decoded in `text` too.

Nothing the function does escapes as an exception: raising, hanging past the RQ job timeout (RQ
raises its timeout inside the call) or returning a non-number all become `{"error": ...}`, which
the stage turns into `reward_error` on every rollout of the group. Only a dead scorer process makes
the job itself fail, and that the stage retries.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.wire import REWARD_FN_PATTERN, Rollout

F = TypeVar("F", bound=Callable[..., Any])
RolloutView = dict[str, Any]


def group_reward(fn: F) -> F:
    """Mark a reward function that scores a whole group (a list of rollouts) at once."""
    fn.reward_scope = "group"  # type: ignore[attr-defined]  # a marker on the function, read with getattr
    return fn


def rollout_view(rollout: Rollout, text: str | None = None) -> RolloutView:
    """The JSON-able view of a rollout that reward functions get (token ids as lists, no logprobs), with the reply
    decoded as `text` where the stage has a tokenizer (`rollouts scorer --tokenizer DIR`)."""
    view: RolloutView = {
        "id": rollout.id,
        "prompt_id": rollout.prompt_id,
        "sample": rollout.sample,
        "n": rollout.n,
        "prompt_tokens": rollout.prompt_tokens.tolist(),
        "tokens": rollout.tokens.tolist(),
        "finish_reason": rollout.finish_reason,
        "version": rollout.version,
        "meta": rollout.meta,
        "error": rollout.error,
    }
    if text is not None:
        view["text"] = text
    return view


def load_reward_fn(path: str) -> Callable[..., Any]:
    """`module:function` (or `module:Class.method`) to the callable; `ValueError` says what is wrong."""
    if not re.match(REWARD_FN_PATTERN, path):
        raise ValueError(f"reward function {path!r} is not an import path like 'my_rewards:exact_match'")
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import reward module {module_name!r}: {exc}") from None
    for name in attribute.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise ValueError(f"reward module {module_name!r} has no {attribute!r}") from None
    if not callable(target):
        raise ValueError(f"{path} is not callable")
    return target


def score_group(reward_fn: str, rollouts: list[RolloutView]) -> dict[str, Any]:
    """The job: `{"rewards": [float | None, ...]}` (None for rollouts whose generation failed) or `{"error": ...}`."""
    try:
        fn = load_reward_fn(reward_fn)
        if getattr(fn, "reward_scope", "rollout") == "group":
            values = _call(fn, rollouts)
            if not isinstance(values, list | tuple) or len(values) != len(rollouts):
                raise ValueError(f"a group reward must return {len(rollouts)} numbers, got {_show(values)}")
            return {"rewards": [_number(v) for v in values]}
        values = zip(rollouts, _call_each(fn, rollouts), strict=True)
        return {"rewards": [None if r["finish_reason"] == "error" else _number(v) for r, v in values]}
    except (Exception, SystemExit) as exc:  # its own failure, RQ's timeout raised in it, or exit() (`sys:exit`)
        return {"error": f"{reward_fn}: {type(exc).__name__}: {exc}"}


def _call(fn: Callable[..., Any], argument: Any) -> Any:
    result = fn(argument)
    if inspect.isawaitable(result):
        result = asyncio.run(_gather([result]))[0]
    return result


def _call_each(fn: Callable[..., Any], rollouts: list[RolloutView]) -> list[Any]:
    """`fn` on each rollout whose generation did not fail (None for those); an async `fn` runs on all of
    them at once, in one event loop (a judge called over the network waits once, not n times)."""
    results = [None if r["finish_reason"] == "error" else fn(r) for r in rollouts]
    waiting = [i for i, result in enumerate(results) if inspect.isawaitable(result)]
    if waiting:
        for i, value in zip(waiting, asyncio.run(_gather([results[i] for i in waiting])), strict=True):
            results[i] = value
    return results


async def _gather(awaitables: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*awaitables))


def _number(value: Any) -> float:
    if isinstance(value, numbers.Real):  # bool and numpy scalars too
        number = float(value)
        if math.isfinite(number):
            return number
    raise ValueError(f"a reward must be a finite number, got {_show(value)}")


def _show(value: Any) -> str:
    return f"{value!r:.60} ({type(value).__name__})"

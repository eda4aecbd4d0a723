"""What Redis spends on bytes passed through a Lua script, against the same commands sent as they are.

An abort sync at 1,000 workers costs Redis ~370 ms of commands, ~160 ms of them the publish script carrying each
worker's interrupted samples (~4 partials of ~5 KB) into `{ns}:partials` (README, 1,000 workers on one Redis). This
prints, per call, Redis's own time (`INFO commandstats`) for: a script that XADDs 4 blobs of each size, the same 4
XADDs sent raw, a script that only receives the 4 blobs, and the publish script itself with 4 real partials (its
XACK and XADDs counted inside it). JSON on stdout; `ROLLOUTS_REDIS_SERVER` picks the server.

    python benchmarks/probes/lua_arg_cost.py --calls 400
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import cast

import numpy as np
import redis
from redis.client import Pipeline

from pipeline.codec import RawFields, for_redis
from pipeline.local import RedisServer, find_redis_server
from pipeline.lua import sources
from pipeline.streams import SCRIPTS, Entry, Publish, Streams
from pipeline.wire import GENERATORS, Partial, Prompt

XADD_ALL = "for i = 1, #ARGV do redis.call('XADD', KEYS[1], '*', 'p', ARGV[i]) end return 1"
RECEIVE_ONLY = "return 1"


def per_call_us(r: redis.Redis, calls: int, send: Callable[[Pipeline], object]) -> dict[str, float]:
    """Redis's time per call of each command that `send(pipeline)` queued `calls` times."""
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    for _ in range(calls):
        send(pipe)
    pipe.execute()
    return command_us(r)


def command_us(r: redis.Redis) -> dict[str, float]:
    """µs a call of each command since `CONFIG RESETSTAT`, as Redis timed them (not the resetting itself)."""
    stats = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): round(v["usec"] / v["calls"], 1) for k, v in stats.items() if "config" not in k}


def publish_ways(r: redis.Redis, calls: int) -> dict[str, dict[str, float]]:
    """One abort-sync publish of 4 partials of 600 generated tokens, two ways, `calls` times each, one round trip a
    publish: the publish script carrying them (today's), and the partials as plain XADDs in a `MULTI` beside a publish
    script that carries none (the proposal). Per publish: Redis's CPU (`INFO cpu`, parsing included) and µs a
    call of each command (`INFO commandstats`; EXEC's includes what it ran)."""
    streams = Streams(r, "cost")
    rng = np.random.default_rng(0)
    prompt = Prompt(id="p", n=4, tokens=rng.integers(0, 1000, 64).astype(np.int32))
    partials = [
        Partial(prompt=prompt, sample=k, generated=rng.integers(0, 1000, 600).astype(np.int32),
                logprobs=rng.random(600).astype(np.float32), spans=[(0, 600, 3)])
        for k in range(4)
    ]  # fmt: skip
    streams.ensure_groups()
    publish_sha = r.script_load(sources(SCRIPTS)["publish"])

    def taken() -> list[Entry]:
        for _ in range(calls):
            r.xadd(streams.keys.prompts, for_redis(prompt.to_fields()))
        reply = r.xreadgroup(GENERATORS, "c", {streams.keys.prompts: ">"}, count=calls)
        (_, entries), *_ = cast("list[tuple[bytes, list[tuple[bytes, RawFields]]]]", reply)  # RESP2, bytes
        return [Entry(streams.keys.prompts, entry_id, {}) for entry_id, _ in entries]

    def in_script(source: Entry) -> None:
        streams.writer.publish_many([Publish((), source, partials, None)])

    def beside_script(source: Entry) -> None:
        buckets, expiry_s = streams.writer.dedupe_buckets()
        keys = [streams.keys.rollouts, source.stream, streams.keys.partials, *buckets]
        transaction = r.pipeline(transaction=True)
        for partial in partials:
            transaction.xadd(streams.keys.partials, for_redis(partial.to_fields()))
        transaction.evalsha(publish_sha, len(keys), *keys, GENERATORS, source.id, expiry_s, 0)
        transaction.execute()

    report = {}
    for name, publish in (("script_carries_partials", in_script), ("multi_beside_script", beside_script)):
        pending = taken()
        r.config_resetstat()
        before = r.info("cpu")
        for source in pending:
            publish(source)
        after = r.info("cpu")
        cpu_s = sum(after[k] - before[k] for k in ("used_cpu_sys", "used_cpu_user"))
        report[name] = {"redis_cpu_us_a_publish": round(cpu_s / calls * 1e6, 1)} | command_us(r)
    return report


def row(r: redis.Redis, calls: int, size: int, xadd_all: str, receive_only: str) -> dict[str, object]:
    """The three ways for 4 blobs of `size` bytes."""
    blobs = [b"x" * size] * 4
    return {
        "bytes_each": size,
        "script_4_xadds": per_call_us(r, calls, lambda p: p.evalsha(xadd_all, 1, f"s{size}", *blobs)),
        "raw_4_xadds": per_call_us(r, calls, lambda p: [p.xadd(f"r{size}", {"p": b}) for b in blobs]),
        "script_receives_4": per_call_us(r, calls, lambda p: p.evalsha(receive_only, 0, *blobs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        xadd_all, receive_only = r.script_load(XADD_ALL), r.script_load(RECEIVE_ONLY)
        rows = [row(r, args.calls, size, xadd_all, receive_only) for size in (10, 1000, 5000)]
        report = {"redis": find_redis_server().describe(), "calls": args.calls, "rows": rows}
        report["publish_4_partials"] = publish_ways(r, args.calls)
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

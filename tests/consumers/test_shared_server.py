"""Workers sharing one vLLM server: its pause holders in a real Redis (`consumers.engines.shared_server`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import redis

from consumers.engines.shared_server import SharedPause
from pipeline.wire import Keys

URL = "http://10.0.0.7:8000"


class Server:
    """Records the pause and resume calls that reached the server, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def call(self, what: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            self.calls.append(what)

        return run


def alive(client: redis.Redis, ns: str, *names: str) -> None:
    for name in names:
        client.hset(Keys(ns).worker(name), "status", "serving")


def test_the_server_resumes_only_when_no_live_worker_holds_it_paused(real_redis: redis.Redis, ns: str) -> None:
    alive(real_redis, ns, "a", "b")
    a, b = (SharedPause(real_redis, ns, URL, name) for name in "ab")
    server = Server()

    async def run() -> None:
        await a.pause(server.call("pause a"))  # sync N
        await b.pause(server.call("pause b"))
        assert not await a.resume(server.call("resume a")), "b still holds it"
        assert await b.resume(server.call("resume b"))
        # b is slow: a pauses for sync N+1 before b's late resume of sync N; the server must stay paused.
        await a.pause(server.call("pause a"))
        assert not await b.resume(server.call("late resume b"))
        assert await a.resume(server.call("resume a"))

    asyncio.run(run())
    assert server.calls == ["pause a", "pause b", "resume b", "pause a", "resume a"]
    assert real_redis.scard(a.pausers) == 0


def test_a_holder_whose_worker_died_no_longer_holds_the_server(real_redis: redis.Redis, ns: str) -> None:
    alive(real_redis, ns, "a", "dead")
    a, dead = SharedPause(real_redis, ns, URL, "a"), SharedPause(real_redis, ns, URL + "/", "dead")
    server = Server()

    async def run() -> None:
        await dead.pause(server.call("pause dead"))
        await a.pause(server.call("pause a"))
        real_redis.delete(Keys(ns).worker("dead"))  # its heartbeat expired
        assert await a.resume(server.call("resume a"))

    asyncio.run(run())
    assert server.calls == ["pause dead", "pause a", "resume a"]
    assert real_redis.smembers(a.pausers) == set(), "the dead holder was dropped"


def test_pause_and_resume_of_two_workers_do_not_interleave(real_redis: redis.Redis, ns: str) -> None:
    """A resume cannot slip between another worker's record of its pause and its pause call."""
    alive(real_redis, ns, "a", "b")
    a, b = (SharedPause(real_redis, ns, URL, name) for name in "ab")
    order: list[str] = []

    def slow(what: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            order.append(f"{what} begins")
            # A pause call that takes time (a loaded server), during which the other worker's resume must not reach the
            # server. Not a wait for a condition.
            await asyncio.sleep(0.2)  # behaviour under test: the call's duration
            order.append(f"{what} ends")

        return run

    async def run() -> None:
        await b.pause(slow("pause b"))
        await asyncio.gather(a.pause(slow("pause a")), b.resume(slow("resume b")))

    asyncio.run(run())
    calls = [step.rsplit(" ", 1)[0] for step in order[2:]]
    assert all(calls[i] == calls[i + 1] for i in range(0, len(calls), 2)), f"calls interleaved: {order}"
    assert order[-1] == "pause a ends", "whichever came first, the server ends paused: a holds it"

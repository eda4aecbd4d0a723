"""Join at the current version from a peer: a worker that starts mid-run takes the version from a live worker that
holds it, not from the trainer or the store.

The peer acts as a one-off trainer for its joiners, over the `nccl://` transport's machinery
(`staleness.weights.nccl`): it asks its engine to push (`SharesWeights.push_weights`, a `PeerPush`), and the engine
pushes from where its weights are (the worker's process for torch, vLLM's worker process for vLLM), hosting a
rendezvous on a free port of this host, in checkpoint names, in one broadcast to every joiner that asked: NCCL from
GPU to GPU, or gloo from host copies when a joiner has no GPU or shares one with the peer or another joiner
(`over_host`: NCCL puts no two ranks on one GPU; each `share` says its joiner's GPU). Each joiner receives it through
the worker's normal path (`load_version` of `nccl://PEERHOST:PORT/v{n}`, as itself) and its engine loads it as it
loads a trainer's push. An engine shares only where what it holds are the checkpoint's values exactly (vLLM: on a GPU,
loading directly, one rank; on the CPU vLLM repacks its weights, so a CPU vLLM worker never shares).

The coordination goes through Redis, in plain text and JSON:
1. a worker that can share says so in its heartbeat (`shares` 1: its engine can push its weights, is started and
   awake), with its `version`;
2. a joiner picks a live peer at the state's version that shares (by name, so that joiners at once pick the same
   one) and asks it with a directed `share` control command (`worker`: the peer, `joiner`: itself, `joiner_gpu`: the
   CUDA UUID of its engine's GPU, if any);
3. the peer gathers the requests that arrive within its `share_window_s` of the first into one push, stages its
   version and answers each joiner on `{ns}:share:{joiner}` (a list, expiring: `uri`, `version`, `epoch`, `members`,
   or `error`); the joiner waits for the answer up to the window and `PEER_ANSWER_S`, then joins the push.

The peer keeps generating meanwhile: only a weight sync (or a release) waits, on the engine slot's lock, for the
broadcast to end, so that the version shared is the one it holds. A joiner that gets no answer in time, or whose
receive fails, tries the next peer, then the store, then awaits the next sync (`WorkerSync.load_current`); a version
published while it joined is loaded before it takes work.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from consumers.engines.base import weights_gpu, weights_sharer
from consumers.house import House
from consumers.lifecycle import WorkerStatus
from consumers.settings import PEER_ANSWER_S
from pipeline.local import free_port
from pipeline.wire import Control
from staleness.weights import load_version

log = logging.getLogger(__name__)

SHARES_FIELD = "shares"
"""Heartbeat field: 1 while the worker can send the version it holds to a joiner."""
WINDOW_FIELD = "share_window_s"
"""Heartbeat field: how long it gathers requests into one push (`WorkerSettings.share_window_s`)."""
PEERS_TRIED = 2
"""A joiner asks at most this many peers before it falls back to the store or the next sync."""
SHARE_EPOCH = 1
"""A share's one broadcast, in the peer's fresh rendezvous: its keys are `e1/...`."""
ANSWER_TTL_S = 60
"""How long a peer's answer waits, unread, for its joiner."""


@dataclass(frozen=True)
class ShareAnswer:
    """A peer's answer to a joiner (`{ns}:share:{joiner}`, JSON): the push to join, or why there is none."""

    peer: str
    uri: str = ""
    version: int = -1
    epoch: int = SHARE_EPOCH
    members: int = 0
    """Joiners served by this one push."""
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ShareAnswer:
        try:
            data = json.loads(raw)
            return cls(str(data["peer"]), str(data["uri"]), int(data["version"]), int(data["epoch"]),
                       int(data["members"]), str(data.get("error", "")))  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            return cls("?", error=f"a malformed answer ({exc})")


def over_host(peer_gpu: str, joiner_gpus: Sequence[str]) -> bool:
    """Whether a push goes over gloo from host copies, not over NCCL from the peer's GPU: the peer holds no GPU, a
    joiner has none (or did not say), or two of them share one (NCCL refuses two ranks on one GPU: "Duplicate GPU
    detected"). GPUs are CUDA UUIDs, "" for none."""
    gpus = [peer_gpu, *joiner_gpus]
    return not all(gpus) or len(set(gpus)) < len(gpus)


class PeerShare:
    """The peer's side: gathers `share` requests into one push of the version its engine holds."""

    def __init__(self, house: House) -> None:
        self._streams, self._name, self._slot, self._state = house.streams, house.name, house.slot, house.state
        self._window_s = house.settings.share_window_s
        self._waiting: dict[str, str] = {}
        """The joiners asked in this window, each with its GPU ("" none)."""
        self._gathering = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.pushes = 0
        """Shares pushed (heartbeat `shared_pushes`)."""
        self.joiners = 0
        """Joiners served by them (heartbeat `shared_joiners`)."""

    def can_share(self) -> bool:
        """Whether its engine holds weights it can send now: started, awake, able to push them, and not stopping."""
        state = self._state
        shares = weights_sharer(self._slot.engine) is not None
        return self._slot.started and shares and not state.asleep and not state.stopping.is_set()

    def heartbeat_fields(self) -> dict[str, object]:
        fields: dict[str, object] = {SHARES_FIELD: int(self.can_share()), WINDOW_FIELD: self._window_s}
        if self.pushes:
            fields |= {"shared_pushes": self.pushes, "shared_joiners": self.joiners}
        return fields

    def request(self, joiner: str, gpu: str = "") -> None:
        """A `share` for `joiner` (its engine's weights on GPU `gpu`, "" none): served with every other that arrives
        within `share_window_s`."""
        self._waiting[joiner] = gpu
        if not self._gathering:
            self._gathering = True
            task = asyncio.create_task(self._serve())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self) -> None:
        await asyncio.sleep(self._window_s)
        waiting, self._waiting, self._gathering = self._waiting, {}, False  # a request from now on: the next window
        joiners = list(waiting)
        answered = False
        try:
            async with self._slot.lock:  # a sync or a release waits for the broadcast: the version sent is the one held
                engine = self._slot.engine
                sharer = weights_sharer(engine)
                if sharer is None or not self.can_share():
                    raise RuntimeError("its engine cannot send its weights now (not started, asleep, or not shared)")
                from staleness.weights.nccl import PeerPush

                began, version = time.monotonic(), engine.version
                on_host = over_host(weights_gpu(engine), list(waiting.values()))
                push = PeerPush(socket.gethostname(), free_port(), version, SHARE_EPOCH, len(joiners), PEER_ANSWER_S,
                                on_host)  # fmt: skip
                answer = ShareAnswer(self._name, push.uri, version, SHARE_EPOCH, len(joiners))

                def staged() -> None:  # the rendezvous listens: each joiner is told where to join
                    nonlocal answered
                    self._answer(joiners, answer)
                    answered = True

                stats = await sharer.push_weights(push, staged)
            self.pushes += 1
            self.joiners += stats.workers
            log.info("%s: shared version %d with %s in one push (%d joined, %.1f MB, %s) in %.3f s", self._name,
                     version, ", ".join(joiners), stats.workers, stats.bytes / 1e6, stats.backend,
                     time.monotonic() - began)  # fmt: skip
        except Exception as exc:
            log.warning("%s: could not share with %s: %s", self._name, ", ".join(joiners), exc)
            if not answered:  # each joiner goes on to its next fallback at once, not after its deadline
                try:
                    await asyncio.to_thread(self._answer, joiners, ShareAnswer(self._name, error=str(exc)))
                except Exception as gone:
                    log.warning("%s: could not answer %s either: %s", self._name, ", ".join(joiners), gone)

    def _answer(self, joiners: list[str], answer: ShareAnswer) -> None:
        pipe = self._streams.redis.pipeline(transaction=False)
        for joiner in joiners:
            key = self._streams.keys.share(joiner)
            pipe.rpush(key, answer.to_json())
            pipe.expire(key, ANSWER_TTL_S)
        pipe.execute()


class PeerJoin:
    """The joiner's side: picks a peer at the current version, asks it, and loads what it pushes."""

    def __init__(self, house: House) -> None:
        self._streams, self._name, self._slot = house.streams, house.name, house.slot
        self.source = ""
        """Where the version it joined at came from: `peer:NAME`, `store`, `sync` (awaited), "" (none to load)."""
        self.join_s = 0.0
        """Its launch's catch-up: from reading the state to serving the current version (or awaiting the next)."""

    def peers(self, version: int) -> list[tuple[str, float]]:
        """Live workers that share and hold `version`, by name (joiners at once ask the same one), each with its
        gathering window."""
        live = self._streams.registry.live_workers()
        return sorted(
            (name, float(fields.get(WINDOW_FIELD) or 0))
            for name, fields in live.items()
            if name != self._name
            and fields.get(SHARES_FIELD) == "1"
            and fields.get("status") in (WorkerStatus.SERVING, WorkerStatus.PAUSED)
            and fields.get("version") == str(version)
        )

    async def load(self, version: int) -> str | None:
        """Load `version` (or a newer one a peer holds by now) from a peer into the started engine; returns the uri
        it came from, or None when no peer could send it (each failure logged)."""
        peers = await asyncio.to_thread(self.peers, version)
        for peer, window_s in peers[:PEERS_TRIED]:
            answer = await asyncio.to_thread(self._ask, peer, window_s + PEER_ANSWER_S)
            if answer is None or answer.error or answer.version < version:
                why = "no answer" if answer is None else answer.error or f"it holds version {answer.version}"
                log.warning("%s: peer %s did not share version %d (%s)", self._name, peer, version, why)
                continue
            from staleness.weights.nccl import drop_link

            began = time.monotonic()
            try:
                await load_version(self._slot.engine, answer.uri, answer.version, None, epoch=answer.epoch,
                                   member=self._name, timeout_s=PEER_ANSWER_S)  # fmt: skip
            except Exception as exc:
                log.warning("%s: receiving version %d from peer %s failed: %s", self._name, answer.version, peer, exc)
                continue
            finally:
                drop_link(answer.uri, self._name)
            log.info("%s: loaded version %d from peer %s (one push to %d) in %.3f s", self._name, answer.version,
                     peer, answer.members, time.monotonic() - began)  # fmt: skip
            self.source = f"peer:{peer}"
            return answer.uri
        return None

    def _ask(self, peer: str, wait_s: float) -> ShareAnswer | None:
        """Ask `peer` to share and wait up to `wait_s` for its answer (None: none came)."""
        redis, key = self._streams.redis, self._streams.keys.share(self._name)
        redis.delete(key)  # an earlier join's answer, never read
        gpu = weights_gpu(self._slot.engine)  # the peer pushes from host copies to a joiner on its own GPU
        self._streams.control.send(Control(cmd="share", worker=peer, joiner=self._name, joiner_gpu=gpu), ring=False)
        self._streams.control.ring_one(peer, "share")  # the peer's bell alone: the fleet need not read it
        deadline = time.monotonic() + wait_s
        while deadline > time.monotonic():
            got = redis.blpop([key], timeout=1)  # a second at a time: under the client's socket timeout
            if got:
                return ShareAnswer.from_json(got[1])
        return None

    def heartbeat_fields(self) -> dict[str, object]:
        return {"joined_from": self.source, "join_s": round(self.join_s, 3)} if self.source else {}

"""The trainer's side of the sync protocol: publish a version through a transport and drive its sync, put the fleet
to sleep for a training step and wake it (`SyncDriver`; `RolloutClient.publish_weights`, `sleep` and `wake` delegate
here).

One publish (`SyncDriver.publish`): refuse while another sync is under way; open the transport the spec names
(`staleness.weights.open_transport`); take the next version (`Manager.next_version`); check each tensor against the
live workers' models as it passes (`staleness.weights.layout`) while the transport stores it (or stages it, for one
that pushes); run the manager's sync, with the transport's `push` as its transfer step when it `pushes`; then release
what no worker needs: the transport's older versions, and the version before if it sat in another transport. No
scheme is named here: the transport's class says what it does (`staleness.weights.base.Transport`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

from pipeline.streams import Streams
from pipeline.wire import PauseMode
from staleness.manager import Manager, SyncError, SyncReport

if TYPE_CHECKING:
    from staleness.weights.base import PublishStats
    from staleness.weights.delta import HeldWeights
    from staleness.weights.sources import WeightSource


class PublishOptions(TypedDict, total=False):
    """How `SyncDriver.publish` (and `RolloutClient.publish_weights`) publishes a version; each left out takes
    `SyncDriver.publish`'s default."""

    transport: str
    mode: PauseMode
    ack_timeout_s: float
    adapter: str | None
    adapter_config: dict[str, Any] | None
    bucket_bytes: int | None
    deltas: bool
    full_every: int


class SyncDriver:
    """Drives the syncs and sleeps of one namespace's fleet from the trainer's process, one at a time, and keeps what
    the last one did (`last_sync`, `last_publish`, `last_push`)."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.last_sync: SyncReport | None = None
        """What the last `publish` did: who acked, who was evicted, how long workers stood still."""
        self.last_push: Any = None
        """What the last publish by a transport that pushes moved, and how fast (nccl: `BroadcastStats`); None after a
        publish by one that stores."""
        self.last_publish: PublishStats | None = None
        """What the last `publish` put in its transport: tensors, bytes, the most it held at once."""
        self._manager: Manager | None = None
        """The last sync's manager, whose resume may still be ringing (`Manager.settle`)."""
        self._held: HeldWeights | None = None
        """The last version published with `deltas`, whole: the base of the next delta."""

    def publish(
        self,
        source: WeightSource,
        *,
        transport: str = "redis://",
        mode: PauseMode = "abort",
        ack_timeout_s: float = 60.0,
        adapter: str | None = None,
        adapter_config: dict[str, Any] | None = None,
        bucket_bytes: int | None = None,
        deltas: bool = False,
        full_every: int | None = None,
    ) -> int:
        """Make `source` the next policy version on every worker; returns that version (`RolloutClient.publish_weights`
        says what each argument does). `WeightsMismatch` before any worker pauses for tensors no live worker's model
        takes; `SyncError` while another sync is under way."""
        from staleness.weights import open_transport, remove_published, transport_of  # torch: only trainers publish
        from staleness.weights.base import delta_schemes
        from staleness.weights.delta import DEFAULT_FULL_EVERY, HeldWeights, check_full_every
        from staleness.weights.layout import LayoutCheck, WeightsMismatch, fleet_layouts
        from staleness.weights.sources import named_tensors, read_adapter

        if adapter is not None:
            source, adapter_config = read_adapter(source, adapter_config)
        elif adapter_config is not None:
            raise ValueError("adapter_config is for an adapter's tensors: name the adapter (adapter='...')")
        self.settle()  # the last sync's resume rung to the whole fleet before the next `weights`
        manager = self._manager = Manager(self.streams, ack_timeout_s=ack_timeout_s, adapter=adapter)
        previous = manager.state()
        if previous.paused and not previous.asleep:  # a sync under way may be loading its next version; a sleep waits
            raise SyncError(
                f"a weight sync is under way (epoch {previous.epoch}, version {previous.pending_version}): publish "
                "when it is over; if its driver died, `rollouts manager` finishes it"
            )
        if deltas and not transport_of(transport).sends_deltas:
            raise ValueError(f"deltas=True: {transport} sends whole versions only; deltas go by {delta_schemes()}")
        if deltas and adapter is not None:
            raise ValueError("deltas=True is for the base model: an adapter's versions go whole")
        if full_every is not None and not deltas:
            raise ValueError("full_every is how often deltas=True sends a version whole only: pass deltas=True")
        if deltas:
            every = check_full_every(DEFAULT_FULL_EVERY if full_every is None else full_every)
            self._held = self._held or HeldWeights()
            self._held.full_every = every
        store = open_transport(
            transport,
            redis_client=self.streams.redis,
            ns=self.streams.keys.ns,
            join_timeout_s=ack_timeout_s,
            adapter=adapter,
            bucket_bytes=bucket_bytes,
            held=self._held if deltas else None,
        )
        version = manager.next_version(previous)  # above any a worker serves: a failover may have lost the last bump
        store.remove(version)  # left over by a publish whose sync failed: never announced, safe to replace
        check = LayoutCheck(fleet_layouts(self.streams)) if adapter is None else None
        if check:  # checked as they pass: the transport stores what passed, and drops it all if one fails
            source = check.wrap(named_tensors(source, keep_device=True))
        refused = ""
        try:
            uri = store.publish(source, version, adapter_config=adapter_config)
        except WeightsMismatch as exc:
            refused = f"{exc}; nothing was published and every worker keeps serving version {previous.version}"
        if refused:  # raised here, not in the handler: its traceback would keep the stream's frames (and a tensor)
            raise WeightsMismatch(refused)
        self.last_publish = store.last_publish
        transfer = store.push if store.pushes else None  # sent during the sync, not before
        self.last_sync = manager.sync(version, uri, mode, transfer=transfer, expected=previous.version)
        self.last_push = store.last_push
        store.release(keep=[version])
        if previous.weights_uri:  # the version before may sit in another transport
            remove_published(previous.weights_uri, self.streams.redis, self.streams.keys.ns)
        return version

    def sleep(self, level: int = 1, mode: PauseMode = "abort", ack_timeout_s: float = 60.0) -> SyncReport:
        """Put every worker's engine to sleep (`RolloutClient.sleep`)."""
        self.settle()
        self._manager = Manager(self.streams, ack_timeout_s=ack_timeout_s)
        return self._manager.sleep(level, mode)

    def wake(self) -> SyncReport | None:
        """End a `sleep` without publishing (`RolloutClient.wake`); None if the fleet was not asleep."""
        self.settle()
        self._manager = Manager(self.streams)
        return self._manager.wake()

    def settle(self) -> None:
        """Wait until the last sync's resume has been rung to every worker (`Manager.settle`)."""
        if self._manager is not None:
            self._manager.settle()

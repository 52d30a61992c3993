"""Leases: a job alone in its lane, or the one fifo keeps there until it ends, attached by a
direct channel, runs its calls without asking. Which job may hold a lane's lease is the
dispatcher's decision (`Dispatcher.lease_holder`); this module adds the daemon's own conditions
(the job's client and calls) and sends the grants and revocations.

A lease makes the lane busy with its holder (`Dispatcher.hold`) until the executor gives it
back; the calls it ran meanwhile are reported afterwards (`ran`) and accounted then.
"""

from __future__ import annotations

from salus.daemon.engine.core import Core
from salus.daemon.engine.ports import LaneKey
from salus.daemon.engine.registry import JobRecord
from salus.daemon.wire.executor_ops import Lease


class Leases:
    """The lanes whose job runs direct calls unasked, and those being asked back."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.held: dict[LaneKey, int] = {}
        self.revoking: set[LaneKey] = set()

    def lane_of(self, job_id: int) -> LaneKey | None:
        return next((k for k, j in self.held.items() if j == job_id), None)

    def refresh(self) -> None:
        """Grant each lane's lease to its job when that job is alone there, attached by a
        direct channel, runnable and has nothing queued through the daemon; take it back
        from any holder that no longer qualifies."""
        dispatch = self.core.dispatch
        for lane in dispatch.lanes():
            holder = self.held.get(lane.key)
            wanted = self._candidate(lane.key)
            if holder is not None and holder != wanted:
                self._revoke(lane.key, holder)
            elif (holder is None and wanted is not None and lane.busy_job is None
                  and lane.reserved_for is None and self.lane_of(wanted) is None):
                # (a job still holding another lane's lease, e.g. before its move is taken
                # back, gets this one once that is revoked: `Lease` names no lane, so a
                # grant sent before the old lane's revocation would be cancelled by it)
                record = self.core.registry.live[wanted]
                self.held[lane.key] = wanted
                dispatch.hold(lane.key, wanted)
                self.core.outbox.send(record, Lease(granted=True))
        for key in [k for k in self.held if dispatch.lane(k) is None]:
            self._revoke(key, self.held[key])

    def _revoke(self, key: LaneKey, holder: int) -> None:
        """Ask job `holder`'s executor to give lane `key`'s lease back (once)."""
        registry = self.core.registry
        record = registry.live.get(holder) or registry.ended.get(holder)
        if key in self.revoking or record is None or not self.core.outbox.alive(
                record.executor):
            return
        self.revoking.add(key)
        self.core.outbox.send(record, Lease(granted=False), lane=key)

    def _candidate(self, key: LaneKey) -> int | None:
        """The job to hold lane `key`'s lease, as the dispatcher decides it
        (`Dispatcher.lease_holder`), if its calls may run unasked (`_unasked`)."""
        core = self.core
        if core.stopping or core.pending_policy is not None:
            return None
        return core.dispatch.lease_holder(key, self._unasked)

    def _unasked(self, job_id: int) -> bool:
        """Whether job `job_id`'s calls may run without asking: it is attached by a direct
        channel, has no call queued through the daemon, and is neither held, nor being
        swapped out or cancelled.

        A queued direct call (its `Ready`, in the executor) does not stand in the way: the
        grant answers it (`turns.on_lease`), and a `Run` the daemon sends for it later is
        answered empty under the lease. Without this a job whose `Ready` came with the report
        of its last iteration (a script at every boundary) got the lease only when the two
        were read apart, and paid a round trip per step until then."""
        record = self.core.registry.live.get(job_id)
        if record is None:
            return False
        life = record.life
        return (record.direct and life.phase == "submitted"
                and not any(call.frame is not None for call in record.calls)
                and not (life.held or life.swap_requested or life.cancel_requested))

    def revoked(self, record: JobRecord, key: LaneKey) -> None:
        """The executor gave lane `key`'s lease back (after any call it was running)."""
        self.revoking.discard(key)
        if self.held.get(key) == record.job_id:
            del self.held[key]
            self.core.dispatch.release(key, record.job_id)
        if not record.live:
            self.core.finalize(record)

    def drop(self, job_id: int) -> None:
        """The job's executor died: its leases end with it."""
        for key in [k for k, j in self.held.items() if j == job_id]:
            del self.held[key]
            self.revoking.discard(key)
            self.core.dispatch.release(key, job_id)

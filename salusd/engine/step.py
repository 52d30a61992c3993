"""One step of the engine, run at the end of every command and executor event:

    switch policy when quiet -> swap out who waits for it -> move jobs waiting in a busy lane
    to an idle CPU device -> reconcile the ledgers with the admissions and tell newly placed
    executors where they run -> send the dispatcher's starts -> refresh leases -> emit a memory
    event if memory changed

A moved job is placed as an admitted one is: its ledger regions leave the old device and are
booked on the new one, and its executor hears its new place (`Place`, answered at the boundary
where it waits); on the CPU the device is only a budget, so no data moves.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from salus.daemon.engine.core import Core
from salus.daemon.engine.leases import Leases
from salus.daemon.engine.ledger import aligned
from salus.daemon.engine.registry import JobRecord, requested_memory
from salus.daemon.wire.executor_ops import Place, Run, Step, SwapOut
from salus.scheduler.dispatch import Start

log = logging.getLogger("salusd.engine")


class Stepper:
    """Runs the step; remembers what the last memory event said."""

    def __init__(self, core: Core, leases: Leases) -> None:
        self.core = core
        self.leases = leases
        self._last_memory: object = None
        self._reconciled = -1  # the dispatcher's version the ledgers last matched

    def step(self) -> None:
        core = self.core
        self._switch_if_quiet()
        for record in core.registry:
            if record.life.swap_requested and not core.dispatch.running(record.job_id):
                self._swap_out(record)
        if not core.stopping and core.pending_policy is None:
            self._move()
        self._place()
        if not core.stopping and core.pending_policy is None:
            for start in core.dispatch.schedule():
                self._start(start)
        self.leases.refresh()

    def _switch_if_quiet(self) -> None:
        core = self.core
        if core.pending_policy is None or core.dispatch.busy:
            return
        policy, core.pending_policy = core.pending_policy, None
        old = core.dispatch.policy.name
        core.take(core.dispatch.set_policy(policy))
        core.event("policy", -1, policy=policy.name, previous=old)
        log.info("policy switched from %s to %s", old, policy.name)

    def _swap_out(self, record: JobRecord) -> None:
        record.life.swapped_out()
        for executor in record.replicas:
            self.core.outbox.send_to(executor, SwapOut())
        self.core.event("swap_out", record.job_id)
        self.core.take(self.core.dispatch.swap_out(record.job_id))

    def _move(self) -> None:
        """Jobs waiting for a turn in a busy lane move to an idle device (CPU only)."""
        update = self.core.dispatch.rebalance()
        for p, was in update.moved:
            self.core.event("move", p.job_id, p.device, p.lane_id, moved_from=was)
            log.info("job %d moved from device %d to device %d, where nothing ran",
                     p.job_id, was, p.device)
        self.core.take(update)

    def _place(self) -> None:
        """Reconcile the ledgers with the scheduler's admissions, and tell newly placed
        executors where they run."""
        core = self.core
        if core.dispatch.version != self._reconciled:
            self._reconcile()
        placed, core.placed = core.placed, []
        for p in placed:
            core.event("admit", p.job_id, p.device, p.lane_id)
            record = core.registry.live.get(p.job_id)
            job = core.dispatch.job(p.job_id)
            lanes = core.dispatch.gang_lanes(p.job_id)
            if record is None or job is None or (p.device, p.lane_id) not in lanes:
                continue  # ended, or placed again since
            replica = lanes.index((p.device, p.lane_id))
            # The cap also holds the executor's cuBLAS workspaces, booked with its context.
            workspace = core.config.workspace_bytes[p.device]
            # A job that asked for its memory (--mem) is capped at that in a larger lane.
            requested = requested_memory(record)
            lane = p.lane_bytes if requested is None else min(p.lane_bytes, aligned(requested))
            core.outbox.send_to(record.replicas[replica], Place(
                core.config.torch_devices[p.device], job.persistent_bytes + lane,
                core.config.compute_slowdowns[p.device], lane=p.lane_id,
                lane_bytes=lane, workspace_bytes=workspace or None))

    def _reconcile(self) -> None:
        """Make each device's ledger hold exactly the scheduler's bookings: every placed job's
        persistent state, every lane, and the executors' contexts of each lane."""
        core = self.core
        for device, ledger in enumerate(core.ledgers):
            wanted: dict[tuple[str, Hashable], int] = {}
            for lane in core.dispatch.lanes(device):
                wanted[("lane", lane.lane_id)] = lane.size
                if lane.contexts:
                    wanted[("contexts", lane.lane_id)] = lane.contexts
                for job_id in lane.residents:
                    job = core.dispatch.job(job_id)
                    assert job is not None
                    wanted[("job", job_id)] = job.persistent_bytes
            for key in list(ledger.regions):
                if wanted.get(key) != ledger.size(key):
                    ledger.remove(key)
            for key, size in wanted.items():
                if ledger.size(key) is None:
                    ledger.place(key, size)
        self._reconciled = core.dispatch.version
        self._memory_event()

    def _start(self, start: Start) -> None:
        """Send the started job's next call (a batch job's next iteration) to its replicas."""
        core = self.core
        record = core.registry.live[start.job_id]
        lanes = list(start.lanes)
        if record.kind == "batch":  # the daemon drives the loop: the next batch, in its lanes
            core.outbox.send_all(record, [Step()] * record.gang, lanes=lanes)
            return
        call = record.calls.popleft()
        # A gang's client frame goes to every replica (`frame` left out); a direct call (a
        # script gang's iteration) waits in each executor (False).
        run = Run(call.counted, False if call.frame is None else
                  True if record.gang == 1 else None)
        core.outbox.send_all(record, [run] * record.gang, lanes=lanes,
                             answer=call.answer, frame=call.frame)
        if call.frame is not None and record.gang == 1:
            call.frame.close_fd()

    def _memory_event(self) -> None:
        """Per device: budget, persistent bytes, lane bytes, free bytes and lanes; and the
        pending queue's length (what metrics show, without reading the engine). Sent when it
        changed: scheduling decisions that move nothing (most boundaries) send none, which
        would fill the event stream's window with copies."""
        core = self.core
        devices = []
        for index, ledger in enumerate(core.ledgers):
            lanes = core.dispatch.lanes(index)
            stats = ledger.stats()
            devices.append({"device": index, "capacity_bytes": stats.capacity,
                            "persistent_bytes": core.dispatch.persistent(index),
                            "lane_bytes": sum(ln.size for ln in lanes),
                            "free_bytes": stats.capacity - stats.used, "lanes": len(lanes)})
        state = (devices, len(core.dispatch.pending()))
        if state == self._last_memory:
            return
        self._last_memory = state
        core.event("memory", -1, devices=devices, pending=state[1])

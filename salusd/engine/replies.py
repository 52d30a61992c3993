"""What the engine does with each executor message: a reply to what it was sent (matched with
the head of its queue, a gang's replicas merged), a message it sent unasked (`ready`: a direct
call waits; `ran`: calls ran under the lease), or its death."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from salus.daemon.engine import admission, checkpoints, gang_failures, replace, scripts
from salus.daemon.engine.booking import booked_persistent
from salus.daemon.engine.core import Core, error_frame, exit_detail
from salus.daemon.engine.leases import Leases
from salus.daemon.engine.ports import LaneKey, Sent
from salus.daemon.engine.registry import Call, JobRecord
from salus.daemon.wire.errors import JobCancelled, JobFailed, SalusError, ShuttingDown
from salus.daemon.wire.executor_ops import (
    UNSOLICITED,
    Attach,
    Attached,
    CallDone,
    Checkpoint,
    DirectChannel,
    Estimate,
    Estimated,
    EstimateFailed,
    Exited,
    Failed,
    Lease,
    Load,
    Loaded,
    Place,
    Placed,
    Progress,
    Ran,
    Ready,
    Refuse,
    Reply,
    Restore,
    Run,
    Step,
    StepDone,
    SwapOut,
    Swapped,
    failure,
    succeeded,
)
from salus.daemon.wire.frames import RawFrame
from salus.scheduler.dispatch import Finished, RanUnderLease

log = logging.getLogger("salusd.engine")


class Replies:
    """Routes executor messages to the engine's parts; `after(fn)` runs a timer's work and
    steps the engine."""

    def __init__(self, core: Core, leases: Leases,
                 after: Callable[[Callable[[], None]], None]) -> None:
        self.core = core
        self.leases = leases
        self.after = after

    def reply(self, executor: object, reply: Reply, frame: RawFrame | None,
              sent: Sent | None) -> None:
        """`executor`'s `reply` to `sent` (None: it spoke unasked, or owed nothing)."""
        core = self.core
        record = core.outbox.job_of(executor)
        if record is not None and isinstance(reply, UNSOLICITED):
            self._unsolicited(record, executor, reply)
            return
        if record is None or sent is None:
            log.warning("unexpected reply from an executor: %r", reply)
            if frame is not None:
                frame.close_fd()
            return
        if sent.gang is not None:
            gang = sent.gang
            call = isinstance(sent.request, Run | Step)
            # A script gang's ranks fail by exiting (`scripts.exited`); a rank that exited
            # answers its peers' run `empty`.
            if call and not succeeded(reply) and record.live and record.script is None:
                if record.kind == "batch":
                    gang_failures.broke(core, record, sent, reply)
                    return
                gang_failures.await_peers(core, gang, lambda: self.after(
                    lambda: gang_failures.peers_late(core, record, gang)))
            if not gang.add(sent.replica, reply, frame):
                return  # other replicas have yet to answer
            reply, frame, sent = gang.merged(), gang.frame, gang.head
            if gang.abandoned:  # answered and failed when a replica did not return
                if frame is not None:
                    frame.close_fd()
                return
            if call and record.live and gang.diverged() and record.script is None:
                frame = gang_failures.diverged(core, record, gang, frame)
        self._answered(record, sent, reply)
        if sent.on_done is not None:
            sent.on_done(reply)
        if sent.answer is not None and frame is not None:
            sent.answer(frame)
        elif frame is not None:
            frame.close_fd()

    def _answered(self, record: JobRecord, sent: Sent, reply: Reply) -> None:
        """The engine's side of the reply to `sent`: what the request's answer changes."""
        core, request = self.core, sent.request
        if isinstance(request, Run | Step):
            self._finished_call(record, sent, reply)
        elif isinstance(request, Lease) and not request.granted and sent.lane is not None:
            self.leases.revoked(record, sent.lane)
        elif isinstance(request, DirectChannel) and succeeded(reply):
            record.direct = True
        elif isinstance(request, Attach) and isinstance(reply, Attached):
            record.persistent_bytes = booked_persistent(record.device_kind, reply)
            if record.live:
                record.life.attached()
            core.event("attach", record.job_id, persistent_bytes=record.persistent_bytes)
        elif isinstance(request, Attach):
            # The state did not load (a class the executor cannot import): the client may
            # attach again, to fresh executors.
            core.outbox.drop_replicas(record)
        elif isinstance(request, Estimate):
            admission.estimated(core, record, reply)
        elif isinstance(request, Load | Restore):
            self._loaded(record, reply)
        elif isinstance(request, Checkpoint):
            checkpoints.written(core, record, reply)
        elif isinstance(request, SwapOut) and record.script is None and isinstance(
                reply, Swapped):
            self._swapped_out(record, reply.swap)
        elif isinstance(request, SwapOut | Place) and isinstance(reply, Swapped):
            scripts.swapped(core, record, reply.swap)
        elif isinstance(request, Place) and isinstance(reply, Placed):
            admission.placed(self.core, record, reply.reserved_bytes)
        elif isinstance(request, Place) and not succeeded(reply) and record.live:
            core.end(record, "failed", f"job {record.job_id} could not be placed: "
                     f"{failure(reply)[:2000]}")

    def _swapped_out(self, record: JobRecord, swap: dict[str, Any]) -> None:
        """A contract job's executor moved its state to host memory: what it left allocated on
        the device (bytes; a gang's replicas summed), in the job's events and the log."""
        left = swap.get("device_bytes_left")
        if type(left) is not int:
            return
        self.core.event("swapped_out", record.job_id, device_bytes_left=left)
        if left:
            log.info("job %d swapped out, leaving %d bytes allocated on its device",
                     record.job_id, left)

    def _unsolicited(self, record: JobRecord, executor: object, message: Reply) -> None:
        """`Ready`: a direct call waits in the executor for its turn; `Ran`: calls ran under
        the job's lease and are accounted now; `Exited`, `Progress`: a script's."""
        core = self.core
        rank = _rank(record, executor)
        if isinstance(message, Ready):
            if not record.live and record.life.grace and not core.stopping:
                # A cancelled script in its grace (`Core.end`): it runs on to its handler's
                # end, its memory no longer booked, as a terminating pod does.
                core.outbox.send_to(executor, Lease(True))
                return
            if not record.live or core.stopping:
                core.outbox.send_to(executor, Refuse(
                    "shutting_down" if core.stopping else "job_cancelled",
                    record.life.reason or "salusd is shutting down"))
                return
            if record.gang > 1 and record.script is not None and not scripts.rank_ready(
                    record, rank):
                return  # a script gang's turn is asked for once all its ranks wait
            self._wants_turn(record, message.counted, message.estimate)
        elif isinstance(message, Exited):  # a script job's command ended
            scripts.exited(core, record, message.code, rank)
            if record.live and scripts.turn_due(record):  # its peers waited for it
                self._wants_turn(record, True, None)
        elif isinstance(message, Progress):
            scripts.progress(core, record, message)
        elif isinstance(message, Ran):
            self._ran(record, message)

    def _ran(self, record: JobRecord, ran: Ran) -> None:
        """Calls ran under the job's lease: account them."""
        core = self.core
        lane = self.leases.lane_of(record.job_id)
        if record.live and (record.life.phase != "submitted" or lane is None):
            return
        record.progress.calls_done += ran.calls
        if record.live:
            record.progress.calls_failed += ran.failed
        core.take(core.dispatch.apply(RanUnderLease(record.job_id, ran.iterations, ran.seconds)))
        if record.live and lane is not None:
            self._accounted(record, lane, ran.iterations, ran.seconds, ran.peak, ran.oom)
            core.event("ran", record.job_id, *lane, calls=ran.calls, iterations=ran.iterations,
                       seconds=ran.seconds, began=ran.began, ended=ran.ended,
                       done=core.done_iterations(record))
        else:  # calls that ran under the lease before the job ended, reported after
            core.event("ran", record.job_id, calls=ran.calls, iterations=ran.iterations,
                       seconds=ran.seconds)

    def _wants_turn(self, record: JobRecord, counted: bool,
                    estimate: Estimated | EstimateFailed | None) -> None:
        """A direct call (a script's next iteration) waits for its turn; the job's first one
        submits it to the scheduler, with the executor's `estimate` of it."""
        core = self.core
        core.queue_call(record, Call(None, None, counted))
        if record.life.phase == "attached" and (record.gang > 1 or not core.config.estimate_first):
            admission.measure_first(core, record, "call")
        elif record.life.phase == "attached":
            # The job's first call: the executor estimated it before asking.
            admission.estimated(core, record, estimate or EstimateFailed(
                "the executor sent no estimate"))

    def _finished_call(self, record: JobRecord, sent: Sent, reply: Reply) -> None:
        core = self.core
        assert sent.lane is not None
        lanes = tuple(sent.gang.lanes) if sent.gang is not None else (sent.lane,)
        done = reply if isinstance(reply, CallDone | StepDone) else None
        seconds = done.seconds if done is not None else 0.0
        empty = isinstance(done, CallDone) and done.empty
        ok = done is not None and done.ok
        # The executor says what it ran: the call asked for may have run under a lease
        # meanwhile, and the next queued call (maybe of the other kind) in its place.
        counted = int(done is not None and done.counted and not empty and not done.oom)
        if not empty:
            record.progress.calls_done += 1
            record.progress.calls_failed += 0 if ok else 1
        if done is not None and done.comm is not None:
            record.progress.comm = done.comm
        core.take(core.dispatch.apply(Finished(record.job_id, lanes, counted, seconds)))
        if record.live and record.life.phase == "submitted" and done is not None:
            self._accounted(record, sent.lane, counted, seconds, done.peak, done.oom)
        elif not record.live:
            # The client had its result (on its direct channel) and closed the job before
            # this reply reached the daemon.
            core.finalize(record)
        extra: dict[str, Any] = {"done": core.done_iterations(record)} if record.live else {}
        if done is not None and done.cache is not None:
            extra["cache"] = done.cache
        core.event("end", record.job_id, sent.lane[0], sent.lane[1], seconds=seconds,
                   iterations=counted, ok=ok, began=done.began if done else None,
                   ended=done.ended if done else None, **extra)
        if record.live and record.kind == "batch":
            checkpoints.batch_step_done(core, record, reply)

    def _accounted(self, record: JobRecord, lane: LaneKey, iterations: int, seconds: float,
                   peak: int | None, oom: bool) -> None:
        """After the scheduler accounted a live job's calls: checkpoint when due, and check
        the measured `peak` against the job's lane."""
        if iterations:
            record.checkpoint.ran(iterations, seconds)
            if record.kind == "interactive":
                checkpoints.maybe(self.core, record)
        if peak is not None:
            admission.check_peak(self.core, record, lane, peak, oom=oom)

    def _loaded(self, record: JobRecord, reply: Reply) -> None:
        """A batch job's entrypoint, or a restored job's checkpoint, was loaded."""
        core = self.core
        if not isinstance(reply, Loaded):
            core.end(record, "failed", f"the job could not be loaded: {failure(reply)[:2000]}")
            return
        record.persistent_bytes = booked_persistent(record.device_kind, reply)
        iteration = reply.iteration
        if record.progress.resumed_from and not iteration and record.live:
            # The registry recorded a checkpoint that the executor found none of: going on from
            # iteration 0 would throw the recorded progress away without a word.
            core.end(record, "failed", f"job {record.job_id}'s checkpoint at iteration "
                     f"{record.progress.resumed_from} could not be read, so it was not "
                     "restarted from iteration 0; submit it again to start afresh")
            return
        if record.progress.resumed_from is not None:  # restored after a restart
            record.progress.resumed_from = record.progress.done_before = iteration
            record.checkpoint.iteration = iteration if iteration else None
            log.info("job %d resumed from its checkpoint at iteration %d", record.job_id,
                     iteration)
        if not record.live:
            return
        record.life.attached()
        core.event("attach", record.job_id, persistent_bytes=record.persistent_bytes,
                   resumed_from=record.progress.resumed_from)
        if record.kind != "batch":
            return
        if iteration >= record.planned_iterations:
            core.end(record, "finished", f"ran its {iteration} iterations")
            return
        record.life.estimating()
        if record.gang > 1 or record.nodes > 1 or not core.config.estimate_first:
            admission.measure_first(core, record, "iteration")
        else:
            core.outbox.send(record, Estimate(frame=False))

    def died(self, executor: object, reason: str, exit_code: int | None, started: bool,
             poisoned: bool, queue: list[Sent]) -> None:
        """The executor is gone (`exit_code`: -N for signal N, None when unknown; `poisoned`:
        it ended because a call poisoned its CUDA context): fail its job with `reason` (unless
        it had already ended, or it goes on from its checkpoint: `replace.py`) and answer
        everything it still owed (`queue`, oldest first). `started`: False for one whose
        process never ran (`reason` is all there is to say)."""
        core = self.core
        record = core.outbox.forget(executor)
        if record is None:
            return
        before = exit_detail(record)
        scripts.died(record, exit_code)
        if not record.live and exit_detail(record) != before:  # it died in its grace
            core.event("exit", record.job_id, **exit_detail(record))
        running = next((s.lane for s in queue if isinstance(s.request, Run | Step)), None)
        leased = self.leases.lane_of(record.job_id)
        if running:
            where = f"while running job {record.job_id} in lane {running[0]}.{running[1]}"
        elif leased:
            where = (f"while running job {record.job_id} in lane {leased[0]}.{leased[1]} (or "
                     "between its calls there)")
        else:
            where = f"while job {record.job_id} was between calls"
        said = f"{reason} {where}" if started else reason
        error: SalusError
        was_live = record.live
        script_gang = record.gang > 1 and record.script is not None
        rank = _rank(record, executor)
        again = scripts.executor_gone(core, record, said)
        replaced = not again and poisoned and replace.may_replace(core, record)
        if again or replaced:  # its command runs again (--restart on-failure), or it goes on
            error = JobFailed(said)
        elif record.live and core.stopping and record.script is not None:
            error = ShuttingDown("salusd is shutting down")  # killed by its SIGTERM: restored
        elif script_gang and record.live:
            # Its peers may wait for it in a collective: SIGTERM and the grace (`Core.end`).
            error = JobFailed(f"rank {rank}: {said}")
            log.warning("%s", error)
            core.end(record, "failed", str(error), grace=True)
        elif record.live:
            error = JobFailed(said)
            log.warning("%s", error)
            core.end(record, "failed", scripts.failed_reason(record, str(error)),
                     executor_gone=True)
        else:
            ended = JobFailed if record.life.end_state == "failed" else JobCancelled
            error = ended(f"job {record.job_id} ended: {record.life.reason}")
        self.leases.drop(record.job_id)
        for sent in queue:
            if sent.lane is not None:
                core.dispatch.release(sent.lane, record.job_id)
            if sent.answer is not None:
                sent.answer(error_frame(error))
            if isinstance(sent.request, Checkpoint):
                record.checkpoint.asked -= 1
            if sent.on_done is not None:
                sent.on_done(Failed(str(error)))
        core.event("executor_died", record.job_id, reason=reason)
        if again:
            scripts.rerun(core, record, self.after)
        elif replaced:
            replace.again(core, record, f"{reason} {where}")
        elif was_live and not script_gang:  # a gang without one replica cannot go on; an
            core.outbox.kill_all(record)  # ended one's replicas may still write checkpoints
        if script_gang and not record.live:
            scripts.settle_grace(core, record)


def _rank(record: JobRecord, executor: object) -> int:
    """`executor`'s replica (a gang's rank) in `record`."""
    return next((r for r, ex in enumerate(record.replicas) if ex is executor), 0)

"""The engine: owns the `IterationScheduler`, turns its decisions into work for executors and
their results back into accounting.

It runs on the daemon's one I/O thread, so it needs no lock; front ends and executors reach it
only through that thread. It never runs job code and never decodes a job's tensors or pickles:
it forwards the client's frames to the job's executor (`ExecutorPort.send`) and the executor's
replies back (`Answer`). A step of the engine reads like vLLM's `EngineCore.step`: a lane falls
idle → ask the scheduler → send the chosen job's next call to its executor → on the result,
account it (iteration time, measured peak) and ask again.

Every message sent to an executor gets exactly one reply, in order, so each executor has a
queue of what it was asked (`_Sent`); a reply is matched with the head of that queue.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from salus.daemon.cluster import ClusterSpec
from salus.daemon.engine.events import Event, EventStream
from salus.daemon.engine.gang import GangReply
from salus.daemon.engine.ledger import DeviceLedger, aligned
from salus.daemon.engine.pipeline_spec import check_pipeline
from salus.daemon.engine.registry import (
    Answer,
    Call,
    EndState,
    JobKind,
    JobRecord,
    Owner,
    Registry,
    check_iterations,
    check_name,
    spec_nodes,
)
from salus.daemon.engine.rendezvous import check_nodes, gang_places
from salus.daemon.wire.errors import (
    BadRequest,
    Busy,
    Conflict,
    DoesNotFit,
    JobCancelled,
    JobFailed,
    SalusError,
    ShuttingDown,
)
from salus.daemon.wire.frames import RawFrame, json_frame
from salus.scheduler import IterationScheduler, Job, JobState, Placement, Policy, make_policy

log = logging.getLogger("salusd.engine")
LaneKey = tuple[int, int]
RSS_NOISE_BYTES = 16 * 2**20
"""On the CPU a call's peak is measured from the executor's resident set, which moves in pages
and includes the allocator's retained memory and torch's lazy start-up (a few MiB on the first
call); overshoots of a lane below this are noise, not growth."""


class ExecutorPort(Protocol):
    """What the engine needs of the executor supervisor."""

    def acquire(self, record: JobRecord, cwd: str | None) -> object:
        """An executor process for `record`, running as its owner."""
        ...

    def send(self, executor: object, meta: dict[str, Any], frame: RawFrame | None) -> None:
        """Send one message (and the client frame that goes with it) to the executor."""
        ...

    def kill(self, executor: object) -> None:
        """End the executor now (SIGKILL)."""
        ...

    def retire(self, executor: object, code: str = "job_cancelled",
               message: str = "the job ended") -> None:
        """Ask the executor to exit once it has answered what it was sent; calls still queued
        on its direct channel get the error `code` with `message`."""
        ...


class JobStore(Protocol):
    """The durable registry (`salusd.state.store.Store`): job ids that never repeat."""

    def new_job(self, name: str, owner: str, uid: int, gid: int, kind: str,
                spec: dict[str, Any], iterations_total: int, priority: float) -> int: ...


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where jobs' checkpoints go (`root/<job id>/`, made by `make_dir` as the job's owner)
    and how often: every `every_iterations` iterations, else every `every_s` seconds of the
    job's own run time."""

    root: str
    make_dir: Callable[[str, Owner], None]
    every_iterations: int | None = None
    every_s: float = 600.0


@dataclass(frozen=True)
class DataCachePolicy:
    """The node's data cache for jobs' `salus.data.CachedDataset`s: level 1 of an owner's jobs
    in `root/<owner>/` (made by `make_dir` as the owner), at most `bytes_per_replica` bytes
    per replica."""

    root: str
    make_dir: Callable[[str, Owner], None]
    bytes_per_replica: int


class Timers(Protocol):
    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None: ...


@dataclass(eq=False)
class _Sent:
    """One message an executor has not answered yet."""

    kind: str
    answer: Answer | None = None
    lane: LaneKey | None = None
    counted: bool = False
    on_done: Callable[[dict[str, Any]], None] | None = None  # gets the executor's reply meta
    gang: GangReply | None = None  # sent to every replica of a gang: their replies merge
    replica: int = 0


def _refuse(call: Call, error: SalusError) -> None:
    """Answer a queued call with `error` (a direct call is answered by its executor when it
    is told the job ended)."""
    if call.frame is not None:
        call.frame.close_fd()
    if call.answer is not None:
        call.answer(error_frame(error))


def error_frame(exc: SalusError) -> RawFrame:
    return json_frame({"ok": False, "code": exc.code, "message": str(exc)})


def ok_frame(result: object = None) -> RawFrame:
    return json_frame({"ok": True, "result": result})


class Engine:
    """Jobs, lanes and executors of one node. `capacities` are the devices' budgets (bytes);
    `device_kinds` says per device whether it is "cpu" or "cuda" (and `torch_devices` its torch
    name); times are seconds on `clock`."""

    def __init__(
        self,
        capacities: Sequence[int],
        policy: str,
        executors: ExecutorPort,
        *,
        clock: Callable[[], float],
        timers: Timers,
        torch_devices: Sequence[str],
        threads: int = 1,
        retention_s: float = 3600.0,
        cancel_grace_s: float = 5.0,
        max_queued_calls: int = 64,
        store: JobStore | None = None,
        checkpoints: CheckpointPolicy | None = None,
        cluster: ClusterSpec | None = None,
        data_cache: DataCachePolicy | None = None,
        compute_slowdowns: Sequence[float] | None = None,
        estimate_first: bool = True,
    ) -> None:
        self.clock = clock
        #: whether a job's first call is estimated on fake tensors before admission (else it is
        #: admitted with its persistent size as the guess and the call is measured; see
        #: `first_call_estimated`)
        self.estimate_first = estimate_first
        #: per device, its simulated compute slowdown (`--cpu-device-slowdown`; 1.0: none)
        self.compute_slowdowns = list(compute_slowdowns or [1.0] * len(capacities))
        self.cluster = cluster
        self.data_cache = data_cache
        self.timers = timers
        self.executors = executors
        self.torch_devices = list(torch_devices)
        self.threads = threads
        self.cancel_grace_s = cancel_grace_s
        self.max_queued_calls = max_queued_calls
        self.ledgers = [DeviceLedger(c) for c in capacities]
        self.sched = IterationScheduler([ld.capacity for ld in self.ledgers],
                                        make_policy(policy), clock)
        self.registry = Registry(clock, retention_s=retention_s)
        self.events = EventStream(keep=1000)
        self.busy: dict[LaneKey, int] = {}
        self.leases: dict[LaneKey, int] = {}  # lanes whose job runs direct calls unasked
        self.revoking: set[LaneKey] = set()
        self.reserved: dict[LaneKey, int] = {}  # idle lanes held for a gang until all are idle
        self._sent: dict[int, deque[_Sent]] = {}  # id(executor) -> what it was asked
        self._by_executor: dict[int, JobRecord] = {}
        self.stopping = False
        self.store = store
        self.checkpoints = checkpoints
        self.pending_policy: Policy | None = None  # switched to once no call runs
        self._last_memory: object = None  # what the last "memory" event said

    # ---- client operations (called by the front end on the I/O thread) ----------------------
    def open(self, owner: Owner, name: object, iterations: object, cwd: str | None, *,
             kind: JobKind = "interactive", spec: dict[str, Any] | None = None,
             priority: float = 1.0, job_id: int | None = None,
             devices: object = 1) -> JobRecord:
        """A new job; an interactive job restored after a restart and waiting for its client
        (same owner and name) is handed back instead, with `resumed_from` set. A new
        interactive job on `devices` > 1 is a gang: its calls run on that many replicas."""
        if self.stopping:
            raise ShuttingDown("salusd is shutting down")
        checked, planned = check_name(name), check_iterations(iterations)
        if kind == "interactive" and job_id is None:
            gang = self.check_devices(devices)
            waiting = next((r for r in self.registry if r.awaiting_client
                            and r.owner.uid == owner.uid and r.name == checked), None)
            if waiting is not None and waiting.gang != gang:
                raise BadRequest(f"job {waiting.job_id} {checked!r} was restored on "
                                 f"{waiting.gang} device(s); connect with devices="
                                 f"{waiting.gang} to go on with it")
            spec = {**(spec or {}), **({"devices": gang} if gang > 1 else {})}
            if waiting is not None:
                waiting.awaiting_client = waiting.held = False
                self._event("reattach", waiting.job_id, iteration=waiting.resumed_from)
                return waiting
        if job_id is None and self.store is not None:
            job_id = self.store.new_job(checked, owner.name, owner.uid, owner.gid, kind,
                                        spec or {}, planned, priority)
        record = self.registry.open(owner, checked, planned, job_id)
        record.threads = self.threads
        record.cwd = cwd
        record.kind, record.spec, record.priority = kind, dict(spec or {}), priority
        record.device_kind = "cuda" if self.torch_devices[0].startswith("cuda") else "cpu"
        if self.checkpoints is not None:
            record.checkpoint_dir = os.path.join(self.checkpoints.root, str(record.job_id))
            self.checkpoints.make_dir(record.checkpoint_dir, owner)
        self._event("open", record.job_id, owner=owner.name, name=record.name, job_kind=kind)
        log.info("job %d %r opened by %s (%s, %d iterations planned)", record.job_id,
                 record.name, owner.name, kind, record.planned_iterations)
        return record

    def submit_batch(self, owner: Owner, name: object, iterations: object, path: str,
                     function: str, priority: float = 1.0, *, devices: int = 1,
                     nodes: int = 1, rendezvous: str | None = None,
                     pipeline: dict[str, Any] | None = None) -> JobRecord:
        """A batch job: its executor imports `path`, calls `function` and the daemon drives
        the loop for `iterations` iterations. With `devices` > 1 it is a gang: one executor
        per device, each running every iteration on its part of the batch (see
        `salusd/executor/gang.py`), admitted on that many devices at once. With `nodes` > 1
        the gang spans that many nodes of the cluster, `devices` on each, and is submitted to
        each node's daemon alike (`salusd/cluster.py`). With `pipeline` ({"placement",
        "microbatches"}) the replicas run the model split into stages instead
        (`salusd/engine/pipeline_spec.py`)."""
        self.check_devices(devices)
        spec: dict[str, Any] = {"entrypoint": f"{path}:{function}", "path": path,
                                "function": function,
                                **check_nodes(nodes, rendezvous, str(name), self.cluster)}
        if devices > 1:
            spec["devices"] = devices
        spec.update(check_pipeline(pipeline, devices, spec_nodes(spec)))
        policy = self.pending_policy or self.sched.policy
        if spec_nodes(spec) > 1 and policy.lane_mode != "pack":
            raise BadRequest(f"a multi-node gang needs lanes of its own, which only the pack "
                             f"policy gives (the policy is {policy.name})")
        record = self.open(owner, name, iterations, os.path.dirname(path), kind="batch",
                           spec=spec, priority=priority)
        self._load(record, restore=False)
        return record

    def check_devices(self, devices: object) -> int:
        """`devices` when this node has that many devices; BadRequest says what it has."""
        if type(devices) is not int or not 1 <= devices <= len(self.ledgers):
            raise BadRequest(f"this node has {len(self.ledgers)} device(s); a job may ask for 1 "
                             f"to {len(self.ledgers)}, not {devices!r}")
        return devices

    def restore(self, owner: Owner, job_id: int, name: str, iterations: int, kind: JobKind,
                spec: dict[str, Any], priority: float, checkpoint_iteration: int | None) -> None:
        """Bring back a job the durable registry says was live when salusd stopped: a batch
        job goes on from its last checkpoint on its own; an interactive one waits, suspended
        at its last checkpoint, for its client to connect again."""
        record = self.open(owner, name, iterations, spec.get("cwd"), kind=kind, spec=spec,
                           priority=priority, job_id=job_id)
        record.resumed_from = checkpoint_iteration or 0
        if spec_nodes(spec) > 1 and self.cluster is None:
            self._end(record, "failed", f"job {job_id} spans {spec_nodes(spec)} nodes and this "
                      "salusd restarted without --cluster")
        elif kind == "batch":
            self._load(record, restore=True)
        elif checkpoint_iteration is None:
            self._end(record, "failed", f"salusd restarted before job {job_id}'s first "
                      "checkpoint, so its state was lost; connect a new job")
        else:
            record.awaiting_client = record.held = True
            self._load(record, restore=True)

    def _load(self, record: JobRecord, restore: bool) -> None:
        self._acquire(record, record.gang)
        if record.kind == "batch":
            meta = {"op": "load", "path": record.spec["path"],
                    "function": record.spec["function"], "restore": restore,
                    "pipeline": record.spec.get("pipeline"),
                    "cache": self._cache_for(record.owner)}
        else:
            meta = {"op": "restore"}
        metas = [{**meta, "dir": self._replica_dir(record, r)} for r in range(record.gang)]
        places = gang_places(record.spec, record.gang, record.owner.name, self.cluster)
        for m, place in zip(metas, places or [], strict=False):
            m["gang"] = place
        self._send_all(record, "load", metas)

    def _cache_for(self, owner: Owner) -> dict[str, Any] | None:
        """Where `owner`'s jobs keep their data cache, and its cap per replica."""
        if self.data_cache is None:
            return None
        path = os.path.join(self.data_cache.root, owner.name)
        self.data_cache.make_dir(path, owner)
        return {"dir": path, "bytes": self.data_cache.bytes_per_replica}

    def _replica_dir(self, record: JobRecord, replica: int) -> str | None:
        """Where replica `replica` of the job keeps its checkpoints."""
        if record.checkpoint_dir is None or record.gang == 1:
            return record.checkpoint_dir
        return os.path.join(record.checkpoint_dir, f"replica{replica}")

    def attach(self, record: JobRecord, frame: RawFrame, answer: Answer) -> None:
        """Forward the client's state to the job's executor, which loads and measures it."""
        self._require_live(record)
        if record.resumed_from is not None and record.kind == "interactive":
            # Restored from a checkpoint: the job already holds its state, so the objects the
            # script built afresh are not loaded.
            frame.close_fd()
            answer(ok_frame({"persistent_bytes": record.persistent_bytes,
                             "resumed_from": record.resumed_from}))
            return
        if record.phase != "open" or record.executor is not None:
            raise BadRequest(f"job {record.job_id} already holds its state; open another job "
                             "with salus.connect() for other objects")
        self._acquire(record, record.gang)
        places = gang_places(record.spec, record.gang, record.owner.name, self.cluster) or [None]
        # Every replica loads the same bytes (a gang's replicas join their group first).
        self._send_all(record, "attach", [{"op": "attach", "gang": p} for p in places],
                       answer=answer, frame=frame)

    def define(self, record: JobRecord, frame: RawFrame, answer: Answer) -> None:
        """Forward a function definition (`@remote.iteration` / `@remote.function`)."""
        self._require_attached(record)
        self._send_all(record, "define", [{"op": "define"}] * record.gang, answer=answer,
                       frame=frame)

    def pull(self, record: JobRecord, frame: RawFrame, answer: Answer) -> None:
        """Forward a request for the job's state; the executor answers after its current call."""
        self._require_attached(record)
        self._send(record, _Sent("pull", answer), {"op": "pull"}, frame)

    def channel(self, record: JobRecord, frame: RawFrame, answer: Answer) -> None:
        """Hand the job's executor the client's end of a direct call channel (the descriptor
        travels with `frame`). Calls on it run at once while the job holds a lease on its lane,
        and are asked for (`ready`) and granted (`run`) one by one otherwise. A gang's calls
        go to every replica, through the daemon: it has no direct channel."""
        self._require_attached(record)
        if record.gang > 1:
            frame.close_fd()
            raise BadRequest(f"job {record.job_id} is a gang of {record.gang} replicas: its "
                             "calls go through salusd to all of them, not on a direct channel")
        self._send(record, _Sent("channel", answer), {"op": "channel"}, frame)

    def call(self, record: JobRecord, frame: RawFrame, answer: Answer, counted: bool) -> None:
        """Queue one call; it runs when the policy picks the job in its lane."""
        self._require_live(record)
        if record.phase == "open":
            raise BadRequest(f"job {record.job_id} has no state yet: call job.attach(...) first")
        if self.stopping:
            raise ShuttingDown("salusd is shutting down")
        if len(record.calls) >= self.max_queued_calls:
            raise Busy(f"job {record.job_id} already has {len(record.calls)} calls queued; wait "
                       "for results before submitting more")
        record.calls.append(Call(frame, answer, counted))
        if record.phase == "attached":
            record.phase = "estimating"
            if record.gang > 1 or not self.estimate_first:
                self._measure_first(record, "call")
                return
            self._send(record, _Sent("estimate"), {"op": "estimate"}, frame.duplicate())
        elif record.phase == "submitted":
            self._pump_job(record)
            self._refresh_leases()

    def close(self, record: JobRecord) -> None:
        """The client is done: the job finishes once its running call (if any) has returned."""
        if record.live and not self.stopping:  # at shutdown the job stays, to be restored
            self._end(record, "finished", f"job {record.job_id} was closed by its client")

    def cancel(self, record: JobRecord) -> None:
        """End the job at its next boundary; a call that does not return within
        `cancel_grace_s` seconds has its executor killed."""
        self._require_live(record)
        self._end(record, "cancelled", f"job {record.job_id} was cancelled")

    def suspend(self, record: JobRecord, swap: bool) -> None:
        self._require_live(record)
        record.held = True
        if record.phase == "submitted":
            job = self.sched.jobs[record.job_id]
            if job.state != JobState.SUSPENDED:
                self.sched.suspend(record.job_id)
            if swap:
                record.swap_requested = True
                self._swap_if_idle(record)
        self._event("suspend", record.job_id, swap=swap)
        self._refresh_leases()
        if record.phase == "submitted" and self.checkpoints is not None:
            self.checkpoint(record)

    def resume(self, record: JobRecord) -> None:
        self._require_live(record)
        if not record.held:
            raise Conflict(f"job {record.job_id} is not suspended")
        record.held = record.swap_requested = False
        if record.phase == "submitted":
            was_swapped = record.swapped
            record.swapped = False
            self._apply(self.sched.resume(record.job_id))
            if not was_swapped:
                self._pump_job(record)
        self._event("resume", record.job_id)
        self._refresh_leases()

    def set_priority(self, record: JobRecord, priority: object) -> None:
        self._require_live(record)
        if isinstance(priority, bool) or not isinstance(priority, int | float) or not (
                0 < priority < 1e12):
            raise BadRequest(f"priority must be a number in (0, 1e12), got {priority!r}")
        record.priority = float(priority)
        if record.phase == "submitted":
            self.sched.set_priority(record.job_id, float(priority))
            self._pump_all()
        self._event("priority", record.job_id, priority=float(priority))

    def begin_shutdown(self) -> None:
        """Refuse new work and fail queued calls; running calls finish and answer."""
        self.stopping = True
        self._refresh_leases()
        for record in self.registry:
            while record.calls:
                _refuse(record.calls.popleft(), ShuttingDown("salusd is shutting down"))
            if (self.checkpoints is not None and record.phase == "submitted"
                    and record.since_checkpoint and not record.checkpointing):
                self.checkpoint(record)  # after its running call, if any

    @property
    def idle(self) -> bool:
        """No executor is running a call or writing a checkpoint (shutdown waits for this)."""
        return not self.busy and not any(r.checkpointing for r in self.registry)

    def checkpoint(self, record: JobRecord,
                   on_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Ask the job's executor to write its state at its next boundary; `on_done` gets the
        executor's answer (iteration, bytes, seconds, path, or a message)."""
        self._require_live(record)
        if self.checkpoints is None:
            raise BadRequest("this salusd keeps no checkpoints (started without --state-dir)")
        if record.executor is None or record.phase in ("open", "estimating") or (
                record.phase == "attached" and record.kind == "batch"):
            raise Conflict(f"job {record.job_id} has no state to checkpoint yet")
        record.checkpointing += 1
        record.since_checkpoint, record.since_checkpoint_s = 0, 0.0
        self._send_all(record, "checkpoint", [
            {"op": "checkpoint", "dir": self._replica_dir(record, r), "job": record.job_id}
            for r in range(record.gang)], on_done=on_done)

    def set_policy(self, name: object) -> None:
        """Switch the scheduling policy at the next boundaries: no new call starts until the
        running ones have returned, then every job is admitted under the new policy."""
        try:
            policy = make_policy(str(name))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        spanning = [r.job_id for r in self.registry.live.values() if r.nodes > 1]
        if policy.lane_mode != "pack" and spanning:
            raise BadRequest(f"{policy.name} shares one lane per device, and multi-node gangs "
                             f"{spanning} need lanes of their own: end them first")
        self.pending_policy = policy
        self._refresh_leases()
        self._switch_if_quiet()

    # ---- executor events -------------------------------------------------------------------
    def on_executor_reply(self, executor: object, meta: dict[str, Any],
                          frame: RawFrame | None) -> None:
        """The executor answered the oldest message it was sent."""
        record = self._by_executor.get(id(executor))
        queue = self._sent.get(id(executor))
        if record is not None and meta.get("unsolicited"):
            self._unsolicited(record, meta)
            self._refresh_leases()
            return
        if record is None or not queue:
            log.warning("unexpected reply from an executor: %r", meta)
            if frame is not None:
                frame.close_fd()
            return
        sent = queue.popleft()
        if sent.gang is not None:
            if sent.kind == "run" and not meta.get("ok") and record.live:
                if record.kind == "batch":
                    self._gang_broke(record, sent, meta)
                    return
                self._await_peers(record, sent.gang)
            if not sent.gang.add(sent.replica, meta, frame):
                return  # other replicas have yet to answer
            gang, meta, frame = sent.gang, sent.gang.merged(), sent.gang.frame
            sent = gang.head
            if gang.abandoned:  # answered and failed when a replica did not return
                if frame is not None:
                    frame.close_fd()
                return
            if sent.kind == "run" and record.live and gang.diverged():
                frame = self._diverged(record, gang, frame)
        if sent.kind == "run":
            self._finished_call(record, sent, meta)
        elif sent.kind == "revoke":
            self._revoked(record, sent)
        elif sent.kind == "channel" and meta.get("ok"):
            record.direct = True
        elif sent.kind == "attach" and meta.get("ok"):
            record.persistent_bytes = int(meta["persistent_bytes"])
            record.phase = "attached" if record.live else record.phase
            self._event("attach", record.job_id, persistent_bytes=record.persistent_bytes)
        elif sent.kind == "attach":
            # The state did not load (a class the executor cannot import): the client may
            # attach again, to fresh executors.
            for replica in record.replicas:
                self._by_executor.pop(id(replica), None)
                self._sent.pop(id(replica), None)
                self.executors.retire(replica)
            record.replicas = []
        elif sent.kind == "estimate":
            self._estimated(record, meta)
        elif sent.kind == "load":
            self._loaded(record, meta)
        elif sent.kind == "checkpoint":
            self._checkpointed(record, meta)
        if sent.on_done is not None:
            sent.on_done(meta)
        if sent.answer is not None and frame is not None:
            sent.answer(frame)
        elif frame is not None:
            frame.close_fd()
        self._refresh_leases()

    def on_executor_died(self, executor: object, reason: str) -> None:
        """The executor is gone: fail its job with `reason` (unless it had already ended) and
        answer everything it still owed."""
        record = self._by_executor.pop(id(executor), None)
        queue = self._sent.pop(id(executor), deque())
        if record is None:
            return
        running = next((s.lane for s in queue if s.kind == "run"), None)
        leased = next((k for k, j in self.leases.items() if j == record.job_id), None)
        if running:
            where = f"while running job {record.job_id} in lane {running[0]}.{running[1]}"
        elif leased:
            where = (f"while running job {record.job_id} in lane {leased[0]}.{leased[1]} (or "
                     "between its calls there)")
        else:
            where = f"while job {record.job_id} was between calls"
        error: SalusError
        was_live = record.live
        if record.live:
            error = JobFailed(f"{reason} {where}")
            log.warning("%s", error)
            self._end(record, "failed", str(error), executor_gone=True)
        else:
            ended = JobFailed if record.end_state == "failed" else JobCancelled
            error = ended(f"job {record.job_id} ended: {record.reason}")
        for key in [k for k, j in self.leases.items() if j == record.job_id]:
            del self.leases[key]
            self.revoking.discard(key)
            if self.busy.get(key) == record.job_id:
                del self.busy[key]
        for sent in queue:
            if sent.lane is not None and self.busy.get(sent.lane) == record.job_id:
                del self.busy[sent.lane]
            if sent.answer is not None:
                sent.answer(error_frame(error))
            if sent.kind == "checkpoint":
                record.checkpointing -= 1
            if sent.on_done is not None:
                sent.on_done({"ok": False, "message": str(error)})
        if was_live:  # a gang without one replica cannot go on; an ended one's replicas
            self._kill_all(record)  # were retired and may still be writing their checkpoints
        self._event("executor_died", record.job_id, reason=reason)
        self._switch_if_quiet()
        self._pump_all()
        self._refresh_leases()

    # ---- internals --------------------------------------------------------------------------
    def _acquire(self, record: JobRecord, count: int) -> None:
        """`count` executors for the job (its replicas), known to the engine from now on."""
        record.replicas = [self.executors.acquire(record, record.cwd) for _ in range(count)]
        for executor in record.replicas:
            self._sent[id(executor)] = deque()
            self._by_executor[id(executor)] = record

    def _kill_all(self, record: JobRecord) -> None:
        """Kill every executor of the job that is still running."""
        for executor in record.replicas:
            if id(executor) in self._by_executor:
                self.executors.kill(executor)

    def _send(self, record: JobRecord, sent: _Sent, meta: dict[str, Any],
              frame: RawFrame | None) -> None:
        self._send_to(record.executor, sent, meta, frame)

    def _send_to(self, executor: object, sent: _Sent, meta: dict[str, Any],
                 frame: RawFrame | None = None) -> None:
        """Send one message to `executor`; its reply is matched with `sent`."""
        self._sent[id(executor)].append(sent)
        self.executors.send(executor, meta, frame)

    def _send_all(self, record: JobRecord, kind: str, metas: list[dict[str, Any]], *,
                  lanes: list[LaneKey] | None = None, counted: bool = False,
                  on_done: Callable[[dict[str, Any]], None] | None = None,
                  answer: Answer | None = None, frame: RawFrame | None = None) -> None:
        """Send `metas[r]` (and the client's `frame`, to each) to replica r of the job; their
        replies come back as one (replica 0's `_Sent` with the merged meta; replica 0's reply
        frame goes to `answer`). A job of one replica gets a plain `_send`."""
        if record.gang == 1:
            self._send(record, _Sent(kind, answer, lanes[0] if lanes else None, counted,
                                     on_done), metas[0], frame)
            return
        frames = [frame, *(frame.duplicate() for _ in metas[1:])] if frame is not None else (
            [None] * record.gang)
        gang = GangReply(record.gang, list(lanes or []))
        for replica, (executor, meta) in enumerate(zip(record.replicas, metas, strict=True)):
            sent = _Sent(kind, answer if replica == 0 else None,
                         lanes[replica] if lanes else None, counted,
                         on_done if replica == 0 else None, gang, replica)
            if replica == 0:
                gang.head = sent
            self._send_to(executor, sent, meta, frames[replica])

    # ---- direct calls and leases -------------------------------------------------------------
    def _unsolicited(self, record: JobRecord, meta: dict[str, Any]) -> None:
        """`ready`: a direct call waits in the executor for its turn; `ran`: a call ran under
        the job's lease and is accounted now."""
        op = meta.get("op")
        if op == "ready":
            if not record.live or self.stopping:
                reason = (record.reason or "salusd is shutting down")
                self._send(record, _Sent("refuse"), {"op": "refuse", "code": (
                    "shutting_down" if self.stopping else "job_cancelled"),
                    "message": reason}, None)
                return
            record.calls.append(Call(None, None, bool(meta.get("counted"))))
            if record.phase == "attached" and not self.estimate_first:
                self._measure_first(record, "call")
            elif record.phase == "attached":
                # The job's first call: the executor estimated it before asking.
                estimate = meta.get("estimate")
                self._estimated(record, estimate if isinstance(estimate, dict) else {
                    "ok": False, "reason": "the executor sent no estimate"})
            else:
                self._pump_job(record)
        elif op == "ran" and not record.live:
            # Calls that ran under the lease before the job ended, reported after.
            iterations = int(meta.get("iterations", 0))
            self._count_after_end(record, iterations)
            record.calls_done += int(meta.get("calls", 0))
            self._event("ran", record.job_id, calls=int(meta.get("calls", 0)),
                        iterations=iterations, seconds=float(meta.get("seconds", 0.0)))
        elif op == "ran" and record.live and record.phase == "submitted":
            lane = next(((k for k, j in self.leases.items() if j == record.job_id)), None)
            if lane is None:
                return
            calls, iterations = int(meta.get("calls", 0)), int(meta.get("iterations", 0))
            record.calls_done += calls
            record.calls_failed += int(meta.get("failed", 0))
            made = self._account(record, lane, meta, iterations)
            self._event("ran", record.job_id, *lane, calls=calls, iterations=iterations,
                        seconds=float(meta.get("seconds", 0.0)), began=meta.get("began"),
                        ended=meta.get("ended"))
            self._apply(made)

    def _refresh_leases(self) -> None:
        """Grant each lane's lease to its job when that job is alone there, attached by a
        direct channel, runnable and has nothing queued through the daemon; take it back
        from any holder that no longer qualifies."""
        for lane in self.sched.lanes.lanes():
            key = (lane.device, lane.lane_id)
            holder = self.leases.get(key)
            wanted = self._lease_candidate(lane.residents)
            if holder is not None and holder != wanted:
                self._revoke(key, holder)
            elif (holder is None and wanted is not None and key not in self.busy
                  and key not in self.reserved):
                record = self.registry.live[wanted]
                self.leases[key] = wanted
                self.busy[key] = wanted
                self._send(record, _Sent("grant"), {"op": "lease", "granted": True}, None)
        for key in [k for k in self.leases if self.sched.lanes.lane(*k) is None]:
            self._revoke(key, self.leases[key])

    def _revoke(self, key: LaneKey, holder: int) -> None:
        """Ask job `holder`'s executor to give lane `key`'s lease back (once)."""
        record = self.registry.live.get(holder) or self.registry.ended.get(holder)
        if key in self.revoking or record is None or id(record.executor) not in (
                self._by_executor):
            return
        self.revoking.add(key)
        self._send(record, _Sent("revoke", lane=key), {"op": "lease", "granted": False}, None)

    def _lease_candidate(self, residents: list[int]) -> int | None:
        if len(residents) != 1 or self.stopping or self.pending_policy is not None:
            return None
        record = self.registry.live.get(residents[0])
        job = self.sched.jobs.get(residents[0])
        if (record is None or job is None or not record.direct or record.calls
                or record.held or record.swap_requested or record.cancel_requested
                or record.phase != "submitted"
                or job.state not in (JobState.ADMITTED, JobState.RUNNING)):
            return None
        return record.job_id

    def _revoked(self, record: JobRecord, sent: _Sent) -> None:
        """The executor gave the lease back (after any call it was running)."""
        assert sent.lane is not None
        key = sent.lane
        self.revoking.discard(key)
        if self.leases.get(key) == record.job_id:
            del self.leases[key]
            if self.busy.get(key) == record.job_id:
                del self.busy[key]
        if not record.live:
            self._finalize(record)
        elif record.swap_requested:
            self._swap_if_idle(record)
        self._switch_if_quiet()
        if self.sched.lanes.lane(*key) is not None:
            self._pump(key)
        self._pump_job(record)

    def _estimated(self, record: JobRecord, meta: dict[str, Any]) -> None:
        if not record.live:
            return
        if meta.get("ok"):
            ephemeral = int(meta["bytes"])
            record.estimate_method = str(meta.get("method", "fake-tensor"))
        else:
            # Data-dependent code: admit with the persistent size as the guess; the first real
            # call is measured and the job is moved if it needs more.
            ephemeral = record.persistent_bytes
            record.estimate_method = ("first call measured (no fake-tensor estimate: "
                                      f"{str(meta.get('reason', ''))[:300]})")
        record.estimate_bytes = ephemeral
        job = Job(job_id=record.job_id, submit_s=self.clock(),
                  total_iterations=record.planned_iterations,
                  persistent_bytes=aligned(record.persistent_bytes),
                  ephemeral_bytes=aligned(ephemeral), owner=record.owner.name,
                  name=record.name, priority=record.priority,
                  done_iterations=record.done_before, gang=record.gang,
                  exclusive=record.nodes > 1)
        try:
            made = self.sched.submit(job)
        except ValueError as exc:
            self._event("reject", record.job_id, reason=str(exc))
            self._end(record, "failed", str(DoesNotFit(
                f"job {record.job_id} can never fit: {exc}")))
            return
        record.phase = "submitted"
        if record.held:
            self.sched.suspend(record.job_id)
        self._event("submit", record.job_id, persistent=job.persistent_bytes,
                    ephemeral=job.ephemeral_bytes, method=record.estimate_method)
        self._apply(made)
        self._pump_job(record)

    def _switch_if_quiet(self) -> None:
        if self.pending_policy is None or self.busy:
            return
        policy, self.pending_policy = self.pending_policy, None
        self.reserved.clear()  # the lanes are made anew
        old = self.sched.policy.name
        made = self.sched.set_policy(policy)
        self._event("policy", -1, policy=policy.name, previous=old)
        log.info("policy switched from %s to %s", old, policy.name)
        self._apply(made)
        self._pump_all()

    def _maybe_checkpoint(self, record: JobRecord) -> None:
        policy = self.checkpoints
        if policy is None or record.checkpointing or not record.live or self.stopping:
            return
        if ((policy.every_iterations and record.since_checkpoint >= policy.every_iterations)
                or record.since_checkpoint_s >= policy.every_s):
            self.checkpoint(record)

    def _loaded(self, record: JobRecord, meta: dict[str, Any]) -> None:
        """A batch job's entrypoint, or a restored job's checkpoint, was loaded."""
        if not meta.get("ok"):
            self._end(record, "failed", "the job could not be loaded: "
                      f"{str(meta.get('message', 'no reason given'))[:2000]}")
            return
        record.persistent_bytes = int(meta.get("persistent_bytes", 0))
        iteration = int(meta.get("iteration", 0))
        if record.resumed_from is not None:  # restored after a restart
            record.resumed_from = record.done_before = iteration
            record.checkpoint_iteration = iteration if iteration else None
            log.info("job %d resumed from its checkpoint at iteration %d", record.job_id,
                     iteration)
        if not record.live:
            return
        record.phase = "attached"
        self._event("attach", record.job_id, persistent_bytes=record.persistent_bytes,
                    resumed_from=record.resumed_from)
        if record.kind == "batch":
            if iteration >= record.planned_iterations:
                self._end(record, "finished", f"ran its {iteration} iterations")
                return
            record.phase = "estimating"
            if record.gang > 1 or record.nodes > 1 or not self.estimate_first:
                self._measure_first(record, "iteration")
                return
            self._send(record, _Sent("estimate"), {"op": "estimate", "frame": False}, None)

    def _measure_first(self, record: JobRecord, what: str) -> None:
        """Admit a job without a fake-tensor estimate, with its persistent size as the guess;
        its first real `what` is measured (and re-admits it if it outgrows its lane). A gang
        job always: its replicas call collectives, which one replica run alone would issue
        without its peers. Any job where the daemon measures first calls (`estimate_first`
        False: CPU devices, whose memory is accounted, not enforced)."""
        reason = (f"a gang job is measured on its first {what}"
                  if record.gang > 1 or record.nodes > 1 else
                  f"this daemon measures a job's first {what} (--first-call measure)")
        self._estimated(record, {"ok": False, "reason": reason})

    def _checkpointed(self, record: JobRecord, meta: dict[str, Any]) -> None:
        record.checkpointing -= 1
        if not meta.get("ok"):
            log.warning("job %d: checkpoint failed: %s", record.job_id, meta.get("message"))
            return
        record.checkpoint_iteration = int(meta["iteration"])
        record.checkpoint_time = float(meta["time"])
        record.checkpoint_bytes = int(meta["bytes"])
        self._event("checkpoint", record.job_id, iteration=record.checkpoint_iteration,
                    seconds=float(meta["seconds"]), bytes=record.checkpoint_bytes,
                    path=str(meta.get("path")), time=record.checkpoint_time)

    def _batch_step_done(self, record: JobRecord, meta: dict[str, Any]) -> None:
        """After a batch job's iteration: fail it if its code raised, finish it (with a final
        checkpoint) when it ran all its iterations, else checkpoint when due."""
        if not meta.get("ok"):
            self._end(record, "failed", f"iteration {int(meta.get('iteration', 0)) + 1} "
                      f"raised {str(meta.get('message', ''))[:2000]}")
            return
        record.last_loss = meta.get("loss")
        if isinstance(meta.get("cache"), dict):
            record.cache = meta["cache"]
        if "evaluation" in meta:
            record.last_evaluation = meta["evaluation"]
        job = self.sched.jobs.get(record.job_id)
        if job is not None and job.done:
            reason = f"ran its {job.done_iterations} iterations"
            if self.checkpoints is None:
                self._end(record, "finished", reason)
                return

            def finished(meta: dict[str, Any]) -> None:
                if record.live:  # not ended meanwhile (cancelled, an executor died)
                    self._end(record, "finished", reason if meta.get("ok") else (
                        f"{reason}; its final checkpoint failed: {meta.get('message')}"))

            # Reported finished once its final checkpoint is on disk (a done job is not picked
            # again meanwhile), so whoever reads "finished" finds the state it ended with.
            self.checkpoint(record, on_done=finished)
        else:
            self._maybe_checkpoint(record)

    def _ready(self, job: Job) -> bool:
        record = self.registry.live.get(job.job_id)
        return record is not None and not record.cancel_requested and (
            bool(record.calls) or record.kind == "batch")

    def _pump_job(self, record: JobRecord) -> None:
        for p in self.sched.lanes.placements(record.job_id):
            self._pump((p.device, p.lane_id))

    def _pump_all(self) -> None:
        for lane in self.sched.lanes.lanes():
            self._pump((lane.device, lane.lane_id))

    def _pump(self, key: LaneKey) -> None:
        """If lane `key` is idle, start the call of the job the policy picks."""
        if key in self.busy or self.stopping or self.pending_policy is not None:
            return
        holder = self.reserved.get(key)
        if holder is not None:
            self._start_gang(holder)
            if key in self.reserved or key in self.busy:
                return
        decision = self.sched.next_iteration(*key, ready=self._ready)
        if decision is None:
            return
        record = self.registry.live[decision.job_id]
        if record.gang > 1:
            self._reserve_gang(record)
            return
        if record.kind == "batch":  # the daemon drives the loop: the next batch, in its lane
            self.sched.iteration_started(record.job_id)
            self.busy[key] = record.job_id
            self._send(record, _Sent("run", None, key, True), {"op": "step"}, None)
            return
        call = record.calls.popleft()
        if call.counted:
            self.sched.iteration_started(record.job_id)
        self.busy[key] = record.job_id
        self._send(record, _Sent("run", call.answer, key, call.counted),
                   {"op": "run", "counted": call.counted, "frame": call.frame is not None},
                   call.frame)
        if call.frame is not None:
            call.frame.close_fd()

    def _gang_lanes(self, job_id: int) -> list[LaneKey]:
        """A gang's lanes, by replica rank (placements in device order)."""
        placed = sorted(self.sched.lanes.placements(job_id), key=lambda p: p.device)
        return [(p.device, p.lane_id) for p in placed]

    def _reserve_gang(self, record: JobRecord) -> None:
        """The policy picked gang `record` in one of its lanes: hold all its lanes (all or
        none, so two gangs never hold each other's) and start it once every one is idle."""
        lanes = self._gang_lanes(record.job_id)
        if any(self.reserved.get(k, record.job_id) != record.job_id for k in lanes):
            return  # another gang holds one of them: the policy asks again when it ran
        for key in lanes:
            self.reserved[key] = record.job_id
        self._start_gang(record.job_id)

    def _start_gang(self, job_id: int) -> None:
        """Run one iteration of gang `job_id` on all its lanes if they are all idle; drop its
        reservations if it can no longer run."""
        record = self.registry.live.get(job_id)
        job = self.sched.jobs.get(job_id)
        lanes = self._gang_lanes(job_id) if record is not None else []
        held = [k for k, j in self.reserved.items() if j == job_id]
        if (record is None or job is None or record.cancel_requested or not lanes
                or (record.kind != "batch" and not record.calls)
                or job.state not in (JobState.ADMITTED, JobState.RUNNING)
                or set(held) != set(lanes)):
            for key in held:
                del self.reserved[key]
            for key in held:
                self._pump(key)
            return
        if any(k in self.busy for k in lanes):
            return  # the last busy lane to finish starts it
        for key in lanes:
            del self.reserved[key]
            self.busy[key] = job_id
        if record.kind == "batch":
            self.sched.iteration_started(job_id)
            self._send_all(record, "run", [{"op": "step"}] * record.gang, lanes=lanes,
                           counted=True)
            return
        call = record.calls.popleft()  # the client's call, to every replica
        if call.counted:
            self.sched.iteration_started(job_id)
        self._send_all(record, "run", [{"op": "run", "counted": call.counted}] * record.gang,
                       lanes=lanes, counted=call.counted, answer=call.answer, frame=call.frame)

    def _gang_broke(self, record: JobRecord, sent: _Sent, meta: dict[str, Any]) -> None:
        """A replica's iteration raised: its peers wait in a collective it will never join,
        so the job fails now and every replica is killed (their deaths free the lanes)."""
        message = str(meta.get("message", ""))[:2000]
        self._break_gang(record, f"iteration {int(meta.get('iteration', 0)) + 1} raised on "
                         f"replica {sent.replica}: {message}",
                         [sent.lane] if sent.lane is not None else [])

    def _break_gang(self, record: JobRecord, reason: str, lanes: list[LaneKey]) -> None:
        """Fail gang `record` with `reason` and kill every replica (peers may wait in a
        collective for ever); `lanes` are freed now, the others as their replicas die."""
        for lane in lanes:
            if self.busy.get(lane) == record.job_id:
                del self.busy[lane]
        self._end(record, "failed", reason, executor_gone=True)
        self._kill_all(record)

    def _await_peers(self, record: JobRecord, gang: GangReply) -> None:
        """A replica's call of an interactive gang raised: its peers may wait for it in a
        collective. Give them `cancel_grace_s` seconds to answer (once per call)."""
        if not gang.waiting:
            gang.waiting = True
            self.timers.call_later(self.cancel_grace_s, lambda: self._peers_late(record, gang))

    def _peers_late(self, record: JobRecord, gang: GangReply) -> None:
        """Replicas of a failed gang call did not return in time (stuck in a collective its
        failed peer never joined): the call and the job fail, and every replica is killed."""
        if gang.complete or gang.abandoned or not record.live:
            return
        gang.abandoned = True
        missing = [r for r in range(gang.expected) if r not in gang.metas]
        reason = (f"{gang.raised()} and replica(s) {missing} did not return within "
                  f"{self.cancel_grace_s:g} s (waiting in a collective for it?); the gang "
                  "cannot go on")
        if gang.frame is not None:
            gang.frame.close_fd()
        if gang.head is not None and gang.head.answer is not None and 0 in gang.metas:
            gang.head.answer(error_frame(JobFailed(f"job {record.job_id} failed: {reason}")))
        self._break_gang(record, reason, gang.lanes)

    def _diverged(self, record: JobRecord, gang: GangReply, frame: RawFrame | None) -> RawFrame:
        """A call raised on some replicas and returned on others: their states may differ
        now, so the job fails (after the call's accounting); returns the client's answer."""
        reason = (f"{gang.raised()} and returned on the others, so the replicas' states may "
                  "differ; the gang cannot go on")
        if frame is not None:
            frame.close_fd()
        self._end(record, "failed", reason)
        return error_frame(JobFailed(f"job {record.job_id} failed: {reason}"))

    def _finished_call(self, record: JobRecord, sent: _Sent, meta: dict[str, Any]) -> None:
        assert sent.lane is not None
        lanes = sent.gang.lanes if sent.gang is not None else [sent.lane]
        for key in lanes:
            self.busy.pop(key, None)
        seconds = float(meta.get("seconds", 0.0))
        # The executor says what it ran: the call asked for may have run under a lease
        # meanwhile, and the next queued call (maybe of the other kind) in its place.
        counted = 0 if meta.get("empty") else int(bool(meta.get("counted", sent.counted)))
        if not counted:
            job = self.sched.jobs.get(record.job_id)
            if job is not None and job.state == JobState.RUNNING:
                job.state = JobState.ADMITTED
        if not meta.get("empty"):
            record.calls_done += 1
            record.calls_failed += 0 if meta.get("ok") else 1
        if isinstance(meta.get("comm"), dict):
            record.comm = meta["comm"]
        made: list[Placement] = []
        if record.live and record.phase == "submitted":
            made = self._account(record, sent.lane, meta, counted, started=True)
        elif not record.live:
            # The client had its result (on its direct channel) and closed the job before
            # this reply reached the daemon.
            self._count_after_end(record, counted)
            self._finalize(record)
        self._event("end", record.job_id, *sent.lane, seconds=seconds,
                    iterations=counted, ok=bool(meta.get("ok")),
                    began=meta.get("began"), ended=meta.get("ended"),
                    **({"cache": meta["cache"]} if isinstance(meta.get("cache"), dict) else {}))
        if record.live and record.kind == "batch":
            self._batch_step_done(record, meta)
        self._switch_if_quiet()
        if record.live and record.swap_requested:
            self._swap_if_idle(record)
        self._apply(made)
        if len(lanes) > 1:
            self._pump_all()  # a gang's end may unblock lanes beyond its own
        else:
            self._pump(sent.lane)

    def _count_after_end(self, record: JobRecord, iterations: int) -> None:
        """Iterations of an ended job that ran before it ended: counted, nothing to decide."""
        job = self.sched.jobs.get(record.job_id)
        if job is not None:
            job.done_iterations += iterations

    def _account(self, record: JobRecord, key: LaneKey, meta: dict[str, Any], iterations: int,
                 *, started: bool = False) -> list[Placement]:
        """Account finished calls of a live, admitted job: `iterations` of them counted, their
        time (`meta["seconds"]`) and their measured peak. Returns the placements a
        re-admission made."""
        made: list[Placement] = []
        job = self.sched.jobs[record.job_id]
        if iterations and not job.done:
            if not started:
                self.sched.iteration_started(record.job_id)
            if record.kind == "interactive":
                # Interactive jobs end at close: the planned count only informs SRTF.
                job.total_iterations = max(job.total_iterations,
                                           job.done_iterations + iterations + 1)
            made = self.sched.iterations_done(record.job_id, iterations,
                                              float(meta.get("seconds", 0.0)))
            record.since_checkpoint += iterations
            record.since_checkpoint_s += float(meta.get("seconds", 0.0))
            if record.kind == "interactive":
                self._maybe_checkpoint(record)
        peak = meta.get("peak")
        if isinstance(peak, int):
            record.measured_peak = max(record.measured_peak or 0, peak)
            made += self._check_peak(record, key, peak)
        return made

    def _check_peak(self, record: JobRecord, key: LaneKey, peak: int) -> list[Placement]:
        """A call measured `peak` bytes above the job's resident state: a job over its lane
        is re-admitted with that size (moved to a lane that holds it, or queued)."""
        lane = self.sched.lanes.lane(*key)
        slack = RSS_NOISE_BYTES if record.device_kind == "cpu" else 0
        if lane is None or peak <= lane.size + slack:
            return []
        job = self.sched.jobs[record.job_id]
        log.info("job %d measured %d B ephemeral, over its %d B lane: re-admitting",
                 record.job_id, peak, lane.size)
        try:
            made = self.sched.requeue(record.job_id, job.persistent_bytes, aligned(peak))
        except ValueError as exc:
            self._event("reject", record.job_id, reason=str(exc))
            self._end(record, "failed", str(DoesNotFit(
                f"job {record.job_id} measured {peak} bytes per call above its state, more "
                f"than any device can hold: {exc}")))
            return []
        self._event("requeue", record.job_id, *key, peak=peak)
        return made

    def _apply(self, made: list[Placement]) -> None:
        """Reconcile the ledgers with the scheduler's admissions, tell newly placed executors
        where they run, and start work in the lanes that changed."""
        for device, ledger in enumerate(self.ledgers):
            lanes = self.sched.lanes.lanes(device)
            wanted: dict[tuple[str, int], int] = {("lane", ln.lane_id): ln.size for ln in lanes}
            for ln in lanes:
                for job_id in ln.residents:
                    wanted[("job", job_id)] = self.sched.jobs[job_id].persistent_bytes
            for key in list(ledger.regions):
                if wanted.get(key) != ledger.size(key):
                    ledger.remove(key)
            for key, size in wanted.items():
                if ledger.size(key) is None:
                    ledger.place(key, size)
        for p in made:
            self._event("admit", p.job_id, p.device, p.lane_id)
            record = self.registry.live.get(p.job_id)
            if record is None:
                continue
            replica = 0
            if record.gang > 1:
                replica = self._gang_lanes(p.job_id).index((p.device, p.lane_id))
            self._send_to(record.replicas[replica], _Sent("place"), {
                "op": "place", "device": self.torch_devices[p.device],
                "budget_bytes": self.sched.jobs[p.job_id].persistent_bytes + p.lane_bytes,
                "slowdown": self.compute_slowdowns[p.device],
            })
        for p in made:
            self._pump((p.device, p.lane_id))
        self._refresh_leases()
        self._memory_event()

    def _memory_event(self) -> None:
        """Per device: budget, persistent bytes, lane bytes, free bytes and lanes; and the
        pending queue's length (what metrics show, without reading the engine). Sent when it
        changed: scheduling decisions that move nothing (most boundaries) send none, which
        would fill the event stream's window with copies."""
        devices = []
        for index, ledger in enumerate(self.ledgers):
            lanes = self.sched.lanes.lanes(index)
            stats = ledger.stats()
            devices.append({"device": index, "capacity_bytes": stats.capacity,
                            "persistent_bytes": self.sched.lanes.persistent(index),
                            "lane_bytes": sum(ln.size for ln in lanes),
                            "free_bytes": stats.capacity - stats.used, "lanes": len(lanes)})
        state = (devices, len(self.sched.lanes.pending))
        if state == self._last_memory:
            return
        self._last_memory = state
        self._event("memory", -1, devices=devices, pending=state[1])

    def _swap_if_idle(self, record: JobRecord) -> None:
        if not record.swap_requested or record.job_id in self.busy.values():
            return
        record.swap_requested = False
        record.swapped = True
        for executor in record.replicas:
            self._send_to(executor, _Sent("swap_out"), {"op": "swap_out"})
        self._event("swap_out", record.job_id)
        self._apply(self.sched.swap_out(record.job_id))

    def _end(self, record: JobRecord, state: EndState, reason: str, *,
             executor_gone: bool = False) -> None:
        """End a live job: answer its queued calls, free its memory now, and retire or kill its
        executor once its running call (if any) has returned."""
        error: SalusError = (JobFailed(reason) if state == "failed" else JobCancelled(reason))
        while record.calls:
            _refuse(record.calls.popleft(), error)
        made: list[Placement] = []
        if record.job_id in self.sched.jobs and not self.sched.jobs[record.job_id].done:
            made = self.sched.finish(record.job_id, JobState.FINISHED if state == "finished"
                                     else JobState.CANCELLED)
        done = self.sched.jobs[record.job_id].done_iterations if (
            record.job_id in self.sched.jobs) else record.done_before
        self.registry.end(record, state, reason)
        for key in [k for k, j in self.reserved.items() if j == record.job_id]:
            del self.reserved[key]
        for gone in [j for j in self.sched.jobs if j not in self.registry.live
                     and j not in self.registry.ended]:
            del self.sched.jobs[gone]  # expired from the registry: forget it here too
        self._event(state if state != "finished" else "finish", record.job_id, reason=reason,
                    iterations_done=done)
        log.info("job %d %s: %s", record.job_id, state, reason)
        running = record.job_id in self.busy.values()
        if not executor_gone:
            if running:
                record.cancel_requested = True
                self.timers.call_later(self.cancel_grace_s, lambda: self._kill_if_running(record))
            else:
                self._finalize(record)
        self._apply(made)
        self._pump_all()
        self._refresh_leases()

    def _kill_if_running(self, record: JobRecord) -> None:
        if record.job_id in self.busy.values() and any(
                id(executor) in self._by_executor for executor in record.replicas):
            log.warning("job %d did not return within %.1f s of its end: killing its "
                        "executor(s)", record.job_id, self.cancel_grace_s)
            self._kill_all(record)

    def _finalize(self, record: JobRecord) -> None:
        code = "job_failed" if record.end_state == "failed" else "job_cancelled"
        for executor in record.replicas:
            if id(executor) in self._by_executor:
                self.executors.retire(executor, code, f"job {record.job_id} has "
                                      f"{record.end_state}: {record.reason}")

    def _require_attached(self, record: JobRecord) -> None:
        self._require_live(record)
        if record.executor is None:
            raise BadRequest(f"job {record.job_id} has no state yet: call job.attach(...) first")

    def _require_live(self, record: JobRecord) -> None:
        if not record.live:
            cls = JobFailed if record.end_state == "failed" else JobCancelled
            raise cls(f"job {record.job_id} has {record.end_state}: {record.reason}")

    def _event(self, kind: str, job_id: int, device: int = -1, lane_id: int = -1,
               **detail: Any) -> None:
        self.events.emit(Event(self.clock(), kind, job_id, device, lane_id, detail))

    def check_invariants(self) -> None:
        """The scheduler's and every ledger's invariants, and the ledgers equal to the
        scheduler's bookings (persistent state of placed jobs plus lane sizes)."""
        self.sched.lanes.check_invariants()
        for device, ledger in enumerate(self.ledgers):
            ledger.check_invariants()
            booked = self.sched.lanes.persistent(device) + sum(
                ln.size for ln in self.sched.lanes.lanes(device))
            assert ledger.stats().used == booked, (device, ledger.stats().used, booked)

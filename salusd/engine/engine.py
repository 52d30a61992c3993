"""The engine: jobs, lanes and executors of one node, as a facade over its parts.

It runs on the daemon's one I/O thread, so it needs no lock; front ends and executors reach it
only through that thread. It never runs job code and never decodes a job's tensors or pickles:
it forwards the client's frames to the job's executors (`outbox.py`) and their replies back.

Every public command and every executor event ends in one `_step()` (`step.py`), as vLLM's
`EngineCore.step` does: the scheduler's admissions are placed, the `Dispatcher` says what
starts (`scheduler/dispatch.py`), leases are refreshed. Deciding lives in `salus.scheduler`;
admission (`admission.py`), leases (`leases.py`), gang failures (`gang_failures.py`) and checkpoints
(`checkpoints.py`) each in their own file, sharing `core.py`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from salus.daemon.cluster import ClusterSpec
from salus.daemon.engine import admission, checkpoints, dependencies, script_command, scripts
from salus.daemon.engine.core import Config, Core, ok_frame
from salus.daemon.engine.events import EventStream
from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.engine.leases import Leases
from salus.daemon.engine.ledger import DeviceLedger
from salus.daemon.engine.outbox import Outbox
from salus.daemon.engine.ports import (
    CheckpointPolicy,
    DataCachePolicy,
    ExecutorPort,
    JobStore,
    OnDone,
    Sent,
    Timers,
)
from salus.daemon.engine.registry import (
    Answer,
    Call,
    JobKind,
    JobRecord,
    Owner,
    Registry,
    is_script,
)
from salus.daemon.engine.replies import Replies
from salus.daemon.engine.setup import batch_spec, load
from salus.daemon.engine.step import Stepper
from salus.daemon.limits import check_iterations, check_name, check_priority
from salus.daemon.wire.errors import (
    BadRequest,
    Busy,
    Conflict,
    JobCancelled,
    JobFailed,
    ShuttingDown,
)
from salus.daemon.wire.executor_ops import Define, DirectChannel, Estimate, Pull, Reply
from salus.daemon.wire.frames import RawFrame
from salus.scheduler import make_policy
from salus.scheduler.dispatch import Dispatcher

log = logging.getLogger("salusd.engine")


class Engine:
    """Jobs, lanes and executors of one node. `capacities` are the devices' budgets (bytes);
    `torch_devices` names each device for torch ("cpu", "cuda:0"); times are seconds on
    `clock`. With `move_waiting` a job that waits for a turn in a busy lane of a CPU device
    moves to a CPU device where nothing runs (`docs/placement.md`); a GPU's jobs never move.
    `gpu_uuids` names each device's GPU ("" for a CPU device)."""

    def __init__(
        self, capacities: Sequence[int], policy: str, executors: ExecutorPort, *,
        clock: Callable[[], float], timers: Timers, torch_devices: Sequence[str],
        threads: int = 1, retention_s: float = 3600.0, cancel_grace_s: float = 5.0,
        max_queued_calls: int = 64, store: JobStore | None = None,
        checkpoints: CheckpointPolicy | None = None, cluster: ClusterSpec | None = None,
        data_cache: DataCachePolicy | None = None,
        compute_slowdowns: Sequence[float] | None = None, estimate_first: bool = True,
        context_bytes: Sequence[int] | None = None, share_lanes: bool = False,
        workspace_bytes: Sequence[int] | None = None, script_grace_s: float = 30.0,
        move_waiting: bool = True, gpu_uuids: Sequence[str] | None = None,
    ) -> None:
        config = Config(list(torch_devices),
                        list(compute_slowdowns or [1.0] * len(capacities)), threads,
                        cancel_grace_s, max_queued_calls, estimate_first, checkpoints,
                        data_cache, cluster, store, share_lanes,
                        list(workspace_bytes or [0] * len(capacities)), script_grace_s,
                        list(gpu_uuids or [""] * len(capacities)))
        ledgers = [DeviceLedger(c) for c in capacities]
        self.core = Core(config, clock, timers, Outbox(executors),
                         Dispatcher([ld.capacity for ld in ledgers], make_policy(policy), clock,
                                    context_bytes=context_bytes, movable=[
                                        i for i, name in enumerate(torch_devices)
                                        if move_waiting and name.startswith("cpu")]),
                         ledgers, Registry(clock, retention_s=retention_s),
                         EventStream(keep=1000))
        self.leases = Leases(self.core)
        self.replies = Replies(self.core, self.leases, self._after)
        self._stepper = Stepper(self.core, self.leases)
        #: script jobs waiting for the jobs they run after (`--after`), by id
        self.waiting: dict[int, dependencies.Waiting] = {}
        #: how each device's lanes share it (MPS or time-shared), for status; set by the daemon
        self.device_sharing: list[str] = [""] * len(capacities)

    # ---- what front ends and reports read ---------------------------------------------------
    @property
    def registry(self) -> Registry:
        return self.core.registry

    @property
    def events(self) -> EventStream:
        return self.core.events

    @property
    def dispatch(self) -> Dispatcher:
        """Read its views only: inputs go through the engine's commands."""
        return self.core.dispatch

    @property
    def ledgers(self) -> list[DeviceLedger]:
        return self.core.ledgers

    @property
    def config(self) -> Config:
        return self.core.config

    @property
    def pending_policy(self) -> str | None:
        """The policy switched to once no call runs, if a switch waits."""
        policy = self.core.pending_policy
        return policy.name if policy is not None else None

    @property
    def stopping(self) -> bool:
        """Shutdown began: new work is refused."""
        return self.core.stopping

    @property
    def idle(self) -> bool:
        """No executor is running a call or writing a checkpoint (shutdown waits for this)."""
        return not self.core.dispatch.busy and not any(
            r.checkpoint.asked for r in self.core.registry)

    # ---- client operations (called by the front end on the I/O thread) ----------------------
    def open(self, owner: Owner, name: object, iterations: object, cwd: str | None, *,
             kind: JobKind = "interactive", spec: JobSpec | None = None,
             priority: float = 1.0, job_id: int | None = None,
             devices: object = 1) -> JobRecord:
        """A new job; an interactive job restored after a restart and waiting for its client
        (same owner and name) is handed back instead, with `resumed_from` set. A new
        interactive job on `devices` > 1 is a gang: its calls run on that many replicas."""
        core = self.core
        if core.stopping:
            raise ShuttingDown("salusd is shutting down")
        spec = JobSpec() if spec is None else spec
        checked, planned = check_name(name), check_iterations(iterations)
        if kind == "interactive" and job_id is None and not spec.is_script:
            gang = admission.check_devices(self.core, devices)
            waiting = next((r for r in core.registry if r.life.awaiting_client
                            and r.owner.uid == owner.uid and r.name == checked
                            and r.owner.allocation == owner.allocation), None)
            if waiting is not None and waiting.gang != gang:
                raise BadRequest(f"job {waiting.job_id} {checked!r} was restored on "
                                 f"{waiting.gang} device(s); connect with devices="
                                 f"{waiting.gang} to go on with it")
            spec = replace(spec, devices=gang)
            if waiting is not None:
                waiting.life.client_back()
                core.event("reattach", waiting.job_id, iteration=waiting.progress.resumed_from)
                return waiting
        if owner.allocation is not None:  # kept with the job, so a restart gives it back
            spec = replace(spec, allocation=owner.allocation)  # to its pod alone
        if job_id is None and core.config.store is not None:
            job_id = core.config.store.new_job(checked, owner.name, owner.uid, owner.gid,
                                               kind, spec.to_json(), planned, priority)
        record = core.registry.open(owner, checked, planned, job_id)
        record.threads = core.config.threads
        record.cwd = cwd
        record.kind, record.spec, record.priority = kind, spec, priority
        record.device_kind = "cuda" if core.config.torch_devices[0].startswith("cuda") else "cpu"
        if core.config.checkpoints is not None:
            record.checkpoint.dir = os.path.join(core.config.checkpoints.root,
                                                 str(record.job_id))
            core.config.checkpoints.make_dir(record.checkpoint.dir, owner)
        core.event("open", record.job_id, owner=owner.name, allocation=owner.allocation,
                   name=record.name,
                   job_kind="script" if is_script(record) else kind)
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
        `salusd/executor/gang.py`). With `nodes` > 1 the gang spans that many nodes of the
        cluster, `devices` on each, and is submitted to each node's daemon alike
        (`salusd/cluster.py`). With `pipeline` ({"placement", "microbatches"}) the replicas
        run the model split into stages instead (`salusd/engine/pipeline_spec.py`)."""
        admission.check_devices(self.core, devices)
        policy = self.core.pending_policy or self.core.dispatch.policy
        spec = batch_spec(path, function, str(name), devices, nodes, rendezvous, pipeline,
                          self.core.config.cluster, policy)
        record = self.open(owner, name, iterations, os.path.dirname(path), kind="batch",
                           spec=spec, priority=priority)
        load(self.core, record, restore=False)
        self._step()
        return record

    def run_script(self, owner: Owner, name: object, iterations: object,
                   command: script_command.ScriptCommand, frames: Sequence[RawFrame] | None, *,
                   priority: float = 1.0, devices: object = None,
                   after: object = None, here: RawFrame | None = None) -> JobRecord:
        """A script job: an executor runs `command` unchanged as `owner`, its optimizer steps
        its iteration boundaries (`scripts.py`); `frames` carry the client's sockets, one per
        rank (None: the output goes to the job's log). A torchrun command runs as a gang of
        its ranks, one per device; `devices` (None: as many as its ranks) must be that many.
        With `after` (job ids) it starts once those jobs have finished (`dependencies.py`).
        `here`: the caller runs the command in its own process, whose link this frame's
        descriptor is (`salusd run --here`; `script_command.check_here` says what it cannot
        do)."""
        priority = check_priority(priority)
        admission.check_devices(self.core, script_command.gang_devices(command, devices))
        if frames is not None and len(frames) != command.ranks:
            raise BadRequest(f"the command runs {command.ranks} rank(s) and the client sent "
                             f"{len(frames)} socket(s): one per rank")
        admission.check_memory(self.core, command.mem_bytes)
        scripts.pinned_devices(self.core, command)  # a pin naming no GPU here: BadRequest
        waits = () if after is None else dependencies.check(self.core, owner, after)
        spec = scripts.spec(command)
        if waits:  # kept to start it after a restart too
            spec = replace(spec, after=waits, env=command.env)
        record = self.open(owner, name, iterations, command.cwd, spec=spec, priority=priority)
        if waits:
            record.after = waits
            self.waiting[record.job_id] = dependencies.Waiting(record, command, frames)
        else:
            self._start_script(record, command, frames, here)
        self._step()
        return record

    def _start_script(self, record: JobRecord, command: script_command.ScriptCommand,
                      frames: Sequence[RawFrame] | None, here: RawFrame | None = None) -> None:
        scripts.start(self.core, record, command, frames, self._after, here)

    def restore(self, owner: Owner, job_id: int, name: str, iterations: int, kind: JobKind,
                spec: JobSpec, priority: float, checkpoint_iteration: int | None,
                checkpoint_time: float | None = None, checkpoint_bytes: int = 0, *,
                iterations_done: int = 0, restarts: int = 0) -> None:
        """Bring back a job the durable registry says was live when salusd stopped: a batch
        job goes on from its last checkpoint on its own; an interactive one waits, suspended
        at its last checkpoint, for its client to connect again; a script job fails or runs
        its command again (its `restarts`, reruns so far, counting this one). Until its
        executor has loaded the checkpoint, the job's views show the one the registry recorded,
        and the `iterations_done` it recorded (what a job failed here keeps)."""
        record = self.open(owner, name, iterations, spec.cwd, kind=kind, spec=spec,
                           priority=priority, job_id=job_id)
        record.progress.resumed_from = checkpoint_iteration or 0
        record.progress.done_before = max(iterations_done, record.progress.resumed_from)
        record.checkpoint.taken(checkpoint_iteration, checkpoint_time, checkpoint_bytes)
        if record.nodes > 1 and self.core.config.cluster is None:
            self.core.end(record, "failed", f"job {job_id} spans {record.nodes} nodes and "
                          "this salusd restarted without --cluster")
        elif kind == "batch":
            load(self.core, record, restore=True)
        elif is_script(record) and dependencies.waits_again(self.core, record):
            self.waiting[job_id] = dependencies.Waiting(record, scripts.stored(record), None)
        elif is_script(record):
            scripts.restored(self.core, record, restarts, self._after)
        elif checkpoint_iteration is None:
            self.core.end(record, "failed", f"salusd restarted before job {job_id}'s first "
                          "checkpoint, so its state was lost; connect a new job")
        else:
            record.life.await_client()
            load(self.core, record, restore=True)
        self._step()

    def attach(self, record: JobRecord, frame: RawFrame, answer: Answer) -> None:
        """Forward the client's state to the job's executors, which load and measure it."""
        _require_live(record)
        if record.progress.resumed_from is not None and record.kind == "interactive":
            # Restored from a checkpoint: the job already holds its state, so the objects the
            # script built afresh are not loaded.
            frame.close_fd()
            answer(ok_frame({"persistent_bytes": record.persistent_bytes,
                             "resumed_from": record.progress.resumed_from}))
            return
        if record.life.phase != "open" or record.executor is not None:
            raise BadRequest(f"job {record.job_id} already holds its state; open another job "
                             "with salus.connect() for other objects")
        load(self.core, record, restore=False, attach=(frame, answer))

    def define(self, record: JobRecord, fid: int, kind: str, inference: bool, frame: RawFrame,
               answer: Answer) -> None:
        """Forward a function definition (`@remote.iteration` / `@remote.function`): function
        `fid` of `kind` ("iteration" or "function"); `inference`: it serves a model and never
        trains (the job is placed in its owner's lane where it can)."""
        _require_attached(record)
        record.functions[fid] = kind
        record.inference = record.inference or inference
        self.core.outbox.send_all(record, [Define()] * record.gang, answer=answer,
                                  frame=frame)

    def pull(self, record: JobRecord, frame: RawFrame, answer: Answer) -> None:
        """Forward a request for the job's state; the executor answers after its current call."""
        _require_attached(record)
        self.core.outbox.send(record, Pull(), frame, answer=answer)

    def channel(self, record: JobRecord, frame: RawFrame, answer: Answer) -> None:
        """Hand the job's executor the client's end of a direct call channel (the descriptor
        travels with `frame`). Calls on it run at once while the job holds a lease on its lane,
        and are asked for (`ready`) and granted (`run`) one by one otherwise. A gang's calls
        go to every replica, through the daemon: it has no direct channel."""
        _require_attached(record)
        if record.gang > 1:
            frame.close_fd()
            raise BadRequest(f"job {record.job_id} is a gang of {record.gang} replicas: its "
                             "calls go through salusd to all of them, not on a direct channel")
        self.core.outbox.send(record, DirectChannel(), frame, answer=answer)

    def call(self, record: JobRecord, frame: RawFrame, answer: Answer, counted: bool) -> None:
        """Queue one call; it runs when the policy picks the job in its lane."""
        core = self.core
        _require_live(record)
        if record.life.phase == "open":
            raise BadRequest(f"job {record.job_id} has no state yet: call job.attach(...) first")
        if core.stopping:
            raise ShuttingDown("salusd is shutting down")
        if len(record.calls) >= core.config.max_queued_calls:
            raise Busy(f"job {record.job_id} already has {len(record.calls)} calls queued; wait "
                       "for results before submitting more")
        core.queue_call(record, Call(frame, answer, counted))
        if record.life.phase == "attached":
            record.life.estimating()
            if record.gang > 1 or not core.config.estimate_first:
                admission.measure_first(core, record, "call")
            else:
                core.outbox.send(record, Estimate(), frame.duplicate())
        self._step()

    def close(self, record: JobRecord, reason: str | None = None) -> None:
        """The client is done: the job finishes once its running call (if any) has returned.
        With `reason` (its client went away without closing it: died, or dropped the
        connection) it fails with that reason instead: nobody saw it end."""
        if record.live and not self.core.stopping:  # at shutdown it stays, to be restored
            self.core.end(record, "failed" if reason else "finished",
                          reason or f"job {record.job_id} was closed by its client")
            self._step()

    def cancel(self, record: JobRecord, reason: str | None = None) -> None:
        """End the job at its next boundary (`reason`: why, for people; by default that it
        was cancelled); a call that does not return within `cancel_grace_s` seconds has its
        executor killed."""
        _require_live(record)
        self.core.end(record, "cancelled", reason or f"job {record.job_id} was cancelled")
        self._step()

    def suspend(self, record: JobRecord, swap: bool) -> None:
        _require_live(record)
        record.life.suspend(swap)
        if record.life.phase == "submitted":
            self.core.dispatch.suspend(record.job_id)
        self.core.event("suspend", record.job_id, swap=swap)
        self._step()
        if record.life.phase == "submitted" and self.core.config.checkpoints is not None:
            checkpoints.request(self.core, record)

    def resume(self, record: JobRecord) -> None:
        _require_live(record)
        if not record.life.held:
            raise Conflict(f"job {record.job_id} is not suspended")
        record.life.resume()
        if record.life.phase == "submitted":
            self.core.take(self.core.dispatch.resume(record.job_id))
        self.core.event("resume", record.job_id)
        self._step()

    def set_priority(self, record: JobRecord, priority: object) -> None:
        _require_live(record)
        weight = check_priority(priority)
        record.priority = weight
        if record.life.phase == "submitted":
            self.core.dispatch.set_priority(record.job_id, weight)
        self.core.event("priority", record.job_id, priority=weight)
        self._step()

    def begin_shutdown(self) -> None:
        """Refuse new work and fail queued calls; running calls finish and answer."""
        core = self.core
        core.stopping = True
        for record in core.registry:
            core.refuse_queued(record)
            if (core.config.checkpoints is not None and record.life.phase == "submitted"
                    and record.checkpoint.since and not record.checkpoint.asked):
                checkpoints.request(core, record)  # after its running call, if any
        signalled = scripts.stop_all(core)
        if signalled:
            log.info("sent SIGTERM to the commands of %d script job(s); waiting for them up to "
                     "%g s", signalled, core.config.script_grace_s)
        self._step()

    @property
    def scripts_running(self) -> bool:
        """A script job's command still runs (shutdown gives them `script_grace_s`)."""
        return scripts.running(self.core)

    def checkpoint(self, record: JobRecord, on_done: OnDone | None = None) -> None:
        """Ask the job's executors to write its state at their next boundary; `on_done` gets
        the answer (iteration, bytes, seconds, path, or a message)."""
        _require_live(record)
        checkpoints.request(self.core, record, on_done)

    def set_policy(self, name: object) -> None:
        """Switch the scheduling policy at the next boundaries: no new call starts until the
        running ones have returned, then every job is admitted under the new policy."""
        try:
            policy = make_policy(str(name))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        spanning = [r.job_id for r in self.core.registry if r.nodes > 1]
        if policy.lane_mode != "pack" and spanning:
            raise BadRequest(f"{policy.name} shares one lane per device, and multi-node gangs "
                             f"{spanning} need lanes of their own: end them first")
        self.core.pending_policy = policy
        self._step()

    def serve_one_owner(self, devices: Sequence[int]) -> None:
        """`devices` (GPUs with an MPS server, which serves one uid at a time) take the jobs of
        one owner at a time from now on (`salus.scheduler.mps`)."""
        self.core.take(self.core.dispatch.serve_one_owner(devices))
        self._step()

    def mps_clients(self, device: int, uids: Iterable[int]) -> None:
        """The uids whose live processes are clients of `device`'s MPS server now: no other
        owner's job is placed there until they are gone."""
        self.core.take(self.core.dispatch.hold_owners(device, uids))
        self._step()

    # ---- executor events -------------------------------------------------------------------
    def on_executor_reply(self, executor: object, reply: Reply, frame: RawFrame | None,
                          sent: Sent | None) -> None:
        """The executor answered `sent`, the oldest message it owed (None: it spoke unasked,
        or owed nothing)."""
        self.replies.reply(executor, reply, frame, sent)
        self._step()

    def on_executor_died(self, executor: object, reason: str, exit_code: int | None,
                         started: bool, poisoned: bool, owed: list[Sent]) -> None:
        """The executor is gone (`reason`; `exit_code` its status, -N for signal N, None when
        unknown; `started` False: its process never ran; `poisoned`: a call poisoned its CUDA
        context): fail its job with `reason` (unless it had already ended, or goes on from its
        checkpoint) and answer everything it still `owed`, oldest first."""
        self.replies.died(executor, reason, exit_code, started, poisoned, owed)
        self._step()

    def _after(self, fn: Callable[[], None]) -> None:
        """Run `fn` (a timer's work) and step."""
        fn()
        self._step()

    def _step(self) -> None:
        """Start the script jobs whose `--after` jobs all finished (failing those one of which
        did not), then the engine's step (`step.py`)."""
        for item in dependencies.settle(self.core, self.waiting):
            self._start_script(item.record, item.command, item.frames)
        self._stepper.step()

    def check_invariants(self) -> None:
        """The scheduler's and every ledger's invariants, and the ledgers equal to the
        scheduler's bookings (persistent state of placed jobs plus lane sizes)."""
        dispatch = self.core.dispatch
        dispatch.check_invariants()
        for device, ledger in enumerate(self.core.ledgers):
            ledger.check_invariants()
            booked = dispatch.persistent(device) + sum(ln.size for ln in dispatch.lanes(device))
            assert ledger.stats().used == booked, (device, ledger.stats().used, booked)


def _require_attached(record: JobRecord) -> None:
    _require_live(record)
    if record.executor is None:
        raise BadRequest(f"job {record.job_id} has no state yet: call job.attach(...) first")


def _require_live(record: JobRecord) -> None:
    if not record.live:
        cls = JobFailed if record.life.end_state == "failed" else JobCancelled
        raise cls(f"job {record.job_id} has {record.life.end_state}: {record.life.reason}")

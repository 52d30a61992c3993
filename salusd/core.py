"""The daemon core: sessions, admission, lane workers and the arenas of every device.

One `threading.Condition` guards the scheduler and the session queues; lane workers wait on it
between iterations and run iterations without holding it. Everything a client can get wrong
raises a `SalusError` for that client alone; a job whose own code raises is failed and freed
while every other job goes on.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from salus.daemon.devices import DeviceSpec
from salus.daemon.errors import (
    BadRequest,
    DoesNotFit,
    JobCancelled,
    JobFailed,
    NotOwner,
    SalusError,
    UnknownJob,
)
from salus.daemon.executor import LaneWorker
from salus.daemon.measure import (
    estimate_forward_peak,
    estimate_iteration_peak,
    measure_iteration,
    optimizer_state_tensors,
    persistent_bytes,
)
from salus.daemon.memory.arena import ALIGNMENT, Arena
from salus.daemon.memory.bins import OutOfArenaMemory
from salus.daemon.service import JobKind
from salus.daemon.session import Request, Session
from salus.scheduler import IterationScheduler, Job, JobState, Placement, make_policy

log = logging.getLogger("salusd.core")
LaneKey = tuple[int, int]


@dataclass(frozen=True)
class Event:
    """One entry of the daemon's event log (seconds on the daemon's monotonic clock)."""

    t: float
    kind: str
    job_id: int
    device: int = -1
    lane_id: int = -1


class Daemon:
    """Owns the devices; implements `salus.daemon.service.JobService`."""

    def __init__(
        self,
        devices: Sequence[DeviceSpec],
        policy: str = "pack",
        *,
        clock: Callable[[], float] = time.monotonic,
        event_log: int = 100_000,
    ) -> None:
        if not devices:
            raise ValueError("the daemon needs at least one device")
        self.devices = list(devices)
        self.policy = make_policy(policy)
        self.clock = clock
        self.arenas = [Arena(d.memory_bytes, d.torch_device) for d in self.devices]
        self.sched = IterationScheduler([a.capacity for a in self.arenas], self.policy, clock)
        self.events: deque[Event] = deque(maxlen=event_log)
        self.finished: deque[dict[str, Any]] = deque(maxlen=1000)
        # One lock; waiters on `_cond` (state_dict) and one condition per lane share it, so an
        # arriving batch wakes only its own lane's worker.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._lane_conds: dict[LaneKey, threading.Condition] = {}
        self._sessions: dict[int, Session] = {}
        self._workers: dict[LaneKey, LaneWorker] = {}
        self._threads: list[LaneWorker] = []
        self._regions: dict[LaneKey, tuple[int, int]] = {}
        self._running: set[int] = set()
        self._busy: set[LaneKey] = set()
        self._ids = itertools.count(1)
        self._stopping = False

    # ---- JobService ------------------------------------------------------------------------
    def open_job(self, owner: str, name: str, iterations: int, kind: JobKind) -> str:
        if kind not in ("training", "inference"):
            raise BadRequest(f"job kind must be 'training' or 'inference', got {kind!r}")
        if not isinstance(iterations, int) or iterations < 1:
            raise BadRequest(f"iterations must be a positive integer, got {iterations!r}")
        if not isinstance(name, str) or not name or len(name) > 200:
            raise BadRequest("a job name must be a non-empty string of at most 200 characters")
        with self._cond:
            self._refuse_if_stopping()
            job_id = next(self._ids)
            session = Session(job_id, owner, name, kind, iterations)
            self._sessions[job_id] = session
            self._event("open", job_id)
        log.info("job %d %r opened by %s (%s, %d iterations planned)",
                 job_id, name, owner, kind, iterations)
        return str(job_id)

    def setup_training(
        self,
        job_id: str,
        owner: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
    ) -> dict[str, Any]:
        session = self._session(job_id, owner)
        if session.kind != "training":
            raise BadRequest(f"job {job_id} is an inference job; use setup_inference")
        if not isinstance(model, torch.nn.Module):
            raise BadRequest(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise BadRequest(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not callable(loss_fn):
            raise BadRequest("loss_fn must be callable as loss_fn(output, target)")
        owned = {id(p) for p in model.parameters()}
        if any(id(p) not in owned for g in optimizer.param_groups for p in g["params"]):
            raise BadRequest("the optimizer holds parameters that are not the model's parameters")
        return self._attach(session, model, optimizer, loss_fn)

    def setup_inference(self, job_id: str, owner: str, model: torch.nn.Module) -> dict[str, Any]:
        session = self._session(job_id, owner)
        if session.kind != "inference":
            raise BadRequest(f"job {job_id} is a training job; use setup_training")
        if not isinstance(model, torch.nn.Module):
            raise BadRequest(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for p in model.parameters():
            p.requires_grad_(False)
        return self._attach(session, model, None, None)

    def step(
        self, job_id: str, owner: str, inputs: torch.Tensor, target: torch.Tensor
    ) -> Future[float]:
        session = self._session(job_id, owner)
        if session.kind != "training" or session.optimizer is None:
            raise BadRequest(f"job {job_id} has no training step: call train_step() first")
        _check_tensors(inputs, target)
        return self._enqueue(session, "step", (inputs, target))

    def infer(self, job_id: str, owner: str, inputs: torch.Tensor) -> Future[torch.Tensor]:
        session = self._session(job_id, owner)
        if session.kind != "inference" or session.model is None:
            raise BadRequest(f"job {job_id} has no inference model: call inference() first")
        _check_tensors(inputs)
        return self._enqueue(session, "infer", (inputs,))

    def state_dict(self, job_id: str, owner: str) -> dict[str, torch.Tensor]:
        session = self._session(job_id, owner)
        with self._cond:
            self._cond.wait_for(lambda: session.job_id not in self._running)
            if session.model is None:
                raise BadRequest(f"job {job_id} has not shipped a model yet")
            return {k: v.detach().to("cpu", copy=True) for k, v in
                    session.model.state_dict().items()}

    def job_info(self, job_id: str, owner: str) -> dict[str, Any]:
        session = self._session(job_id, owner)
        with self._cond:
            return self._info(session)

    def close_job(self, job_id: str, owner: str) -> None:
        sid = _parse_id(job_id)
        with self._cond:
            session = self._sessions.get(sid)
            if session is None:
                if any(f["job_id"] == sid and f["owner"] == owner for f in self.finished):
                    return
                raise UnknownJob(f"no job {job_id} in this daemon")
            self._check_owner(session, owner)
            self._end(session, JobState.FINISHED, JobCancelled(f"job {job_id} was closed"))

    # ---- control (REST, benchmarks) -------------------------------------------------------
    def suspend(self, job_id: str, owner: str, *, swap: bool = False) -> None:
        """Stop scheduling the job from its next iteration boundary. Its state stays resident
        (a switch costs no copy) unless `swap`: then it moves to host memory at the boundary
        and its device memory goes to other jobs until it resumes. A job not yet admitted is
        held from the start."""
        session = self._session(job_id, owner)
        with self._cond:
            session.held = True
            if session.submitted:
                self.sched.suspend(session.job_id)
                if swap:
                    session.swap_requested = True
                    self._swap_if_idle(session)
            self._event("suspend", session.job_id)
            self._wake()

    def resume(self, job_id: str, owner: str) -> None:
        """Schedule the job again (a swapped-out job first waits for admission)."""
        session = self._session(job_id, owner)
        with self._cond:
            if not session.held:
                raise BadRequest(f"job {job_id} is not suspended")
            session.held = False
            session.swap_requested = False
            if session.submitted:
                self._apply(self.sched.resume(session.job_id))
            self._event("resume", session.job_id)
            self._wake()

    def cancel(self, job_id: str, owner: str) -> None:
        session = self._session(job_id, owner)
        with self._cond:
            self._end(session, JobState.CANCELLED, JobCancelled(f"job {job_id} was cancelled"))

    def set_priority(self, job_id: str, owner: str, priority: float) -> None:
        """The job's weight under fair (> 0); a job not yet admitted gets it at admission."""
        if not priority > 0:
            raise BadRequest(f"priority must be > 0, got {priority}")
        session = self._session(job_id, owner)
        with self._cond:
            session.priority = priority
            if session.submitted:
                self.sched.set_priority(session.job_id, priority)
            self._wake()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Refuse new work, fail queued requests, let running iterations finish, stop workers."""
        with self._cond:
            self._stopping = True
            for session in list(self._sessions.values()):
                self._end(session, JobState.CANCELLED, JobCancelled("salusd is shutting down"))
            for w in self._threads:
                w.stopping = True
            self._wake()
        deadline = time.monotonic() + timeout_s
        for w in self._threads:
            w.join(max(0.0, deadline - time.monotonic()))

    @property
    def workers_alive(self) -> int:
        """Lane worker threads still running."""
        return sum(w.is_alive() for w in self._threads)

    def snapshot(self) -> dict[str, Any]:
        """Devices, arenas, lanes and jobs as JSON-able data (for the CLI, REST and the demo)."""
        with self._cond:
            return {
                "policy": self.policy.name,
                "devices": [self._device_info(i) for i in range(len(self.devices))],
                "jobs": [self._info(s) for s in self._sessions.values()],
                "pending": [j.job_id for j in self.sched.lanes.pending],
            }

    # ---- lane workers ---------------------------------------------------------------------
    def next_work(self, worker: LaneWorker) -> tuple[Session, Request] | None:
        """Block until the policy picks a job for `worker`'s lane; None once the lane is gone."""
        key = (worker.device, worker.lane_id)
        with self._cond:
            while True:
                if worker.stopping:
                    return None
                work = self._take(key)
                if work is not None:
                    return work
                self._lane_conds[key].wait()

    def _take(self, key: LaneKey, only: int | None = None) -> tuple[Session, Request] | None:
        """Claim lane `key` for the policy's next iteration (only if it is job `only`, when
        given); None if the lane is busy or has nothing to run."""
        if key in self._busy:
            return None
        decision = self.sched.next_iteration(*key, ready=self._ready)
        if decision is None or (only is not None and decision.job_id != only):
            return None
        session = self._sessions[decision.job_id]
        request = session.requests.popleft()
        self.sched.iteration_started(decision.job_id)
        self._running.add(decision.job_id)
        self._busy.add(key)
        self._event("start", decision.job_id, *key)
        return session, request

    def run_work(self, worker: LaneWorker, session: Session, request: Request) -> None:
        """Run one iteration, then account it; never raises (the job fails instead)."""
        try:
            with worker.on_lane():
                session.make_resident(self.arenas[worker.device], worker.device)
                measure = None
                if session.measured_peak is None:
                    opt = session.optimizer
                    measure = partial(
                        measure_iteration, persistent=lambda: optimizer_state_tensors(opt)
                    )
                result = session.run(request, measure, worker.torch_device)
        except Exception as exc:  # the job's own code or memory: fail that job only
            self._fail(session, request, exc, worker)
            return
        with self._cond:
            self._release_lane(session, worker)
            self._event("end", session.job_id, worker.device, worker.lane_id)
            made: list[Placement] = []
            job = self.sched.jobs[session.job_id]
            if not job.done:
                # Interactive jobs end at close: the declared count only informs SRTF.
                job.total_iterations = max(job.total_iterations, job.done_iterations + 2)
                made = self.sched.iteration_done(session.job_id, result.seconds)
                if result.peak_bytes is not None:
                    made += self._check_peak(session, worker, result.peak_bytes)
            if session.closed:
                self._finalize(session)
            elif session.swap_requested:
                self._swap_if_idle(session)
            if made or job.done or result.peak_bytes is not None:  # lanes may have changed
                self._apply(made)
                self._wake()
            else:
                self._cond.notify_all()  # state_dict() waits for the iteration to end
        request.future.set_result(result.value)

    # ---- internals (call with the lock held unless noted) ---------------------------------
    def _attach(
        self,
        session: Session,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[..., torch.Tensor] | None,
    ) -> dict[str, Any]:
        if session.model is not None:
            raise BadRequest(f"job {session.job_id} already has a model")
        try:
            model.to("cpu")
            pbytes = persistent_bytes(model, optimizer)
        except Exception as exc:
            raise BadRequest(f"cannot measure the model: {type(exc).__name__}: {exc}") from None
        biggest = max(a.capacity for a in self.arenas)
        if pbytes > biggest:
            raise DoesNotFit(
                f"the model's persistent state needs {pbytes} bytes; the largest device has "
                f"{biggest} bytes (raise --cpu-memory or use a smaller model)"
            )
        with self._cond:
            session.attach(model, optimizer, loss_fn)
            session.persistent_bytes = pbytes
            session.persistent_reserve = _arena_reservation(pbytes, model)
            return self._info(session)

    def _enqueue(
        self, session: Session, op: str, tensors: tuple[torch.Tensor, ...]
    ) -> Future[Any]:
        if not session.submitted:
            self._submit(session, tensors)
        future: Future[Any] = Future()
        with self._cond:
            self._refuse_if_stopping()
            if session.closed:
                raise JobCancelled(f"job {session.job_id} is closed")
            session.requests.append(Request(op, tensors, future))
            placed = self.sched.lanes.placements(session.job_id)
            worker = self._workers.get((placed[0].device, placed[0].lane_id)) if placed else None
            work = None
            if worker is not None:
                work = self._take((worker.device, worker.lane_id), only=session.job_id)
            if worker is None or work is None:
                self._wake(session.job_id)
                return future
        # The lane is idle and the policy picks this job: run here, saving two thread hand-offs.
        self.run_work(worker, *work)
        return future

    def _submit(self, session: Session, tensors: tuple[torch.Tensor, ...]) -> None:
        """Estimate the iteration's ephemeral peak from the first batch and ask for admission."""
        try:
            if session.kind == "training":
                peak = estimate_iteration_peak(
                    session.model, session.optimizer, session.loss_fn, tensors[:1], tensors[1]
                )
            else:
                peak = estimate_forward_peak(session.model, tensors)
        except Exception as exc:
            # Models the fake-tensor estimate cannot trace are measured on their first iteration.
            log.warning("job %d: no estimate (%s: %s); admitting by persistent size",
                        session.job_id, type(exc).__name__, exc)
            peak = session.persistent_bytes
        peak = _aligned(peak)
        job = Job(
            job_id=session.job_id,
            submit_s=self.clock(),
            total_iterations=max(1, session.planned_iterations),
            persistent_bytes=session.persistent_reserve,
            ephemeral_bytes=peak,
            owner=session.owner,
            name=session.name,
            priority=session.priority,
        )
        with self._cond:
            if session.submitted:
                return
            try:
                made = self.sched.submit(job)
            except ValueError as exc:
                raise DoesNotFit(str(exc)) from None
            session.submitted = True
            session.estimated_peak = peak
            if session.held:
                self.sched.suspend(session.job_id)
            self._event("submit", session.job_id)
            self._apply(made)

    def _check_peak(self, session: Session, worker: LaneWorker, peak: int) -> list[Placement]:
        """The first real iteration measured `peak`; a job over its lane is moved or re-queued."""
        session.measured_peak = peak
        peak = _aligned(peak)
        lane = self.sched.lanes.lane(worker.device, worker.lane_id)
        job = self.sched.jobs[session.job_id]
        if lane is None or peak <= lane.size:
            return []
        log.info("job %d measured %d B ephemeral, over its %d B lane: re-admitting",
                 session.job_id, peak, lane.size)
        try:
            made = self.sched.requeue(session.job_id, job.persistent_bytes, peak)
        except ValueError as exc:
            self._end(session, JobState.CANCELLED, DoesNotFit(str(exc)))
            return []
        self._event("requeue", session.job_id, worker.device, worker.lane_id)
        return made

    def _apply(self, made: list[Placement]) -> None:
        """Reconcile lane workers, lane regions and residency with the scheduler's lanes."""
        for p in made:
            self._event("admit", p.job_id, p.device, p.lane_id)
        current = {(ln.device, ln.lane_id): ln.size for ln in self.sched.lanes.lanes()}
        for key in list(self._workers):
            if key not in current:
                self._workers.pop(key).stopping = True
                self._lane_conds.pop(key).notify_all()
                self._free_region(key)
        for key, size in current.items():
            region = self._regions.get(key)
            if region is None or region[1] != size:
                self._free_region(key)
                self._reserve_region(key, size)
            if key not in self._workers:
                self._lane_conds[key] = threading.Condition(self._lock)
                worker = LaneWorker(self, *key)
                self._workers[key] = worker
                self._threads = [w for w in self._threads if w.is_alive()] + [worker]
                worker.start()
        for session in self._sessions.values():
            placed = self.sched.lanes.placements(session.job_id)
            if session.resident is not None and session.job_id not in self._running and (
                not placed or placed[0].device != session.resident_device
            ):
                session.evict()

    def _reserve_region(self, key: LaneKey, size: int) -> None:
        try:
            self._regions[key] = (self.arenas[key[0]].alloc(size), size)
        except OutOfArenaMemory as exc:
            # Fragmentation only: the scheduler's accounting still holds the lane's bytes.
            log.warning("lane %s: region of %d B not reserved in the arena: %s", key, size, exc)

    def _free_region(self, key: LaneKey) -> None:
        region = self._regions.pop(key, None)
        if region is not None:
            self.arenas[key[0]].free(region[0])

    def _swap_if_idle(self, session: Session) -> None:
        """Carry out a requested swap-out once the job is between iterations."""
        if not session.swap_requested or session.job_id in self._running:
            return
        session.swap_requested = False
        self._event("swap_out", session.job_id)
        self._apply(self.sched.swap_out(session.job_id))  # evicts the session's arena state
        self._wake()

    def _wake(self, job_id: int | None = None) -> None:
        """Wake the lane of `job_id` (its new batch can only change that lane's decision), or
        every lane and every waiter when admission or job states changed."""
        if job_id is not None:
            for p in self.sched.lanes.placements(job_id):
                self._lane_conds[(p.device, p.lane_id)].notify()
            return
        for cond in self._lane_conds.values():
            cond.notify()
        self._cond.notify_all()

    def _ready(self, job: Job) -> bool:
        session = self._sessions.get(job.job_id)
        return session is not None and session.ready

    def _release_lane(self, session: Session, worker: LaneWorker) -> None:
        self._running.discard(session.job_id)
        key = (worker.device, worker.lane_id)
        self._busy.discard(key)
        cond = self._lane_conds.get(key)
        if cond is None or threading.current_thread() is worker:
            return
        if any(self._ready(job) for job in self.sched.lane_jobs(*key)):
            cond.notify()  # work queued meanwhile: the lane's own worker runs it

    def _fail(
        self, session: Session, request: Request, exc: BaseException, worker: LaneWorker
    ) -> None:
        if isinstance(exc, OutOfArenaMemory):
            error: SalusError = JobFailed(f"job {session.job_id}: arena placement failed: {exc}")
        else:
            where = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            error = JobFailed(f"job {session.job_id} raised in its iteration: {where}")
        log.warning("%s", error)
        with self._cond:
            self._release_lane(session, worker)
            self._end(session, JobState.CANCELLED, error)
            self._wake()
        request.future.set_exception(error)

    def _end(self, session: Session, state: JobState, reason: SalusError) -> None:
        """Fail queued requests with `reason`; free the job now, or after its running iteration."""
        session.closed = True
        while session.requests:
            session.requests.popleft().future.set_exception(reason)
        if session.job_id in self.sched.jobs and not self.sched.jobs[session.job_id].done:
            self._apply(self.sched.finish(session.job_id, state))
        if session.job_id not in self._running:
            self._finalize(session)
        self._wake()

    def _finalize(self, session: Session) -> None:
        if self._sessions.pop(session.job_id, None) is None:
            return
        self.finished.append(self._info(session))
        session.evict()
        self._event("close", session.job_id)

    def _session(self, job_id: str, owner: str) -> Session:
        sid = _parse_id(job_id)
        with self._cond:
            session = self._sessions.get(sid)
            if session is None:
                raise UnknownJob(f"no job {job_id} in this daemon (closed, failed or never opened)")
            self._check_owner(session, owner)
            return session

    @staticmethod
    def _check_owner(session: Session, owner: str) -> None:
        if session.owner != owner:
            raise NotOwner(f"job {session.job_id} belongs to {session.owner}, not {owner}")

    def _refuse_if_stopping(self) -> None:
        if self._stopping:
            raise JobCancelled("salusd is shutting down")

    def _event(self, kind: str, job_id: int, device: int = -1, lane_id: int = -1) -> None:
        self.events.append(Event(self.clock(), kind, job_id, device, lane_id))

    def _info(self, session: Session) -> dict[str, Any]:
        job = self.sched.jobs.get(session.job_id)
        placed = self.sched.lanes.placements(session.job_id)
        # A single-mode lane resizes as residents come and go: report its size now.
        lane = self.sched.lanes.lane(placed[0].device, placed[0].lane_id) if placed else None
        return {
            "job_id": session.job_id,
            "owner": session.owner,
            "name": session.name,
            "kind": session.kind,
            "state": job.state.value if job else ("closed" if session.closed else "open"),
            "iterations_done": job.done_iterations if job else 0,
            "iterations_planned": session.planned_iterations,
            "mean_iteration_s": job.iter_s if job else None,
            "submit_s": job.submit_s if job else None,
            "start_s": job.start_s if job else None,
            "finish_s": job.finish_s if job else None,
            "device": placed[0].device if placed else None,
            "lane": placed[0].lane_id if placed else None,
            "last_loss": session.last_loss,
            "memory": {
                "persistent_bytes": session.persistent_bytes,
                "persistent_limit": "enforced",
                "ephemeral_estimate_bytes": session.estimated_peak,
                "ephemeral_measured_bytes": session.measured_peak,
                "lane_bytes": lane.size if lane else None,
                "ephemeral_limit": "accounted",
                "resident": session.resident is not None and not session.resident.swapped,
            },
        }

    def _device_info(self, index: int) -> dict[str, Any]:
        stats = self.arenas[index].stats()
        lanes = self.sched.lanes.lanes(index)
        return {
            **self.devices[index].describe(),
            "arena": {
                "capacity_bytes": stats.capacity,
                "used_bytes": stats.used,
                "peak_bytes": stats.peak,
                "largest_free_bytes": stats.largest_free,
            },
            "persistent_bytes": self.sched.lanes.persistent(index),
            "unreserved_bytes": self.sched.lanes.unreserved(index),
            "lanes": [
                {"lane_id": ln.lane_id, "size_bytes": ln.size, "jobs": list(ln.residents)}
                for ln in lanes
            ],
        }


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the arena's allocation granularity."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _arena_reservation(persistent: int, model: torch.nn.Module) -> int:
    """Bytes admission books for a job's persistent state: the exact bytes plus the rounding of
    every tensor the arena will hold (a parameter, its gradient and up to four optimizer-state
    tensors, and each buffer), so placement never fails for want of alignment slack."""
    tensors = 6 * sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    return persistent + tensors * ALIGNMENT


def _parse_id(job_id: str | int) -> int:
    try:
        return int(job_id)
    except (TypeError, ValueError):
        raise UnknownJob(f"{job_id!r} is not a job id") from None


def _check_tensors(*tensors: object) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise BadRequest(f"expected a torch.Tensor, got {type(t).__name__}")

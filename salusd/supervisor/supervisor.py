"""The daemon's side of the executors: start the zygote, keep a standby pool of forked
executor processes, give each new job one (running as its owner), gather the jobs of one
owner in one lane into one process, and report how each process ended.

**Executors per (owner, device, lane).** A job attaches in a fresh process of its owner (its
state must be loaded before admission can place it). When the engine places it (`place`), the
supervisor looks up the process that serves its owner in that lane: none yet, and the job is
alone in its process, so that process serves the lane from now on; else the job moves there
(`Handover` to the old process, which sends back its state, random generator, waiting calls and
its client's socket; `Adopt` to the new one) and the old process exits once it hosts nothing.
So the jobs of one owner in one lane share one CUDA context and one caching allocator, which
holds the largest of their ephemeral peaks, as admission books it. Jobs of different owners
never share a process. A gang's replicas, batch jobs, script jobs (the process runs the
script), a job whose state cannot be pickled again (the reply says why, and `salusd status`
shows it) and every job under `--isolation job` keep a process of their own. Where a lane
holds processes of several owners, each returns its cached device memory at the end of each
call (`Place.shared`), so the lane holds only the running process's blocks: what is booked is
what the device holds.

The engine sees one `ExecutorHandle` per job (per replica of a gang); messages to a handle go
to its process addressed to its job (`wire/executor_ops/envelope.py`), and the process's
replies come back to the handle they name. A handle's `owed` is the one queue of the replies
its job owes: each goes back to the engine with the `Sent` it answers, or to the supervisor's
own step (host, handover, adopt, replace, exit); on a death the engine gets the `Sent`s still
owed. The engine's messages to a job that is moving are held and sent to its new process once
it took the job over.

An executor's death is known from two sources that arrive in either order: its socket closes
(end of stream) and the zygote reports its wait status. Its jobs are failed once both are in,
or `lost_after_s` seconds after the socket closed, with the reason a person can act on
(`executor (pid 4242) died: signal 11 (SIGSEGV) while running job 7 in lane 0.3`): a crash
costs exactly the jobs of that process. Killing a job's executor (a cancelled call that did
not return in time) kills the process and so the other jobs it hosts, with that reason.

One executor is not forked at all: `salusd run --here` runs the script in its own process
(in a pod, the pod's) and hands the daemon one end of that process's link, which the supervisor
adopts (`ExecutorPool.adopt`). It speaks the same protocol, but salusd cannot signal or kill a
process it did not start, so a signal goes to it as a `Signal` message and a kill closes its link
(`salusd/executor/in_pod.py`); its end is its link closing.

The environment every executor starts with, on a GPU host and off it, is
`processes.executor_environment`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence

from salus.daemon.devices.mps import thread_percentage
from salus.daemon.engine.ports import Sent
from salus.daemon.engine.registry import JobRecord, Owner, is_script, may_share_executor
from salus.daemon.loop import Link, Loop
from salus.daemon.state.job_output import output_path
from salus.daemon.supervisor.pool import ExecutorPool
from salus.daemon.supervisor.processes import (
    ISOLATIONS,
    Died,
    ExecutorHandle,
    ExecutorProcess,
    LaneOf,
    Pending,
    Reader,
    executor_environment,
)
from salus.daemon.supervisor.zygotes import other_interpreter
from salus.daemon.wire.executor_ops import (
    UNSOLICITED,
    Adopt,
    Exit,
    Failed,
    HandedOver,
    Handover,
    Host,
    Place,
    Poisoned,
    Reply,
    Request,
    Signal,
    address_of,
    addressed,
    decode_reply,
    encode,
    failure,
    frames_after,
)
from salus.daemon.wire.frames import RawFrame, json_frame

log = logging.getLogger("salusd.supervisor")


class Supervisor:
    """Implements the engine's `ExecutorPort` over the zygote and the loop. `isolation`:
    "lane" gathers an owner's jobs of one lane into one process; "job" gives every job its
    own."""

    def __init__(self, loop: Loop, *, standby: int = 2, lost_after_s: float = 2.0,
                 retire_after_s: float = 10.0, threads: int = 1,
                 estimate_first: bool = True, gpu_uuids: Sequence[str] = (),
                 gpu_total_bytes: Sequence[int | None] = (), isolation: str = "lane") -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation is one of {', '.join(ISOLATIONS)}, not {isolation!r}")
        self.loop = loop
        self.gpu_uuids = tuple(gpu_uuids)  # the daemon's cuda:i is gpu_uuids[i]
        self.gpu_total_bytes = tuple(gpu_total_bytes)  # and has this much memory (bytes)
        self.lost_after_s = lost_after_s
        self.retire_after_s = retire_after_s
        self.estimate_first = estimate_first  # executors estimate a job's first call
        self.isolation = isolation
        #: a job's reply to the engine's message (its `Sent`; None: unsolicited or unowed)
        self.on_reply: Callable[[ExecutorHandle, Reply, RawFrame | None, Sent | None], None] = (
            lambda *_: None)
        #: a job's executor is gone: why, its exit code (-N: signal N; None: unknown),
        #: whether its process ever ran, whether a call poisoned its CUDA context (its batch
        #: jobs may go on elsewhere), and the engine's messages it still owed
        self.on_died: Died = lambda *_: None
        self._serving: dict[LaneOf, ExecutorProcess] = {}  # the owner's process of a lane
        self.moves = 0  # jobs moved into their owner's process of their lane
        #: device index -> (its MPS server's pipe directory, the device's budget in bytes), for
        #: the GPUs with an MPS control daemon (`salusd/devices/mps.py`), set by the daemon
        self.mps_clients: dict[int, tuple[str, int]] = {}
        #: told the uids whose live processes are a GPU's MPS clients whenever they change
        self.on_mps_clients: Callable[[int, frozenset[int]], None] = lambda *_: None
        self.pool = ExecutorPool(
            loop, lambda: executor_environment(os.environ, self.gpu_uuids), standby=standby,
            threads=threads, on_frame=self._executor_frame, on_closed=self._executor_closed,
            on_exited=self._maybe_report, on_unforkable=self._unforkable)

    # ---- the processes ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the zygote; it reports `ready` once torch is imported (see `wait_ready`)."""
        self.pool.start()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        self.pool.wait_ready(timeout_s)

    @property
    def restarts(self) -> int:
        """How many times the zygote went away and was started again."""
        return self.pool.restarts

    def _unforkable(self, proc: ExecutorProcess, why: str) -> None:
        """A zygote of another interpreter could not fork `proc`: its jobs could not start."""
        for handle in list(proc.jobs.values()):
            script = is_script(handle.record)
            self._died(handle, f"the {'script' if script else 'job'} could not start: {why}",
                       started=False)
        proc.jobs.clear()

    def _died(self, handle: ExecutorHandle, reason: str, exit_code: int | None = None,
              started: bool = True, poisoned: bool = False) -> None:
        """Tell the engine the handle's job is gone from its process, with the engine's
        messages it owed replies to (sent, then held while it moved), oldest first."""
        owed = [r for r in handle.owed if isinstance(r, Sent)]
        for _, reader, frame in handle.held or ():
            if isinstance(reader, Sent):
                owed.append(reader)
            if frame is not None:  # never sent: its descriptor is still ours
                frame.close_fd()
        handle.owed.clear()
        handle.held = None
        self.on_died(handle, reason, exit_code, started, poisoned, owed)

    # ---- the engine's ExecutorPort -----------------------------------------------------------
    def acquire(self, record: JobRecord, cwd: str | None, replica: int = 0) -> ExecutorHandle:
        script = is_script(record)  # the process runs its script
        python = record.spec.python  # a contract job's client's, when not ours
        state = record.script if script else None
        if state is not None and state.here is not None:  # `salusd run --here`'s own
            proc, state.here = self.pool.adopt(record.owner, state.here), None
        else:
            if state is not None:
                python = other_interpreter(state.command.command[0], state.command.env)
            try:
                proc = self.pool.new_process(record.owner, python)
            except OSError as exc:  # its owner cannot start it: the owner's executor says why
                log.warning("job %d: no executor zygote of %s (%s); the daemon's serves",
                            record.job_id, python, exc)
                python = None
                proc = self.pool.new_process(record.owner)
        sharable = self.isolation == "lane" and may_share_executor(record)
        handle = ExecutorHandle(proc, record, replica, sharable)
        if not sharable:
            handle.why_alone = ("--isolation job" if self.isolation == "job" else
                                "a gang's replica" if record.gang > 1 else
                                "salusd run --here runs it in its own process" if proc.adopted
                                else "a script job" if script else
                                "an interactive job of another interpreter than the "
                                "daemon's" if python is not None else "a batch job")
        proc.jobs[record.job_id] = handle
        # The caller's own process may not see the state dir (a pod), and has its client.
        log_file = (None if record.checkpoint.dir is None or proc.adopted
                    else output_path(record.checkpoint.dir, replica))
        self._to_process(handle, Host(cwd, self.estimate_first, log_file), None, "host")
        return handle

    def send(self, executor: object, sent: Sent, frame: RawFrame | None) -> None:
        assert isinstance(executor, ExecutorHandle)
        msg = sent.request
        if isinstance(msg, Place):
            msg = self._on_gpu(msg, executor)
        self._send(executor, msg, sent, frame)

    def _send(self, handle: ExecutorHandle, msg: Request, reader: Reader,
              frame: RawFrame | None) -> None:
        if handle.held is not None:  # moving: sent once the new process has the job
            handle.held.append((msg, reader, frame))
        else:
            self._forward(handle, msg, reader, frame)

    def _forward(self, handle: ExecutorHandle, msg: Request, reader: Reader,
                 frame: RawFrame | None) -> None:
        """An engine message (or our `Exit` for the job) to the handle's process."""
        if isinstance(msg, Place):
            self._place(handle, msg, reader, frame)
        else:
            self._to_process(handle, msg, frame, reader)

    def _to_process(self, handle: ExecutorHandle, msg: Request, frame: RawFrame | None,
                    reader: Reader | None) -> None:
        """Send `msg` (and `frame`) to the handle's process for its job; its reply goes to
        `reader` (the engine, with that `Sent`, or the supervisor's own step; None: no reply
        comes)."""
        if reader is not None:
            handle.owed.append(reader)
        self.loop.send(handle.process.link, json_frame(addressed(encode(msg), handle.job)))
        if frame is not None:
            self.loop.send(handle.process.link, frame)

    def _on_gpu(self, place: Place, handle: ExecutorHandle) -> Place:
        """A `place` on a GPU with that GPU's UUID and memory added (the engine names devices
        by index), and its MPS server's pipe where the GPU has one (`_mps_client`)."""
        device = place.device
        if not (device.startswith("cuda:") and device[5:].isdigit()):
            return place
        index = int(device[5:])
        if index < len(self.gpu_uuids):
            place = dataclasses.replace(place, uuid=self.gpu_uuids[index])
        if index < len(self.gpu_total_bytes) and self.gpu_total_bytes[index]:
            place = dataclasses.replace(place, total_bytes=self.gpu_total_bytes[index])
        if index in self.mps_clients:
            self._mps_client(index, handle.process)
            pipe, context = self.mps_clients[index]
            place = dataclasses.replace(place, mps=pipe, mps_limit_bytes=context,
                                        mps_threads=thread_percentage(handle.record.priority))
        return place

    def _mps_client(self, index: int, proc: ExecutorProcess) -> None:
        """`proc` becomes a client of GPU `index`'s MPS server (its CUDA starts there). Legacy
        MPS serves one uid at a time, so the engine hears whose processes are the GPU's
        clients (`on_mps_clients`) and admits no other owner's job there until they are gone
        (`salus.scheduler.mps`)."""
        if proc.mps is None:
            proc.mps = index
            self._tell_mps_clients(index)

    def _tell_mps_clients(self, index: int) -> None:
        self.on_mps_clients(index, frozenset(
            p.uid if p.uid is not None and os.geteuid() == 0 else os.getuid()
            for p in self.pool.processes() if p.mps == index and not p.reported))

    def kill(self, executor: object) -> None:
        assert isinstance(executor, ExecutorHandle)
        self.pool.kill(executor.process)

    def send_signal(self, executor: object, signum: int) -> None:
        assert isinstance(executor, ExecutorHandle)
        proc = executor.process
        if proc.adopted:  # not ours to kill(2): it raises what its link says (in_pod.py)
            self.loop.send(proc.link, json_frame(addressed(encode(Signal(signum)),
                                                           executor.job)))
        elif proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)

    def retire(self, executor: object, code: str = "job_cancelled",
               message: str = "the job ended") -> None:
        """The job leaves its process once it answered what it was sent (the engine hears
        of it as of a death, with its calls still owed answered); a process left without
        jobs exits."""
        assert isinstance(executor, ExecutorHandle)
        self._send(executor, Exit(code, message), "exit", None)

    def _release(self, handle: ExecutorHandle, proc: ExecutorProcess) -> None:
        """`handle`'s job left `proc`: a process without jobs is told to exit."""
        proc.jobs.pop(handle.job, None)
        if proc.jobs or proc.closed:
            return
        self._unserve(proc)
        self.loop.send(proc.link, json_frame(encode(Exit("job_cancelled", "no jobs left"))))
        self.loop.call_later(self.retire_after_s, lambda: self._kill_if_alive(proc))

    def _kill_if_alive(self, proc: ExecutorProcess) -> None:
        if proc.status is None and (proc.pid is not None or proc.adopted and not proc.closed):
            log.warning("%s did not exit when asked: killing it", proc.who)
            self.pool.kill(proc)

    # ---- placement: an owner's jobs of one lane in one process --------------------------------
    def _place(self, handle: ExecutorHandle, place: Place, reader: Reader,
               frame: RawFrame | None) -> None:
        handle.lane = place.lane
        own = handle.process
        if handle.sharable and handle.lane is not None and own.uid is not None:
            key = (own.uid, handle.lane)
            serving = self._serving.get(key)
            if (serving is None or serving.closed) and len(own.jobs) == 1 and own.device in (
                    None, place.device):
                self._serve(own, key)  # alone in its process: that process serves the lane
            elif self._lane_process(handle.record.owner, key) is not own:
                handle.held = [(place, reader, frame)]
                self._to_process(handle, Handover(), None, "handover")
                return
        self._send_place(handle, place, reader, frame)

    def _send_place(self, handle: ExecutorHandle, place: Place, reader: Reader,
                    frame: RawFrame | None) -> None:
        """Send the engine's `place` to the process the job is in, marked shared where other
        processes run in its lane (and those told so too)."""
        proc = handle.process
        handle.place = (dataclasses.replace(place, shared=True)
                        if self._lane_shared(handle, proc) else place)
        proc.device = proc.device or place.device
        self._to_process(handle, handle.place, frame, reader)
        self._tell_lane(handle)

    def _lane_process(self, owner: Owner, key: LaneOf) -> ExecutorProcess:
        """The process serving the owner's lane `key`, started (become the owner) if none
        does."""
        serving = self._serving.get(key)
        if serving is None or serving.closed:
            serving = self.pool.new_process(owner)
            self._serve(serving, key)
        return serving

    def _serve(self, proc: ExecutorProcess, key: LaneOf) -> None:
        self._unserve(proc)
        proc.key = key
        self._serving[key] = proc

    def _unserve(self, proc: ExecutorProcess) -> None:
        """`proc` no longer serves the lane it served (it moved on, emptied or closed)."""
        key = proc.key
        if key is not None and self._serving.get(key) is proc:
            del self._serving[key]

    def _lane_shared(self, handle: ExecutorHandle, proc: ExecutorProcess) -> bool:
        """Whether a process other than `proc` runs jobs in the handle's lane."""
        return handle.lane is not None and any(
            p is not proc for p in self._processes_in(handle.lane))

    def _processes_in(self, lane: int) -> set[ExecutorProcess]:
        return {h.process for p in self.pool.processes() for h in p.jobs.values()
                if h.lane == lane and h.held is None}

    def _tell_lane(self, handle: ExecutorHandle) -> None:
        """A process joined the handle's lane: the jobs of the others there, placed as not
        shared, are placed again as shared (they return cached device memory after each
        call from now on; on the CPU this changes nothing)."""
        if handle.lane is None:
            return
        for proc in self._processes_in(handle.lane):
            if proc is handle.process:
                continue
            for other in proc.jobs.values():
                if other.lane == handle.lane and other.held is None and (
                        other.place is not None and not other.place.shared):
                    other.place = dataclasses.replace(other.place, shared=True)
                    self._to_process(other, other.place, None, "replace")

    def _moved(self, handle: ExecutorHandle, reply: Reply, frames: list[RawFrame]) -> None:
        """The old process answered `Handover`: hand the job to its lane's process (`ok`), or
        leave it where it is (its state could not be pickled again)."""
        held, handle.held = handle.held or [], None
        source = handle.process
        if not isinstance(reply, HandedOver) or not reply.ok:
            handle.sharable = False
            handle.why_alone = f"its state could not move: {failure(reply)}"
            log.info("job %d keeps its own executor: %s", handle.job, handle.why_alone)
            for frame in frames:
                frame.close_fd()
            for m, r, f in held:
                self._forward(handle, m, r, f)
            return
        assert source.uid is not None and handle.lane is not None
        target = self._lane_process(handle.record.owner, (source.uid, handle.lane))
        self._release(handle, source)
        handle.process = target
        target.jobs[handle.job] = handle
        self.moves += 1
        self._to_process(handle, Adopt(reply.channel, reply.pool), frames[0], "adopt")
        for frame in frames[1:]:
            self.loop.send(target.link, frame)
        for m, r, f in held:
            if isinstance(m, Place):
                self._send_place(handle, m, r, f)
            else:
                self._forward(handle, m, r, f)

    # ---- executor links ----------------------------------------------------------------------
    def _executor_frame(self, link: Link, frame: RawFrame) -> None:
        proc = self.pool.by_link.get(id(link))
        if proc is None:
            frame.close_fd()
            return
        pending = proc.pending
        if pending is not None:
            pending.frames.append(frame)
            if len(pending.frames) == pending.count:
                proc.pending = None
                self._reply(proc, pending.handle, pending.reply, pending.frames)
            return
        meta = frame.json()
        frame.close_fd()
        try:
            job = address_of(meta) if isinstance(meta, dict) else None
            reply = decode_reply(meta)
        except ValueError as exc:
            log.error("executor pid %s sent a message that is not one: %s; killing it",
                      proc.pid, exc)
            self.pool.kill(proc)
            return
        if job is None:
            log.error("executor pid %s sent a message for no job: killing it", proc.pid)
            self.pool.kill(proc)
            return
        handle = proc.jobs.get(job)
        if isinstance(reply, Poisoned):
            # Its jobs fail once it has ended, with this as the reason.
            proc.poisoned = (f"its CUDA context was poisoned by a call of job {job} "
                             f"({reply.message[:1000]}), so it ended")
            return
        count = frames_after(reply)
        if count:
            proc.pending = Pending(handle, reply, count)
        else:
            self._reply(proc, handle, reply, [])

    def _reply(self, proc: ExecutorProcess, handle: ExecutorHandle | None, reply: Reply,
               frames: list[RawFrame]) -> None:
        """One reply (or unsolicited message) of `proc` for `handle`'s job, with its frames."""
        if handle is None or handle.process is not proc:
            for frame in frames:
                frame.close_fd()
            return
        if isinstance(reply, UNSOLICITED):
            self.on_reply(handle, reply, frames[0] if frames else None, None)
            return
        reader = handle.owed.popleft() if handle.owed else None
        if reader is None or isinstance(reader, Sent):  # the engine's (None: owed nothing)
            self.on_reply(handle, reply, frames[0] if frames else None, reader)
        elif reader == "handover":
            self._moved(handle, reply, frames)
        elif reader == "exit":
            self._release(handle, proc)
            self._died(handle, f"{proc.who} let job {handle.job} go: it ended")
        elif isinstance(reply, Failed):  # host, adopt, replace
            for frame in frames:
                frame.close_fd()
            self._release(handle, proc)
            self._died(handle, f"{proc.who} could not {reader} job "
                               f"{handle.job}: {failure(reply)}")

    def _executor_closed(self, link: Link, reason: str) -> None:
        proc = self.pool.by_link.get(id(link))
        if proc is None:
            return
        proc.closed = True
        self.pool.closed(proc)
        self._unserve(proc)
        if proc.adopted:  # no zygote reports its end: this is all salusd learns of it
            proc.status = proc.status or ("its link closed: its process ended without the "
                                          "script's exit status (salusd run shows how)")
        elif proc.status is None:
            self.loop.call_later(self.lost_after_s, lambda: self._maybe_report(proc, force=True))
        self._maybe_report(proc)

    def _maybe_report(self, proc: ExecutorProcess, force: bool = False) -> None:
        if proc.reported or not proc.closed or (proc.status is None and not force):
            return
        proc.reported = True
        self.pool.forget(proc)
        if proc.mps is not None:  # its MPS client is gone with it
            self._tell_mps_clients(proc.mps)
        how = proc.status or "its connection closed (exit status unknown)"
        for handle in list(proc.jobs.values()):
            self._died(handle, f"{proc.who} {proc.poisoned}" if proc.poisoned
                       else f"{proc.who} died: {how}", proc.exit_code,
                       True, proc.poisoned is not None)
        proc.jobs.clear()

    def stop(self) -> None:
        """Close every executor link and the zygote (executors exit when their link closes)."""
        self.pool.stop()


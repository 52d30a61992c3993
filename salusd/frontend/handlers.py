"""Request dispatch of the unix-socket front end: check one request and call the engine.

Requests are JSON objects with an "op" (or compact call frames); replies are
`{"ok": true, "result": ...}` or `{"ok": false, "code": ..., "message": ...}` with the codes of
`salus.daemon.wire.errors`. The daemon reads only the JSON header of a request: the objects,
functions and arguments it carries stay pickled and go to the job's executor untouched.

    op         fields                                  answered by   result
    ping       max_frame_bytes?                        daemon        version, limits, owner
    open       name, iterations, cwd?, devices?,       daemon        {"job": id, "threads": n,
               python? (the client's interpreter)                    "devices": replicas}
    attach     job, objects (pickled dict), rng?       executor      persistent bytes, threads
    define     job, fid, kind, fn (pickled)            executor      None
    call       job, fid | fn (pickled), args, rng?     executor      the pickled result (+ rng)
               (or a compact OP_CALL frame)                          (or a compact OP_RESULT);
                                                                     a gang's: every replica
                                                                     runs it, replica 0 answers
    pull       job, names?                             executor      pickled {name: state}
    channel    job (+ a socket descriptor)             executor      None: later calls may go
                                                                     straight to the executor
    info       job                                     daemon        the job's figures
    close      job                                     daemon        None
    status                                             daemon        devices, lanes, the
                                                                     caller's jobs (root:
                                                                     every job)
    suspend    job, swap?                              daemon        None
    resume / cancel   job                              daemon        None
    priority   job, priority                           daemon        None
    run        command, cwd, env, name, iterations,    daemon        {"job": id, "threads": n,
               priority?, devices?, restart?,          a script job; its  "output": each rank's
               max_restarts?, time_limit_s?,           executor runs      output file (null:
               signal?, signal_before_s?, mem_bytes?,  `command` as the   none), where the
               after? (job ids: start once they        caller, its stdio  client copies what
               finished), array_index?, array_job?,    the client's (sent it relays}
               here? (the client runs it itself)       on the pair)
               (+ the client's end of a socket pair)
    socket     executor? (+ the client's end of a      daemon        None: the next `run`, of a
               socket pair)                                          torchrun gang, gives it to
                                                                     rank 1, the next to rank 2..;
                                                                     with `executor`, the next
                                                                     `run --here` adopts it as
                                                                     its executor's link
    logs       job, offset?                            daemon        {"text", "offset", "ended"}:
                                                                     at most 64 KiB of the job's
                                                                     output file from byte
                                                                     `offset` (default: its last
                                                                     64 KiB), the offset to go on
                                                                     from, whether the job ended
                                                                     (also a job that ended before
                                                                     salusd restarted, from the
                                                                     registry, as REST finds it)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from salus.daemon.engine import script_command
from salus.daemon.engine.core import ok_frame
from salus.daemon.engine.engine import Engine
from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.engine.registry import JobRecord, parse_id
from salus.daemon.engine.report import job_info, snapshot
from salus.daemon.limits import MAX_PATH_CHARS
from salus.daemon.owners import as_caller
from salus.daemon.state.job_output import output_path, read_output, writer_uid
from salus.daemon.supervisor.zygotes import other_interpreter
from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.errors import BadRequest, Conflict, NotOwner, ShuttingDown, UnknownJob
from salus.daemon.wire.frames import (
    COMPACT_REVISION,
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_SEGMENT,
    FLAG_SOCKET,
    FLAGS_WITH_FD,
    FUNCTION_MASK,
    OP_CALL,
    VERSION,
    RawFrame,
)
from salus.daemon.wire.refs import check_compact, check_json
from salus.daemon.wire.segment import sealed_size

if TYPE_CHECKING:
    from salus.daemon.frontend.server import Client
    from salus.daemon.state.store import Store

Answer = Callable[[RawFrame], None]
MAX_FUNCTIONS = 1024
# What a stopping salusd still answers; a job request gets `salusd is shutting down` (a client
# whose executor exited asks `info` why, and learns it that way).
_WHILE_STOPPING = frozenset({"ping", "status", "close"})


def _segment_bytes(frame: RawFrame, op: str) -> int | None:
    """The size of the shared-memory segment `frame` carries (None: it carries none), checked as
    the executor will map it. Only `channel` (and `run`, not forwarded) carries a socket
    instead."""
    if frame.flags & FLAG_SOCKET:
        if op != "channel" or frame.compact or frame.flags & FLAG_SEGMENT:
            raise BadRequest("only a 'channel' request carries a socket, and nothing else")
        return None
    if not frame.flags & FLAG_SEGMENT or frame.fd is None:
        return None
    try:
        return sealed_size(frame.fd)
    except (ValueError, OSError) as exc:
        raise BadRequest(f"the frame's shared-memory segment: {exc}") from None


class Handlers:
    """Routes each request of a connection to the engine."""

    def __init__(self, engine: Engine, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 state_dir: str | None = None, store: Store | None = None) -> None:
        self.engine = engine
        self.store = store  # the durable registry: jobs that ended before the last restart
        self.max_frame_bytes = max_frame_bytes
        self.state_dir = state_dir  # said in `ping`: where the operator's CLI finds the REST API
        self._ops: dict[type[ops.Request], Callable[[Client, Any], Any]] = {
            ops.Ping: self._ping, ops.Open: self._open, ops.Info: self._info,
            ops.Close: self._close, ops.Status: self._status, ops.Suspend: self._suspend,
            ops.Resume: self._resume, ops.Cancel: self._cancel, ops.Priority: self._priority,
            ops.Logs: self._logs,
        }

    def handle(self, client: Client, frame: RawFrame, answer: Answer) -> None:
        if frame.compact:
            code, job, aux = frame.compact_head()
            if code != OP_CALL:
                raise BadRequest(f"compact op {code} is not a request")
            self._check_allowed(client, "call")
            check_compact(frame.header, len(frame.body), _segment_bytes(frame, "call"))
            record = self.engine.registry.get(job, client.owner)
            counted = record.functions.get(aux & FUNCTION_MASK) == "iteration"
            self.engine.call(record, frame, answer, counted)
            return
        wire = frame.json()
        if not isinstance(wire, dict):
            raise BadRequest("a request must be a JSON object with an 'op' field")
        op = wire.get("op")
        if not isinstance(op, str):
            raise BadRequest("a request needs an 'op' string")
        self._check_allowed(client, op)
        if op not in ops.OPS:
            raise BadRequest(f"unknown op {op[:40]!r}; expected one of {sorted(ops.OPS)}")
        if self.engine.stopping and op not in _WHILE_STOPPING:
            raise ShuttingDown("salusd is shutting down")
        try:
            request = ops.decode_control(wire)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if isinstance(request, ops.FORWARDED):
            check_json(wire, len(frame.body), _segment_bytes(frame, op))
            self._forward(client, request, frame, answer)
        elif isinstance(request, ops.Run):
            self._run(client, request, frame, answer)
        elif isinstance(request, ops.Socket):
            self._socket(client, request, frame)
            answer(ok_frame(None))
        else:
            frame.close_fd()
            answer(ok_frame(self._ops[type(request)](client, request)))

    def client_gone(self, client: Client, why: str) -> None:
        """The connection closed (`why`) with jobs its client never closed: they end, with a
        reason saying the client went away (its process died or dropped the connection)."""
        for job_id in sorted(client.jobs):
            record = self.engine.registry.live.get(job_id)
            if record is not None:
                self.engine.close(record, f"job {job_id}'s client (pid {client.pid}) went away "
                                          f"without closing it ({why})")
        client.jobs.clear()
        while client.sockets:
            client.sockets.pop().close_fd()
        if client.here is not None:
            client.here.close_fd()
            client.here = None

    # ---- forwarded to the job's executor -----------------------------------------------------
    def _forward(self, client: Client, request: ops.Forwarded, frame: RawFrame,
                 answer: Answer) -> None:
        record = self._record(client, request)
        if isinstance(request, ops.Attach):
            self.engine.attach(record, frame, answer)
        elif isinstance(request, ops.Define):
            if not 0 <= request.fid < MAX_FUNCTIONS:
                raise BadRequest(f"'define' needs 'fid', an int in 0..{MAX_FUNCTIONS - 1}")
            if request.kind not in ("iteration", "function"):
                raise BadRequest("'define' needs 'kind': 'iteration' or 'function'")
            self.engine.define(record, request.fid, request.kind, request.inference, frame,
                               answer)
        elif isinstance(request, ops.Call):
            counted = (request.fid is not None
                       and record.functions.get(request.fid) == "iteration")
            self.engine.call(record, frame, answer, counted)
        elif isinstance(request, ops.Channel):
            if frame.fd is None or frame.flags & FLAGS_WITH_FD != FLAG_SOCKET:
                raise BadRequest("'channel' carries the client's end of a socket pair")
            self.engine.channel(record, frame, answer)
        else:
            self.engine.pull(record, frame, answer)

    def _socket(self, client: Client, request: ops.Socket, frame: RawFrame) -> None:
        """One more client socket, for a rank of the next `run` (a torchrun gang), or the link
        of the executor the client runs itself (`executor`: for the next `run --here`)."""
        if frame.fd is None or frame.flags & FLAGS_WITH_FD != FLAG_SOCKET:
            raise BadRequest("'socket' carries the client's end of a socket pair, for a rank "
                             "of the next 'run'")
        if request.executor:
            if client.here is not None:
                raise BadRequest("the next 'run' already has its executor's link")
            client.here = frame
            return
        if len(client.sockets) >= len(self.engine.ledgers) - 1:
            raise BadRequest(f"more ranks than this node's {len(self.engine.ledgers)} "
                             "device(s): a torchrun gang runs one rank per device")
        client.sockets.append(frame)

    def _run(self, client: Client, request: ops.Run, frame: RawFrame, answer: Answer) -> None:
        """A script job (`salusd run`): the frame carries the client's end of a socket pair,
        on which the client sends its stdin, stdout and stderr to the job's executor; a
        torchrun gang's ranks 1, 2... get the sockets of the `socket` requests before it."""
        ranks, client.sockets = [frame, *client.sockets], []
        here, client.here = client.here, None
        try:
            if frame.fd is None or frame.flags & FLAGS_WITH_FD != FLAG_SOCKET:
                raise BadRequest("'run' carries the client's end of a socket pair, on which "
                                 "it sends its stdin, stdout and stderr")
            command = script_command.from_run(request)
            if request.here:
                script_command.check_here(command, here, request.after)
            elif here is not None:
                raise BadRequest("an executor's link came before this 'run', which does not "
                                 "say 'here'")
            elif client.allocation is not None:
                raise BadRequest(
                    "a pod's script runs in the pod, taking turns from salusd: 'salusd run' "
                    "does so where the device plugin set SALUS_GRANT, or with --here "
                    "(docs/kubernetes.md)")
            else:  # salusd's executor runs it as the caller: it must find what it runs
                command = as_caller(client.owner, command)
            record = self.engine.run_script(
                client.owner, request.name, request.iterations, command, ranks,
                priority=request.priority, devices=request.devices, after=request.after,
                here=here)
        except BaseException:
            for rank in ranks[1:]:  # the server closes the run frame's own
                rank.close_fd()
            if here is not None:
                here.close_fd()
            raise
        client.jobs.add(record.job_id)
        # Where the client copies each rank's output (`salusd/cli/relay.py`), as the executor
        # of a REST script job does: the job's owner may write its folder, the client is it.
        # A script run in the caller's own process may run where that folder is not (a pod).
        folder = None if request.here else record.checkpoint.dir
        answer(ok_frame({"job": str(record.job_id), "threads": record.threads,
                         "output": None if folder is None else [
                             output_path(folder, rank) for rank in range(record.gang)]}))

    # ---- answered by the daemon --------------------------------------------------------------
    def _check_allowed(self, client: Client, op: str) -> None:
        if client.refused and op != "ping":
            raise NotOwner(client.refused)

    def _record(self, client: Client, request: Any) -> JobRecord:
        """The job `request.job` names, if the client may act on it."""
        return self.engine.registry.get(request.job, client.owner)

    def _ping(self, client: Client, request: ops.Ping) -> dict[str, Any]:
        return {"version": VERSION, "max_frame_bytes": self.max_frame_bytes,
                "owner": client.owner.name, "compact": COMPACT_REVISION,
                "refused": client.refused or None, "state_dir": self.state_dir}

    def _open(self, client: Client, request: ops.Open) -> dict[str, Any]:
        cwd, python = request.cwd, request.python
        if cwd is not None and len(cwd) > MAX_PATH_CHARS:
            raise BadRequest(f"'cwd' must be a path of at most {MAX_PATH_CHARS} characters")
        if python is not None and not (os.path.isabs(python) and len(python) <= MAX_PATH_CHARS
                                       and "\0" not in python):
            raise BadRequest("'python' must be the client's interpreter, an absolute path of "
                             f"at most {MAX_PATH_CHARS} characters")
        if client.allocation is not None and request.devices != 1:
            raise BadRequest("a pod's job runs on its allocation's one GPU: 'devices' must be 1")
        other = other_interpreter(python, {}) if python is not None else None
        record = self.engine.open(client.owner, request.name, request.iterations, cwd,
                                  devices=request.devices,
                                  spec=JobSpec(python=other))
        client.jobs.add(record.job_id)
        return {"job": str(record.job_id), "threads": record.threads,
                "resumed_from": record.progress.resumed_from, "devices": record.gang}

    def _info(self, client: Client, request: ops.Info) -> dict[str, Any]:
        return job_info(self.engine, self._record(client, request))

    def _close(self, client: Client, request: ops.Close) -> None:
        record = self._record(client, request)
        self.engine.close(record)
        client.jobs.discard(record.job_id)

    def _status(self, client: Client, request: ops.Status) -> dict[str, Any]:
        """The node's devices and lanes, and the jobs the caller may see: its own, or every
        job for root and the daemon's own user (as REST lists an owner token's jobs only)."""
        snap = snapshot(self.engine)
        uid = client.owner.uid
        if uid not in (0, os.geteuid()):
            own = {r.job_id for r in self.engine.registry if r.owner.uid == uid
                   and r.owner.allocation == client.owner.allocation}
            snap["jobs"] = [j for j in snap["jobs"] if j["job_id"] in own]
        return snap

    def _logs(self, client: Client, request: ops.Logs) -> dict[str, Any]:
        offset = request.offset
        if offset is not None and offset < 0:
            raise BadRequest("'logs' field 'offset' must be a byte offset (an int >= 0)")
        try:
            record = self._record(client, request)
            job_id, folder, uid = record.job_id, record.checkpoint.dir, record.owner.uid
            ended = not record.live
        except UnknownJob:
            job_id, folder, uid = self._stored_output(client, request.job)
            ended = True
        if folder is None:
            raise BadRequest(f"job {job_id} has no output file: salusd keeps them in "
                             "its state dir, and runs without one")
        try:
            data, offset = read_output(output_path(folder), offset, writer_uid(uid))
        except PermissionError as exc:
            raise Conflict(str(exc)) from None
        return {"text": data.decode("utf-8", "replace"), "offset": offset, "ended": ended}

    def _stored_output(self, client: Client, job: object) -> tuple[int, str, int]:
        """A job only the durable registry knows (it ended before the last restart): its id,
        its folder in the state dir and its owner's uid, if the client may read it; else
        UnknownJob, as for any job the engine does not know."""
        policy = self.engine.core.config.checkpoints
        row = None if self.store is None else self.store.get_job(parse_id(job))
        if row is None or policy is None:
            raise UnknownJob(f"no job {parse_id(job)} in this daemon")
        if row.uid != client.owner.uid and not client.owner.is_admin:
            raise NotOwner(f"job {row.id} belongs to {row.owner}, not {client.owner.name}")
        return row.id, os.path.join(policy.root, str(row.id)), row.uid

    def _suspend(self, client: Client, request: ops.Suspend) -> None:
        self.engine.suspend(self._record(client, request), request.swap)

    def _resume(self, client: Client, request: ops.Resume) -> None:
        self.engine.resume(self._record(client, request))

    def _cancel(self, client: Client, request: ops.Cancel) -> None:
        self.engine.cancel(self._record(client, request))

    def _priority(self, client: Client, request: ops.Priority) -> None:
        self.engine.set_priority(self._record(client, request), request.priority)


"""The daemon's side of the executors: start the zygote, keep a standby pool of forked
executors, hand one to each new job (running as its owner), and report how each one ended.

An executor's death is known from two sources that arrive in either order: its socket closes
(end of stream) and the zygote reports its wait status. The job is failed once both are in, or
`lost_after_s` seconds after the socket closed, with the reason a person can act on
(`executor (pid 4242) died: signal 11 (SIGSEGV) while running job 7 in lane 0.3`).

On a GPU host the zygote, and so every executor, starts with `CUDA_VISIBLE_DEVICES` set to the
daemon's GPUs by UUID in the daemon's order, so the daemon's `cuda:i` is every executor's
`cuda:i` whatever CUDA's own order, and with `PYTORCH_NVML_BASED_CUDA_CHECK=1`, so that
`torch.cuda.is_available()` before a fork does not initialise CUDA. Each `place` carries the
GPU's UUID, with which an executor whose CUDA has not started can narrow `CUDA_VISIBLE_DEVICES`
to its own GPU (`salusd/executor/visible.py`; torch reads the variable only when CUDA starts in
the process: pytorch/pytorch#23544).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pwd
import signal
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.loop import Link, Loop
from salus.daemon.state.job_output import output_path
from salus.daemon.wire.executor_ops import Become, Exit, encode
from salus.daemon.wire.frames import FLAG_SEGMENT, RawFrame, json_frame

log = logging.getLogger("salusd.supervisor")


@dataclass(eq=False)
class ExecutorHandle:
    """One executor process as the daemon sees it."""

    token: int
    link: Link
    pid: int | None = None
    record: JobRecord | None = None
    status: str | None = None  # how it ended, once the zygote reaped it
    closed: bool = False
    reported: bool = False
    kill_when_forked: bool = False
    pending_meta: dict[str, Any] | None = None


def describe_status(status: int) -> str:
    """'signal 11 (SIGSEGV)' or 'exit status 3' for a wait status."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"signal {-code} ({name})"
    return f"exit status {code}"


def executor_environment(base: Mapping[str, str], gpu_uuids: Sequence[str]) -> dict[str, str]:
    """The zygote's (so every executor's) environment: `base` with CUDA pinned to the daemon's
    GPUs (`gpu_uuids`, in the daemon's device order; none on a CPU host)."""
    env = {**base, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    if gpu_uuids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_uuids)
    return env


def identity(owner: Owner) -> dict[str, Any]:
    """Who an owner's executor runs as: the owner's uid, gid and groups when the daemon is root,
    else the daemon's own user (it accepts jobs only from itself and root)."""
    if os.geteuid() != 0:
        entry = pwd.getpwuid(os.getuid())
        return {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
                "user": entry.pw_name, "home": entry.pw_dir}
    try:
        entry = pwd.getpwuid(owner.uid)
    except KeyError:
        return {"uid": owner.uid, "gid": owner.gid, "groups": [owner.gid], "user": owner.name,
                "home": "/"}
    return {"uid": owner.uid, "gid": entry.pw_gid,
            "groups": os.getgrouplist(entry.pw_name, entry.pw_gid),
            "user": entry.pw_name, "home": entry.pw_dir}


class Supervisor:
    """Implements the engine's `ExecutorPort` over the zygote and the loop."""

    def __init__(self, loop: Loop, *, standby: int = 2, lost_after_s: float = 2.0,
                 retire_after_s: float = 10.0, threads: int = 1,
                 estimate_first: bool = True, gpu_uuids: Sequence[str] = ()) -> None:
        self.loop = loop
        self.gpu_uuids = tuple(gpu_uuids)  # the daemon's cuda:i is gpu_uuids[i]
        self.standby_size = standby
        self.lost_after_s = lost_after_s
        self.retire_after_s = retire_after_s
        self.threads = threads
        self.estimate_first = estimate_first  # executors estimate a job's first call
        self.on_reply: Callable[[ExecutorHandle, dict[str, Any], RawFrame | None], None] = (
            lambda *_: None)
        self.on_died: Callable[[ExecutorHandle, str], None] = lambda *_: None
        self._standby: deque[ExecutorHandle] = deque()
        self._by_token: dict[int, ExecutorHandle] = {}
        self._by_pid: dict[int, ExecutorHandle] = {}
        self._by_link: dict[int, ExecutorHandle] = {}
        self._tokens = itertools.count(1)
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_link: Link | None = None
        self._stopping = False
        self.zygote_ready = False
        self.restarts = 0

    # ---- zygote -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the zygote; it reports `ready` once torch is imported (see `wait_ready`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "salus.daemon.executor.zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            env=executor_environment(os.environ, self.gpu_uuids))
        theirs.close()
        self.zygote_ready = False
        self._zygote_link = self.loop.add(Link(ours, self._zygote_frame, self._zygote_closed))
        for _ in range(self.standby_size - len(self._standby)):
            self._standby.append(self._fork())

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = self.loop.clock() + timeout_s
        while not self.zygote_ready:
            if self.loop.clock() > deadline or self._zygote is None or (
                    self._zygote.poll() is not None):
                raise RuntimeError("the executor zygote did not start (it imports torch); see "
                                   "the log above")
            self.loop.run_once(0.1)

    def _zygote_frame(self, link: Link, frame: RawFrame) -> None:
        message = frame.json()
        frame.close_fd()
        if not isinstance(message, dict):
            return
        op = message.get("op")
        if op == "ready":
            self.zygote_ready = True
            log.info("executor zygote ready (pid %s)", message.get("pid"))
        elif op == "forked":
            ex = self._by_token.get(int(message.get("token", -1)))
            pid = int(message.get("pid", -1))
            if ex is not None and pid > 0:
                ex.pid = pid
                self._by_pid[pid] = ex
                if ex.kill_when_forked:
                    self.kill(ex)
        elif op == "exited":
            ex = self._by_pid.pop(int(message.get("pid", -1)), None)
            if ex is not None:
                ex.status = describe_status(int(message.get("status", 0)))
                self._maybe_report(ex)

    def _zygote_closed(self, link: Link, reason: str) -> None:
        if self._stopping:
            return
        log.error("the executor zygote went away (%s): restarting it", reason)
        self.restarts += 1
        for ex in list(self._standby):
            self.loop.close(ex.link, "zygote restarted")
        self._standby.clear()
        if self._zygote is not None:
            self._zygote.wait()
        self.start()

    def _fork(self) -> ExecutorHandle:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        token = next(self._tokens)
        ex = ExecutorHandle(token, Link(ours, self._executor_frame, self._executor_closed))
        self.loop.add(ex.link)
        self._by_token[token] = ex
        self._by_link[id(ex.link)] = ex
        assert self._zygote_link is not None
        request = json_frame({"op": "fork", "token": token})
        request.flags |= FLAG_SEGMENT  # the descriptor that travels is the executor's socket
        request.fd = theirs.detach()
        self.loop.send(self._zygote_link, request)
        return ex

    # ---- the engine's ExecutorPort -----------------------------------------------------------
    def acquire(self, record: JobRecord, cwd: str | None, replica: int = 0) -> ExecutorHandle:
        ex = self._standby.popleft() if self._standby else self._fork()
        ex.record = record
        who = identity(record.owner)
        log = (None if record.checkpoint_dir is None
               else output_path(record.checkpoint_dir, replica))
        self.loop.send(ex.link, json_frame(encode(Become(
            who["uid"], who["gid"], tuple(who["groups"]), who["user"], who["home"], cwd,
            self.threads, record.job_id, self.estimate_first, log))))
        while len(self._standby) < self.standby_size and not self._stopping:
            self._standby.append(self._fork())
        return ex

    def send(self, executor: object, meta: dict[str, Any], frame: RawFrame | None) -> None:
        assert isinstance(executor, ExecutorHandle)
        self.loop.send(executor.link, json_frame(self._with_uuid(meta)))
        if frame is not None:
            self.loop.send(executor.link, frame)

    def _with_uuid(self, meta: dict[str, Any]) -> dict[str, Any]:
        """A `place` on a GPU with that GPU's UUID added (the engine names devices by index)."""
        device = meta.get("device")
        if meta.get("op") != "place" or not isinstance(device, str) or not (
                device.startswith("cuda:") and device[5:].isdigit()):
            return meta
        index = int(device[5:])
        return {**meta, "uuid": self.gpu_uuids[index]} if index < len(self.gpu_uuids) else meta

    def kill(self, executor: object) -> None:
        assert isinstance(executor, ExecutorHandle)
        if executor.pid is None:
            executor.kill_when_forked = True
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(executor.pid, signal.SIGKILL)

    def retire(self, executor: object, code: str = "job_cancelled",
               message: str = "the job ended") -> None:
        assert isinstance(executor, ExecutorHandle)
        self.loop.send(executor.link, json_frame(encode(Exit(code, message))))
        self.loop.call_later(self.retire_after_s, lambda: self._kill_if_alive(executor))

    def _kill_if_alive(self, ex: ExecutorHandle) -> None:
        if ex.status is None and ex.pid is not None:
            log.warning("executor pid %d did not exit when asked: killing it", ex.pid)
            self.kill(ex)

    # ---- executor links ----------------------------------------------------------------------
    def _executor_frame(self, link: Link, frame: RawFrame) -> None:
        ex = self._executor_of(link)
        if ex is None or ex.record is None:
            frame.close_fd()
            return
        if ex.pending_meta is None:
            meta = frame.json()
            frame.close_fd()
            if not isinstance(meta, dict):
                self.kill(ex)
                return
            if meta.get("forward"):
                ex.pending_meta = meta
                return
            self.on_reply(ex, meta, None)
        else:
            meta, ex.pending_meta = ex.pending_meta, None
            self.on_reply(ex, meta, frame)

    def _executor_of(self, link: Link) -> ExecutorHandle | None:
        return self._by_link.get(id(link))

    def _executor_closed(self, link: Link, reason: str) -> None:
        ex = self._executor_of(link)
        if ex is None:
            return
        ex.closed = True
        if ex in self._standby:
            self._standby.remove(ex)
        if ex.status is None:
            self.loop.call_later(self.lost_after_s, lambda: self._maybe_report(ex, force=True))
        self._maybe_report(ex)

    def _maybe_report(self, ex: ExecutorHandle, force: bool = False) -> None:
        if ex.reported or not ex.closed or (ex.status is None and not force):
            return
        ex.reported = True
        self._by_token.pop(ex.token, None)
        self._by_link.pop(id(ex.link), None)
        if ex.record is None:
            return
        how = ex.status or "its connection closed (exit status unknown)"
        self.on_died(ex, f"executor (pid {ex.pid}) died: {how}")

    def stop(self) -> None:
        """Close every executor link and the zygote (executors exit when their link closes)."""
        self._stopping = True
        for ex in list(self._by_token.values()):
            self.loop.close(ex.link, "salusd stopped")
            if ex.status is None:
                self.kill(ex)
        if self._zygote_link is not None:
            self.loop.close(self._zygote_link, "salusd stopped")
        if self._zygote is not None:
            try:
                self._zygote.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()


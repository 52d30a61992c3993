"""The executor processes as processes: the zygote of the daemon's interpreter (restarted if it
goes away) and those of other interpreters (`zygotes.OtherZygotes`), a standby pool of forked
processes that have not become anyone yet, and every live process by token, pid and link.

Which job a process hosts is the `Supervisor`'s business; the pool tells it when a zygote has
reaped a process (`on_exited`) and when a zygote of another interpreter cannot fork the
processes asked of it (`on_unforkable`). Each process's socket is read by the supervisor's
`on_frame` and `on_closed`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterator

from salus.daemon.engine.registry import Owner
from salus.daemon.loop import Link, Loop
from salus.daemon.owners import identity
from salus.daemon.supervisor.processes import ExecutorProcess, describe_status
from salus.daemon.supervisor.zygotes import OtherZygotes, Zygote, launch, stop_zygote
from salus.daemon.wire.executor_ops import Become, encode
from salus.daemon.wire.frames import FLAG_SEGMENT, RawFrame, json_frame

log = logging.getLogger("salusd.supervisor")

LinkReader = Callable[[Link, RawFrame], None]
LinkClosed = Callable[[Link, str], None]


class ExecutorPool:
    """Forks executor processes and knows each live one. `environment()` is the zygotes'
    environment (`processes.executor_environment`); `standby` processes are kept forked ahead,
    so that a new job does not wait for a fork."""

    def __init__(self, loop: Loop, environment: Callable[[], dict[str, str]], *,
                 standby: int, threads: int, on_frame: LinkReader, on_closed: LinkClosed,
                 on_exited: Callable[[ExecutorProcess], None],
                 on_unforkable: Callable[[ExecutorProcess, str], None]) -> None:
        self.loop = loop
        self.environment = environment
        self.standby_size = standby
        self.threads = threads
        self.on_frame, self.on_closed = on_frame, on_closed
        self.on_exited, self.on_unforkable = on_exited, on_unforkable
        self.standby: deque[ExecutorProcess] = deque()
        self.by_token: dict[int, ExecutorProcess] = {}
        self.by_pid: dict[int, ExecutorProcess] = {}
        self.by_link: dict[int, ExecutorProcess] = {}
        self._tokens = itertools.count(1)
        self.zygote: subprocess.Popen[bytes] | None = None
        self._zygote_link: Link | None = None
        self.stopping = False
        self.zygote_ready = False
        self.restarts = 0
        self.others = OtherZygotes(loop, environment, self._zygote_message,
                                   self._other_zygote_failed)

    # ---- the zygote ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the zygote; it reports `ready` once torch is imported (see `wait_ready`)."""
        self.zygote, ours, _ = launch(self.loop, sys.executable, [], self.environment())
        self.zygote_ready = False
        self._zygote_link = self.loop.add(Link(ours, self._zygote_frame, self._zygote_closed))
        for _ in range(self.standby_size - len(self.standby)):
            self.standby.append(self.fork())

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = self.loop.clock() + timeout_s
        while not self.zygote_ready:
            if self.loop.clock() > deadline or self.zygote is None or (
                    self.zygote.poll() is not None):
                raise RuntimeError("the executor zygote did not start (it imports torch); see "
                                   "the log above")
            self.loop.run_once(0.1)

    def _zygote_frame(self, link: Link, frame: RawFrame) -> None:
        message = frame.json()
        frame.close_fd()
        if not isinstance(message, dict):
            return
        if message.get("op") == "ready":
            self.zygote_ready = True
            log.info("executor zygote ready (pid %s)", message.get("pid"))
        else:
            self._zygote_message(message)

    def _zygote_message(self, message: dict[str, object]) -> None:
        """A zygote forked an executor (`forked`) or reaped one (`exited`)."""
        op = message.get("op")
        if op == "forked":
            proc = self.by_token.get(_int(message.get("token")))
            pid = _int(message.get("pid"))
            if proc is not None and pid > 0:
                proc.pid = pid
                self.by_pid[pid] = proc
                if proc.kill_when_forked:
                    self.kill(proc)
        elif op == "exited":
            proc = self.by_pid.pop(_int(message.get("pid")), None)
            if proc is not None:
                status = _int(message.get("status"), 0)
                proc.status = describe_status(status)
                proc.exit_code = os.waitstatus_to_exitcode(status)
                self.on_exited(proc)

    def _zygote_closed(self, link: Link, reason: str) -> None:
        if self.stopping:
            return
        log.error("the executor zygote went away (%s): restarting it", reason)
        self.restarts += 1
        for proc in list(self.standby):
            self.loop.close(proc.link, "zygote restarted")
        self.standby.clear()
        if self.zygote is not None:
            self.zygote.wait()
        self.start()

    def _other_zygote_failed(self, zygote: Zygote, why: str) -> None:
        """A zygote of another interpreter cannot serve: the processes it never forked are
        forgotten, and their jobs fail with `why` (`on_unforkable`)."""
        for proc in [p for p in self.by_token.values() if p.zygote is zygote and p.pid is None]:
            proc.reported = proc.closed = True
            self.forget(proc)
            self.loop.close(proc.link, why)
            self.on_unforkable(proc, why)

    # ---- processes ----------------------------------------------------------------------------
    def fork(self, zygote: Zygote | None = None) -> ExecutorProcess:
        """A new executor forked by the daemon's zygote, or by `zygote`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        token = next(self._tokens)
        proc = self._known(ExecutorProcess(token, Link(ours, self.on_frame, self.on_closed),
                                           zygote=zygote))
        link = self._zygote_link if zygote is None else zygote.link
        assert link is not None
        request = json_frame({"op": "fork", "token": token})
        request.flags |= FLAG_SEGMENT  # the descriptor that travels is the executor's socket
        request.fd = theirs.detach()
        self.loop.send(link, request)
        return proc

    def new_process(self, owner: Owner, python: str | None = None) -> ExecutorProcess:
        """A process of the standby pool (`python`: forked by that interpreter's zygote for
        the owner), become `owner`."""
        who = identity(owner)
        if python is not None:
            proc = self.fork(self.others.get(python, who))
        else:
            proc = self.standby.popleft() if self.standby else self.fork()
        proc.uid = owner.uid
        self.loop.send(proc.link, json_frame(encode(Become(
            who["uid"], who["gid"], tuple(who["groups"]), who["user"], who["home"],
            self.threads))))
        while len(self.standby) < self.standby_size and not self.stopping:
            self.standby.append(self.fork())
        return proc

    def adopt(self, owner: Owner, fd: int) -> ExecutorProcess:
        """The executor `salusd run --here` runs in its own process, on the link whose
        daemon end is `fd` (ours now). Salusd did not fork it: it is sent no `Become` (it is
        the caller already), no zygote reports its end (its link closing is its end), and it
        is killed by closing its link (`executor/in_pod.py`)."""
        return self._known(ExecutorProcess(
            next(self._tokens), Link(socket.socket(fileno=fd), self.on_frame, self.on_closed),
            uid=owner.uid, adopted=True))

    def _known(self, proc: ExecutorProcess) -> ExecutorProcess:
        """`proc`, its link read by the loop and the process known by its token and link."""
        self.loop.add(proc.link)
        self.by_token[proc.token] = proc
        self.by_link[id(proc.link)] = proc
        return proc

    def processes(self) -> Iterator[ExecutorProcess]:
        """Every process forked or asked for, not yet reported ended."""
        return iter(self.by_token.values())

    def closed(self, proc: ExecutorProcess) -> None:
        """`proc`'s socket closed: it is no longer a standby."""
        if proc in self.standby:
            self.standby.remove(proc)

    def forget(self, proc: ExecutorProcess) -> None:
        """`proc` has ended and been reported."""
        self.by_token.pop(proc.token, None)
        self.by_link.pop(id(proc.link), None)

    def kill(self, proc: ExecutorProcess) -> None:
        if proc.adopted:  # the loop's next turn closes its link, on which it kills itself
            if proc.status is None:
                proc.status = "killed by signal 9 (SIGKILL): salusd closed its link"
                proc.exit_code = -signal.SIGKILL
            self.loop.call_later(0.0, lambda: self.loop.close(proc.link, "killed by salusd"))
            return
        if proc.pid is None:
            proc.kill_when_forked = True
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Close every executor link and the zygotes (executors exit when their link closes)."""
        self.stopping = True
        for proc in list(self.by_token.values()):
            self.loop.close(proc.link, "salusd stopped")
            if proc.status is None:
                self.kill(proc)
        self.others.stop()
        if self._zygote_link is not None:
            self.loop.close(self._zygote_link, "salusd stopped")
        if self.zygote is not None:
            stop_zygote(self.zygote)


def _int(value: object, default: int = -1) -> int:
    """A zygote's integer field (the zygote is ours; a missing field is `default`)."""
    return value if type(value) is int else default

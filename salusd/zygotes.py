"""Zygotes of other interpreters: one per (interpreter path, owner), started on first use.

A user's packages live in the user's environment (a virtualenv, conda), not in the daemon's. A
job whose interpreter is another environment than the daemon's (a script job's `python`, as
the caller's shell resolved it) gets its executor from a zygote of that interpreter: started
as the owner the first time one of the owner's jobs needs it (`python -m
salus.daemon.executor.zygote FD VERSION`: it imports torch and the executor code once, then
forks executors in milliseconds, exactly as the daemon's own zygote does), kept warm for the
owner's next jobs, and stopped with the daemon (it also dies with it: `PR_SET_PDEATHSIG`).
Because it runs as the owner, its imports run the owner's code with the owner's rights only.

It must import the daemon's salusd version and torch: a zygote that cannot says so (`refused`)
or exits before it is ready, and the jobs waiting for it fail with what to install. Where an
interpreter's environment is the daemon's own (its `sys.prefix`), the daemon's zygote serves.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from salus.daemon.loop import Link, Loop
from salus.daemon.wire.frames import RawFrame

log = logging.getLogger("salusd.supervisor")
STOP_WAIT_S = 10.0
# Variables that would point another interpreter at the daemon's own packages.
NOT_INHERITED = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")


def launch(python: str, args: list[str], env: Mapping[str, str],
           **popen: Any) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start an executor zygote of `python` (`args` after its socket's descriptor) with
    `env`: the process and the daemon's end of its socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        process = subprocess.Popen(
            [python, "-m", "salus.daemon.executor.zygote", str(theirs.fileno()), *args],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=dict(env), **popen)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, ours


def wait_or_kill(process: subprocess.Popen[bytes], timeout_s: float = STOP_WAIT_S) -> None:
    """Wait for a zygote told to stop; kill it if it does not exit within `timeout_s`."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def salusd_version() -> str:
    try:
        return version("salusd")
    except PackageNotFoundError:
        return "unknown"


def environment_of(python: str) -> str:
    """The environment an interpreter at path `python` runs in, without running it: the
    virtualenv beside it (the directory holding `pyvenv.cfg`), else its installation's
    prefix."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    if os.path.isfile(os.path.join(here, "pyvenv.cfg")):
        return here
    return os.path.dirname(os.path.dirname(os.path.realpath(python)))


def other_interpreter(interpreter: str, env: Mapping[str, str]) -> str | None:
    """The absolute path of `interpreter` (a path, or a name looked up on `env`'s PATH) when
    it is another environment than the daemon's; None for the daemon's own, or for one that
    is not found (the executor then says why)."""
    found = (interpreter if os.sep in interpreter
             else shutil.which(interpreter, path=env.get("PATH", os.defpath)))
    if found is None or not os.path.isfile(found):
        return None
    path = os.path.abspath(found)
    if path == sys.executable or environment_of(path) == os.path.realpath(sys.prefix):
        return None
    return path


@dataclass(eq=False)
class Zygote:
    """A zygote of interpreter `python` running as uid `uid`."""

    python: str
    uid: int
    popen: subprocess.Popen[bytes]
    link: Link
    ready: bool = False


class OtherZygotes:
    """The zygotes of other interpreters, by (interpreter path, uid). `on_message` gets their
    `forked` and `exited` messages (as the daemon's zygote's); `on_failed(zygote, why)` is
    told when one cannot serve, so the forks it owes fail with `why`."""

    def __init__(self, loop: Loop, environment: Callable[[], dict[str, str]],
                 on_message: Callable[[dict[str, Any]], None],
                 on_failed: Callable[[Zygote, str], None]) -> None:
        self.loop = loop
        self.environment = environment
        self.on_message = on_message
        self.on_failed = on_failed
        self._zygotes: dict[tuple[str, int], Zygote] = {}
        self._by_link: dict[int, Zygote] = {}
        self._stopping = False

    def __len__(self) -> int:
        return len(self._zygotes)

    def get(self, python: str, who: dict[str, Any]) -> Zygote:
        """The zygote of `python` for the owner `who` (`supervisor.identity`), started now
        when there is none."""
        key = (python, int(who["uid"]))
        zygote = self._zygotes.get(key)
        if zygote is None:
            zygote = self._zygotes[key] = self._start(python, who)
            self._by_link[id(zygote.link)] = zygote
        return zygote

    def _start(self, python: str, who: dict[str, Any]) -> Zygote:
        env = {k: v for k, v in self.environment().items() if k not in NOT_INHERITED}
        env.update({"HOME": who["home"] or "/", "USER": who["user"], "LOGNAME": who["user"]})
        drop: dict[str, Any] = {}
        if os.geteuid() == 0 and who["uid"] != 0:
            drop = {"user": who["uid"], "group": who["gid"], "extra_groups": who["groups"]}
        popen, ours = launch(python, [salusd_version()], env, cwd="/", **drop)
        log.info("starting an executor zygote of %s for uid %d (pid %d)", python, who["uid"],
                 popen.pid)
        return Zygote(python, int(who["uid"]), popen,
                      self.loop.add(Link(ours, self._frame, self._closed)))

    def _frame(self, link: Link, frame: RawFrame) -> None:
        message = frame.json()
        frame.close_fd()
        zygote = self._by_link.get(id(link))
        if zygote is None or not isinstance(message, dict):
            return
        if message.get("op") == "ready":
            zygote.ready = True
            log.info("executor zygote of %s for uid %d ready (pid %s)", zygote.python,
                     zygote.uid, message.get("pid"))
        elif message.get("op") == "refused":
            self._forget(zygote, str(message.get("message", "it refused"))[:2000])
        else:
            self.on_message(message)

    def _closed(self, link: Link, reason: str) -> None:
        zygote = self._by_link.get(id(link))
        if zygote is None or self._stopping:
            return
        want = salusd_version()
        why = (f"{zygote.python} cannot import salusd {want} and torch (its error is in "
               f"salusd's log): install them in that environment ({zygote.python} -m pip "
               f"install salusd=={want}), or run the script with the daemon's interpreter"
               if not zygote.ready else
               f"the executor zygote of {zygote.python} went away ({reason})")
        self._forget(zygote, why)

    def _forget(self, zygote: Zygote, why: str) -> None:
        """`zygote` cannot serve: the next job of its key starts another one."""
        log.warning("executor zygote of %s for uid %d: %s", zygote.python, zygote.uid, why)
        self._zygotes.pop((zygote.python, zygote.uid), None)
        self._by_link.pop(id(zygote.link), None)
        self.loop.close(zygote.link, why)
        self.loop.call_later(1.0, zygote.popen.poll)  # reaped once it has exited
        self.on_failed(zygote, why)

    def stop(self) -> None:
        """Close every zygote's link (each then exits and its executors die with it) and wait
        for them, killing one that does not exit."""
        self._stopping = True
        for zygote in self._zygotes.values():
            self.loop.close(zygote.link, "salusd stopped")
        for zygote in self._zygotes.values():
            wait_or_kill(zygote.popen)
        self._zygotes.clear()
        self._by_link.clear()

"""Zygotes of other interpreters: one per (interpreter path, owner), started on first use.

A user's packages live in the user's environment (a virtualenv, conda), not in the daemon's. A
job whose interpreter is another environment than the daemon's (a script job's `python`, as
the caller's shell resolved it) gets its executor from a zygote of that interpreter: started
as the owner the first time one of the owner's jobs needs it (`python -m
salus.daemon.executor.zygote FD VERSION`: it imports the executor code, and torch where that
environment has it, once, then forks executors in milliseconds, exactly as the daemon's own
zygote does), kept warm for the owner's next jobs, and stopped with the daemon (it also dies
with it: `PR_SET_PDEATHSIG`). Because it runs as the owner, its imports run the owner's code
with the owner's rights only.

The environment needs neither salusd nor torch: the zygote finds the daemon's own salusd
packages, and nothing else of the daemon's, first on its `PYTHONPATH` (`python_path.py`). It
must be Python 3.11 or later and find the daemon's salusd version there: a zygote that cannot
says why (`refused`) or exits before it is ready, and the jobs waiting for it fail with one
line naming the interpreter and what it lacks. Where an interpreter's environment is the
daemon's own (its `sys.prefix`), the daemon's zygote serves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from salus.daemon import installed_version
from salus.daemon.loop import Link, Loop
from salus.daemon.owners import run_as
from salus.daemon.python_path import PythonPath
from salus.daemon.wire.frames import RawFrame

log = logging.getLogger("salusd.supervisor")
STOP_WAIT_S = 10.0
# Variables that would point another interpreter at the daemon's own packages.
NOT_INHERITED = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
# What of the daemon's environment its executors start with: the search paths and locale the
# interpreter and its libraries need, and the settings an operator gives torch, the BLAS and
# OpenMP runtimes, CUDA, NCCL and salusd itself. Nothing else of the daemon's (its tokens, its
# service manager's variables) reaches job code; a script job gets its caller's environment.
INHERITED = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH",
                       "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                       "PYTHONWARNINGS", "PYTHONFAULTHANDLER"})
INHERITED_PREFIXES = ("LC_", "SALUS_", "CUDA_", "CUBLAS_", "CUDNN_", "NCCL_", "NVIDIA_",
                      "TORCH_", "PYTORCH_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GLOO_")


def inherited(base: Mapping[str, str]) -> dict[str, str]:
    """The variables of `base` (the daemon's environment) its executors start with."""
    return {k: v for k, v in base.items() if k in INHERITED or k.startswith(INHERITED_PREFIXES)}


def launch(loop: Loop, python: str, args: list[str], env: Mapping[str, str],
           **popen: Any) -> tuple[subprocess.Popen[bytes], socket.socket, OutputRelay]:
    """Start an executor zygote of `python` (`args` after its socket's descriptor) with
    `env`: the process, the daemon's end of its socket and the relay of its output. Its
    stdout and stderr (so its executors') are a pipe whose lines the daemon logs
    (`OutputRelay`): no executor holds a descriptor of the daemon's own log."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read, write = os.pipe()
    try:
        process = subprocess.Popen(
            [python, "-m", "salus.daemon.executor.zygote", str(theirs.fileno()), *args],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=write, stderr=write,
            env=dict(env), **popen)
    except BaseException:
        ours.close()
        os.close(read)
        raise
    finally:
        theirs.close()
        os.close(write)
    return process, ours, OutputRelay(loop, read, process.pid)


class OutputRelay:
    """The daemon's end of a zygote's output pipe: each line becomes one record of the
    daemon's log, under `executor output (zygote PID):`, so what an executor (or job code
    writing to its descriptors) prints there cannot pass for a line of the daemon's own. At
    most `MAX_LINES` lines a second are kept (the rest are counted, and the count logged),
    each cut at `MAX_LINE` characters; the pipe is closed once every writer has gone."""

    MAX_LINE = 2000
    MAX_LINES = 200

    def __init__(self, loop: Loop, fd: int, zygote: int) -> None:
        self.loop, self.fd, self.zygote = loop, fd, zygote
        self.partial = b""
        self.last = ""  # the last line, for why a zygote that exited at start failed
        self.second, self.lines, self.dropped = -1, 0, 0
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._read)

    def _read(self) -> bool:
        """Log what one read brings; False when nothing came (or the pipe is closed)."""
        if self.fd < 0:
            return False
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self.loop.selector.unregister(self.fd)
            os.close(self.fd)
            self.fd = -1
            if self.partial:
                self._line(self.partial)
            self._count_dropped()
            return False
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        if len(self.partial) > self.MAX_LINE:
            lines.append(self.partial)
            self.partial = b""
        for line in lines:
            self._line(line)
        return True

    def drain(self) -> None:
        """Log what the pipe holds now: a zygote wrote its last lines (why it exited) before
        its exit closed its socket, which the loop may see first."""
        while self._read():
            pass

    def _line(self, raw: bytes) -> None:
        second = int(self.loop.clock())
        if second != self.second:
            self._count_dropped()
            self.second, self.lines = second, 0
        self.lines += 1
        if self.lines > self.MAX_LINES:
            self.dropped += 1
            return
        text = raw[:self.MAX_LINE].decode("utf-8", "replace").rstrip("\r")
        if text.strip():
            self.last = text.strip()
        log.warning("executor output (zygote %d): %s", self.zygote,
                    text.encode("unicode_escape").decode("ascii") if not text.isprintable()
                    else text)

    def _count_dropped(self) -> None:
        if self.dropped:
            log.warning("executor output (zygote %d): %d lines left out (more than %d a "
                        "second)", self.zygote, self.dropped, self.MAX_LINES)
            self.dropped = 0


def stop_zygote(process: subprocess.Popen[bytes], timeout_s: float = STOP_WAIT_S) -> None:
    """Stop a zygote whose link is closed: SIGTERM (it kills its executors and exits at once,
    even in the middle of its preloading, which reads no link), then wait; kill it if it does
    not exit within `timeout_s`."""
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


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
    output: OutputRelay
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
        self.path = PythonPath()  # salusd's packages, for the other interpreters

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
        env.update({"HOME": who["home"] or "/", "USER": who["user"], "LOGNAME": who["user"],
                    "PYTHONPATH": self.path.directory()})
        popen, ours, output = launch(self.loop, python, [installed_version()], env, cwd="/",
                                     **run_as(who))
        log.info("starting an executor zygote of %s for uid %d (pid %d)", python, who["uid"],
                 popen.pid)
        return Zygote(python, int(who["uid"]), popen,
                      self.loop.add(Link(ours, self._frame, self._closed)), output)

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
        zygote.output.drain()
        self._forget(zygote, exited_why(zygote.python, zygote.ready, zygote.output.last,
                                        zygote.popen.poll()))

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
            stop_zygote(zygote.popen)
        self._zygotes.clear()
        self._by_link.clear()
        self.path.remove()


def exited_why(python: str, ready: bool, last_line: str, status: int | None) -> str:
    """One line on why jobs of interpreter `python` cannot run: its zygote exited before it
    was ready (`ready` False: `last_line`, the last it printed, says why) or after (what its
    executors printed last is theirs, not its), with `status` its return code (-N: signal
    N; None: not reaped yet)."""
    status_said = ("" if status is None else f" (signal {-status})" if status < 0
                   else f" (exit status {status})")
    if not ready:
        said = f": {last_line}" if last_line else status_said
        return f"{python} exited before it could run the script{said}"
    return f"{python} exited while salusd was running scripts with it{status_said}"

"""`salusd run --here`: the script runs in a child of `salusd run` itself, taking turns from the
daemon, instead of in an executor salusd forks.

This is how a pod runs its own script (`salusd run` in a pod, where the device plugin's grant
set `SALUS_GRANT`, does it without the flag): the script, its interpreter, its packages and its
data are the pod's, and so is the process. `salusd run` makes a socket pair for the executor's
link and hands the daemon one end (`socket` with `executor`) before its `run` with `here`; once
the daemon took the job it forks the executor on the other end: `script_only.serve` without
`Become` (it already is the caller), in a session of its own (the terminal's Ctrl-C reaches
`salusd run`, which forwards it as for any script job), dying with `salusd run`. Its stdio is
`salusd run`'s relay, as for any script job (the client's socket travels through the daemon).

The daemon adopts that link as the job's executor (`salusd/supervisor/pool.py`): the script's
boundaries take turns, are measured and placed, and are suspended, resumed and cancelled as any
script job's. Salusd cannot signal or kill a process in another pid namespace, so it signals
through the link and kills by closing it (`salusd/executor/in_pod.py`).

What `--here` cannot do, said when asked: a torchrun gang, `--restart on-failure`, `--after`
and `--array` (each needs salusd to start processes later), and `salus.resume_dir()` (the
daemon's state dir is not the pod's).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
import traceback

from salus.daemon.cli.control import Control
from salus.daemon.wire import control_ops as ops

GRANT_ENV = "SALUS_GRANT"  # set by the device plugin's grant: this process is in a pod
REAP_WAIT_S = 5.0  # after the script's status came, its process exits within this


def in_pod() -> bool:
    """Whether this process runs in a pod that salusd's device plugin granted a share."""
    return GRANT_ENV in os.environ


class HereExecutor:
    """The executor of a `run --here`: its link handed to the daemon (`offer`), then its
    process (`start`, once the daemon took the job), then reaped (`reap`)."""

    def __init__(self) -> None:
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid: int | None = None

    def offer(self, channel: Control) -> None:
        """Hand the daemon its end of the link, for the next `run` (which says `here`)."""
        channel.send(ops.Socket(executor=True), self._theirs.fileno())
        self._theirs.close()
        channel.reply()

    def start(self, threads: int) -> None:
        """Fork the executor on our end of the link, with `threads` intra-op threads (the
        daemon's for each job)."""
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(self._ours.detach(), parent, threads)
        self.pid = pid
        self._ours.close()

    def close(self) -> None:
        """Drop our end of the link unstarted (the daemon then sees the executor gone)."""
        self._ours.close()
        self._theirs.close()

    def reap(self) -> int | None:
        """Wait for the executor to exit (it does once the daemon let the job go), killing its
        process group if it has not within `REAP_WAIT_S`; its exit code (-N: signal N; None:
        never started, or reaped before)."""
        pid, self.pid = self.pid, None
        if pid is None:
            return None
        deadline = time.monotonic() + REAP_WAIT_S
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _child(fd: int, parent: int, threads: int) -> None:
    """The executor process: keep only the link and stdio (the relay's descriptors must close
    when the script's do), lead a session of its own, die with `salusd run`, and serve."""
    code = 1
    try:
        from salus.daemon.executor.process import set_threads
        from salus.daemon.executor.script_only import serve
        from salus.daemon.executor.zygote import die_with_parent

        os.closerange(3, fd)
        os.closerange(fd + 1, 65536)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                       signal.SIGUSR2, signal.SIGWINCH):
            signal.signal(signum, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.setsid()
        die_with_parent(signal.SIGKILL, parent)
        set_threads(threads)
        code = serve(socket.socket(fileno=fd), in_pod=True)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)

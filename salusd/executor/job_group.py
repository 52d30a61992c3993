"""A job's process group: what a job's code starts ends with the job, also in an executor that
goes on serving its owner's other jobs.

Mechanism (chosen over the alternatives below): each contract job has a process group of its
own, led by a tiny *anchor* process the executor starts (`python -I -S`, pausing; it dies with
the executor). While a job's code runs, the executor itself is a member of that job's group
(`setpgid`, one system call when `Executor._switch` changes jobs), so every process the code
starts — `subprocess.Popen`, `os.fork`, `multiprocessing`, DataLoader workers, and their own
children — is born in the job's group, whichever thread or library forks it. When the job ends
(or moves to another executor), the executor leaves the group and sends it SIGTERM, then
SIGKILL to what is left after `KILL_WAIT_S`, and reaps the members that were its children
(`waitpid(-group)`: another job's children are never touched). Signals and waits go to the
job's group only: the executor leaves it before, and other jobs' groups are other ids.

Alternatives set aside: a cgroup per job needs a delegated cgroup tree that the owner's
executor may move itself between, which neither a non-root daemon nor most containers have;
attributing the pids that appear under the executor (a child subreaper) to the job whose code
ran when they appeared misattributes a process that a job's child starts and orphans while
another job's code runs, and would then kill that other job's process.

What it does not reach: a process that leaves the job's group itself (`setsid`, a new process
group: a daemon) and a fork from a job's background thread while another job's code runs
(it joins that job's group). Those end when the executor ends (the zygote kills every process
left in its tree), as before. A script job's process is its own executor: its command runs in
the executor's own group, and the zygote ends what it started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("salusd.executor")
KILL_WAIT_S = 1.0  # SIGTERM to SIGKILL, then SIGKILL to giving up (seconds)
POLL_S = 0.01
# The anchor leads the group; it dies with the executor (PR_SET_PDEATHSIG, option 1).
_ANCHOR = ("import ctypes, os, signal, sys\n"
           "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
           "if os.getppid() != int(sys.argv[1]):\n"
           "    sys.exit(0)\n"
           "while True:\n"
           "    signal.pause()\n")


class JobGroup:
    """One job's process group in its executor (`enter` before its code runs, `end` when the
    job ends here)."""

    def __init__(self) -> None:
        self.anchor: subprocess.Popen[bytes] | None = None  # the group's leader

    @property
    def id(self) -> int | None:
        """The process group id (None before the job's code first ran)."""
        return None if self.anchor is None else self.anchor.pid

    def enter(self) -> None:
        """Make the executor a member of the job's group, starting the group when it has none
        (or its anchor is gone), so that what the job's code starts from now is in it. Where
        no group can be started (a process limit), the executor stays in its own group, and
        the job's children end with the executor (a warning is logged)."""
        try:
            if self.anchor is None or self.anchor.poll() is not None:
                self.anchor = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _ANCHOR, str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, process_group=0)
            os.setpgid(0, self.anchor.pid)
        except OSError as exc:
            _home()
            log.warning("cannot give the job a process group of its own (%s): what it starts "
                        "ends with its executor, not with the job", exc)

    def end(self, wait_s: float = KILL_WAIT_S) -> None:
        """End every process of the job's group: SIGTERM, then SIGKILL to what is left after
        `wait_s` seconds; the executor leaves the group first (if it is in it)."""
        anchor, self.anchor = self.anchor, None
        if anchor is None:
            return
        group = anchor.pid
        if os.getpgrp() == group:
            _home()
        if _signal(group, signal.SIGTERM) and not _gone(group, wait_s):
            _signal(group, signal.SIGKILL)
            _gone(group, wait_s)
        anchor.poll()  # reaped above: this only records it


def _home() -> None:
    """Put the executor back in its own process group (the one it leads)."""
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)


def _signal(group: int, signum: int) -> bool:
    """Send `signum` to process group `group`; False when it has no member we may signal."""
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _gone(group: int, within_s: float) -> bool:
    """Reap the group's members that are the executor's children until none is left (True) or
    `within_s` seconds passed (False)."""
    deadline = time.monotonic() + within_s
    while True:
        _reap(group)
        if not _signal(group, 0):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def _reap(group: int) -> None:
    """Reap the executor's children of process group `group` that have exited."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-group, os.WNOHANG)[0] != 0:
            pass

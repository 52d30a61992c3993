"""An executor process's start: forked by the zygote, it becomes the job's owner, then serves.

The zygote (`zygote.py`) forks it with torch already imported, so it starts in milliseconds.
Its first message from the daemon says who it becomes (`Become`): as root it drops to the
owner's uid, gid and groups before it receives any job bytes, and then can do exactly what the
owner could do by running the script. Its loop is `main.Executor`; in a zygote of an
interpreter without torch, `script_only.serve`, which runs script jobs only. This module
itself imports no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import signal
import socket
import sys
from types import ModuleType

from salus.daemon.executor.on_import import imported, when_imported
from salus.daemon.executor.privileges import drop_privileges
from salus.daemon.executor.zygote import die_with_parent, reap_orphans
from salus.daemon.wire.executor_ops import Become

log = logging.getLogger("salusd.executor")
_PR_SET_DUMPABLE = 4
_threads = 1  # the jobs' intra-op threads (`Become.threads`)


def threads() -> int:
    """The intra-op thread count the daemon gives this process's jobs."""
    return _threads


def _set_threads(torch: ModuleType) -> None:
    torch.set_num_threads(_threads)


def become(hello: Become) -> None:
    """Drop to the owner's identity (when running as root) and every privilege
    (`privileges.py`), and set up the jobs' environment:
    home, user name, intra-op threads, no core dumps (each job's working directory is set
    when its code runs: `Executor._switch`)."""
    uid, gid, groups = hello.uid, hello.gid, list(hello.groups)

    def take_identity() -> None:
        if os.geteuid() == 0 and uid != 0:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            # Changing uid makes the process undumpable, which hands its /proc files to root
            # and would hide /proc/self/clear_refs (the peak meter) from the job; its owner
            # may see it.
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)

    drop_privileges(take_identity)  # no capability, no_new_privs: `privileges.py`
    if os.getuid() != uid:
        raise PermissionError(f"executor runs as uid {os.getuid()} and cannot become {uid}")
    os.environ.update({"HOME": hello.home or "/", "USER": hello.user, "LOGNAME": hello.user})
    for place in (hello.home, "/"):
        if isinstance(place, str):
            with contextlib.suppress(OSError):
                os.chdir(place)
                break
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    set_threads(hello.threads)


def set_threads(count: int) -> None:
    """The jobs' intra-op thread count: set in torch now, or as a script imports it."""
    global _threads
    _threads = max(1, count)
    when_imported("torch", _set_threads)


def child_main(fd: int, zygote: int) -> None:
    """Entry point in an executor just forked by the zygote (pid `zygote`): keep only the
    channel `fd` and stdio; lead a process group of its own, die with the zygote, and keep
    the job's orphaned descendants as its children (the zygote kills them when it ends)."""
    if imported("torch") is not None:
        from salus.daemon.executor.main import serve
    else:
        from salus.daemon.executor.script_only import serve

    os.closerange(3, fd)
    os.closerange(fd + 1, 65536)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)
    die_with_parent(signal.SIGKILL, zygote)
    reap_orphans()
    sock = socket.socket(fileno=fd)
    code = 1
    try:
        code = serve(sock, zygote)
    except BaseException:
        log.exception("executor failed")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

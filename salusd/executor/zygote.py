"""The zygote: a process that imports torch once and forks executors on the daemon's request.

The daemon itself never imports torch; it starts this process at start-up, which imports torch,
the executor code and warms the fake-tensor estimator, then serves two requests over a socket
pair: `fork` (with the new executor's end of a socket pair attached) answered by `forked` with
its pid, and it reports every executor's exit (`exited`, with the wait status) as it reaps it.
Forking a warm process takes milliseconds (PipeSwitch's pre-started workers, Android's zygote),
and the torch pages the children share copy-on-write keep many executors cheap in memory.
The daemon's zygote says `ready` once torch imported (the daemon then listens) and preloads
the rest (the executor code, the fake-tensor warm-up: about 3 s of CPU) before it reads the
first fork request, so the daemon's start and the preloading overlap; a job that comes at
once waits for them, as it would have waited for the start.

The zygote runs as the daemon's user and never runs job code; its children drop privileges
before they receive any (`process.become`). It starts no threads before forking. A zygote of
another interpreter (`salusd/supervisor/zygotes.py`) runs as the owner whose jobs it forks, with the
daemon's salusd on its path, and first checks that the interpreter is Python 3.11 or later
and that the salusd it finds is the daemon's version; it refuses to serve otherwise, saying
so in one line. It imports torch where that environment has it (its executors then run any
job, as the daemon's do); where it has none, its executors run script jobs only
(`script_only.py`) and never import torch themselves.

Nothing outlives the daemon or a job: the zygote gets SIGTERM when the daemon dies (Linux
`PR_SET_PDEATHSIG`) and then kills every executor's process group; each executor leads its own
process group, gets SIGKILL when the zygote dies, and is a child subreaper
(`PR_SET_CHILD_SUBREAPER`), so its orphaned descendants stay in its tree. When an executor
exits, the zygote kills its process group and every other process left reparented to the
zygote (itself a subreaper): what a job forked dies with the job. An executor that serves
several jobs runs each contract job's code in a process group of the job's own and ends that
group when the job ends there (`job_group.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import selectors
import signal
import socket
import sys

from salus.daemon.wire.frames import FrameReader, RawFrame, json_frame

log = logging.getLogger("salusd.zygote")
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
MIN_PYTHON = (3, 11)  # pyproject.toml's requires-python
_executors: set[int] = set()  # pids of the executors forked and not yet reaped


def _prctl(option: int, value: int) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


def die_with_parent(sig: int, parent: int) -> None:
    """Have the kernel send `sig` to this process when its parent (pid `parent`) exits; exit
    at once if it already has. Changing uid or gid clears this: set it again after."""
    _prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def reap_orphans() -> None:
    """Make this process a child subreaper: descendants orphaned below it become its
    children, not init's."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _children(pid: int) -> list[int]:
    """The children of process `pid` (from /proc, Linux 3.5+)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]
    return []


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants as they are now."""
    found: list[int] = []
    stack = [pid]
    while stack and len(found) < 100_000:
        found.append(stack.pop())
        stack.extend(_children(found[-1]))
    return found


def _kill_leftovers(executor: int | None) -> None:
    """Kill what an ended executor left (`executor` None: kill every executor and what it
    started): its process group, and every process reparented to the zygote, with their
    descendants."""
    groups = _executors if executor is None else {executor}
    roots = [p for p in _children(os.getpid()) if executor is None or p not in _executors]
    doomed = [p for root in roots for p in _tree(root)]  # found before any is killed
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _daemon_died(*_: object) -> None:
    _kill_leftovers(None)
    os._exit(1)


def _send(sock: socket.socket, message: dict[str, object]) -> None:
    sock.sendall(b"".join(json_frame(message).buffers()))


def _fork(sock: socket.socket, frame: RawFrame) -> None:
    request = frame.json()
    token = request.get("token") if isinstance(request, dict) else None
    if frame.fd is None:
        _send(sock, {"op": "forked", "token": token, "pid": -1})
        return
    fd, frame.fd = frame.fd, None
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        from salus.daemon.executor.process import child_main

        sock.close()
        child_main(fd, zygote)
    _executors.add(pid)
    os.close(fd)
    _send(sock, {"op": "forked", "token": token, "pid": pid})


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in _executors:
            _executors.discard(pid)
            _kill_leftovers(pid)
            _send(sock, {"op": "exited", "pid": pid, "status": status})


def serve(fd: int, daemon: int, want: str | None = None) -> int:
    """Serve fork requests on socket `fd` until the daemon (pid `daemon`) closes it or dies.
    `want`: the daemon's salusd version, for a zygote of another interpreter
    (`salusd/supervisor/zygotes.py`), which refuses to serve without Python 3.11 and that version,
    and imports torch only where its environment has it."""
    signal.signal(signal.SIGTERM, _daemon_died)
    die_with_parent(signal.SIGTERM, daemon)
    reap_orphans()
    sock = socket.socket(fileno=fd)
    if want is not None and (why := _cannot_serve(want)):
        _send_blocking(sock, {"op": "refused", "message": why})
        return 1
    if want is None:  # salusd's own environment: torch imports, and the daemon can listen
        import torch  # noqa: F401 - a torch that does not import fails the daemon's start

        _send_blocking(sock, {"op": "ready", "pid": os.getpid()})
    if want is None or _has_torch():
        from salus.daemon.executor import main  # noqa: F401 - the executors' code, preloaded
        from salus.daemon.executor.measure import warm_up

        warm_up()
    else:
        from salus.daemon.executor import script_only  # noqa: F401 - preloaded
    _trim()  # every executor starts from these pages: leave none the warm-up freed
    sock.setblocking(False)
    reader = FrameReader(sock)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    if want is not None:  # another interpreter: ready once its environment ran our code
        _send_blocking(sock, {"op": "ready", "pid": os.getpid()})
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj == wake_r:
                    os.read(wake_r, 4096)
                    _blocking(sock, _reap)
                    continue
                frames, closed = reader.read(0.0)
                if closed:  # the daemon stopped: fork nothing more
                    return 0
                for frame in frames:
                    _blocking(sock, lambda s, f=frame: _fork(s, f))
    except (BrokenPipeError, ConnectionResetError):  # it stopped while we answered it
        return 0


def _cannot_serve(want: str) -> str:
    """Why this interpreter cannot run the daemon's executors ('' when it can), in one line
    that names it and what it lacks."""
    import importlib.metadata

    python = sys.executable
    if old := too_old(python, tuple(sys.version_info[:3])):
        return old
    try:
        have = importlib.metadata.version("salusd")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if (have or "unknown") != want:  # "unknown": neither has metadata (a source tree)
        return (f"{python} finds salusd {have or 'without a version'} where this salusd runs "
                f"{want}: uninstall salusd from that environment or install salusd=={want} "
                "there (if salusd was upgraded since it started, restart it)")
    return ""


def too_old(python: str, version: tuple[int, ...]) -> str:
    """Why interpreter `python` of `version` (major, minor, micro) cannot run salusd's
    executor code ('' when it can: Python `MIN_PYTHON` or later)."""
    if version[:2] >= MIN_PYTHON:
        return ""
    found = ".".join(map(str, version))
    wanted = ".".join(map(str, MIN_PYTHON))
    return f"{python} is Python {found}; salusd runs scripts with Python {wanted} or later"


def _has_torch() -> bool:
    """Import torch where this interpreter's environment has it, once for every executor;
    False where it has none, or where it cannot be imported (said in the daemon's log: a
    script that imports it fails there as in a direct run)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch  # noqa: F401 - imported here once, shared by every executor
    except Exception as exc:  # a broken install: the executors run script jobs only
        print(f"{sys.executable} cannot import torch ({type(exc).__name__}: {exc}): its "
              "executors run script jobs only", file=sys.stderr)
        return False
    return True


def _trim() -> None:
    """Collect garbage and hand the heap's free pages back to the kernel (glibc's
    `malloc_trim`), so that forked executors do not carry them."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _blocking(sock: socket.socket, fn: object) -> None:
    sock.setblocking(True)
    try:
        fn(sock)  # type: ignore[operator]
    finally:
        sock.setblocking(False)


def _send_blocking(sock: socket.socket, message: dict[str, object]) -> None:
    _blocking(sock, lambda s: _send(s, message))


def main() -> None:
    """Serve, then end every executor and exit at once: the interpreter's own teardown, with
    torch and its compiler stack loaded, takes a second of CPU that nothing needs (measured:
    1.1-1.3 s against 0.06 s for `os._exit`)."""
    code = serve(int(sys.argv[1]), os.getppid(), sys.argv[2] if len(sys.argv) > 2 else None)
    _kill_leftovers(None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

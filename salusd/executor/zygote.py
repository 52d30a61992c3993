"""The zygote: a process that imports torch once and forks executors on the daemon's request.

The daemon itself never imports torch; it starts this process at start-up, which imports torch,
the executor code and warms the fake-tensor estimator, then serves two requests over a socket
pair: `fork` (with the new executor's end of a socket pair attached) answered by `forked` with
its pid, and it reports every executor's exit (`exited`, with the wait status) as it reaps it.
Forking a warm process takes milliseconds (PipeSwitch's pre-started workers, Android's zygote),
and the torch pages the children share copy-on-write keep many executors cheap in memory.

The zygote runs as the daemon's user and never runs job code; its children drop privileges
before they receive any (`main.become`). It starts no threads before forking.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import sys

from salus.daemon.wire.frames import FrameReader, RawFrame, json_frame

log = logging.getLogger("salusd.zygote")


def _send(sock: socket.socket, message: dict[str, object]) -> None:
    sock.sendall(b"".join(json_frame(message).buffers()))


def _fork(sock: socket.socket, frame: RawFrame) -> None:
    request = frame.json()
    token = request.get("token") if isinstance(request, dict) else None
    if frame.fd is None:
        _send(sock, {"op": "forked", "token": token, "pid": -1})
        return
    fd, frame.fd = frame.fd, None
    pid = os.fork()
    if pid == 0:
        from salus.daemon.executor.main import child_main

        sock.close()
        child_main(fd)
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
        _send(sock, {"op": "exited", "pid": pid, "status": status})


def serve(fd: int) -> int:
    """Serve fork requests on socket `fd` until the daemon closes it."""
    import torch  # noqa: F401 - imported here once, shared by every executor

    from salus.daemon.executor import main  # noqa: F401 - the executors' code, preloaded
    from salus.daemon.executor.measure import warm_up

    warm_up()
    sock = socket.socket(fileno=fd)
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
    _send_blocking(sock, {"op": "ready", "pid": os.getpid()})
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _blocking(sock, _reap)
                continue
            frames, closed = reader.read(0.0)
            for frame in frames:
                _blocking(sock, lambda s, f=frame: _fork(s, f))
            if closed:
                return 0


def _blocking(sock: socket.socket, fn: object) -> None:
    sock.setblocking(True)
    try:
        fn(sock)  # type: ignore[operator]
    finally:
        sock.setblocking(False)


def _send_blocking(sock: socket.socket, message: dict[str, object]) -> None:
    _blocking(sock, lambda s: _send(s, message))


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))

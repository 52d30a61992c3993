"""The client of the daemon's socket for everything but a job's tensors: an operator's status,
suspend / resume / cancel / priority / output of jobs the caller owns (root: any job), and the
requests of `salusd run` (`send` with a descriptor, `reply`), over the same unix socket as the
data plane.

    from salus.daemon.cli.control import Control
    with Control() as ctl:              # SALUS_ADDRESS or the default socket
        print(ctl.status()["jobs"])
        ctl.suspend("3", swap=True)

Standard library only (no torch, which the wire's tensor codec would import: `salusd run`
starts in a fraction of a second): it speaks JSON frames and nothing else. Replies come in the
order of the requests.
"""

from __future__ import annotations

import contextlib
import socket
from collections import deque
from typing import Any

from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.address import connect_unix, default_socket_path, parse_address
from salus.daemon.wire.errors import DaemonUnavailable
from salus.daemon.wire.frames import (
    FLAG_SOCKET,
    VERSION,
    FrameReader,
    RawFrame,
    json_frame,
    reply_result,
)


class Control:
    """One connection to salusd (one caller at a time). `timeout_s` bounds the connection
    and the wait for each reply; with `wait_forever`, only the connection (`salusd run` waits
    for its job's end, however long it runs)."""

    def __init__(self, address: str | None = None, *, timeout_s: float = 30.0,
                 wait_forever: bool = False) -> None:
        self.path = parse_address(address) if address is not None else default_socket_path()
        self._sock = connect_unix(self.path, timeout_s)
        if wait_forever:
            self._sock.settimeout(None)
        self._reader = FrameReader(self._sock)
        self._frames: deque[RawFrame] = deque()
        hello = self._call(ops.Ping())
        if hello.get("version") != VERSION:
            self.close()
            raise DaemonUnavailable(f"salusd at {self.path} speaks another protocol version")
        if hello.get("refused"):
            self.close()
            raise DaemonUnavailable(str(hello["refused"]))
        self.owner: str = hello.get("owner", "")
        state_dir = hello.get("state_dir")
        self.state_dir: str | None = state_dir if isinstance(state_dir, str) else None

    def status(self) -> dict[str, Any]:
        """Devices (budget, lanes) and jobs (state, progress, memory)."""
        result: dict[str, Any] = self._call(ops.Status())
        return result

    def info(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call(ops.Info(str(job_id)))
        return result

    def suspend(self, job_id: str, *, swap: bool = False) -> None:
        self._call(ops.Suspend(str(job_id), swap))

    def resume(self, job_id: str) -> None:
        self._call(ops.Resume(str(job_id)))

    def cancel(self, job_id: str) -> None:
        self._call(ops.Cancel(str(job_id)))

    def priority(self, job_id: str, priority: float) -> None:
        self._call(ops.Priority(str(job_id), priority))

    def logs(self, job_id: str, offset: int | None = None) -> dict[str, Any]:
        """At most 64 KiB of what the job printed from byte `offset` of its output file (None:
        its last 64 KiB): {"text", "offset" (to go on from), "ended" (the job ended)}."""
        result: dict[str, Any] = self._call(ops.Logs(str(job_id), offset))
        return result

    def close(self) -> None:
        self._reader.close()
        self._sock.close()

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, request: ops.Request, fd: int | None = None) -> None:
        """Send one request; `fd`, a descriptor, goes with it (a socket for the job)."""
        frame = json_frame(ops.encode(request))
        if fd is None:
            self._sock.sendall(b"".join(frame.buffers()))
            return
        frame.flags |= FLAG_SOCKET
        socket.send_fds(self._sock, [b"".join(frame.buffers())], [fd])

    def reply(self) -> Any:
        """The result of the oldest request not yet answered; SalusError for an error
        reply, DaemonUnavailable when the connection closed first."""
        while not self._frames:
            frames, closed = self._reader.read(0.0)
            self._frames.extend(frames)
            if closed and not self._frames:
                raise DaemonUnavailable(f"salusd at {self.path} closed the connection")
        frame = self._frames.popleft()
        frame.close_fd()
        return reply_result(frame.json())

    def call(self, request: ops.Request) -> dict[str, Any]:
        """`request`'s result, as an object ({} for any other result)."""
        self.send(request)
        result = self.reply()
        return result if isinstance(result, dict) else {}

    def _call(self, request: ops.Request) -> Any:
        try:
            # salusd may have answered and closed before the request went out (a connection
            # over its limit is refused at once): read what it said.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.send(request)
            return self.reply()
        except (TimeoutError, ConnectionError, OSError) as exc:
            raise DaemonUnavailable(f"lost the connection to salusd at {self.path}: "
                                    f"{exc}") from None

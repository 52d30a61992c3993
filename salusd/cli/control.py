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

from collections import deque
from typing import Any

from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.address import connect_unix, default_socket_path, parse_address
from salus.daemon.wire.client import Line, Pending, hello
from salus.daemon.wire.json_channel import JsonChannel


class Control:
    """One connection to salusd (one caller at a time). `timeout_s` bounds the connection
    and the wait for each reply; with `wait_forever`, only the connection (`salusd run` waits
    for its job's end, however long it runs)."""

    def __init__(self, address: str | None = None, *, timeout_s: float = 30.0,
                 wait_forever: bool = False) -> None:
        self.path = parse_address(address) if address is not None else default_socket_path()
        sock = connect_unix(self.path, timeout_s)
        channel = JsonChannel(sock)  # blocking, then each reply waited for at most timeout_s
        sock.settimeout(None if wait_forever else timeout_s)
        self._line = Line(channel, self.path)
        self._replies: deque[Pending] = deque()  # of `send`, for `reply`
        try:
            said = hello(self._line)
        except BaseException:
            self.close()
            raise
        self.owner: str = said.get("owner", "")
        state_dir = said.get("state_dir")
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
        self._line.channel.close()

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, request: ops.Request, fd: int | None = None) -> None:
        """Send one request; `fd`, a descriptor, goes with it (a socket for the job). Its
        result is `reply()`'s, in the order of the requests."""
        self._replies.append(self._line.request(request, fd=fd))

    def reply(self) -> Any:
        """The result of the oldest request `send` sent and `reply` did not return yet;
        SalusError for an error reply, DaemonUnavailable when the connection was lost
        first."""
        return self._replies.popleft().result()

    def call(self, request: ops.Request) -> dict[str, Any]:
        """`request`'s result, as an object ({} for any other result)."""
        result = self._call(request)
        return result if isinstance(result, dict) else {}

    def _call(self, request: ops.Request) -> Any:
        return self._line.request(request).result()

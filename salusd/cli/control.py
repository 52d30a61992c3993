"""A control client for operators: the daemon's status, and suspend / resume / cancel /
priority / output of jobs the caller owns (root: any job), over the same unix socket as the
data plane.

    from salus.daemon.cli.control import Control
    with Control() as ctl:              # SALUS_ADDRESS or the default socket
        print(ctl.status()["jobs"])
        ctl.suspend("3", swap=True)

Standard library only (no torch): it speaks JSON frames and nothing else.
"""

from __future__ import annotations

from typing import Any

from salus.daemon.wire.address import connect_unix, default_socket_path, parse_address
from salus.daemon.wire.errors import DaemonUnavailable
from salus.daemon.wire.frames import VERSION, FrameReader, json_frame, reply_result


class Control:
    """One connection to salusd for control requests (one caller at a time)."""

    def __init__(self, address: str | None = None, *, timeout_s: float = 30.0) -> None:
        self.path = parse_address(address) if address is not None else default_socket_path()
        self._sock = connect_unix(self.path, timeout_s)
        self._reader = FrameReader(self._sock)
        hello = self._call("ping")
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
        result: dict[str, Any] = self._call("status")
        return result

    def info(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("info", job=str(job_id))
        return result

    def suspend(self, job_id: str, *, swap: bool = False) -> None:
        self._call("suspend", job=str(job_id), swap=swap)

    def resume(self, job_id: str) -> None:
        self._call("resume", job=str(job_id))

    def cancel(self, job_id: str) -> None:
        self._call("cancel", job=str(job_id))

    def priority(self, job_id: str, priority: float) -> None:
        self._call("priority", job=str(job_id), priority=priority)

    def logs(self, job_id: str, offset: int | None = None) -> dict[str, Any]:
        """At most 64 KiB of what the job printed from byte `offset` of its output file (None:
        its last 64 KiB): {"text", "offset" (to go on from), "ended" (the job ended)}."""
        result: dict[str, Any] = self._call("logs", job=str(job_id), offset=offset)
        return result

    def close(self) -> None:
        self._reader.close()
        self._sock.close()

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, **fields: Any) -> Any:
        try:
            unsent: OSError | None = None
            try:
                self._sock.sendall(b"".join(json_frame({"op": op, **fields}).buffers()))
            except (BrokenPipeError, ConnectionResetError) as exc:
                # salusd may have answered and closed before the request went out (a
                # connection over its limit is refused at once): read what it said.
                unsent = exc
            while True:
                frames, closed = self._reader.read(0.0)
                if frames:
                    reply = frames[0].json()
                    break
                if closed:
                    raise unsent or ConnectionError("salusd closed the connection")
        except (TimeoutError, ConnectionError, OSError) as exc:
            raise DaemonUnavailable(f"lost the connection to salusd at {self.path}: "
                                    f"{exc}") from None
        return reply_result(reply)

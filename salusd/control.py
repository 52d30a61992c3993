"""A control client for operators: the daemon's status, and suspend / resume / cancel /
priority of jobs the caller owns, over the same unix socket as the data plane.

    from salus.daemon.control import Control
    with Control() as ctl:              # SALUS_ADDRESS or the default socket
        print(ctl.status()["jobs"])
        ctl.suspend("3", swap=True)
"""

from __future__ import annotations

from typing import Any

from salus.daemon.errors import DaemonUnavailable
from salus.daemon.ipc.wire import (
    VERSION,
    Channel,
    ConnectionClosed,
    connect_unix,
    default_socket_path,
    parse_address,
    reply_result,
)


class Control:
    """One connection to salusd for control requests (not thread-safe: one caller at a time)."""

    def __init__(self, address: str | None = None, *, timeout_s: float = 30.0) -> None:
        self.path = parse_address(address) if address is not None else default_socket_path()
        self._channel = Channel(connect_unix(self.path, timeout_s))
        hello = self._call("ping")
        if hello.get("version") != VERSION:
            self.close()
            raise DaemonUnavailable(f"salusd at {self.path} speaks another protocol version")
        self.owner: str = hello.get("owner", "")

    def status(self) -> dict[str, Any]:
        """Devices (arena figures, lanes) and jobs (state, progress, memory)."""
        result: dict[str, Any] = self._call("status")
        return result

    def suspend(self, job_id: str, *, swap: bool = False) -> None:
        self._call("suspend", job=str(job_id), swap=swap)

    def resume(self, job_id: str) -> None:
        self._call("resume", job=str(job_id))

    def cancel(self, job_id: str) -> None:
        self._call("cancel", job=str(job_id))

    def priority(self, job_id: str, priority: float) -> None:
        self._call("priority", job=str(job_id), priority=priority)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, **fields: Any) -> Any:
        try:
            self._channel.send({"op": op, **fields})
            return reply_result(self._channel.recv())
        except (ConnectionClosed, OSError) as exc:
            raise DaemonUnavailable(f"lost the connection to salusd at {self.path}: "
                                    f"{exc}") from None

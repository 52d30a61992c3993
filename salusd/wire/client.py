"""A client's side of one connection to salusd: what every client of its socket shares.

A connection carries requests and their replies in order, so a `Line` keeps what it sent and
has not had answered (`Pending`, a reply to come) and matches each reply it reads with the
oldest. `hello` is the first exchange of every connection: the protocol version, and whether
salusd refused the connection (over its limit, it answers the first request with why and
closes).

The operator's and `salusd run`'s client (`salusd/cli/control.py`) reads JSON frames
(`JsonChannel`, standard library only); a job's client (`salus.adapters.torch`, its line to
the daemon and its direct line to the job's executor) reads frames that carry tensors
(`Channel`). Both are a `Line` over their channel, with the same ordering, the same handling of
a connection that breaks (every request still waiting fails with the reason) and the same
hello.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.errors import DaemonUnavailable
from salus.daemon.wire.frames import VERSION, ConnectionClosed, FrameError, reply_result


class ClientChannel(Protocol):
    """What a `Line` needs of a channel (`Channel`, `JsonChannel`)."""

    def send(self, message: Any) -> None: ...

    def send_socket(self, message: dict[str, Any], fd: int) -> None: ...

    def recv(self) -> Any: ...

    def close(self) -> None: ...


class Waiting(Protocol):
    """How a line waits for its replies (`salus.adapters.torch.waiting.ReplyWait` polls for a
    reply it expects soon; `BLOCKING` just reads)."""

    def sent(self) -> None: ...

    def before_recv(self, channel: Any) -> None: ...

    def answered(self) -> None: ...


class _Blocking:
    def sent(self) -> None:
        pass

    def before_recv(self, channel: Any) -> None:
        pass

    def answered(self) -> None:
        pass


BLOCKING: Waiting = _Blocking()


class Pending:
    """The reply to one request, to come: `result()` waits for it on its line and returns
    what `decode` makes of it, or raises the error it stands for."""

    def __init__(self, line: Line, decode: Callable[[Any], Any]) -> None:
        self._line = line
        self._decode = decode
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def result(self) -> Any:
        if not self._done:
            self._line.wait_for(self)
        if self._error is not None:
            raise self._error
        return self._value

    def resolve(self, reply: Any) -> None:
        try:
            self._value = self._decode(reply)
        except BaseException as exc:
            self._error = exc
        self._done = True

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done = True


class Line:
    """One connection's requests and their replies, in order. `broken(exc)` makes the error
    the requests still waiting fail with once the connection is lost (default: salusd is
    unavailable); `aside(message)` takes a message that answers no request (the job's printed
    lines on its direct line) and says whether it did. Reading replies holds `lock` (a job's
    two lines share one); sending is its owner's to lock."""

    def __init__(self, channel: ClientChannel, path: str, *, wait: Waiting = BLOCKING,
                 broken: Callable[[BaseException], BaseException] | None = None,
                 aside: Callable[[Any], bool] | None = None,
                 lock: AbstractContextManager[Any] | None = None) -> None:
        self.channel = channel
        self.lock = lock if lock is not None else threading.RLock()
        self.path = path
        self.pending: deque[Pending] = deque()
        self.broken: BaseException | None = None
        self.wait = wait
        self._why_broken = broken or self._unavailable
        self._aside = aside
        self._send_failed: BaseException | None = None

    def request(self, message: Any, decode: Callable[[Any], Any] = reply_result, *,
                fd: int | None = None) -> Pending:
        """Send `message` (a typed request is encoded; `fd`, a descriptor, goes with it); its
        reply comes in order. A send the peer refused (it closed) is not an error yet: what
        salusd said before it closed (why it refused this connection) is read first."""
        if self.broken is not None:
            raise self.broken
        if isinstance(message, ops.REQUESTS):
            message = ops.encode(message)
        pending = Pending(self, decode)
        if self._send_failed is None:
            try:
                if fd is None:
                    self.channel.send(message)
                else:
                    self.channel.send_socket(message, fd)
            except (BrokenPipeError, ConnectionResetError) as exc:
                self._send_failed = exc
            except (ConnectionClosed, OSError) as exc:  # a timeout: the stream is cut
                self.lost(exc)
                raise self.broken from None  # type: ignore[misc]
        self.pending.append(pending)
        self.wait.sent()
        return pending

    def wait_for(self, pending: Pending) -> None:
        """Read replies until `pending` has its own (or the connection is lost)."""
        with self.lock:
            self._read_until(pending)

    def _read_until(self, pending: Pending) -> None:
        while not pending.done():
            head = self.pending[0]
            self.wait.before_recv(self.channel)
            try:
                reply = self.channel.recv()
            except (ConnectionClosed, OSError) as exc:
                self.lost(self._send_failed or exc)
                return
            except FrameError as exc:
                if not exc.recoverable:
                    self.lost(exc)
                    return
                self.pending.popleft()
                self.wait.answered()
                head.fail(exc)
                continue
            except BaseException:
                # Interrupted mid-reply: the stream is out of step with the requests.
                self.lost(ConnectionError("interrupted while reading a reply"))
                raise
            if self._aside is not None and self._aside(reply):
                continue
            self.pending.popleft()
            self.wait.answered()
            head.resolve(reply)

    def drain(self) -> None:
        """Wait for every reply still to come."""
        if self.pending:
            self.wait_for(self.pending[-1])

    def lost(self, exc: BaseException) -> None:
        """The connection is gone: every request still waiting fails with the reason."""
        waiting = list(self.pending)
        self.pending.clear()
        self.broken = self._why_broken(exc)
        for pending in waiting:
            pending.fail(self.broken)

    def _unavailable(self, exc: BaseException) -> BaseException:
        return DaemonUnavailable(f"lost the connection to salusd at {self.path}: {exc}")


def hello(line: Line, max_frame_bytes: int | None = None) -> dict[str, Any]:
    """The first exchange of a connection: salusd's answer to a ping (its `owner`, `version`
    and limits). DaemonUnavailable when it speaks another protocol version or refused the
    connection; its own error (SalusError) when it answered the ping with one."""
    reply = line.request(ops.Ping(max_frame_bytes)).result()
    if not isinstance(reply, dict) or reply.get("version") != VERSION:
        raise DaemonUnavailable(f"salusd at {line.path} speaks another protocol version "
                                f"({reply!r}); install matching versions")
    if reply.get("refused"):
        raise DaemonUnavailable(str(reply["refused"]))
    return reply

"""A job's connection to salusd: requests and their replies, in order, on the daemon's socket
or on a direct line to the job's executor (each a `salus.daemon.wire.client.Line`, as every
client of salusd's socket uses); reconnecting while salusd restarts; the random state handed
back and forth."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from salus.adapters.torch.replies import json_result
from salus.adapters.torch.waiting import ReplyWait, spin_s
from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.address import connect_unix
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.client import Line
from salus.daemon.wire.client import Pending as Future
from salus.daemon.wire.errors import DaemonUnavailable, JobCancelled, JobFailed, SalusError

RECONNECT_TRIES = 8  # with backoff 0.25 s doubling to 4 s: about 20 s for salusd to come back
# Calls in flight on a job's direct line at most: a further `submit` first waits for the oldest
# reply. Below the executor's bound (64 queued calls, beyond which it answers `busy`).
MAX_IN_FLIGHT = 32


def connect_retrying(path: str, timeout_s: float | None) -> socket.socket:
    """Connect; while salusd is restarting (`$SALUS_RECONNECT`, on by default; `0` turns it
    off) retry a bounded number of times with backoff."""
    tries = RECONNECT_TRIES if os.environ.get("SALUS_RECONNECT", "1") != "0" else 1
    delay = 0.25
    for attempt in range(tries):
        try:
            return connect_unix(path, timeout_s)
        except DaemonUnavailable as exc:
            if attempt == tries - 1 or "permission denied" in str(exc):
                raise
            time.sleep(delay)
            delay = min(4.0, delay * 2)
    raise AssertionError("unreachable")


def _printed(frame: Any) -> bool:
    """Print `frame` if it is a line the job printed (the executor sends them on the direct
    line as they are written, before the call's result), as the job wrote it."""
    if not (isinstance(frame, dict) and frame.get("op") == "output"):
        return False
    stream = sys.stderr if frame.get("stream") == "stderr" else sys.stdout
    stream.write(str(frame.get("text", "")))
    stream.flush()
    return True


class Connection:
    """The requests of one job: its line to the daemon and, once attached, its direct line to
    the job's executor (`Job` adds the contract on top)."""

    def __init__(self, channel: Channel, name: str, path: str) -> None:
        self._channel = channel
        self._lock = threading.RLock()
        self._line = Line(channel, path, lock=self._lock)
        self._direct: Line | None = None
        self.name = name
        self.path = path
        self.id: str | None = None
        self._closed = False
        self._rng_synced: torch.Tensor | None = None
        self._calls_answered = 0  # calls the job ran and answered (ok or failed in its code)

    def close(self) -> None:
        """Finish the job in the daemon and close the connection (idempotent)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._drain_direct()
                if self.id is not None and self._line.broken is None:
                    self._request(ops.Close(self.id)).result()
            except (DaemonUnavailable, SalusError):
                pass
            finally:
                self._closed = True
                if self._direct is not None:
                    self._direct.channel.close()
                self._channel.close()

    def _open_direct(self) -> None:
        """A socket straight to the job's executor for its calls: while the job has its lane
        to itself they skip the daemon (which is told afterwards)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._request(ops.Channel(self._require_id()),
                          fd=theirs.fileno()).result()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._direct = Line(Channel(ours, pool=True), self.path, wait=ReplyWait(spin_s()),
                            broken=self._why_executor_gone, aside=_printed, lock=self._lock)

    def _require_id(self) -> str:
        if self.id is None:
            raise RuntimeError(f"job {self.name!r} is not open")
        return self.id

    def _request(self, message: Any, decode: Callable[[Any], Any] | None = None, *,
                 direct: bool = False, fd: int | None = None) -> Future:
        """Send one request, to the daemon or (`direct`) straight to the job's executor; its
        Future resolves when its reply arrives (replies on a line come in order). A request of
        the daemon's socket is typed (`control_ops`); one on the direct line is its frame."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"job {self.name!r} is closed")
            line = self._direct if direct and self._direct is not None else self._line
            if line is self._line and self._direct is not None and self._direct.pending:
                self._drain_direct()  # what goes through the daemon follows the calls before
            if line is self._direct:
                while len(line.pending) >= MAX_IN_FLIGHT and line.broken is None:
                    line.wait_for(line.pending[0])
            return line.request(message, decode or json_result, fd=fd)

    def _drain_direct(self) -> None:
        if self._direct is not None:
            self._direct.drain()

    def _why_executor_gone(self, exc: BaseException, wait_s: float = 5.0) -> BaseException:
        """The direct line to the executor closed: the daemon knows why the job ended. It
        learns of an executor's death a moment after the client may see it, so ask until the
        job shows as ended (at most `wait_s` seconds)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = self._request(ops.Info(self._require_id())).result()
            except SalusError as error:
                return error
            if info.get("state") in ("failed", "cancelled", "finished"):
                break
            if time.monotonic() > deadline:
                return DaemonUnavailable(f"lost the connection to job {self.id}'s executor: "
                                         f"{exc}")
            time.sleep(0.02)
        state, reason = info.get("state"), info.get("reason") or "its executor went away"
        if state == "failed":
            return JobFailed(reason)
        if state in ("cancelled", "finished"):
            return JobCancelled(reason)
        return DaemonUnavailable(f"lost the connection to job {self.id}'s executor: {exc}")

    def _rng_to_send(self) -> torch.Tensor | None:
        """The client's generator state when it changed since the job last had it."""
        state = torch.get_rng_state()
        if self._rng_synced is not None and torch.equal(state, self._rng_synced):
            return None
        self._rng_synced = state
        return state

    def _rng_back(self, state: torch.Tensor | None) -> None:
        if state is not None:
            state = state.clone()
            torch.set_rng_state(state)
            self._rng_synced = state

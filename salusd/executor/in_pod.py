"""The link of an executor salusd did not fork: the one `salusd run --here` runs in its own
process (in a pod, the pod's), on one end of a socket pair whose other end the daemon adopted
as the job's executor link (`salusd/supervisor/supervisor.py`, `Supervisor.acquire`).

That process is `script_only.serve` without `Become` (it already is the caller), and its
script's boundaries take turns as any script job's. What differs is what the daemon can do to
it: salusd cannot `kill` or signal a process it did not start (a pod's pid namespace is not
the daemon's). So, once the script runs, a thread reads the link as frames come instead of at
boundaries only:

- a `Signal` message is raised in the script at once, as salusd's `kill` of a forked
  executor's script raises it: its handler runs wherever the script is, also while it waits at
  a boundary for a turn that a cancelled job will not get (so a checkpoint-on-SIGTERM handler
  runs within the grace);
- the link closing while the script runs is a kill: the daemon ended the job after its grace,
  or went away. The thread kills this process's group (the script and what it started), as a
  forked executor dies with its zygote;
- every other message waits for the script's next boundary, as on any executor's link.

Standard library only, as `script_only.py`.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import deque
from typing import Any

from salus.daemon.wire.executor_ops import Signal, address_of, decode_request
from salus.daemon.wire.frames import ConnectionClosed
from salus.daemon.wire.json_channel import JsonChannel


class InPodChannel(JsonChannel):
    """The daemon's link of an executor salusd did not fork. Before `watch` it is a plain
    `JsonChannel`; after, a thread reads it (see the module's docstring)."""

    def __init__(self, sock: Any) -> None:
        super().__init__(sock)
        self._cond = threading.Condition()
        self._messages: deque[Any] = deque()  # read, for the script's boundaries
        self._end: BaseException | None = None  # why nothing more comes
        self._watching = False
        self.over = False  # the script ended: the link closing is its normal end

    def watch(self) -> None:
        """From now on read the link on a thread (see the module's docstring)."""
        self._watching = True
        threading.Thread(target=self._read, name="salusd-link", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = JsonChannel.recv(self)
            except (ConnectionClosed, OSError) as exc:
                with self._cond:
                    self._end = exc if isinstance(exc, ConnectionClosed) else ConnectionClosed(
                        f"the daemon's link failed: {exc}")
                    self._cond.notify_all()
                if not self.over:  # killed: the daemon ended the job, or went away
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                return
            except Exception as exc:  # a frame that is not JSON: its boundary hears of it
                message = exc
            if isinstance(message, dict) and message.get("op") == Signal.op:
                try:
                    unaddressed = dict(message)  # the boundary reads what is not a signal
                    address_of(unaddressed)
                    request = decode_request(unaddressed)
                except ValueError:
                    pass  # not a signal after all: the boundary answers it `Failed`
                else:
                    assert isinstance(request, Signal)
                    os.kill(os.getpid(), request.signum)  # as kill(2) from salusd would
                    continue
            with self._cond:
                self._messages.append(message)
                self._cond.notify_all()

    def recv(self) -> Any:
        if not self._watching:
            return super().recv()
        with self._cond:
            while not self._messages and self._end is None:
                self._cond.wait()
            if not self._messages:
                assert self._end is not None
                raise self._end
            message = self._messages.popleft()
        if isinstance(message, BaseException):
            raise message
        return message

    def buffered(self) -> bool:
        if not self._watching:
            return super().buffered()
        with self._cond:
            return bool(self._messages) or self._end is not None

    def ready(self) -> bool:
        return self.buffered() if self._watching else super().ready()

"""One job hosted by an executor process: its runtime and its side of the loop.

An executor process hosts the jobs of one owner in one lane (`salusd/supervisor/supervisor.py`).
What is process-wide in torch and the OS but belongs to a job — the CPU random generator, the
working directory, where `print` goes, the peak meter's baseline, the process group its
children are born in (`job_group.py`) — is swapped in by `Executor._switch` before any of the
job's code runs, so each job sees only its own.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from contextlib import AbstractContextManager
from typing import Any

import torch

from salus.daemon.executor.calls import unsendable
from salus.daemon.executor.job_group import JobGroup
from salus.daemon.executor.output import OutputSink
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.executor.turns import Turn
from salus.daemon.wire import compact
from salus.daemon.wire.channel import Channel


class Slot:
    """One hosted job (`job`: its id)."""

    def __init__(self, job: int, runtime: JobRuntime, sink: OutputSink, cwd: str | None,
                 log: str | None, estimated: bool) -> None:
        self.job = job
        self.runtime = runtime
        self.sink = sink
        self.cwd = cwd
        self.log = log
        self.estimated = estimated  # its first call's estimate was sent (or is not wanted)
        self.turn = Turn()  # its lease, its `Ready` for the head of `queue`, what ran
        self.queue: deque[Any] = deque()  # direct calls waiting, in order
        self.lender: int | None = None  # id() of the queued call whose arguments view the pool
        self.data: Channel | None = None  # the client's direct channel
        self.rng: torch.Tensor | None = None  # its CPU generator while another job's code ran
        self.lane_bytes = 0  # its lane's size where it was placed (bytes)
        self.shared_lane = False  # other processes run in its lane: release cached memory
        self.group = JobGroup()  # the processes its code started, ended with it here

    def next_call(self) -> Any:
        """The call at the head of the job's queue, taken off it."""
        request = self.queue.popleft()
        if id(request) == self.lender:
            self.lender = None
        return request

    def give_back(self, *, before_reply: bool = False) -> None:
        """Once the call whose arguments were lent out of the client's pool ran and no result
        waits to go out, give them back: the client may write its next frame there.
        `before_reply`: the call's reply is still to be sent, and may view them; give them back
        only if nothing does (so that the client's next frame, sent as soon as that reply
        comes, finds the pool free), and otherwise again after the reply."""
        if self.data is not None and self.lender is None and not self.sink.holding:
            self.data.give_back(retire=not before_reply)

    def sending(self) -> AbstractContextManager[object]:
        """Hold the job output's lock while a reply goes out on the channel, after what the
        job printed so far (a line printed on another thread never splits a reply)."""
        sys.stdout.flush()
        sys.stderr.flush()
        return self.sink.lock

    def answer(self, reply: Any, hold: bool = False) -> bool:
        """Send `reply` on the job's line, after the results held back there; False when the
        line broke (the caller closes it). With `hold` (a short call: under `HOLD_S`), a
        compact result may wait for the next reply instead, when the client's next call is
        already here (it keeps calls in flight) and the sink's bound allows
        (`OutputSink.may_hold`): it goes with the next send, or as soon as the executor has
        nothing to run at once (`Executor._release_held`). A client waiting for the oldest
        result then waits for about one more call like it."""
        if self.data is None:
            return True
        if hold and type(reply) is compact.Message:
            now = time.perf_counter()
            if self.sink.may_hold(now) and (self.queue or self.data.readable(0)):
                self.sink.hold(reply, now)
                return True
        try:
            with self.sending():
                try:
                    self.sink.send(reply)
                except TypeError as exc:
                    self.sink.send(unsendable(exc))
        except OSError:
            return False
        return True

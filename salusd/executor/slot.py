"""One job hosted by an executor process: its runtime and its side of the loop.

An executor process hosts the jobs of one owner in one lane (`salusd/supervisor.py`). What is
process-wide in torch and the OS but belongs to a job — the CPU random generator, the working
directory, where `print` goes, the peak meter's baseline — is swapped in by `Executor._switch`
before any of the job's code runs, so each job sees only its own.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from salus.daemon.executor.output import OutputSink
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.executor_ops import CallDone, Ran

REPORT_EVERY_S = 0.02  # leased calls are reported to the daemon in batches this often


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
        self.lease = False
        self.asked = False  # a `Ready` for the head of `queue` is with the daemon
        self.queue: deque[Any] = deque()  # direct calls waiting, in order
        self.lender: int | None = None  # id() of the queued call whose arguments view the pool
        self.data: Channel | None = None  # the client's direct channel
        self.ran: RanSoFar | None = None  # leased calls not yet reported to the daemon
        self.rng: torch.Tensor | None = None  # its CPU generator while another job's code ran
        self.lane_bytes = 0  # its lane's size where it was placed (bytes)
        self.persistent_bytes = 0  # its budget less the lane (bytes)
        self.shared_lane = False  # other processes run in its lane: release cached memory


class RanSoFar:
    """Leased calls since the last `Ran` report: calls, iterations, failures, the iterations'
    seconds, the largest peak (bytes), the first call's start and the last one's end, and
    whether one ran out of device memory."""

    def __init__(self, since: float, began: float | None) -> None:
        self.since = since  # when the first of them was noted (time.monotonic)
        self.calls = self.iterations = self.failed = 0
        self.seconds = 0.0
        self.peak: int | None = None
        self.began = self.ended = began if began is not None else 0.0
        self.oom = False

    def add(self, done: CallDone) -> None:
        self.calls += 1
        self.iterations += done.counted
        self.failed += not done.ok
        self.seconds += done.seconds if done.counted else 0.0
        if done.peak is not None:
            self.peak = max(self.peak or 0, done.peak)
        if done.ended is not None:
            self.ended = done.ended
        self.oom = self.oom or done.oom

    def report(self) -> Ran:
        return Ran(self.calls, self.iterations, self.failed, self.seconds, self.peak,
                   self.began, self.ended, self.oom)


def process_cap(slots: list[Slot], device: torch.device) -> int:
    """The reserved bytes the process may hold on `device`: its jobs' persistent bytes there
    plus one lane (they share it, one call at a time)."""
    here = [s for s in slots if s.runtime.device == device]
    return sum(s.persistent_bytes for s in here) + max((s.lane_bytes for s in here), default=0)

"""One job hosted by an executor process: its runtime and its side of the loop.

An executor process hosts the jobs of one owner in one lane (`salusd/supervisor/supervisor.py`).
What is process-wide in torch and the OS but belongs to a job — the CPU random generator, the
working
directory, where `print` goes, the peak meter's baseline, the process group its children are
born in (`job_group.py`) — is swapped in by `Executor._switch` before any of the job's code
runs, so each job sees only its own.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from salus.daemon.executor.job_group import JobGroup
from salus.daemon.executor.output import OutputSink
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.executor.turns import Turn
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

"""What the supervisor knows of an executor process and of a job in one, how a process
ended, and the environment every executor starts with.

On a GPU host the zygote, and so every executor, starts with `CUDA_VISIBLE_DEVICES` set to the
daemon's GPUs by UUID in the daemon's order, so the daemon's `cuda:i` is every executor's
`cuda:i` whatever CUDA's own order, and with `PYTORCH_NVML_BASED_CUDA_CHECK=1`, so that
`torch.cuda.is_available()` before a fork does not initialise CUDA. Each `place` carries the
GPU's UUID, with which an executor whose CUDA has not started can narrow `CUDA_VISIBLE_DEVICES`
to its own GPU (`salusd/executor/visible.py`; torch reads the variable only when CUDA starts in
the process: pytorch/pytorch#23544).
"""

from __future__ import annotations

import os
import signal
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from salus.daemon.devices.context_cost import workspace_config
from salus.daemon.engine.ports import Sent
from salus.daemon.engine.registry import JobRecord
from salus.daemon.executor.visible import DEVICE_KIND_ENV
from salus.daemon.loop import Link
from salus.daemon.supervisor.zygotes import Zygote, inherited
from salus.daemon.wire.executor_ops import Place, Reply, Request
from salus.daemon.wire.frames import RawFrame

ISOLATIONS = ("lane", "job")  # `--isolation`: an owner's jobs of a lane in one process, or not

LaneOf = tuple[int, int]  # (owner uid, lane id): lane ids are never reused on a node
#: who reads a reply a process owes: the engine (the `Sent` it gets back with the reply), or the
#: supervisor's own step of that name ("host", "handover", "adopt", "replace", "exit")
Reader = Sent | str


@dataclass(eq=False)
class ExecutorProcess:
    """One executor process as the daemon sees it."""

    token: int
    link: Link
    pid: int | None = None
    uid: int | None = None  # whose jobs it hosts, once it became them
    key: LaneOf | None = None  # the owner's lane it serves (None: the jobs it has)
    device: str | None = None  # where it was first placed: CUDA binds a process to its GPU
    jobs: dict[int, ExecutorHandle] = field(default_factory=dict)
    status: str | None = None  # how it ended, once the zygote reaped it
    exit_code: int | None = None  # the same as a number: -N for signal N
    closed: bool = False
    reported: bool = False
    kill_when_forked: bool = False
    pending: Pending | None = None  # a reply whose frames are still to come
    zygote: Zygote | None = None  # forked by a zygote of another interpreter (zygotes.py)
    poisoned: str | None = None  # why it ends: a sticky CUDA error in one of its jobs' calls
    mps: int | None = None  # the GPU whose MPS server it was placed as a client of
    #: salusd did not fork it: `salusd run --here` runs it in its own process (maybe a pod's),
    #: which salusd signals and kills through its link only (`executor/in_pod.py`)
    adopted: bool = False

    @property
    def who(self) -> str:
        """How messages name it."""
        return ("salusd run's own executor (--here)" if self.adopted
                else f"executor (pid {self.pid})")


@dataclass(eq=False)
class ExecutorHandle:
    """One job (one replica of a gang) in its executor process: what the engine holds."""

    process: ExecutorProcess
    record: JobRecord
    replica: int
    sharable: bool  # may move into its owner's process of its lane
    why_alone: str | None = None  # why it keeps a process of its own, when it is sharable
    owed: deque[Reader] = field(default_factory=deque)  # the replies it owes, oldest first
    #: while it moves: what is sent to its new process once that has the job
    held: list[tuple[Request, Reader, RawFrame | None]] | None = None
    lane: int | None = None  # the lane id where it was placed
    place: Place | None = None  # the last place sent

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def job(self) -> int:
        return self.record.job_id

    def describe(self) -> dict[str, Any]:
        """For `salusd status`: its process, the other jobs it hosts, and why."""
        proc = self.process
        if self.why_alone is not None:
            why = f"its own process: {self.why_alone}"
        elif proc.key is not None:
            why = f"one process per owner and lane (lane {proc.key[1]})"
        else:
            why = "its own process until it is placed"
        return {"pid": proc.pid, "shared_with": sorted(j for j in proc.jobs if j != self.job),
                "why": why}

    @property
    def closed(self) -> bool:
        """Its process is gone, or it left it."""
        return self.process.closed or self.process.jobs.get(self.job) is not self


@dataclass
class Pending:
    """A reply whose frames follow: for `handle`, with `count` frames still to come."""

    handle: ExecutorHandle | None
    reply: Reply
    count: int
    frames: list[RawFrame] = field(default_factory=list)


class Died(Protocol):
    """`Supervisor.on_died`: (the job's handle, why, its exit code, whether it ever ran,
    whether a call poisoned its CUDA context, the engine's messages it still owed replies to,
    oldest first)."""

    def __call__(self, handle: ExecutorHandle, reason: str, exit_code: int | None,
                 started: bool, poisoned: bool, owed: list[Sent], /) -> None: ...


def describe_status(status: int) -> str:
    """'signal 11 (SIGSEGV)' or 'exit status 3' for a wait status."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"signal {-code} ({name})"
    return f"exit status {code}"


def executor_environment(base: Mapping[str, str], gpu_uuids: Sequence[str]) -> dict[str, str]:
    """The zygote's (so every executor's) environment: what Python, torch and the accelerator
    libraries read from `base` (`zygotes.inherited`; nothing else of the daemon's reaches job
    code), CUDA pinned to the daemon's GPUs (`gpu_uuids`, in the daemon's device order; none on
    a CPU host) and, on a GPU host, the cuBLAS workspace's size fixed where `base` leaves it to
    torch (the daemon books it: `context_cost.workspace_config`)."""
    env = {**inherited(base), "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    if gpu_uuids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_uuids)
        env[DEVICE_KIND_ENV] = "cuda"
        env["CUBLAS_WORKSPACE_CONFIG"] = workspace_config(base)
    return env

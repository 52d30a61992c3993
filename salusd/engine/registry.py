"""The job registry: every job's record and its state machine, and the ended jobs kept for a
retention period so that late calls get the job's end state and reason, never a bare
`UnknownJob`.

A job moves through phases (the scheduler's `JobState` refines `submitted`):

    open ──attach──▶ attached ──first call──▶ estimating ──estimate──▶ submitted ──▶ ended
      └──────────────────────────── close / cancel / executor death ───────────────▶ ended

Ended jobs carry `end_state` (finished, cancelled or failed) and a `reason` a person can read.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from salus.daemon.engine.checkpoint_state import CheckpointState
from salus.daemon.engine.job_progress import JobProgress
from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.engine.lifecycle import EndState, Lifecycle
from salus.daemon.engine.script_state import ScriptState
from salus.daemon.limits import check_iterations, check_name
from salus.daemon.wire.errors import NotOwner, UnknownJob
from salus.daemon.wire.frames import RawFrame

JobKind = Literal["interactive", "batch"]
Answer = Callable[[RawFrame], None]


@dataclass(frozen=True)
class Owner:
    """Who a job belongs to: the user name, uid and gid the kernel reported for the client;
    for a pod's client (one that came through a Kubernetes allocation's socket), the
    allocation's id, the uid and gid being salusd's unprivileged pod user's."""

    name: str
    uid: int
    gid: int
    allocation: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.uid == 0

    @property
    def runs_as(self) -> int:
        """The uid the owner's executors run as: its own where salusd is root, else salusd's
        (which then runs only its own user's code)."""
        return self.uid if os.geteuid() == 0 else os.getuid()


@dataclass(eq=False)
class Call:
    """One queued call from a client: the frame to forward, who to answer, and whether it
    counts as an iteration (`@remote.iteration`) or not (`@remote.function`)."""

    frame: RawFrame | None  # None: a direct call waiting in the executor
    answer: Answer | None  # None: the executor answers the client itself
    counted: bool


@dataclass(eq=False)
class JobRecord:
    """One job as the daemon knows it (no tensors: those live in its executor)."""

    job_id: int
    owner: Owner
    name: str
    planned_iterations: int
    opened_s: float
    replicas: list[Any] = field(default_factory=list)  # its executors, by replica rank
    cwd: str | None = None
    life: Lifecycle = field(default_factory=Lifecycle)  # its phase and flags: the writers
    calls: deque[Call] = field(default_factory=deque)
    persistent_bytes: int = 0
    threads: int = 1
    estimate_bytes: int | None = None
    estimate_method: str = ""
    ephemeral_guessed: bool = False  # admitted with a guess that its next measured call sets
    measured_peak: int | None = None
    priority: float = 1.0
    device_kind: str = "cpu"
    functions: dict[int, str] = field(default_factory=dict)  # function id -> its kind
    inference: bool = False  # it serves a model (`Job.inference`): shares its owner's lane
    direct: bool = False  # the client calls the executor on a direct channel
    kind: JobKind = "interactive"  # batch: the daemon drives the loop from an entrypoint
    spec: JobSpec = JobSpec()  # what the job was submitted with
    checkpoint: CheckpointState = field(default_factory=CheckpointState)  # folder, last one
    progress: JobProgress = field(default_factory=JobProgress)  # calls, restarts, last step
    script: ScriptState | None = None  # a script job's reruns and client
    limit: Literal["time", "memory"] | None = None  # what ended it: its --time or its --mem
    # A script job's command's end, as a shell reports it (engine/scripts.py `died`)
    exit_status: int | None = None
    signal: int | None = None
    after: tuple[int, ...] = ()  # jobs it still waits for (--after: engine/dependencies.py)

    @property
    def live(self) -> bool:
        """Not ended (`life` holds its phase and flags, written by its transitions)."""
        return self.life.live

    @property
    def gang(self) -> int:
        """Devices (replicas) the job runs on."""
        return self.spec.devices

    @property
    def nodes(self) -> int:
        """Nodes of the cluster the job spans (a gang across nodes when above 1)."""
        return self.spec.nodes

    @property
    def executor(self) -> Any:
        """The job's executor (a gang's replica 0), or None before it has one."""
        return self.replicas[0] if self.replicas else None


def requested_memory(record: JobRecord) -> int | None:
    """The device memory (bytes) the job asked for (`salusd run --mem`): its lane at
    admission and its cap; None: sized from its first call, as measured."""
    return record.spec.mem_bytes


def is_script(record: JobRecord) -> bool:
    """Whether the job runs a whole command (`salusd run`, REST `command`): its process runs
    the script."""
    return record.spec.is_script


def may_share_executor(record: JobRecord) -> bool:
    """Whether the job's executor process may host its owner's other jobs of its lane: an
    interactive job of one replica whose state lives in objects it attached (not a gang's
    replica, a batch job, a script job, whose process runs the script, or a job whose client
    runs another interpreter than the daemon's, whose executor runs that one), and not a pod's
    job: every pod runs as the one pod user, and a shared process would mix their states."""
    return (record.kind == "interactive" and record.gang == 1 and record.owner.allocation is None
            and not is_script(record) and record.spec.python is None)


class Registry:
    """Live jobs by id, and ended ones for `retention_s` seconds (at most `keep_ended`)."""

    def __init__(self, clock: Callable[[], float], *, retention_s: float = 3600.0,
                 keep_ended: int = 10_000, first_id: int = 1,
                 wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall = wall
        self.retention_s = retention_s
        self.keep_ended = keep_ended
        self.live: dict[int, JobRecord] = {}
        self.ended: OrderedDict[int, JobRecord] = OrderedDict()
        self._ids = itertools.count(first_id)

    def open(self, owner: Owner, name: object, iterations: object,
             job_id: int | None = None) -> JobRecord:
        """A new live record; `job_id` comes from the durable store when there is one."""
        record = JobRecord(next(self._ids) if job_id is None else job_id, owner,
                           check_name(name), check_iterations(iterations), self.clock())
        self.live[record.job_id] = record
        return record

    def get(self, job_id: object, owner: Owner) -> JobRecord:
        """The record (live or recently ended) of `job_id`, if `owner` may act on it."""
        jid = parse_id(job_id)
        self.expire()
        record = self.live.get(jid) or self.ended.get(jid)
        if record is None:
            raise UnknownJob(f"no job {jid} in this daemon (never opened, or ended more than "
                             f"{self.retention_s:.0f} s ago)")
        if (record.owner.uid != owner.uid or record.owner.allocation != owner.allocation
                ) and not owner.is_admin:  # pods share the pod user's uid, not their jobs
            raise NotOwner(f"job {jid} belongs to {record.owner.name}, not {owner.name}")
        return record

    def end(self, record: JobRecord, state: EndState, reason: str) -> None:
        """Move a live record to the ended ones."""
        if not record.live:
            return
        record.life.end(state, reason, self.clock(), self.wall())
        self.live.pop(record.job_id, None)
        self.ended[record.job_id] = record
        self.expire()

    def expire(self) -> None:
        cutoff = self.clock() - self.retention_s
        while self.ended:
            oldest = next(iter(self.ended.values()))
            if len(self.ended) <= self.keep_ended and (oldest.life.ended_s or 0.0) >= cutoff:
                break
            self.ended.popitem(last=False)

    def __iter__(self) -> Iterator[JobRecord]:
        return iter(list(self.live.values()))


def parse_id(job_id: object) -> int:
    if isinstance(job_id, bool):
        raise UnknownJob(f"{job_id!r} is not a job id")
    try:
        jid = int(job_id)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise UnknownJob(f"{str(job_id)[:40]!r} is not a job id") from None
    if not 0 < jid < 2**63:
        raise UnknownJob(f"{jid} is not a job id")
    return jid

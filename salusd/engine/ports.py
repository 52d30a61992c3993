"""What the engine needs from the rest of the daemon, and the policies it is started with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from salus.daemon.engine.gang import GangReply
from salus.daemon.engine.registry import Answer, JobRecord, Owner
from salus.daemon.wire.executor_ops import Reply, Request
from salus.daemon.wire.frames import RawFrame

LaneKey = tuple[int, int]
OnDone = Callable[[Reply], None]


@dataclass(eq=False)
class Sent:
    """One message the engine sent an executor, owed a reply: the `request`, who gets the
    client's answer that comes with the reply, the lane it runs in, and what to call with the
    reply. The port keeps it until the reply comes back with it (`Engine.on_executor_reply`),
    or hands it back among what a dead executor owed (`Engine.on_executor_died`)."""

    request: Request
    answer: Answer | None = None
    lane: LaneKey | None = None
    on_done: OnDone | None = None  # gets the executor's reply
    gang: GangReply | None = None  # sent to every replica of a gang: their replies merge
    replica: int = 0


class ExecutorPort(Protocol):
    """What the engine needs of the executor supervisor."""

    def acquire(self, record: JobRecord, cwd: str | None, replica: int = 0) -> object:
        """An executor process for replica `replica` of `record`, running as its owner."""
        ...

    def send(self, executor: object, sent: Sent, frame: RawFrame | None) -> None:
        """Send `sent.request` (and the client frame that goes with it) to the executor. An
        executor answers its messages in order; the port keeps what it owes, one queue per
        executor, and gives `sent` back with its reply, or with the executor's death."""
        ...

    def kill(self, executor: object) -> None:
        """End the executor now (SIGKILL)."""
        ...

    def send_signal(self, executor: object, signum: int) -> None:
        """Send the executor signal `signum`: a script job's command gets SIGTERM and its
        grace (its handler may save a checkpoint and exit), or `--signal` before its limit."""
        ...

    def retire(self, executor: object, code: str = "job_cancelled",
               message: str = "the job ended") -> None:
        """Ask the executor to exit once it has answered what it was sent; calls still queued
        on its direct channel get the error `code` with `message`."""
        ...


class StoredJob(Protocol):
    """A job as the durable registry keeps it (`salusd.state.store.JobRow`)."""

    @property
    def owner(self) -> str: ...
    @property
    def uid(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def reason(self) -> str: ...


class JobStore(Protocol):
    """The durable registry (`salusd.state.store.Store`): job ids that never repeat, and the
    jobs of before a restart (what `--after` waits for may have ended then)."""

    def new_job(self, name: str, owner: str, uid: int, gid: int, kind: str,
                spec: dict[str, Any], iterations_total: int, priority: float) -> int: ...

    def get_job(self, job_id: int) -> StoredJob | None: ...


class Timers(Protocol):
    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None: ...


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where jobs' checkpoints go (`root/<job id>/`, made by `make_dir` as the job's owner)
    and how often: every `every_iterations` iterations, else every `every_s` seconds of the
    job's own run time."""

    root: str
    make_dir: Callable[[str, Owner], None]
    every_iterations: int | None = None
    every_s: float = 600.0


@dataclass(frozen=True)
class DataCachePolicy:
    """The node's data cache for jobs' `salus.data.CachedDataset`s: level 1 of an owner's jobs
    in `root/<owner>/` (made by `make_dir` as the owner), at most `bytes_per_replica` bytes
    per replica."""

    root: str
    make_dir: Callable[[str, Owner], None]
    bytes_per_replica: int

"""One owner per MPS GPU: the admission rule for a GPU whose processes are clients of an NVIDIA
MPS server.

Legacy MPS runs one server per uid at a time: a client of another uid blocks at CUDA's start
until every client of the running server has gone. So on such a GPU admission places the jobs
of one owner (one uid) at a time: while the GPU serves an owner, through its admitted jobs or
its live client processes (a swapped-out job's process keeps its context), a job of another
owner goes to another GPU or waits. Owners are compared by the uid their processes run as
(`Job.uid`), or by name where the caller gives none.

Pure policy: the GPU's served owners are given, nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Collection

from salus.scheduler.job import Job

RunsAs = int | str
"""Who a job's processes run as: its uid, or its owner's name where no uid is given."""


def runs_as(job: Job) -> RunsAs:
    return job.uid if job.uid is not None else job.owner


def admits(serving: Collection[RunsAs], who: RunsAs) -> bool:
    """Whether a job running as `who` may be placed on a one-owner GPU that serves `serving`
    (its admitted jobs' and live client processes' owners): only if it serves no one else."""
    return all(s == who for s in serving)


def describe(serving: Collection[RunsAs], waiting: int) -> str:
    """What status says of a one-owner GPU: whom its MPS server serves, and how many pending
    jobs of other owners wait for it (they may also wait for memory)."""
    if not serving:
        return "mps: serving no owner; the next owner's jobs start its server"
    names = ", ".join(f"uid {s}" if isinstance(s, int) else str(s)
                      for s in sorted(serving, key=str))
    return f"mps: serving {names}; other owners wait ({waiting} waiting)"

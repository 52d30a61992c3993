"""What the engine keeps of a job's checkpoints beside its record (`JobRecord.checkpoint`):
where they go, the last one taken, the work run since, and the ones asked and not answered.
When to take one is `checkpoints.py`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class CheckpointState:
    """`dir`: the job's folder (its checkpoints and its output), None for a job that keeps
    none. The last checkpoint taken: its `iteration` (None: none yet), `time` (unix seconds)
    and `bytes`. Since it: `since` iterations and `since_s` seconds of job time. `asked`:
    checkpoints asked of the executor and not answered yet."""

    dir: str | None = None
    iteration: int | None = None
    time: float | None = None
    bytes: int = 0
    since: int = 0
    since_s: float = 0.0
    asked: int = 0

    def ran(self, iterations: int, seconds: float) -> None:
        """The job ran `iterations` more, for `seconds` of job time."""
        self.since += iterations
        self.since_s += seconds

    def asking(self) -> None:
        """One checkpoint asked of the executor: the work since is counted from now."""
        self.asked += 1
        self.since, self.since_s = 0, 0.0

    def taken(self, iteration: int | None, time: float | None, size: int) -> None:
        """The executor wrote the checkpoint of `iteration` (None: no iteration yet)."""
        self.iteration, self.time, self.bytes = iteration, time, size

    def from_last(self) -> None:
        """A fresh executor goes on from the last checkpoint: nothing run since it, and
        nothing asked of the executor that is gone."""
        self.since, self.since_s, self.asked = 0, 0.0, 0

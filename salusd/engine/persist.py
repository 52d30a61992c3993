"""Writes the engine's events into the durable registry (`salusd.state.store.Store`).

Runs on the engine's thread as an event subscriber: each state change, checkpoint and end (with
a script job's exit status, signal and limit, and those again when its command ends after the
job, in its grace) is one small SQLite transaction (WAL, `synchronous=FULL`), so after
`kill -9` the registry says which jobs were live, where their last checkpoint is and what each
ended with. Progress is not written per iteration (that would be an fsync per iteration): it is
written at every checkpoint and at the job's end, and the live jobs' counts (the `done` of `end`
and `ran` events) at most once per `progress_every_s` of engine time, all in one transaction,
so a job that a restart fails, or reruns, keeps about the iterations it had done.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from salus.daemon.engine.events import Event
from salus.daemon.engine.jobstate import ENDED, EventState

log = logging.getLogger("salusd.persist")


PROGRESS_EVERY_S = 1.0


class Updates(Protocol):
    def update_job(self, job_id: int, **fields: Any) -> None: ...

    def update_progress(self, done: dict[int, int]) -> None: ...

    def set_setting(self, key: str, value: str) -> None: ...


class Persistence:
    """Event subscriber: `engine.events.subscribe(Persistence(store).observe)`."""

    def __init__(self, store: Updates, progress_every_s: float = PROGRESS_EVERY_S) -> None:
        self.store = store
        self.progress_every_s = progress_every_s
        self.states: dict[int, EventState] = {}  # live jobs, as the events tell them
        self.unwritten: dict[int, int] = {}  # live jobs' iterations done, not yet written
        self.written_t = float("-inf")  # engine time of the last progress write

    def observe(self, event: Event) -> None:
        if event.kind == "policy":  # a live switch: the next start keeps it (`salusd serve`)
            self.store.set_setting("policy", str(event.detail["policy"]))
            return
        if event.job_id < 0:
            return
        fields = self._fields(event)
        if fields:
            self.store.update_job(event.job_id, **fields)
        if self.unwritten and event.t - self.written_t >= self.progress_every_s:
            self.written_t = event.t
            done, self.unwritten = self.unwritten, {}
            self.store.update_progress(done)

    def _fields(self, event: Event) -> dict[str, Any]:
        kind, detail = event.kind, event.detail
        if kind in ("end", "ran") and "done" in detail:
            self.unwritten[event.job_id] = int(detail["done"])
        if kind in ENDED:
            self.states.pop(event.job_id, None)
            self.unwritten.pop(event.job_id, None)
            return {"state": ENDED[kind], "reason": str(detail.get("reason", ""))[:4000],
                    "iterations_done": int(detail.get("iterations_done", 0)),
                    **_exit_columns(detail)}
        if kind == "exit":  # a script's command ended after its job (in its grace)
            return _exit_columns(detail)
        if kind == "checkpoint":
            return {"checkpoint_iteration": int(detail["iteration"]),
                    "checkpoint_time": float(detail["time"]),
                    "checkpoint_bytes": int(detail["bytes"]),
                    "checkpoint_path": str(detail.get("path", "")),
                    "iterations_done": int(detail["iteration"])}
        if kind == "restart" and "restarts" in detail:
            return {"restarts": int(detail["restarts"])}
        if kind == "priority":
            return {"priority": float(detail["priority"])}
        state = self.states.setdefault(event.job_id, EventState())
        return {"state": state.state} if state.observe(kind) else {}


def _exit_columns(detail: dict[str, Any]) -> dict[str, Any]:
    """The registry's columns of how a script job's command ended (`core.exit_detail`)."""
    return {"exit_status": detail.get("exit_status"), "exit_signal": detail.get("signal"),
            "end_limit": detail.get("limit")}

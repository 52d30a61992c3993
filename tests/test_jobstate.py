"""One vocabulary of job states for every reader: the durable registry and the metrics follow
the same events to the same state, and the engine's views agree with them."""

from __future__ import annotations

from salus.daemon.engine.events import Event
from salus.daemon.engine.jobstate import EventState, live_state
from salus.daemon.engine.persist import Persistence
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.metrics import Metrics
from salus.scheduler import JobState
from salus.scheduler.dispatch import JobView

# (event, the state it leaves the job in), worked out from the vocabulary by hand
LIFE = [("open", "open"), ("attach", "open"), ("submit", "pending"), ("admit", "running"),
        ("end", "running"), ("suspend", "suspended"), ("swap_out", "suspended"),
        ("resume", "pending"), ("admit", "running"), ("requeue", "pending"),
        ("suspend", "suspended"), ("admit", "suspended"), ("resume", "running")]


class Rows:
    def __init__(self) -> None:
        self.state: dict[int, str] = {}

    def update_job(self, job_id: int, **fields: object) -> None:
        if "state" in fields:
            self.state[job_id] = str(fields["state"])


def test_the_registry_and_the_metrics_follow_events_to_the_same_state() -> None:
    rows, metrics, tracked = Rows(), Metrics(), EventState()
    persist = Persistence(rows)
    for t, (kind, expected) in enumerate(LIFE):
        event = Event(float(t), kind, 3, 0 if kind == "admit" else -1, 0,
                      {"owner": "u", "name": "j"} if kind == "open" else {})
        persist.observe(event)
        metrics.observe(event)
        tracked.observe(kind)
        assert tracked.state == expected, (t, kind)
        assert rows.state.get(3, "open") == expected, (t, kind)
        body = metrics.render()[0].decode()
        assert f'salusd_job_state{{job_id="3",state="{expected}"}} 1.0' in body, (t, kind)


def _view(state: JobState) -> JobView:
    return JobView(1, state, state in (JobState.FINISHED, JobState.CANCELLED), 0, 1, 256, 256,
                   None, 0.0, 0.0, None, None, None, 1)


def test_a_live_jobs_state_from_its_record_and_its_scheduler_view() -> None:
    record = JobRecord(1, Owner("u", 1000, 1000), "j", 10, 0.0)
    assert live_state(record, None) == "open"
    assert live_state(record, _view(JobState.PENDING)) == "pending"
    assert live_state(record, _view(JobState.RUNNING)) == "running"
    # ran its iterations, its final checkpoint not yet on disk: not finished yet
    assert live_state(record, _view(JobState.FINISHED)) == "finishing"
    record.life.suspend(swap=False)  # suspended before it was ever submitted: still suspended
    assert live_state(record, None) == "suspended"
    record.life.resume()
    record.life.await_client()  # restored, its client not back yet
    assert live_state(record, _view(JobState.ADMITTED)) == "suspended"
    record.life.end("failed", "it raised", 1.0, 2.0)
    assert live_state(record, _view(JobState.CANCELLED)) == "failed"

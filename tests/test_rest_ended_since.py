"""`GET /v1/jobs?ended_since=T`'s filter (`rest/routes_jobs._ended_since`): live jobs always
show, ended ones when they ended at T or later, every job without T."""

from __future__ import annotations

from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.rest.routes_jobs import _ended_since


def _record(ended_at: float | None) -> JobRecord:
    record = JobRecord(1, Owner("u", 1000, 1000), "j", 10, 0.0)
    if ended_at is not None:
        record.life.end("finished", "ran its iterations", 5.0, ended_at)
    return record


def test_live_jobs_show_and_ended_ones_from_the_time_asked() -> None:
    live, ended = _record(None), _record(100.0)
    assert _ended_since(live, 200.0) and _ended_since(live, None)
    assert _ended_since(ended, 100.0) and _ended_since(ended, 0.0) and _ended_since(ended, None)
    assert not _ended_since(ended, 100.5)

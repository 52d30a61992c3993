"""The daemon's registry on disk: job ids never come back (reopen, deleted rows, SIGKILL), tokens
are stored only as hashes, and the admin token file is its owner's alone."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from salus.daemon.state.store import (
    DB_NAME,
    SCHEMA_VERSION,
    Store,
    ensure_admin_token,
)

ROOT = Path(__file__).resolve().parent.parent


def _job(store: Store, name: str = "train") -> int:
    return store.new_job(name, "alice", 1000, 1000, "batch",
                         {"entrypoint": "train.py", "devices": ["cpu:0"]}, 100, 0)


def _raw_delete_all(path: Path) -> None:
    """What an operator's `sqlite3 salusd.db 'DELETE FROM jobs'` would do."""
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DELETE FROM jobs")
    conn.close()


def test_ids_never_repeat_across_reopen_and_deleted_rows(tmp_path: Path) -> None:
    path = tmp_path / DB_NAME
    store = Store.open(path, clock=lambda: 1000.0)
    issued = [_job(store) for _ in range(3)]
    store.update_job(issued[-1], state="finished")
    assert store.forget_ended(older_than_s=0, now=2000.0) == 1  # the newest row is gone
    store.close()

    store = Store.open(path)
    after_forget = _job(store)
    store.close()
    _raw_delete_all(path)  # no row left to take a maximum from
    store = Store.open(path)
    after_wipe = _job(store)
    store.close()

    assert issued == [1, 2, 3]
    assert after_forget == 4 and after_wipe == 5


def test_a_committed_job_survives_sigkill(tmp_path: Path) -> None:
    path = tmp_path / DB_NAME
    child = textwrap.dedent(f"""
        import os, signal
        from salus.daemon.state.store import Store
        store = Store.open({str(path)!r})
        first = store.new_job("a", "alice", 1000, 1000, "batch", {{"entrypoint": "a.py"}}, 10)
        second = store.new_job("b", "alice", 1000, 1000, "interactive", {{}}, None, 3)
        store.update_job(first, state="running", iterations_done=4)
        print(first, second, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint of the WAL
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == -signal.SIGKILL, done.stderr
    first, second = map(int, done.stdout.split())

    store = Store.open(path)
    row = store.get_job(first)
    assert row is not None and row.state == "running" and row.iterations_done == 4
    assert row.spec == {"entrypoint": "a.py"} and row.iterations_total == 10
    assert [r.id for r in store.unfinished_jobs()] == [first, second]
    assert _job(store) > second
    store.close()


def test_wal_synchronous_full_and_schema_version(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB_NAME)
    conn = store._conn
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # 2 is FULL
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    versions = [v for (v,) in conn.execute("SELECT version FROM schema_version")]
    assert versions == list(range(1, SCHEMA_VERSION + 1))
    store.close()
    assert stat.S_IMODE((tmp_path / DB_NAME).stat().st_mode) == 0o600


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    Store.open(tmp_path / DB_NAME).close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="newer than this salusd knows"):
        Store.open(tmp_path / DB_NAME)


def test_job_updates_states_and_forgetting(tmp_path: Path) -> None:
    now = [100.0]
    store = Store.open(tmp_path / DB_NAME, clock=lambda: now[0])
    a, b, c = _job(store, "a"), _job(store, "b"), _job(store, "c")
    store.update_job(a, state="finished", reason="done")
    now[0] = 200.0
    store.update_job(b, state="suspended", checkpoint_iteration=40, checkpoint_time=199.5,
                     checkpoint_bytes=4096, checkpoint_path="/ckpt/b/ckpt-000000000040",
                     spec={"entrypoint": "b.py", "priority": 2})
    row = store.get_job(b)
    assert row is not None and row.updated == 200.0 and row.created == 100.0
    assert row.checkpoint_path == "/ckpt/b/ckpt-000000000040"
    assert row.spec == {"entrypoint": "b.py", "priority": 2}
    store.update_job(c, state="pending", priority=2.5)
    assert [(r.id, r.priority) for r in store.unfinished_jobs()] == [(b, 0.0), (c, 2.5)]
    assert [r.id for r in store.jobs(["finished"])] == [a]

    with pytest.raises(ValueError, match="cannot update"):
        store.update_job(b, colour="red")
    with pytest.raises(ValueError, match="cannot update"):
        store.update_job(b, uid=0)
    with pytest.raises(ValueError, match="state is one of"):
        store.update_job(b, state="canceled")
    with pytest.raises(KeyError):
        store.update_job(999, state="running")

    assert store.forget_ended(older_than_s=150, now=200.0) == 0  # ended 100 s ago
    assert store.forget_ended(older_than_s=50, now=200.0) == 1
    assert store.get_job(a) is None
    store.close()


def test_progress_and_restarts_are_kept_for_live_jobs_only(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB_NAME)
    live, ended = _job(store, "live"), _job(store, "ended")
    store.update_job(ended, state="failed", iterations_done=7)
    store.update_progress({live: 250, ended: 300, 999: 1})
    store.update_job(live, restarts=2)
    rows = {row.id: row for row in store.jobs()}
    assert (rows[live].iterations_done, rows[live].restarts) == (250, 2)
    assert (rows[ended].iterations_done, rows[ended].restarts) == (7, 0)
    store.close()


def test_a_registry_of_schema_1_gains_the_restart_count(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied REAL)")
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
    conn.execute("INSERT INTO meta VALUES ('next_job_id', 2)")
    conn.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, name TEXT NOT NULL, owner TEXT "
                 "NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL, kind TEXT NOT NULL, "
                 "spec TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', "
                 "iterations_done INTEGER NOT NULL DEFAULT 0, iterations_total INTEGER, "
                 "priority REAL NOT NULL DEFAULT 0, checkpoint_iteration INTEGER, "
                 "checkpoint_time REAL, checkpoint_bytes INTEGER, checkpoint_path TEXT, "
                 "created REAL NOT NULL, updated REAL NOT NULL)")
    conn.execute("CREATE TABLE tokens (name TEXT PRIMARY KEY, owner TEXT NOT NULL, uid INTEGER "
                 "NOT NULL, gid INTEGER NOT NULL, hash TEXT NOT NULL UNIQUE, created REAL NOT "
                 "NULL, revoked_at REAL)")
    conn.execute("INSERT INTO jobs (id, name, owner, uid, gid, kind, spec, state, "
                 "iterations_done, created, updated) VALUES (1, 'old', 'alice', 1000, 1000, "
                 "'interactive', '{}', 'running', 12, 1.0, 1.0)")
    conn.execute("INSERT INTO schema_version VALUES (1, 1.0)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    store = Store.open(tmp_path / DB_NAME)
    (row,) = store.jobs()
    assert (row.name, row.iterations_done, row.restarts) == ("old", 12, 0)
    store.close()


def test_ids_are_unique_from_two_threads(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB_NAME)
    got: list[list[int]] = [[], []]

    def insert(out: list[int]) -> None:
        out.extend(_job(store) for _ in range(50))

    threads = [threading.Thread(target=insert, args=(out,)) for out in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got[0] + got[1]) == list(range(1, 101))
    store.close()


def test_tokens_are_stored_hashed(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB_NAME)
    clear = store.add_token("ci-bot", "alice", 1000, 1000)
    assert clear.startswith("salus_") and len(clear) > 40
    store.close()  # the WAL may or may not be folded in: look at every file
    on_disk = b"".join(p.read_bytes() for p in tmp_path.glob(DB_NAME + "*"))
    assert clear.encode() not in on_disk
    assert hashlib.sha256(clear.encode()).hexdigest().encode() in on_disk

    store = Store.open(tmp_path / DB_NAME)
    row = store.lookup_token(clear)
    assert row is not None and (row.name, row.owner, row.uid) == ("ci-bot", "alice", 1000)
    assert store.lookup_token(clear + "x") is None
    assert not hasattr(store.list_tokens()[0], "hash")
    store.close()


def test_revoked_tokens_do_not_authenticate(tmp_path: Path) -> None:
    store = Store.open(tmp_path / DB_NAME)
    old = store.add_token("laptop", "bob", 1001, 1001)
    with pytest.raises(ValueError, match="exists"):
        store.add_token("laptop", "bob", 1001, 1001)
    assert store.revoke_token("laptop") is True
    assert store.revoke_token("laptop") is False
    assert store.revoke_token("never-made") is False
    assert store.lookup_token(old) is None
    (listed,) = store.list_tokens()
    assert listed.revoked_at is not None

    new = store.add_token("laptop", "bob", 1001, 1001)  # a revoked name may be reused
    assert store.lookup_token(old) is None
    found = store.lookup_token(new)
    assert found is not None and found.revoked_at is None
    store.close()


@pytest.mark.parametrize("name", ["", "x" * 65, "has space", "a/b", "naïve", "semi;colon",
                                  None, 7])
def test_bad_token_names_are_refused(tmp_path: Path, name: object) -> None:
    store = Store.open(tmp_path / DB_NAME)
    with pytest.raises(ValueError, match="1-64 characters"):
        store.add_token(name, "alice", 1000, 1000)
    assert store.list_tokens() == []
    store.close()


@pytest.mark.parametrize("name", ["a", "x" * 64, "ci-bot_1.prod"])
def test_good_token_names_are_accepted(tmp_path: Path, name: str) -> None:
    store = Store.open(tmp_path / DB_NAME)
    store.add_token(name, "alice", 1000, 1000)
    assert [t.name for t in store.list_tokens()] == [name]
    store.close()


def test_admin_token_file_is_private_and_stable(tmp_path: Path) -> None:
    first = ensure_admin_token(tmp_path)
    path = tmp_path / "admin.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == first and first.startswith("salus_")
    assert ensure_admin_token(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin.token"]  # no temp file left

    os.chmod(path, 0o640)
    with pytest.raises(PermissionError, match="readable by its owner only"):
        ensure_admin_token(tmp_path)


def test_admin_token_is_made_despite_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ensure_admin_token(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "admin.token").stat().st_mode) == 0o600


_OPS = st.lists(st.sampled_from(["insert", "insert", "insert", "forget", "wipe", "reopen"]),
                max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS)
def test_ids_strictly_increase_whatever_happens_between(ops: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / DB_NAME
        store = Store.open(path)
        issued: list[int] = []
        try:
            for op in ops:
                if op == "insert":
                    issued.append(_job(store))
                elif op == "forget" and store.jobs():
                    store.update_job(store.jobs()[-1].id, state="cancelled")  # the newest row
                    assert store.forget_ended(older_than_s=-1, now=store._clock()) == 1
                elif op == "wipe":
                    store.close()
                    _raw_delete_all(path)
                    store = Store.open(path)
                elif op == "reopen":
                    store.close()
                    store = Store.open(path)
        finally:
            store.close()
    assert all(a < b for a, b in zip(issued, issued[1:], strict=False))
    assert issued == list(range(1, len(issued) + 1))  # none skipped either: one per insert


def test_a_registry_of_schema_3_gains_exit_fields_and_end_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from salus.daemon.state import store as store_module

    monkeypatch.setattr(store_module, "SCHEMA_VERSION", 3)
    Store.open(tmp_path / DB_NAME).close()  # the schema as version 3 left it
    monkeypatch.undo()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    for job_id, state, updated in ((1, "failed", 50.0), (2, "running", 60.0)):
        conn.execute("INSERT INTO jobs (id, name, owner, uid, gid, kind, spec, state, created, "
                     "updated) VALUES (?, 'old', 'alice', 1000, 1000, 'interactive', '{}', ?, "
                     "1.0, ?)", (job_id, state, updated))
    conn.commit()
    conn.close()
    store = Store.open(tmp_path / DB_NAME, clock=lambda: 100.0)
    ended, live = store.jobs()
    # An ended row was last written when it ended; a live one has not ended.
    assert (ended.ended_at, ended.exit_status, ended.exit_signal, ended.end_limit) == (
        50.0, None, None, None)
    assert live.ended_at is None
    assert [r.id for r in store.ended_since(50.0)] == [1]
    assert store.ended_since(50.5) == []
    store.close()


def test_exit_fields_and_the_first_end_time_are_kept(tmp_path: Path) -> None:
    now = [1000.0]
    store = Store.open(tmp_path / DB_NAME, clock=lambda: now[0])
    killed, running = _job(store), _job(store)
    store.update_job(killed, state="failed", reason="hit its time limit", end_limit="time")
    now[0] = 1005.0  # its command dies of the SIGTERM 5 s later, in its grace
    store.update_job(killed, exit_status=143, exit_signal=15, end_limit="time")
    row = store.get_job(killed)
    assert row is not None
    assert (row.state, row.exit_status, row.exit_signal, row.end_limit, row.ended_at) == (
        "failed", 143, 15, "time", 1000.0)
    store.update_job(killed, state="failed")  # a later end keeps the first end's time
    assert store.get_job(killed).ended_at == 1000.0  # type: ignore[union-attr]
    assert store.get_job(running).ended_at is None  # type: ignore[union-attr]
    assert [r.id for r in store.ended_since(999.0)] == [killed]
    assert store.ended_since(1000.5) == []
    with pytest.raises(ValueError, match="end limit"):
        store.update_job(running, end_limit="patience")
    with pytest.raises(ValueError, match="cannot update"):
        store.update_job(running, ended_at=5.0)
    store.close()

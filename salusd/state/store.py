"""The daemon's crash-safe registry: jobs and API tokens in one embedded SQLite file.

The file is `<state-dir>/salusd.db`, in WAL mode with `synchronous=FULL`, so a call that
returned has its row on disk: a daemon killed at any point restarts with every committed job
and token, and `unfinished_jobs()` says what it must bring back. One connection, guarded by a
lock, serves the engine thread and the HTTP thread; every write is one `BEGIN IMMEDIATE`
transaction. `PRAGMA user_version` and the `schema_version` table record which of
`_MIGRATIONS` have run, so a later release appends a migration instead of guessing.

This module never imports torch: the daemon does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from salus.daemon.state.durable import fsync_dir
from salus.daemon.wire.errors import StateDiskFull

DB_NAME = "salusd.db"
ADMIN_TOKEN_NAME = "admin.token"
TOKEN_PREFIX = "salus_"
MAX_TOKEN_CHARS = 200  # a longer "token" is refused before it is hashed
JOB_KINDS = ("interactive", "batch")
# The daemon's job states, defined here for every layer (`engine/jobstate.py` says what each
# means and `engine/persist.py` maps events onto them); checked on update so that a misspelt
# end state cannot bring a finished job back at the next start.
LIVE_STATES = ("open", "pending", "running", "suspended")
ENDED_STATES = ("finished", "cancelled", "failed")
JOB_STATES = LIVE_STATES + ENDED_STATES
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# Migration i takes the schema from version i to i + 1; only ever append.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied REAL NOT NULL)",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        "INSERT INTO meta (key, value) VALUES ('next_job_id', 1)",
        """CREATE TABLE jobs (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL,
            owner TEXT NOT NULL,
            uid INTEGER NOT NULL,
            gid INTEGER NOT NULL,
            kind TEXT NOT NULL,
            spec TEXT NOT NULL,
            state TEXT NOT NULL,
            reason TEXT NOT NULL DEFAULT '',
            iterations_done INTEGER NOT NULL DEFAULT 0,
            iterations_total INTEGER,
            priority REAL NOT NULL DEFAULT 0,
            checkpoint_iteration INTEGER,
            checkpoint_time REAL,
            checkpoint_bytes INTEGER,
            checkpoint_path TEXT,
            created REAL NOT NULL,
            updated REAL NOT NULL)""",
        "CREATE INDEX jobs_state ON jobs (state)",
        """CREATE TABLE tokens (
            name TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            uid INTEGER NOT NULL,
            gid INTEGER NOT NULL,
            hash TEXT NOT NULL UNIQUE,
            created REAL NOT NULL,
            revoked_at REAL)""",
    ),
    (  # a script job's reruns, so that a rerun after a restart counts against max_restarts
        "ALTER TABLE jobs ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0",
    ),
    (  # the daemon's own settings made live (the policy), kept across restarts
        "CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ),
    (  # how a script job's command ended, and when each job ended, kept across restarts
        "ALTER TABLE jobs ADD COLUMN exit_status INTEGER",
        "ALTER TABLE jobs ADD COLUMN exit_signal INTEGER",
        "ALTER TABLE jobs ADD COLUMN end_limit TEXT",
        "ALTER TABLE jobs ADD COLUMN ended_at REAL",
        # Before this version an ended row was last written when it ended.
        "UPDATE jobs SET ended_at = updated WHERE state IN ('finished', 'cancelled', 'failed')",
        "CREATE INDEX jobs_ended_at ON jobs (ended_at)",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)

_JOB_COLUMNS = ("id", "name", "owner", "uid", "gid", "kind", "spec", "state", "reason",
                "iterations_done", "iterations_total", "priority", "checkpoint_iteration",
                "checkpoint_time", "checkpoint_bytes", "checkpoint_path", "created", "updated",
                "restarts", "exit_status", "exit_signal", "end_limit", "ended_at")
# Who a job is and when it was made never change; `updated` is set by every update, `ended_at`
# by the first that ends the job.
_JOB_MUTABLE = frozenset(_JOB_COLUMNS) - {"id", "owner", "uid", "gid", "kind", "created",
                                          "updated", "ended_at"}
END_LIMITS = ("time", "memory")
_TOKEN_COLUMNS = ("name", "owner", "uid", "gid", "created", "revoked_at")


@dataclass(frozen=True)
class JobRow:
    """One job as stored; times are unix seconds, `spec` is the caller's JSON object."""

    id: int
    name: str
    owner: str
    uid: int
    gid: int
    kind: str
    spec: dict[str, Any]
    state: str
    reason: str
    iterations_done: int
    iterations_total: int | None
    priority: float
    checkpoint_iteration: int | None
    checkpoint_time: float | None
    checkpoint_bytes: int | None
    checkpoint_path: str | None
    created: float
    updated: float
    restarts: int = 0  # a script job's reruns (`--restart on-failure`)
    # A script job's command's end, as a shell reports it: its exit status (128 + N for signal
    # N, 125 when it could not start), the signal that ended it, and the limit that ended the
    # job ("time": its --time, "memory": its --mem); None where none applies.
    exit_status: int | None = None
    exit_signal: int | None = None
    end_limit: str | None = None
    ended_at: float | None = None  # when the job ended (unix seconds); None while it is live

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES


@dataclass(frozen=True)
class TokenRow:
    """One API token without its hash (safe to print); times are unix seconds."""

    name: str
    owner: str
    uid: int
    gid: int
    created: float
    revoked_at: float | None


def token_hash(clear: str) -> str:
    """The stored form of a token: hex SHA-256.

    A plain fast hash is adequate here, unlike for passwords: every token is 256 random bits
    from `secrets`, so there is no dictionary to try and a stolen hash cannot be inverted by
    brute force. Because the hash is the lookup key, a timing difference in the index search
    reveals at most something about the hash of a guess, which does not help find a preimage.
    """
    return hashlib.sha256(clear.encode()).hexdigest()


def check_token_name(name: object) -> str:
    """`name` when it is 1-64 characters of letters, digits, `_`, `.` and `-`; else ValueError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a token name is 1-64 characters of A-Z a-z 0-9 _ . - ; got {name!r}")
    return name


def _check_id(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


class Store:
    """The registry in one SQLite file; every method is one transaction, safe across threads."""

    def __init__(self, conn: sqlite3.Connection, path: Path,
                 clock: Callable[[], float] = time.time) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._clock = clock
        self.path = path

    @classmethod
    def open(cls, path: Path, *, clock: Callable[[], float] = time.time) -> Store:
        """Open (creating it with mode 0600 when missing) and migrate the database at `path`.
        Raises RuntimeError, with what to do, for a database written by a newer schema than
        this code knows, or one SQLite cannot open or finds damaged."""
        path = Path(path)
        with contextlib.suppress(FileExistsError):  # WAL and SHM files copy these permissions
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        try:
            if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
                raise RuntimeError(f"{path}: SQLite could not switch to WAL mode")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            problems = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(map(str, problems)))
            store = cls(conn, path, clock)
            store._migrate()
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise damaged(path, exc) from None
        except BaseException:
            conn.close()
            raise
        return store

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- jobs ---------------------------------------------------------------------------------
    def new_job(self, name: str, owner: str, uid: int, gid: int, kind: str,
                spec: dict[str, Any], iterations_total: int | None = None,
                priority: float = 0.0) -> int:
        """Record a new job in state 'open' and return its id, which no job of this database
        ever had: the counter in `meta` advances in the same transaction as the insert."""
        if kind not in JOB_KINDS:
            raise ValueError(f"a job's kind is one of {JOB_KINDS}, got {kind!r}")
        if not isinstance(name, str) or not isinstance(owner, str):
            raise ValueError("a job's name and owner are strings")
        _check_id(uid, "uid")
        _check_id(gid, "gid")
        text = json.dumps(spec)
        now = self._clock()
        with self._transaction() as cur:
            (job_id,) = cur.execute(
                "SELECT value FROM meta WHERE key = 'next_job_id'").fetchone()
            cur.execute("UPDATE meta SET value = ? WHERE key = 'next_job_id'", (job_id + 1,))
            cur.execute(
                "INSERT INTO jobs (id, name, owner, uid, gid, kind, spec, state, "
                "iterations_total, priority, created, updated) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 'open', ?, ?, ?, ?)",
                (job_id, name, owner, uid, gid, kind, text, iterations_total, priority, now,
                 now))
        return int(job_id)

    def update_job(self, job_id: int, **fields: Any) -> None:
        """Set the given columns of job `job_id` (and `updated` to now). ValueError for a
        column that is unknown or never changes, or an unknown state; KeyError for no such job."""
        bad = sorted(set(fields) - _JOB_MUTABLE)
        if bad:
            raise ValueError(f"cannot update job columns {bad}; updatable: "
                             f"{sorted(_JOB_MUTABLE)}")
        if "state" in fields and fields["state"] not in JOB_STATES:
            raise ValueError(f"a job's state is one of {JOB_STATES}, got {fields['state']!r}")
        if fields.get("end_limit") not in (None, *END_LIMITS):
            raise ValueError(f"a job's end limit is one of {END_LIMITS} or None, got "
                             f"{fields['end_limit']!r}")
        if "spec" in fields:
            fields["spec"] = json.dumps(fields["spec"])
        fields["updated"] = self._clock()
        assignments = ", ".join(f"{column} = ?" for column in fields)
        if fields.get("state") in ENDED_STATES:  # the first end counts
            assignments += ", ended_at = COALESCE(ended_at, ?)"
            fields["ended_at"] = fields["updated"]
        with self._transaction() as cur:
            cur.execute(f"UPDATE jobs SET {assignments} WHERE id = ?",
                        (*fields.values(), job_id))
            if cur.rowcount == 0:
                raise KeyError(f"no job {job_id} in the registry")

    def update_progress(self, done: dict[int, int]) -> None:
        """Set `iterations_done` of each live job in `done` (job id -> iterations) in one
        transaction; an ended job keeps what its end recorded, an unknown id is skipped."""
        if not done:
            return
        now = self._clock()
        marks = ", ".join("?" * len(ENDED_STATES))
        with self._transaction() as cur:
            cur.executemany(f"UPDATE jobs SET iterations_done = ?, updated = ? WHERE id = ? "
                            f"AND state NOT IN ({marks})",
                            [(int(n), now, job_id, *ENDED_STATES) for job_id, n in done.items()])

    def get_job(self, job_id: int) -> JobRow | None:
        rows = self._jobs("WHERE id = ?", (job_id,))
        return rows[0] if rows else None

    def jobs(self, states: Iterable[str] | None = None) -> list[JobRow]:
        """Every job (in the given states only, when `states` is given), by id."""
        if states is None:
            return self._jobs("", ())
        wanted = tuple(states)
        marks = ", ".join("?" * len(wanted))
        return self._jobs(f"WHERE state IN ({marks})", wanted)

    def ended_since(self, since: float) -> list[JobRow]:
        """The jobs that ended at `since` (unix seconds) or later, by id."""
        marks = ", ".join("?" * len(ENDED_STATES))
        return self._jobs(f"WHERE state IN ({marks}) AND ended_at >= ?",
                          (*ENDED_STATES, since))

    def unfinished_jobs(self) -> list[JobRow]:
        """The jobs a restarted daemon must bring back: every one not finished, cancelled or
        failed, by id."""
        marks = ", ".join("?" * len(ENDED_STATES))
        return self._jobs(f"WHERE state NOT IN ({marks})", ENDED_STATES)

    def forget_ended(self, older_than_s: float, now: float) -> int:
        """Delete jobs that ended more than `older_than_s` seconds before `now` (unix seconds);
        returns how many. Their ids stay used."""
        marks = ", ".join("?" * len(ENDED_STATES))
        with self._transaction() as cur:
            cur.execute(f"DELETE FROM jobs WHERE state IN ({marks}) AND updated < ?",
                        (*ENDED_STATES, now - older_than_s))
            return cur.rowcount

    # ---- tokens -------------------------------------------------------------------------------
    def setting(self, key: str) -> str | None:
        """A setting made live (`set_setting`), or None."""
        with self._lock:
            row = self._conn.execute("SELECT value FROM settings WHERE key = ?",
                                     (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_setting(self, key: str, value: str) -> None:
        with self._transaction() as cur:
            cur.execute("INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT (key) DO "
                        "UPDATE SET value = excluded.value", (key, value))

    def add_token(self, name: str, owner: str, uid: int, gid: int) -> str:
        """Create the API token `name` for `owner` and return it in clear, the only time it is
        ever available: only its hash is stored. A revoked name may be reused; an active one
        is a ValueError."""
        check_token_name(name)
        _check_id(uid, "uid")
        _check_id(gid, "gid")
        clear = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._transaction() as cur:
            row = cur.execute("SELECT revoked_at FROM tokens WHERE name = ?", (name,)).fetchone()
            if row is not None and row[0] is None:
                raise ValueError(f"a token named {name!r} exists; revoke it first")
            cur.execute("DELETE FROM tokens WHERE name = ?", (name,))
            cur.execute("INSERT INTO tokens (name, owner, uid, gid, hash, created) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (name, owner, uid, gid, token_hash(clear), self._clock()))
        return clear

    def revoke_token(self, name: str) -> bool:
        """Revoke the active token `name`; False when there is none."""
        with self._transaction() as cur:
            cur.execute("UPDATE tokens SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
                        (self._clock(), name))
            return cur.rowcount == 1

    def lookup_token(self, clear: str) -> TokenRow | None:
        """The active token whose clear text is `clear`; None when unknown or revoked."""
        if not isinstance(clear, str) or not 0 < len(clear) <= MAX_TOKEN_CHARS:
            return None
        columns = ", ".join(_TOKEN_COLUMNS)
        with self._lock:
            row = self._conn.execute(
                f"SELECT {columns} FROM tokens WHERE hash = ? AND revoked_at IS NULL",
                (token_hash(clear),)).fetchone()
        return TokenRow(*row) if row is not None else None

    def list_tokens(self) -> list[TokenRow]:
        """Every token, revoked ones too, by name; never their hashes."""
        columns = ", ".join(_TOKEN_COLUMNS)
        with self._lock:
            rows = self._conn.execute(f"SELECT {columns} FROM tokens ORDER BY name").fetchall()
        return [TokenRow(*row) for row in rows]

    # ---- internals ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction under the lock: committed whole, or rolled back on error."""
        with self._lock:
            cur = self._conn.cursor()
            cur.execute("BEGIN IMMEDIATE")  # take the write lock now, not at the first write
            try:
                yield cur
                cur.execute("COMMIT")
            except BaseException as exc:
                if self._conn.in_transaction:
                    cur.execute("ROLLBACK")
                if isinstance(exc, sqlite3.OperationalError) and (
                        exc.sqlite_errorcode == sqlite3.SQLITE_FULL):
                    raise StateDiskFull(
                        f"salusd's state disk is full: the registry {self.path} cannot grow "
                        f"({exc}); nothing was changed. The operator frees space on the disk "
                        f"of {self.path.parent}, then the request works again") from None
                raise

    def _jobs(self, where: str, params: tuple[Any, ...]) -> list[JobRow]:
        columns = ", ".join(_JOB_COLUMNS)
        with self._lock:
            rows = self._conn.execute(f"SELECT {columns} FROM jobs {where} ORDER BY id",
                                      params).fetchall()
        out = []
        for row in rows:
            values = dict(zip(_JOB_COLUMNS, row, strict=True))
            values["spec"] = json.loads(values["spec"])
            out.append(JobRow(**values))
        return out

    def _migrate(self) -> None:
        with self._transaction() as cur:
            version = cur.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path} has schema version {version}, newer than this salusd "
                    f"knows ({SCHEMA_VERSION}); run the newer salusd or restore a backup")
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[target - 1]:
                    cur.execute(statement)
                cur.execute("INSERT INTO schema_version (version, applied) VALUES (?, ?)",
                            (target, self._clock()))
                cur.execute(f"PRAGMA user_version = {target}")


def damaged(path: Path, exc: sqlite3.DatabaseError) -> RuntimeError:
    """The start-up error for a registry SQLite cannot open or read: which file, and what to
    do."""
    if isinstance(exc, sqlite3.OperationalError):
        return RuntimeError(f"cannot open the registry {path}: {exc}")
    return RuntimeError(
        f"the registry {path} is damaged (SQLite: {exc}). To start afresh, move it aside with "
        f"its -wal and -shm files (mv {path} {path}.damaged); the jobs it listed are then not "
        f"restored, and their checkpoints stay in {path.parent / 'checkpoints'}")


def ensure_admin_token(state_dir: Path) -> str:
    """The daemon's admin token from `<state_dir>/admin.token`, made at first start.

    The file is created whole or not at all: written and fsynced under a temporary name made
    with O_CREAT|O_EXCL and mode 0600, then hard-linked into place (which fails if another
    start won the race), so a crash never leaves an empty token file. A token file that the
    group or others may read, or that another user owns, is refused with PermissionError:
    anyone who could read it would be admin.
    """
    state_dir = Path(state_dir)
    path = state_dir / ADMIN_TOKEN_NAME
    try:
        return _read_admin_token(path)
    except FileNotFoundError:
        pass
    tmp = state_dir / f".{ADMIN_TOKEN_NAME}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # left by a crashed start of a process that had our pid
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return _read_admin_token(path)
    finally:
        tmp.unlink()
        fsync_dir(state_dir)
    return token


def _read_admin_token(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PermissionError(f"{path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise PermissionError(f"{path} is owned by uid {info.st_uid}, not by salusd's "
                                  f"uid {os.geteuid()}; remove it to make a new one")
        if info.st_mode & 0o077:
            raise PermissionError(
                f"{path} has mode {stat.S_IMODE(info.st_mode):04o}; the admin token must be "
                f"readable by its owner only: chmod 600 {path} (and consider it leaked)")
        token = os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)
    if not token or "\n" in token:
        raise ValueError(f"{path} does not hold one token; remove it to make a new one")
    return token


__all__ = ["ENDED_STATES", "JOB_KINDS", "JOB_STATES", "LIVE_STATES", "SCHEMA_VERSION", "JobRow",
           "Store", "TokenRow", "check_token_name", "ensure_admin_token", "token_hash"]

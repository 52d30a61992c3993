"""Nothing a job or the daemon started outlives it: the real `salusd serve` process killed with
SIGKILL takes its zygote and executors with it, and a job's forked children end with the job."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from daemon_proc import salusd, wait_until
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.cli.control import Control

pytestmark = pytest.mark.slow


def children(pid: int) -> list[int]:
    """The children of process `pid` (from /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], within_s: float) -> list[int]:
    """The pids still alive after waiting up to `within_s` seconds for them to go."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def fork_sleepers(s: object) -> list[int]:
    """In the job: a child in the executor's process group and one in a session of its own
    (it leaves the group), both sleeping far longer than the test."""
    import subprocess

    kept = subprocess.Popen(["sleep", "300"])
    escaped = subprocess.Popen(["sleep", "300"], start_new_session=True)
    s.children = (kept, escaped)  # type: ignore[attr-defined]  # not waited for while the job lives
    return [kept.pid, escaped.pid]


def test_kill_9_of_the_daemon_takes_its_zygote_and_executors(tmp_path: Path) -> None:
    with salusd(tmp_path) as (proc, address):
        job = salus.connect(name="orphan", iterations=1, address=address)
        remote = job.attach(model=nn.Linear(2, 2))
        sleepers = remote.call(fork_sleepers)
        zygotes = children(proc.pid)
        assert len(zygotes) == 1
        executors = children(zygotes[0])
        assert executors, "the zygote has forked no executors"
        assert all(alive(p) for p in [*zygotes, *executors, *sleepers])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_gone([*zygotes, *executors, *sleepers], 5.0) == []


def test_a_sigterm_while_the_zygote_preloads_stops_everything_cleanly(tmp_path: Path) -> None:
    """The daemon listens once its zygote imported torch, and the zygote preloads after. A
    SIGTERM at once (the zygote reads no link while it preloads, and the standby forks wait
    for it) still stops the daemon with status 0 and its zygote with it, and the log holds no
    traceback (the zygote used to answer a queued fork into the closed link)."""
    with salusd(tmp_path) as (proc, _):
        zygotes = children(proc.pid)
        assert len(zygotes) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert wait_gone(zygotes, 5.0) == []
        log = (tmp_path / "salusd.log").read_text()
        assert "stopped" in log and "Traceback" not in log, log


def test_an_ended_job_leaves_no_child(tmp_path: Path) -> None:
    with salusd(tmp_path) as (proc, address):
        with salus.connect(name="forks", iterations=1, address=address) as job:
            remote = job.attach(model=nn.Linear(2, 2))
            sleepers = remote.call(fork_sleepers)
            assert all(alive(p) for p in sleepers)
            job.close(pull=False)
        assert wait_gone(sleepers, 5.0) == []
        assert proc.poll() is None


def fork_sleeper(s: object) -> int:
    """In the job: one child sleeping far longer than the test, kept (not waited for)."""
    import subprocess

    s.child = subprocess.Popen(["sleep", "300"])  # type: ignore[attr-defined]
    return s.child.pid  # type: ignore[attr-defined]


def test_a_jobs_children_end_with_it_in_an_executor_that_serves_on(tmp_path: Path) -> None:
    """Two jobs of one owner in one lane share an executor; each forks a long-lived child.
    When the first ends, its child ends, while the executor and the other job's child live on
    (and the other job still answers); the other's child ends when that job ends."""
    with salusd(tmp_path, "--policy", "fair", devices=1) as (proc, address):
        first = salus.connect(name="first", iterations=1, address=address)
        second = salus.connect(name="second", iterations=1, address=address)
        remotes = [job.attach(model=nn.Linear(2, 2)) for job in (first, second)]
        for remote in remotes:
            remote.call(lambda s: None)
        with Control(address) as ctl:
            executors = {j["executor"]["pid"] for j in ctl.status()["jobs"]}
        assert len(executors) == 1, executors  # the second job moved to the first's process
        (executor,) = executors
        mine, other = (remote.call(fork_sleeper) for remote in remotes)
        assert {mine, other} <= set(children(executor))
        first.close(pull=False)
        assert wait_gone([mine], 5.0) == []
        assert alive(executor) and alive(other)
        # What ended is reaped (the executor reaps it when its SIGCHLD arrives).
        wait_until(lambda: all(alive(p) for p in children(executor)), 5.0,
                   "the ended job's child reaped by the executor")
        assert remotes[1].call(lambda s: 7) == 7
        second.close(pull=False)
        assert wait_gone([other], 5.0) == []
        assert proc.poll() is None

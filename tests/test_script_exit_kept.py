"""A script job's `exit_status`, `signal` and `limit` survive a restart of the real daemon, as
`GET /v1/jobs/{id}` and `salusd status --all` show them; `salusd status --since` lists the
jobs that ended since then with the live ones.

Expected values come from the scripts themselves: one exits with 3, one kills itself with
SIGKILL (a shell reports 128 + 9), one outlives its time limit and dies of the SIGTERM it gets
(128 + 15, limit "time")."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import salusd
from rest_client import connect, job, wait_for

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(address: str, cwd: Path, code: str) -> int:
    """`salusd run -- python -c CODE`; its exit status."""
    return subprocess.run(
        [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
         address.removeprefix("unix://"), "--", sys.executable, "-c", code],
        cwd=cwd, env=ENV, timeout=120, capture_output=True).returncode


def _status(state: Path, *options: str) -> dict[int, dict[str, Any]]:
    """`salusd status --json OPTIONS`: its jobs by id."""
    out = subprocess.run([sys.executable, "-m", "salus.daemon.cli", "status", "--json",
                          "--state-dir", str(state), *options],
                         env=ENV, timeout=60, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return {j["id"]: j for j in json.loads(out.stdout)["jobs"]}


def _ended(j: dict[str, Any]) -> tuple[Any, ...]:
    return j["state"], j["exit_status"], j["signal"], j["limit"]


def _latest_id(client: Any) -> int:
    return max(j["id"] for j in client.get("/v1/jobs").json())


@pytest.mark.slow
def test_exit_statuses_survive_a_restart_and_status_since_picks_ended_jobs(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    expected: dict[int, tuple[Any, ...]] = {}
    with salusd(tmp_path, "--http", "127.0.0.1:0") as (proc, address), \
            connect(state) as client:
        assert _run(address, tmp_path, "import sys; sys.exit(3)") == 3
        expected[_latest_id(client)] = ("failed", 3, None, None)
        assert _run(address, tmp_path, "import os, signal; os.kill(os.getpid(), "
                    "signal.SIGKILL)") == 128 + signal.SIGKILL
        expected[_latest_id(client)] = ("failed", 128 + signal.SIGKILL, signal.SIGKILL, None)
        # Its command outlives the job, which its time limit ends: its status comes after.
        reply = client.post("/v1/jobs", json={
            "name": "slow", "command": [sys.executable, "-c", "import time; time.sleep(600)"],
            "cwd": str(tmp_path), "time_limit_s": 1, "grace_s": 30})
        assert reply.status_code == 201, reply.text
        slow = reply.json()["id"]
        wait_for(lambda: job(client, slow)["exit_status"] is not None, "the slow job's end")
        expected[slow] = ("failed", 128 + signal.SIGTERM, signal.SIGTERM, "time")
        for job_id, want in expected.items():
            assert _ended(job(client, job_id)) == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    cut = time.time()
    time.sleep(0.05)
    with salusd(tmp_path, "--http", "127.0.0.1:0") as (_, address), \
            connect(state) as client:
        for job_id, want in expected.items():
            assert _ended(job(client, job_id)) == want
        everything = _status(state, "--all")
        for job_id, want in expected.items():
            assert _ended(everything[job_id]) == want
            assert everything[job_id]["ended_at"] < cut
        assert _status(state) == {}  # by default: live jobs only
        # A job that ends after the cut, and one that is live.
        assert _run(address, tmp_path, "pass") == 0
        done = _latest_id(client)
        reply = client.post("/v1/jobs", json={
            "name": "live", "command": [sys.executable, "-c", "import time; time.sleep(600)"],
            "cwd": str(tmp_path)})
        assert reply.status_code == 201, reply.text
        live = reply.json()["id"]
        iso = datetime.datetime.fromtimestamp(cut).isoformat()
        assert set(_status(state, "--since", iso)) == {done, live}
        assert _ended(_status(state, "--since", iso)[done]) == ("finished", 0, None, None)
        assert set(_status(state, "--since", "1h")) == {*expected, done, live}
        assert set(_status(state)) == {live}
        bad = subprocess.run([sys.executable, "-m", "salus.daemon.cli", "status", "--since",
                              "yesterday", "--state-dir", str(state)],
                             env=ENV, timeout=60, capture_output=True, text=True)
        assert bad.returncode == 2 and "neither a duration" in bad.stderr, bad.stderr
        assert client.delete(f"/v1/jobs/{live}").status_code == 200


def test_the_status_table_shows_how_a_command_ended_after_its_state() -> None:
    from salus.daemon.cli.rest import exit_text

    assert exit_text({"exit_status": None, "signal": None, "limit": None}) == ""
    assert exit_text({"exit_status": 0, "signal": None, "limit": None}) == " (0)"
    assert exit_text({"exit_status": 143, "signal": 15, "limit": "time"}) == (
        " (143 SIGTERM time limit)")
    assert exit_text({"exit_status": 137, "signal": 9, "limit": "memory"}) == (
        " (137 SIGKILL memory limit)")

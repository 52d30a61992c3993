"""SIGTERM with one call running and another waiting for the lane, against the real daemon: the
running call's result is delivered and the waiting call gets `salusd is shutting down`, not a
connection reset (the waiting call sat in an executor, on the job's direct channel)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from client_proc import finish
from daemon_proc import salusd, wait_until

from salus.daemon.cli.control import Control

pytestmark = pytest.mark.slow

CLIENT = textwrap.dedent("""
    import os, sys, time
    from torch import nn
    import salus.adapters.torch as salus

    with salus.connect(name=sys.argv[1], iterations=10) as job:
        remote = job.attach(model=nn.Linear(2, 2))

        @remote.function
        def sleepy(s, release):
            while release and not os.path.exists(release):  # runs until the test says
                time.sleep(0.01)
            return "slept"

        sleepy("")  # defined and run once: its calls go on the direct channel
        print("ready", flush=True)
        sys.stdin.readline()
        print("calling", flush=True)
        try:
            print(f"RESULT {sleepy(sys.argv[2])}", flush=True)
        except BaseException as exc:
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
""")


def _in_a_lane(ctl: Control, name: str) -> bool:
    """Whether job `name` runs a call in a lane now, as the daemon's status shows it."""
    status = ctl.status()
    (job,) = [j for j in status["jobs"] if j["name"] == name]
    return job["job_id"] in {lane["busy_job"] for device in status["devices"]
                             for lane in device["lanes"]}


def test_sigterm_answers_the_waiting_call_with_shutting_down(tmp_path: Path) -> None:
    (tmp_path / "client.py").write_text(CLIENT)
    release = tmp_path / "release"
    with salusd(tmp_path, "--policy", "fair", devices=1) as daemon:
        proc, address = daemon
        env = {**os.environ, "SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1"}
        clients = {name: subprocess.Popen(
            [sys.executable, str(tmp_path / "client.py"), name, until], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for name, until in (("a", str(release)), ("b", ""))}
        try:
            for c in clients.values():
                assert c.stdout is not None and c.stdin is not None
                assert c.stdout.readline().strip() == "ready", finish(c, timeout_s=30)
            # a's call runs until released; b's waits for the one lane (fair), unread in the
            # executor that runs a's call, where the daemon cannot see it.
            a = clients["a"]
            assert a.stdin is not None and a.stdout is not None
            a.stdin.write("go\n")
            a.stdin.flush()
            assert a.stdout.readline() == "calling\n"
            with Control(address) as ctl:
                wait_until(lambda: _in_a_lane(ctl, "a"), 60, "a's call to run")
            b = clients["b"]
            assert b.stdin is not None and b.stdout is not None
            b.stdin.write("go\n")
            b.stdin.flush()
            assert b.stdout.readline() == "calling\n"
            time.sleep(0.3)  # what the daemon cannot show: b's frame, sent after that line
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "shutting down" in daemon.log_text(), 60, "salusd to stop")
            release.touch()  # a's call ends while salusd stops: its result is delivered
            said = {name: finish(c, timeout_s=60) for name, c in clients.items()}
            assert said["a"][0].strip() == "RESULT slept", said["a"]
            assert said["b"][0].strip() == "ERROR ShuttingDown: salusd is shutting down", said["b"]
            assert proc.wait(60) == 0
        finally:
            for c in clients.values():
                if c.poll() is None:
                    c.kill()
                    c.wait()

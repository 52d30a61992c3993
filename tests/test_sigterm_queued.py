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
from daemon_proc import salusd

pytestmark = pytest.mark.slow

CLIENT = textwrap.dedent("""
    import sys, time
    from torch import nn
    import salus.adapters.torch as salus

    with salus.connect(name=sys.argv[1], iterations=10) as job:
        remote = job.attach(model=nn.Linear(2, 2))

        @remote.function
        def sleepy(s, seconds):
            time.sleep(seconds)
            return "slept"

        sleepy(0.0)  # defined and run once: its calls go on the direct channel
        print("ready", flush=True)
        sys.stdin.readline()
        try:
            print(f"RESULT {sleepy(float(sys.argv[2]))}", flush=True)
        except BaseException as exc:
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
""")


def test_sigterm_answers_the_waiting_call_with_shutting_down(tmp_path: Path) -> None:
    (tmp_path / "client.py").write_text(CLIENT)
    with salusd(tmp_path, "--policy", "fair", devices=1) as (proc, address):
        env = {**os.environ, "SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1"}
        clients = {name: subprocess.Popen(
            [sys.executable, str(tmp_path / "client.py"), name, seconds], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for name, seconds in (("a", "3"), ("b", "0"))}
        try:
            for c in clients.values():
                assert c.stdout is not None and c.stdin is not None
                assert c.stdout.readline().strip() == "ready", finish(c, timeout_s=30)
            for name in ("a", "b"):  # a's call runs 3 s; b's waits for the one lane (fair)
                stdin = clients[name].stdin
                assert stdin is not None
                stdin.write("go\n")
                stdin.flush()
                time.sleep(0.7)
            proc.send_signal(signal.SIGTERM)
            said = {name: finish(c, timeout_s=60) for name, c in clients.items()}
            assert said["a"][0].strip() == "RESULT slept", said["a"]
            assert said["b"][0].strip() == "ERROR ShuttingDown: salusd is shutting down", said["b"]
            assert proc.wait(60) == 0
        finally:
            for c in clients.values():
                if c.poll() is None:
                    c.kill()
                    c.wait()

"""A job whose client process dies ends saying so, not as if its client had closed it: the
real `salusd serve` process and a client process killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import RunningDaemon, salusd
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.cli.control import Control

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    with salusd(tmp_path_factory.mktemp("salusd")) as running:
        yield running

CLIENT = textwrap.dedent("""
    import sys, time
    from torch import nn
    import salus.adapters.torch as salus

    job = salus.connect(name="killed", iterations=1, address=sys.argv[1])
    job.attach(model=nn.Linear(2, 2))
    print(job.id, flush=True)
    time.sleep(300)
""")


def ended(control: Control, job_id: str, within_s: float = 5.0) -> dict[str, object]:
    """The job's info once it has ended (waits up to `within_s` seconds)."""
    deadline = time.monotonic() + within_s
    info = control.info(job_id)
    while info["state"] not in ("finished", "cancelled", "failed") and (
            time.monotonic() < deadline):
        time.sleep(0.05)
        info = control.info(job_id)
    return info


def killed_after_its_job_id(client: subprocess.Popen[str], what: str) -> str:
    """The job id `client` prints first; `client` is then killed with SIGKILL (and reaped)."""
    try:
        assert client.stdout is not None
        job_id = client.stdout.readline().strip()
        assert job_id, what
        os.kill(client.pid, signal.SIGKILL)
    finally:
        client.kill()
        client.wait()
    return job_id


def test_a_killed_clients_job_ends_saying_its_client_went_away(daemon: RunningDaemon) -> None:
    address = daemon.address
    client = subprocess.Popen([sys.executable, "-c", CLIENT, address], text=True,
                              stdout=subprocess.PIPE)
    job_id = killed_after_its_job_id(client, "the client did not open its job")
    with salus.connect(name="closed", iterations=1, address=address) as job:
        job.attach(model=nn.Linear(2, 2))
    with Control(address) as control:
        killed = ended(control, job_id)
        closed = ended(control, str(job.id))
    assert f"client (pid {client.pid}) went away without closing it" in str(killed["reason"])
    assert killed["state"] == "failed"  # never finished: nobody saw it end
    assert "closed by its client" in str(closed["reason"]) and closed["state"] == "finished"
    log = daemon.log_text()
    assert f"job {job_id}'s client (pid {client.pid}) went away" in log


SCRIPT = textwrap.dedent("""
    import os, time
    print(os.environ["SALUS_JOB_ID"], flush=True)
    time.sleep(300)
""")


def test_a_killed_salusd_runs_script_job_fails_saying_so(daemon: RunningDaemon,
                                                        tmp_path: Path) -> None:
    """`salusd run` killed with SIGKILL while its script runs: nobody saw the script end, so
    its job fails saying its client went away; it does not finish."""
    (tmp_path / "sleeper.py").write_text(SCRIPT)
    address = daemon.address
    client = subprocess.Popen(
        [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
         address.removeprefix("unix://"), "--", sys.executable, "sleeper.py"],
        cwd=tmp_path, text=True, stdout=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    job_id = killed_after_its_job_id(client, "the script did not start")
    with Control(address) as control:
        killed = ended(control, job_id, within_s=15.0)
    assert killed["state"] == "failed", killed
    assert f"client (pid {client.pid}) went away without closing it" in str(killed["reason"])

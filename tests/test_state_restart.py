"""What the registry keeps across `kill -9` and a restart of the real daemon: a script job rerun
after the restart counts that rerun, a job failed by the restart keeps the iterations it had
done, and `salusd logs` over the socket finds a job that ended before the restart, as REST
does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from daemon_proc import salusd
from rest_client import connect, job, wait_for

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SEEN = 40  # iterations each long job has done before the kill


@pytest.mark.slow
def test_a_restart_keeps_restart_counts_iterations_done_and_ended_jobs_logs(
        tmp_path: Path) -> None:
    path = tmp_path / "steps.py"
    path.write_text(textwrap.dedent("""\
        import sys, time
        import salus.adapters.torch as salus
        print("stepping", flush=True)
        for _ in range(int(sys.argv[1])):
            time.sleep(0.02)
            salus.step()
        print("done", flush=True)
    """))
    body = {"command": [sys.executable, str(path)], "cwd": str(tmp_path),
            "env": {"PATH": os.environ["PATH"]}}
    with salusd(tmp_path, "--http", "127.0.0.1:0") as (proc, address):
        with connect(tmp_path / "state") as client:
            quick = client.post("/v1/jobs", json={**body, "name": "quick",
                                                  "command": [*body["command"], "3"]})
            assert quick.status_code == 201, quick.text
            quick_id = quick.json()["id"]
            wait_for(lambda: job(client, quick_id)["state"] == "finished", "the quick job")
            ids = {}
            for restart in ("never", "on-failure"):
                reply = client.post("/v1/jobs", json={
                    **body, "name": restart, "restart": restart,
                    "command": [*body["command"], "100000"]})
                assert reply.status_code == 201, reply.text
                ids[restart] = reply.json()["id"]
            wait_for(lambda: all(job(client, i)["iterations_done"] >= SEEN
                                 for i in ids.values()), "both jobs running", 90)
            wait_for(lambda: all(job(client, i)["iterations_done"] >= 3 * SEEN
                                 for i in ids.values()), "both jobs running on", 90)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with salusd(tmp_path, "--http", "127.0.0.1:0") as (_, address), \
            connect(tmp_path / "state") as client:
        failed = wait_for(lambda: (j := job(client, ids["never"]))["state"] == "failed" and j,
                          "the never job failed")
        assert "salusd restarted while job" in failed["reason"]
        assert failed["iterations_done"] >= SEEN, failed
        rerun = wait_for(lambda: (j := job(client, ids["on-failure"]))["state"] in (
            "admitted", "running") and j, "the on-failure job runs again")
        assert rerun["script"]["restarts"] == 1, rerun
        assert rerun["iterations_done"] >= SEEN, rerun
        log = client.get(f"/v1/jobs/{quick_id}/log", params={"offset": 0})
        assert log.status_code == 200 and log.text == "stepping\ndone\n", log.text
        logs = subprocess.run([sys.executable, "-m", "salus.daemon.cli", "logs", str(quick_id),
                               "--socket", address.removeprefix("unix://")],
                              capture_output=True, text=True, env=ENV, timeout=60)
        assert (logs.returncode, logs.stdout) == (0, log.text), logs.stderr
        assert client.delete(f"/v1/jobs/{ids['on-failure']}").status_code == 200

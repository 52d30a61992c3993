"""What a job prints reaches its owner, not the daemon's log: the real `salusd serve` process,
an interactive job's client that sees the job's lines before its call returns, `salusd logs`,
a batch job's `GET /v1/jobs/{id}/log`, and the output file's rotation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_proc import finish
from daemon_proc import RunningDaemon, job_root, salusd
from rest_client import connect, job, wait_for

from salus.daemon.cli.control import Control
from salus.daemon.state.job_output import MAX_FILE_BYTES
from salus.daemon.wire.errors import Conflict

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """One daemon (one device, REST, the printing job's root) for the module's tests: each
    reads its own jobs' output, and none of their lines may reach the daemon's log."""
    tmp = tmp_path_factory.mktemp("salusd")
    root = job_root(tmp, "printing.py")
    with salusd(tmp, "--http", "127.0.0.1:0", "--job-root", str(root), devices=1) as running:
        yield running

CLIENT = textwrap.dedent("""
    import os, sys, warnings
    import torch
    import salus.adapters.torch as salus

    lines = int(sys.argv[1])

    def chatty(s, x):
        for i in range(3):
            print(f"job line {i}")
        warnings.warn("job warning")
        pid = os.fork()
        if pid == 0:  # a child the job forks writes to the file only, never into the channel
            print("child line")
            os._exit(0)
        os.waitpid(pid, 0)
        return s.model(x).sum()

    def flood(s):
        for i in range(lines):
            print(f"flood {i:07d} " + "x" * 1000)

    with salus.connect(name="printer", iterations=1) as job:
        print("job", job.id, flush=True)
        remote = job.attach(model=torch.nn.Linear(2, 1))
        remote.iteration(chatty)(torch.ones(1, 2))
        print("after call", flush=True)
        if lines:
            remote.function(flood)()
            print("after flood", flush=True)
""")


def _client(tmp: Path, address: str, flood_lines: int = 0) -> tuple[str, str, str]:
    """Run the client script; (its job id, its stdout, its stderr)."""
    script = tmp / "client.py"
    script.write_text(CLIENT)
    env = {"SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, str(script), str(flood_lines)], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    out, err = finish(proc, timeout_s=120)
    assert proc.returncode == 0, (first, out, err)
    assert first.startswith("job "), first
    return first.split()[1], out, err


def _logs(address: str, job_id: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "salus.daemon.cli", "logs", job_id,
                           "--socket", address.removeprefix("unix://"), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_interactive_jobs_lines_reach_its_client_before_the_result_and_salusd_logs(
        daemon: RunningDaemon, tmp_path: Path) -> None:
    address = daemon.address
    job_id, out, err = _client(tmp_path, address)
    assert out == "job line 0\njob line 1\njob line 2\nafter call\n"
    assert "UserWarning: job warning" in err
    logged = _logs(address, job_id)
    assert _logs(address, job_id, "-f") == logged  # the job ended: -f stops at the end
    assert logged.startswith("job line 0\njob line 1\njob line 2\n"), logged
    assert "UserWarning: job warning" in logged
    assert logged.endswith("child line\n"), logged
    daemon_log = daemon.log_text()
    assert "job line" not in daemon_log and "job warning" not in daemon_log


PIPELINED = textwrap.dedent("""
    import json, sys
    import torch
    import salus.adapters.torch as salus

    def say(s, x):
        if int(x) % 3 == 0:
            print(f"call {int(x)}")
        return x

    futures = []
    seen = []

    class Watch:
        # the client stdout: when the job line of call i arrives, which results are in
        def write(self, text):
            i = int(text.split()[1])
            seen.append((i, [f.done() for f in futures[:i + 1]]))
            return len(text)

        def flush(self):
            pass

    with salus.connect(name="pipelined", iterations=60) as job:
        remote = job.attach(model=torch.nn.Linear(2, 1))
        fn = remote.iteration(say)
        real, sys.stdout = sys.stdout, Watch()
        for i in range(60):
            futures.append(fn.submit(torch.tensor(i)))
        values = [int(f.result()) for f in futures]
        sys.stdout = real

        def twenty_raises(s, x):
            if int(x) == 20:
                raise ValueError("twenty")
            return x

        failing = remote.iteration(twenty_raises)
        outcome = []
        for f in [failing.submit(torch.tensor(i)) for i in range(40)]:
            try:
                outcome.append(int(f.result()))
            except ValueError as exc:
                outcome.append(str(exc))
        calls_done = job.info()["calls_done"]
    print(json.dumps({"values": values, "seen": seen, "outcome": outcome,
                      "calls_done": calls_done}))
""")


def test_lines_and_results_of_calls_in_flight_keep_their_order(daemon: RunningDaemon,
                                                              tmp_path: Path) -> None:
    """The executor holds results back while the client keeps calls in flight: a line a call
    prints still reaches the client after the results of the calls before it and before its
    own; a call that raises fails alone, in its place; `info` counts every call."""
    script = tmp_path / "pipelined.py"
    script.write_text(PIPELINED)
    address = daemon.address
    env = {"SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["values"] == list(range(60))
    assert [i for i, _ in result["seen"]] == list(range(0, 60, 3))
    for i, results_in in result["seen"]:
        assert results_in == [True] * i + [False], (i, results_in)
    # A call that raises in flight fails alone, in its place; the daemon counted every call.
    assert result["outcome"] == [*range(20), "twenty", *range(21, 40)]
    assert result["calls_done"] == 100


def test_a_job_printing_6_mib_keeps_a_bounded_file_with_the_latest_lines(
        daemon: RunningDaemon, tmp_path: Path) -> None:
    lines = 6 * 1024  # about 1 KiB each
    address = daemon.address
    job_id, out, _ = _client(tmp_path, address, flood_lines=lines)
    assert out.count("\nflood ") == lines and out.endswith("after flood\n")
    tail = _logs(address, job_id, "--tail", "5000")
    folder = daemon.state_dir / "checkpoints" / job_id
    current, previous = folder / "output.log", folder / "output.log.1"
    assert current.stat().st_size <= MAX_FILE_BYTES
    assert previous.stat().st_size <= MAX_FILE_BYTES
    kept = previous.read_text() + current.read_text()
    assert kept.endswith(f"flood {lines - 1:07d} " + "x" * 1000 + "\n")
    numbers = [int(line.split()[1]) for line in kept.splitlines() if line.startswith("flood")]
    assert numbers == list(range(lines))  # 6 MiB fit in the two files: no line lost
    assert current.read_text().startswith("flood ") and current.stat().st_size < 3 << 20
    assert tail.endswith(f"flood {lines - 1:07d} " + "x" * 1000 + "\n")
    assert 4000 < len(tail) <= 5000


def _printed(client: Any, iterations: int) -> int:
    """The id of a REST batch job of `printing.py` that ran `iterations` and finished."""
    reply = client.post("/v1/jobs", json={"name": "printing", "iterations": iterations,
                                          "entrypoint": "printing.py:make_job"})
    assert reply.status_code == 201, reply.text
    jid = int(reply.json()["id"])
    wait_for(lambda: job(client, jid)["state"] == "finished", "the job finished")
    return jid


def test_a_batch_jobs_lines_are_served_by_rest(daemon: RunningDaemon, tmp_path: Path) -> None:
    client = connect(daemon.state_dir)
    jid = _printed(client, 5)
    got = client.get(f"/v1/jobs/{jid}/log")
    assert got.status_code == 200, got.text
    assert got.headers["content-type"].startswith("text/plain")
    expected = "".join(f"batch iteration {i}\n" for i in range(5))
    assert got.text == expected
    assert int(got.headers["X-Salus-Next-Offset"]) == len(expected)
    rest = client.get(f"/v1/jobs/{jid}/log", params={"offset": 7})
    assert rest.text == expected[7:]
    end = client.get(f"/v1/jobs/{jid}/log", params={"offset": len(expected)})
    assert end.text == "" and end.headers["X-Salus-Next-Offset"] == str(len(expected))
    assert client.get(f"/v1/jobs/{jid + 100}/log").status_code == 404
    # The owner controls the directory: a link or a FIFO in the file's place is refused,
    # not followed or waited on by the (root) daemon.
    path = daemon.state_dir / "checkpoints" / str(jid) / "output.log"
    (tmp_path / "secret").write_text("not the job's\n")
    path.unlink()
    path.symlink_to(tmp_path / "secret")
    refused = client.get(f"/v1/jobs/{jid}/log")
    assert refused.status_code == 409 and "not the job's" not in refused.text
    path.unlink()
    os.mkfifo(path)
    assert client.get(f"/v1/jobs/{jid}/log").status_code == 409
    assert "batch iteration" not in daemon.log_text()


def test_a_directory_in_the_output_files_place_leaks_no_descriptor_of_salusd(
        daemon: RunningDaemon) -> None:
    """An owner can put anything in their job's directory: 360 reads of a directory in the
    output file's place, over the socket and REST, each answer a conflict and leave the
    daemon's descriptor count flat; its soft limit of open files is its hard one."""
    proc, address = daemon.proc, daemon.address
    client = connect(daemon.state_dir)
    jid = _printed(client, 2)
    path = daemon.state_dir / "checkpoints" / str(jid) / "output.log"
    path.unlink()
    path.mkdir()
    fds = f"/proc/{proc.pid}/fd"
    with Control(address) as control:
        client.get(f"/v1/jobs/{jid}/log")  # the connections both ends keep are open
        before = len(os.listdir(fds))
        for i in range(300):
            with pytest.raises(Conflict, match="not a regular file"):
                control.logs(str(jid))
            if i % 5 == 0:  # a REST request takes longer: every fifth read is one
                got = client.get(f"/v1/jobs/{jid}/log")
                assert got.status_code == 409 and "not a regular file" in got.text, got.text
        assert len(os.listdir(fds)) <= before + 2, (before, os.listdir(fds))
    again = client.post("/v1/jobs", json={"name": "after", "iterations": 1,
                                          "entrypoint": "printing.py:make_job"})
    assert again.status_code == 201, again.text
    limits = Path(f"/proc/{proc.pid}/limits").read_text()
    (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
    soft, hard = line.split()[3:5]
    assert soft == hard, line

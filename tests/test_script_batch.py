"""Slurm-style batch options of `salusd run` against a real daemon: `--mem` (the job's lane and
cap), `--after` (start once other jobs finished), `--array` (one job per index) and the exit
status `salusd run` takes from the job's `exit_status` and `signal` fields.

Expected values come from the test's own arithmetic (sizes in MiB, the indexes of an array) or
from running the same script directly.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import salusd
from rest_client import wait_for

from salus.daemon.cli.control import Control

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 120
MiB = 2**20
DEVICE_MIB = 512


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One CPU device of 512 MiB."""
    tmp = tmp_path_factory.mktemp("salusd")
    with salusd(tmp, devices=1, memory=f"{DEVICE_MIB}M") as (_, address):
        yield address


def salusd_run(address: str, argv: list[str], cwd: Path, *options: str,
               **popen: Any) -> subprocess.Popen[str]:
    """`salusd run [options] -- python ARGV...` in `cwd`, its output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
         address.removeprefix("unix://"), *options, "--", sys.executable, *argv],
        cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        **{"env": ENV, **popen})


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, out, err


def script(tmp_path: Path, body: str, name: str = "s.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def job_id_in(path: Path) -> str:
    """The job id a script wrote to `path` (its SALUS_JOB_ID) once it is there."""
    return str(wait_for(lambda: path.exists() and path.read_text().strip(), f"{path}"))


# A script that writes its job id, then steps until the file `go` appears.
WAITS = """\
    import os, pathlib, sys, time
    import salus.adapters.torch as salus
    pathlib.Path(sys.argv[1]).write_text(os.environ["SALUS_JOB_ID"])
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
        salus.step()
    print("done")
"""


# ---- --mem ---------------------------------------------------------------------------------
def test_mem_above_every_device_is_refused_in_mib_and_gib(daemon: str, tmp_path: Path) -> None:
    path = script(tmp_path, "print('ran')\n")
    code, out, err = finish(salusd_run(daemon, [str(path)], tmp_path, "--mem", "1.5G"))
    assert (code, out) == (125, "")
    assert f"needs {1.5:.1f} GiB (--mem), the largest device has {DEVICE_MIB:.1f} MiB" in err


def test_mem_is_the_jobs_lane_from_its_start(daemon: str, tmp_path: Path) -> None:
    """The lane is the request (96 MiB) before the job measured anything, not a guess."""
    path = script(tmp_path, WAITS)
    proc = salusd_run(daemon, [str(path), str(tmp_path / "id"), str(tmp_path / "go")],
                      tmp_path, "--mem", "96M")
    job = job_id_in(tmp_path / "id")
    with Control(daemon) as ctl:
        info = wait_for(lambda: (i := ctl.info(job))["memory"]["lane_bytes"] and i, "a lane")
    (tmp_path / "go").touch()
    assert finish(proc)[:2] == (0, "done\n")
    assert info["memory"]["lane_bytes"] == 96 * MiB
    assert info["memory"]["requested_bytes"] == 96 * MiB
    assert info["memory"]["ephemeral_estimate_bytes"] == 96 * MiB


def test_a_job_over_its_mem_on_the_cpu_is_ended_saying_so(daemon: str, tmp_path: Path) -> None:
    """A 200 MiB tensor in a job that asked for 64 MiB: the job fails at the boundary that
    measured it (as an out-of-memory kill), where without a request it would be moved to a
    larger lane and finish."""
    path = script(tmp_path, """\
        import torch
        import salus.adapters.torch as salus
        for step in range(50):
            big = torch.ones(50 * 2**20)  # 200 MiB of float32, touched
            del big
            salus.step()
        print("done")
    """)
    code, out, err = finish(salusd_run(daemon, [str(path)], tmp_path, "--mem", "64M"))
    assert "done" not in out
    assert code != 0
    assert f"more than the {64:.1f} MiB it asked for (--mem)" in err


# ---- --after ---------------------------------------------------------------------------------
def job_named(ctl: Control, name: str) -> dict[str, Any]:
    """The info of the live job named `name`, once salusd has it."""
    def find() -> dict[str, Any] | None:
        jobs = [j for j in ctl.status()["jobs"] if j["name"] == name]
        return jobs[-1] if jobs else None
    return wait_for(find, f"a job named {name!r}")


MARKS = """\
    import pathlib, sys
    pathlib.Path(sys.argv[1]).write_text("ran")
    print("ran")
"""


def test_after_starts_the_job_once_the_other_finished(daemon: str, tmp_path: Path) -> None:
    first = salusd_run(daemon, [str(script(tmp_path, WAITS)), str(tmp_path / "id"),
                                str(tmp_path / "go")], tmp_path)
    first_id = job_id_in(tmp_path / "id")
    marks = script(tmp_path, MARKS, "marks.py")
    second = salusd_run(daemon, [str(marks), str(tmp_path / "second-ran")], tmp_path,
                        "--after", first_id, "--name", "second")
    with Control(daemon) as ctl:
        waiting = job_named(ctl, "second")
        time.sleep(1.0)  # time it would need to start, were it not waiting
        assert not (tmp_path / "second-ran").exists()
        again = ctl.info(str(waiting["job_id"]))
    assert (waiting["state"], waiting["waiting_for"]) == ("pending", [int(first_id)])
    assert (again["state"], again["after"], again["memory"]["lane_bytes"]) == (
        "pending", [int(first_id)], None)
    (tmp_path / "go").touch()
    assert finish(first)[:2] == (0, "done\n")
    assert finish(second)[:2] == (0, "ran\n")


def test_after_a_failed_job_fails_naming_it_and_so_do_those_after_that(
        daemon: str, tmp_path: Path) -> None:
    """A fails with status 3; B runs after A, C after B: neither runs, each names its reason."""
    fails = script(tmp_path, WAITS.replace('print("done")', "sys.exit(3)"), "fails.py")
    a = salusd_run(daemon, [str(fails), str(tmp_path / "id"), str(tmp_path / "go")], tmp_path)
    a_id = job_id_in(tmp_path / "id")
    marks = script(tmp_path, MARKS, "marks.py")
    b = salusd_run(daemon, [str(marks), str(tmp_path / "b-ran")], tmp_path,
                   "--after", a_id, "--name", "after-a")
    with Control(daemon) as ctl:
        b_id = str(job_named(ctl, "after-a")["job_id"])
        c = salusd_run(daemon, [str(marks), str(tmp_path / "c-ran")], tmp_path,
                       "--after", f"{a_id},{b_id}", "--name", "after-b")
        c_id = str(job_named(ctl, "after-b")["job_id"])
    (tmp_path / "go").touch()
    assert finish(a)[0] == 3
    b_code, b_out, b_err = finish(b)
    c_code, c_out, c_err = finish(c)
    assert (b_code, b_out, c_code, c_out) == (1, "", 1, "")
    assert f"job {a_id}, which job {b_id} was to run after (--after), failed: its command " \
           "exited with status 3" in b_err
    assert f"which job {c_id} was to run after (--after), failed" in c_err
    assert not (tmp_path / "b-ran").exists() and not (tmp_path / "c-ran").exists()


def test_after_a_job_that_does_not_exist_is_refused(daemon: str, tmp_path: Path) -> None:
    path = script(tmp_path, "print('ran')\n")
    code, out, err = finish(salusd_run(daemon, [str(path)], tmp_path, "--after", "999999"))
    assert (code, out) == (125, "")
    assert "--after 999999: there is no job 999999" in err


@pytest.mark.slow
def test_rest_after_waits_across_a_daemon_restart(tmp_path: Path) -> None:
    """REST `after`: B waits for A; salusd is killed (-9) and started again: A (restart
    on-failure) runs again, B still waits for it, and runs, its output in its log, once A
    finished."""
    from rest_client import connect, job

    waits = script(tmp_path, WAITS)
    marks = script(tmp_path, MARKS, "marks.py")
    body = {"cwd": str(tmp_path), "env": {"PATH": os.environ["PATH"]}}
    with salusd(tmp_path, "--http", "127.0.0.1:0") as (proc, _), \
            connect(tmp_path / "state") as client:
        a = client.post("/v1/jobs", json={**body, "name": "a", "restart": "on-failure",
                                          "command": [sys.executable, str(waits),
                                                      str(tmp_path / "id"),
                                                      str(tmp_path / "go")]})
        assert a.status_code == 201, a.text
        a_id = a.json()["id"]
        b = client.post("/v1/jobs", json={**body, "name": "b", "after": [a_id],
                                          "command": [sys.executable, str(marks),
                                                      str(tmp_path / "b-ran")]})
        assert b.status_code == 201, b.text
        b_id = b.json()["id"]
        assert (b.json()["state"], b.json()["after"], b.json()["waiting_for"]) == (
            "pending", [a_id], [a_id])
        job_id_in(tmp_path / "id")
        proc.kill()
        proc.wait()
    (tmp_path / "id").unlink()
    with salusd(tmp_path, "--http", "127.0.0.1:0"), connect(tmp_path / "state") as client:
        job_id_in(tmp_path / "id")  # A runs again
        assert (job(client, b_id)["state"], job(client, b_id)["waiting_for"]) == (
            "pending", [a_id])
        assert not (tmp_path / "b-ran").exists()
        (tmp_path / "go").touch()
        wait_for(lambda: job(client, b_id)["state"] == "finished", "B finished")
        assert job(client, a_id)["state"] == "finished"
        assert client.get(f"/v1/jobs/{b_id}/log", params={"offset": 0}).text == "ran\n"
    assert (tmp_path / "b-ran").read_text() == "ran"


# ---- --array ---------------------------------------------------------------------------------
def test_an_array_runs_a_job_per_index_each_with_its_own_output_file(
        daemon: str, tmp_path: Path) -> None:
    """`--array 0,2,5`: three jobs, each told its index and the array's id (the first task's
    job id), stdin empty, output in salus-A_I.out; `salusd run` exits with the highest status
    (each task exits with its index: 5)."""
    path = script(tmp_path, """\
        import os, sys
        index = int(os.environ["SALUS_ARRAY_INDEX"])
        print(index, os.environ["SALUS_ARRAY_JOB_ID"], os.environ["SALUS_JOB_ID"],
              repr(sys.stdin.read()))
        print("to stderr", file=sys.stderr)
        sys.exit(index)
    """)
    code, out, err = finish(salusd_run(daemon, [str(path)], tmp_path, "--array", "0,2,5"))
    assert (code, out) == (max(0, 2, 5), "")
    files = sorted(tmp_path.glob("salus-*_*.out"))
    assert len(files) == 3, err
    lines = {int(f.name.split("_")[1].removesuffix(".out")): f.read_text().splitlines()
             for f in files}
    assert sorted(lines) == [0, 2, 5]
    first = lines[0][0].split()[2]  # task 0's job id is the array's
    for index, (printed, stderr) in lines.items():
        got_index, array_job, job, stdin = printed.split()
        assert (int(got_index), array_job, stdin, stderr) == (index, first, "''", "to stderr")
        assert (tmp_path / f"salus-{first}_{index}.out").exists()
        assert f"task {index} (job {job}) exited {index}" in err
    assert len({line[0].split()[2] for line in lines.values()}) == 3  # three jobs


def test_an_array_with_a_throttle_runs_at_most_that_many_at_once(
        daemon: str, tmp_path: Path) -> None:
    """`--array 0-3%2`: four tasks of 1.5 s, each in a lane of its own (--mem 64M: four fit
    the device at once), never more than two running at a time, two at first."""
    path = script(tmp_path, """\
        import os, sys, time
        began = time.time()
        time.sleep(1.5)
        print(began, time.time())
    """)
    code, _, err = finish(salusd_run(daemon, [str(path)], tmp_path, "--array", "0-3%2",
                                     "--mem", "64M"))
    assert code == 0, err
    spans = [tuple(map(float, f.read_text().split())) for f in tmp_path.glob("salus-*.out")]
    assert len(spans) == 4
    most = max(sum(1 for b, e in spans if b <= t < e) for t, _ in spans)
    assert most == 2, spans


def test_signals_reach_every_task_of_an_array(daemon: str, tmp_path: Path) -> None:
    path = script(tmp_path, """\
        import signal, sys, time
        import salus.adapters.torch as salus

        def term(*_):
            print("got TERM", flush=True)
            sys.exit(0)

        signal.signal(signal.SIGTERM, term)
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
            salus.step()
    """)
    proc = salusd_run(daemon, [str(path)], tmp_path, "--array", "0-1")
    wait_for(lambda: [f.read_text() for f in tmp_path.glob("salus-*.out")] == ["ready\n"] * 2,
             "both tasks ready")
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == 0, err
    assert [f.read_text() for f in tmp_path.glob("salus-*.out")] == ["ready\ngot TERM\n"] * 2


def test_array_indexes_read_as_slurms() -> None:
    from salus.daemon.cli.run import array_spec

    assert array_spec("0-7") == (list(range(8)), None)
    assert array_spec("0,2,5") == ([0, 2, 5], None)
    assert array_spec("0-15:4%2") == ([0, 4, 8, 12], 2)
    assert array_spec("3,1-2,3") == ([1, 2, 3], None)
    for bad in ("", "a", "3-1", "0-7%0", "0-4:0", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            array_spec(bad)


# ---- how a job ended: exit_status, signal, limit; salusd status --------------------------------
@pytest.fixture(scope="module")
def rest_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A daemon with its REST API: (socket address, state dir)."""
    tmp = tmp_path_factory.mktemp("salusd-rest")
    with salusd(tmp, "--http", "127.0.0.1:0", "--script-grace", "5", devices=1,
                memory=f"{DEVICE_MIB}M") as (_, address):
        yield address, tmp / "state"


@pytest.mark.parametrize("ending, exit_status, signum", [
    ("sys.exit(3)", 3, None),
    ("os._exit(7)", 7, None),  # the process ends without the script's status reaching salusd
    ("os.kill(os.getpid(), signal.SIGKILL)", 128 + 9, 9),
])
def test_the_job_view_says_how_the_command_ended_and_salusd_run_exits_so(
        rest_daemon: tuple[str, Path], tmp_path: Path, ending: str, exit_status: int,
        signum: int | None) -> None:
    from rest_client import connect, job

    address, state = rest_daemon
    path = script(tmp_path, f"""\
        import os, signal, sys
        print(os.environ["SALUS_JOB_ID"], flush=True)
        {ending}
    """)
    code, out, _ = finish(salusd_run(address, [str(path)], tmp_path))
    assert code == exit_status
    with connect(state) as client:
        view = job(client, int(out.split()[0]))
    assert (view["state"], view["exit_status"], view["signal"], view["limit"]) == (
        "failed", exit_status, signum, None)


def test_salusd_run_takes_its_status_from_the_fields_not_the_reason(
        daemon: str, tmp_path: Path) -> None:
    """A script that exits 0 with "hit its time limit" in its command line (so in the job's
    reason) exits 0, and one that hits its --time exits 124 (`limit` is "time")."""
    path = script(tmp_path, """\
        import sys, time
        import salus.adapters.torch as salus
        if sys.argv[1] == "wait":
            while True:
                time.sleep(0.01)
                salus.step()
    """)
    code, _, err = finish(salusd_run(daemon, [str(path), "hit its time limit"], tmp_path))
    assert code == 0, err
    code, _, err = finish(salusd_run(daemon, [str(path), "wait"], tmp_path, "--time", "2"))
    assert code == 124 and "hit its time limit of 2 s" in err


def test_a_cancelled_script_that_dies_of_sigterm_is_recorded_with_it(
        rest_daemon: tuple[str, Path], tmp_path: Path) -> None:
    from rest_client import connect, job

    address, state = rest_daemon
    proc = salusd_run(address, [str(script(tmp_path, WAITS)), str(tmp_path / "id"),
                                str(tmp_path / "never")], tmp_path)
    job_id = int(job_id_in(tmp_path / "id"))
    with connect(state) as client:
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
        assert finish(proc)[0] == 128 + signal.SIGTERM
        view = wait_for(lambda: (v := job(client, job_id))["signal"] and v, "the signal")
    assert (view["state"], view["exit_status"], view["signal"]) == (
        "cancelled", 128 + signal.SIGTERM, signal.SIGTERM)


def test_status_shows_live_jobs_unless_all_and_an_unknown_count_as_a_dash(
        rest_daemon: tuple[str, Path], tmp_path: Path) -> None:
    address, state = rest_daemon
    quick = script(tmp_path, "print('quick')\n", "quick.py")
    assert finish(salusd_run(address, [str(quick)], tmp_path, "--name", "ended-one"))[0] == 0
    live = salusd_run(address, [str(script(tmp_path, WAITS)), str(tmp_path / "id"),
                                str(tmp_path / "go")], tmp_path, "--name", "live-one")
    live_id = job_id_in(tmp_path / "id")

    def status(*options: str) -> str:
        done = subprocess.run([sys.executable, "-m", "salus.daemon.cli", "status",
                               "--state-dir", str(state), *options], capture_output=True,
                              text=True, env=ENV, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        return done.stdout

    import json

    names = {j["name"] for j in json.loads(status("--json"))["jobs"]}
    every = {j["name"] for j in json.loads(status("--json", "--all"))["jobs"]}
    table = status()
    (tmp_path / "go").touch()
    assert finish(live)[0] == 0
    assert "live-one" in names and "ended-one" not in names
    assert {"live-one", "ended-one"} <= every
    assert str(2**53) not in table
    row = next((line for line in table.splitlines() if line.startswith(f"│ {live_id} ")), "")
    assert "/- " in row, table  # done/planned, the planned count unknown

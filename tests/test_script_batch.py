"""Slurm-style batch options of `salusd run` against a real daemon: `--mem` (the job's lane and
cap), `--after` (start once other jobs finished), `--array` (one job per index) and the exit
status `salusd run` takes from the job's `exit_status` and `signal` fields.

Expected values come from the test's own arithmetic (sizes in MiB, the indexes of an array) or
from running the same script directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import salusd

from salus.daemon.control import Control

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


def wait_for(check: Any, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


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

"""`salusd run --here`: the script runs in salusd run's own child, taking turns from a real
daemon through the link the daemon adopts as its executor's (`salusd/cli/here.py`,
`salusd/executor/in_pod.py`).

Expected values come from running the same scripts directly (`OMP_NUM_THREADS=1`, as the
daemon gives each job one intra-op thread): a script run here and one in salusd's own executor
take turns in one lane under `fair` and both end bit-equal to their direct runs. Signals that
salusd cannot `kill` into the caller's process (a cancel's SIGTERM) reach the script through the
link, and closing the link kills it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import salusd
from test_script_jobs import (
    CASES,
    ENV,
    assert_equal,
    ctrl_c_is_the_scripts_keyboard_interrupt,
    direct,
    finish,
    in_one_lane,
    saved,
    script,
    write_data,
)

from salus.daemon.cli.control import Control
from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.errors import SalusError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One CPU device under `fair`: jobs that run at once share its one lane."""
    tmp = tmp_path_factory.mktemp("salusd")
    with salusd(tmp, "--policy", "fair", devices=1, memory="2G") as (_, address):
        yield address


def run(address: str, argv: list[str], cwd: Path, *options: str,
        here: bool = True, **popen: object) -> subprocess.Popen[str]:
    """`salusd run [--here] [options] -- python ARGV...` in `cwd`."""
    return subprocess.Popen(
        [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
         address.removeprefix("unix://"), *(("--here",) if here else ()), *options, "--",
         sys.executable, *argv],
        cwd=cwd, text=True, **{"env": ENV, **popen})  # type: ignore[call-overload]


def wait_for(check: object, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_script_here_and_one_in_salusds_executor_share_a_lane_and_equal_direct_runs(
        daemon: str, tmp_path: Path) -> None:
    cases = {"gcn": True, "gat": False}  # name: run here
    want, runs = {}, {}
    for name in cases:
        cwd = tmp_path / f"direct-{name}"
        cwd.mkdir()
        write_data(cwd)
        code, _, err = finish(direct(CASES[name][0], cwd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE))
        assert code == 0, err
        want[name] = saved(cwd, CASES[name][1])
    for name, here in cases.items():
        cwd = tmp_path / name
        cwd.mkdir()
        write_data(cwd)
        runs[name] = (cwd, run(daemon, CASES[name][0], cwd, "--name", name, here=here,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    with Control(daemon) as ctl:
        placed = in_one_lane(ctl, {name: proc for name, (_, proc) in runs.items()})
        why = {j["name"]: ctl.info(str(j["job_id"]))["executor"]
               for j in ctl.status()["jobs"] if j["name"] in runs}
    assert any(len(p) == 1 for p in placed), placed  # both in one lane at once
    assert why["gcn"]["pid"] is None and "--here" in why["gcn"]["why"], why
    assert why["gat"]["pid"] is not None, why
    for name, (cwd, proc) in runs.items():
        code, _, err = finish(proc)
        assert code == 0, f"{name}: {err}"
        assert_equal(saved(cwd, CASES[name][1]), want[name], name)


@pytest.mark.parametrize("ending, status", [
    ("sys.exit(3)", 3),
    ("raise ValueError('bad value')", 1),
    ("os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL),
])
def test_output_and_exit_status_are_a_direct_runs(daemon: str, tmp_path: Path, ending: str,
                                                  status: int) -> None:
    path = script(tmp_path, f"""\
        import os, signal, subprocess, sys, torch
        print("one", sys.argv[1:], os.getcwd() == {str(tmp_path)!r}, os.environ["MARK"])
        print("two to stderr", torch.get_num_threads(), file=sys.stderr)
        sys.stdout.flush()
        subprocess.run(["echo", "three from a child"])
        sys.stdout.flush()
        {ending}
    """)
    env = {**ENV, "MARK": "caller's"}
    want = finish(direct([str(path), "a b"], tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT))
    got = finish(run(daemon, [str(path), "a b"], tmp_path, env=env, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT))
    assert got[0] == status, got
    assert got[1].startswith(want[1]), (got[1], want[1])


def test_ctrl_c_is_the_scripts_keyboard_interrupt(daemon: str, tmp_path: Path) -> None:
    ctrl_c_is_the_scripts_keyboard_interrupt(
        tmp_path, lambda argv: run(daemon, argv, tmp_path, stdout=subprocess.PIPE))


STEPS_FOREVER = """\
    import os, signal, sys, time, torch
    def on_term(*_):
        print("SIGTERM in the script", flush=True)
    signal.signal(signal.SIGTERM, on_term)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    print(os.getpid(), flush=True)
    while True:
        opt.step()
        time.sleep(0.02)
"""


def cancelled(daemon: str, path: Path, name: str, grace: str,
              turns: int) -> tuple[int, str, str, int, dict[str, Any]]:
    """Run the script `path` here as job `name` with `--grace`, and cancel it once it has done
    `turns` iterations: salusd run's exit status, stdout and stderr, the script's pid (its
    first line) and the job's info once salusd run has exited."""
    proc = run(daemon, [str(path)], path.parent, "--name", name, "--grace", grace,
               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    with Control(daemon) as ctl:
        (job,) = [j["job_id"] for j in ctl.status()["jobs"] if j["name"] == name]
        wait_for(lambda: ctl.info(str(job))["iterations_done"] >= turns, "turns taken")
        ctl.call(ops.Cancel(str(job)))
        code, out, err = finish(proc)
        return code, out, err, pid, ctl.info(str(job))


def test_a_cancel_signals_the_script_through_its_link_then_kills_it_after_its_grace(
        daemon: str, tmp_path: Path) -> None:
    """salusd cannot kill(2) the caller's process: the SIGTERM of a cancel comes as a message
    the script's handler gets, and the end of the grace closes the link, which kills it."""
    code, out, err, pid, info = cancelled(daemon, script(tmp_path, STEPS_FOREVER), "forever",
                                          "2", 5)
    assert out == "SIGTERM in the script\n", (out, err)
    assert code == 128 + signal.SIGKILL, err
    assert f"job {info['job_id']} cancelled" in err
    assert info["state"] == "cancelled" and info["signal"] == signal.SIGKILL, info
    assert gone(pid)


def test_a_cancel_reaches_a_script_waiting_at_a_boundary_for_its_turn(
        daemon: str, tmp_path: Path) -> None:
    """A cancelled job gets no more turns: its SIGTERM must reach the script while it waits
    at a boundary (another job's long iteration runs in its lane), as salusd's kill(2) of a
    forked executor's script would, so that its handler runs within the grace."""
    slow = script(tmp_path, """\
        import time, torch
        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        print("slow", flush=True)
        for _ in range(30):
            time.sleep(0.5)
            opt.step()
    """, "slow.py")
    other = run(daemon, [str(slow)], tmp_path, "--name", "slow", here=False,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert other.stdout is not None and other.stdout.readline() == "slow\n"
        code, out, err, pid, _ = cancelled(daemon, script(tmp_path, STEPS_FOREVER, "waiter.py"),
                                           "waiter", "3", 2)
    finally:
        other.kill()
        other.communicate()
    assert out == "SIGTERM in the script\n", (out, err)
    assert code == 128 + signal.SIGKILL, err
    assert gone(pid)


def test_what_here_cannot_do_is_refused_saying_why(daemon: str, tmp_path: Path) -> None:
    path = script(tmp_path, "print('ran')\n")
    cases = {
        ("--restart", "on-failure"): "--restart on-failure needs salusd's executors",
        ("--after", "1"): "--after needs salusd's executors",
        ("--array", "0-1"): "--array needs salusd's executors",
    }
    for options, why in cases.items():
        code, out, err = finish(run(daemon, [str(path)], tmp_path, *options,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        assert code == 125 and out == "", (options, out, err)
        assert why in " ".join(err.split()), (options, err)
    torchrun = subprocess.run(
        [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
         daemon.removeprefix("unix://"), "--here", "--", sys.executable, "-m",
         "torch.distributed.run", "--nproc-per-node", "1", str(path)],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert torchrun.returncode == 125
    assert "--here runs one process: a torchrun gang" in " ".join(torchrun.stderr.split())


def test_salusd_run_killed_takes_its_script_and_job_with_it(daemon: str,
                                                            tmp_path: Path) -> None:
    path = script(tmp_path, STEPS_FOREVER)
    proc = run(daemon, [str(path)], tmp_path, "--name", "orphan", stdout=subprocess.PIPE,
               stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    wait_for(lambda: gone(pid), "the script to die with salusd run", 10.0)
    with Control(daemon) as ctl:
        (job,) = [j["job_id"] for j in ctl.status()["jobs"] if j["name"] == "orphan"] or [None]
        if job is not None:  # still ending
            wait_for(lambda: ctl.info(str(job))["state"] in ("cancelled", "failed"), "its end")


def test_the_script_dies_when_salusd_goes_away(tmp_path: Path) -> None:
    """A forked executor dies with its zygote; one salusd did not fork dies when its link
    closes."""
    path = script(tmp_path, STEPS_FOREVER)
    (tmp_path / "d").mkdir()
    with salusd(tmp_path / "d", devices=1, memory="1G") as (daemon, address):
        proc = run(address, [str(path)], tmp_path, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        time.sleep(0.5)
        daemon.kill()
        daemon.wait()
        wait_for(lambda: gone(pid), "the script to die with its link", 10.0)
        code, _, err = finish(proc)
    assert code == 128 + signal.SIGKILL, err


def test_a_here_run_and_its_executors_link_come_together_or_are_refused(
        daemon: str, tmp_path: Path) -> None:
    """The protocol's side: `run` with `here` needs the link (a `socket` with `executor`)
    before it, and a link is adopted only by a `run` that says `here`."""
    run_request = ops.Run((sys.executable, "-c", "print(1)"), str(tmp_path), dict(ENV),
                          name="protocol")
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    with Control(daemon) as ctl, a, b, c, d:
        ctl.send(dataclasses.replace(run_request, here=True), b.fileno())
        with pytest.raises(SalusError, match="needs its executor's link"):
            ctl.reply()
        ctl.send(ops.Socket(executor=True), c.fileno())
        ctl.reply()
        ctl.send(ops.Socket(executor=True), d.fileno())
        with pytest.raises(SalusError, match="already has its executor's link"):
            ctl.reply()
        ctl.send(run_request, b.fileno())
        with pytest.raises(SalusError, match="does not say 'here'"):
            ctl.reply()
        assert not [j for j in ctl.status()["jobs"] if j["name"] == "protocol"]

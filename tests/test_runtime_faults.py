"""Job code that crashes, exits or hangs costs only its own job: the real `salusd serve`
process, two jobs training meanwhile in other client processes, and the bad job's client.
One daemon serves every kind in turn, so each later kind also finds it whole after the
earlier ones."""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_proc import TRAINER as GOOD
from client_proc import finish, go, reap, start_client
from daemon_proc import RunningDaemon, salusd

from salus.daemon.cli.control import Control

pytestmark = pytest.mark.slow


BAD = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import salus.adapters.torch as salus

    kind = sys.argv[1]

    def misbehave(s, x, bad=False):
        if bad and kind == "segfault":
            import ctypes
            ctypes.string_at(0)
        if bad and kind == "os_exit":
            import os
            os._exit(1)
        if bad and kind == "sys_exit":
            sys.exit(3)
        if bad and kind == "hang":
            import time
            time.sleep(3600)
        return s.model(x).sum()

    with salus.connect(name=f"bad-{kind}", iterations=10) as job:
        remote = job.attach(model=nn.Linear(4, 2))
        it = remote.iteration(misbehave)
        it(torch.randn(2, 4))
        print(job.id, flush=True)
        try:
            it(torch.randn(2, 4), bad=True)
            print("NO ERROR", flush=True)
        except BaseException as exc:
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        try:  # the job survives its own exception, not its executor's death
            it(torch.randn(2, 4))
            print("AFTER ok", flush=True)
        except BaseException as exc:
            print(f"AFTER {type(exc).__name__}: {exc}", flush=True)
""")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    with salusd(tmp_path_factory.mktemp("salusd"), "--cancel-grace", "1") as running:
        yield running


@pytest.mark.parametrize("kind", ["segfault", "os_exit", "sys_exit", "hang"])
def test_bad_job_costs_only_itself(daemon: RunningDaemon, tmp_path: Path, kind: str) -> None:
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    proc, address = daemon.proc, daemon.address
    logged = len(daemon.log_text())
    goods = [start_client(tmp_path / "good.py", str(seed), address=address) for seed in (1, 2)]
    try:
        for g in goods:
            assert g.stdout is not None
            line = g.stdout.readline()
            assert "job" in json.loads(line or "{}"), g.stderr.read() if g.stderr else ""
        bad = start_client(tmp_path / "bad.py", kind, address=address)
        assert bad.stdout is not None
        job_id = bad.stdout.readline().strip()
        assert job_id.isdigit(), finish(bad, timeout_s=30)
        if kind == "hang":
            time.sleep(0.5)
            started = time.monotonic()
            with Control(address) as ctl:
                ctl.cancel(job_id)
        out, err = finish(bad, timeout_s=60)
        if kind == "hang":
            assert time.monotonic() - started < 15  # grace 1 s, then the kill
        lines = out.strip().splitlines()
        assert len(lines) >= 2, f"the bad client said {out!r}; stderr: {err[-3000:]}"
        error, after = lines[0], lines[1]
        if kind == "segfault":
            assert "signal 11 (SIGSEGV)" in error and f"running job {job_id}" in error
            assert after.startswith("AFTER JobFailed")
        elif kind == "os_exit":
            assert "exit status 1" in error and f"running job {job_id}" in error
            assert after.startswith("AFTER JobFailed")
        elif kind == "sys_exit":
            assert error.startswith("ERROR CallFailed") and "SystemExit: 3" in error
            assert after == "AFTER ok"  # an exception in a call fails the call only
        else:
            assert error.startswith("ERROR JobCancelled") and "cancelled" in error
            assert after.startswith("AFTER JobCancelled")
        for g in goods:
            go(g)
        for g in goods:
            out, err = finish(g, timeout_s=120)
            assert g.returncode == 0, err
            assert json.loads(out.strip().splitlines()[-1])["max_abs_diff"] == 0.0
        assert proc.poll() is None, "the daemon died"
    finally:
        reap(goods)
    log = daemon.log_text()[logged:]
    if kind in ("segfault", "os_exit"):
        assert "died" in log

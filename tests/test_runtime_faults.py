"""Job code that crashes, exits or hangs costs only its own job: the real `salusd serve`
process, two jobs training meanwhile in other client processes, and the bad job's client."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from client_proc import finish
from daemon_proc import salusd

from salus.daemon.control import Control

pytestmark = pytest.mark.slow

GOOD = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import salus.adapters.torch as salus

    torch.set_num_threads(1)
    seed = int(sys.argv[1])

    def build():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(30)]

    def step(s, x, y):
        s.opt.zero_grad()
        loss = nn.functional.cross_entropy(s.model(x), y)
        loss.backward()
        s.opt.step()
        return loss

    model, opt = build()
    torch.manual_seed(1000 + seed)
    with salus.connect(name=f"good{seed}", iterations=len(data)) as job:
        remote = job.attach(model=model, opt=opt)
        train = remote.iteration(step)
        for i, (x, y) in enumerate(data):
            if i == 10:
                print("ready", flush=True)
                sys.stdin.readline()  # the bad job misbehaves now
            train(x, y)
        remote.pull()
    direct, dopt = build()
    torch.manual_seed(1000 + seed)
    from types import SimpleNamespace
    s = SimpleNamespace(model=direct, opt=dopt)
    for x, y in data:
        step(s, x, y)
    diff = max((a - b).abs().max().item()
               for a, b in zip(model.state_dict().values(), direct.state_dict().values()))
    print(json.dumps({"max_abs_diff": diff}), flush=True)
""")

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


def _start(script: Path, *args: str, address: str) -> subprocess.Popen[str]:
    env = {"SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen([sys.executable, str(script), *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@pytest.mark.parametrize("kind", ["segfault", "os_exit", "sys_exit", "hang"])
def test_bad_job_costs_only_itself(tmp_path: Path, kind: str) -> None:
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    with salusd(tmp_path, "--cancel-grace", "1") as (proc, address):
        goods = [_start(tmp_path / "good.py", str(seed), address=address) for seed in (1, 2)]
        try:
            for g in goods:
                assert g.stdout is not None
                assert g.stdout.readline().strip() == "ready", g.stderr.read() if g.stderr else ""
            bad = _start(tmp_path / "bad.py", kind, address=address)
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
                assert g.stdin is not None
                g.stdin.write("go\n")
                g.stdin.flush()
            for g in goods:
                out, err = finish(g, timeout_s=120)
                assert g.returncode == 0, err
                assert json.loads(out.strip().splitlines()[-1])["max_abs_diff"] == 0.0
            assert proc.poll() is None, "the daemon died"
        finally:
            for g in goods:
                if g.poll() is None:
                    g.kill()
                    g.wait()
        log = (tmp_path / "salusd.log").read_text()
        if kind in ("segfault", "os_exit"):
            assert "died" in log

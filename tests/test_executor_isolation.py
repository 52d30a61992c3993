"""Job code cannot read the daemon's environment or write into the daemon's log (issue 33, items
2 and 3): the real `salusd serve`, started with a variable only it has and its log in a file, runs
an interactive job's function and a `salusd run` script; each looks at its own process, as an
attacker would (`/proc/self/environ`, every open descriptor), and writes a forged log line into
every descriptor it holds that is not a socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from client_proc import finish
from daemon_proc import salusd

pytestmark = pytest.mark.slow

SECRET_NAME, SECRET = "DAEMON_ONLY_TOKEN", "s3cret-of-the-daemon"
FORGED = "[00:00:00] CRITICAL FORGED BY A JOB"

PROBE = textwrap.dedent(f"""
    import json, os

    def probe(state=None):
        with open("/proc/self/environ", "rb") as f:
            initial = f.read().decode("utf-8", "replace")
        fds = {{}}
        for name in os.listdir("/proc/self/fd"):
            try:
                fds[name] = os.readlink(f"/proc/self/fd/{{name}}")
            except OSError:
                continue
        for name, target in fds.items():
            if int(name) > 1 and not target.startswith(("socket:", "anon_inode:")):
                try:
                    os.write(int(name), {(FORGED + chr(10))!r}.encode())
                except OSError:
                    pass
        with open("/proc/self/status") as f:
            status = dict(line.rstrip("\\n").split(":\\t", 1) for line in f if ":\\t" in line)
        privileges = {{k: status[k].strip() for k in
                      ("NoNewPrivs", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}}
        return {{"initial": initial, "environ": dict(os.environ), "fds": fds,
                 "privileges": privileges}}
""")

CLIENT = PROBE + textwrap.dedent("""
    import torch
    import salus.adapters.torch as salus

    with salus.connect(name="probe", iterations=1) as job:
        remote = job.attach(model=torch.nn.Linear(1, 1))
        print(json.dumps(remote.function(probe)()), flush=True)
""")

SCRIPT = PROBE + textwrap.dedent("""
    print(json.dumps(probe()), flush=True)
""")


def _check(seen: dict[str, Any], log: Path) -> None:
    assert SECRET not in seen["initial"] and SECRET_NAME not in seen["environ"], seen["initial"]
    held = {os.path.realpath(t) for t in seen["fds"].values() if t.startswith("/")}
    assert os.path.realpath(log) not in held, seen["fds"]
    # No capability, none to gain (the bounding set is emptied where salusd had one to empty:
    # as root), and setuid programs run without their privilege.
    privileges = seen["privileges"]
    assert privileges["NoNewPrivs"] == "1", privileges
    held_caps = {k: int(v, 16) for k, v in privileges.items() if k.startswith("Cap")}
    assert {k: v for k, v in held_caps.items() if k != "CapBnd" and v} == {}, privileges
    if os.geteuid() == 0:
        assert held_caps["CapBnd"] == 0, privileges


def _forged_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines()
            if line.startswith("[00:00:00] CRITICAL")]


def test_job_code_gets_no_variable_descriptor_or_privilege_of_the_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_NAME, SECRET)  # the daemon's environment only
    log = tmp_path / "salusd.log"
    caller = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    with salusd(tmp_path, devices=1) as (_, address):
        env = {**caller, "SALUS_ADDRESS": address}
        (tmp_path / "client.py").write_text(CLIENT)
        client = subprocess.Popen([sys.executable, str(tmp_path / "client.py")], env=env,
                                  text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = finish(client, timeout_s=120)
        assert client.returncode == 0, err
        _check(json.loads(out.splitlines()[-1]), log)

        (tmp_path / "script.py").write_text(SCRIPT)
        run = subprocess.run(
            [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
             address.removeprefix("unix://"), "--", sys.executable, "script.py"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        _check(json.loads(run.stdout.splitlines()[-1]), log)
    # What the jobs wrote reached the daemon's log, if at all, only as relayed executor output.
    assert _forged_lines(log) == []

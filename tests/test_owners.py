"""Owner isolation, as root: two users made for the test (removed after) in the socket's group.
A job of user A cannot read user B's executor (where B's state lives), the daemon's memory or
/etc/shadow (the OS's own PermissionError), and A cannot suspend or cancel B's job.

Each client process starts as root, imports what it needs and then becomes its user (groups,
gid, uid) before it connects: the daemon learns who a client is from SO_PEERCRED, which the
kernel takes at connect(), so it sees exactly that user. (The interpreter of this machine's
virtual environment lives under /root, mode 0700, which other users cannot execute.)"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_proc import finish
from daemon_proc import salusd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="creating users and dropping to them needs "
                       "root (CI runs as root)"),
    pytest.mark.skipif(shutil.which("useradd") is None, reason="needs useradd/groupadd"),
]

BECOME = textwrap.dedent("""
    import json, os, sys, torch
    from torch import nn
    import salus.adapters.torch as salus
    from salus.daemon.cli.control import Control
    from salus.daemon.wire.errors import NotOwner

    warm = nn.Linear(4, 2)  # torch imports more on first use: do it while the stdlib is readable
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    nn.MSELoss()(warm(torch.zeros(1, 4)), torch.zeros(1, 2)).backward()
    uid, gid, group = (int(v) for v in sys.argv[1:4])
    os.setgroups([gid, group])
    os.setgid(gid)
    os.setuid(uid)
    args = sys.argv[4:]
""")

OWNER_B = BECOME + textwrap.dedent("""

    with salus.connect(name="b-secret", iterations=5) as job:
        model = nn.Linear(4, 2)
        step = job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
        step(torch.randn(2, 4), torch.randn(2, 2))
        info = job.info()
        print(json.dumps({"job": job.id, "executor_pid": info["executor_pid"],
                          "owner": info["owner"]}), flush=True)
        sys.stdin.readline()
        step(torch.randn(2, 4), torch.randn(2, 2))  # still there, still B's
        print("B done", flush=True)
""")

OWNER_A = BECOME + textwrap.dedent("""
    b_job, b_pid, daemon_pid = args[0], int(args[1]), int(args[2])

    def probe(s, paths):
        out = {}
        for path in paths:
            try:
                with open(path, "rb") as f:
                    f.read(16)
                out[path] = "read"
            except OSError as exc:
                out[path] = type(exc).__name__
        out["uid"] = os.getuid()
        return out

    with salus.connect(name="a-curious", iterations=5) as job:
        remote = job.attach(model=nn.Linear(2, 2))
        seen = remote.call(probe, [f"/proc/{b_pid}/mem", f"/proc/{b_pid}/environ",
                                   f"/proc/{daemon_pid}/mem", "/etc/shadow"])
        steer = {}
        with Control() as ctl:
            for action in ("suspend", "cancel"):
                try:
                    getattr(ctl, action)(b_job)
                    steer[action] = "allowed"
                except Exception as exc:
                    steer[action] = type(exc).__name__
        print(json.dumps({"seen": seen, "steer": steer, "me": os.getuid()}), flush=True)
""")


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def two_users() -> Iterator[tuple[str, str, str]]:
    tag = uuid.uuid4().hex[:6]
    group, a, b = f"salust{tag}", f"salusa{tag}", f"salusb{tag}"
    _run("groupadd", group)
    try:
        _run("useradd", "-M", "-G", group, a)
        _run("useradd", "-M", "-G", group, b)
        yield group, a, b
    finally:
        for user in (a, b):
            subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def _as(user: str, group: str, script: Path, *args: str, address: str) -> subprocess.Popen[str]:
    entry = pwd.getpwnam(user)
    env = {"SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(script.parent)}
    ids = (str(entry.pw_uid), str(entry.pw_gid), str(grp.getgrnam(group).gr_gid))
    return subprocess.Popen([sys.executable, str(script), *ids, *args], env=env, text=True,
                            cwd=script.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_jobs_run_as_their_owner_and_cannot_reach_each_other(two_users: tuple[str, str, str]
                                                             ) -> None:
    group, user_a, user_b = two_users
    tmp = Path(tempfile.mkdtemp(prefix="salusd-owners-"))
    try:
        tmp.chmod(0o755)
        (tmp / "a.py").write_text(OWNER_A)
        (tmp / "b.py").write_text(OWNER_B)
        with salusd(tmp, "--group", group) as (proc, address):
            b = _as(user_b, group, tmp / "b.py", address=address)
            assert b.stdout is not None and b.stdin is not None
            line = b.stdout.readline()
            assert line, b.stderr.read() if b.stderr else ""
            b_info = json.loads(line)
            assert b_info["owner"] == user_b
            uid_b = pwd.getpwnam(user_b).pw_uid
            with open(f"/proc/{b_info['executor_pid']}/status") as f:
                uids = next(ln for ln in f if ln.startswith("Uid:")).split()[1:]
            assert {int(u) for u in uids} == {uid_b}  # B's job runs as B
            a = _as(user_a, group, tmp / "a.py", b_info["job"], str(b_info["executor_pid"]),
                    str(proc.pid), address=address)
            out, err = a.communicate(timeout=120)
            assert a.returncode == 0, err
            result = json.loads(out.strip().splitlines()[-1])
            seen = result["seen"]
            assert seen["uid"] == pwd.getpwnam(user_a).pw_uid
            for path, outcome in seen.items():
                if path != "uid":
                    assert outcome == "PermissionError", (path, outcome)
            assert result["steer"] == {"suspend": "NotOwner", "cancel": "NotOwner"}
            b.stdin.write("go\n")
            b.stdin.flush()
            out_b, err_b = finish(b, timeout_s=60)
            assert "B done" in out_b, err_b
            assert proc.poll() is None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""`status` over the unix socket lists the caller's own jobs; root (and the daemon's own user)
sees every job, as REST does for an owner's token and the admin token."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
from client_proc import finish
from daemon_proc import salusd

from salus.daemon.cli.control import Control
from salus.daemon.wire import control_ops as ops

pytestmark = pytest.mark.slow

# Becomes the user given (uid, gid, socket group), opens a job, prints the job names its
# `status` shows, holds the job open (a job ends with its client's connection) until told to go.
OPENER = textwrap.dedent("""
    import json, os, sys
    from salus.daemon.cli.control import Control
    from salus.daemon.wire import control_ops as ops

    uid, gid, group = (int(v) for v in sys.argv[3:6])
    os.setgroups([gid, group])
    os.setgid(gid)
    os.setuid(uid)
    with Control(sys.argv[1]) as ctl:
        ctl.call(ops.Open(sys.argv[2], 3))
        print(json.dumps(sorted(j["name"] for j in ctl.status()["jobs"])), flush=True)
        sys.stdin.readline()
""")


def _names(ctl: Control) -> list[str]:
    return sorted(j["name"] for j in ctl.status()["jobs"])


def test_the_daemons_own_user_sees_its_jobs(tmp_path: Path) -> None:
    with salusd(tmp_path, devices=1) as (_, address), Control(address) as ctl:
        ctl.call(ops.Open("mine", 3))
        assert _names(ctl) == ["mine"]


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's view needs a second user, which "
                    "only root can create (CI runs as root)")
@pytest.mark.skipif(shutil.which("useradd") is None, reason="needs useradd/groupadd")
def test_another_user_sees_only_its_own_jobs_and_root_sees_all() -> None:
    tag = uuid.uuid4().hex[:6]
    group, user = f"salust{tag}", f"saluss{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    tmp = Path(tempfile.mkdtemp(prefix="salusd-status-"))
    other: subprocess.Popen[str] | None = None
    try:
        subprocess.run(["useradd", "-M", "-G", group, user], check=True, capture_output=True)
        tmp.chmod(0o755)
        (tmp / "opener.py").write_text(OPENER)
        entry = pwd.getpwnam(user)
        with salusd(tmp, "--group", group, devices=1) as (_, address), \
                Control(address) as root:
            root.call(ops.Open("root-job", 3))
            other = subprocess.Popen(
                [sys.executable, str(tmp / "opener.py"), address, "their-job",
                 str(entry.pw_uid), str(entry.pw_gid), str(grp.getgrnam(group).gr_gid)],
                cwd=tmp, text=True,
                env={"PATH": "/usr/bin:/bin", "HOME": str(tmp)},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert other.stdout is not None
            seen = other.stdout.readline()
            assert seen.strip() == '["their-job"]', finish(other, timeout_s=30)
            assert _names(root) == ["root-job", "their-job"]
            out, err = finish(other, "go\n", timeout_s=30)
            assert other.returncode == 0, err
    finally:
        if other is not None and other.poll() is None:
            other.kill()
            other.wait()
        subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)

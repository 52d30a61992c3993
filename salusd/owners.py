"""Who an owner's processes run as, and what a script job's owner can reach.

A root daemon must not look at a caller's files with its own rights: `os.stat` as root answers
for directories the caller cannot search, so an error built from it tells the caller whether a
file exists where they may not look, and an interpreter that root finds but the caller cannot
run fails only later, in the middle of starting the job. So a script job's working directory and
interpreter are checked at submission by a shell (`/bin/sh`, which every user may run, unlike the
daemon's own interpreter: a job of that one runs in an executor forked from the daemon's, so its
caller needs no access to its file) running with the caller's uid, gid and groups: the kernel
applies its own permission rules (modes, ACLs, mounts) and the shell's `command -v` resolves the
interpreter on the job's `PATH` as the caller's shell would. A refused submission is a 4xx
naming the field, and no job is made. Where the daemon is not root it runs jobs only as itself,
and the shell runs as the daemon.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import subprocess
import sys
from typing import Any

from salus.daemon.engine.registry import Owner
from salus.daemon.engine.script_command import ScriptCommand
from salus.daemon.wire.errors import BadRequest

CHECK_TIMEOUT_S = 10.0
# $1: the working directory, $2: the interpreter as given, $3: "own" when it is the daemon's own
# (the job's executor runs it already, so the caller need not reach its file). One line out:
# "ok PATH" or "error WHY". A directory that is missing, not a directory, or behind one the
# caller cannot search reads alike, as it does to the caller.
_CHECK = r"""
[ -d "$1" ] || { echo "error 'cwd' $1 is not a directory the job's owner can reach"; exit 0; }
cd -- "$1" 2>/dev/null || { echo "error 'cwd' $1: the job's owner cannot enter it"; exit 0; }
[ "$3" = own ] && { echo "ok $2"; exit 0; }
case $2 in
    */*) found=$2 ;;
    *) found=$(command -v -- "$2") || found= ;;
esac
case $found in
    "") echo "error $2: command not found on the job's PATH ($PATH)"; exit 0 ;;
    /*) ;;
    *) found=$PWD/$found ;;
esac
if [ -f "$found" ] && [ -x "$found" ]; then echo "ok $found"
else echo "error $2: $found is not a file the job's owner can execute"; fi
"""


def identity(owner: Owner) -> dict[str, Any]:
    """Who an owner's executor runs as: the owner's uid, gid and groups when the daemon is root,
    else the daemon's own user (it accepts jobs only from itself and root)."""
    if os.geteuid() != 0:
        entry = pwd.getpwuid(os.getuid())
        return {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
                "user": entry.pw_name, "home": entry.pw_dir}
    try:
        entry = pwd.getpwuid(owner.uid)
    except KeyError:
        return {"uid": owner.uid, "gid": owner.gid, "groups": [owner.gid], "user": owner.name,
                "home": "/"}
    return {"uid": owner.uid, "gid": entry.pw_gid,
            "groups": os.getgrouplist(entry.pw_name, entry.pw_gid),
            "user": entry.pw_name, "home": entry.pw_dir}


def run_as(who: dict[str, Any]) -> dict[str, Any]:
    """`subprocess.Popen` arguments that start a process as `who` (`identity`): its uid, gid
    and groups when the daemon is root and `who` is not, else none."""
    if os.geteuid() == 0 and who["uid"] != 0:
        return {"user": who["uid"], "group": who["gid"], "extra_groups": who["groups"]}
    return {}


def as_caller(owner: Owner, command: ScriptCommand) -> ScriptCommand:
    """`command` with its interpreter as the absolute path its owner's shell finds, after
    checking as the owner that its `cwd` can be entered and the interpreter run; BadRequest
    says in one line what is wrong."""
    who = identity(owner)
    path = command.env.get("PATH", os.defpath)
    python = command.command[0]
    own = "own" if os.path.isabs(python) and os.path.abspath(python) == sys.executable else ""
    try:
        done = subprocess.run(["/bin/sh", "-c", _CHECK, "sh", command.cwd, python, own],
                              env={"PATH": path}, cwd="/", stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, errors="replace",
                              timeout=CHECK_TIMEOUT_S, **run_as(who))
    except subprocess.TimeoutExpired:
        raise BadRequest(f"'cwd' {command.cwd} and interpreter {command.command[0]} took over "
                         f"{CHECK_TIMEOUT_S:g} s to look up as the job's owner") from None
    verdict, _, rest = done.stdout.strip().partition(" ")
    if verdict == "ok" and os.path.isabs(rest):
        return dataclasses.replace(command, command=(rest, *command.command[1:]))
    if verdict == "error":
        raise BadRequest(rest[:1000])
    raise RuntimeError(f"the check of a script job's cwd and interpreter as uid {who['uid']} "
                       f"failed: {(done.stderr or done.stdout).strip()[:500]}")

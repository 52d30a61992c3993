"""A script job in the caller's interpreter, not the daemon's: the executor's fallback.

A user's packages live in the user's environment (a virtualenv, conda, `pip --user`), not in
the daemon's. The daemon gives a job whose interpreter is another environment an executor forked by
a warm zygote of that interpreter (`salusd/supervisor/zygotes.py`), where this module finds the
interpreter is its own. Where the daemon took it for its own environment but it is not (the
daemon judges from the files beside the interpreter; this module asks the interpreter itself),
this path runs it. When the command's interpreter (`python` as the caller's shell resolved it; on
REST, as the job's `PATH` resolves it) is another environment than the executor's own, the
executor, already the caller (uid, groups, directory), replaces itself with that interpreter
(`execve`, same process: its pid, process group, parent-death signal and the daemon's socket
stay) running `salus.daemon.executor.script_exec`, which goes on with the job there. That
interpreter must import the same salusd as the daemon; it is checked first, in a subprocess
that imports no torch, and a job whose interpreter cannot run it fails with what to install.

What this costs: the caller's interpreter starts and imports torch for each such job (about
a second), where a zygote forks a warm executor in milliseconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

from salus.daemon import installed_version

CHECK_TIMEOUT_S = 60.0
ENTRY = "salus.daemon.executor.script_exec"
_CHECK = """\
import importlib.util, json, sys
out = {"prefix": sys.prefix, "executable": sys.executable}
try:
    from importlib.metadata import version
    out["salusd"] = version("salusd")
    out["entry"] = importlib.util.find_spec("salus.daemon.executor.script_exec") is not None
    out["torch"] = importlib.util.find_spec("torch") is not None
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def resolve(interpreter: str, env: dict[str, str]) -> str:
    """The interpreter's absolute path, found as a shell would (the job's `PATH`); ValueError
    when there is none."""
    if os.path.abspath(interpreter) == sys.executable:
        return sys.executable  # this very interpreter (the owner may not see its path)
    found = shutil.which(interpreter, path=env.get("PATH", os.defpath))
    if found is None:
        raise ValueError(f"{interpreter}: command not found (PATH {env.get('PATH', '')!r})")
    return os.path.abspath(found)


def elsewhere(interpreter: str, env: dict[str, str]) -> bool:
    """Whether `interpreter` is another environment than this process's, after checking that
    it can run the job (ValueError says what to install where otherwise)."""
    if interpreter == sys.executable:
        return False
    try:
        done = subprocess.run([interpreter, "-c", _CHECK], env=env, capture_output=True,
                              text=True, timeout=CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
        found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        raise ValueError(f"{interpreter} does not run as a Python interpreter: {exc}") from None
    if found.get("prefix") == sys.prefix:
        return False
    want = installed_version()
    if "error" in found or not found.get("entry"):
        why = found.get("error", f"no {ENTRY}")
        raise ValueError(f"{interpreter} cannot import salusd ({why}): install it in that "
                         f"environment ({interpreter} -m pip install salusd=={want}), or run "
                         "the script with the daemon's interpreter")
    if found.get("salusd") != want:
        raise ValueError(f"{interpreter} has salusd {found.get('salusd')} and this salusd runs "
                         f"{want}: install the same version there ({interpreter} -m pip install "
                         f"salusd=={want})")
    if not found.get("torch"):
        raise ValueError(f"{interpreter} cannot import torch: install it in that environment")
    return True


def become(interpreter: str, state: dict[str, Any], inherit: list[int],
           env: dict[str, str]) -> None:
    """Replace this process with `interpreter` running the script executor's entry with
    `state`; the descriptors `inherit` stay open across the exec. Does not return."""
    for fd in inherit:
        os.set_inheritable(fd, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(interpreter, [interpreter, "-m", ENTRY, json.dumps(state)], env)

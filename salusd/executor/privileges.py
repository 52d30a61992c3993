"""An executor keeps no privilege: no capability, and no way to gain one.

salusd runs as root on a shared node (or with CAP_KILL and CAP_CHOWN in its container), and its
executors run job code. As an executor takes its owner's identity (`process.become`), it drops
what root could still hand down:

- the capability bounding set is emptied while the process may still do so (CAP_SETPCAP), so
  nothing it runs later can gain a capability from a file's capabilities;
- its own capabilities (effective, permitted, inheritable, ambient) are cleared: a job of a
  root owner runs as uid 0 but without the capabilities that would let it override file modes,
  signal other users' processes or change owners;
- `no_new_privs` is set, so setuid and setgid programs (sudo, su) run without their privilege:
  a job cannot become another user, whatever it executes.

Where the process has nothing to drop (salusd run by an ordinary user), the bounding set cannot
be changed (EPERM) and is left as it is; `no_new_privs` is set in every case. These are the
documented Linux interfaces (prctl(2), capset(2), capabilities(7)), called through libc because
the standard library has no binding for them.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAPABILITY_VERSION_3 = 0x20080522
_CAP_LAST_CAP_FILE = "/proc/sys/kernel/cap_last_cap"


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_privileges(take_identity: Callable[[], None]) -> None:
    """Empty the bounding set (where permitted), run `take_identity` (the switch to the
    owner's uid and groups, which needs root's capabilities), then clear every capability of
    this process and set `no_new_privs`; OSError when a step that must succeed fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(_last_cap() + 1):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            code = ctypes.get_errno()
            if code == errno.EPERM:  # no CAP_SETPCAP: nothing was ours to hand down
                break
            if code != errno.EINVAL:  # EINVAL: a capability this kernel does not know
                raise OSError(code, f"cannot drop capability {cap} from the bounding set")
    take_identity()
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before Linux 4.3
    none = (_Data * 2)()
    if libc.capset(ctypes.byref(_Header(_CAPABILITY_VERSION_3, 0)), none) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot clear the executor's capabilities: {os.strerror(code)}")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot set no_new_privs: {os.strerror(code)}")


def _last_cap() -> int:
    try:
        with open(_CAP_LAST_CAP_FILE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 63  # the bound of the two 32-bit words capset(2) takes

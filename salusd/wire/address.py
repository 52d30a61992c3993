"""Where salusd listens: `unix://` addresses, the default socket, and connecting to it.

Standard library only: the daemon, the executors and the adapter all import it.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

from salus.daemon.wire.errors import DaemonUnavailable

ADDRESS_ENV = "SALUS_ADDRESS"
_RETRY_ERRNOS = (errno.EAGAIN, errno.EINTR)


def connect_unix(path: str, timeout_s: float | None) -> socket.socket:
    """A socket connected to salusd at `path`; DaemonUnavailable with what to do when it cannot
    be reached. `timeout_s` seconds bound the whole attempt, and the socket keeps that timeout.

    A burst of clients can fill the daemon's listen backlog, which a unix socket answers with
    EAGAIN at once: that is retried with exponential backoff (1 ms doubling to 100 ms) until
    the time is up.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise DaemonUnavailable(f"no salusd listening at {path}: start it with `salusd "
                                    "serve` or set SALUS_ADDRESS") from None
        except PermissionError:
            sock.close()
            raise DaemonUnavailable(f"permission denied on {path}: your user must be in the "
                                    "socket's group (see `ls -l` of it)") from None
        except OSError as exc:
            sock.close()
            busy = exc.errno in _RETRY_ERRNOS
            if not busy or (deadline is not None and time.monotonic() + delay > deadline):
                raise DaemonUnavailable(f"cannot connect to salusd at {path}: {exc}") from None
        time.sleep(delay)
        delay = min(0.1, delay * 2)


def default_state_dir() -> Path:
    """salusd's default state directory: `$XDG_RUNTIME_DIR/salusd` when XDG_RUNTIME_DIR is set,
    else `~/.local/state/salusd`. The daemon's `--state-dir` default must be this, so that
    clients find its socket without configuration."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "salusd"
    return Path.home() / ".local" / "state" / "salusd"


def default_socket_path() -> str:
    """The socket clients connect to and the daemon listens on by default.

    `$SALUS_ADDRESS` (`unix:///absolute/path`) wins; else `default_state_dir()/salusd.sock`,
    i.e. `$XDG_RUNTIME_DIR/salusd/salusd.sock` or `~/.local/state/salusd/salusd.sock`.
    """
    address = os.environ.get(ADDRESS_ENV)
    if address:
        return parse_address(address)
    return str(default_state_dir() / "salusd.sock")


def parse_address(address: str) -> str:
    """The socket path of a `unix:///absolute/path` address; ValueError for anything else."""
    if not isinstance(address, str):
        raise TypeError(f"a salusd address is a string, got {type(address).__name__}")
    scheme, sep, path = address.partition("://")
    if not sep or scheme != "unix":
        raise ValueError(f"unsupported salusd address {address!r}: salusd listens on a unix "
                         "socket; write unix:///absolute/path/to/salusd.sock")
    if not path.startswith("/"):
        raise ValueError(f"salusd address {address!r} needs an absolute path after unix:// "
                         "(three slashes in all, e.g. unix:///run/salusd/salusd.sock)")
    return path


def format_address(path: str | os.PathLike[str]) -> str:
    """The `unix://` address of a socket path (made absolute)."""
    return "unix://" + os.path.abspath(os.fspath(path))


LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it).

    Written by hand rather than torch's elastic ``get_free_port``, which binds "localhost" and
    may check ::1 instead of the IPv4 address the process group connects to. The port is
    released before it is returned, so another program may take it first; callers pick one per
    group, right before starting it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def parse_listen(text: str) -> tuple[str, int] | None:
    """`127.0.0.1:7077` → (host, port); `none` → None. ValueError says what is wrong."""
    if text.strip().lower() == "none":
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--http wants HOST:PORT or 'none', got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)

"""The data plane's listener: a unix socket served by one thread per connection.

A thread per connection is deliberate: a node has few clients (one connection per job), each
connection is a strict request/reply sequence, and the heavy torch work runs on the executor's
lane workers, so a connection thread mostly blocks in recv or on a future. Blocking threads keep
the per-request path to one recvmsg, a dispatch and one sendmsg, with no event loop hop.

Clients are authenticated by the kernel: SO_PEERCRED gives the peer's uid, whose user name is
the `owner` passed to the JobService (the decimal uid when it has no name). Access control is the
socket file's mode (0660 by default) and group.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import pwd
import socket
import stat
import struct
import threading
from functools import lru_cache

from salus.daemon.ipc import compact
from salus.daemon.ipc.handlers import RequestHandler, error_reply
from salus.daemon.ipc.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_SHM_THRESHOLD,
    Channel,
    ConnectionClosed,
    FrameError,
    FrameTooLarge,
    format_address,
)
from salus.daemon.service import JobService

log = logging.getLogger("salus.daemon.ipc")
_UCRED = struct.Struct("3i")
_SUN_PATH_BYTES = 107


@lru_cache(maxsize=256)
def user_name(uid: int) -> str:
    """The user name of `uid`, or the uid in decimal when the system has no name for it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket (Linux SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


class SocketServer:
    """Serves a JobService on the unix socket at `path`.

    `mode` and `group` set the socket file's permissions (who may connect);
    `max_frame_bytes` bounds a request's inline part (bytes); tensors of at least
    `shm_threshold` bytes (in requests and replies) travel in shared memory.
    """

    def __init__(self, path: str, service: JobService, *, mode: int = 0o660,
                 group: str | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 shm_threshold: float = DEFAULT_SHM_THRESHOLD) -> None:
        path = os.path.abspath(path)
        if len(os.fsencode(path)) > _SUN_PATH_BYTES:
            raise ValueError(f"socket path {path!r} is longer than the {_SUN_PATH_BYTES} bytes a "
                             "unix socket allows; pick a shorter --socket path")
        if not 0 <= mode <= 0o777:
            raise ValueError(f"socket mode must be within 0o000..0o777, got {mode:#o}")
        if not isinstance(max_frame_bytes, int) or max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be an int of at least 1024, "
                             f"got {max_frame_bytes!r}")
        if not hasattr(socket, "SO_PEERCRED"):
            raise RuntimeError("the salusd data plane needs Linux (SO_PEERCRED peer credentials)")
        self._gid = _group_id(group) if group is not None else None
        self._path = path
        self._service = service
        self._mode = mode
        self._max_frame_bytes = max_frame_bytes
        self._shm_threshold = shm_threshold
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()

    @property
    def address(self) -> str:
        """The `unix://` address clients use (SALUS_ADDRESS)."""
        return format_address(self._path)

    @property
    def path(self) -> str:
        """The socket file's absolute path."""
        return self._path

    def start(self) -> None:
        """Bind, set mode and group, then listen and start accepting connections."""
        if self._listener is not None:
            raise RuntimeError("the socket server is already started")
        os.makedirs(os.path.dirname(self._path), mode=0o750, exist_ok=True)
        _remove_stale_socket(self._path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self._path)
            # Permissions are fixed before listen(): nobody can connect while they are wider.
            os.chmod(self._path, self._mode)
            if self._gid is not None:
                try:
                    os.chown(self._path, -1, self._gid)
                except PermissionError:
                    raise PermissionError(f"cannot give {self._path} to group id {self._gid}: "
                                          "the daemon's user must be a member of it") from None
            self._inode = os.stat(self._path).st_ino
            listener.listen(64)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._stopping.clear()
        self._accept_thread = threading.Thread(target=self._accept_loop, name="salusd-accept",
                                               daemon=True)
        self._accept_thread.start()
        log.info("data plane listening at %s (mode %#o)", self.address, self._mode)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, end every connection (their jobs are closed), remove the socket file.
        Waits up to `timeout_s` seconds for connection threads."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            threads = list(self._connections.values())
        if self._accept_thread is not None:
            self._accept_thread.join(timeout_s)
        for thread in threads:
            thread.join(timeout_s)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self._path).st_ino == self._inode:
                os.unlink(self._path)
        log.info("data plane at %s stopped", self.address)

    def connection_count(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._connections)

    def __enter__(self) -> SocketServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("accept failed on %s", self.address)
                self._stopping.wait(0.05)  # e.g. out of descriptors: do not spin
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name="salusd-conn")
            with self._lock:
                if self._stopping.is_set():
                    conn.close()
                    return
                self._connections[conn] = thread
                thread.start()

    def _serve(self, conn: socket.socket) -> None:
        pid, uid = -1, -1
        handler: RequestHandler | None = None
        channel = Channel(conn, max_frame_bytes=self._max_frame_bytes,
                          shm_threshold=self._shm_threshold)
        try:
            pid, uid, _ = peer_credentials(conn)
            handler = RequestHandler(self._service, user_name(uid), self._max_frame_bytes)
            log.debug("connection from %s (uid %d, pid %d)", handler.owner, uid, pid)
            self._serve_requests(channel, handler)
        except Exception:
            log.exception("connection from uid %d (pid %d) failed", uid, pid)
        finally:
            closed = handler.close_all() if handler is not None else []
            if handler is not None and closed:
                log.info("client pid %d of %s went away: closed its jobs %s", pid,
                         handler.owner, ", ".join(closed))
            with self._lock:
                self._connections.pop(conn, None)
                channel.close()

    def _serve_requests(self, channel: Channel, handler: RequestHandler) -> None:
        while True:
            try:
                request = channel.recv()
            except ConnectionClosed:
                return
            except FrameError as exc:
                log.warning("bad frame from %s: %s", handler.owner, exc)
                with contextlib.suppress(OSError):
                    channel.send(error_reply(exc.code, str(exc)))
                if not exc.recoverable:
                    return
                continue
            except OSError as exc:
                if exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.EBADF, errno.EINVAL):
                    log.warning("connection from %s broke: %s", handler.owner, exc)
                return
            reply = handler.handle(request)
            if handler.peer_max_frame_bytes is not None:
                channel.peer_max_frame_bytes = handler.peer_max_frame_bytes
            try:
                _send_reply(channel, reply)
            except OSError:
                return


def _send_reply(channel: Channel, reply: dict[str, object] | compact.Message) -> None:
    """Send `reply`, or an error reply when it cannot be encoded or is over the peer's limit."""
    try:
        channel.send(reply)
    except FrameTooLarge as exc:
        channel.send(error_reply(exc.code, f"the reply is too large: {exc}"))
    except TypeError as exc:
        log.exception("reply could not be encoded")
        channel.send(error_reply("error", f"internal error in salusd: the reply could not be "
                                          f"encoded ({exc})"))


def _group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"unknown group {group!r} for the socket: create it or pick an "
                         "existing one") from None


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a daemon that is gone; refuse to touch a live one or a file
    that is not a socket."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise FileExistsError(f"{path} exists and is not a socket: remove it or pick another "
                              "--socket path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"another salusd is already listening at {path}")

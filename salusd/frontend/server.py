"""The unix-socket front end: accept clients, authenticate them by the kernel, bound them, and
answer each connection's requests in the order they came.

Clients are authenticated by SO_PEERCRED (the peer's uid and gid); the socket file's mode
(0660) and group say who may connect at all. A daemon running as root serves every user who can
reach the socket, each job's code running as its owner; a daemon running as an ordinary user
accepts jobs only from that user and root, and tells anyone else so.

Bounds: at most `max_connections` clients (one more gets a clear refusal); a frame must arrive
whole within `frame_timeout_s` seconds of its first byte; all partly received frames together
hold at most `max_pending_bytes` (the connection that would pass it is dropped); at most
`max_outstanding` requests per connection wait for their replies.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import socket
import stat
import struct
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from salus.daemon.engine.core import error_frame
from salus.daemon.engine.registry import Owner
from salus.daemon.loop import Link, Loop
from salus.daemon.wire.address import format_address
from salus.daemon.wire.errors import Busy, SalusError
from salus.daemon.wire.frames import DEFAULT_MAX_FRAME_BYTES, RawFrame

if TYPE_CHECKING:
    from salus.daemon.frontend.handlers import Handlers

log = logging.getLogger("salusd.server")
_UCRED = struct.Struct("3i")
_SUN_PATH_BYTES = 107


@lru_cache(maxsize=1024)
def user_name(uid: int) -> str:
    """The user name of `uid`, or the uid in decimal when the system has no name for it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@dataclass(eq=False)
class Client:
    """One client connection: who it is, the jobs it opened, its replies in request order."""

    link: Link
    owner: Owner
    pid: int
    refused: str = ""
    allocation: str | None = None  # the Kubernetes allocation whose socket it came through
    jobs: set[int] = field(default_factory=set)
    slots: deque[list[RawFrame | None]] = field(default_factory=deque)
    sockets: list[RawFrame] = field(default_factory=list)  # the next `run`'s ranks 1, 2, ...
    here: RawFrame | None = None  # the next `run --here`'s executor link


class SocketServer:
    """Listens on the unix socket at `path` and hands requests to `handlers`."""

    def __init__(self, path: str, loop: Loop, handlers: Handlers, *, mode: int = 0o660,
                 group: str | None = None, max_connections: int = 1024,
                 frame_timeout_s: float = 30.0, max_outstanding: int = 80,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, backlog: int = 4096) -> None:
        path = os.path.abspath(path)
        if len(os.fsencode(path)) > _SUN_PATH_BYTES:
            raise ValueError(f"socket path {path!r} is longer than the {_SUN_PATH_BYTES} bytes a "
                             "unix socket allows; pick a shorter --socket path")
        self.path = path
        self.loop = loop
        self.handlers = handlers
        self.mode = mode
        self.gid = _group_id(group) if group is not None else None
        self.max_connections = max_connections
        self.frame_timeout_s = frame_timeout_s
        self.max_outstanding = max_outstanding
        self.max_frame_bytes = max_frame_bytes
        self.backlog = backlog
        self.clients: dict[int, Client] = {}
        self.refused_connections = 0
        self.requests = 0  # received, all connections together
        self._listener: socket.socket | None = None
        self._inode: int | None = None

    @property
    def address(self) -> str:
        return format_address(self.path)

    def start(self) -> None:
        """Bind (mode and group set before listen), listen, and watch the deadlines."""
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        _remove_stale_socket(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound and listening under a temporary name, then renamed: the socket file appears only
        # once a connect to it succeeds, so clients may take its existence as "salusd is up".
        building = os.path.join(os.path.dirname(self.path), f".salusd-{os.getpid()}.new")
        if len(os.fsencode(building)) > _SUN_PATH_BYTES:
            building = self.path  # no room for the other name: bound in place
        bound = False
        try:
            if building != self.path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(building)
            listener.bind(building)
            bound = True
            os.chmod(building, self.mode)
            if self.gid is not None:
                os.chown(building, -1, self.gid)
            self._inode = os.stat(building).st_ino
            listener.listen(self.backlog)
            if building != self.path:
                os.rename(building, self.path)
        except BaseException:
            listener.close()
            if bound:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(building)
            raise
        listener.setblocking(False)
        self._listener = listener
        self.loop.add_reader(listener, self._accept)
        self.loop.call_later(1.0, self._check_deadlines)
        log.info("listening at %s (mode %#o)", self.address, self.mode)

    def stop(self) -> None:
        """Stop accepting and remove the socket file (connections close with the loop)."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.loop.selector.unregister(listener)
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)

    # ---- connections ------------------------------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        link = Link(conn, self._frame, self._closed, self.max_frame_bytes, explain_errors=True)
        client = self.identify(conn, link)
        self.loop.add(link)
        if len(self.clients) >= self.max_connections:
            self.refused_connections += 1
            self.loop.send(link, error_frame(Busy(
                f"salusd serves at most {self.max_connections} connections and has that many; "
                "try again later or ask the operator to raise --max-connections")))
            link.close_after_flush = True
            return
        self.clients[id(link)] = client

    def identify(self, conn: socket.socket, link: Link) -> Client:
        """Who a new connection is: the peer's uid and gid from SO_PEERCRED (a server whose
        connections belong to something else, a pod's allocation, says so instead)."""
        pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      _UCRED.size))
        client = Client(link, Owner(user_name(uid), uid, gid), pid)
        euid = os.geteuid()
        if euid != 0 and uid not in (euid, 0):
            client.refused = (f"salusd runs as {user_name(euid)} and accepts jobs only from "
                              f"{user_name(euid)} and root, not {client.owner.name}; ask the "
                              "operator to run it as root (it then runs each job as its owner)")
        return client

    def _closed(self, link: Link, reason: str) -> None:
        client = self.clients.pop(id(link), None)
        if client is None:
            return
        if client.jobs:
            log.info("client pid %d of %s went away (%s): closing its jobs %s", client.pid,
                     client.owner.name, reason, sorted(client.jobs))
        self.handlers.client_gone(client, reason)

    def _frame(self, link: Link, frame: RawFrame) -> None:
        client = self.clients.get(id(link))
        if client is None:
            frame.close_fd()
            return
        self.requests += 1
        slot: list[RawFrame | None] = [None]
        client.slots.append(slot)

        def answer(reply: RawFrame) -> None:
            if slot[0] is not None:
                reply.close_fd()
                return
            slot[0] = reply
            self._flush(client)

        if len(client.slots) > self.max_outstanding:
            frame.close_fd()
            answer(error_frame(Busy(f"more than {self.max_outstanding} requests wait for "
                                    "replies on this connection")))
            return
        try:
            self.handlers.handle(client, frame, answer)
        except SalusError as exc:
            frame.close_fd()
            answer(error_frame(exc))
        except Exception as exc:
            frame.close_fd()
            log.exception("request from %s failed inside salusd", client.owner.name)
            answer(error_frame(SalusError(f"internal error in salusd ({type(exc).__name__}: "
                                          f"{exc}); the daemon log has the traceback")))

    def _flush(self, client: Client) -> None:
        while client.slots and client.slots[0][0] is not None:
            reply = client.slots.popleft()[0]
            assert reply is not None
            self.loop.send(client.link, reply)

    def _check_deadlines(self) -> None:
        now = self.loop.clock()
        for client in list(self.clients.values()):
            started = client.link.reader.started_at
            if started is not None and now - started > self.frame_timeout_s:
                log.warning("dropping %s (pid %d): a frame did not arrive whole within %.0f s",
                            client.owner.name, client.pid, self.frame_timeout_s)
                self.loop.close(client.link, "frame deadline passed")
        if self._listener is not None:
            self.loop.call_later(1.0, self._check_deadlines)


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

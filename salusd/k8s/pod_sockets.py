"""salusd's socket in every live allocation's directory: how a pod reaches the daemon.

The device plugin mounts an allocation's directory at /run/salusd in the pod and points
`SALUS_ADDRESS` at `salusd.sock` there. `PodSockets` listens on that socket from the moment
the allocation is made (or restored from the table at start) until it is freed, with the main
socket's framing, bounds and handlers. A connection there belongs to the allocation, whoever
the peer says it is: its jobs run as the configured unprivileged pod user (never root, never
salusd's own user), are shown as `pod:<namespace>/<name>` once the kubelet names the pod
(`alloc:<id>` before), are admitted only within the allocation's units
(`engine/pod_grants.py`), and are cancelled, with the reason, when the allocation is freed.

The plugin calls `opened`, `named` and `freed` from its own threads; the work is done on the
daemon's loop thread (`Loop.call_soon_threadsafe`), where the sockets and the engine live.
"""

from __future__ import annotations

import logging
import os
import pwd
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from salus.daemon.engine.pod_grants import PodGrant
from salus.daemon.engine.registry import Owner
from salus.daemon.frontend.server import Client, SocketServer
from salus.daemon.k8s.allocations import Allocation
from salus.daemon.loop import Link, Loop
from salus.daemon.wire.frames import RawFrame

if TYPE_CHECKING:
    from salus.daemon.engine.engine import Engine
    from salus.daemon.frontend.handlers import Handlers

log = logging.getLogger("salusd.k8s")
SOCKET_NAME = "salusd.sock"  # as `grants.CONTAINER_SOCKET` names it inside the pod
_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PodUser:
    """The unprivileged user a pod's jobs run as: its name, uid and gid."""

    name: str
    uid: int
    gid: int


def resolve_pod_user(name: str) -> PodUser:
    """`name`'s uid and gid; ValueError when the system has no such user or it is root (a
    pod's job would then run as root on the node)."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"--pod-user {name!r}: no such user on this node; pods' jobs run as "
                         "it (default 'nobody'): create it or name another") from None
    if entry.pw_uid == 0:
        raise ValueError(f"--pod-user {name!r} is uid 0: pods' jobs would run as root on the "
                         "node; name an unprivileged user (default 'nobody')")
    return PodUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


class AllocationSocketServer(SocketServer):
    """The main socket's server, but every connection belongs to one allocation: its owner is
    the pod user with the allocation's id (SO_PEERCRED gives the peer's pid, for the log only).
    """

    def __init__(self, path: str, loop: Loop, handlers: Handlers, allocation: str,
                 owner: Callable[[], Owner], **options: Any) -> None:
        super().__init__(path, loop, handlers, mode=0o666, **options)
        self.allocation = allocation
        self.owner = owner

    def identify(self, conn: socket.socket, link: Link) -> Client:
        pid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            _UCRED.size))[0]
        client = Client(link, self.owner(), pid, allocation=self.allocation)
        if os.geteuid() != 0:  # it would run the pod's code as salusd's own user
            client.refused = ("salusd does not run as root, so it cannot run a pod's jobs "
                              "as the pod user: ask the operator to run it as root")
        return client

    def _frame(self, link: Link, frame: RawFrame) -> None:
        client = self.clients.get(id(link))
        if client is not None:  # the pod may have been named since the connection was made
            client.owner = self.owner()
        super()._frame(link, frame)


class PodSockets:
    """One `AllocationSocketServer` per live allocation. `devices`: GPU uuid -> the daemon's
    device index (an allocation of another GPU is mapped to `default_device`)."""

    def __init__(self, loop: Loop, handlers: Handlers, engine: Engine, user: PodUser,
                 devices: Mapping[str, int], *, default_device: int = 0,
                 **server_options: Any) -> None:
        self.loop = loop
        self.handlers = handlers
        self.engine = engine
        self.user = user
        self.devices = dict(devices)
        self.default_device = default_device
        self.server_options = server_options
        self.servers: dict[str, AllocationSocketServer] = {}

    # -- called from the plugin's threads
    def opened(self, allocation: Allocation) -> None:
        self.loop.call_soon_threadsafe(lambda: self._open(allocation))

    def named(self, allocation_id: str, pod: str) -> None:
        self.loop.call_soon_threadsafe(lambda: self._name(allocation_id, pod))

    def freed(self, allocation: Allocation, why: str) -> None:
        self.loop.call_soon_threadsafe(lambda: self._close(allocation.id, why))

    # -- on the loop thread
    def _owner(self, allocation_id: str) -> Owner:
        grant = self.engine.core.pod_grants.get(allocation_id)
        name = grant.owner_name if grant is not None else f"alloc:{allocation_id}"
        return Owner(name, self.user.uid, self.user.gid, allocation_id)

    def _name(self, allocation_id: str, pod: str) -> None:
        """The kubelet named the allocation's pod: its jobs show it from now on."""
        core = self.engine.core
        core.pod_grants.name_pod(allocation_id, pod)
        for record in core.registry.live.values():
            if record.owner.allocation == allocation_id:
                core.event("pod", record.job_id, allocation=allocation_id, pod=pod)

    def _open(self, allocation: Allocation) -> None:
        if allocation.id in self.servers:
            return
        device = self.devices.get(allocation.uuid, self.default_device)
        self.engine.core.pod_grants.set(PodGrant(allocation.id, allocation.units, device,
                                                 allocation.pod))
        path = str(Path(allocation.directory) / SOCKET_NAME)
        server = AllocationSocketServer(path, self.loop, self.handlers, allocation.id,
                                        lambda: self._owner(allocation.id),
                                        **self.server_options)
        try:
            server.start()
        except (OSError, ValueError, RuntimeError) as exc:
            log.error("allocation %s: cannot listen at %s (%s); its pod cannot reach salusd",
                      allocation.id, path, exc)
            return
        self.servers[allocation.id] = server
        log.info("allocation %s (%d GiB, device %d): listening at %s", allocation.id,
                 allocation.units, device, path)

    def _close(self, allocation_id: str, why: str) -> None:
        """Stop listening, cancel the allocation's live jobs with the reason, and drop its
        connections."""
        self.engine.core.pod_grants.drop(allocation_id)
        server = self.servers.pop(allocation_id, None)
        for record in list(self.engine.core.registry.live.values()):
            if record.owner.allocation == allocation_id:
                self.engine.cancel(record, f"job {record.job_id} was cancelled: its pod's "
                                           f"allocation {allocation_id} was freed ({why})")
        if server is None:
            return
        server.stop()
        for client in list(server.clients.values()):
            self.loop.close(client.link, f"the pod's allocation {allocation_id} was freed")
        log.info("allocation %s: socket closed (%s)", allocation_id, why)

    def stop(self) -> None:
        """Stop listening on every allocation's socket (salusd stops; jobs stay to be
        restored, as the main socket's)."""
        for server in self.servers.values():
            server.stop()
        self.servers.clear()

"""The device plugin's allocations: which units of which GPU each `Allocate` granted, the
directory made for it and, once the kubelet's PodResources API names it, its pod.

Kept as JSON in the state dir (`k8s-allocations.json`, written whole and renamed into place),
so a restarted salusd still knows what it granted: the kubelet does not call `Allocate` again
for a running container.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

log = logging.getLogger("salusd.k8s")

FILE_NAME = "k8s-allocations.json"


@dataclass(frozen=True)
class Allocation:
    """One container's grant: `units` GiB of GPU `uuid` (its unit IDs in `device_ids`), the
    host directory mounted at /run/salusd in it, when it was made (seconds since the epoch),
    and its pod ("namespace/name") and container once PodResources names them."""

    id: str
    uuid: str
    device_ids: tuple[str, ...]
    directory: str
    created: float
    pod: str | None = None
    container: str | None = None

    @property
    def units(self) -> int:
        return len(self.device_ids)


class AllocationTable:
    """Allocations by id, safe across threads (gRPC's and the plugin's), each change written
    to `path` (None: kept in memory only)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._rows: dict[str, Allocation] = {}
        if path is not None and path.exists():
            self._rows = {a.id: a for a in _read(path)}

    def all(self) -> list[Allocation]:
        with self._lock:
            return sorted(self._rows.values(), key=lambda a: (a.created, a.id))

    def add(self, allocations: Sequence[Allocation]) -> list[Allocation]:
        """Record `allocations`, all or none (OSError: none, the file could not be written);
        the allocations they take units from are dropped and returned (the kubelet hands a
        unit out again only once its last holder is gone)."""
        with self._lock:
            before = dict(self._rows)
            mine = {d for a in allocations for d in a.device_ids}
            superseded = [a for a in self._rows.values() if mine & set(a.device_ids)]
            for old in superseded:
                del self._rows[old.id]
            self._rows.update((a.id, a) for a in allocations)
            try:
                self._save()
            except OSError:
                self._rows = before
                raise
        return superseded

    def name_pod(self, allocation_id: str, pod: str, container: str) -> None:
        with self._lock:
            row = self._rows.get(allocation_id)
            if row is not None and (row.pod, row.container) != (pod, container):
                self._rows[allocation_id] = replace(row, pod=pod, container=container)
                self._save()

    def remove(self, allocation_id: str) -> Allocation | None:
        with self._lock:
            row = self._rows.pop(allocation_id, None)
            if row is not None:
                self._save()
        return row

    def _save(self) -> None:
        if self.path is None:
            return
        rows = [asdict(a) for a in sorted(self._rows.values(), key=lambda a: a.id)]
        tmp = self.path.with_suffix(".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"version": 1, "allocations": rows}, f, indent=1)
        os.replace(tmp, self.path)


def _read(path: Path) -> list[Allocation]:
    """The allocations recorded in `path`; an unreadable file is logged and set aside
    (renamed `.bad`) rather than stopping salusd. Running pods keep what the kubelet gave them,
    but salusd no longer knows those grants, and their directories stay until removed."""
    try:
        rows = json.loads(path.read_text())["allocations"]
        return [Allocation(str(r["id"]), str(r["uuid"]), tuple(map(str, r["device_ids"])),
                           str(r["directory"]), float(r["created"]), r.get("pod"),
                           r.get("container")) for r in rows]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        bad = path.with_suffix(".bad")
        log.error("the device plugin's allocations in %s are unreadable (%s); moved to %s and "
                  "starting with none", path, exc, bad)
        os.replace(path, bad)
        return []

"""What the REST handlers reach: the engine (through the bridge), the registry and the paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from salus.daemon.engine.registry import JobRecord
from salus.daemon.rest.auth import Principal
from salus.daemon.rest.bridge import EngineBridge
from salus.daemon.wire.errors import NotOwner, UnknownJob

if TYPE_CHECKING:
    from salus.daemon.engine.engine import Engine
    from salus.daemon.metrics import Metrics
    from salus.daemon.state.store import Store


@dataclass
class Context:
    engine: Engine
    bridge: EngineBridge
    store: Store
    metrics: Metrics
    job_root: str
    checkpoint_timeout_s: float = 300.0
    # Jobs this start found unrestorable and recorded failed (the engine never held them): the
    # job list shows them beside the engine's, so `salusd status` says why they are gone.
    not_restored: list[int] = field(default_factory=list)

    def find(self, job_id: int, who: Principal) -> JobRecord:
        """The job, if `who` may act on it (on the engine's thread)."""
        registry = self.engine.registry
        record = registry.live.get(job_id) or registry.ended.get(job_id)
        if record is None:
            raise UnknownJob(f"no live or recent job {job_id}")
        check_owner(job_id, record.owner.uid, record.owner.name, who)
        return record


def check_owner(job_id: int, uid: int, name: str, who: Principal) -> None:
    if not who.admin and uid != who.owner.uid:
        raise NotOwner(f"job {job_id} belongs to {name}; this token is {who.owner.name}'s")


def context(request: Request) -> Context:
    ctx: Context = request.app.state.ctx
    return ctx

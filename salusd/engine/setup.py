"""A job's executors acquired and given its state: a client's objects (`attach`), a batch job's
entrypoint (`load`) or a restored job's checkpoint (`restore`)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from salus.daemon.cluster import ClusterSpec
from salus.daemon.engine.checkpoints import replica_dir
from salus.daemon.engine.core import Core
from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.engine.pipeline_spec import check_pipeline
from salus.daemon.engine.registry import Answer, JobRecord, Owner
from salus.daemon.engine.rendezvous import check_nodes, gang_places
from salus.daemon.state.checkpoint_files import gang_iteration
from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.executor_ops import (
    Attach,
    CachePlace,
    GangPlace,
    Load,
    Request,
    Restore,
)
from salus.daemon.wire.frames import RawFrame
from salus.scheduler import Policy


def batch_spec(path: str, function: str, name: str, devices: int, nodes: int,
               rendezvous: str | None, pipeline: dict[str, Any] | None,
               cluster: ClusterSpec | None, policy: Policy) -> JobSpec:
    """What a batch job is submitted with; BadRequest for what this node cannot run."""
    spec = JobSpec(devices=devices, path=path, function=function,
                   **check_nodes(nodes, rendezvous, name, cluster))
    spec = replace(spec, pipeline=check_pipeline(pipeline, devices, spec.nodes))
    if spec.nodes > 1 and policy.lane_mode != "pack":
        raise BadRequest(f"a multi-node gang needs lanes of its own, which only the pack "
                         f"policy gives (the policy is {policy.name})")
    return spec


def load(core: Core, record: JobRecord, restore: bool,
         attach: tuple[RawFrame, Answer] | None = None) -> None:
    """Acquire the job's executors (one per replica) and send each its state: the client's
    `attach` frame (every replica loads the same bytes, after joining its gang's group), or a
    batch job's entrypoint, or a restored job's checkpoint."""
    core.outbox.acquire(record, record.gang)
    places = gang_places(record.spec, record.gang, record.owner.name, core.config.cluster)
    gangs: list[GangPlace | None] = list(places) if places else [None]
    if attach is not None:
        frame, answer = attach
        core.outbox.send_all(record, [Attach(p) for p in gangs], answer=answer, frame=frame)
        return
    at = (gang_iteration(Path(record.checkpoint.dir), record.gang)
          if restore and record.gang > 1 and record.checkpoint.dir is not None else None)
    msgs: list[Request]
    if record.kind == "batch":
        spec = record.spec
        assert spec.path is not None and spec.function is not None, "a batch job's entrypoint"
        cache = _cache_for(core, record.owner)
        msgs = [Load(spec.path, spec.function, restore, spec.pipeline, cache,
                     replica_dir(record, r), gangs[r], at) for r in range(record.gang)]
    else:
        msgs = [Restore(replica_dir(record, r), gangs[r], at) for r in range(record.gang)]
    core.outbox.send_all(record, msgs)


def _cache_for(core: Core, owner: Owner) -> CachePlace | None:
    """Where `owner`'s jobs keep their data cache, and its cap per replica."""
    policy = core.config.data_cache
    if policy is None:
        return None
    # A pod's owner name (`pod:namespace/name`) holds a slash: its cache is its allocation's.
    folder = owner.name if owner.allocation is None else f"alloc-{owner.allocation}"
    path = os.path.join(policy.root, folder)
    policy.make_dir(path, owner)
    return CachePlace(path, policy.bytes_per_replica)

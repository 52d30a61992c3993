"""Engine records and registry rows as REST models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.engine.registry import JobRecord, is_script
from salus.daemon.engine.report import job_info
from salus.daemon.rest.models import Checkpoint, JobOut
from salus.daemon.state.store import JobRow

if TYPE_CHECKING:
    from salus.daemon.engine.engine import Engine


def job_out(engine: Engine, record: JobRecord) -> JobOut:
    """A live or recently ended job (on the engine's thread)."""
    info = job_info(engine, record)
    memory = info["memory"]
    state = str(info["state"])
    ephemeral = memory["ephemeral_measured_bytes"]
    checkpoint = None
    if record.checkpoint.iteration is not None and record.checkpoint.time is not None:
        checkpoint = Checkpoint(iteration=record.checkpoint.iteration,
                                time=record.checkpoint.time, bytes=record.checkpoint.bytes)
    progress = record.progress
    evaluation = progress.last_evaluation
    return JobOut(
        id=record.job_id, name=record.name, owner=record.owner.name,
        allocation=info["allocation"], pod=info["pod"],
        kind="script" if is_script(record) else record.kind,
        state=state, reason=record.life.reason, exit_status=record.exit_status,
        signal=record.signal, limit=record.limit, ended_at=record.life.ended_at,
        iterations_done=max(int(info["iterations_done"]), progress.done_before),
        iterations_total=record.planned_iterations, device=info["device"], lane=info["lane"],
        devices=record.gang, nodes=record.nodes, priority=record.priority,
        persistent_bytes=record.persistent_bytes,
        ephemeral_bytes=ephemeral if ephemeral is not None else memory[
            "ephemeral_estimate_bytes"],
        lane_bytes=memory["lane_bytes"], mem_bytes=memory["requested_bytes"],
        after=info["after"], waiting_for=info["waiting_for"], checkpoint=checkpoint,
        resumed_from=progress.resumed_from, swapped=bool(memory["swapped_out"]),
        script=info["script"], last_loss=progress.last_loss, cache=progress.cache,
        comm=progress.comm, executor=info["executor"], **_submitted(record.spec),
        last_evaluation=evaluation if isinstance(evaluation, float | str) else None)


def row_out(row: JobRow) -> JobOut:
    """A job known only to the durable registry (ended before the last restart)."""
    checkpoint = None
    if row.checkpoint_iteration is not None and row.checkpoint_time is not None:
        checkpoint = Checkpoint(iteration=row.checkpoint_iteration, time=row.checkpoint_time,
                                bytes=row.checkpoint_bytes or 0, path=row.checkpoint_path)
    try:
        spec = JobSpec.from_json(row.spec)
    except ValueError:  # a damaged registry row (its restart failed it, saying why): no spec
        spec = JobSpec()
    return JobOut(
        id=row.id, name=row.name, owner=row.owner,
        kind="batch" if row.kind == "batch" else "script" if spec.is_script
        else "interactive", state=row.state,
        reason=row.reason, exit_status=row.exit_status, signal=row.exit_signal,
        limit=_limit(row.end_limit), ended_at=row.ended_at, iterations_done=row.iterations_done,
        iterations_total=row.iterations_total or 0, device=None, lane=None,
        devices=spec.devices, nodes=spec.nodes,
        priority=float(row.priority), persistent_bytes=0, ephemeral_bytes=None,
        lane_bytes=None, checkpoint=checkpoint, resumed_from=None,
        script=({"restart": spec.restart, "restarts": row.restarts,
                 "max_restarts": spec.max_restarts} if spec.is_script else None),
        **_submitted(spec))


def _submitted(spec: JobSpec) -> dict[str, Any]:
    """What a job's view shows of its spec: a batch job's entrypoint and pipeline split, a
    script job's command."""
    pipeline = spec.pipeline
    return {"entrypoint": spec.entrypoint,
            "command": list(spec.command) if spec.is_script else None,
            "pipeline": None if pipeline is None else {
                "placement": pipeline.placement, "microbatches": pipeline.microbatches}}


def _limit(text: str | None) -> Literal["time", "memory"] | None:
    """A stored end limit as the model's type (the store accepts no other value)."""
    if text == "time":
        return "time"
    return "memory" if text == "memory" else None

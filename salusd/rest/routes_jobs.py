"""`/v1/jobs`: list, inspect, submit batch jobs, suspend, resume, cancel, priority, checkpoint,
and a job's output."""

from __future__ import annotations

import asyncio
import os
import pwd
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Path, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse

from salus.daemon.engine import script_command
from salus.daemon.engine.registry import JobRecord
from salus.daemon.limits import MAX_ITERATIONS
from salus.daemon.owners import as_caller
from salus.daemon.rest.auth import Principal, principal
from salus.daemon.rest.context import Context, check_owner, context
from salus.daemon.rest.models import (
    ERRORS,
    Checkpoint,
    CheckpointDone,
    JobOut,
    JobSubmit,
    Priority,
    Suspend,
)
from salus.daemon.rest.views import job_out, row_out
from salus.daemon.state.job_output import output_path, read_output, writer_uid
from salus.daemon.state.store import JobRow
from salus.daemon.wire.control_ops import Run
from salus.daemon.wire.errors import BadRequest, Conflict, UnknownJob
from salus.daemon.wire.executor_ops import Checkpointed, failure

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERRORS)
JobId = Path(ge=1, le=2**63 - 1, description="the job id")


@router.get("", response_model=list[JobOut], summary="Live and ended jobs")
async def list_jobs(ended_since: float | None = Query(
                        None, ge=0, allow_inf_nan=False, description="with it: the live jobs "
                        "and every job that ended at this time (unix seconds) or later, those "
                        "that ended before salusd's last restart too (the durable registry "
                        "keeps them); 0: every job. Without it: the live jobs and those that "
                        "ended in the last hour"),
                    who: Principal = Depends(principal),
                    ctx: Context = Depends(context)) -> list[JobOut]:
    def read() -> tuple[list[JobOut], set[int]]:
        engine = ctx.engine
        records = [*engine.registry.live.values(), *engine.registry.ended.values()]
        return [job_out(engine, r) for r in records
                if (who.admin or r.owner.uid == who.owner.uid) and _ended_since(r, ended_since)
                ], {r.job_id for r in records}
    jobs, held = await ctx.bridge.run(read)  # the engine's view of a job it holds stands

    def stored() -> list[JobRow]:
        if ended_since is None:
            return [row for job_id in ctx.not_restored
                    if (row := ctx.store.get_job(job_id)) is not None]
        return ctx.store.ended_since(ended_since)
    rows = [row for row in await run_in_threadpool(stored)
            if row.id not in held and (who.admin or row.uid == who.owner.uid)]
    return sorted([*jobs, *map(row_out, rows)], key=lambda j: j.id)


@router.get("/{job_id}", response_model=JobOut, summary="One job")
async def get_job(job_id: int = JobId, who: Principal = Depends(principal),
                  ctx: Context = Depends(context)) -> JobOut:
    try:
        return await ctx.bridge.run(lambda: job_out(ctx.engine, ctx.find(job_id, who)))
    except UnknownJob:
        row = await run_in_threadpool(ctx.store.get_job, job_id)
        if row is None:
            raise
        check_owner(job_id, row.uid, row.owner, who)
        return row_out(row)


@router.get("/{job_id}/log", response_class=PlainTextResponse,
            summary="What a job printed (its stdout and stderr)")
async def get_log(job_id: int = JobId,
                  offset: int | None = Query(None, ge=0, description="byte offset in the job's "
                                             "output file (default: its last 64 KiB)"),
                  who: Principal = Depends(principal),
                  ctx: Context = Depends(context)) -> PlainTextResponse:
    """At most 64 KiB of the job's output file from `offset`; the offset to ask from next is
    in the header `X-Salus-Next-Offset` (an offset past the end of a rotated file starts
    again at 0)."""
    policy = ctx.engine.core.config.checkpoints

    def where() -> tuple[str | None, int]:
        record = ctx.find(job_id, who)
        return record.checkpoint.dir, record.owner.uid
    try:
        folder, uid = await ctx.bridge.run(where)
    except UnknownJob:
        row = await run_in_threadpool(ctx.store.get_job, job_id)
        if row is None or policy is None:
            raise
        check_owner(job_id, row.uid, row.owner, who)
        folder, uid = os.path.join(policy.root, str(job_id)), row.uid
    if folder is None:
        raise Conflict(f"job {job_id} has no output file: salusd keeps them in its state dir, "
                       "and runs without one")
    try:
        data, next_offset = await run_in_threadpool(read_output, output_path(folder), offset,
                                                    writer_uid(uid))
    except PermissionError as exc:
        raise Conflict(str(exc)) from None
    return PlainTextResponse(data.decode("utf-8", "replace"),
                             headers={"X-Salus-Next-Offset": str(next_offset)})


@router.post("", response_model=JobOut, status_code=201,
             summary="Submit a batch job or a script job")
async def submit(body: JobSubmit, who: Principal = Depends(principal),
                 ctx: Context = Depends(context)) -> JobOut:
    """A script job (`command`): an executor running as the token's owner runs the command
    unchanged in `cwd` (what `salusd run` does), its optimizer steps the iteration boundaries
    and its output the job's log (`GET /v1/jobs/{id}/log`). A torchrun command (`["python",
    "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"]`) runs its ranks as a
    gang, one per device, each rank's output in its own log.

    A batch job (`entrypoint`): the daemon imports `entrypoint` (a file under its
    `--job-root`) in an executor running as the token's owner and drives the loop itself for
    `iterations` iterations; with `devices` > 1 it runs as a gang of that many replicas, one
    per device (data-parallel); with `nodes` > 1 the gang spans that many nodes of the
    cluster (submitted to each)."""
    if body.command is not None:
        # The socket's `run` request, so one check serves both (`script_command.from_run`).
        request = Run(tuple(body.command), body.cwd or "", _script_env(who, body.env),
                      restart=body.restart, max_restarts=body.max_restarts,
                      time_limit_s=body.time_limit_s, signal=body.signal,
                      signal_before_s=body.signal_before_s, grace_s=body.grace_s,
                      mem_bytes=body.mem_bytes)
        command = await run_in_threadpool(as_caller, who.owner, script_command.from_run(request))

        # A torchrun command runs its ranks as a gang, one per device (`devices`: as many).
        devices = body.devices if "devices" in body.model_fields_set else None

        def run() -> JobOut:
            record = ctx.engine.run_script(who.owner, body.name,
                                           body.iterations or MAX_ITERATIONS, command, None,
                                           priority=body.priority, devices=devices,
                                           after=body.after)
            return job_out(ctx.engine, record)
        return await ctx.bridge.run(run)
    assert body.entrypoint is not None and body.iterations is not None
    path, function = resolve_entrypoint(ctx.job_root, body.entrypoint)

    def start() -> JobOut:
        record = ctx.engine.submit_batch(who.owner, body.name, body.iterations, path,
                                         function, body.priority, devices=body.devices,
                                         nodes=body.nodes, rendezvous=body.rendezvous,
                                         pipeline=body.pipeline_options())
        return job_out(ctx.engine, record)
    return await ctx.bridge.run(start)


def _ended_since(record: JobRecord, since: float | None) -> bool:
    """Whether a list asking for jobs ended at `since` or later shows `record` (a live one:
    yes; None: every job)."""
    ended = record.life.ended_at
    return since is None or ended is None or ended >= since


def _script_env(who: Principal, env: dict[str, str] | None) -> dict[str, str]:
    """A REST script job's environment: the owner's name and home and the daemon's `PATH` (a
    submitter's shell has one, a REST body often none), then what the request gives."""
    try:
        entry = pwd.getpwuid(who.owner.uid)
        home = entry.pw_dir
    except KeyError:
        home = "/"
    name = who.owner.name
    return {"HOME": home, "USER": name, "LOGNAME": name,
            "PATH": os.environ.get("PATH", os.defpath), **(env or {})}


def resolve_entrypoint(job_root: str, entrypoint: str) -> tuple[str, str]:
    """`file.py:function` → (the file's real path under `job_root`, the function's name)."""
    file, function = entrypoint.rsplit(":", 1)
    root = os.path.realpath(job_root)
    path = os.path.realpath(os.path.join(root, file))
    if os.path.commonpath([root, path]) != root:
        raise BadRequest(f"the entrypoint must be a file under the job root {root}")
    if not os.path.isfile(path):
        raise BadRequest(f"there is no file {file} under the job root {root}")
    return path, function


async def _act(ctx: Context, job_id: int, who: Principal,
               fn: Callable[[Any], None]) -> JobOut:
    def act() -> JobOut:
        record = ctx.find(job_id, who)
        fn(record)
        return job_out(ctx.engine, record)
    return await ctx.bridge.run(act)


@router.post("/{job_id}/suspend", response_model=JobOut, summary="Stop scheduling a job")
async def suspend(body: Suspend | None = None, job_id: int = JobId,
                  who: Principal = Depends(principal), ctx: Context = Depends(context)) -> JobOut:
    """At its next iteration boundary; with `swap`, its memory is given back too. A
    checkpoint is written when salusd keeps them."""
    swap = body.swap if body else False
    return await _act(ctx, job_id, who, lambda r: ctx.engine.suspend(r, swap))


@router.post("/{job_id}/resume", response_model=JobOut, summary="Schedule a job again")
async def resume(job_id: int = JobId, who: Principal = Depends(principal),
                 ctx: Context = Depends(context)) -> JobOut:
    return await _act(ctx, job_id, who, ctx.engine.resume)


@router.delete("/{job_id}", response_model=JobOut, summary="Cancel a job")
async def cancel(job_id: int = JobId, who: Principal = Depends(principal),
                 ctx: Context = Depends(context)) -> JobOut:
    return await _act(ctx, job_id, who, ctx.engine.cancel)


@router.put("/{job_id}/priority", response_model=JobOut, summary="Set a job's weight (fair)")
async def set_priority(body: Priority, job_id: int = JobId,
                       who: Principal = Depends(principal),
                       ctx: Context = Depends(context)) -> JobOut:
    return await _act(ctx, job_id, who, lambda r: ctx.engine.set_priority(r, body.priority))


@router.post("/{job_id}/checkpoint", response_model=CheckpointDone,
             summary="Write a job's checkpoint now")
async def checkpoint(job_id: int = JobId, who: Principal = Depends(principal),
                     ctx: Context = Depends(context)) -> CheckpointDone:
    """Answers once the checkpoint is on disk (after the job's running iteration)."""
    def start(done: Callable[[Any], None]) -> None:
        ctx.engine.checkpoint(ctx.find(job_id, who), done)
    reply = await ctx.bridge.later(start, ctx.checkpoint_timeout_s)
    if not isinstance(reply, Checkpointed):
        raise Conflict(f"job {job_id}'s checkpoint was not written: {failure(reply)}")
    await asyncio.sleep(0)
    return CheckpointDone(id=job_id, checkpoint=Checkpoint(
        iteration=reply.iteration, time=reply.time, bytes=reply.bytes, path=reply.path))

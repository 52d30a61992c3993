"""`/v1/devices`, `/v1/lanes`, `/v1/policy`: the node as the scheduler sees it."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from salus.daemon.engine.report import snapshot
from salus.daemon.rest.auth import Principal, admin, principal
from salus.daemon.rest.context import Context, context
from salus.daemon.rest.models import ERRORS, DeviceOut, LaneOut, PolicyIn, PolicyOut

router = APIRouter(prefix="/v1", tags=["node"], responses=ERRORS)


@router.get("/devices", response_model=list[DeviceOut], summary="Devices and their budgets")
async def devices(_: Principal = Depends(principal),
                  ctx: Context = Depends(context)) -> list[DeviceOut]:
    snap = await ctx.bridge.run(lambda: snapshot(ctx.engine))
    return [DeviceOut(index=d["index"], torch_device=d["torch_device"],
                      compute_slowdown=d["compute_slowdown"],
                      capacity_bytes=d["capacity_bytes"], used_bytes=d["used_bytes"],
                      persistent_bytes=d["persistent_bytes"],
                      unreserved_bytes=d["unreserved_bytes"],
                      largest_free_bytes=d["largest_free_bytes"], lanes=len(d["lanes"]),
                      jobs=sum(len(ln["jobs"]) for ln in d["lanes"]), sharing=d["sharing"])
            for d in snap["devices"]]


@router.get("/lanes", response_model=list[LaneOut], summary="Lanes and their jobs")
async def lanes(_: Principal = Depends(principal),
                ctx: Context = Depends(context)) -> list[LaneOut]:
    snap = await ctx.bridge.run(lambda: snapshot(ctx.engine))
    return [LaneOut(device=d["index"], lane_id=ln["lane_id"], size_bytes=ln["size_bytes"],
                    jobs=ln["jobs"], busy_job=ln["busy_job"])
            for d in snap["devices"] for ln in d["lanes"]]


def _policy(ctx: Context) -> PolicyOut:
    return PolicyOut(policy=ctx.engine.dispatch.policy.name,
                     pending=ctx.engine.pending_policy)


@router.get("/policy", response_model=PolicyOut, summary="The scheduling policy")
async def get_policy(_: Principal = Depends(principal),
                     ctx: Context = Depends(context)) -> PolicyOut:
    return await ctx.bridge.run(lambda: _policy(ctx))


@router.put("/policy", response_model=PolicyOut, summary="Switch the policy live")
async def put_policy(body: PolicyIn, _: Principal = Depends(admin),
                     ctx: Context = Depends(context)) -> PolicyOut:
    """At the next iteration boundaries: running iterations return, then every job is
    admitted under the new policy; none is lost."""
    def switch() -> PolicyOut:
        ctx.engine.set_policy(body.policy)
        return _policy(ctx)
    return await ctx.bridge.run(switch)

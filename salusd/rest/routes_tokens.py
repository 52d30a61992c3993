"""`/v1/tokens` (admin only): owner tokens, shown once, stored hashed."""

from __future__ import annotations

import os
import pwd

from fastapi import APIRouter, Depends, HTTPException
from fastapi.concurrency import run_in_threadpool

from salus.daemon.rest.auth import Principal, admin
from salus.daemon.rest.context import Context, context
from salus.daemon.rest.models import ERRORS, TokenIn, TokenMade, TokenOut
from salus.daemon.state.store import TokenRow
from salus.daemon.wire.errors import BadRequest, Conflict

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], responses=ERRORS)


@router.get("", response_model=list[TokenOut], summary="Owner tokens (never their secrets)")
async def list_tokens(_: Principal = Depends(admin),
                      ctx: Context = Depends(context)) -> list[TokenOut]:
    return [_out(r) for r in await run_in_threadpool(ctx.store.list_tokens)]


@router.post("", response_model=TokenMade, status_code=201, summary="Make an owner token")
async def add_token(body: TokenIn, _: Principal = Depends(admin),
                    ctx: Context = Depends(context)) -> TokenMade:
    """The token's jobs run as unix user `user`; its secret is in this answer only."""
    try:
        user = pwd.getpwnam(body.user)
    except KeyError:
        raise BadRequest(f"there is no unix user {body.user!r} on this node") from None
    if os.geteuid() != 0 and user.pw_uid != os.getuid():
        raise BadRequest(f"this salusd runs as uid {os.getuid()}, not root, so it can run jobs "
                         f"only as that user, not as {body.user}")
    try:
        clear = await run_in_threadpool(ctx.store.add_token, body.name, user.pw_name,
                                        user.pw_uid, user.pw_gid)
    except ValueError as exc:
        raise Conflict(str(exc)) from None
    row = next(r for r in await run_in_threadpool(ctx.store.list_tokens)
               if r.name == body.name and r.revoked_at is None)
    return TokenMade(**_out(row).model_dump(), token=clear)


@router.delete("/{name}", response_model=TokenOut, summary="Revoke an owner token")
async def revoke_token(name: str, _: Principal = Depends(admin),
                       ctx: Context = Depends(context)) -> TokenOut:
    if not await run_in_threadpool(ctx.store.revoke_token, name):
        raise HTTPException(404, f"no active token named {name[:64]!r}")
    row = next(r for r in await run_in_threadpool(ctx.store.list_tokens) if r.name == name)
    return _out(row)


def _out(row: TokenRow) -> TokenOut:
    return TokenOut(name=row.name, owner=row.owner, uid=row.uid, created=row.created,
                    revoked_at=row.revoked_at)

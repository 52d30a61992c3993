"""Bearer tokens: the admin token (a 0600 file made at first start) and owner tokens (stored
hashed in the registry, each mapped to a unix user whose jobs it may see and run)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Protocol

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from salus.daemon.engine.registry import Owner
from salus.daemon.state.store import TokenRow

bearer = HTTPBearer(auto_error=False, description="the admin token or an owner's token")
MAX_TOKEN_CHARS = 256


class TokenLookup(Protocol):
    def lookup_token(self, clear: str) -> TokenRow | None: ...


@dataclass(frozen=True)
class Principal:
    """Who is calling: the admin acts on every job; an owner on its own jobs only."""

    owner: Owner
    admin: bool
    token_name: str


class Auth:
    def __init__(self, admin_token: str, tokens: TokenLookup, admin_owner: Owner) -> None:
        self.admin_token = admin_token
        self.tokens = tokens
        self.admin_owner = admin_owner

    def principal(self, token: str) -> Principal | None:
        if len(token) > MAX_TOKEN_CHARS:
            return None
        if hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return Principal(self.admin_owner, True, "admin")
        row = self.tokens.lookup_token(token)
        if row is None:
            return None
        return Principal(Owner(row.owner, row.uid, row.gid), False, row.name)


def principal(request: Request,
              credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
    """The dependency every /v1 route has: 401 without a valid token."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(401, "send 'Authorization: Bearer <token>' (the admin token is in "
                            "<state-dir>/admin.token; owners get theirs from `salusd token "
                            "add`)", headers={"WWW-Authenticate": "Bearer"})
    found = request.app.state.auth.principal(credentials.credentials)
    if found is None:
        raise HTTPException(401, "unknown or revoked token", headers={
            "WWW-Authenticate": "Bearer"})
    return found


def admin(who: Principal = Depends(principal)) -> Principal:
    """The dependency of admin-only routes: 403 for an owner's token."""
    if not who.admin:
        raise HTTPException(403, f"only the admin token may do this (this is {who.token_name}'s "
                            "token)")
    return who

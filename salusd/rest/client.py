"""A small client of the REST API for the CLI: where the daemon is and which token to send.

Address: `--url`, else `$SALUS_URL`, else the `http.url` the daemon wrote in its state dir
(`--state-dir`, else the default one, else /var/lib/salusd), else http://127.0.0.1:7077.
Token: `--token`, else `$SALUS_TOKEN`, else the admin token in that state dir when this user
may read it (root, or the user the daemon runs as).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import httpx

from salus.daemon.wire.address import default_state_dir
from salus.daemon.wire.errors import SalusError

DEFAULT_URL = "http://127.0.0.1:7077"


class RestError(SalusError):
    """The daemon refused (`status` is the HTTP status) or could not be reached (0)."""

    code = "rest"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def state_dirs(explicit: Path | None) -> list[Path]:
    """Where to look for the daemon's REST address and admin token: `explicit`, else the state
    dir of the daemon at `$SALUS_ADDRESS` (its socket says), then the default places."""
    if explicit:
        return [explicit]
    found = [] if not os.environ.get("SALUS_ADDRESS") else _asked(os.environ["SALUS_ADDRESS"])
    return [*found, default_state_dir(), Path("/var/lib/salusd")]


def _asked(address: str) -> list[Path]:
    """The state dir the daemon listening at `address` says it keeps ([] if none answers)."""
    from salus.daemon.cli.control import Control

    try:
        with Control(address, timeout_s=5.0) as ctl:
            return [Path(ctl.state_dir)] if ctl.state_dir else []
    except (SalusError, OSError, ValueError):
        return []


def find_url(url: str | None, state_dir: Path | None) -> str:
    if url:
        return url.rstrip("/")
    if os.environ.get("SALUS_URL"):
        return os.environ["SALUS_URL"].rstrip("/")
    for folder in state_dirs(state_dir):
        with contextlib.suppress(OSError):
            return (folder / "http.url").read_text().strip().rstrip("/")
    return DEFAULT_URL


def find_token(token: str | None, state_dir: Path | None) -> str | None:
    if token:
        return token
    if os.environ.get("SALUS_TOKEN"):
        return os.environ["SALUS_TOKEN"]
    for folder in state_dirs(state_dir):
        with contextlib.suppress(OSError):
            return (folder / "admin.token").read_text().strip()
    return None


class RestClient:
    def __init__(self, url: str, token: str | None, *, timeout_s: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url
        self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            reply = self.http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise RestError(0, f"cannot reach salusd at {self.url}: {exc} (is it running "
                            "with --http? set --url or $SALUS_URL)") from None
        if reply.status_code >= 400:
            try:
                detail = reply.json().get("detail", reply.text)
            except ValueError:
                detail = reply.text
            if reply.status_code == 401 and "Authorization" not in self.http.headers:
                detail = (f"{detail}; no token found: pass --token or set $SALUS_TOKEN")
            raise RestError(reply.status_code, f"{reply.status_code}: {detail}")
        return reply.json()

    def get(self, path: str) -> Any:
        return self.call("GET", path)

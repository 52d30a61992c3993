"""Helpers for tests of the REST API against the real daemon process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from daemon_proc import wait_until


def connect(state: Path, token: str | None = None) -> httpx.Client:
    """A client of the daemon whose state dir is `state`, with the admin token by default."""
    url = (state / "http.url").read_text().strip()
    token = token or (state / "admin.token").read_text().strip()
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                        timeout=30)


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    """`daemon_proc.wait_until` with the argument order these tests were written with."""
    return wait_until(check, timeout_s, what)


def job(client: httpx.Client, job_id: int) -> dict[str, Any]:
    reply = client.get(f"/v1/jobs/{job_id}")
    assert reply.status_code == 200, reply.text
    return reply.json()

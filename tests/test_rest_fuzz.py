"""schemathesis against the real daemon's `/openapi.json`: generated requests to every route
(bounded examples, with the admin token), none answered with a 5xx, and the daemon alive
afterwards and stopping cleanly on SIGTERM."""

from __future__ import annotations

import signal

import httpx
import pytest
import schemathesis
from daemon_proc import job_root, salusd
from hypothesis import HealthCheck, given, settings


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    root = job_root(tmp, "shuffled.py")
    with salusd(tmp, "--http", "127.0.0.1:0", "--job-root", str(root)) as (proc, _):
        state = tmp / "state"
        yield proc, (state / "http.url").read_text().strip(), (
            state / "admin.token").read_text().strip()
        assert proc.poll() is None, "salusd died during the fuzzing"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "salusd did not stop cleanly after the fuzzing"


def test_no_request_gets_a_server_error(live):
    proc, url, token = live
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:

        @settings(max_examples=12, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case) -> None:
            response = case.call(headers={"Authorization": f"Bearer {token}"})
            assert response.status_code < 500, (case.method, case.formatted_path,
                                                response.status_code, response.text)
            assert proc.poll() is None, "salusd died"

        call()


def test_daemon_alive_after_fuzzing(live):
    proc, url, _ = live
    assert proc.poll() is None
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}

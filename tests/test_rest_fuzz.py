"""schemathesis against the real daemon's `/openapi.json`: generated requests to every route
(bounded examples, with the admin token), none answered with a 5xx; the job routes' bodies with
what JSON carries but the schema's strings and numbers cannot be (NaN, Infinity, lone
surrogates) each refused with a 4xx; and the daemon alive afterwards and stopping cleanly on
SIGTERM."""

from __future__ import annotations

import json
import math
import signal
from typing import Any

import httpx
import pytest
from daemon_proc import job_root, salusd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


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
    import schemathesis  # here: its import is most of this file's collection time

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


# What JSON can carry but no field of the schema may hold: a reply, log line, database row or
# environment could not.
LONE_SURROGATES = st.builds(lambda head, cp, tail: head + chr(cp) + tail,
                           st.sampled_from(["", "/tmp/", "a"]), st.integers(0xD800, 0xDFFF),
                           st.sampled_from(["", ".py", "/b"]))
UNREPRESENTABLE = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), LONE_SURROGATES)
# Bodies the job routes accept as they are (a script job, a batch job, a weight, a suspend):
# one of their values or names made unrepresentable is the only thing wrong with them.
VALID = {"/v1/jobs": [{"name": "s", "command": ["python", "train.py"], "cwd": "/tmp",
                       "env": {"A": "1"}, "priority": 2.0, "iterations": 5},
                      {"name": "b", "entrypoint": "shuffled.py:make_job", "iterations": 1,
                       "rendezvous": "r1"}],
         "/v1/jobs/{job_id}/priority": [{"priority": 2.0}],
         "/v1/jobs/{job_id}/suspend": [{"swap": True}]}


def _places(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], bool]]:
    """Every value in a JSON document (path, False) and every key of its objects (path, True)."""
    found = [(at, False)] if at else []
    if isinstance(value, dict):
        for key, inner in value.items():
            found += [(at + (key,), True), *_places(inner, at + (key,))]
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            found += _places(inner, at + (i,))
    return found


def _put(doc: Any, at: tuple[Any, ...], key: bool, new: Any) -> Any:
    """`doc` with the value at path `at` (or, with `key`, that object key) replaced by `new`."""
    if not at:
        return new
    head, rest = at[0], at[1:]
    if isinstance(doc, list):
        return [_put(v, rest, key, new) if i == head else v for i, v in enumerate(doc)]
    if key and not rest:
        return {(new if k == head else k): v for k, v in doc.items()}
    return {k: _put(v, rest, key, new) if k == head else v for k, v in doc.items()}


def test_job_routes_refuse_nan_infinity_and_lone_surrogates_with_a_4xx(live):
    import schemathesis  # here: its import is most of this file's collection time

    proc, url, token = live
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [op for op in (r.ok() for r in schema.get_all_operations())
                  if op.path.startswith("/v1/jobs") and op.method.upper() in ("POST", "PUT")]
    assert {op.path for op in operations} >= set(VALID)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for operation in operations:

            @settings(max_examples=20, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(), data=st.data())
            def call(case, data) -> None:
                generated = case.body if isinstance(case.body, dict) else {}
                body = data.draw(st.sampled_from([generated, *VALID.get(case.operation.path, [])]))
                places = _places(body)
                if not places:
                    return
                at, key = data.draw(st.sampled_from(places))
                sent = _put(body, at, key, data.draw(LONE_SURROGATES if key else UNREPRESENTABLE))
                reply = client.request(case.method, case.formatted_path,
                                       content=json.dumps(sent).encode())
                what = (case.method, case.formatted_path, json.dumps(sent), reply.status_code,
                        reply.text)
                assert reply.status_code < 500, what
                if body is not generated:  # a valid body: what was put in is what is wrong
                    assert reply.status_code == 422, what
                    assert key or f'"{at[0]}"' in reply.text, what  # the field is named
                assert proc.poll() is None, "salusd died"

            call()


def test_daemon_alive_after_fuzzing(live):
    proc, url, _ = live
    assert proc.poll() is None
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}

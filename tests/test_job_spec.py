"""A job's frozen spec (`salusd/engine/job_spec.py`): what the registry keeps is read back
equal, its JSON leaves defaults out, older and later registries are read, a wrong type is
refused naming the field; and a daemon restarted on a registry whose spec cannot be read
fails that job, saying why, and goes on restoring the others."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from daemon_proc import salusd
from hypothesis import given
from hypothesis import strategies as st
from rest_client import connect, job

from salus.daemon.cli.control import Control
from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.state.store import Store
from salus.daemon.wire.executor_ops import PipelineOptions


def _whole(spec: JobSpec) -> JobSpec:
    """`spec` made one the registry could hold: a script's directory named, a batch job's path
    and function together (the tests below refuse the others)."""
    if spec.is_script and spec.cwd is None:
        spec = dataclasses.replace(spec, cwd="/work")
    if (spec.path is None) != (spec.function is None):
        spec = dataclasses.replace(spec, function=None if spec.path is None else "make")
    return spec


_text = st.text(min_size=1, max_size=12)
_maybe_int = st.none() | st.integers(0, 1 << 40)
_maybe_float = st.none() | st.floats(0, 1e6, allow_nan=False)

specs = st.builds(
    JobSpec, devices=st.integers(1, 64), nodes=st.integers(1, 8),
    allocation=st.none() | _text, python=st.none() | _text, path=st.none() | _text,
    function=st.none() | _text, rendezvous=st.none() | _text,
    pipeline=st.none() | st.builds(PipelineOptions, st.sampled_from(["even", "sky"]),
                                   st.integers(1, 1024)),
    command=st.lists(_text, max_size=4).map(tuple), cwd=st.none() | _text,
    env=st.none() | st.dictionaries(_text, _text, max_size=3),
    restart=st.sampled_from(["never", "on-failure"]), max_restarts=_maybe_int,
    grace_s=_maybe_float, mem_bytes=_maybe_int, time_limit_s=_maybe_float,
    signal=st.none() | st.integers(1, 31), signal_before_s=_maybe_float,
    array_index=_maybe_int, array_job=_maybe_int,
    after=st.lists(st.integers(1, 10_000), max_size=3).map(tuple)).map(_whole)



@given(specs)
def test_what_the_registry_keeps_reads_back_equal_and_leaves_defaults_out(
        spec: JobSpec) -> None:
    stored = json.loads(json.dumps(spec.to_json()))  # as the registry's JSON column holds it
    assert JobSpec.from_json(stored) == spec
    defaults = {f.name for f in dataclasses.fields(JobSpec)
                if getattr(spec, f.name) == f.default}
    assert not defaults & stored.keys()


def test_older_and_later_registries_are_read() -> None:
    # An older salusd wrote the entrypoint's text beside its path and function; a later one
    # may write names this one does not know.
    old = {"entrypoint": "/jobs/a.py:make", "path": "/jobs/a.py", "function": "make",
           "devices": 2, "pipeline": {"placement": "sky", "microbatches": 4},
           "some_later_field": [1, 2]}
    spec = JobSpec.from_json(old)
    assert spec == JobSpec(devices=2, path="/jobs/a.py", function="make",
                           pipeline=PipelineOptions("sky", 4))
    assert spec.entrypoint == "/jobs/a.py:make" and not spec.is_script
    script = JobSpec.from_json({"command": ["python", "t.py"], "cwd": "/w", "restart": "never",
                                "max_restarts": 3})
    assert script.is_script and script.command == ("python", "t.py") and script.entrypoint is None


@pytest.mark.parametrize("bad, field", [({"devices": "two"}, "devices"),
                                        ({"command": "python t.py"}, "command"),
                                        ({"after": [1, "2"]}, "after"),
                                        ({"pipeline": {"placement": "even"}}, "microbatches"),
                                        ({"command": ["python", "t.py"]}, "cwd"),
                                        ({"path": "/jobs/a.py"}, "function"),
                                        ([1, 2], "a JSON object")])
def test_a_wrong_type_is_refused_naming_the_field(bad: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        JobSpec.from_json(bad)


@pytest.mark.slow
def test_a_restart_fails_the_job_whose_spec_cannot_be_read_and_goes_on_with_the_others(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    store = Store.open(state / "salusd.db")
    try:
        bad = store.new_job("damaged", "u", 1000, 1000, "interactive", {"devices": "two"}, 5)
        good = store.new_job("waits", "u", 1000, 1000, "interactive", {}, 5)
    finally:
        store.close()
    with salusd(tmp_path, "--http", "127.0.0.1:0") as (_, address):
        with Control(address) as ctl:
            # the next job went through the usual restore: an interactive job that never
            # reached a checkpoint has no state to bring back
            info = ctl.info(str(good))
        assert "before job" in info["reason"] and "first checkpoint" in info["reason"]
        # the damaged row is listed with the rest, as failed and why, not as a server error
        with connect(state) as rest:
            listed = rest.get("/v1/jobs")
            assert listed.status_code == 200, listed.text
            shown = job(rest, bad)
    assert {j["id"] for j in listed.json()} >= {bad, good}
    assert shown["state"] == "failed"
    assert f"job {bad}'s spec in the registry cannot be read" in shown["reason"]
    assert "'devices'" in shown["reason"]

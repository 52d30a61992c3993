"""The REST control plane against the real daemon process: batch jobs, suspend and resume,
cancel, priority, a live policy switch, tokens and owner isolation, and restart after kill -9."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_proc import RunningDaemon, job_root, salusd
from jobs import shuffled
from rest_client import connect, job, wait_for

from salus.daemon.executor import checkpoint
from salus.daemon.state.store import Store


def _root(tmp: Path) -> Path:
    return job_root(tmp, "shuffled.py")


def _serve(tmp: Path, *extra: str):
    return salusd(tmp, "--http", "127.0.0.1:0", "--job-root", str(_root(tmp)), *extra)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """One daemon for the tests that neither restart it nor change its environment; each
    cancels the jobs it leaves running and puts back the policy it switched."""
    tmp = tmp_path_factory.mktemp("salusd")
    with _serve(tmp, "--checkpoint-every", "1000") as running:
        yield running


def _submit(client, iterations: int, name: str = "shuffled", **extra) -> int:
    reply = client.post("/v1/jobs", json={"name": name, "entrypoint": "shuffled.py:make_job",
                                          "iterations": iterations, **extra})
    assert reply.status_code == 201, reply.text
    body = reply.json()
    assert body["kind"] == "batch" and body["iterations_total"] == iterations
    return int(body["id"])


def test_batch_job_suspend_resume_priority_cancel(daemon):
    client = connect(daemon.state_dir)
    jid = _submit(client, 10**9)
    wait_for(lambda: job(client, jid)["iterations_done"] > 5, "iterations")
    reply = client.post(f"/v1/jobs/{jid}/suspend", json={"swap": False})
    assert reply.status_code == 200, reply.text
    # Suspending checkpoints the job at the boundary where it stops, so once a checkpoint
    # of its last iteration is there the iteration running at the suspend (if any) ended.
    held = wait_for(lambda: (j := job(client, jid))["state"] == "suspended" and (
        j["checkpoint"] or {}).get("iteration") == j["iterations_done"] and j,
        "the suspended job's checkpoint at the iteration it stopped at")
    stopped = held["iterations_done"]
    time.sleep(0.5)  # not a wait: the window in which a suspended job must not run
    assert job(client, jid)["iterations_done"] == stopped, "a suspended job ran"
    assert client.post(f"/v1/jobs/{jid}/resume").status_code == 200
    wait_for(lambda: job(client, jid)["iterations_done"] > stopped + 5, "resumed")
    assert client.post(f"/v1/jobs/{jid}/resume").status_code == 409  # not suspended
    reply = client.put(f"/v1/jobs/{jid}/priority", json={"priority": 3.5})
    assert reply.status_code == 200 and reply.json()["priority"] == 3.5
    assert client.put(f"/v1/jobs/{jid}/priority", json={"priority": -1}).status_code == 422
    made = client.post(f"/v1/jobs/{jid}/checkpoint")
    assert made.status_code == 200, made.text
    assert made.json()["checkpoint"]["iteration"] > stopped
    assert client.delete(f"/v1/jobs/{jid}").status_code == 200
    wait_for(lambda: job(client, jid)["state"] == "cancelled", "cancelled")
    assert client.post(f"/v1/jobs/{jid}/resume").status_code == 409
    assert client.get("/v1/jobs/999999").status_code == 404


def test_bad_submissions_get_clear_errors(daemon):
    client = connect(daemon.state_dir)
    cases = [
        ({"name": "x", "entrypoint": "../../etc/passwd.py:f", "iterations": 1}, 422,
         "under the job root"),
        ({"name": "x", "entrypoint": "missing.py:f", "iterations": 1}, 422, "no file"),
        ({"name": "x", "entrypoint": "a\x00b.py:f", "iterations": 1}, 422, "pattern"),
        ({"name": "x", "entrypoint": "shuffled.py:f", "iterations": 0}, 422, ""),
        ({"name": "x", "entrypoint": "shuffled.py:make_job", "iterations": 1,
          "devices": 3}, 422, "this node has 2 device(s)"),
        ({"name": "\x1b[2J", "entrypoint": "shuffled.py:make_job", "iterations": 1}, 422,
         "printable"),
    ]
    for body, status, words in cases:
        reply = client.post("/v1/jobs", json=body)
        assert reply.status_code == status, (body, reply.text)
        assert words in reply.text
    reply = client.post("/v1/jobs", json={"name": "nofn", "entrypoint":
                                          "shuffled.py:nothing", "iterations": 3})
    jid = reply.json()["id"]  # the function is looked up in the owner's executor
    failed = wait_for(lambda: (j := job(client, jid))["state"] == "failed" and j, "failed")
    assert "has no function 'nothing'" in failed["reason"]
    huge = client.post("/v1/jobs", content=b"{" + b" " * 100_000 + b"}",
                       headers={"content-type": "application/json"})
    assert huge.status_code == 413
    # Bodies JSON can hold but a reply could not echo, and what an environment cannot hold:
    # a 4xx naming the field, never a 500.
    script = '{"name": "s", "command": ["python", "-c", "1"], '
    for rest, words in [
            ('"cwd": "/tmp", "priority": NaN}', "priority"),
            ('"cwd": "/tmp", "priority": Infinity}', "priority"),
            ('"cwd": "/tmp/\\ud800"}', "cwd"),
            ('"cwd": "/tmp/a\\u0000b"}', "without NUL"),
            ('"cwd": "/tmp", "env": {"": "1"}}', "non-empty"),
            ('"cwd": "/tmp", "env": {"\\ud800": "1"}}', "UTF-8")]:
        raw = script + rest
        reply = client.post("/v1/jobs", content=raw.encode(),
                            headers={"content-type": "application/json"})
        assert reply.status_code == 422 and words in reply.text, (raw, reply.text)
    # A job made from one would answer every later listing with a 500.
    reply = client.post("/v1/jobs", content=b'{"name": "s", "cwd": "/tmp", "command": '
                        b'["python", "\\ud800.py"]}',
                        headers={"content-type": "application/json"})
    assert reply.status_code == 422 and '"command"' in reply.text, reply.text
    assert client.get("/v1/jobs").status_code == 200
    assert client.get("/healthz").json() == {"status": "ok"}


def test_a_script_job_refused_at_submission_says_why_and_leaves_no_job(daemon, tmp_path):
    """A cwd that is well-formed but missing or not a directory, and an interpreter not on the
    job's PATH, are found out at submission, as the job's owner (who alone may look): a 422 in
    one line naming the field, and no job made (before: a job that failed later, or one left
    open by an internal error)."""
    (tmp_path / "a-file").write_text("")
    client = connect(daemon.state_dir)
    jobs = client.get("/v1/jobs").json()
    for cwd, python, why in [
            (tmp_path / "missing", sys.executable,
             f"'cwd' {tmp_path / 'missing'} is not a directory the job's owner can reach"),
            (tmp_path / "a-file", sys.executable,
             f"'cwd' {tmp_path / 'a-file'} is not a directory the job's owner can reach"),
            (tmp_path, "no-such-python", "no-such-python: command not found on the job's "
             f"PATH ({os.environ['PATH']})"),
            (tmp_path, str(tmp_path / "a-file"), f"{tmp_path / 'a-file'} is not a file the "
             "job's owner can execute")]:
        reply = client.post("/v1/jobs", json={"name": "s", "cwd": str(cwd),
                                              "command": [python, "train.py"]})
        assert reply.status_code == 422 and why in reply.text, reply.text
    assert client.get("/v1/jobs").json() == jobs


def test_a_rest_script_job_finds_python_on_the_daemons_path(tmp_path, monkeypatch):
    """The README's REST example as written: `["python", ...]` and no `env` runs with the
    daemon's PATH, where `python` is (before: the default /bin:/usr/bin, where it is not)."""
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    with _serve(tmp_path):
        client = connect(tmp_path / "state")
        reply = client.post("/v1/jobs", json={"name": "s", "cwd": str(tmp_path), "command": [
            "python", "-c", "import sys; print(sys.prefix)"]})
        assert reply.status_code == 201, reply.text
        jid = reply.json()["id"]
        done = wait_for(lambda: (j := job(client, jid))["state"] in ("finished", "failed")
                        and j, "the job ended")
        assert done["state"] == "finished", done
        log = client.get(f"/v1/jobs/{jid}/log").text
        assert log.strip() == sys.prefix, log


def test_a_live_policy_switch_survives_a_restart_unless_serve_names_one(tmp_path):
    """`PUT /v1/policy` is kept in the state dir: the next `salusd serve` without `--policy`
    starts with it (before: with pack again); one given `--policy` starts with that."""
    with _serve(tmp_path) as (proc, _):
        client = connect(tmp_path / "state")
        assert client.get("/v1/policy").json()["policy"] == "pack"
        assert client.put("/v1/policy", json={"policy": "fair"}).status_code == 200
        wait_for(lambda: client.get("/v1/policy").json() == {"policy": "fair", "pending": None},
                 "the switch")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    for args, policy in (((), "fair"), (("--policy", "srtf"), "srtf")):
        with _serve(tmp_path, *args):
            client = connect(tmp_path / "state")
            assert client.get("/v1/policy").json()["policy"] == policy, args


def test_live_policy_switch_loses_no_job(daemon):
    client = connect(daemon.state_dir)
    jobs = [_submit(client, 10**9, name=f"j{i}") for i in range(3)]
    for jid in jobs:
        wait_for(lambda jid=jid: job(client, jid)["iterations_done"] > 2, "running")
    for policy in ("fair", "fifo", "pack", "srtf"):
        reply = client.put("/v1/policy", json={"policy": policy})
        assert reply.status_code == 200, reply.text
        wait_for(lambda p=policy: client.get("/v1/policy").json() == {
            "policy": p, "pending": None}, f"switch to {policy}")
        before = {jid: job(client, jid)["iterations_done"] for jid in jobs}
        # Every job is still there and live; at least one of them runs under the policy.
        wait_for(lambda b=before: any(job(client, j)["iterations_done"] > b[j]
                                      for j in jobs), f"progress under {policy}")
        states = {job(client, jid)["state"] for jid in jobs}
        assert states <= {"running", "admitted", "pending"}, states
    assert client.put("/v1/policy", json={"policy": "lottery"}).status_code == 422
    for jid in jobs:
        assert client.delete(f"/v1/jobs/{jid}").status_code == 200
    assert client.put("/v1/policy", json={"policy": "pack"}).status_code == 200


@pytest.mark.skipif(os.geteuid() != 0, reason="owner tokens for other users need a root daemon")
def test_tokens_and_owner_isolation(daemon):
    admin = connect(daemon.state_dir)
    jid = _submit(admin, 10**9)
    made = admin.post("/v1/tokens", json={"name": "guest", "user": "nobody"})
    assert made.status_code == 201, made.text
    secret = made.json()["token"]
    assert secret.encode() not in (daemon.state_dir / "salusd.db").read_bytes()
    guest = connect(daemon.state_dir, token=secret)
    assert guest.get("/v1/jobs").json() == []  # sees only its own jobs
    assert guest.get(f"/v1/jobs/{jid}").status_code == 403
    assert guest.delete(f"/v1/jobs/{jid}").status_code == 403
    assert guest.put("/v1/policy", json={"policy": "fair"}).status_code == 403
    assert guest.get("/v1/tokens").status_code == 403
    assert admin.post("/v1/tokens", json={"name": "guest", "user": "nobody"}
                      ).status_code == 409
    assert admin.post("/v1/tokens", json={"name": "x", "user": "no-such-user-here"}
                      ).status_code == 422
    assert admin.delete("/v1/tokens/guest").status_code == 200
    assert guest.get("/v1/jobs").status_code == 401  # revoked
    anonymous = admin.get("/v1/jobs", headers={"Authorization": ""})
    assert anonymous.status_code == 401
    assert admin.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
    wait_for(lambda: job(admin, jid)["state"] == "running",
             "the admin's job (the guest could not cancel it) running")
    assert admin.delete(f"/v1/jobs/{jid}").status_code == 200


def test_kill_9_then_restart_resumes_batch_job_exactly(tmp_path):
    # Long enough that the job cannot finish between the poll that sees its checkpoint at
    # iteration 10 and the kill (40 iterations once did, on a fast run).
    iterations = 300
    with _serve(tmp_path, "--checkpoint-every", "5") as (proc, _):
        client = connect(tmp_path / "state")
        jid = _submit(client, iterations)
        wait_for(lambda: (job(client, jid)["checkpoint"] or {}).get("iteration", 0) >= 10,
                 "a checkpoint at iteration 10 or later")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with Store.open(tmp_path / "state" / "salusd.db") as store:
        row = store.get_job(jid)
        assert row is not None and row.state in ("running", "pending")
        saved = row.checkpoint_iteration
    assert saved is not None and saved >= 10
    with _serve(tmp_path, "--checkpoint-every", "5"):
        client = connect(tmp_path / "state")
        resumed = job(client, jid)  # at once: its executor may not have loaded it yet
        assert resumed["resumed_from"] is not None and resumed["resumed_from"] >= saved
        assert resumed["iterations_done"] >= saved, resumed
        assert (resumed["checkpoint"] or {}).get("iteration", 0) >= saved, resumed
        done = wait_for(lambda: (j := job(client, jid))["state"] == "finished" and j,
                        "the resumed job to finish", timeout_s=120)
        assert done["iterations_done"] == iterations
        assert _submit(client, 1) > jid  # ids never repeat across restarts
    loaded = checkpoint.load_latest(tmp_path / "state" / "checkpoints" / str(jid))
    assert loaded is not None and loaded.iteration == iterations
    torch.set_num_threads(1)
    expected = shuffled.run_directly(iterations).state_dict()
    got = loaded.payload["objects"]["model"].state_dict()
    for key, value in expected.items():
        assert torch.allclose(got[key], value, rtol=0, atol=1e-6), key

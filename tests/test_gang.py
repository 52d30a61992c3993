"""Gang (data-parallel) batch jobs through the real daemon with 2 CPU devices.

Four gangs of 2 replicas, each averaging gradients another way (ring, Blink trees, sparse
top-k, ring then the PTO sharded step), run at once with a one-device job beside them. Each
must end with the parameters of one process training on the whole batches (the reference here
is that plain loop). Float sums differ in order (two half-batch means averaged, against one
mean over the batch), hence the 1e-6 tolerance. Within one node ``sparse_all_reduce`` reduces
exactly (Hi-TopK prunes only what crosses nodes), so the sparse gang must match too.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_proc import RunningDaemon, job_root, salusd
from jobs import dataparallel
from rest_client import connect, job, wait_for

from salus.daemon.executor import checkpoint

ITERATIONS = 14  # more than one epoch (6 batches each)
GANGS = ("ring", "tree", "sparse", "sharded")


def _root(tmp: Path) -> Path:
    return job_root(tmp, "dataparallel.py", "shuffled.py")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """One daemon for the gang tests that do not restart it."""
    tmp = tmp_path_factory.mktemp("salusd")
    with salusd(tmp, "--http", "127.0.0.1:0", "--job-root", str(_root(tmp)),
                "--checkpoint-every", "1000") as running:
        yield running


def _submit(client, name: str, entrypoint: str, devices: int, iterations: int) -> int:
    reply = client.post("/v1/jobs", json={"name": name, "entrypoint": entrypoint,
                                          "iterations": iterations, "devices": devices})
    assert reply.status_code == 201, reply.text
    return int(reply.json()["id"])


def _params(state_dir: Path, jid: int, replica: int) -> dict[str, torch.Tensor]:
    loaded = checkpoint.load_latest(state_dir / "checkpoints" / str(jid) / f"replica{replica}")
    assert loaded is not None and loaded.iteration == ITERATIONS
    return loaded.payload["objects"]["model"].state_dict()


@pytest.mark.slow
def test_gangs_train_like_one_process_on_whole_batches(daemon):
    state = daemon.state_dir
    client = connect(state)
    ids = {name: _submit(client, name, f"dataparallel.py:make_{name}", 2, ITERATIONS)
           for name in GANGS}
    single = _submit(client, "single", "shuffled.py:make_job", 1, 30)
    for jid in [*ids.values(), single]:
        wait_for(lambda j=jid: job(client, j)["state"] in ("finished", "failed"),
                 f"job {jid} to end", timeout_s=300)
    ended = {name: job(client, jid) for name, jid in ids.items()}
    assert job(client, single)["state"] == "finished"
    too_many = client.post("/v1/jobs", json={"name": "x", "iterations": 1, "devices": 3,
                                             "entrypoint": "dataparallel.py:make_ring"})
    assert too_many.status_code == 422 and "2 device" in too_many.json()["detail"]
    for name, info in ended.items():
        assert info["state"] == "finished" and info["devices"] == 2, (name, info["reason"])
        assert info["iterations_done"] == ITERATIONS

    torch.set_num_threads(1)
    reference = dataparallel.run_directly(ITERATIONS).state_dict()
    for name, jid in ids.items():
        replicas = [_params(state, jid, r) for r in (0, 1)]
        for key, want in reference.items():
            assert torch.equal(replicas[0][key], replicas[1][key]), (name, key)
            assert torch.allclose(replicas[0][key], want, rtol=0, atol=1e-6), (name, key)

    # PTO: each replica holds the momentum of half the parameters' elements.
    full = sum(p.numel() * p.element_size() for p in reference.values())
    shard = ended["sharded"]["last_evaluation"]
    assert abs(shard - full / 2) <= 64, (shard, full)
    assert ended["ring"]["last_evaluation"] == full  # unsharded: all of it


@pytest.mark.slow
def test_a_failing_replica_fails_its_gang_only_and_a_cancelled_gang_frees_its_lanes(daemon):
    client = connect(daemon.state_dir)
    failing = _submit(client, "failing", "dataparallel.py:make_failing", 2, 10)
    endless = _submit(client, "endless", "dataparallel.py:make_ring", 2, 10**9)
    info = wait_for(lambda: (j := job(client, failing))["state"] == "failed" and j,
                    "the failing gang to fail", timeout_s=120)
    assert "replica 1" in info["reason"] and "broke on purpose" in info["reason"]
    wait_for(lambda: job(client, endless)["iterations_done"] > 3, "the other gang runs on")
    assert client.delete(f"/v1/jobs/{endless}").status_code == 200
    wait_for(lambda: job(client, endless)["state"] == "cancelled", "cancelled")
    after = _submit(client, "after", "dataparallel.py:make_tree", 2, 4)
    wait_for(lambda: job(client, after)["state"] == "finished", "a gang on the freed lanes",
             timeout_s=120)
    assert client.get("/healthz").status_code == 200


@pytest.mark.slow
def test_kill_9_then_restart_resumes_a_gang_from_its_replicas_checkpoints(tmp_path):
    iterations, state = 30, tmp_path / "state"
    with salusd(tmp_path, "--http", "127.0.0.1:0", "--job-root", str(_root(tmp_path)),
                "--checkpoint-every", "4") as (proc, _):
        client = connect(state)
        # The PTO gang: each replica's momentum for its half of the parameters lives in the
        # Comm's shard optimizer, which the replicas' checkpoints must carry.
        jid = _submit(client, "sharded", "dataparallel.py:make_sharded", 2, iterations)
        wait_for(lambda: (job(client, jid)["checkpoint"] or {}).get("iteration", 0) >= 8,
                 "a checkpoint at iteration 8 or later")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with salusd(tmp_path, "--http", "127.0.0.1:0", "--job-root", str(_root(tmp_path)),
                "--checkpoint-every", "4"):
        client = connect(state)
        done = wait_for(lambda: (j := job(client, jid))["state"] in ("finished", "failed") and j,
                        "the resumed gang to end", timeout_s=120)
        assert done["state"] == "finished", done["reason"]
        assert done["resumed_from"] >= 8 and done["iterations_done"] == iterations
    torch.set_num_threads(1)
    reference = dataparallel.run_directly(iterations).state_dict()
    for replica in (0, 1):
        loaded = checkpoint.load_latest(state / "checkpoints" / str(jid) / f"replica{replica}")
        assert loaded is not None and loaded.iteration == iterations
        got = loaded.payload["objects"]["model"].state_dict()
        for key, want in reference.items():
            assert torch.allclose(got[key], want, rtol=0, atol=1e-6), (replica, key)

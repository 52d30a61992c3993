"""Gangs across nodes: two daemons on loopback as two nodes of 2 CPU devices each.

Each daemon is started with ``--cluster 127.0.0.1:PORT --nodes 2 --node-rank R`` (node 0
hosts the rendezvous store) and the same job is submitted to both, as `torchrun` is started on
every node. The four replicas (ranks node-major) must end with the parameters of one process
training on the whole batches: each replica trains on a quarter of every batch, so the sums
differ from the reference in order only (hence 1e-6). Beside them, a larger model trains dense
and with ``sparse_all_reduce`` at density 0.01 (Hi-TopK prunes what crosses the nodes, with
error feedback): its held-out loss must be within 5 % of the dense one's.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from daemon_proc import job_root, salusd
from jobs import dataparallel, heldout
from rest_client import connect, job, wait_for

from salus.daemon.cluster import ClusterSpec, parse_cluster
from salus.daemon.executor import checkpoint
from salus.daemon.wire.address import free_port

ITERATIONS = 8
HELD_OUT_ITERATIONS = 100


def test_cluster_flags_and_torchrun_environment() -> None:
    assert parse_cluster(None, None, None) is None
    assert parse_cluster("10.0.0.1:29500", 4, 2) == ClusterSpec("10.0.0.1", 29500, 4, 2)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "NNODES": "2", "GROUP_RANK": "1"}
    spec = parse_cluster("env", None, None, env)
    assert spec == ClusterSpec("127.0.0.1", 29400, 2, 1) and spec.loopback
    with pytest.raises(ValueError, match="MASTER_PORT"):
        parse_cluster("env", None, None, {"MASTER_ADDR": "h", "NNODES": "2", "NODE_RANK": "0"})
    with pytest.raises(ValueError, match="--nodes K and --node-rank R"):
        parse_cluster("h:1", None, None)
    with pytest.raises(ValueError, match="--node-rank must be in"):
        parse_cluster("h:1", 2, 2)
    with pytest.raises(ValueError, match="need --cluster"):
        parse_cluster(None, 2, 0)
    with pytest.raises(ValueError, match="HOST:PORT or env"):
        parse_cluster("nohost", 2, 0)


def _root(tmp: Path) -> Path:
    return job_root(tmp, "dataparallel.py", "heldout.py")


def _submit(client, name: str, entrypoint: str, iterations: int = ITERATIONS, **extra) -> int:
    reply = client.post("/v1/jobs", json={"name": name, "entrypoint": entrypoint,
                                          "iterations": iterations, "devices": 2, **extra})
    assert reply.status_code == 201, reply.text
    return int(reply.json()["id"])


def _model(node: Path, jid: int, iterations: int, replica: int = 0) -> dict[str, torch.Tensor]:
    loaded = checkpoint.load_latest(node / "state" / "checkpoints" / str(jid) / f"replica{replica}")
    assert loaded is not None and loaded.iteration == iterations
    return loaded.payload["objects"]["model"].state_dict()


@pytest.mark.slow
def test_a_gang_on_two_daemons_trains_like_one_process_on_whole_batches(tmp_path):
    store = f"127.0.0.1:{free_port()}"
    root = _root(tmp_path)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    with ExitStack() as stack:
        for rank, where in enumerate(nodes):
            where.mkdir()
            stack.enter_context(salusd(where, "--http", "127.0.0.1:0", "--job-root", str(root),
                                       "--checkpoint-every", "1000", "--cluster", store,
                                       "--nodes", "2", "--node-rank", str(rank)))
        clients = [connect(where / "state") for where in nodes]
        ids = {algorithm: [_submit(c, algorithm, f"dataparallel.py:make_{algorithm}", nodes=2)
                           for c in clients] for algorithm in ("ring", "tree")}
        held = {kind: [_submit(c, kind, f"heldout.py:make_{kind}", HELD_OUT_ITERATIONS,
                               nodes=2) for c in clients] for kind in ("dense", "sparse")}
        for algorithm, pair in (ids | held).items():
            for client, jid in zip(clients, pair, strict=True):
                info = wait_for(lambda c=client, j=jid: (i := job(c, j))["state"] in (
                    "finished", "failed") and i, f"{algorithm} job {jid} to end", timeout_s=240)
                assert info["state"] == "finished", (algorithm, info["reason"])
                assert info["nodes"] == 2 and info["state"] == "finished"
                if algorithm in ("ring", "tree"):  # job info says what s.comm ran
                    assert info["comm"]["last_algorithm"] == algorithm, info["comm"]
                    assert info["comm"]["calls"][f"all_reduce.{algorithm}"] >= 2 * ITERATIONS
        losses = {kind: job(clients[0], pair[0])["last_evaluation"] for kind, pair in held.items()}
        refused = clients[0].post("/v1/jobs", json={"name": "x", "iterations": 1, "nodes": 3,
                                                    "entrypoint": "dataparallel.py:make_ring"})
        assert refused.status_code == 422 and "2 node(s)" in refused.json()["detail"]
        switch = clients[0].put("/v1/policy", json={"policy": "fifo"})
        assert switch.status_code == 200  # no multi-node job is live any more

    torch.set_num_threads(1)
    dense, sparse = losses["dense"], losses["sparse"]
    print(f"held-out loss after {HELD_OUT_ITERATIONS} steps, 2 nodes x 2 devices: dense "
          f"{dense:.6f}, sparse@0.01 {sparse:.6f} (ratio {sparse / dense:.4f})")
    assert abs(sparse - dense) <= 0.05 * dense, losses
    assert dense < 0.5 * heldout.initial_loss(), (losses, heldout.initial_loss())
    pruned = [_model(nodes[0], held[kind][0], HELD_OUT_ITERATIONS) for kind in held]
    assert max((pruned[0][k] - pruned[1][k]).abs().max() for k in pruned[0]) > 1e-4, (
        "the sparse gang sent everything: top-k pruned nothing")
    reference = dataparallel.run_directly(ITERATIONS).state_dict()
    for algorithm, pair in ids.items():
        for node, jid in zip(nodes, pair, strict=True):
            for replica in (0, 1):
                got = _model(node, jid, ITERATIONS, replica)
                for key, want in reference.items():
                    assert torch.allclose(got[key], want, rtol=0, atol=1e-6), (
                        algorithm, node.name, replica, key)


def test_a_multi_node_job_needs_a_cluster_and_the_pack_policy(tmp_path):
    with salusd(tmp_path, "--http", "127.0.0.1:0", "--job-root", str(_root(tmp_path))):
        client = connect(tmp_path / "state")
        reply = client.post("/v1/jobs", json={"name": "x", "iterations": 1, "nodes": 2,
                                              "entrypoint": "dataparallel.py:make_ring"})
        assert reply.status_code == 422 and "--cluster" in reply.json()["detail"]

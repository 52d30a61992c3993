"""The data cache as a service to jobs: a gang batch job through the real daemon reads its
samples with `salus.data.CachedDataset` + `ReplicaLoader`.

Checked: the gang trains like one process on the whole batches (1e-6; the reference draws the
same epoch orders), and the job's info reports the cache's counters for the whole gang, which
must follow from how the cache works: every file is read from the source once in the gang
(by the replica that owns it) and decoded once into its owner's memory; later epochs are memory
hits; level 1 (disk) holds each raw file once, in its owner's folder under the node's cache.
"""

from __future__ import annotations

import os
import pwd

import pytest
import torch
from daemon_proc import job_root, salusd
from jobs import cached
from rest_client import connect, job, wait_for

from salus.daemon.executor import checkpoint

EPOCHS = 3
ITERATIONS = EPOCHS * cached.SAMPLES // cached.BATCH


@pytest.mark.slow
def test_a_gang_reads_through_the_node_cache_and_reports_it(tmp_path):
    root = job_root(tmp_path, "cached.py")
    cached.write_samples(str(root / "samples"))
    cache = tmp_path / "cache"
    with salusd(tmp_path, "--http", "127.0.0.1:0", "--job-root", str(root), "--cache-dir",
                str(cache), "--cache-bytes", "1M", "--checkpoint-every", "1000"):
        client = connect(tmp_path / "state")
        reply = client.post("/v1/jobs", json={"name": "cached", "iterations": ITERATIONS,
                                              "entrypoint": "cached.py:make_job", "devices": 2})
        assert reply.status_code == 201, reply.text
        jid = reply.json()["id"]
        info = wait_for(lambda: (j := job(client, jid))["state"] in ("finished", "failed") and j,
                        "the job to end", timeout_s=180)
        assert info["state"] == "finished", info["reason"]

    stats = info["cache"]
    sample_bytes = (cached.FEATURES + 1) * 4
    assert stats["source_reads"] == cached.SAMPLES
    assert stats["source_bytes"] == cached.SAMPLES * sample_bytes
    assert stats["memory"]["misses"] == cached.SAMPLES  # epoch 1, each at its owner
    assert stats["memory"]["hits"] == (EPOCHS - 1) * cached.SAMPLES
    assert stats["disk"]["stored_bytes"] == cached.SAMPLES * sample_bytes
    owner = pwd.getpwuid(os.getuid()).pw_name  # the daemon's user submitted it (admin token)
    assert [p.name for p in cache.iterdir()] == [owner]
    raw = [p for p in (cache / owner).rglob("*") if p.is_file() and p.stat().st_size ==
           sample_bytes]
    assert len(raw) == cached.SAMPLES, "level 1 holds each raw file once, at its owner"

    torch.set_num_threads(1)
    reference = cached.run_directly(str(root / "samples"), ITERATIONS).state_dict()
    for replica in (0, 1):
        loaded = checkpoint.load_latest(tmp_path / "state" / "checkpoints" / str(jid) /
                                        f"replica{replica}")
        assert loaded is not None and loaded.iteration == ITERATIONS, info["reason"]
        got = loaded.payload["objects"]["model"].state_dict()
        for key, want in reference.items():
            assert torch.allclose(got[key], want, rtol=0, atol=1e-6), (replica, key)

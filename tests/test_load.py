"""A bounded load test on loopback: 200 clients connect to the real daemon, run a few
iterations and leave (every fifth abruptly, without closing its job) while a poller reads the
REST API; the daemon stays up, its memory returns to within 10 % of its baseline, and every
job is accounted for (the abandoned ones failed, saying their client went away)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from daemon_proc import rss, salusd
from rest_client import connect, wait_for
from torch import nn

import salus.adapters.torch as salus

CLIENTS = 200
ITERATIONS = 3


def _client(address: str, index: int) -> int:
    model = nn.Linear(4, 2)
    job = salus.connect(f"load-{index}", ITERATIONS, address=address, timeout_s=60)
    remote = job.attach(model=model)
    step = remote.iteration(lambda s, x: s.model(x).sum())
    for _ in range(ITERATIONS):
        step(torch.ones(2, 4))
    if index % 5 == 0:
        job._channel.close()  # gone without a word: the daemon must end the job itself
        if job._direct is not None:
            job._direct.channel.close()
    else:
        job.close()
    return ITERATIONS


@pytest.mark.slow
def test_200_clients_and_rest_polling(tmp_path):
    with salusd(tmp_path, "--http", "127.0.0.1:0", "--max-connections", "1024",
                memory="2G") as (proc, address):
        client = connect(tmp_path / "state")
        with ThreadPoolExecutor(16) as pool:  # warm-up: allocator and pools at steady state
            assert sum(pool.map(lambda i: _client(address, i), range(1000, 1064))) == 192
        time.sleep(1.0)
        baseline = rss(proc.pid)
        stop = threading.Event()
        polls = []

        def poll() -> None:
            while not stop.is_set() and len(polls) < 5000:
                polls.append(client.get("/v1/jobs").status_code)
                client.get("/v1/lanes")
                time.sleep(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            with ThreadPoolExecutor(16) as pool:
                ran = sum(pool.map(lambda i: _client(address, i), range(CLIENTS)))
        finally:
            stop.set()
            poller.join(60)
        assert ran == CLIENTS * ITERATIONS
        assert polls and set(polls) == {200}
        jobs = wait_for(lambda: (js := [j for j in client.get("/v1/jobs").json()
                                        if j["name"].startswith("load-") and
                                        int(j["name"][5:]) < CLIENTS])
                        and all(j["state"] in ("finished", "failed") for j in js) and js,
                        "every job ended", timeout_s=120)
        assert len(jobs) == CLIENTS
        # A job whose client left without closing it failed, saying so; the others finished.
        for j in jobs:
            gone = int(j["name"][5:]) % 5 == 0
            assert j["state"] == ("failed" if gone else "finished"), j
        done = {j["iterations_done"] for j in jobs}
        assert done == {ITERATIONS}, sorted(done)
        time.sleep(1.0)
        after = rss(proc.pid)
        assert proc.poll() is None
        assert after <= baseline * 1.10, (baseline, after)

"""An interactive job survives `kill -9` of salusd: restarted, the daemon brings it back
suspended at its last checkpoint, the same script connecting again gets it with
`job.resumed_from`, and finishing from there gives the parameters of an uninterrupted run."""

from __future__ import annotations

import signal

import torch
from daemon_proc import salusd
from rest_client import connect, job, wait_for
from torch import nn

import salus.adapters.torch as salus

ITERATIONS = 16


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
            for _ in range(ITERATIONS)]


def _step(s, x, y):
    s.opt.zero_grad()
    loss = nn.functional.mse_loss(s.model(x), y)
    loss.backward()
    s.opt.step()
    return loss


def _run(address, first, last):
    """The script: connect, attach, run batches [resumed_from or first, last)."""
    model, opt = _model()
    job_ = salus.connect("resumable", ITERATIONS, address=address)
    remote = job_.attach(model=model, opt=opt)
    step = remote.iteration(_step)
    start = job_.resumed_from or first
    for x, y in _batches()[start:last]:
        step(x, y)
    return job_, remote, start


def test_interactive_job_resumes_after_kill_9(tmp_path):
    with salusd(tmp_path, "--http", "127.0.0.1:0", "--checkpoint-every", "5") as (proc, addr):
        job_, _, start = _run(addr, 0, 12)
        assert start == 0
        client = connect(tmp_path / "state")
        # Every 5 iterations, as the executor reports them (leased calls in batches).
        wait_for(lambda: (job(client, int(job_.id))["checkpoint"] or {}).get("iteration", 0)
                 >= 5, "an automatic checkpoint")
        made = client.post(f"/v1/jobs/{job_.id}/checkpoint")
        assert made.status_code == 200 and made.json()["checkpoint"]["iteration"] == 12
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with salusd(tmp_path, "--http", "127.0.0.1:0", "--checkpoint-every", "5") as (_, addr):
        client = connect(tmp_path / "state")
        restored = wait_for(lambda: (j := job(client, int(job_.id)))["resumed_from"] == 12
                            and j, "the restored job")
        assert restored["state"] == "suspended"
        again, remote, start = _run(addr, 0, ITERATIONS)
        assert again.id == job_.id and start == 12
        pulled = again.state_dict()
        again.close()
    torch.set_num_threads(1)
    model, opt = _model()

    class S:
        pass

    s = S()
    s.model, s.opt = model, opt
    for x, y in _batches():
        _step(s, x, y)
    for key, value in model.state_dict().items():
        assert torch.allclose(pulled[key], value, rtol=0, atol=1e-6), key

"""Interactive data-parallel jobs: `salus.connect(devices=2)` through the real daemon with 2 CPU
devices.

The reference for training is one plain process stepping on the whole batches, with the same
thread count. The gang's replicas each take half a batch and average their gradients, so the
float sums run in another order (two half-batch means averaged against one mean): hence 1e-6,
not equality.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from daemon_proc import salusd
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.wire.errors import JobFailed, SalusError

STEPS = 6
BATCH = 8


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g))
            for _ in range(steps)]


def _direct(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[nn.Module, list[float]]:
    """The same training in this process, one step per whole batch."""
    torch.set_num_threads(1)
    model, opt = _model()
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def _close(got: dict[str, torch.Tensor], want: nn.Module) -> float:
    """The largest difference between the pulled parameters and the reference's."""
    return max(float((got[k] - v).abs().max()) for k, v in want.state_dict().items())


def _step(s, x, y, algorithm="ring"):
    s.opt.zero_grad()
    loss = nn.functional.mse_loss(s.model(x), y)
    loss.backward()
    s.comm.all_reduce_gradients(s.model, algorithm=algorithm)
    s.opt.step()
    return loss


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gang")
    with salusd(tmp, "--cancel-grace", "2") as (proc, addr):
        yield SimpleNamespace(proc=proc, addr=addr, log=tmp / "salusd.log")
    assert proc.poll() is None or proc.returncode == -signal.SIGKILL


def test_gang_training_equals_one_process_on_the_whole_batch(daemon):
    batches = _batches()
    want, losses = _direct(batches)
    # ring: each tensor split in halves by salusd; tree: the client gives one half per replica
    for name, split_here in (("ring", False), ("tree", True)):
        model, opt = _model()
        with salus.connect(f"gang-{name}", STEPS, address=daemon.addr, devices=2) as job:
            assert job.devices == 2
            remote = job.attach(model=model, opt=opt)
            fn = remote.iteration(_step)
            for x, y in batches:
                if split_here:
                    fn(salus.per_replica(x[:4], x[4:]), salus.per_replica(y[:4], y[4:]),
                       algorithm=name)
                else:
                    fn(x, y, algorithm=name)
            info = job.info()
            assert info["devices"] == 2 and info["iterations_done"] == STEPS
            assert sorted(d for d, _ in info["replica_lanes"]) == [0, 1]
            assert info["comm"]["last_algorithm"] == name
            remote.pull()
        assert _close(dict(model.state_dict()), want) < 1e-6, name
    # train_step averages over the gang and returns the whole batch's mean loss
    model, opt = _model()
    with salus.connect("gang-sugar", STEPS, address=daemon.addr, devices=2) as job:
        step = job.train_step(model, opt, nn.functional.mse_loss)
        got = [step(x, y) for x, y in batches]
        assert max(abs(a - b) for a, b in zip(got, losses, strict=True)) < 1e-6
        assert _close(job.state_dict(), want) < 1e-6


def test_gang_inference_returns_the_whole_batch(daemon):
    model, _ = _model()
    x = torch.randn(7, 8)  # odd: parts of 4 and 3
    with salus.connect("gang-infer", 2, address=daemon.addr, devices=2) as job:
        infer = job.inference(model)
        out = infer(x)
    assert out.shape == (7, 1)
    torch.set_num_threads(1)
    with torch.inference_mode():
        assert float((out - model(x)).abs().max()) < 1e-6


def _draw(s, x):
    """Every replica's draw (gathered on replica 0) and its part of `x`."""
    drawn = torch.rand(3)
    both = [torch.empty(3), torch.empty(3)]
    s.comm.all_gather(both, drawn)
    return torch.stack(both), x


def test_gang_random_stream_continues_the_clients(daemon):
    model, _ = _model()
    with salus.connect("gang-rng", 4, address=daemon.addr, devices=2) as job:
        remote = job.attach(model=model)
        draw = remote.iteration(_draw)
        torch.manual_seed(11)
        both, part = draw(salus.whole(torch.arange(4.0)))
        after = torch.rand(2)
        _, half = draw(torch.arange(4.0))  # split by default: replica 0 answers with its half
    assert torch.equal(half, torch.arange(2.0))
    torch.manual_seed(11)
    want = torch.rand(3)
    assert torch.equal(both[0], want) and torch.equal(both[1], want)
    assert torch.equal(after, torch.rand(2))  # the client goes on after the job's draw
    assert torch.equal(part, torch.arange(4.0))  # Whole: not split


def _raise_everywhere(s):
    raise ValueError("bad input on every replica")


def _raise_on_one(s):
    if s.comm.rank == 1:
        raise RuntimeError("only replica 1 fails")
    return 1.0


def _raise_then_collective(s):
    if s.comm.rank == 1:
        raise RuntimeError("replica 1 fails before the allreduce")
    t = torch.ones(1)
    s.comm.all_reduce(t)
    return t


def test_gang_call_errors(daemon):
    model, _ = _model()
    with salus.connect("gang-err", 8, address=daemon.addr, devices=2) as job:
        remote = job.attach(model=model)
        with pytest.raises(ValueError, match="bad input on every replica"):
            remote.call(_raise_everywhere)
        assert remote.call(lambda s: s.comm.size) == 2  # the job goes on
    for fn, says in ((_raise_on_one, "states may differ"),
                     (_raise_then_collective, "did not return within 2 s")):
        model, _ = _model()
        job = salus.connect(f"gang-{fn.__name__}", 8, address=daemon.addr, devices=2)
        remote = job.attach(model=model)
        with pytest.raises(JobFailed, match=says):
            remote.call(fn)
        info = job.info()
        assert info["state"] == "failed" and "replica(s) [1]" in info["reason"]
        with pytest.raises(JobFailed):
            remote.call(lambda s: 1)
        job.close()
    # the daemon and a new gang are fine
    with salus.connect("gang-after", 2, address=daemon.addr, devices=2) as job:
        assert job.attach(model=_model()[0]).call(lambda s: s.comm.rank) == 0


def test_gang_refusals(daemon):
    with pytest.raises(SalusError, match="this node has 2 device"):
        salus.connect("too-wide", 2, address=daemon.addr, devices=3)
    with pytest.raises(ValueError, match="devices must be an int"):
        salus.connect("zero", 2, address=daemon.addr, devices=0)


def test_gang_resumes_after_kill_9(tmp_path: Path):
    """kill -9 of salusd mid-training: the gang comes back suspended at its checkpoint, the
    script connects again with devices=2 and finishes; parameters equal one process's."""
    steps = 10
    batches = _batches(steps)

    def run(addr: str, last: int) -> tuple[salus.Job, int]:
        model, opt = _model()
        job = salus.connect("gang-resume", steps, address=addr, devices=2)
        remote = job.attach(model=model, opt=opt)
        step = remote.iteration(_step)
        start = job.resumed_from
        for x, y in batches[start:last]:
            step(x, y)
        return job, start

    with salusd(tmp_path, "--checkpoint-every", "3") as (proc, addr):
        job, start = run(addr, 7)
        assert start == 0
        job.info()  # every call before it has been accounted (and checkpointed at 3 and 6)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with salusd(tmp_path, "--checkpoint-every", "3") as (_, addr):
        with pytest.raises(SalusError, match="connect with devices=2"):
            salus.connect("gang-resume", steps, address=addr, devices=1)
        job, start = run(addr, steps)
        assert start == 6
        pulled = job.state_dict()
        job.close()
    want, _ = _direct(batches)
    assert _close(pulled, want) < 1e-6

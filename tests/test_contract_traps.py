"""Ports written the obvious way either work or fail loudly, against the real `salusd serve`
process: pull brings back train/eval modes and non-persistent buffers, a module with layers in
a plain list is refused, an attached object changed on the client is refused before a pull
overwrites it, closing without pull warns, LBFGS trains, and info counts calls run under a
lease. Expected values come from the same steps run directly, with the daemon's thread count
(1)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_proc import salusd
from torch import nn

import salus.adapters.torch as salus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with salusd(Path(tmp_path_factory.mktemp("traps"))) as (_, addr):
        yield addr


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the daemon's executors (--cpu-threads 1)
    yield
    torch.set_num_threads(threads)


class Counted(nn.Module):
    """Batch norm, and a non-persistent buffer (left out of state_dict) counting the batches
    seen in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 2)
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += 1
        return self.b(torch.relu(self.bn(self.a(x))))


def data(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(16, 4, generator=g) for _ in range(n)]


def sgd_step(s: Any, x: torch.Tensor) -> torch.Tensor:
    s.opt.zero_grad()
    loss = s.model(x).pow(2).mean()
    loss.backward()
    s.opt.step()
    return loss.detach()


class Direct:
    """The job's objects, for running its functions directly."""

    def __init__(self, **objects: Any) -> None:
        self.__dict__.update(objects)


def test_pull_brings_back_modes_and_non_persistent_buffers(address: str) -> None:
    torch.manual_seed(0)
    model = Counted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    direct = Direct(model=copy.deepcopy(model))
    direct.opt = torch.optim.SGD(direct.model.parameters(), lr=0.1)
    batches = data(4)
    with salus.connect(name="modes", iterations=4, address=address) as job:
        remote = job.attach(model=model, opt=opt)
        step = remote.iteration(sgd_step)
        for x in batches:
            step(x)
        remote.call(lambda s: s.model.eval())
        remote.pull()
    for x in batches:
        sgd_step(direct, x)
    direct.model.eval()
    assert [m.training for m in model.modules()] == [False] * 4
    assert model.seen.item() == direct.model.seen.item() == 4
    probe = data(5)[-1]
    torch.testing.assert_close(model(probe), direct.model(probe), atol=1e-6, rtol=0)


class PlainList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(4, 4), nn.Linear(4, 2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_layers_in_a_plain_list_are_refused_at_attach_naming_them(address: str) -> None:
    with salus.connect(name="plain-list", iterations=1, address=address) as job:
        with pytest.raises(TypeError, match=r"model\.layers is a plain list .*nn\.ModuleList"):
            job.attach(model=PlainList())
        assert job.remote is None


def test_a_module_run_in_train_mode_on_the_client_is_refused_at_the_next_pull(
        address: str) -> None:
    torch.manual_seed(0)
    model = Counted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = data(3)
    with salus.connect(name="client-forward", iterations=3, address=address) as job:
        remote = job.attach(model=model, opt=opt)
        step = remote.iteration(sgd_step)
        step(batches[0])
        remote.pull()
        model.eval()
        model(batches[1])  # eval mode: nothing of the model changes
        step(batches[1])
        remote.pull()
        model(batches[1])  # train mode (as the job has it): batch norm's statistics move
        step(batches[2])
        with pytest.raises(RuntimeError, match=r"'model'.*train mode.*s\.model\(x\)"):
            remote.pull()
        remote.pull()  # told once: the script may go on


def test_an_lr_scheduler_stepped_on_the_client_is_refused_at_the_next_call(
        address: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    direct = Direct(model=copy.deepcopy(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    direct.opt = torch.optim.SGD(direct.model.parameters(), lr=0.1)
    direct.sched = torch.optim.lr_scheduler.StepLR(direct.opt, step_size=1, gamma=0.5)
    batches = data(2)
    with salus.connect(name="client-sched", iterations=2, address=address) as job:
        remote = job.attach(model=model, opt=opt, sched=sched)
        step = remote.iteration(sgd_step)
        step(batches[0])
        with warnings.catch_warnings():  # torch: the client's optimizer never stepped
            warnings.simplefilter("ignore")
            sched.step()  # the obvious port: the job never sees it, the next pull undoes it
        with pytest.raises(RuntimeError, match=r"remote\.call\(lambda s: s\.sched\.step\(\)\)"):
            step(batches[1])
        remote.call(lambda s: s.sched.step())  # what the error says to do
        step(batches[1])
        remote.pull()
    sgd_step(direct, batches[0])
    direct.sched.step()
    sgd_step(direct, batches[1])
    assert sched.last_epoch == direct.sched.last_epoch == 1
    assert opt.param_groups[0]["lr"] == direct.opt.param_groups[0]["lr"] == pytest.approx(0.05)
    torch.testing.assert_close(model.weight, direct.model.weight, atol=1e-6, rtol=0)


def test_closing_after_calls_without_pull_warns_unless_told(address: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    start = copy.deepcopy(model)
    direct = Direct(model=copy.deepcopy(model))
    direct.opt = torch.optim.SGD(direct.model.parameters(), lr=0.1)
    x = data(1)[0]
    sgd_step(direct, x)

    def trained(close: dict[str, bool]) -> None:
        model.load_state_dict(start.state_dict())
        job = salus.connect(name="unpulled", iterations=1, address=address)
        remote = job.attach(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))
        remote.iteration(sgd_step)(x)
        job.close(**close)

    with pytest.warns(UserWarning, match=r"discards the state .* remote\.pull\(\)"):
        trained({})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trained({"pull": False})
        torch.testing.assert_close(model.weight, start.weight, atol=0, rtol=0)
        trained({"pull": True})
        torch.testing.assert_close(model.weight, direct.model.weight, atol=1e-6, rtol=0)
        with salus.connect(name="inference", iterations=1, address=address) as job:
            job.inference(model)(x)


def test_lbfgs_trains_in_the_job_as_in_a_direct_run(address: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    direct = Direct(model=copy.deepcopy(model))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    direct.opt = torch.optim.LBFGS(direct.model.parameters(), lr=0.5, max_iter=5)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)

    def lbfgs_step(s: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def closure() -> torch.Tensor:
            s.opt.zero_grad()
            loss = (s.model(x) - y).pow(2).mean()
            loss.backward()
            return loss
        return s.opt.step(closure).detach()

    with salus.connect(name="lbfgs", iterations=3, address=address) as job:
        remote = job.attach(model=model, opt=opt)
        step = remote.iteration(lbfgs_step)
        losses = [step(x, y).item() for _ in range(3)]
        remote.pull()
    expected = [lbfgs_step(direct, x, y).item() for _ in range(3)]
    assert losses == pytest.approx(expected, abs=1e-6)
    for mine, theirs in zip(model.parameters(), direct.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    assert opt.state_dict()["state"][0]["n_iter"] == direct.opt.state_dict()["state"][0]["n_iter"]


def test_info_counts_the_calls_run_under_a_lease(address: str) -> None:
    with salus.connect(name="leased", iterations=12, address=address) as job:
        remote = job.attach(model=nn.Linear(4, 2))
        step = remote.iteration(lambda s, x: s.model(x).sum())
        failing = remote.function(lambda s: 1 / 0)
        for x in data(12):
            step(x)
        with pytest.raises(ZeroDivisionError):
            failing()
        info = job.info()
        job.close(pull=False)
    assert (info["iterations_done"], info["calls_done"], info["calls_failed"]) == (12, 13, 1)


def test_running_past_the_declared_iterations_warns_once(address: str) -> None:
    model = nn.Linear(4, 2)
    xs = data(4)
    with salus.connect(name="overrun", iterations=2, address=address) as job:
        step = job.attach(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1)
                          ).iteration(sgd_step)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(xs[0])
            step(xs[1])  # the declared two: no warning
        with pytest.warns(UserWarning, match=r"ran past the 2 iterations it declared") as seen:
            step(xs[2])
            step(xs[3])
        assert len([w for w in seen if "ran past" in str(w.message)]) == 1
        job.close(pull=False)

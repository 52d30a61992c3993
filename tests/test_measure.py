"""Measuring a job in its executor: the storage tracker, exact persistent bytes, and the
fake-tensor estimate of a call's peak against the same call's measured peak."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from salus.daemon.executor.measure import (
    EstimationError,
    StorageTracker,
    estimate_call_peak,
    optimizer_state_tensors,
    state_bytes,
    state_footprint,
)

MIB = 2**20

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True),
}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (_mlp, (64,)),
    "cnn": (_cnn, (3, 16, 16)),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _iteration(s: SimpleNamespace, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A job's training iteration, as a user writes it for `@remote.iteration`."""
    s.opt.zero_grad(set_to_none=False)
    loss = nn.functional.cross_entropy(s.model(x), y)
    loss.backward()
    s.opt.step()
    return loss.detach()


def _measured_peak(fn: Callable[..., object], state: SimpleNamespace,
                   *args: torch.Tensor) -> int:
    """Peak ephemeral bytes of the real call in steady state: a first, untracked call creates
    the gradients and the optimizer state, the second is tracked."""
    fn(state, *args)
    with StorageTracker() as tracker:
        out = fn(state, *args)
        del out
    return tracker.peak_bytes


def test_tracker_counts_exact_bytes_of_a_known_sequence() -> None:
    existing = torch.zeros(1000)
    with StorageTracker() as tracker:
        a = torch.empty(1000, dtype=torch.float32)  # 4000
        b = torch.empty(250, dtype=torch.float64)  # 2000 -> live 6000
        a_view = a[10:20].view(2, 5)  # aliases a: nothing new
        existing.add_(1)  # in place on a storage from before: nothing new
        alias = existing[:10]  # view of an untracked storage: nothing new
        del a  # its storage lives on through a_view
        c = torch.ones(3000, dtype=torch.uint8)  # live 9000 = peak
        del a_view
        assert tracker.live_bytes == 5000
        d = existing * 2  # 4000 -> live 9000 again
        del b, c
        assert tracker.live_bytes == 4000
    assert tracker.peak_bytes == 9000
    del d, alias
    assert tracker.live_bytes == 0  # frees after exit still count


def test_tracker_sees_autograd_saved_tensors() -> None:
    x = torch.randn(128, 256, requires_grad=True)
    with StorageTracker() as tracker:
        y = torch.sigmoid(x)  # saved for backward
        z = (y * 3).sum()
        z.backward()
        del y, z
    assert tracker.peak_bytes >= 2 * 128 * 256 * 4  # sigmoid output and the mul result
    assert x.grad is not None


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("model_name", MODELS)
def test_state_bytes_is_exact_before_the_first_step(model_name: str, opt_name: str) -> None:
    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    opt = OPTIMIZERS[opt_name](list(model.parameters()))
    predicted = state_bytes([model, opt])  # what an executor reports at attach
    assert not opt.state and all(p.grad is None for p in model.parameters())

    _iteration(SimpleNamespace(model=model, opt=opt), torch.randn(4, *shape),
               torch.randint(0, 10, (4,)))

    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()),
               *optimizer_state_tensors(opt)]
    exact = sum(_nbytes(t) for t in tensors if t is not None)
    assert predicted == exact
    assert state_bytes([model, opt]) == exact  # the real state now


def test_state_bytes_counts_frozen_parameters_without_gradients() -> None:
    model = nn.Linear(10, 10)
    model.bias.requires_grad_(False)
    opt = torch.optim.Adam([model.weight])
    weight, bias = 100 * 4, 10 * 4
    step = 4  # Adam's float32 step counter
    assert state_bytes([model, opt]) == weight + bias + weight + 2 * weight + step
    assert state_bytes([model]) == weight + bias + weight


def test_state_footprint_books_the_mlp_1024_trainer_in_reserved_units() -> None:
    # bench/gpu/models.py mlp(1024) with SGD momentum, before its first step. By hand, from
    # the caching allocator's rules: nine 4 MiB tensors (weights, gradients, momentum) take
    # 20 MiB segments five at a time (two segments), nine 4 KiB biases one 2 MiB segment.
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    footprint = state_footprint([model, opt])
    assert footprint.bytes == state_bytes([model, opt]) == 3 * 3 * (1024 * 1024 + 1024) * 4
    assert footprint.reserved_bytes == 42 * MIB


def test_the_estimate_replays_the_calls_storages_in_reserved_units() -> None:
    state = SimpleNamespace(w=torch.zeros(1024, 1024))

    def call(s: SimpleNamespace, x: torch.Tensor) -> torch.Tensor:
        a = s.w * 2  # 4 MiB: a 20 MiB segment, split
        b = a + 1  # 4 MiB from the rest
        del a
        c = b * x  # a's freed block, the best fit
        return c.sum()  # 4 bytes: a 2 MiB small segment

    peak = estimate_call_peak(call, state, (torch.ones(()),), {})
    assert peak.bytes == 8 * MIB + 4
    assert peak.reserved_bytes == 20 * MIB + 2 * MIB


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam"])
@pytest.mark.parametrize("model_name", MODELS)
def test_estimate_tracks_the_measured_peak(model_name: str, opt_name: str) -> None:
    make, shape = MODELS[model_name]
    peaks = []
    for batch in (8, 256):
        torch.manual_seed(0)
        model = make()
        opt = OPTIMIZERS[opt_name](list(model.parameters()))
        state = SimpleNamespace(model=model, opt=opt)
        x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.get_rng_state()
        estimate = estimate_call_peak(_iteration, state, (x, y), {}).bytes
        assert torch.equal(rng, torch.get_rng_state())
        assert not opt.state and all(p.grad is None for p in model.parameters())
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        measured = _measured_peak(_iteration, state, x, y)
        assert 0.5 * measured <= estimate <= 2 * measured, (estimate, measured)
        peaks.append((estimate, measured))
    (est_small, meas_small), (est_big, meas_big) = peaks
    assert est_big > est_small and meas_big > meas_small


def test_estimate_of_a_users_own_iteration_function_matches_the_measured_peak() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = SimpleNamespace(model=model, opt=opt)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))

    rng = torch.get_rng_state()
    estimate = estimate_call_peak(_iteration, state, (x, y), {}).bytes
    assert torch.equal(torch.get_rng_state(), rng)
    assert not opt.state and all(p.grad is None for p in model.parameters())  # untouched
    assert estimate == _measured_peak(_iteration, state, x, y)


def test_estimate_handles_data_dependent_scalars() -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = float(x.abs().max().item())  # a value fake tensors do not have
            return self.fc(x) / (scale + 1.0)

    def step(s: SimpleNamespace, x: torch.Tensor) -> torch.Tensor:
        s.opt.zero_grad()
        loss = s.model(x).square().mean()
        loss.backward()
        s.opt.step()
        return loss.detach()

    model = Gate()
    state = SimpleNamespace(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))
    estimate = estimate_call_peak(step, state, (torch.randn(16, 32),), {}).bytes
    assert estimate >= 16 * 32 * 4  # at least the linear layer's output


def test_estimate_reports_data_dependent_shapes_clearly() -> None:
    class Nonzero(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)[x > 0]

    state = SimpleNamespace(model=Nonzero())
    with pytest.raises(EstimationError, match="measured first iteration"):
        estimate_call_peak(lambda s, x: s.model(x).sum(), state, (torch.randn(4, 8),), {})


def test_estimate_follows_foreach_optimizer_kernels() -> None:
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    estimates, measured = [], []
    for foreach in (False, True):
        torch.manual_seed(0)
        model = _mlp()
        state = SimpleNamespace(model=model,
                                opt=torch.optim.Adam(model.parameters(), foreach=foreach))
        estimates.append(estimate_call_peak(_iteration, state, (x, y), {}).bytes)
        measured.append(_measured_peak(_iteration, state, x, y))
        assert 0.5 * measured[-1] <= estimates[-1] <= 2 * measured[-1]
    # foreach Adam holds one temporary per parameter at once, the single-tensor loop holds two
    # for one parameter at a time: the peaks differ, and the estimate must follow the kernels.
    assert estimates[0] != estimates[1]
    assert (estimates[1] > estimates[0]) == (measured[1] > measured[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_estimate_tracks_the_measured_peak_of_a_cuda_iteration() -> None:
    torch.manual_seed(0)
    model = _mlp().cuda()
    state = SimpleNamespace(model=model, opt=torch.optim.Adam(model.parameters()))
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    estimate = estimate_call_peak(_iteration, state, (x, y), {}).bytes
    measured = _measured_peak(_iteration, state, x, y)
    assert 0.5 * measured <= estimate <= 2 * measured


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reserved_figures_cover_what_the_caching_allocator_reserves() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(256, 1024, device="cuda"), torch.randn(256, 1024, device="cuda")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()  # the batch's, which is not the job's state
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(3))).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = SimpleNamespace(model=model, opt=opt)
    persistent = state_footprint([model, opt]).reserved_bytes
    estimate = estimate_call_peak(_mse_iteration, state, (x, y), {}).reserved_bytes
    _mse_iteration(state, x, y)  # the state's gradients and momentum now exist
    torch.cuda.synchronize()
    # The cuBLAS(Lt) workspaces sit in the allocator too; they are booked per process, apart.
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved() - base
    torch.cuda.reset_peak_memory_stats()
    _mse_iteration(state, x, y)
    torch.cuda.synchronize()
    call = torch.cuda.max_memory_reserved() - base - held
    print(f"persistent reserved {held} booked {persistent}; call {call} booked {estimate}")
    assert held <= persistent
    assert call <= estimate + 2 * (32 + 2) * MIB  # with the workspaces of two threads at most


def _mse_iteration(s: SimpleNamespace, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    s.opt.zero_grad()
    loss = nn.functional.mse_loss(s.model(x), y)
    loss.backward()
    s.opt.step()
    return loss.detach()


def test_on_a_gpu_host_the_call_is_estimated_on_fake_cuda_tensors_without_starting_cuda(
        ) -> None:
    """Faked on the GPU, a call is estimated as it will run there: its arguments' copy onto
    the device counts (as the executor's does); no CUDA context is made for it. Where torch
    has CUDA, a training step with Adam runs too, its `step` kept on the CPU as placing the
    state keeps it (backward and autocast on fake CUDA tensors need torch's CUDA build)."""
    model = nn.Linear(256, 512, bias=False)
    state = SimpleNamespace(model=model, opt=torch.optim.Adam(model.parameters()))

    def forward(s: SimpleNamespace, x: torch.Tensor) -> torch.Tensor:
        return s.model(x)

    def train(s: SimpleNamespace, x: torch.Tensor) -> torch.Tensor:
        s.opt.zero_grad()
        loss = s.model(x).square().mean()
        loss.backward()
        s.opt.step()
        return loss.detach()

    x = torch.ones(8, 256)
    served = SimpleNamespace(model=nn.Linear(256, 512, bias=False).requires_grad_(False))
    on_cpu = estimate_call_peak(forward, served, (x,), {})
    on_gpu = estimate_call_peak(forward, served, (x,), {}, torch.device("cuda"))
    assert on_cpu.bytes == 8 * 512 * 4  # the output alone
    assert on_gpu.bytes == 8 * 256 * 4 + 8 * 512 * 4  # and the argument's copy on the GPU
    assert not torch.cuda.is_initialized()
    if torch.cuda.is_available():  # backward on fake CUDA tensors needs torch's CUDA build
        trained = estimate_call_peak(train, state, (x,), {}, torch.device("cuda"))
        assert trained.bytes >= 512 * 256 * 4  # at least the gradient
        assert not state.opt.state  # the real state untouched

"""Arena views and ResidentState: training with state inside the arena equals normal training."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from salus.daemon.memory import Arena, OutOfArenaMemory, ResidentState

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // 256) * 256


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))


def _batches(n: int, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 12, generator=gen).to(device),
             torch.randint(0, 3, (16,), generator=gen).to(device)) for _ in range(n)]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _persistent_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *grads, *model.buffers(), *state]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64, torch.int8, torch.bool, torch.complex128])
def test_views_of_any_dtype_are_disjoint(dtype: torch.dtype) -> None:
    arena = Arena(64 * 1024)
    shapes = [(3, 5), (7,), (2, 3, 4), (0, 3), ()]
    tensors = [arena.alloc_tensor(shape, dtype) for shape in shapes]
    for i, (offset, view) in enumerate(tensors):
        assert offset % 256 == 0 and view.shape == torch.Size(shapes[i]) and view.dtype == dtype
        assert view.is_contiguous() and arena.owns(view)
        view.fill_(i + 1 if dtype != torch.bool else True)
    for i, (_, view) in enumerate(tensors):
        expected = torch.full(shapes[i], i + 1 if dtype != torch.bool else True, dtype=dtype)
        assert torch.equal(view, expected), "a neighbour's write leaked into this view"
    assert arena.stats().used == sum(_aligned(torch.Size(s).numel() * dtype.itemsize)
                                     for s in shapes)


def test_views_keep_their_own_autograd_version() -> None:
    arena = Arena(4096)
    _, a = arena.alloc_tensor((4,), torch.float32)
    _, b = arena.alloc_tensor((4,), torch.float32)
    before = b._version
    a.add_(1)
    assert b._version == before


def test_view_checks_the_chunk_size_and_offsets() -> None:
    arena = Arena(4096 + 100)
    assert arena.capacity == 4096
    offset = arena.alloc(256)
    with pytest.raises(ValueError, match="needs 260 bytes"):
        arena.view(offset, (65,), torch.float32)
    with pytest.raises(ValueError, match="non-negative"):
        arena.view(offset, (-1,), torch.float32)
    with pytest.raises(ValueError, match="live allocation"):
        arena.view(offset + 256, (1,), torch.float32)
    assert not arena.owns(torch.zeros(3))
    arena.free(offset)
    assert arena.stats().used == 0
    with pytest.raises(ValueError, match="at least 256"):
        Arena(100)


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_training_in_the_arena_matches_normal_training(opt_name: str) -> None:
    resident_model, reference = _mlp(), _mlp()
    resident_opt = OPTIMIZERS[opt_name](list(resident_model.parameters()))
    reference_opt = OPTIMIZERS[opt_name](list(reference.parameters()))
    arena = Arena(1 << 20)
    params_before = list(resident_model.parameters())
    state = ResidentState.place(arena, resident_model, resident_opt)
    assert all(arena.owns(p) and p.grad is not None and arena.owns(p.grad)
               for p in resident_model.parameters())
    assert all(arena.owns(b) for b in resident_model.buffers())

    for i, (x, y) in enumerate(_batches(8)):
        _step(resident_model, resident_opt, x, y)
        _step(reference, reference_opt, x, y)
        if i == 0:
            state.adopt_optimizer_state()
        if i == 4:
            state.swap_out()
            assert state.swapped and arena.stats().used == 0 and state.nbytes == 0
            assert not any(arena.owns(t) for t in _persistent_tensors(resident_model,
                                                                       resident_opt))
            state.swap_in()
            assert not state.swapped
        persistent = _persistent_tensors(resident_model, resident_opt)
        assert all(arena.owns(t) for t in persistent), "a persistent tensor left the arena"
        expected = sum(_aligned(t.numel() * t.element_size()) for t in persistent)
        assert arena.stats().used == state.nbytes == expected

    assert list(resident_model.parameters()) == params_before  # same Parameter objects
    for (name, got), want in zip(resident_model.state_dict().items(),
                                 reference.state_dict().values(), strict=True):
        assert torch.equal(got, want), f"{name} differs from normal training"
    for p, q in zip(resident_model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)

    state.release()
    assert arena.stats().used == 0 and arena.stats().num_allocations == 0
    assert not any(arena.owns(t) for t in _persistent_tensors(resident_model, resident_opt))
    x, y = _batches(1)[0]
    _step(resident_model, resident_opt, x, y)  # still usable on the host copies
    _step(reference, reference_opt, x, y)
    for got, want in zip(resident_model.state_dict().values(), reference.state_dict().values(),
                         strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="released"):
        state.swap_in()


def test_place_rolls_back_when_the_arena_is_too_small() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    pointers = [p.data_ptr() for p in model.parameters()]
    arena = Arena(2048)
    with pytest.raises(OutOfArenaMemory) as err:
        ResidentState.place(arena, model, opt)
    assert any("while placing" in note for note in err.value.__notes__)
    assert arena.stats().used == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


def test_swap_in_fails_cleanly_when_the_arena_filled_up() -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    arena = Arena(64 * 1024)
    state = ResidentState.place(arena, model, opt)
    _step(model, opt, *_batches(1)[0])
    state.adopt_optimizer_state()
    held = state.nbytes
    snapshot = {name: t.clone() for name, t in model.state_dict().items()}
    state.swap_out()
    squatter = arena.alloc(arena.capacity - held // 2)
    with pytest.raises(OutOfArenaMemory):
        state.swap_in()
    assert state.swapped and arena.stats().used == arena.size_of(squatter)
    arena.free(squatter)
    filler = arena.alloc(256)  # moves the layout: offsets after swap-in differ
    state.swap_in()
    assert state.nbytes == held and arena.stats().used == held + 256
    assert all(torch.equal(t, snapshot[name]) for name, t in model.state_dict().items())
    arena.free(filler)
    with pytest.raises(ValueError, match="resident"):
        state.swap_in()


def test_reloaded_optimizer_state_is_readopted_without_leaking() -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    arena = Arena(1 << 20)
    state = ResidentState.place(arena, model, opt)
    _step(model, opt, *_batches(1)[0])
    state.adopt_optimizer_state()
    held = state.nbytes
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert not all(arena.owns(t) for s in opt.state.values() for t in s.values())
    state.adopt_optimizer_state()
    assert state.nbytes == held == arena.stats().used
    assert all(arena.owns(t) for s in opt.state.values() for t in s.values())
    arena.allocator.check_invariants()


def test_gradients_replaced_by_set_to_none_are_readopted() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arena = Arena(1 << 20)
    state = ResidentState.place(arena, model, opt)
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(_batches(1)[0][0]), _batches(1)[0][1]).backward()
    assert not any(arena.owns(p.grad) for p in model.parameters() if p.grad is not None)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    used = arena.stats().used
    state.adopt_gradients()
    assert all(p.grad is not None and arena.owns(p.grad) for p in model.parameters())
    assert all(p.grad is not None and torch.equal(p.grad, g)
               for p, g in zip(model.parameters(), grads, strict=True))
    assert arena.stats().used == used


def test_concurrent_allocations_stay_consistent() -> None:
    arena = Arena(1 << 20)

    def churn(seed: int) -> None:
        for i in range(300):
            offset, view = arena.alloc_tensor((seed + i % 7,), torch.int32)
            view.fill_(seed)
            assert bool((view == seed).all()), "another thread wrote into this chunk"
            arena.free(offset)

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    arena.allocator.check_invariants()
    assert arena.stats().used == 0 and arena.stats().peak <= 4 * 256


def test_tied_parameters_and_shared_buffers_are_placed_once() -> None:
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    arena = Arena(1 << 16)
    state = ResidentState.place(arena, model, None)
    expected = sum(2 * _aligned(p.numel() * p.element_size()) for p in shared.parameters())
    assert state.nbytes == expected
    assert model[0].weight is model[2].weight and arena.owns(model[2].weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_cuda_arena_training_and_pinned_swap(opt_name: str) -> None:
    device = torch.device("cuda")
    resident_model, reference = _mlp().to(device), _mlp().to(device)
    resident_opt = OPTIMIZERS[opt_name](list(resident_model.parameters()))
    reference_opt = OPTIMIZERS[opt_name](list(reference.parameters()))
    arena = Arena(1 << 22, device=device)
    state = ResidentState.place(arena, resident_model, resident_opt)
    for i, (x, y) in enumerate(_batches(6, device)):
        _step(resident_model, resident_opt, x, y)
        _step(reference, reference_opt, x, y)
        if i == 0:
            state.adopt_optimizer_state()
        if i == 3:
            state.swap_out()
            assert all(p.device.type == "cpu" and p.is_pinned()
                       for p in resident_model.parameters())
            state.swap_in()
            assert all(arena.owns(p) for p in resident_model.parameters())
    for got, want in zip(resident_model.state_dict().values(), reference.state_dict().values(),
                         strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    state.release()
    assert arena.stats().used == 0

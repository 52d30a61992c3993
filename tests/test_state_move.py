"""Every tensor of a job's state moves (salusd/executor/state_move.py): modules, optimizers'
state with their `step` where torch.optim keeps it, a GradScaler, tensors inside containers;
each tensor stays the same object, views stay views, and training goes on exactly as if the
state had not moved. On the CPU the copy is done by a recording stand-in for the device copy;
on a GPU, fused Adam with a GradScaler goes to cuda:0 and back bit-equal."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from salus.daemon.executor.state_move import destinations, move_state, relocate

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")


def _state(device: torch.device = CPU, fused: bool = True) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    model.to(device)
    w = torch.zeros(3, device=device, requires_grad=True)  # optimised directly, in no module
    opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=fused)
    plain = torch.optim.Adam([w], lr=0.1)  # neither fused nor capturable: `step` on the CPU
    scaler = torch.amp.GradScaler(device.type)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    base = torch.arange(10.0, device=device)
    state = {"model": model, "w": w, "opt": opt, "plain": plain, "scaler": scaler,
             "sched": sched, "notes": {"ema": torch.ones(2, device=device),
                                       "hist": [base, (base[2:5], 7)]}, "epoch": 3}
    _train(state, 2)
    return state


def _train(state: dict[str, Any], steps: int) -> None:
    model, opt, plain, scaler = state["model"], state["opt"], state["plain"], state["scaler"]
    device = state["w"].device
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator).to(device)
        opt.zero_grad()
        plain.zero_grad()
        loss = model(x).pow(2).mean() + (state["w"] - 1).pow(2).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.step(plain)
        scaler.update()
        state["sched"].step()
        with torch.no_grad():
            state["notes"]["ema"].mul_(0.9).add_(loss.detach())


def _tensors(state: dict[str, Any]) -> dict[str, Tensor]:
    """Every tensor the state holds, named, listed by hand from the objects' own APIs."""
    model, opt, plain, scaler = state["model"], state["opt"], state["plain"], state["scaler"]
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        out[f"param {name}"] = p
        out[f"grad {name}"] = p.grad
    for name, b in model.named_buffers():
        out[f"buffer {name}"] = b
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for key, value in opt.state[p].items():
            out[f"opt {i} {key}"] = value
    out["w"], out["w.grad"] = state["w"], state["w"].grad
    for key, value in plain.state[state["w"]].items():
        out[f"plain {key}"] = value
    out["scale"], out["growth"] = scaler._scale, scaler._growth_tracker
    out["ema"], out["base"] = state["notes"]["ema"], state["notes"]["hist"][0]
    out["view"] = state["notes"]["hist"][1][0]
    return out


def test_every_tensor_is_found_and_steps_stay_where_torch_keeps_them() -> None:
    state = _state()
    expected = {id(t): (name, CPU if name == "plain step" else GPU)
                for name, t in _tensors(state).items()}
    found = {id(t): where for t, where in destinations(state.values(), GPU)}
    assert found.keys() == expected.keys(), sorted(
        expected[i][0] for i in expected.keys() - found.keys())
    for key, (name, where) in expected.items():
        assert found[key] == where, name
    # Fused: the step is the fused kernel's input, on the device; plain Adam keeps it a CPU
    # scalar so that bias corrections need no synchronisation.
    assert any(name == "opt 0 step" for name, _ in expected.values())


class _Recorder:
    """A stand-in for the device copy: clones into new memory and records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.device]] = []

    def __call__(self, sources: Sequence[Tensor], device: torch.device) -> list[Tensor]:
        assert all(s.dtype == torch.uint8 and s.dim() == 1 for s in sources)
        self.calls.append((len(sources), device))
        return [s.clone() for s in sources]


def test_moved_in_place_each_tensor_stays_itself_and_views_stay_views() -> None:
    state = _state()
    twin = copy.deepcopy(state)
    named = _tensors(state)
    before = {name: t.detach().clone() for name, t in named.items()}
    storages = {t.untyped_storage().data_ptr() for t in named.values()}
    expected_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                          for t in named.values()}.values())
    recorder = _Recorder()
    moved = relocate(destinations(state.values(), CPU), recorder)
    assert recorder.calls == [(len(storages), CPU)]  # one copy call, one source per storage
    assert moved == expected_bytes
    after = _tensors(state)
    for name, t in after.items():
        assert t is named[name], name  # the same object, moved in place
        assert t.untyped_storage().data_ptr() not in storages, name  # on new memory
        assert torch.equal(t, before[name]), name
    view, base = after["view"], after["base"]
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    base[3] = -1.0
    assert view[1] == -1.0  # still a view of base
    base[3] = 3.0
    assert state["opt"].param_groups[0]["params"][0] is state["model"][0].weight
    _train(state, 3)  # the optimizers still step the moved parameters
    _train(twin, 3)
    for (name, t), u in zip(_tensors(state).items(), _tensors(twin).values(), strict=True):
        assert torch.equal(t, u), name


def test_nothing_moves_when_the_state_is_already_there() -> None:
    state = _state()
    recorder = _Recorder()
    assert move_state(state.values(), CPU, recorder) == 0
    assert recorder.calls == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_adam_and_a_grad_scaler_go_to_the_gpu_and_back_bit_equal() -> None:
    state = _state(GPU)
    twin = copy.deepcopy(state)
    before = {name: t.detach().cpu().clone() for name, t in _tensors(state).items()}
    assert _tensors(state)["opt 0 step"].device == GPU  # fused: the step lives on the GPU
    move_state(state.values(), CPU)
    for name, t in _tensors(state).items():
        assert t.device == CPU, name
        assert torch.equal(t, before[name]), name
        assert not t.is_pinned(), name  # through the pinned ring into pageable memory
    move_state(state.values(), GPU)
    for name, t in _tensors(state).items():
        assert t.device == (CPU if name == "plain step" else GPU), name
        assert torch.equal(t.cpu(), before[name]), name
    _train(state, 3)
    _train(twin, 3)
    for (name, t), u in zip(_tensors(state).items(), _tensors(twin).values(), strict=True):
        assert torch.equal(t, u), name

"""The optimizer state booked from SGD's, Adam's and AdamW's layout (executor/optimizer_state.py)
equals what stepping a fake copy predicts and what a real first step creates, for any mix of
their options, parameter shapes and dtypes, frozen parameters and parameter groups."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from salus.daemon.executor import measure
from salus.daemon.executor.optimizer_state import layout_bytes

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _real_state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """Bytes of the state a real first step creates (zero gradients, as the fake step uses)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return sum(v.numel() * v.element_size() for p in params
               for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))


def _options(draw: st.DrawFn, name: str) -> dict[str, object]:
    if name == "SGD":
        momentum = draw(st.sampled_from([0.0, 0.9]))
        return {"lr": 0.1, "momentum": momentum,
                "nesterov": momentum > 0 and draw(st.booleans()),
                "foreach": draw(st.sampled_from([None, True, False]))}
    implementation = draw(st.sampled_from(["default", "foreach", "single", "fused"]))
    return {"lr": 1e-3, "amsgrad": draw(st.booleans()),
            "foreach": {"foreach": True, "single": False}.get(implementation),
            "fused": True if implementation == "fused" else None}


@st.composite
def _optimizers(draw: st.DrawFn) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    name = draw(st.sampled_from(["SGD", "Adam", "AdamW"]))
    dtype = draw(st.sampled_from(DTYPES))
    groups, trained = [], []
    for _ in range(draw(st.integers(1, 3))):
        params = []
        for _ in range(draw(st.integers(1, 3))):
            shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
            p = nn.Parameter(torch.zeros(shape, dtype=dtype),
                             requires_grad=draw(st.booleans()) or not params)
            params.append(p)
            trained += [p] if p.requires_grad else []
        groups.append({"params": params, **_options(draw, name)})
    return getattr(torch.optim, name)(groups), trained


@settings(max_examples=60, deadline=None)
@given(_optimizers())
def test_layout_equals_the_fake_step_and_a_real_one(made: tuple) -> None:
    optimizer, trained = made
    known = layout_bytes(optimizer, trained)
    assert known is not None
    assert known == measure._fake_optimizer_state(optimizer, trained)
    assert known == _real_state_bytes(optimizer, trained)


def test_the_step_counter_follows_a_float64_default_dtype() -> None:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        p = nn.Parameter(torch.zeros(3, dtype=torch.float32))
        optimizer = torch.optim.Adam([p])
        assert layout_bytes(optimizer, [p]) == 2 * 12 + 8
        assert layout_bytes(optimizer, [p]) == _real_state_bytes(optimizer, [p])
    finally:
        torch.set_default_dtype(before)


def test_other_optimizers_and_subclasses_take_the_fake_step() -> None:
    class MyAdam(torch.optim.Adam):
        pass

    p = nn.Parameter(torch.zeros(4))
    for optimizer in (torch.optim.RMSprop([p], momentum=0.9), MyAdam([p])):
        assert layout_bytes(optimizer, [p]) is None
        expected = _real_state_bytes(optimizer, [p])
        optimizer.state.clear()
        assert measure.state_bytes([optimizer]) == expected

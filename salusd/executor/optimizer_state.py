"""The bytes of state an optimizer's first ``step()`` creates, read off its documented layout.

`measure.state_bytes` books a job's optimizer state before that state exists. Stepping a fake
copy of the optimizer (`measure._predicted_optimizer_state`) finds it for any optimizer, but in
a freshly forked executor it takes 15-45 ms (`python bench/attach_cost.py`), most of a small
job's attach. The three optimizers most jobs use keep, per parameter given a gradient, buffers
shaped like the parameter and, for Adam and AdamW, a scalar step counter, so their state is
counted here without running them:

- `torch.optim.SGD`: ``momentum_buffer`` when ``momentum != 0``, else nothing;
- `torch.optim.Adam`, `torch.optim.AdamW`: ``step`` (a scalar of torch's optimizer scalar
  dtype), ``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq``.

Only those exact classes count (a subclass may keep more), and only while torch still has the
helper that names the step counter's dtype; for anything else `layout_bytes` returns None and
the fake step runs. `tests/test_optimizer_state.py` checks both ways agree on every
combination of the options above.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.optim.optimizer as torch_optimizer
from torch import Tensor
from torch.optim import Optimizer


def _step_bytes(fused: bool) -> int | None:
    """Bytes of Adam's ``step`` counter, as torch creates it (None: torch no longer says)."""
    scalar_dtype = getattr(torch_optimizer, "_get_scalar_dtype", None)
    if scalar_dtype is None:
        return None
    return int(torch.empty((), dtype=scalar_dtype(is_fused=fused)).element_size())


def _group_sizes(cls: type, group: dict, params: Sequence[Tensor]) -> list[int] | None:
    sizes = [p.numel() * p.element_size() for p in params]
    if cls is torch.optim.SGD:
        return sizes if group.get("momentum", 0) != 0 else []
    step = _step_bytes(bool(group.get("fused")))
    if step is None:
        return None
    buffers = 3 if group.get("amsgrad") else 2
    # per parameter, in the order torch's first step creates them: step, then the buffers
    return [size for p in sizes for size in (step, *[p] * buffers)]


def layout_sizes(optimizer: Optimizer, params: Sequence[Tensor]) -> list[int] | None:
    """Bytes of each tensor of state `optimizer`'s first step creates for `params` (each to be
    given a gradient), in creation order, or None where its layout is not known here."""
    cls = type(optimizer)
    if cls not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return None
    wanted = {id(p) for p in params}
    out: list[int] = []
    for group in optimizer.param_groups:
        mine = [p for p in group["params"] if id(p) in wanted]
        if not mine:
            continue
        sizes = _group_sizes(cls, group, mine)
        if sizes is None:
            return None
        out += sizes
    return out


def layout_bytes(optimizer: Optimizer, params: Sequence[Tensor]) -> int | None:
    """Bytes of the state `optimizer`'s first step creates for `params` (each to be given a
    gradient), or None where its layout is not known here."""
    sizes = layout_sizes(optimizer, params)
    return None if sizes is None else sum(sizes)

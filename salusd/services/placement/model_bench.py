"""Model side of the benchmark phase: per-layer memory, FLOPs and traffic of a forward+backward.

Each layer runs once forward and once backward on an example batch, under
`torch.utils.flop_counter.FlopCounterMode` (FLOPs), a dispatch mode that adds up the bytes each
operator reads and writes (traffic), and saved-tensor hooks (what autograd keeps for the
backward). Layers and inputs may live on the ``meta`` device: then nothing is computed or
allocated and a model far larger than this machine's memory can be profiled at full size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from .profile import LayerProfile, ModelProfile

Activation = torch.Tensor | tuple[torch.Tensor, ...]


class BytesAccessedMode(TorchDispatchMode):
    """Adds up the bytes of every tensor argument and result of each non-view operator.

    A roofline-style estimate of memory traffic: it assumes each operator reads its inputs and
    writes its outputs once, and that views move nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            leaves = tree_leaves((args, kwargs, out))
            self.total_bytes += sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor))
        return out


def top_level_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's top-level children with their names: the layers of an `nn.Sequential`."""
    blocks = list(model.named_children())
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no child modules to profile as layers")
    return blocks


def profile_model(
    blocks: nn.Module | Sequence[tuple[str, nn.Module]],
    example_input: Activation,
    *,
    optimizer_states_per_param: float = 2.0,
) -> ModelProfile:
    """Profile each block once, feeding each the previous block's output (as `nn.Sequential`).

    `blocks` is a model (its top-level children are the layers) or a list of (name, module).
    `example_input` is one mini-batch (its first dimension is the batch size) for the first
    block; a block may return a tuple of tensors, which the next block gets as one argument.
    `optimizer_states_per_param` is the optimizer state per trainable parameter byte (Adam keeps
    2, SGD with momentum 1, plain SGD 0). Gradient bytes equal the trainable parameter bytes.
    The first block's input is data and gets no gradient; later blocks' floating-point inputs
    get one, as a pipeline stage computes it to send back. The blocks run in their current
    train/eval mode.
    """
    named = top_level_blocks(blocks) if isinstance(blocks, nn.Module) else list(blocks)
    batch_size = int(tree_leaves(example_input)[0].shape[0])
    layers = []
    x = example_input
    for i, (name, block) in enumerate(named):
        layer, x = _profile_block(name, block, x, optimizer_states_per_param, input_grad=i > 0)
        layers.append(layer)
    return ModelProfile(tuple(layers), batch_size)


def _profile_block(name: str, block: nn.Module, x: Activation, optimizer_states_per_param: float,
                   *, input_grad: bool) -> tuple[LayerProfile, Activation]:
    inputs = _as_tuple(x)
    leaf_inputs = tuple(
        t.detach().requires_grad_(input_grad and t.is_floating_point()) for t in inputs
    )
    arg: Activation = leaf_inputs if isinstance(x, tuple) else leaf_inputs[0]
    # Saved tensors are told apart by storage (views share one); holding the storages and the
    # saved tensors keeps every id unique while the block runs.
    param_storages = [p.untyped_storage() for p in block.parameters()]
    param_ids = {id(s) for s in param_storages}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if id(storage) not in param_ids:
            saved[id(storage)] = t
        return t

    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          FlopCounterMode(display=False) as fwd_flops, BytesAccessedMode() as fwd_bytes):
        out = block(arg)
    outputs = _as_tuple(out)
    needs_grad = [t for t in outputs if t.requires_grad]
    trainable = [p for p in block.parameters() if p.requires_grad]
    wrt = trainable + [t for t in leaf_inputs if t.requires_grad]
    with FlopCounterMode(display=False) as bwd_flops, BytesAccessedMode() as bwd_bytes:
        if needs_grad:
            # autograd.grad, not backward: the same work, and the block's .grad stay untouched.
            torch.autograd.grad(needs_grad, wrt, [torch.ones_like(t) for t in needs_grad],
                                allow_unused=True)
    trainable_bytes = sum(p.nbytes for p in trainable)
    state = sum(p.nbytes for p in block.parameters()) + sum(b.nbytes for b in block.buffers())
    layer = LayerProfile(
        name=name,
        param_bytes=state,
        grad_bytes=trainable_bytes,
        optimizer_bytes=round(optimizer_states_per_param * trainable_bytes),
        activation_bytes=sum(t.untyped_storage().nbytes() for t in saved.values()),
        output_bytes=sum(t.nbytes for t in outputs),
        forward_flops=fwd_flops.get_total_flops(),
        backward_flops=bwd_flops.get_total_flops(),
        forward_bytes_accessed=fwd_bytes.total_bytes,
        backward_bytes_accessed=bwd_bytes.total_bytes,
    )
    detached = tuple(t.detach() for t in outputs)
    return layer, (detached if isinstance(out, tuple) else detached[0])


def _as_tuple(x: object) -> tuple[torch.Tensor, ...]:
    items = x if isinstance(x, tuple) else (x,)
    if not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError("a layer's input and output must be a tensor or a tuple of tensors, "
                        f"got {type(x).__name__}")
    return tuple(items)

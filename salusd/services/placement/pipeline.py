"""Run a model split at a plan's boundaries as a GPipe pipeline over local processes.

`split_model` cuts an `nn.Sequential`-like model (its top-level children, or given blocks) into
stage modules that keep the original parameter names. `train_pipelined` starts one process per
stage (`procgroup.run_local_group`), joins them in a gloo group on loopback, and trains with
`torch.distributed.pipelining` (`PipelineStage` + `ScheduleGPipe`): each mini-batch is cut into
micro-batches along dimension 0, each micro-batch's loss is backpropagated, and the gradients
are divided by the number of micro-batches, i.e. the loss is the mean of the micro-batch losses.
Between stages a block's output travels as the next stage's positional arguments.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from ..procgroup import free_port, init_loopback, leave_group, run_local_group

ModelFactory = Callable[[], nn.Module]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_model(model: nn.Module | Sequence[tuple[str, nn.Module]],
                boundaries: Sequence[int]) -> list[nn.Sequential]:
    """Stage d is an `nn.Sequential` of blocks `boundaries[d]`..`boundaries[d + 1] - 1`.

    Blocks keep their names, so a stage's `state_dict` keys are the model's own keys. The
    blocks are shared with `model`, not copied.
    """
    blocks = list(model.named_children()) if isinstance(model, nn.Module) else list(model)
    b = list(boundaries)
    if not b or b[0] != 0 or b[-1] != len(blocks) or any(x >= y for x, y in zip(b, b[1:],
                                                                                strict=False)):
        raise ValueError(f"boundaries {b} must rise strictly from 0 to {len(blocks)}")
    return [nn.Sequential(OrderedDict(blocks[a:z])) for a, z in zip(b, b[1:], strict=False)]


@dataclass(frozen=True)
class PipelineResult:
    """The trained model's state (keys as in the unsplit model) and each step's loss: the mean
    over micro-batches of `loss_fn` on each micro-batch."""

    state: dict[str, torch.Tensor]
    losses: list[float]


def train_pipelined(
    model_factory: ModelFactory,
    boundaries: Sequence[int],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    optimizer_factory: OptimizerFactory,
    n_microbatches: int,
    *,
    timeout_s: float = 120.0,
) -> PipelineResult:
    """Train `model_factory()` on `batches` of (input, target), one optimizer step per batch,
    as a GPipe pipeline of len(boundaries) - 1 CPU processes, stage d holding blocks
    `boundaries[d]`..`boundaries[d + 1] - 1`.

    Every process calls `model_factory` and keeps its own stage, so the factory must build the
    same model each time (seed it) and, like `loss_fn` and `optimizer_factory`, be picklable
    (a module-level function or a `functools.partial` of one). The whole run is bounded by
    `timeout_s` seconds.
    """
    world = len(boundaries) - 1
    if world < 1:
        raise ValueError(f"boundaries {list(boundaries)} define no stage")
    with tempfile.TemporaryDirectory(prefix="salus-pipeline-") as out:
        run_local_group(
            _stage_worker, world,
            (world, free_port(), model_factory, tuple(boundaries), list(batches), loss_fn,
             optimizer_factory, n_microbatches, out),
            timeout_s=timeout_s,
        )
        state: dict[str, torch.Tensor] = {}
        for rank in range(world):
            state.update(torch.load(Path(out) / f"stage{rank}.pt", weights_only=True))
        losses = torch.load(Path(out) / "losses.pt", weights_only=True)
    return PipelineResult(state, [float(x) for x in losses])


def _stage_worker(rank: int, world: int, port: int, model_factory: ModelFactory,
                  boundaries: tuple[int, ...], batches: list[tuple[torch.Tensor, torch.Tensor]],
                  loss_fn: LossFn, optimizer_factory: OptimizerFactory, n_microbatches: int,
                  out: str) -> None:
    init_loopback(rank, world, port)
    try:
        module = split_model(model_factory(), boundaries)[rank]
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn)
        optimizer = optimizer_factory(module.parameters())
        first, last = rank == 0, rank == world - 1
        step_losses = []
        for inputs, target in batches:
            optimizer.zero_grad()
            micro: list[torch.Tensor] = []
            args = (inputs,) if first else ()
            if last:
                schedule.step(*args, target=target, losses=micro)
                step_losses.append(torch.stack(micro).mean().detach())
            else:
                schedule.step(*args)
            optimizer.step()
        torch.save(module.state_dict(), Path(out) / f"stage{rank}.pt")
        if last:
            torch.save(torch.stack(step_losses), Path(out) / "losses.pt")
    except BaseException:
        dist.destroy_process_group()  # no barrier: the peers may never get there
        raise
    leave_group()

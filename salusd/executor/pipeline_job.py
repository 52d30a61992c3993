"""Pipeline jobs: a gang batch job whose model runs split into one stage per replica.

A batch job submitted with ``"devices": N, "pipeline": true`` gives, instead of an
``iteration``, its loss (``iteration`` may be left out, and is not used)::

    def make_job():
        torch.manual_seed(0)
        model = nn.Sequential(...)           # its top-level children are the layers
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return {"state": {"model": model, "opt": opt}, "loss": nn.functional.mse_loss,
                "data": loader}              # batches of (input, target)

Every replica builds the whole job. At the first iteration, once every replica knows its device,
the replicas plan the split together (`plan_in_group`: each benchmarks its device with its
simulated slowdown, rank 0 profiles the model on one micro-batch and runs the ``placement``
allocator) and replica r keeps layers ``boundaries[r]:boundaries[r + 1]`` as ``s.model`` (an
``nn.Sequential`` keeping the layers' names) with ``s.opt`` a new optimizer of the same class,
defaults and param-group hyperparameters over those layers' parameters (their state, if any,
moved over). ``s.pipeline`` (`PipelinePlan`) says which layers this replica holds; it is part of
the job's state, so a checkpoint restores the stage and the split together.

Each iteration is one GPipe step (`torch.distributed.pipelining`): the batch is cut into
``microbatches`` parts along dim 0 (``torch.tensor_split``), replica 0 feeds the inputs, the last
replica applies ``loss(output, target)`` to each micro-batch, the gradients are those of the mean
of the micro-batch losses, and each replica steps its optimizer. The iteration's loss (that
mean) is the last replica's, shared with the others. The batch is not sharded; every replica
draws it (in the same order, as every gang does) and uses its part. Each replica's forward and
backward computations are slowed by its device's simulated factor (``--cpu-device-slowdown``)
where they happen, so a slow stage delays the pipeline as a slow device would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from salus.daemon.executor.batch import BatchJob
from salus.daemon.executor.gang import GangSpec
from salus.daemon.services.optimizers import rebuilt
from salus.daemon.services.placement import plan_in_group, split_model
from salus.daemon.services.slowdown import ComputeSlowdown
from salus.daemon.wire.executor_ops import PipelineOptions

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Placed(Protocol):
    """Where the replica runs now (the executor's runtime): its budget and slowdown."""

    budget_bytes: int
    slowdown: ComputeSlowdown


@dataclass
class PipelinePlan:
    """The job's split as this replica holds it; `boundaries` is None until it is planned.

    `stage_times_s` are the allocator's predicted seconds of each stage (one micro-batch's
    forward and backward, with its link), `compute_slowdowns` each stage's simulated factor
    when it was planned.
    """

    placement: str
    microbatches: int
    rank: int
    world: int
    boundaries: tuple[int, ...] | None = None
    stage_times_s: tuple[float, ...] | None = None
    compute_slowdowns: tuple[float, ...] | None = None

    @property
    def layers(self) -> range:
        """The layers this replica holds."""
        assert self.boundaries is not None, "the pipeline is not planned yet"
        return range(self.boundaries[self.rank], self.boundaries[self.rank + 1])


def prepare(job: BatchJob, options: PipelineOptions, gang: GangSpec | None,
            placed: Placed) -> BatchJob:
    """`job` as a pipeline job of `options` on this gang; TypeError or ValueError says why
    the entrypoint cannot run as one."""
    if gang is None or gang.world < 2:
        raise ValueError('a pipeline job runs on a gang of at least 2 devices ("devices": N)')
    model, opt, loss = job.state.get("model"), job.state.get("opt"), job.loss
    if not isinstance(model, nn.Sequential):
        raise TypeError("a pipeline job's state['model'] must be an nn.Sequential (its "
                        f"top-level children are the pipeline's layers), got "
                        f"{type(model).__name__}")
    if len(model) < gang.world:
        raise ValueError(f"the model has {len(model)} layer(s) (top-level children) and the "
                         f"pipeline {gang.world} stages: each stage needs at least one layer")
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError("a pipeline job's state['opt'] must be the model's optimizer, got "
                        f"{type(opt).__name__}")
    if not callable(loss):
        raise TypeError("a pipeline job's entrypoint must give 'loss': loss(output, target)")
    _check_state(job.state, model, opt)
    plan = PipelinePlan(options.placement, options.microbatches, gang.rank, gang.world)
    state = {**job.state, "pipeline": plan}
    return dataclasses.replace(job, state=state, iteration=PipelineStep(loss, placed, state),
                               pipelined=True)


def _check_state(state: dict[str, Any], model: nn.Sequential,
                 opt: torch.optim.Optimizer) -> None:
    if "pipeline" in state:
        raise ValueError("'pipeline' is the name of the job's split in a pipeline job's state; "
                         "name that object otherwise")
    schedulers = [n for n, o in state.items()
                  if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
    if schedulers:
        raise TypeError(f"{schedulers}: a pipeline job's optimizer is rebuilt per stage, and an "
                        "LR scheduler would go on stepping the old one")
    owner: dict[int, str] = {}
    for name, layer in model.named_children():
        for p in layer.parameters():
            if owner.setdefault(id(p), name) != name:
                raise ValueError(f"layers {owner[id(p)]} and {name} share a parameter, which "
                                 "a pipeline split cannot keep")
    if any(id(p) not in owner for g in opt.param_groups for p in g["params"]):
        raise ValueError("state['opt'] optimises parameters that are not the model's")


class PipelineStep:
    """The iteration of a pipeline job: plans and splits at its first call, then runs one GPipe
    step of this replica's stage per call and returns the mean micro-batch loss."""

    def __init__(self, loss: LossFn, placed: Placed, entry_state: dict[str, Any]) -> None:
        self.loss = loss
        self.placed = placed
        self.entry_state = entry_state  # what the entrypoint returned: it must let go too
        self.schedule: ScheduleGPipe | None = None

    def __call__(self, s: Any, batch: Any) -> torch.Tensor:
        inputs, target = _pair(batch)
        if self.schedule is None:
            self.schedule = self._start(s, inputs)
        plan = s.pipeline
        first, last = plan.rank == 0, plan.rank == plan.world - 1
        s.opt.zero_grad()
        args = (inputs,) if first else ()
        losses: list[torch.Tensor] = []
        if last:
            self.schedule.step(*args, target=target, losses=losses)
        else:
            self.schedule.step(*args)
        s.opt.step()
        loss = (torch.stack([x.detach() for x in losses]).mean().double().cpu() if last
                else torch.zeros((), dtype=torch.float64))
        dist.broadcast(loss, src=plan.world - 1)
        return loss

    def _start(self, s: Any, inputs: torch.Tensor) -> ScheduleGPipe:
        plan: PipelinePlan = s.pipeline
        if plan.boundaries is None:
            self._split(s, plan, inputs)
        self.entry_state.update(model=s.model, opt=s.opt)  # the other stages' layers go
        device = next(s.model.parameters()).device
        stage = SlowedStage(s.model, plan.rank, plan.world, device, self.placed.slowdown)
        return ScheduleGPipe(stage, plan.microbatches, loss_fn=self.loss)

    def _split(self, s: Any, plan: PipelinePlan, inputs: torch.Tensor) -> None:
        example = torch.tensor_split(inputs, plan.microbatches)[0]
        planned = plan_in_group(s.model, example, plan.placement, self.placed.budget_bytes,
                                compute_slowdown=self.placed.slowdown.factor,
                                optimizer_states_per_param=_states_per_param(s.opt))
        factors: list[float | None] = [None] * plan.world
        dist.all_gather_object(factors, self.placed.slowdown.factor)
        stage = split_model(s.model, planned.boundaries)[plan.rank]
        s.model, s.opt = stage, stage_optimizer(s.opt, stage)
        plan.boundaries, plan.stage_times_s = planned.boundaries, planned.stage_times_s
        plan.compute_slowdowns = tuple(float(f or 1.0) for f in factors)


class SlowedStage(PipelineStage):
    """A pipeline stage whose forward and backward computations are stretched by the device's
    simulated slowdown (`ComputeSlowdown`, on this thread's CPU seconds) as they run."""

    def __init__(self, module: nn.Module, rank: int, world: int, device: torch.device,
                 slowdown: ComputeSlowdown) -> None:
        super().__init__(module, rank, world, device)
        self.slowdown = slowdown

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        with self.slowdown:
            return super().forward_maybe_with_nosync(*args, **kwargs)

    def backward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        with self.slowdown:
            return super().backward_maybe_with_nosync(*args, **kwargs)


def stage_optimizer(opt: torch.optim.Optimizer, stage: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of `opt`'s class over `stage`'s parameters: same defaults, each param group
    with its own hyperparameters (groups with no parameter in the stage are left out), and the
    state `opt` already holds for those parameters."""
    mine = {id(p) for p in stage.parameters()}
    groups = []
    for group in opt.param_groups:
        params = [p for p in group["params"] if id(p) in mine]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": params})
    if not groups:
        raise ValueError("the optimizer has no parameter in this stage's layers")
    new = rebuilt(opt, groups)
    for group in groups:
        for p in group["params"]:
            if p in opt.state:
                new.state[p] = opt.state[p]
    return new


def _states_per_param(opt: torch.optim.Optimizer) -> float:
    """Optimizer state per parameter byte, for the memory side of the plan: SGD keeps one
    momentum buffer (or none), the others are taken to keep two (as Adam does)."""
    if isinstance(opt, torch.optim.SGD):
        return 1.0 if any(g.get("momentum") for g in opt.param_groups) else 0.0
    return 2.0


def _pair(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, tuple | list) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise TypeError("a pipeline job's data must yield (input, target) pairs of tensors, got "
                        f"{type(batch).__name__}")
    return batch[0], batch[1]

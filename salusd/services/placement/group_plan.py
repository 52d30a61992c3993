"""Plan a model's pipeline split from inside a process group: the benchmark phase and an
allocator, run by the ranks that will hold the stages.

Every rank benchmarks its own device (short kernels; CPU ranks then share the best of their
measurements, see `_one_cpu`) and applies its simulated compute slowdown
(`--cpu-device-slowdown`), the ranks time their links, rank 0 profiles the model on an example
micro-batch and runs the allocator, and every rank gets rank 0's plan: stage d runs on rank d.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from salus.daemon.services.slowdown import DeviceSlowdown

from .cost import CostModel
from .device_bench import benchmark_device
from .even import allocate_even
from .heterogeneity import slow_down
from .link_bench import benchmark_links
from .model_bench import Activation, profile_model
from .optimal import allocate_optimal
from .plan import Plan
from .profile import ClusterProfile, DeviceProfile, ModelProfile
from .sky import allocate_sky

ALLOCATORS: dict[str, Callable[[CostModel], Plan]] = {
    "even": allocate_even, "sky": allocate_sky, "optimal": allocate_optimal}
COPY_BYTES = 16 * 2**20  # the memory-bound kernel's buffer: the plan runs inside a job's lane
LINK_BYTES = 8 * 2**20
LINK_TRIES = 3  # a link measurement disturbed by other load is taken again


def plan_in_group(
    model: nn.Module,
    example_input: Activation,
    placement: str,
    memory_bytes: int,
    *,
    compute_slowdown: float = 1.0,
    optimizer_states_per_param: float = 2.0,
    min_run_time_s: float = 0.05,
) -> Plan:
    """The plan of `placement` ("even", "sky" or "optimal") for `model`'s top-level children
    over the ranks of the default process group; every rank must call this with its own
    `memory_bytes` (its budget, bytes) and `compute_slowdown` (>= 1: its device's simulated
    factor, which divides its measured FLOP/s and bytes/s). `example_input` is one micro-batch
    for the first layer (only rank 0 uses it). Each device kernel runs `min_run_time_s` seconds.

    Returns the same plan on every rank; raises the same error on every rank when rank 0
    could not plan (`PlacementInfeasible` when no split fits the budgets). The model's
    buffers, gradients and the random state are left as they were.
    """
    if placement not in ALLOCATORS:
        raise ValueError(f"placement must be one of {sorted(ALLOCATORS)}, got {placement!r}")
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        cluster = _cluster(device, memory_bytes, compute_slowdown, min_run_time_s)
        answer: list[object] = [None]
        if dist.get_rank() == 0:
            try:
                profile = _profile(model, example_input, optimizer_states_per_param)
                answer[0] = ALLOCATORS[placement](CostModel(profile, cluster))
            except Exception as exc:  # every rank must hear of it, or the others would wait
                answer[0] = exc
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], Exception):
        raise answer[0]
    assert isinstance(answer[0], Plan)
    return answer[0]


def _cluster(device: torch.device, memory_bytes: int, slowdown: float,
             min_run_time_s: float) -> ClusterProfile:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = benchmark_device(device, memory_bytes, name=f"rank{rank}", matmul_size=512,
                            copy_bytes=COPY_BYTES, min_run_time_s=min_run_time_s)
    gathered: list[tuple[DeviceProfile, float] | None] = [None] * world
    dist.all_gather_object(gathered, (mine, slowdown))
    for attempt in range(LINK_TRIES):
        try:
            links = benchmark_links(device, large_bytes=LINK_BYTES)
            break
        except RuntimeError:  # raised on every rank alike, so all of them try again
            if attempt == LINK_TRIES - 1:
                raise
    pairs = [g for g in gathered if g is not None]
    devices = tuple(d for d, _ in pairs)
    if device.type == "cpu":
        devices = _one_cpu(devices)
    measured = ClusterProfile(devices, links)
    return slow_down(measured, [DeviceSlowdown(f, 1.0, 1.0) for _, f in pairs])


def _one_cpu(devices: tuple[DeviceProfile, ...]) -> tuple[DeviceProfile, ...]:
    """CPU devices of one node are lanes of the same cores (a pipeline runs on one node), so
    their measured speeds differ only by what else ran during each rank's benchmark: every rank
    gets the best measurement, and the simulated slowdowns alone make them differ. Without
    this, a rank benchmarked beside other load looks slower than a simulated slow device."""
    flops = max(d.flops_per_s for d in devices)
    copy = max(d.bytes_per_s for d in devices)
    return tuple(replace(d, flops_per_s=flops, bytes_per_s=copy) for d in devices)


def _profile(model: nn.Module, example_input: Activation,
             optimizer_states_per_param: float) -> ModelProfile:
    """The model's profile; its buffers (a batch norm's running statistics) are put back."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        return profile_model(model, example_input,
                             optimizer_states_per_param=optimizer_states_per_param)
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)

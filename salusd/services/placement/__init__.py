"""Sky Computing layer placement: profiles, allocators (even, sky, optimal MILP), pipeline split.

- Benchmark phase: `profile_model` (per-layer memory, FLOPs, traffic, on real or meta
  tensors), `benchmark_device`, `benchmark_links` / `benchmark_cluster` (timed exchanges over a
  process group) or `links_from_topology`; saved as a JSON `Profile`.
- Allocation over one `CostModel`: `allocate_even`, `allocate_sky` (two-phase heuristic),
  `allocate_optimal` (MILP, HiGHS); each returns a `Plan` or raises `PlacementInfeasible`.
  Devices are in pipeline order: stage d runs on the d-th device of the cluster profile.
- Heterogeneity simulation: `DeviceSlowdown`, `draw_slowdowns`, `slow_down`,
  `heterogeneous_cluster`, `compute_slowdown`.
- Pipelines: `split_model`, `train_pipelined` (GPipe with `torch.distributed.pipelining`);
  `plan_in_group`: the benchmark phase and an allocator run by a gang's own ranks (pipeline
  jobs, `salusd/executor/pipeline_job.py`).
"""

from salus.daemon.services.slowdown import DeviceSlowdown, compute_slowdown, draw_slowdowns

from .cost import CostModel
from .device_bench import benchmark_device
from .even import allocate_even, even_boundaries
from .group_plan import plan_in_group
from .heterogeneity import heterogeneous_cluster, slow_down
from .link_bench import benchmark_cluster, benchmark_links, links_from_topology
from .model_bench import profile_model, top_level_blocks
from .optimal import allocate_optimal
from .pipeline import PipelineResult, split_model, train_pipelined
from .plan import PlacementInfeasible, Plan
from .profile import (
    ClusterProfile,
    DeviceProfile,
    LayerProfile,
    LinkProfile,
    ModelProfile,
    Profile,
)
from .sky import allocate_sky

__all__ = [
    "ClusterProfile",
    "CostModel",
    "DeviceProfile",
    "DeviceSlowdown",
    "LayerProfile",
    "LinkProfile",
    "ModelProfile",
    "PipelineResult",
    "PlacementInfeasible",
    "Plan",
    "Profile",
    "allocate_even",
    "allocate_optimal",
    "allocate_sky",
    "benchmark_cluster",
    "benchmark_device",
    "benchmark_links",
    "compute_slowdown",
    "draw_slowdowns",
    "even_boundaries",
    "heterogeneous_cluster",
    "links_from_topology",
    "plan_in_group",
    "profile_model",
    "slow_down",
    "split_model",
    "top_level_blocks",
    "train_pipelined",
]

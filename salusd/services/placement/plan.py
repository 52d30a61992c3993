"""What an allocator decides: contiguous pipeline stages, one per device, and what they cost."""

from __future__ import annotations

from dataclasses import dataclass


class PlacementInfeasible(ValueError):
    """No split of the layers into the devices' stages fits every device's memory."""


@dataclass(frozen=True)
class Plan:
    """Stage d (on the d-th device, in the given pipeline order) runs layers
    `boundaries[d]` to `boundaries[d + 1] - 1`; every stage holds at least one layer.

    Times are seconds of one training iteration over the profiled mini-batch (forward,
    backward and the stage's link transfers), memory is bytes. `planning_s` is the allocator's
    own run time in seconds. `status` is "even", "heuristic", "optimal" (proved by the MILP
    within its relative gap tolerance) or "time_limit" (the MILP's best solution when time ran
    out); `mip_gap` is the relative gap the MILP proved (None for the other allocators, or
    when nothing was proved in time).
    """

    allocator: str
    boundaries: tuple[int, ...]
    stage_times_s: tuple[float, ...]
    stage_memory_bytes: tuple[int, ...]
    planning_s: float
    status: str
    mip_gap: float | None = None

    @property
    def max_stage_time_s(self) -> float:
        """The bottleneck stage's time in seconds: what every allocator minimises."""
        return max(self.stage_times_s)

    def stages(self) -> list[range]:
        """The layer indices of each stage, in pipeline order."""
        return [range(a, b) for a, b in zip(self.boundaries, self.boundaries[1:], strict=False)]

    def iteration_time_s(self, n_microbatches: int) -> float:
        """Seconds of one GPipe iteration split into `n_microbatches` equal micro-batches.

        The fill-and-drain estimate: each micro-batch takes 1/n of a stage's time; the first
        passes every stage once, the other n - 1 follow at the bottleneck stage's pace.
        """
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be at least 1, got {n_microbatches}")
        pace = self.max_stage_time_s / n_microbatches
        return sum(self.stage_times_s) / n_microbatches + (n_microbatches - 1) * pace

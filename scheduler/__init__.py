"""salus.scheduler: pure-Python policy shared by the daemon and the trace simulator.

Job state (`job`), lane admission (`lanes`, with its `pending` queue and its `devices` book),
the four iteration policies (`policies`) and the `IterationScheduler` that ties them together
(`iteration`). Nothing here imports torch or does I/O; time comes from an injected clock.

The trace simulator drives the same objects on a virtual clock: `traces` (native and Tiresias
CSV, synthetic mixes, `model_sizes`), `sim` (the engine and `python -m salus.scheduler.sim`),
`sim_model` (its job model: batches in flight, per-job records), `fairshare` (closed forms that
let it skip ahead under `fair`) and `report` (metrics, tables, plots). They are not imported
here, so `import salus.scheduler` stays light.
"""

from salus.scheduler.iteration import Decision, IterationScheduler
from salus.scheduler.job import Job, JobState
from salus.scheduler.lanes import Lane, LaneManager, LaneMode, Placement
from salus.scheduler.policies import POLICIES, Policy, make_policy

__all__ = [
    "POLICIES",
    "Decision",
    "IterationScheduler",
    "Job",
    "JobState",
    "Lane",
    "LaneManager",
    "LaneMode",
    "Placement",
    "Policy",
    "make_policy",
]

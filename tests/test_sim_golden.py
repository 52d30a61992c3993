"""The simulator's schedule, fixed: per-job admission, first-run and end times of small seeded
workloads under every policy, as the simulator computed them before its engine was reorganised
for speed (commit 11e0059). Any change to the engine's data structures must leave every time
bit for bit the same; a change that means to alter the schedule updates
`tests/data/sim_golden.json` on purpose and says why.

The workloads: a synthetic short/long mix over four devices at 110 % load (jobs wait for memory
and for lanes, pack runs under interference) and the Tiresias trace on eight devices (gangs,
one shrunk to the node). Times are stored as `float.hex` so the comparison is exact.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from salus.scheduler.policies import POLICIES
from salus.scheduler.sim import simulate
from salus.scheduler.traces import TraceJob, load_trace, synthetic

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "sim_golden.json"
WORKLOADS: dict[str, tuple[Callable[[], list[TraceJob]], int]] = {
    "synthetic-240x4": (lambda: synthetic(240, seed=11, devices=4, load=1.1,
                                          short_iterations=(5, 60),
                                          long_iterations=(200, 800)), 4),
    "tiresias-60x8": (lambda: load_trace(DATA / "tiresias-60job.csv", "tiresias"), 8),
}


def outcomes(workload: str, policy: str) -> dict[str, str]:
    """Job id -> "admitted first-run finish" seconds, each as `float.hex`."""
    make, devices = WORKLOADS[workload]
    result = simulate(make(), policy, devices=devices)
    return {str(r.job_id): f"{r.admitted_s.hex()} {r.first_run_s.hex()} {r.finish_s.hex()}"
            for r in result.records}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_schedule_is_unchanged(workload: str, policy: str) -> None:
    expected = json.loads(GOLDEN.read_text())[workload][policy]
    got = outcomes(workload, policy)
    assert got.keys() == expected.keys()
    changed = [j for j in expected if got[j] != expected[j]]
    assert not changed, (
        f"{len(changed)} of {len(expected)} jobs changed under {policy} on {workload}, "
        f"first job {changed[0]}: {got[changed[0]]} != {expected[changed[0]]}")

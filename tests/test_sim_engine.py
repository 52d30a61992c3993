"""The trace simulator: batched engine against the per-iteration one, closed forms of fifo and of
the interference model, and every policy on the Tiresias trace."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from salus.scheduler.model_sizes import MIB
from salus.scheduler.policies import POLICIES, Policy
from salus.scheduler.sim import Interval, SimResult, simulate
from salus.scheduler.traces import TraceJob, load_trace, synthetic

TIRESIAS = Path(__file__).resolve().parent / "data" / "tiresias-60job.csv"


@st.composite
def traces(draw: st.DrawFn, max_gang: int = 1, max_jobs: int = 8) -> list[TraceJob]:
    """Small traces with submit ties, mixed sizes (some must wait for memory), utils and
    priorities; iteration times on the simulator's time grid."""
    n = draw(st.integers(1, max_jobs))
    return [
        TraceJob(
            job_id=i,
            submit_s=float(draw(st.integers(0, 20))),
            iterations=draw(st.integers(1, 12)),
            iter_s=draw(st.sampled_from([0.25, 0.5, 0.75, 1.0, 1.25])),
            persistent_bytes=draw(st.integers(0, 6000)) * MIB,
            ephemeral_bytes=draw(st.integers(100, 8000)) * MIB,
            util=draw(st.sampled_from([0.25, 0.5, 0.75, 1.0])),
            priority=draw(st.sampled_from([1.0, 2.0, 3.0])),
            gang=draw(st.integers(1, max_gang)),
        )
        for i in range(n)
    ]


def merged(timeline: list[Interval]) -> dict[tuple[int, int], list[tuple[int, float, float, int]]]:
    """Per lane: maximal back-to-back runs of one job as (job, start, end, iterations)."""
    lanes: dict[tuple[int, int], list[tuple[int, float, float, int]]] = {}
    for iv in sorted(timeline, key=lambda i: (i.device, i.lane_id, i.start_s)):
        runs = lanes.setdefault((iv.device, iv.lane_id), [])
        if runs and runs[-1][0] == iv.job_id and runs[-1][2] == iv.start_s:
            job, start, _, count = runs[-1]
            runs[-1] = (job, start, iv.end_s, count + iv.iterations)
        else:
            runs.append((iv.job_id, iv.start_s, iv.end_s, iv.iterations))
    return lanes


def outcome(r: SimResult) -> list[tuple[int, float, float, float]]:
    return [(j.job_id, j.admitted_s, j.first_run_s, j.finish_s) for j in r.records]


def assert_same_schedule(batched: SimResult, exact: SimResult, tol: float) -> None:
    if tol == 0.0:
        assert outcome(batched) == outcome(exact)
        assert merged(batched.timeline) == merged(exact.timeline)
        return
    for a, b in zip(outcome(batched), outcome(exact), strict=True):
        assert a[0] == b[0] and a[1:] == pytest.approx(b[1:], rel=tol, abs=tol)
    ma, mb = merged(batched.timeline), merged(exact.timeline)
    assert ma.keys() == mb.keys()
    for lane in ma:
        assert [(j, n) for j, _, _, n in ma[lane]] == [(j, n) for j, _, _, n in mb[lane]]
        for x, y in zip(ma[lane], mb[lane], strict=True):
            assert x[1:3] == pytest.approx(y[1:3], rel=tol, abs=tol)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(max_gang=3, max_jobs=10), devices=st.integers(1, 3),
       policy=st.sampled_from(sorted(POLICIES)))
def test_batched_engine_equals_per_iteration_engine(
    trace: list[TraceJob], devices: int, policy: str
) -> None:
    batched = simulate(trace, policy, devices=devices, record=True, check=True)
    exact = simulate(trace, policy, devices=devices, exact=True, record=True)
    # Single-lane modes run at rate 1 on the time grid: bit-identical. Pack divides by Σ util.
    assert_same_schedule(batched, exact, 1e-9 if policy == "pack" else 0.0)


@pytest.mark.parametrize("policy", ["fair", "srtf"])
def test_batched_engine_takes_far_fewer_events(policy: str) -> None:
    trace = synthetic(60, seed=5, devices=2, load=1.2, short_iterations=(20, 60),
                      long_iterations=(200, 400))
    batched = simulate(trace, policy, devices=2)
    exact = simulate(trace, policy, devices=2, exact=True)
    assert outcome(batched) == outcome(exact)
    assert batched.events * 20 < exact.events


@settings(max_examples=40, deadline=None)
@given(trace=traces(max_jobs=10), exact=st.booleans())
def test_fifo_on_one_device_is_the_sequential_schedule(
    trace: list[TraceJob], exact: bool
) -> None:
    """With memory for everyone, finish_i = max(submit_i, finish_(i-1)) + iterations_i x iter_s."""
    result = simulate(trace, "fifo", devices=1, device_memory_mb=1 << 30, exact=exact)
    finish = 0.0
    by_id = {r.job_id: r for r in result.records}
    for job in sorted(trace, key=lambda j: (j.submit_s, j.job_id)):
        finish = max(job.submit_s, finish) + job.iterations * job.iter_s
        assert by_id[job.job_id].finish_s == finish
        assert by_id[job.job_id].first_run_s == finish - job.iterations * job.iter_s


@settings(max_examples=40, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.integers(1, 30), st.sampled_from([0.25, 0.5, 1.0]),
                  st.sampled_from([0.2, 0.25, 0.3, 0.5, 0.7, 1.0])),
        min_size=1,
        max_size=6,
    )
)
def test_pack_interference_matches_the_fluid_model(
    jobs: list[tuple[int, float, float]],
) -> None:
    """Jobs alone in their lanes on one device all start at 0; while a set A runs, each makes
    progress at 1 / max(1, Σ_A util). Expected finishes by the closed-form fluid recurrence."""
    trace = [TraceJob(i, 0.0, n, s, 0, 1 * MIB, u) for i, (n, s, u) in enumerate(jobs)]
    result = simulate(trace, "pack", devices=1, record=True, check=True)
    left = {j.job_id: j.duration_s for j in trace}
    util = {j.job_id: j.util for j in trace}
    t, expect = 0.0, {}
    while left:
        rate = 1.0 / max(1.0, math.fsum(util[i] for i in left))
        first = min(left.values())
        t += first / rate
        for i in list(left):
            left[i] -= first
            if left[i] <= 1e-12:
                expect[i] = t
                del left[i]
    for rec in result.records:
        assert rec.finish_s == pytest.approx(expect[rec.job_id], rel=1e-9)
    lanes = merged(result.timeline)
    assert len(lanes) == len(trace)  # every job got its own lane and ran without a break
    assert all(len(runs) == 1 for runs in lanes.values())


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_the_tiresias_trace(policy: str, devices: int) -> None:
    trace = load_trace(TIRESIAS, "tiresias")
    result = simulate(trace, policy, devices=devices, record=True, check=devices == 1)
    assert len(result.records) == len(trace)
    spec = {j.job_id: j for j in trace}
    for rec in result.records:
        assert rec.finish_s - rec.submit_s >= spec[rec.job_id].duration_s - 1e-9
        assert rec.submit_s <= rec.admitted_s <= rec.first_run_s < rec.finish_s
    assert result.shrunk_gangs == sum(1 for j in trace if j.gang > devices)
    # A gang job's iterations start and end on all its devices at once.
    starts: dict[tuple[int, float], list[Interval]] = {}
    for iv in result.timeline:
        starts.setdefault((iv.job_id, iv.start_s), []).append(iv)
    for (jid, _), group in starts.items():
        gang = min(spec[jid].gang, devices)
        assert len({iv.device for iv in group}) == len(group) == gang
        assert len({(iv.end_s, iv.iterations) for iv in group}) == 1
    done = {jid: sum(iv.iterations for iv in g if iv.device == g[0].device)
            for jid, g in _by_job(result.timeline).items()}
    assert done == {j.job_id: j.iterations for j in trace}


def _by_job(timeline: list[Interval]) -> dict[int, list[Interval]]:
    out: dict[int, list[Interval]] = {}
    for iv in timeline:
        out.setdefault(iv.job_id, []).append(iv)
    for ivs in out.values():
        first = ivs[0].device
        ivs.sort(key=lambda iv: iv.device != first)
    return out


def test_simulator_rejects_bad_setups() -> None:
    job = TraceJob(0, 0.0, 10, 1.0, 10 * MIB, 10 * MIB)
    with pytest.raises(ValueError, match="raise the device memory"):
        simulate([job], "fifo", device_memory_mb=15)
    with pytest.raises(ValueError, match="devices must be >= 1"):
        simulate([job], "fifo", devices=0)
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        simulate([job], "lifo")
    with pytest.raises(ValueError, match="no jobs"):
        simulate([], "fifo")


@contextlib.contextmanager
def fifth_policy() -> Iterator[None]:
    """POLICIES with a fifth entry meanwhile: "las", least attained service first (seconds run,
    without fair's priorities), preemptive, one lane per device. Its rank grows as a job runs,
    so running a pick to its end, as the simulator may for fifo, srtf and pack, would be
    wrong."""
    POLICIES["las"] = Policy("las", "single", True, "least attained service first",
                             key=lambda job: (job.attained_s, job.submit_s, job.job_id))
    try:
        yield
    finally:
        del POLICIES["las"]


@settings(max_examples=40, deadline=None)
@given(trace=traces(max_jobs=8))
def test_a_fifth_policy_is_one_entry_and_is_simulated_exactly(trace: list[TraceJob]) -> None:
    """A policy added as one entry of POLICIES, with no batching said: the simulator steps it
    one iteration per event and ends each job where an independent per-boundary loop does
    (memory for everyone, one device)."""
    with fifth_policy():
        result = simulate(trace, "las", devices=1, device_memory_mb=1 << 30)
        stepped = simulate(trace, "las", devices=1, device_memory_mb=1 << 30, exact=True)
    assert outcome(result) == outcome(stepped)
    t, left, first, finish = 0.0, {j.job_id: j.iterations for j in trace}, {}, {}
    jobs = {j.job_id: j for j in trace}
    attained = dict.fromkeys(jobs, 0.0)
    while left:
        arrived = [i for i in left if jobs[i].submit_s <= t]
        if not arrived:
            t = min(jobs[i].submit_s for i in left)
            continue
        pick = min(arrived, key=lambda i: (attained[i], jobs[i].submit_s, i))
        first.setdefault(pick, t)
        t += jobs[pick].iter_s
        attained[pick] += jobs[pick].iter_s
        left[pick] -= 1
        if not left[pick]:
            del left[pick]
            finish[pick] = t
    by_id = {r.job_id: r for r in result.records}
    for job_id in jobs:
        assert (by_id[job_id].first_run_s, by_id[job_id].finish_s) == (
            first[job_id], finish[job_id]), job_id

"""Discrete-event trace simulator over the daemon's own `IterationScheduler`.

The clock is virtual. Admission, lanes and every pick come from the same `LaneManager`,
`Policy` and `IterationScheduler` objects the daemon uses; the simulator only decides *when*
things happen. Interference model: while jobs run iterations at once on a device, each makes
progress at rate 1 / max(1, Σ util of those jobs); a gang job runs at the rate of its slowest
device. In single-lane modes (fifo, srtf, fair) one job runs per device, so the rate is 1.

Batching. Stepping one iteration per event is exact but far too slow at 100k jobs, so by default
one event covers many iterations, only where the decision provably cannot change in between:

* a lane's set of jobs changes only at an arrival, admission or finish, and a job's rank only
  when it runs; nothing else (no suspends or priority changes happen in a trace);
* fifo, pack and srtf: the picked job keeps winning until such an event (fifo never preempts;
  pack ranks by submit order; srtf's runner only gets shorter), so it runs to its last iteration;
* fair: the leader runs until its attained/priority passes the best rival's
  (`fairshare.iterations_until_overtaken`); on a lane of one-device jobs the whole interleaving
  up to the first finish is one event (`fairshare.plan`);
* an admission into a busy lane cuts its batch at the end of the iteration in flight (a
  non-preemptive lane is left alone), exactly where a stepping scheduler would re-decide;
* when the set of jobs running on a device changes, the rates and end times of the batches in
  flight there are recomputed at that instant.

So the batched engine yields the same schedule as `exact=True` (one event per iteration); tests
check this on small traces. Events at one instant are applied before any decision; finishes
first, then arrivals, each in submit order, so ties resolve the same way in both engines.

What starts where comes from the daemon's own `Dispatcher` (`dispatch.py`), gangs included: a
gang picked in one lane reserves all its lanes and starts once all are idle. A reservation cuts
the batch in flight on a reserved lane at the end of its iteration, where the daemon's lane
would next decide; a gang itself runs one iteration per event, since whether it keeps its lanes
depends on every one of them.

Ties must not depend on rounding, so times live on a grid of 2**-20 s (about 1 µs): submit times
are rounded to it and iteration times rounded up. Sums and multiples of grid values are exact in
float64 (below 2**33 s), so at rate 1 (the single-lane modes) both engines compute bit-identical
times and attained service. Under interference (pack) rates 1/U are not exact; there events less
than 1e-10 x now apart count as one instant.

The job model the engine moves (trace jobs on the grid, batches in flight, per-job records) is
in `sim_model.py`; this module is the event loop, the decisions and the command line.

Run as ``python -m salus.scheduler.sim --trace FILE ...`` (see `main`).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from salus.scheduler import fairshare
from salus.scheduler.dispatch import Dispatcher, Finished, Start
from salus.scheduler.job import Job, JobState
from salus.scheduler.model_sizes import MIB
from salus.scheduler.policies import make_policy, runnable
from salus.scheduler.sim_model import (
    GRID_S,
    Interval,
    JobRecord,
    LaneKey,
    Run,
    Segment,
    SimResult,
    prepare,
)
from salus.scheduler.traces import TraceJob

Progress = Callable[[int, int, float], None]
_PACK_INSTANT = 1e-10


# A heap entry: when, the job's order key, push order, the batch ending, its version then.
_EndEvent = tuple[float, tuple[float, int], int, "Run | Segment", int]


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block. The engine keeps every job (and
    its trace) alive to the end and makes no reference cycles, so the collector's periodic full
    passes over millions of live objects find nothing to free, yet they cost a tenth or more of
    a million-job run; reference counting frees everything else as usual. `simulate` pauses it
    from the first job made: with it running, making a million jobs took 3.9 s (8.0 s after an
    earlier run in the process, whose garbage its passes wade through) against 2.4 s paused."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _end_order(entry: _EndEvent) -> tuple[tuple[float, int], int]:
    """End events at one instant apply in job order, then in the order they were pushed."""
    return entry[1], entry[2]


def _run_order(run: Run) -> tuple[float, int]:
    """Runs re-rated at one instant push their new ends in job order."""
    return run.job.order_key


__all__ = ["GRID_S", "Interval", "JobRecord", "SimResult", "Simulator", "simulate"]


class Simulator:
    """Replays a trace under one policy. Sizes in bytes, times in seconds.

    `exact` steps one iteration per event (the reference); `record` keeps a timeline of
    intervals; `check` asserts after every instant that admission's invariants hold and that no
    lane idles while it could run a job (tests); `progress(done_jobs, total_jobs, now_s)` is
    called every couple of seconds of wall time. Gang jobs asking for more devices than exist
    run on all devices with their iteration time scaled by asked/devices (same device-seconds of
    work)."""

    def __init__(
        self,
        jobs: Sequence[TraceJob],
        policy: str,
        *,
        devices: int = 1,
        device_memory_mb: float = 16384.0,
        exact: bool = False,
        record: bool = False,
        check: bool = False,
        progress: Progress | None = None,
    ) -> None:
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        if not device_memory_mb > 0:
            raise ValueError(f"device memory must be > 0 MiB, got {device_memory_mb}")
        if not jobs:
            raise ValueError("the trace has no jobs")
        self.policy = make_policy(policy)
        self.devices = devices
        self.capacity = int(device_memory_mb * MIB)
        self.exact = exact
        self.record = record
        self.check = check
        self.progress = progress
        self.jobs, self.shrunk = prepare(jobs, devices)  # submitted as they arrive
        for job in self.jobs:
            need = job.persistent_bytes + job.ephemeral_bytes
            if need > self.capacity:
                raise ValueError(
                    f"job {job.job_id} needs {need / MIB:.0f} MiB on a device but devices have "
                    f"{device_memory_mb:g} MiB; raise the device memory"
                )
        self.now = 0.0
        self.dispatch = Dispatcher([self.capacity] * devices, self.policy, self._clock,
                                   measure=False)
        self.sched = self.dispatch.scheduler  # read for batching; written through dispatch
        self._batching = self.policy.batching
        self._shared = self.policy.lane_mode == "pack"
        self._instant = _PACK_INSTANT if self._shared else 0.0
        self._heap: list[_EndEvent] = []
        self._seq = itertools.count()
        self._running: dict[LaneKey, Run | Segment] = {}
        self._dirty: set[LaneKey] = set()
        self._dev_runs: list[set[Run]] = [set() for _ in range(devices)]
        self._util = [0.0] * devices
        self._rate_dirty: set[int] = set()
        self._finished = 0
        self._events = 0
        self._timeline: list[Interval] = []

    def _clock(self) -> float:
        return self.now

    # ---- the event loop ------------------------------------------------------------------
    def run(self) -> SimResult:
        """Simulate until every job finished; RuntimeError if the schedule stalls."""
        with _collector_paused():
            return self._run()

    def _run(self) -> SimResult:
        # Arrivals stay out of the heap: the jobs are in (submit, id) order already, so the
        # heap holds only the end events in flight and each instant merges the two.
        jobs, arrived, total = self.jobs, 0, len(self.jobs)
        submits = [job.submit_s for job in jobs] + [math.inf]  # a sentinel past the last
        heap, heappop, instant = self._heap, heapq.heappop, self._instant
        apply_instant = self._apply_instant
        last_report = time.monotonic()
        steps = 0
        while heap or arrived < total:
            now = heap[0][0] if heap else math.inf
            if submits[arrived] < now:
                now = submits[arrived]
            self.now = now
            horizon = now + now * instant
            while True:
                ends = []
                while heap and heap[0][0] <= horizon:
                    ends.append(heappop(heap))
                first = arrived
                while submits[arrived] <= horizon:
                    arrived += 1
                if not ends and first == arrived:
                    break
                self._events += len(ends) + arrived - first
                apply_instant(ends, jobs, first, arrived)
            if self._dirty:
                self._decide()
            if self._rate_dirty:
                self._rerate()
            if self.check:
                self._check()
            steps += 1
            if self.progress is not None and steps % 2048 == 0:
                wall = time.monotonic()
                if wall - last_report > 2.0:
                    last_report = wall
                    self.progress(self._finished, total, now)
        return self._result()

    def _apply_instant(self, ends: list[_EndEvent], jobs: Sequence[Job],
                       first: int, last: int) -> None:
        """Apply the events of one instant: the end events `ends` popped from the heap, in
        (job order, push order), then the arrivals `jobs[first:last]`, in submit order."""
        if len(ends) > 1:
            ends.sort(key=_end_order)
        for _, _, _, obj, version in ends:
            if obj.version == version:  # else it was cut or re-rated: a newer event stands
                self._end(obj)
        for i in range(first, last):
            self._placed(self.dispatch.submit(jobs[i], driven=True).placed)

    def _push(self, at: float, key: tuple[float, int], obj: Run | Segment, version: int) -> None:
        """Schedule the end of `obj` at `at`; `key` orders ends at one instant."""
        heapq.heappush(self._heap, (at, key, next(self._seq), obj, version))

    def _result(self) -> SimResult:
        stuck = [j.job_id for j in self.sched.jobs.values() if j.state != JobState.FINISHED]
        if stuck or len(self.sched.jobs) != len(self.jobs):
            raise RuntimeError(f"simulation stalled with jobs {stuck[:10]} unfinished")
        records = []
        for job in self.jobs:
            assert job.start_s is not None and job.first_run_s is not None
            assert job.finish_s is not None
            records.append(JobRecord(job.job_id, job.submit_s, job.start_s, job.first_run_s,
                                     job.finish_s, job.total_iterations * job.est_iter_s,
                                     job.total_iterations, job.gang, job.util))
        return SimResult(self.policy.name, self.devices, self.capacity, records, self._events,
                         self.shrunk, self._timeline)

    # ---- events --------------------------------------------------------------------------
    def _placed(self, made: Sequence[Any]) -> None:
        """Admissions changed these lanes: re-decide them, cutting batches in flight."""
        for p in made:
            lane = (p.device, p.lane_id)
            self._dirty.add(lane)
            busy = self._running.get(lane)
            if busy is not None and self.policy.preemptive:
                self._cut(busy)  # ends at the iteration's end, decided with that instant

    def _end(self, obj: Run | Segment) -> None:
        if isinstance(obj, Segment):
            self._end_segment(obj)
            return
        run, job = obj, obj.job
        for lane in run.lanes:
            del self._running[lane]
            if self.record:
                self._timeline.append(
                    Interval(lane[0], lane[1], job.job_id, run.start, self.now, run.count)
                )
        if self._shared:
            for d in run.devices:
                runs = self._dev_runs[d]
                runs.discard(run)
                if runs:  # the jobs left on the device speed up; an idle one has none to re-rate
                    self._rate_dirty.add(d)
        update = self.dispatch.apply(
            Finished(job.job_id, run.lanes, run.count, run.count * job.iteration_time)
        )
        self._count_finish(job)
        lanes = self.sched.lanes
        for lane in run.lanes:
            if lanes.lane(*lane) is not None:  # else the job left it empty: nothing to decide
                self._dirty.add(lane)
        self._placed(update.placed)

    def _end_segment(self, seg: Segment) -> None:
        del self._running[seg.lane]
        self._dirty.add(seg.lane)
        if self.record:
            self._record_segment(seg)
        made: list[Any] = []
        for i, job in enumerate(seg.jobs):
            count = seg.counts[i]
            began = None
            if count and job.first_run_s is None:
                began = seg.start + fairshare.first_offset(seg.shares, seg.counts, i)
            update = self.dispatch.apply(Finished(
                job.job_id, (seg.lane,), count, count * seg.shares[i].iter_s, began))
            made += update.placed
            self._count_finish(job)
        self._placed(made)

    def _count_finish(self, job: Job) -> None:
        if job.done:
            self._finished += 1

    def _cut(self, busy: Run | Segment, *, decided_first: bool = False) -> bool:
        """End the batch at the end of the iteration in flight (now, if one just ended; unless
        `decided_first`: a stepping engine decides lanes in order at one instant, and would
        have started this lane's next iteration before the decision that cuts it). True when
        the batch now ends at this instant."""
        now = self.now
        if isinstance(busy, Segment):
            elapsed = now - busy.start
            counts = fairshare.cut(busy.shares, busy.counts, elapsed)
            if counts == busy.counts:
                return busy.end <= now
            busy.counts = counts
            busy.end = busy.start + fairshare.duration(busy.shares, counts)
            busy.version += 1
            self._push(busy.end, busy.finisher.order_key, busy, busy.version)
            return busy.end <= now
        if busy.count == 1:
            return False
        if busy.rate == 0.0:  # started at this instant, rated (and pushed) after decisions
            busy.count, busy.left = 1, busy.job.iteration_time
            return False
        s, rate, tol = busy.job.iteration_time, busy.rate, now * self._instant
        done = busy.count * s - max(0.0, busy.left - (now - busy.since) * rate)
        whole = math.floor(done / s)
        if whole >= 1 and (done - whole * s) / rate <= tol and not decided_first:
            keep, left = whole, 0.0  # an iteration ended at this instant
        else:
            keep = whole + 1
            left = keep * s - done
            if left / rate <= tol:
                left = 0.0
        if keep >= busy.count:
            return False
        busy.count, busy.left, busy.since = keep, left, now
        busy.version += 1
        self._push(busy.end, busy.job.order_key, busy, busy.version)
        return left == 0.0

    # ---- decisions -----------------------------------------------------------------------
    def _decide(self) -> None:
        """Start what the dispatcher picks on the lanes that changed. A gang's reservation cuts
        the batches on its busy lanes; one whose iteration ends at this instant ends now, and
        the lanes decided at this instant decide again, as a stepping engine that saw that
        lane idle would have."""
        todo: set[LaneKey] = set()
        while self._dirty:
            todo |= self._dirty
            self._dirty.clear()
            for start in self.dispatch.schedule(todo):  # it skips lanes that were freed
                self._start(start)
            for lane, picked_at in self.dispatch.reservations().items():
                busy = self._running.get(lane)
                if busy is not None and self._cut(busy, decided_first=lane < picked_at):
                    busy.version += 1  # its end event is handled here, not from the heap
                    self._end(busy)

    def _start(self, start: Start) -> None:
        job, lanes = self.sched.jobs[start.job_id], start.lanes
        if self.exact or job.gang > 1 or self._batching == "one":
            count = 1
        elif self._batching == "fair":
            mates = runnable(self.sched.lane_jobs(*lanes[0]))
            if len(mates) > 1 and all(m.gang == 1 for m in mates):
                seg = Segment(lanes[0], mates, self.now)
                self._running[lanes[0]] = seg
                self._push(seg.end, seg.finisher.order_key, seg, 0)
                return
            # alone in its lane, nobody overtakes it: it runs to its end
            count = self._fair_lead(job, lanes) if len(mates) > 1 else job.remaining_iterations
        else:
            count = job.remaining_iterations
        run = Run(job, lanes, count, self.now)
        for lane in lanes:
            self._running[lane] = run
        if self._shared:
            for d in run.devices:
                self._dev_runs[d].add(run)
                self._rate_dirty.add(d)
        else:
            run.rate = 1.0  # one job at a time per device: never slowed
            self._push(run.end, job.order_key, run, 0)

    def _fair_lead(self, job: Job, lanes: tuple[LaneKey, ...]) -> int:
        """Iterations the fair leader runs before a rival on any of its lanes overtakes it."""
        count = job.remaining_iterations
        me = fairshare.Share(job.attained_s, job.priority, job.iteration_time, count,
                             job.order_key)
        for lane in lanes:
            rivals = [j for j in runnable(self.sched.lane_jobs(*lane)) if j is not job]
            if rivals:
                r = min(rivals, key=self.policy.rank)
                count = min(count, fairshare.iterations_until_overtaken(
                    me, r.attained_s / r.priority, r.order_key))
        return count

    def _rerate(self) -> None:
        """Devices whose set of running jobs changed: new rates and end times for their runs."""
        touched: set[Run] = set()
        util, dev_runs = self._util, self._dev_runs
        for d in self._rate_dirty:
            runs = dev_runs[d]
            if len(runs) > 1:
                util[d] = math.fsum([r.job.util for r in runs])  # exact: in any order
                touched |= runs
            elif runs:
                (only,) = runs
                util[d] = only.job.util  # fsum of one value is that value
                touched.add(only)
            else:
                util[d] = 0.0
        self._rate_dirty.clear()
        now = self.now
        for run in sorted(touched, key=_run_order) if len(touched) > 1 else touched:
            devices = run.devices
            busiest = util[devices[0]] if len(devices) == 1 else max([util[d] for d in devices])
            rate = 1.0 / busiest if busiest > 1.0 else 1.0
            if run.rate == rate:
                continue
            if run.rate:
                run.left = max(0.0, run.left - (now - run.since) * run.rate)
                run.since = now
            run.rate = rate
            run.version += 1
            self._push(run.end, run.job.order_key, run, run.version)

    def _check(self) -> None:
        """Work conservation: every lane whose pick is a one-device job is running it (a gang
        job may wait for its other lanes), and no pending job fits (check_invariants)."""
        lanes = self.sched.lanes
        lanes.check_invariants()
        reserved = self.dispatch.reservations()
        for lane in lanes.lanes():
            key = (lane.device, lane.lane_id)
            if key not in self._running and key not in reserved:
                pick = self.sched.next_iteration(*key)
                assert pick is None or self.sched.jobs[pick.job_id].gang > 1, (
                    f"lane {key} idles at {self.now} s while job {pick.job_id} is ready"
                )

    def _record_segment(self, seg: Segment) -> None:
        t = seg.start
        for i, length in fairshare.sequence(seg.shares, seg.counts):
            end = t + length * seg.shares[i].iter_s
            self._timeline.append(
                Interval(seg.lane[0], seg.lane[1], seg.jobs[i].job_id, t, end, length)
            )
            t = end


def simulate(
    jobs: Sequence[TraceJob],
    policy: str,
    *,
    devices: int = 1,
    device_memory_mb: float = 16384.0,
    exact: bool = False,
    record: bool = False,
    check: bool = False,
    progress: Progress | None = None,
) -> SimResult:
    """Run `jobs` under `policy` on `devices` devices of `device_memory_mb` MiB each."""
    with _collector_paused():  # from the first job made (`_collector_paused`)
        return Simulator(jobs, policy, devices=devices, device_memory_mb=device_memory_mb,
                         exact=exact, record=record, check=check, progress=progress).run()


if __name__ == "__main__":  # `python -m salus.scheduler.sim`: the command line is sim_cli.py
    from salus.scheduler.sim_cli import main

    sys.exit(main())

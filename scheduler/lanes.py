"""Lane admission (Salus §3.3.2): which job may hold memory on which device, and in which lane.

Persistent memory (parameters, gradients, optimizer state) is counted per device apart from the
lanes; lanes hold ephemeral memory (one iteration's temporaries). On every device always
`Σ persistent of admitted jobs + Σ lane sizes ≤ capacity`.

* ``pack`` mode: a job first gets a new lane of exactly its ephemeral size if the device has that
  much unreserved memory; else it joins the smallest existing lane whose size is at least its
  ephemeral bytes (ties: fewer residents, then lower lane id); else it waits. Lanes never grow.
* ``single`` mode: one lane per device holding every admitted job, sized to the largest
  resident's ephemeral bytes; a job is admitted while
  `Σ persistent + P_new + max(E of residents, E_new) ≤ capacity`.

**Executors.** Each device may charge `context_bytes` for every executor process a lane holds,
booked as persistent memory (a CUDA context; on the CPU an executor's private runtime): a job
that `shares` joins its owner's process where the lane already holds one and costs nothing
more, any other job costs one context. So in pack mode a new lane costs `P + E + C`, and where
that is more than the device has to spare, joining a lane the owner holds costs only `P`. An
`inference` job tries its owner's lanes (large enough for it) before a new lane.

An empty lane is freed and the pending list is re-run in submit order; a pending job that does
not fit never blocks a later one that does. With several devices a job tries devices in order of
fewest admitted jobs, then lower device id (spreads load); a new lane on any device is preferred
to sharing a lane. A gang job (``gang = g``) is admitted only when g distinct devices take it at
once, each holding its full persistent and ephemeral size. In pack mode an ``exclusive`` job
only ever gets new lanes, and no job joins a lane it holds: its iterations never wait behind
another job's in a lane (needed by a gang whose iterations wait for peers on other nodes, which
would otherwise deadlock with a job queued behind it there). Single mode has one lane per
device and cannot honour it: a caller refuses such jobs there.

**One owner per device** (``one_owner``: GPUs whose processes are MPS clients, `mps.py`): such
a device takes a job only while it serves no other owner, that is while no admitted job and no
live process (given with `hold`) of another owner is on it; the job goes to another device or
waits, and is admitted when the device's last admitted job and held process of that owner leave.

After every public call no pending job fits (`fits_now` is False for all of them). Only memory
that was freed can change that, so a re-run after a release visits only the pending jobs whose
sizes meet the bounds of a device that freed memory (`Device.bounds`, searched with
`PendingQueue.first_fitting`): the outcome is that of a full pass in submit order, at a cost that
grows with the jobs that might fit rather than with the pending list.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from salus.scheduler.devices import Device, LoadOrder
from salus.scheduler.job import Job, JobState
from salus.scheduler.mps import RunsAs, admits, runs_as
from salus.scheduler.pending import PendingQueue

LaneMode = Literal["pack", "single"]


@dataclass(slots=True)
class Lane:
    """A region of ephemeral memory on one device; its residents take turns running iterations."""

    lane_id: int
    device: int
    size: int
    residents: list[int] = field(default_factory=list)
    exclusive: bool = False  # pack mode: held by one exclusive job, which no other joins
    groups: dict[str, int] = field(default_factory=dict)  # owner -> its sharing residents
    contexts: int = 0  # bytes booked for the executor processes it holds


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one admitted job lives on one device (a gang job has one per device)."""

    job_id: int
    device: int
    lane_id: int
    lane_bytes: int


_Slot = tuple[Device, Lane | None]


class LaneManager:
    """Admission for all devices of one node; mutated only through `submit`/`release`/`requeue`."""

    def __init__(self, capacities: Sequence[int], mode: LaneMode = "pack", *,
                 first_lane_id: int = 0, context_bytes: Sequence[int] | None = None,
                 one_owner: Iterable[int] = ()) -> None:
        if not capacities:
            raise ValueError("at least one device is needed")
        if any(c <= 0 for c in capacities):
            raise ValueError(f"device capacities must be > 0 bytes, got {list(capacities)}")
        if mode not in ("pack", "single"):
            raise ValueError(f"lane mode must be 'pack' or 'single', got {mode!r}")
        self.mode: LaneMode = mode
        self._devices = [Device(i, c) for i, c in enumerate(capacities)]
        self._order = LoadOrder(self._devices)  # by (jobs, index): admission's preference
        self._by_capacity = sorted(capacities)
        self._pending = PendingQueue()
        self._jobs: dict[int, Job] = {}
        self._placements: dict[int, tuple[Placement, ...]] = {}
        self._next_lane = first_lane_id  # lane ids are never reused, even across a rebuild
        self.context_bytes = tuple(context_bytes or (0,) * len(capacities))
        if len(self.context_bytes) != len(capacities) or min(self.context_bytes) < 0:
            raise ValueError(f"one context size >= 0 per device, got {list(self.context_bytes)}")
        self._max_context = max(self.context_bytes)  # fixed; read at every submission
        self.one_owner = frozenset(one_owner)  # devices that serve one owner at a time
        self.held: dict[int, frozenset[RunsAs]] = {}  # device -> owners of its live processes

    # ---- queries -------------------------------------------------------------------------
    @property
    def pending(self) -> list[Job]:
        """Jobs waiting for memory, in submit order."""
        return list(self._pending)

    def placements(self, job_id: int) -> tuple[Placement, ...]:
        """The job's placements (empty while pending or after release)."""
        return self._placements.get(job_id, ())

    def lanes(self, device: int | None = None) -> list[Lane]:
        devs = self._devices if device is None else [self._devices[device]]
        return [lane for d in devs for lane in d.lanes.values()]

    def lane(self, device: int, lane_id: int) -> Lane | None:
        return self._devices[device].lanes.get(lane_id)

    def unreserved(self, device: int) -> int:
        """Bytes of the device held neither by persistent state nor by a lane."""
        return self._devices[device].unreserved

    def persistent(self, device: int) -> int:
        return self._devices[device].persistent

    def capacity(self, device: int) -> int:
        return self._devices[device].capacity

    @property
    def next_lane_id(self) -> int:
        return self._next_lane

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    def can_ever_fit(self, job: Job) -> bool:
        """Whether the job fits on an empty device (gang: on `gang` empty devices)."""
        return self._fits_empty(job.persistent_bytes + job.ephemeral_bytes, job.gang, job.devices)

    def serving(self, device: int) -> frozenset[RunsAs]:
        """Whom `device` serves: the owners of its admitted jobs and held processes."""
        return frozenset(self._devices[device].owners) | self.held.get(device, frozenset())

    def fits_on(self, job: Job, device: int) -> bool:
        """Whether one-device `job` (placed elsewhere, or pending) could be placed on `device`
        now."""
        return job.gang == 1 and self._slot_on(self._devices[device], job) is not False

    def fits_now(self, job: Job) -> bool:
        """Whether admission could place `job` now (no side effects)."""
        return self._find_slots(job) is not None

    # ---- mutation ------------------------------------------------------------------------
    def serve_one_owner(self, devices: Iterable[int]) -> list[Placement]:
        """From now on `devices` serve one owner at a time (jobs admitted before stay); returns
        the placements a device leaving that set made."""
        before, self.one_owner = self.one_owner, frozenset(devices)
        return self._admit(sorted(before - self.one_owner), None)

    def hold(self, device: int, owners: Iterable[RunsAs]) -> list[Placement]:
        """`owners` are now those with live processes on `device` (an MPS GPU's clients, which
        outlive their jobs' admission while swapped out or exiting); returns the placements
        this made (an owner left)."""
        self.held[device] = frozenset(owners)
        return self._admit([device], None) if device in self.one_owner else []

    def submit(self, job: Job) -> list[Placement]:
        """Queue a job and run admission; returns every placement made (this job's or none).

        Raises ValueError if the job can never fit, so it does not wait forever."""
        if job.job_id in self._jobs:
            raise ValueError(f"job {job.job_id} is already known to admission")
        self._check_can_fit(job, job.persistent_bytes, job.ephemeral_bytes)
        self._jobs[job.job_id] = job
        job.state = JobState.PENDING
        # Nothing else was freed, so only the new job can have become admissible: placed at
        # once if it fits, else it waits (a pass over the pending list would try it alone).
        slots = self._find_slots(job)
        if slots is not None:
            return self._place(job, slots)
        self._pending.insert(job)
        return []

    def release(self, job_id: int) -> list[Placement]:
        """Remove a job (finished, cancelled, or leaving); frees empty lanes and re-runs the
        pending list. Returns the placements that this made."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            raise KeyError(f"job {job_id} is not known to admission")
        if job_id in self._pending:
            self._pending.remove(job_id)
            return []
        return self._admit(self._vacate(job), None)

    def requeue(self, job_id: int, persistent_bytes: int, ephemeral_bytes: int) -> list[Placement]:
        """Re-admit a job with corrected sizes (e.g. its measured peak exceeded its lane): it
        leaves its lane and waits again at its original place in submit order, ahead of every
        later job. ValueError (and no change) if the new sizes can never fit."""
        job = self._jobs.get(job_id)
        if job is None:
            raise KeyError(f"job {job_id} is not known to admission")
        if persistent_bytes < 0 or ephemeral_bytes < 0:
            raise ValueError(f"job {job_id}: memory sizes must be >= 0 bytes")
        self._check_can_fit(job, persistent_bytes, ephemeral_bytes)
        if job_id in self._pending:
            self._pending.remove(job_id)
            freed: set[int] = set()
        else:
            freed = self._vacate(job)
        job.persistent_bytes, job.ephemeral_bytes = persistent_bytes, ephemeral_bytes
        if job.state != JobState.SUSPENDED:
            job.state = JobState.PENDING
        self._pending.insert(job)
        return self._admit(freed, job_id)

    def move(self, job_id: int, device: int) -> list[Placement]:
        """Move an admitted one-device job to `device` (its slot there as admission picks
        one), freeing its old place; returns its new placement and those the freed memory
        made. ValueError, nothing changed, if it does not fit there."""
        job = self._jobs[job_id]
        if (job_id not in self._placements or not self.fits_on(job, device)
                or any(p.device == device for p in self._placements[job_id])):
            raise ValueError(f"job {job_id} cannot move to device {device}")
        dev = self._devices[device]
        slot = self._slot_on(dev, job)
        assert slot is not False
        freed = self._vacate(job)
        return self._place(job, [(dev, slot)]) + self._admit(freed, None)

    # ---- internals -----------------------------------------------------------------------
    def _check_can_fit(self, job: Job, persistent: int, ephemeral: int) -> None:
        if not self._fits_empty(persistent + ephemeral, job.gang, job.devices):
            context = (f" and {self._max_context} for its executor" if self._max_context
                       else "")
            among = ("" if job.devices is None
                     else f" among the devices it may use, {sorted(job.devices)},")
            raise ValueError(
                f"job {job.job_id} needs {persistent + ephemeral} bytes{context} on "
                f"{job.gang} device(s) but no such device exists{among} (capacities "
                f"{[d.capacity for d in self._devices]})"
            )

    def _fits_empty(self, need: int, gang: int, devices: frozenset[int] | None = None) -> bool:
        """Whether `gang` empty devices (of `devices`; None: any) hold `need` bytes and an
        executor's context each."""
        if devices is None and not self._max_context:
            return len(self._by_capacity) - bisect.bisect_left(self._by_capacity, need) >= gang
        return sum(d.capacity >= need + self.context_bytes[d.index] for d in self._devices
                   if devices is None or d.index in devices) >= gang

    def _owner_ok(self, dev: Device, job: Job) -> bool:
        """Whether `dev` may take `job`: one of the job's own devices if it has them, and the
        one-owner rule (`mps.py`)."""
        if job.devices is not None and dev.index not in job.devices:
            return False
        return dev.index not in self.one_owner or admits(
            set(dev.owners) | self.held.get(dev.index, frozenset()), runs_as(job))

    def _context(self, dev: Device, lane: Lane | None, job: Job) -> int:
        """What placing `job` in `lane` of `dev` (None: a new lane) costs for its executor."""
        if lane is not None and job.shares and lane.groups.get(job.owner):
            return 0
        return self.context_bytes[dev.index]

    def _admit(self, freed: Iterable[int], extra: int | None) -> list[Placement]:
        """A pass in submit order over the pending jobs that may fit now: those within the
        bounds of a device in `freed`, and the newly queued job `extra`."""
        queue = self._pending
        if not queue:
            return []  # nothing waits (`extra`, when given, is queued already)
        devs = [self._devices[i] for i in freed]
        p_limit, need_limit = self._limits(devs)
        extra_pos = queue.position(extra) if extra is not None else None
        made: list[Placement] = []
        pos = 0
        while True:
            nxt = queue.first_fitting(pos, p_limit, need_limit) if devs else None
            if extra_pos is not None and extra_pos >= pos and (nxt is None or extra_pos < nxt):
                nxt = extra_pos
            if nxt is None:
                return made
            job = queue.at(nxt)
            slots = self._find_slots(job)
            if slots is not None:
                queue.remove(job.job_id)
                made.extend(self._place(job, slots))
                p_limit, need_limit = self._limits(devs)
            pos = nxt + 1

    def _limits(self, devs: list[Device]) -> tuple[int, int]:
        """Bounds a job must meet to fit on at least one of `devs` (see `Device.bounds`)."""
        if not devs:
            return -1, -1
        bounds = [d.bounds(self.mode) for d in devs]
        return max((b[0] for b in bounds), default=-1), max((b[1] for b in bounds), default=-1)

    def _vacate(self, job: Job) -> set[int]:
        """Take an admitted job out of its lanes; returns the devices that freed memory."""
        freed = set()
        for p in self._placements.pop(job.job_id, ()):
            self._remove_from_device(job, p)
            freed.add(p.device)
        return freed

    def _find_slots(self, job: Job) -> list[_Slot] | None:
        """Where admission would place `job` now (one slot per gang member), or None."""
        if job.gang == 1:
            best = self._best_pack_slot(job) if self.mode == "pack" else self._best_single(job)
            return [best] if best is not None else None
        chosen: list[_Slot] = []
        for dev in self._order:
            slot = self._slot_on(dev, job)
            if slot is not False:
                chosen.append((dev, slot))
                if len(chosen) == job.gang:
                    return chosen
        return None

    def _place(self, job: Job, slots: list[_Slot]) -> list[Placement]:
        made = [self._occupy(dev, lane, job) for dev, lane in slots]
        self._placements[job.job_id] = tuple(made)
        if job.state == JobState.PENDING:
            job.state = JobState.ADMITTED
        return made

    def _best_single(self, job: Job) -> _Slot | None:
        """Single mode, one device: the fitting device with fewest jobs, then lowest index."""
        p, e = job.persistent_bytes, job.ephemeral_bytes
        for dev in self._order:
            # The one lane's size is the device's lane bytes; it grows to e if e is larger.
            size = dev.lane_bytes if dev.lane_bytes > e else e
            lane = next(iter(dev.lanes.values()), None)
            if dev.capacity - dev.persistent >= p + self._context(dev, lane, job) + size and (
                    self._owner_ok(dev, job)):
                return dev, lane
        return None

    def _best_pack_slot(self, job: Job) -> _Slot | None:
        """Pack rule over all devices: a new lane anywhere first, else the smallest lane."""
        p, e = job.persistent_bytes, job.ephemeral_bytes
        if job.inference and job.shares and not job.exclusive:
            own = [lane for dev in self._devices
                   if dev.unreserved >= p and self._owner_ok(dev, job)
                   for lane in dev.lanes.values()
                   if lane.groups.get(job.owner) and lane.size >= e and not lane.exclusive]
            if own:
                lane = min(own, key=lambda ln: (ln.size, len(ln.residents), ln.lane_id))
                return self._devices[lane.device], lane
        for dev in self._order:
            if dev.unreserved >= p + e + self.context_bytes[dev.index] and self._owner_ok(
                    dev, job):
                return dev, None
        if job.exclusive:
            return None
        lanes = [
            lane
            for dev in self._devices
            if dev.unreserved >= p and self._owner_ok(dev, job)
            for lane in dev.lanes.values()
            if lane.size >= e and not lane.exclusive
            and dev.unreserved >= p + self._context(dev, lane, job)
        ]
        if not lanes:
            return None
        lane = min(lanes, key=lambda ln: (ln.size, len(ln.residents), ln.lane_id))
        return self._devices[lane.device], lane

    def _slot_on(self, dev: Device, job: Job) -> Lane | None | Literal[False]:
        """Where `job` could go on `dev`: a lane to join, None for a new lane, False if nowhere."""
        p, e = job.persistent_bytes, job.ephemeral_bytes
        if not self._owner_ok(dev, job):
            return False
        if self.mode == "single":
            lane = next(iter(dev.lanes.values()), None)
            size = lane.size if lane else 0
            c = self._context(dev, lane, job)
            return lane if dev.unreserved + size >= p + c + max(size, e) else False
        if dev.unreserved >= p + e + self.context_bytes[dev.index]:
            return None
        if job.exclusive:
            return False
        fits = [lane for lane in dev.lanes.values()
                if lane.size >= e and dev.unreserved >= p + self._context(dev, lane, job)
                and not lane.exclusive]
        if not fits:
            return False
        return min(fits, key=lambda lane: (lane.size, len(lane.residents), lane.lane_id))

    def _occupy(self, dev: Device, lane: Lane | None, job: Job) -> Placement:
        context = self._context(dev, lane, job)
        if lane is None:
            lane = Lane(self._next_lane, dev.index, job.ephemeral_bytes,
                        exclusive=job.exclusive and self.mode == "pack")
            self._next_lane += 1
            dev.lanes[lane.lane_id] = lane
            dev.lane_bytes += lane.size
        elif self.mode == "single" and job.ephemeral_bytes > lane.size:
            dev.lane_bytes += job.ephemeral_bytes - lane.size
            lane.size = job.ephemeral_bytes
        lane.residents.append(job.job_id)
        if job.shares:
            lane.groups[job.owner] = lane.groups.get(job.owner, 0) + 1
        lane.contexts += context
        dev.persistent += job.persistent_bytes + context
        dev.jobs += 1
        self._order.moved(dev, dev.jobs - 1)
        who = runs_as(job)
        dev.owners[who] = dev.owners.get(who, 0) + 1
        return Placement(job.job_id, dev.index, lane.lane_id, lane.size)

    def _remove_from_device(self, job: Job, p: Placement) -> None:
        dev = self._devices[p.device]
        lane = dev.lanes[p.lane_id]
        lane.residents.remove(job.job_id)
        context = self.context_bytes[dev.index]
        if job.shares:
            lane.groups[job.owner] -= 1
            if lane.groups[job.owner]:
                context = 0  # the owner's process stays for its other jobs here
            else:
                del lane.groups[job.owner]
        lane.contexts -= context
        dev.persistent -= job.persistent_bytes + context
        dev.jobs -= 1
        self._order.moved(dev, dev.jobs + 1)
        who = runs_as(job)
        dev.owners[who] -= 1
        if not dev.owners[who]:
            del dev.owners[who]
        if not lane.residents:
            del dev.lanes[p.lane_id]
            dev.lane_bytes -= lane.size
        elif self.mode == "single":
            size = max(self._jobs_sizes(lane.residents))
            dev.lane_bytes += size - lane.size
            lane.size = size

    def _jobs_sizes(self, ids: Iterable[int]) -> Iterator[int]:
        return (self._jobs[i].ephemeral_bytes for i in ids)

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the book-keeping is inconsistent, memory over-committed, or a
        pending job fits now (`lane_invariants.py`)."""
        from salus.scheduler.lane_invariants import check

        check(self)

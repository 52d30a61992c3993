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

An empty lane is freed and the pending list is re-run in submit order; a pending job that does
not fit never blocks a later one that does. With several devices a job tries devices in order of
fewest admitted jobs, then lower device id (spreads load); a new lane on any device is preferred
to sharing a lane. A gang job (``gang = g``) is admitted only when g distinct devices take it at
once, each holding its full persistent and ephemeral size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from salus.scheduler.job import Job, JobState

LaneMode = Literal["pack", "single"]


@dataclass
class Lane:
    """A region of ephemeral memory on one device; its residents take turns running iterations."""

    lane_id: int
    device: int
    size: int
    residents: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Placement:
    """Where one admitted job lives on one device (a gang job has one per device)."""

    job_id: int
    device: int
    lane_id: int
    lane_bytes: int


class _Device:
    """Per-device book-keeping: persistent bytes and lanes."""

    def __init__(self, index: int, capacity: int) -> None:
        self.index = index
        self.capacity = capacity
        self.persistent = 0
        self.lanes: dict[int, Lane] = {}
        self.jobs = 0

    @property
    def lane_bytes(self) -> int:
        return sum(lane.size for lane in self.lanes.values())

    @property
    def unreserved(self) -> int:
        return self.capacity - self.persistent - self.lane_bytes


class LaneManager:
    """Admission for all devices of one node; mutated only through `submit`/`release`/`requeue`."""

    def __init__(self, capacities: Sequence[int], mode: LaneMode = "pack") -> None:
        if not capacities:
            raise ValueError("at least one device is needed")
        if any(c <= 0 for c in capacities):
            raise ValueError(f"device capacities must be > 0 bytes, got {list(capacities)}")
        if mode not in ("pack", "single"):
            raise ValueError(f"lane mode must be 'pack' or 'single', got {mode!r}")
        self.mode: LaneMode = mode
        self._devices = [_Device(i, c) for i, c in enumerate(capacities)]
        self._pending: list[Job] = []
        self._jobs: dict[int, Job] = {}
        self._placements: dict[int, tuple[Placement, ...]] = {}
        self._next_lane = 0

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
    def num_devices(self) -> int:
        return len(self._devices)

    def can_ever_fit(self, job: Job) -> bool:
        """Whether the job fits on an empty device (gang: on `gang` empty devices)."""
        need = job.persistent_bytes + job.ephemeral_bytes
        return sum(1 for d in self._devices if d.capacity >= need) >= job.gang

    # ---- mutation ------------------------------------------------------------------------
    def submit(self, job: Job) -> list[Placement]:
        """Queue a job and run admission; returns every placement made (this job's or none).

        Raises ValueError if the job can never fit, so it does not wait forever."""
        if job.job_id in self._jobs:
            raise ValueError(f"job {job.job_id} is already known to admission")
        if not self.can_ever_fit(job):
            raise ValueError(
                f"job {job.job_id} needs {job.persistent_bytes + job.ephemeral_bytes} bytes on "
                f"{job.gang} device(s) but no such device exists "
                f"(capacities {[d.capacity for d in self._devices]})"
            )
        self._jobs[job.job_id] = job
        job.state = JobState.PENDING
        self._insert_pending(job)
        return self.admit_pending()

    def release(self, job_id: int) -> list[Placement]:
        """Remove a job (finished, cancelled, or leaving); frees empty lanes and re-runs the
        pending list. Returns the placements that this made."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            raise KeyError(f"job {job_id} is not known to admission")
        if job in self._pending:
            self._pending.remove(job)
            return []
        for p in self._placements.pop(job_id, ()):
            self._remove_from_device(job, p)
        return self.admit_pending()

    def requeue(self, job_id: int, persistent_bytes: int, ephemeral_bytes: int) -> list[Placement]:
        """Re-admit a job with corrected sizes (e.g. its measured peak exceeded its lane): it
        leaves its lane and is submitted again at its original place in submit order."""
        job = self._jobs[job_id]
        made = [p for p in self.release(job_id) if p.job_id != job_id]
        job.persistent_bytes, job.ephemeral_bytes = persistent_bytes, ephemeral_bytes
        return made + self.submit(job)

    def admit_pending(self) -> list[Placement]:
        """One pass over the pending list in submit order; admits everything that fits now."""
        made: list[Placement] = []
        still: list[Job] = []
        for job in self._pending:
            placed = self._try_place(job)
            if placed:
                made.extend(placed)
            else:
                still.append(job)
        self._pending = still
        return made

    # ---- internals -----------------------------------------------------------------------
    def _insert_pending(self, job: Job) -> None:
        key = job.order_key
        i = len(self._pending)
        while i > 0 and self._pending[i - 1].order_key > key:
            i -= 1
        self._pending.insert(i, job)

    def _device_order(self) -> list[_Device]:
        return sorted(self._devices, key=lambda d: (d.jobs, d.index))

    def _try_place(self, job: Job) -> list[Placement]:
        chosen: list[tuple[_Device, Lane | None]]
        if self.mode == "pack" and job.gang == 1:
            best = self._best_pack_slot(job)
            chosen = [best] if best else []
        else:
            chosen = []
            for dev in self._device_order():
                slot = self._slot_on(dev, job)
                if slot is not False and len(chosen) < job.gang:
                    chosen.append((dev, slot))
        if len(chosen) < job.gang:
            return []
        made = [self._occupy(dev, lane, job) for dev, lane in chosen]
        self._placements[job.job_id] = tuple(made)
        job.state = JobState.ADMITTED
        return made

    def _best_pack_slot(self, job: Job) -> tuple[_Device, Lane | None] | None:
        """Pack rule over all devices: a new lane anywhere first, else the smallest lane."""
        for dev in self._device_order():
            if dev.unreserved >= job.persistent_bytes + job.ephemeral_bytes:
                return dev, None
        lanes = [
            lane
            for dev in self._devices
            if dev.unreserved >= job.persistent_bytes
            for lane in dev.lanes.values()
            if lane.size >= job.ephemeral_bytes
        ]
        if not lanes:
            return None
        lane = min(lanes, key=lambda ln: (ln.size, len(ln.residents), ln.device, ln.lane_id))
        return self._devices[lane.device], lane

    def _slot_on(self, dev: _Device, job: Job) -> Lane | None | Literal[False]:
        """Where `job` could go on `dev`: a lane to join, None for a new lane, False if nowhere."""
        p, e = job.persistent_bytes, job.ephemeral_bytes
        if self.mode == "single":
            lane = next(iter(dev.lanes.values()), None)
            size = lane.size if lane else 0
            return lane if dev.unreserved + size >= p + max(size, e) else False
        if dev.unreserved >= p + e:
            return None
        fits = [lane for lane in dev.lanes.values() if lane.size >= e and dev.unreserved >= p]
        if not fits:
            return False
        return min(fits, key=lambda lane: (lane.size, len(lane.residents), lane.lane_id))

    def _occupy(self, dev: _Device, lane: Lane | None, job: Job) -> Placement:
        if lane is None:
            lane = Lane(self._next_lane, dev.index, job.ephemeral_bytes)
            self._next_lane += 1
            dev.lanes[lane.lane_id] = lane
        elif self.mode == "single":
            lane.size = max(lane.size, job.ephemeral_bytes)
        lane.residents.append(job.job_id)
        dev.persistent += job.persistent_bytes
        dev.jobs += 1
        return Placement(job.job_id, dev.index, lane.lane_id, lane.size)

    def _remove_from_device(self, job: Job, p: Placement) -> None:
        dev = self._devices[p.device]
        lane = dev.lanes[p.lane_id]
        lane.residents.remove(job.job_id)
        dev.persistent -= job.persistent_bytes
        dev.jobs -= 1
        if not lane.residents:
            del dev.lanes[p.lane_id]
        elif self.mode == "single":
            lane.size = max(self._jobs_sizes(lane.residents))

    def _jobs_sizes(self, ids: Iterable[int]) -> Iterator[int]:
        return (self._jobs[i].ephemeral_bytes for i in ids)

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the book-keeping is inconsistent or memory over-committed."""
        placed: dict[int, list[Placement]] = {}
        for dev in self._devices:
            persistent = 0
            jobs = 0
            for lane in dev.lanes.values():
                assert lane.residents, f"empty lane {lane.lane_id} on device {dev.index} kept"
                assert lane.device == dev.index
                for jid in lane.residents:
                    job = self._jobs[jid]
                    assert job.ephemeral_bytes <= lane.size, (
                        f"job {jid} ({job.ephemeral_bytes} B ephemeral) in lane {lane.lane_id} "
                        f"of {lane.size} B"
                    )
                    persistent += job.persistent_bytes
                    jobs += 1
                    placed.setdefault(jid, []).append(
                        Placement(jid, dev.index, lane.lane_id, lane.size)
                    )
            if self.mode == "single":
                assert len(dev.lanes) <= 1, f"device {dev.index} has {len(dev.lanes)} lanes"
                for lane in dev.lanes.values():
                    assert lane.size == max(self._jobs_sizes(lane.residents))
            assert persistent == dev.persistent, f"device {dev.index} persistent drifted"
            assert jobs == dev.jobs
            assert dev.persistent + dev.lane_bytes <= dev.capacity, (
                f"device {dev.index} over-committed: {dev.persistent} persistent + "
                f"{dev.lane_bytes} lanes > {dev.capacity}"
            )
        assert set(placed) == set(self._placements), "placements out of sync with lanes"
        for jid, ps in placed.items():
            assert len(ps) == self._jobs[jid].gang, f"job {jid} on {len(ps)} devices"
            assert len({p.device for p in ps}) == len(ps), f"gang job {jid} twice on a device"
        pending_ids = [j.job_id for j in self._pending]
        assert len(set(pending_ids)) == len(pending_ids)
        assert not set(pending_ids) & set(placed), "a job is both pending and placed"
        assert set(pending_ids) | set(placed) == set(self._jobs)
        keys = [j.order_key for j in self._pending]
        assert keys == sorted(keys), "pending list out of submit order"

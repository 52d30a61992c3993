"""The lane manager's invariants (`LaneManager.check_invariants`): its book-keeping against the
lanes themselves, memory never over-committed, and no pending job that fits now."""

from __future__ import annotations

from salus.scheduler.lanes import LaneManager, Placement
from salus.scheduler.mps import RunsAs, runs_as


def check(lm: LaneManager) -> None:
    """Raise AssertionError if `lm`'s book-keeping is inconsistent, memory over-committed, or
    a pending job fits now."""
    placed: dict[int, list[Placement]] = {}
    for dev in lm._devices:
        persistent = 0
        jobs = 0
        for lane in dev.lanes.values():
            assert lane.residents, f"empty lane {lane.lane_id} on device {dev.index} kept"
            assert lane.device == dev.index
            sharing = [lm._jobs[j] for j in lane.residents if lm._jobs[j].shares]
            groups: dict[str, int] = {}
            for job in sharing:
                groups[job.owner] = groups.get(job.owner, 0) + 1
            assert groups == lane.groups, f"lane {lane.lane_id}'s processes drifted"
            processes = len(groups) + len(lane.residents) - len(sharing)
            assert lane.contexts == processes * lm.context_bytes[dev.index], (
                f"lane {lane.lane_id} books {lane.contexts} B for {processes} executors")
            persistent += lane.contexts
            for jid in lane.residents:
                job = lm._jobs[jid]
                assert job.ephemeral_bytes <= lane.size, (
                    f"job {jid} ({job.ephemeral_bytes} B ephemeral) in lane {lane.lane_id} "
                    f"of {lane.size} B"
                )
                persistent += job.persistent_bytes
                jobs += 1
                placed.setdefault(jid, []).append(
                    Placement(jid, dev.index, lane.lane_id, lane.size)
                )
        for lane in dev.lanes.values():
            assert not lane.exclusive or (
                len(lane.residents) == 1 and lm._jobs[lane.residents[0]].exclusive), (
                f"exclusive lane {lane.lane_id} shared: {lane.residents}")
            if lm.mode == "pack":
                assert all(lane.exclusive or not lm._jobs[j].exclusive
                           for j in lane.residents), f"an exclusive job shares {lane.lane_id}"
        if lm.mode == "single":
            assert len(dev.lanes) <= 1, f"device {dev.index} has {len(dev.lanes)} lanes"
            for lane in dev.lanes.values():
                assert lane.size == max(lm._jobs_sizes(lane.residents))
        assert persistent == dev.persistent, f"device {dev.index} persistent drifted"
        assert jobs == dev.jobs
        owners: dict[RunsAs, int] = {}
        for lane in dev.lanes.values():
            for jid in lane.residents:
                owners[runs_as(lm._jobs[jid])] = owners.get(runs_as(lm._jobs[jid]), 0) + 1
        assert owners == dev.owners, f"device {dev.index}'s owners drifted"
        assert dev.index not in lm.one_owner or len(owners) <= 1, (
            f"device {dev.index} serves one owner at a time, has jobs of {list(owners)}")
        assert dev.lane_bytes == sum(ln.size for ln in dev.lanes.values()), "lane bytes drifted"
        assert dev.persistent + dev.lane_bytes <= dev.capacity, (
            f"device {dev.index} over-committed: {dev.persistent} persistent + "
            f"{dev.lane_bytes} lanes > {dev.capacity}"
        )
    assert list(lm._order) == sorted(lm._devices, key=lambda d: (d.jobs, d.index)), (
        "devices' load order drifted")
    assert set(placed) == set(lm._placements), "placements out of sync with lanes"
    for jid, ps in placed.items():
        assert len(ps) == lm._jobs[jid].gang, f"job {jid} on {len(ps)} devices"
        assert len({p.device for p in ps}) == len(ps), f"gang job {jid} twice on a device"
        # lane_bytes is the size at admission (single-mode lanes resize later): not compared.
        where = {(p.device, p.lane_id) for p in lm._placements[jid]}
        assert {(p.device, p.lane_id) for p in ps} == where, f"job {jid} placements stale"
    pending = lm.pending
    pending_ids = [j.job_id for j in pending]
    assert len(set(pending_ids)) == len(pending_ids) == len(lm._pending)
    assert not set(pending_ids) & set(placed), "a job is both pending and placed"
    assert set(pending_ids) | set(placed) == set(lm._jobs)
    keys = [j.order_key for j in pending]
    assert keys == sorted(keys), "pending list out of submit order"
    for job in pending:
        assert not lm.fits_now(job), f"pending job {job.job_id} fits but was left waiting"

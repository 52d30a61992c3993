"""A pod's grant at admission (`engine/pod_grants.py`), its jobs' device (`Job.devices` in the
lane manager) and the pod user (`k8s/pod_sockets.py`): what is refused, with which words,
where a pod's job goes, and a pod user that would be root."""

from __future__ import annotations

import pwd

import pytest

from salus.daemon.engine.pod_grants import PodGrant, PodGrants
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.k8s.pod_sockets import resolve_pod_user
from salus.scheduler import Job, LaneManager

GIB, MIB = 2**30, 2**20


def record(job_id: int, allocation: str | None) -> JobRecord:
    return JobRecord(job_id, Owner("alloc:x", 65534, 65534, allocation), f"job{job_id}", 1, 0.0)


def test_a_pods_jobs_together_stay_within_its_units() -> None:
    grants = PodGrants()
    grants.set(PodGrant("a1", units=2, device=0))
    grants.set(PodGrant("b2", units=8, device=0))
    first, other_pod, new = record(1, "a1"), record(2, "b2"), record(3, "a1")
    booked = [(first, 1 * GIB + 512 * MIB), (other_pod, 6 * GIB), (new, 0)]
    # 1.5 GiB of its own pod's booked: 512 MiB more fits 2 GiB exactly, a byte more does not
    assert grants.refusal(new, 512 * MIB, booked) is None
    assert grants.refusal(new, 512 * MIB + 1, booked) == (
        "job 3 does not fit its pod's grant: the pod's grant is 2 GiB, and its other jobs book "
        "1.5 GiB; this job needs 512.0 MiB (salusd.io/gpu-mem in the pod's limits: ask for "
        "more, or make the job smaller)")
    alone = grants.refusal(record(4, "b2"), 9 * GIB, [])
    assert alone is not None and "the pod's grant is 8 GiB; this job needs 9.0 GiB" in alone
    assert grants.refusal(record(5, None), 100 * GIB, booked) is None  # not a pod's job


def test_a_freed_allocations_job_is_refused_and_the_pod_name_shows() -> None:
    grants = PodGrants()
    grants.set(PodGrant("a1", units=1, device=0))
    assert grants.get("a1") is not None and grants.get("a1").owner_name == "alloc:a1"
    grants.name_pod("a1", "ns/p")
    assert grants.get("a1").owner_name == "pod:ns/p"  # type: ignore[union-attr]
    grants.drop("a1")
    assert grants.refusal(record(1, "a1"), 1, []) == (
        "job 1: the pod's allocation a1 was freed (its pod is gone)")


def test_the_pod_user_is_never_root_nor_unknown() -> None:
    nobody = pwd.getpwnam("nobody")
    assert resolve_pod_user("nobody").uid == nobody.pw_uid != 0
    with pytest.raises(ValueError, match="is uid 0: pods' jobs would run as root"):
        resolve_pod_user("root")
    with pytest.raises(ValueError, match="no such user on this node"):
        resolve_pod_user("no-such-user-here")


@pytest.mark.parametrize("mode", ["pack", "single"])
def test_a_pods_job_is_placed_only_on_its_allocations_device(mode: str) -> None:
    """Device 1 is emptier (admission would pick it), but the job's units are on device 0;
    with device 0 full it waits for device 0, and goes there once room is made."""
    lanes = LaneManager([4 * GIB, 8 * GIB], mode)  # type: ignore[arg-type]
    (filler,) = lanes.submit(Job(1, 0.0, 1, 3 * GIB, 512 * MIB, devices=frozenset({0})))
    assert filler.device == 0
    # device 1 has room, unused: the job waits for its own
    assert lanes.submit(Job(2, 0.0, 1, GIB, 0, devices=frozenset({0}))) == []
    (moved,) = lanes.release(1)
    assert (moved.job_id, moved.device) == (2, 0)
    (free,) = lanes.submit(Job(3, 0.0, 1, GIB, 0))
    assert free.device == 1  # an unpinned job goes where admission prefers

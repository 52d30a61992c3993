"""What `job.info()`, `salusd status` and REST show: JSON-able views of the engine.

Memory figures say per job what is enforced and what is accounted. On the CPU nothing can cap a
job's memory reliably (an `RLIMIT_AS` on a process that maps libtorch breaks torch itself, and
cgroups need a delegated hierarchy), so both parts are accounted: the persistent bytes are the
exact sum of the job's tensors, the ephemeral bytes the executor's peak resident memory above
its state during each call. On CUDA the executor's allocations are capped at its budget with
`torch.cuda.set_per_process_memory_fraction`, which is enforced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from salus.daemon.devices.discovery import format_size
from salus.daemon.engine import scripts
from salus.daemon.engine.admission import RSS_NOISE_BYTES
from salus.daemon.engine.jobstate import live_state
from salus.daemon.engine.registry import JobRecord, requested_memory

if TYPE_CHECKING:
    from salus.daemon.engine.engine import Engine


def _pod(engine: Engine, record: JobRecord) -> str | None:
    grant = engine.core.pod_grants.get(record.owner.allocation)
    if grant is not None and grant.pod is not None:
        return grant.pod
    name = record.owner.name  # a freed allocation's ended job: the pod it was shown as
    return name.removeprefix("pod:") if name.startswith("pod:") else None


def job_info(engine: Engine, record: JobRecord) -> dict[str, Any]:
    """One job: identity, state, progress, placement and memory (bytes, seconds)."""
    job = engine.dispatch.job(record.job_id)
    placed = engine.dispatch.placements(record.job_id)
    lane = engine.dispatch.lane((placed[0].device, placed[0].lane_id)) if placed else None
    enforced = "enforced" if record.device_kind == "cuda" else "accounted"
    requested = requested_memory(record)
    ephemeral = record.measured_peak
    slack = RSS_NOISE_BYTES if record.device_kind == "cpu" else 0
    over = ephemeral is not None and lane is not None and ephemeral > lane.size + slack
    return {
        "job_id": record.job_id,
        "owner": record.owner.name,
        # a Kubernetes pod's job: the allocation whose socket it came through, and its pod
        # ("namespace/name") once the kubelet named it; None for other jobs
        "allocation": record.owner.allocation,
        "pod": _pod(engine, record),
        "name": record.name,
        "state": live_state(record, job),
        "reason": record.life.reason,
        # A script job's command's end, as a shell reports it: its exit status (128 + N for
        # signal N, 125 when it could not start) and the signal that ended it; the limit
        # (time, memory) that ended the job. None while it runs, or where none applies.
        "exit_status": record.exit_status,
        "signal": record.signal,
        "limit": record.limit,
        "grace": record.life.grace,  # ended, its command still running on after SIGTERM
        "iterations_done": job.done_iterations if job else 0,
        "iterations_planned": record.planned_iterations,
        "calls_done": record.progress.calls_done,
        "calls_failed": record.progress.calls_failed,
        "calls_queued": len(record.calls),
        "mean_iteration_s": job.iteration_s if job else None,
        "submit_s": job.submit_s if job else None,
        "start_s": job.start_s if job else None,
        "finish_s": job.finish_s if job else None,
        "device": placed[0].device if placed else None,
        "lane": placed[0].lane_id if placed else None,
        "devices": record.gang,  # replicas of a gang job (one per device), else 1
        "replica_lanes": [[p.device, p.lane_id] for p in sorted(placed, key=lambda p: p.device)],
        "comm": record.progress.comm,  # a gang's: bytes and calls of s.comm, the last "auto" pick
        "threads": record.threads,
        # a batch job's, or what a script's framework logged
        "last_loss": record.progress.last_loss,
        "script": scripts.view(record),  # a script job's reruns and swap; None for others
        # the jobs a script job runs after (--after)
        "after": list(record.spec.after) if record.spec.after else None,
        "waiting_for": list(record.after),  # those of them that have not finished yet
        "executor_pid": getattr(record.executor, "pid", None),
        "executor": describe() if callable(describe := getattr(record.executor, "describe",
                                                                 None)) else None,
        "memory": {
            "persistent_bytes": record.persistent_bytes,
            "persistent_limit": enforced,
            "ephemeral_estimate_bytes": record.estimate_bytes,
            "ephemeral_estimate_method": record.estimate_method,
            "ephemeral_measured_bytes": ephemeral,
            "lane_bytes": lane.size if lane else None,
            "ephemeral_limit": ("enforced at iteration boundaries: the job ends once it "
                                "measures more than it asked for (--mem)"
                                if requested is not None and enforced == "accounted"
                                else enforced),
            "requested_bytes": requested,  # --mem: its lane at admission and its cap
            "over_lane": (f"measured {format_size(ephemeral)} over the "
                          f"{format_size(lane.size)} lane; being moved"
                          if over and lane is not None and ephemeral is not None else ""),
            "measured_by": ("CUDA caching allocator peak" if record.device_kind == "cuda" else
                            "executor's peak resident memory above its state (VmHWM), every "
                            f"call; overshoots under {RSS_NOISE_BYTES >> 20} MiB are noise"),
            "swapped_out": record.life.swapped,
        },
    }


def snapshot(engine: Engine) -> dict[str, Any]:
    """Devices (budget regions, lanes), live jobs and the pending queue."""
    devices = []
    dispatch = engine.dispatch
    for index, ledger in enumerate(engine.ledgers):
        stats = ledger.stats()
        devices.append({
            "index": index,
            "torch_device": engine.config.torch_devices[index],
            "compute_slowdown": engine.config.compute_slowdowns[index],
            "capacity_bytes": stats.capacity,
            "used_bytes": stats.used,
            "persistent_bytes": dispatch.persistent(index),
            "unreserved_bytes": dispatch.unreserved(index),
            "largest_free_bytes": stats.largest_free,
            "compactions": ledger.compactions,
            "sharing": "; ".join(filter(None, (engine.device_sharing[index],
                                               dispatch.one_owner(index)))),
            "lanes": [{"lane_id": ln.lane_id, "size_bytes": ln.size, "jobs": list(ln.residents),
                       "busy_job": ln.busy_job} for ln in dispatch.lanes(index)],
        })
    return {
        "policy": dispatch.policy.name,
        "devices": devices,
        "jobs": [job_info(engine, r) for r in engine.registry],
        "pending": dispatch.pending(),
    }

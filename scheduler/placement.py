"""Moves of waiting jobs on devices where a device is a budget, not a place: the CPU.

A job that waits for a turn in a lane another job holds, while a device runs nothing and fits
it, moves there at its boundary (it waits at one): the lowest-numbered such device, one job per
idle device per decision, the waiting jobs in submit order. Never on a GPU, where the job's
CUDA context and state live on the device it started on. New jobs are placed by admission
(`lanes.py`: the device with the fewest jobs that fits, ties to the lower index).

Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from salus.scheduler.job import Job


def moves(waiting: Sequence[Job], idle: Iterable[int],
          fits: Callable[[Job, int], bool]) -> list[tuple[int, int]]:
    """Where waiting jobs go: (job id, device) for each of `waiting` (in submit order) that
    fits one of the `idle` devices, the lowest-numbered of them; each idle device takes one."""
    free = sorted(set(idle))
    chosen: list[tuple[int, int]] = []
    for job in sorted(waiting, key=lambda j: j.order_key):
        device = next((d for d in free if fits(job, d)), None)
        if device is not None:
            chosen.append((job.job_id, device))
            free.remove(device)
    return chosen

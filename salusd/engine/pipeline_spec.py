"""A pipeline job's request, checked where it is submitted; the executors do the rest.

``"pipeline": true`` on a gang batch job asks its replicas to split the entrypoint's model into
one stage each and train it as a GPipe pipeline (`salusd/executor/pipeline_job.py`). The daemon
checks what it can without the model (a gang on one node, a known placement, micro-batches in
range) and keeps the request in the job's spec, so a restarted daemon loads the job alike.
"""

from __future__ import annotations

from typing import Any

from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.executor_ops import PipelineOptions

PLACEMENTS = ("even", "sky", "optimal")
MAX_MICROBATCHES = 1024


def check_pipeline(pipeline: dict[str, Any] | None, devices: int,
                   nodes: int) -> PipelineOptions | None:
    """The split a pipeline request asks for (None for a job that is not one): placement
    "even" (default), "sky" or "optimal", and microbatches (default 1). BadRequest says what
    is wrong."""
    if pipeline is None:
        return None
    unknown = set(pipeline) - {"placement", "microbatches"}
    if unknown:
        raise BadRequest(f"unknown pipeline options {sorted(unknown)}")
    placement = pipeline.get("placement", "even")
    microbatches = pipeline.get("microbatches", 1)
    if placement not in PLACEMENTS:
        raise BadRequest(f"placement must be one of {list(PLACEMENTS)}, not {placement!r}")
    if type(microbatches) is not int or not 1 <= microbatches <= MAX_MICROBATCHES:
        raise BadRequest(f"microbatches must be an integer from 1 to {MAX_MICROBATCHES}, not "
                         f"{microbatches!r}")
    if devices < 2:
        raise BadRequest(f'a pipeline job runs one stage per device and needs "devices" of at '
                         f"least 2, not {devices}")
    if nodes > 1:
        raise BadRequest("pipeline jobs run on one node: a pipeline across nodes is not "
                         "supported yet")
    return PipelineOptions(placement, microbatches)

"""A real executor process, driven over its sockets as the daemon and a client drive it: a job
handed over while its client keeps calls in flight takes every call along, including the frames
the executor had already read off the client's socket but not yet parsed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from salus.daemon.wire import compact
from salus.daemon.wire.channel import PickledPayload
from salus.daemon.wire.executor_ops import (
    HandedOver,
    Handover,
    Lease,
    addressed,
    encode,
)
from tests.executor_proc import JOB, daemon_reply, leased_job


def slow_at_zero(s: Any, x: torch.Tensor) -> torch.Tensor:
    """The job's function: the call with x == 0 takes 0.3 s, so that everything sent during
    it arrives together."""
    if float(x) == 0.0:
        time.sleep(0.3)
    return x + 1


def _call(x: float) -> compact.Message:
    return compact.Message(compact.OP_CALL, str(JOB), (torch.tensor(x),), 0)


@pytest.mark.slow
def test_a_handover_takes_the_frames_already_read_along(tmp_path: Path) -> None:
    with leased_job(tmp_path, slow_at_zero) as (daemon, client):
        client.send(_call(0.0))  # runs under the lease for 0.3 s; meanwhile:
        time.sleep(0.05)
        client.send_many([_call(float(i)) for i in range(1, 6)])  # one sendmsg: read together
        daemon.send_many([addressed(encode(Lease(False)), JOB),  # read together, too
                          addressed(encode(Handover()), JOB)])
        first = client.recv()
        assert float(first.tensors[0]) == 1.0

        handed = None
        while handed is None:  # skip the lease's report, the ack and the next call's `ready`
            reply = daemon_reply(daemon)
            if isinstance(reply, HandedOver):
                handed = reply
        assert handed.ok and handed.channel, handed
        payload = daemon.recv()["bundle"]
        assert isinstance(payload, PickledPayload)
        bundle = payload.load("the bundle", own=True)
        queued = [float(m.tensors[0]) for m in bundle["queued"]]
        assert queued == [1.0, 2.0, 3.0, 4.0, 5.0]

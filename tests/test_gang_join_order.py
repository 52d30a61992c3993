"""An interactive gang's replica joins its process group after it is placed, on its device's
backend (NCCL on CUDA, gloo on the CPU): in process, with gloo standing in for NCCL."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist

from salus.daemon.executor.gang import backend_for
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.wire.address import free_port
from salus.daemon.wire.channel import Channel, Pickled
from salus.daemon.wire.executor_ops import GangPlace


def _through_the_wire(message: dict[str, Any]) -> Any:
    """`message` as an executor receives it (pickled objects arrive as a PickledPayload)."""
    left, right = socket.socketpair()
    sender, receiver = Channel(left), Channel(right)
    try:
        sender.send(message)
        return receiver.recv()
    finally:
        sender.close()
        receiver.close()


def test_the_backend_is_nccl_on_cuda_and_gloo_on_the_cpu() -> None:
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"


@pytest.mark.skipif(dist.is_initialized(), reason="a process group is already up here")
def test_a_gang_replica_joins_its_group_only_once_placed() -> None:
    runtime = JobRuntime()
    request = _through_the_wire({"objects": Pickled({"w": torch.arange(4.0)})})
    runtime.attach(request, GangPlace(0, 1, port=free_port()))
    assert runtime.comm is None and not dist.is_initialized()  # attached, not yet placed
    assert not hasattr(runtime.state, "comm")
    try:
        runtime.place("cpu", 1 << 20)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert runtime.state.comm is runtime.comm is not None
        runtime.place("cpu", 1 << 20)  # placed again (after a swap): the same group
        assert runtime.state.comm is runtime.comm
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

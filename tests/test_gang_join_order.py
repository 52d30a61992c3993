"""A gang's replica (interactive or batch) joins its process group after it is placed, on its
device's backend (NCCL on CUDA, gloo on the CPU): in process, with gloo standing in for NCCL."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from salus.daemon.executor import gang as gang_module
from salus.daemon.executor.gang import backend_for
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.wire.address import free_port
from salus.daemon.wire.channel import Channel, Pickled
from salus.daemon.wire.executor_ops import CachePlace, GangPlace, Load


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


ENTRYPOINT = '''
import os
import torch
from torch import nn
from salus.data import CachedDataset, ReplicaLoader

def make_job():
    torch.manual_seed(0)
    images = CachedDataset(os.environ["SAMPLES"], lambda raw: torch.tensor(len(raw)))
    return {"state": {"model": nn.Linear(2, 1)}, "iteration": lambda s, b: 0.0,
            "data": ReplicaLoader(images, 1)}
'''


@pytest.mark.skipif(dist.is_initialized(), reason="a process group is already up here")
def test_a_batch_gang_replica_joins_once_placed_and_then_binds_its_data_and_syncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch gang's replica runs its entrypoint unjoined (NCCL needs the device it is placed
    on); once placed it joins, the data set its entrypoint built takes the gang's Comm (level
    1 in the replica's own folder), and its state is broadcast from replica 0, once."""
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "0.bin").write_bytes(b"abc")
    (tmp_path / "job.py").write_text(ENTRYPOINT)
    monkeypatch.setenv("SAMPLES", str(tmp_path / "samples"))
    broadcasts: list[list[str]] = []
    monkeypatch.setattr(gang_module, "broadcast_state",
                        lambda comm, objects: broadcasts.append(sorted(objects)))
    runtime = JobRuntime()
    runtime.load(Load(str(tmp_path / "job.py"), "make_job", False, None,
                      CachePlace(str(tmp_path / "cache"), 1 << 20), None,
                      GangPlace(0, 1, port=free_port())))
    (images,) = runtime.context.datasets
    assert runtime.comm is None and not dist.is_initialized() and broadcasts == []
    assert runtime.context.unbound == [images]
    try:
        runtime.place("cpu", 1 << 20)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert runtime.context.comm is runtime.comm is not None
        assert runtime.context.unbound == [] and images._group is not None
        assert images._disk.directory == tmp_path / "cache" / "rank0"
        assert broadcasts == [["model"]]
        runtime.place("cpu", 1 << 20)  # placed again: no second join or broadcast
        assert broadcasts == [["model"]]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

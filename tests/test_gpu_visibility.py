"""Each executor sees the daemon's GPUs by UUID (`salusd/supervisor/supervisor.py`) and, once
placed, only its own (`salusd/executor/visible.py`). On the CPU the UUIDs are made up: the zygote
and the executors start with them in their environment exactly as on a GPU host."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from salus.daemon.devices.discovery import probe_cuda_devices
from salus.daemon.engine.ports import Sent
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.executor.visible import BoundToAnotherGpu, device_for
from salus.daemon.loop import Link, Loop
from salus.daemon.supervisor.processes import (
    ExecutorHandle,
    ExecutorProcess,
    executor_environment,
)
from salus.daemon.supervisor.supervisor import Supervisor
from salus.daemon.wire.executor_ops import Lease, Place, decode_request, encode
from salus.daemon.wire.frames import FrameReader

A, B = "GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000"


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def test_the_executors_environment_lists_the_daemons_gpus_in_its_order() -> None:
    env = executor_environment({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1,0"}, [B, A])
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": f"{B},{A}",
                   "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                   "SALUS_DEVICE_KIND": "cuda"}
    assert executor_environment({"PATH": "/bin"}, []) == {
        "PATH": "/bin", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    # The caller's cuBLAS workspace stays (the daemon books the size it sets).
    assert executor_environment({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, [A])[
        "CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def _sent(supervisor: Supervisor, loop: Loop, meta: dict[str, object], uid: int = 1000,
          priority: float = 1.0, token: int = 1) -> dict[str, object]:
    """What an executor (of owner `uid`) receives when the engine sends it the request `meta`
    is through `supervisor`; the process stays registered with the supervisor as open."""
    ours, theirs = socket.socketpair()
    link = loop.add(Link(ours, lambda *_: None, lambda *_: None))
    record = JobRecord(3, Owner("ada", uid, uid), "j", 10, 0.0, priority=priority)
    process = ExecutorProcess(token, link, uid=uid)
    supervisor.pool.by_token[token] = process
    handle = ExecutorHandle(process, record, 0, sharable=False)
    supervisor.send(handle, Sent(decode_request(meta)), None)
    loop.run_once(0.0)
    reader = FrameReader(theirs)
    frames: list[object] = []
    deadline = time.monotonic() + 5
    while not frames and time.monotonic() < deadline:
        got, _ = reader.read(0.1)
        frames += [f.json() for f in got]
    loop.close(link, "done")
    theirs.close()
    (message,) = frames
    assert isinstance(message, dict)
    assert message.pop("for_job") == 3  # addressed to the handle's job
    return message


def test_a_place_on_a_gpu_carries_that_gpus_uuid() -> None:
    loop = Loop(time.monotonic)
    supervisor = Supervisor(loop, gpu_uuids=[A, B])
    got = _sent(supervisor, loop, encode(Place("cuda:1", 5 << 20, 1.0)))
    assert decode_request(got) == Place("cuda:1", 5 << 20, 1.0, B)
    cpu = Supervisor(loop)
    assert _sent(cpu, loop, encode(Place("cpu:0", 5 << 20, 1.0))) == encode(
        Place("cpu:0", 5 << 20, 1.0))
    assert _sent(supervisor, loop, encode(Lease(True))) == encode(Lease(True))
    supervisor.mps_clients = {1: ("/state/mps/GPU-b/pipe", 500 << 20)}  # cuda:1 has MPS
    got = _sent(supervisor, loop, encode(Place("cuda:1", 5 << 20, 1.0)), priority=0.25)
    assert decode_request(got) == Place("cuda:1", 5 << 20, 1.0, B,
                                        mps="/state/mps/GPU-b/pipe", mps_limit_bytes=500 << 20,
                                        mps_threads=25)
    got = _sent(supervisor, loop, encode(Place("cuda:0", 5 << 20, 1.0)))
    assert decode_request(got) == Place("cuda:0", 5 << 20, 1.0, A)  # no MPS there


def test_a_place_on_a_gpu_carries_its_memory_where_the_daemon_knows_it() -> None:
    """For the script's JAX and TensorFlow settings (`executor/framework_memory.py`)."""
    loop = Loop(time.monotonic)
    supervisor = Supervisor(loop, gpu_uuids=[A, B], gpu_total_bytes=[80 << 30, None])
    got = _sent(supervisor, loop, encode(Place("cuda:0", 5 << 20, 1.0)))
    assert decode_request(got) == Place("cuda:0", 5 << 20, 1.0, A, total_bytes=80 << 30)
    got = _sent(supervisor, loop, encode(Place("cuda:1", 5 << 20, 1.0)))
    assert decode_request(got) == Place("cuda:1", 5 << 20, 1.0, B)


def test_an_mps_gpu_tells_the_engine_whose_processes_are_its_clients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Legacy MPS runs one server per uid: every process placed on an MPS GPU joins its server,
    and the engine hears whose live processes are the GPU's clients (admission keeps other
    owners' jobs off the GPU while there are any: `salus.scheduler.mps`), once more when a
    client process is gone."""
    # root: owners' uids
    monkeypatch.setattr("salus.daemon.supervisor.supervisor.os.geteuid", lambda: 0)
    loop = Loop(time.monotonic)
    supervisor = Supervisor(loop, gpu_uuids=[A, B])
    supervisor.mps_clients = {1: ("/state/mps/GPU-b/pipe", 500 << 20)}
    told: list[tuple[int, frozenset[int]]] = []
    supervisor.on_mps_clients = lambda index, uids: told.append((index, uids))
    place = encode(Place("cuda:1", 5 << 20, 1.0))
    assert "mps" in _sent(supervisor, loop, place, uid=1000, token=1)
    assert "mps" in _sent(supervisor, loop, place, uid=1000, token=3)  # the same owner joins
    assert "mps" not in _sent(supervisor, loop, encode(Place("cuda:0", 5 << 20, 1.0)),
                              uid=1001, token=2)  # no MPS on cuda:0
    assert told == [(1, frozenset({1000}))] * 2
    for token in (1, 3):
        process = supervisor.pool.by_token[token]
        process.closed = True
        process.status = "exited 0"
        supervisor._maybe_report(process)
    assert told[-2:] == [(1, frozenset({1000})), (1, frozenset())]


@pytest.mark.slow
def test_the_zygote_and_its_executors_start_with_the_gpus_by_uuid() -> None:
    loop = Loop(time.monotonic)
    supervisor = Supervisor(loop, standby=1, gpu_uuids=[B, A])
    supervisor.start()
    try:
        supervisor.wait_ready()
        deadline = time.monotonic() + 30
        while supervisor.pool.standby[0].pid is None and time.monotonic() < deadline:
            loop.run_once(0.1)
        assert supervisor.pool.zygote is not None
        for pid in (supervisor.pool.zygote.pid, supervisor.pool.standby[0].pid):
            assert pid is not None
            env = _environ(pid)
            assert env["CUDA_VISIBLE_DEVICES"] == f"{B},{A}"
            assert env["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    finally:
        supervisor.stop()


def test_an_executor_narrows_to_its_gpu_before_cuda_starts() -> None:
    environ = {"CUDA_VISIBLE_DEVICES": f"{A},{B}"}
    assert device_for("cuda:1", B, cuda_started=False, environ=environ) == "cuda:0"
    assert environ["CUDA_VISIBLE_DEVICES"] == B
    assert device_for("cuda:1", B, cuda_started=True, environ=environ) == "cuda:0"
    assert device_for("cpu:0", None, cuda_started=False, environ=environ) == "cpu:0"
    assert environ["CUDA_VISIBLE_DEVICES"] == B


def test_an_executor_whose_cuda_started_cannot_move_to_another_gpu() -> None:
    wide = {"CUDA_VISIBLE_DEVICES": f"{A},{B}"}
    assert device_for("cuda:1", B, cuda_started=True, environ=wide) == "cuda:1"  # not narrowed
    with pytest.raises(BoundToAnotherGpu, match=f"started on {A}; a job placed on {B} needs a "
                                                "new executor"):
        device_for("cuda:1", B, cuda_started=True, environ={"CUDA_VISIBLE_DEVICES": A})


NARROWED = """
import os, sys, torch
from salus.daemon.executor.visible import device_for
torch.cuda.is_available()  # as an executor loading a job's state before its place may
device = device_for(sys.argv[1], sys.argv[2], cuda_started=torch.cuda.is_initialized(),
                    environ=os.environ)
torch.ones(1, device=device)
print(device, torch.cuda.device_count(), torch.cuda.get_device_properties(0).uuid)
"""


@pytest.mark.cuda
@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="needs a CUDA device")
def test_a_narrowed_executor_sees_only_its_gpu_as_cuda_0() -> None:
    gpus = probe_cuda_devices()
    if not gpus:
        pytest.skip("needs a CUDA device")
    last = gpus[-1]
    assert last.uuid is not None
    env = executor_environment(os.environ, [g.uuid or "" for g in gpus])
    done = subprocess.run([sys.executable, "-c", NARROWED, last.torch_device, last.uuid],
                          env=env, capture_output=True, text=True, timeout=300, check=True)
    device, count, uuid = done.stdout.split()
    assert (device, count) == ("cuda:0", "1")
    assert last.uuid.endswith(uuid)

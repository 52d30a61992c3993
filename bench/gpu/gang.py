"""A 2-replica data-parallel gang through salusd against one process training on the whole
batch: after the same steps the parameters must agree (float32 rounding apart).

The gang is `salus.connect(..., devices=2)`: each call goes to both replicas, each steps on half
the batch and averages gradients with `s.comm.all_reduce_gradients` (ring). The reference is
the same seeded model trained in this process. salusd places one replica per device and its
replicas join their process group with gloo before placement, so on a machine with one GPU the
gang runs on 2 CPU devices and the CUDA figure is skipped; with 2 GPUs it runs on CUDA, its
replicas joining NCCL once placed. Step times are client side, ms.

`nccl_join_one_replica`: salusd forms a process group only for gangs of 2 or more replicas, so
on one GPU a job placed on it joins a 1-replica group from inside its executor, through the
same `gang.join` a replica uses after placement (NCCL on CUDA; gloo on a CPU run, which says
so), and all-reduces a tensor of ones over it (`jobfns.one_replica_join`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jobfns
import kit
import models
import torch

import salus.adapters.torch as salus

State = dict[str, torch.Tensor]


def _reference(width: int, rows: int, steps: int) -> tuple[State, list[float]]:
    model = models.mlp(width)
    opt = models.sgd(model)
    x, y = models.batch(width, rows)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, times


def _gang(address: str, width: int, rows: int, steps: int) -> tuple[State, list[float]]:
    model = models.mlp(width)
    x, y = models.batch(width, rows)
    times = []
    with salus.connect(name="gang", iterations=steps, address=address, devices=2) as job:
        remote = job.attach(model=model, opt=models.sgd(model))
        step = remote.iteration(jobfns.gang_train)
        for _ in range(steps):
            start = time.perf_counter()
            step(x, y)
            times.append(time.perf_counter() - start)
        remote.pull("model")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, times


def _compare(address: str, device: str, small: bool) -> dict[str, Any]:
    width, rows, steps = (128, 64, 5) if small else (256, 512, 20)
    ours, gang_times = _gang(address, width, rows, steps)
    ref, ref_times = _reference(width, rows, steps)
    diff = max(float((ours[k] - ref[k]).abs().max()) for k in ref)
    return {
        "device": device,
        "steps": steps,
        "max_abs_param_diff": diff,
        "equal_within_1e-5": diff <= 1e-5,
        "gang_step_ms_median": statistics.median(gang_times[1:] or gang_times) * 1e3,
        "one_process_step_ms_median": statistics.median(ref_times) * 1e3,
        "backend": "gloo" if device.startswith("2 CPU") else "nccl (joined after placement)",
    }


def _one_replica_join(address: str) -> dict[str, Any]:
    """A job placed on one device joins a 1-replica group there and all-reduces over it."""
    model = models.mlp(64)
    with salus.connect(name="join", iterations=1, address=address) as job:
        joined: dict[str, Any] = job.attach(model=model).function(jobfns.one_replica_join)()
    return joined


def measure(cuda: bool, small: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="salusd-kit-gang-") as tmp:
        with kit.daemon(Path(tmp), cuda=False, cpu_devices=2, name="cpu") as d:
            out["cpu"] = _compare(d.address, "2 CPU devices", small)
            if not cuda:
                out["nccl_join_one_replica"] = {
                    **_one_replica_join(d.address),
                    "note": "a CPU run: the same join on gloo; NCCL needs CUDA"}
        if not cuda:
            out["cuda"] = kit.skipped("needs CUDA")
        elif torch.cuda.device_count() < 2:
            out["cuda"] = kit.skipped("one GPU: salusd places one replica per device, so a "
                                      "2-replica gang cannot share it")
        else:
            with kit.daemon(Path(tmp), cuda=True, name="cuda") as d:
                out["cuda"] = _compare(d.address, "2 GPUs", small)
        if cuda:
            try:
                with kit.daemon(Path(tmp), cuda=True, name="join") as d:
                    out["nccl_join_one_replica"] = _one_replica_join(d.address)
            except Exception as exc:  # noqa: BLE001 - keep the gang's figures
                out["nccl_join_one_replica"] = {"joined": False,
                                                "error": f"{type(exc).__name__}: {exc}"[:2000]}
    return out


if __name__ == "__main__":
    kit.step_main(measure, __doc__)

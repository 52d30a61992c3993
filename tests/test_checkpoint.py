"""A job's checkpoint on disk: a real training state comes back and trains on exactly like an
uninterrupted copy, identity between objects survives, the tensors are in safetensors, and a
crash before the rename or a damaged latest checkpoint leaves the previous one to load."""

from __future__ import annotations

import copy
import multiprocessing
import os
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from salus.daemon.executor.checkpoint import (
    MAX_MANIFEST_BYTES,
    latest_iteration,
    load_latest,
    save,
)


def _training_objects() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    model[3].bias.requires_grad_(False)  # a frozen parameter must stay frozen
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ema = torch.zeros(8)
    return {"model": model, "opt": opt, "sched": sched, "ema": ema, "ema_again": ema,
            "notes": {"epoch": 3, "losses": [0.5, 0.25], "tag": "run-1"}}


def _train(objects: dict[str, Any], loss_fn: Any, steps: int, seed: int) -> None:
    torch.manual_seed(seed)
    model, opt, sched = objects["model"], objects["opt"], objects["sched"]
    for _ in range(steps):
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            objects["ema"].mul_(0.9).add_(model[0].weight.sum(dim=1), alpha=0.1)
        objects["notes"]["losses"].append(loss.item())


def _payload() -> tuple[dict[str, Any], Any]:
    scale = 0.5  # captured: the function travels by value, closure included

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean() * scale

    objects = _training_objects()
    _train(objects, loss_fn, steps=3, seed=1)
    payload = {"objects": objects, "functions": {0: ("iteration", loss_fn)},
               "rng": {"cpu": torch.get_rng_state(), "cuda": []}}
    return payload, loss_fn


def test_a_training_state_round_trips_and_trains_on_identically(tmp_path: Path) -> None:
    payload, loss_fn = _payload()
    saved = save(tmp_path / "ckpt", 3, payload, extra={"loss": 0.1}, job_id=7)
    uninterrupted = copy.deepcopy(payload["objects"])

    loaded = load_latest(tmp_path / "ckpt")
    assert loaded is not None and loaded.iteration == 3 and loaded.path == saved.path
    assert loaded.manifest["job_id"] == 7 and loaded.manifest["extra"] == {"loss": 0.1}
    assert loaded.manifest["names"]["objects"] == sorted(payload["objects"])
    assert torch.equal(loaded.payload["rng"]["cpu"], payload["rng"]["cpu"])
    objects = loaded.payload["objects"]
    kind, fn = loaded.payload["functions"][0]
    assert kind == "iteration"
    x, y = torch.ones(2, 1), torch.zeros(2, 1)
    assert torch.equal(fn(x, y), loss_fn(x, y))
    assert objects["notes"] == uninterrupted["notes"]

    _train(objects, fn, steps=4, seed=2)
    _train(uninterrupted, loss_fn, steps=4, seed=2)
    for (name, a), (_, b) in zip(objects["model"].state_dict().items(),
                                 uninterrupted["model"].state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # BatchNorm's running stats included
    assert torch.equal(objects["ema"], uninterrupted["ema"])
    assert objects["sched"].get_last_lr() == uninterrupted["sched"].get_last_lr()
    assert objects["notes"]["losses"] == uninterrupted["notes"]["losses"]


def test_identity_parameters_and_gradients_survive(tmp_path: Path) -> None:
    payload, _ = _payload()
    model = payload["objects"]["model"]
    save(tmp_path, 3, payload)
    loaded = load_latest(tmp_path)
    assert loaded is not None
    objects = loaded.payload["objects"]
    params = list(objects["model"].parameters())
    opt = objects["opt"]
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], params, strict=True))
    assert all(any(key is p for p in params) for key in opt.state)
    assert objects["sched"].optimizer is opt
    assert objects["ema"] is objects["ema_again"]
    assert all(type(p) is nn.Parameter for p in params)
    assert [p.requires_grad for p in params] == [p.requires_grad for p in model.parameters()]
    assert objects["model"][3].bias.requires_grad is False
    for p, q in zip(params, model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        assert p.grad is None or torch.equal(p.grad, q.grad)


def test_the_tensors_are_in_safetensors(tmp_path: Path) -> None:
    payload, _ = _payload()
    objects = payload["objects"]
    saved = save(tmp_path, 3, payload)
    with safe_open(str(saved.path / "tensors.safetensors"), framework="pt") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - not a dict
    # every parameter, its gradient, buffer and Adam moment, the EMA (once) and the RNG state
    params = [p for p in objects["model"].parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    buffers = list(objects["model"].buffers())
    moments = [v for s in objects["opt"].state.values() for v in s.values()]
    expected = [*params, *grads, *buffers, *moments, objects["ema"], payload["rng"]["cpu"]]
    assert Counter(tuple(t.shape) for t in stored.values()) == Counter(
        tuple(t.shape) for t in expected)
    weight = objects["model"][0].weight
    assert any(torch.equal(t, weight.detach()) for t in stored.values())


def test_the_pickle_holds_no_tensor_bytes(tmp_path: Path) -> None:
    big = nn.Linear(1024, 1024)  # 4 MiB of weights
    saved = save(tmp_path, 0, {"model": big, "opt": torch.optim.SGD(big.parameters(), lr=0.1)})
    assert (saved.path / "objects.pkl").stat().st_size < 64 * 2**10
    assert (saved.path / "tensors.safetensors").stat().st_size > 4 * 2**20


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors are deprecated
def test_tensors_safetensors_cannot_hold_are_pickled(tmp_path: Path) -> None:
    sparse = torch.eye(3).to_sparse()
    complex_ = torch.tensor([1 + 2j, 3 - 1j])
    quantized = torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.1, 0, torch.qint8)
    dense = torch.arange(4.0)
    save(tmp_path, 0, {"s": sparse, "c": complex_, "q": quantized, "d": dense})
    loaded = load_latest(tmp_path)
    assert loaded is not None
    out = loaded.payload
    assert torch.equal(out["s"].to_dense(), sparse.to_dense()) and out["s"].is_sparse
    assert torch.equal(out["c"], complex_)
    assert torch.equal(out["q"].dequantize(), quantized.dequantize())
    assert torch.equal(out["d"], dense)
    # the sparse tensor's dense parts and the plain tensor go to safetensors, nothing complex
    shapes = sorted(r["shape"] for r in loaded.manifest["tensors"].values())
    assert shapes == [[2, 3], [3], [4]]


def _save_then_die(root: Path) -> None:
    save(root, 20, {"step": torch.full((3,), 20.0)}, _before_rename=lambda: os._exit(17))


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, 10, {"step": torch.full((3,), 10.0)})
    child = multiprocessing.get_context("fork").Process(target=_save_then_die, args=(tmp_path,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 17
    assert (tmp_path / f"tmp-20-{child.pid}" / "manifest.json").exists()  # all written

    assert latest_iteration(tmp_path) == 10
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.iteration == 10
    assert torch.equal(loaded.payload["step"], torch.full((3,), 10.0))

    save(tmp_path, 30, {"step": torch.full((3,), 30.0)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000010",
                                                          "ckpt-000000000030"]


def test_keep_bounds_the_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "job-7"
    for iteration in range(1, 6):
        save(root, iteration, {"i": torch.tensor(iteration)}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000000004",
                                                      "ckpt-000000000005"]
    save(root, 6, {"i": torch.tensor(6)}, keep=1)
    assert [p.name for p in root.iterdir()] == ["ckpt-000000000006"]
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_saving_an_iteration_again_replaces_it(tmp_path: Path) -> None:
    save(tmp_path, 5, {"v": 1})
    save(tmp_path, 5, {"v": 2})
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.payload == {"v": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000000005"]


@pytest.mark.parametrize("damage", ["no manifest", "truncated tensors", "garbage manifest",
                                    "huge manifest", "renamed to tmp"])
def test_a_damaged_latest_checkpoint_is_skipped(tmp_path: Path, damage: str) -> None:
    save(tmp_path, 1, {"w": torch.ones(64)}, keep=5)
    latest = save(tmp_path, 2, {"w": torch.full((64,), 2.0)}, keep=5).path
    if damage == "no manifest":
        (latest / "manifest.json").unlink()
    elif damage == "truncated tensors":
        os.truncate(latest / "tensors.safetensors", 100)
    elif damage == "garbage manifest":
        (latest / "manifest.json").write_text('{"iteration": 2, "format')
    elif damage == "huge manifest":
        os.truncate(latest / "manifest.json", MAX_MANIFEST_BYTES + 1)
    else:
        latest.rename(tmp_path / "tmp-2-1")

    assert latest_iteration(tmp_path) == 1
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.iteration == 1
    assert torch.equal(loaded.payload["w"], torch.ones(64))


def test_nothing_to_load(tmp_path: Path) -> None:
    assert load_latest(tmp_path / "missing") is None
    assert latest_iteration(tmp_path) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_are_saved_from_the_host_and_recorded(tmp_path: Path) -> None:
    model = nn.Linear(4, 2).cuda()
    save(tmp_path, 1, {"model": model})
    loaded = load_latest(tmp_path)
    assert loaded is not None
    assert {r["device"] for r in loaded.manifest["tensors"].values()} == {"cuda:0"}
    restored = loaded.payload["model"]
    assert restored.weight.device.type == "cpu"
    assert torch.equal(restored.weight, model.weight.detach().cpu())

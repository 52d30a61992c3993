"""Pipeline jobs through the real daemon on 2 CPU devices, device 1 slowed 3x (simulated),
and the pieces they are made of (the request check, the stage optimizer, the slowed stage).

Each pipeline job (even, sky and optimal splits) must end with the parameters of the unsplit
model trained in one process with the same micro-batching: the reference here is a plain loop
that backpropagates each micro-batch's loss, divides the summed gradients by their number and
steps. The sky and optimal splits must give the slowed device fewer layers; a restart after
kill -9 must resume each stage from its replica's checkpoint with the same split; bad requests
are refused with the reason.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from daemon_proc import RunningDaemon, job_root, salusd
from jobs import pipeline
from rest_client import connect, job, wait_for
from torch import nn
from torch.utils.data import DataLoader

from salus.daemon.engine.pipeline_spec import check_pipeline
from salus.daemon.executor import checkpoint
from salus.daemon.services.placement import split_model
from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.executor_ops import PipelineOptions

SLOWDOWN = ("--cpu-device-slowdown", "1,3")


def _daemon(tmp: Path, *args: str) -> Any:
    root = job_root(tmp, "pipeline.py")
    return salusd(tmp, "--http", "127.0.0.1:0", "--job-root", str(root), *SLOWDOWN, *args)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """One daemon for the tests that do not restart it."""
    with _daemon(tmp_path_factory.mktemp("salusd"), "--checkpoint-every", "1000") as running:
        yield running


def _submit(client: httpx.Client, entrypoint: str, iterations: int, **extra: Any
            ) -> httpx.Response:
    return client.post("/v1/jobs", json={"name": entrypoint.rsplit(":")[-1], "iterations":
                                         iterations, "entrypoint": entrypoint, **extra})


def _run(client: httpx.Client, entrypoint: str, iterations: int, **extra: Any
         ) -> dict[str, Any]:
    reply = _submit(client, entrypoint, iterations, devices=2, pipeline=True, **extra)
    assert reply.status_code == 201, reply.text
    jid = reply.json()["id"]
    ended = wait_for(lambda: (j := job(client, jid))["state"] in ("finished", "failed") and j,
                     f"job {jid} to end", timeout_s=120)
    if ended["state"] == "finished":  # its final checkpoint is written after it ends
        wait_for(lambda: (job(client, jid)["checkpoint"] or {}).get("iteration") == iterations,
                 f"job {jid}'s final checkpoint")
    return ended


def _stages(state: Path, jid: int, iterations: int) -> list[tuple[Any, dict[str, torch.Tensor]]]:
    """Each replica's split and stage parameters, from its last checkpoint."""
    out = []
    for replica in (0, 1):
        loaded = checkpoint.load_latest(state / "checkpoints" / str(jid) / f"replica{replica}")
        assert loaded is not None and loaded.iteration == iterations
        objects = loaded.payload["objects"]
        out.append((objects["pipeline"], objects["model"].state_dict()))
    return out


def _reference(iterations: int) -> dict[str, torch.Tensor]:
    """The unsplit model trained in this process, the gradient of each step being the mean of
    its micro-batches' gradients."""
    torch.set_num_threads(1)
    model = pipeline.model()
    opt = pipeline.optimizer(model)
    loader = DataLoader(pipeline.data(), batch_size=pipeline.BATCH, shuffle=True)
    it = iter(loader)
    for _ in range(iterations):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad()
        for xm, ym in zip(x.tensor_split(pipeline.MICROBATCHES),
                          y.tensor_split(pipeline.MICROBATCHES), strict=True):
            pipeline.loss(model(xm), ym).backward()
        for p in model.parameters():
            p.grad.div_(pipeline.MICROBATCHES)
        opt.step()
    return model.state_dict()


def _check_trained_like_one_process(stages: list[tuple[Any, dict[str, torch.Tensor]]],
                                    reference: dict[str, torch.Tensor]) -> None:
    got = {**stages[0][1], **stages[1][1]}
    assert sorted(got) == sorted(reference)
    for key, want in reference.items():
        assert torch.allclose(got[key], want, rtol=0, atol=1e-6), key


def test_the_daemon_checks_a_pipeline_request_without_the_model() -> None:
    assert check_pipeline(None, 1, 1) is None
    assert check_pipeline({}, 2, 1) == PipelineOptions("even", 1)
    assert check_pipeline({"placement": "sky", "microbatches": 8}, 3, 1) == PipelineOptions(
        "sky", 8)
    for bad, devices, nodes, reason in (
            ({}, 1, 1, 'needs "devices" of at least 2'),
            ({"placement": "best"}, 2, 1, "placement must be one of"),
            ({"microbatches": 0}, 2, 1, "microbatches must be an integer"),
            ({"microbatches": True}, 2, 1, "microbatches must be an integer"),
            ({"stages": 2}, 2, 1, "unknown pipeline options"),
            ({}, 2, 2, "one node")):
        with pytest.raises(BadRequest, match=reason):
            check_pipeline(bad, devices, nodes)


def test_a_stage_optimizer_keeps_each_group_hyperparameters_and_state() -> None:
    # Here: it imports torch.distributed.pipelining, seconds of every run's collection.
    from salus.daemon.executor.pipeline_job import stage_optimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": [*model[1].parameters(), *model[2].parameters()],
                            "lr": 0.5}], lr=0.1, momentum=0.9, nesterov=True)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    stage = split_model(model, [0, 2, 3])[0]
    mine = stage_optimizer(opt, stage)
    assert type(mine) is torch.optim.SGD and mine.defaults == opt.defaults
    assert [g["lr"] for g in mine.param_groups] == [0.1, 0.5]
    assert [len(g["params"]) for g in mine.param_groups] == [2, 2]
    assert mine.param_groups[1]["params"][0] is model[1].weight
    assert mine.state[model[1].weight] is opt.state[model[1].weight]
    assert model[2].weight not in mine.state
    last = stage_optimizer(opt, split_model(model, [0, 2, 3])[1])
    assert [g["lr"] for g in last.param_groups] == [0.5]
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    staged = stage_optimizer(adamw, stage)  # its defaults hold a key its constructor refuses
    assert type(staged) is torch.optim.AdamW and staged.defaults == adamw.defaults


@pytest.mark.slow
def test_pipelines_train_like_one_process_and_sky_unloads_the_slow_device(daemon):
    iterations, state = 7, daemon.state_dir  # 3 batches an epoch: into the third epoch
    client = connect(state)
    devices = client.get("/v1/devices").json()
    assert [d["compute_slowdown"] for d in devices] == [1.0, 3.0]
    ended = {p: _run(client, "pipeline.py:make_job", iterations, placement=p,
                     microbatches=pipeline.MICROBATCHES)
             for p in ("even", "sky", "optimal")}
    reference = _reference(iterations)
    for placement, info in ended.items():
        assert info["state"] == "finished", (placement, info["reason"])
        assert info["pipeline"] == {"placement": placement,
                                    "microbatches": pipeline.MICROBATCHES}
        stages = _stages(state, info["id"], iterations)
        _check_trained_like_one_process(stages, reference)
        plan = stages[0][0]
        assert stages[1][0].boundaries == plan.boundaries
        assert plan.compute_slowdowns == (1.0, 3.0)
        fast, slow = len(stages[0][0].layers), len(stages[1][0].layers)  # devices 0, 1
        if placement == "even":
            assert plan.boundaries == (0, 3, 6)
        else:
            assert slow < fast, (placement, plan.boundaries, plan.stage_times_s)


@pytest.mark.slow
def test_bad_pipeline_requests_are_refused_with_the_reason(daemon):
    client = connect(daemon.state_dir)
    one = _submit(client, "pipeline.py:make_job", 3, devices=1, pipeline=True)
    assert one.status_code == 422 and 'needs "devices" of at least 2' in one.json()["detail"]
    loose = _submit(client, "pipeline.py:make_job", 3, devices=2, placement="sky")
    assert loose.status_code == 422 and "pipeline" in loose.text
    not_sequential = _run(client, "pipeline.py:make_not_sequential", 3)
    one_layer = _run(client, "pipeline.py:make_one_layer", 3)
    assert not_sequential["state"] == "failed"
    assert "must be an nn.Sequential" in not_sequential["reason"], not_sequential["reason"]
    assert one_layer["state"] == "failed"
    assert "1 layer(s)" in one_layer["reason"] and "2 stages" in one_layer["reason"]


@pytest.mark.slow
def test_kill_9_then_restart_resumes_each_stage_with_its_split(tmp_path):
    iterations, state = 8, tmp_path / "state"
    with _daemon(tmp_path, "--checkpoint-every", "2") as (proc, _):
        client = connect(state)
        reply = _submit(client, "pipeline.py:make_job", iterations, devices=2, pipeline=True,
                        placement="sky", microbatches=pipeline.MICROBATCHES)
        assert reply.status_code == 201, reply.text
        jid = reply.json()["id"]
        wait_for(lambda: (job(client, jid)["checkpoint"] or {}).get("iteration", 0) >= 2,
                 "a checkpoint at iteration 2 or later")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = checkpoint.load_latest(state / "checkpoints" / str(jid) / "replica0")
    assert before is not None and before.iteration < iterations
    with _daemon(tmp_path, "--checkpoint-every", "2"):
        client = connect(state)
        done = wait_for(lambda: (j := job(client, jid))["state"] in ("finished", "failed") and j,
                        "the resumed pipeline to end", timeout_s=120)
        wait_for(lambda: (job(client, jid)["checkpoint"] or {}).get("iteration") == iterations,
                 "its final checkpoint")
    assert done["state"] == "finished", done["reason"]
    assert done["resumed_from"] >= 2
    stages = _stages(state, jid, iterations)
    assert stages[0][0].boundaries == before.payload["objects"]["pipeline"].boundaries
    _check_trained_like_one_process(stages, _reference(iterations))

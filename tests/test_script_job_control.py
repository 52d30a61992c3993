"""Script jobs under the daemon's control: reruns after a failure (`--restart on-failure`),
`suspend --swap`, metrics and policy switches while scripts run.

One real daemon (one CPU device under `fair`, REST on); the expected parameters come from the
same script run directly, uninterrupted (`OMP_NUM_THREADS=1`, as the daemon's executors run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_proc import salusd
from rest_client import connect, job, wait_for
from test_script_jobs import ENV, _job_named, assert_equal, direct, finish, salusd_run

from salus.daemon.cli.control import Control

TRAIN = """\
import os, sys, time
import torch
import salus.adapters.torch as salus

# crash: none | die-once (os._exit(1)) | exit-once (sys.exit(3)) | exit-always
crash, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
teacher = torch.nn.Linear(8, 1).requires_grad_(False)  # no optimizer steps it
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
ckpt = os.path.join(salus.resume_dir(), "ckpt.pt")
marker = os.path.join(salus.resume_dir(), "crashed")
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"])
    start = state["step"]
print("from", start, flush=True)
for step in range(start, steps):
    x = torch.randn(32, 8)
    loss = torch.nn.functional.mse_loss(model(x), teacher(x).sin())
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(pause)
    if (step + 1) % 5 == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "rng": torch.get_rng_state(), "step": step + 1}, ckpt)
    if step == 12 and (crash == "exit-always" or crash.endswith("-once")
                       and not os.path.exists(marker)):
        open(marker, "w").close()
        if crash == "die-once":
            os._exit(1)
        sys.exit(3)
torch.save(model.state_dict(), out)
print("done", flush=True)
"""
STEPS = 30


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One CPU device under `fair`, with REST; yields its address and state dir."""
    tmp = tmp_path_factory.mktemp("salusd")
    with salusd(tmp, "--policy", "fair", "--http", "127.0.0.1:0", devices=1,
                memory="2G") as (_, address):
        yield address, tmp / "state"


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The parameters of a direct, uninterrupted run."""
    cwd = tmp_path_factory.mktemp("direct")
    (cwd / "train.py").write_text(TRAIN)
    code, _, err = finish(direct(["train.py", "none", str(STEPS), "out.pt"], cwd,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    assert code == 0, err
    return dict(torch.load(cwd / "out.pt"))


def _train_in(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


def _ended(daemon: tuple[str, Path], name: str) -> dict[str, Any]:
    """The REST view of the last job named `name` (live or recently ended)."""
    with connect(daemon[1]) as client:
        jobs = [j for j in client.get("/v1/jobs").json() if j["name"] == name]
    assert jobs, name
    return dict(jobs[-1])


# ---- --restart on-failure ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("crash", ["die-once", "exit-once"])
def test_a_script_that_fails_once_reruns_from_its_checkpoint_and_ends_equal_to_a_direct_run(
        daemon: tuple[str, Path], expected: dict[str, torch.Tensor], tmp_path: Path,
        crash: str) -> None:
    """Its process dies (`os._exit(1)`) or exits 3 at step 13, after a checkpoint at step 10;
    the rerun goes on from that checkpoint, still attached to the caller's terminal, and ends
    bit-equal to the uninterrupted direct run."""
    cwd = _train_in(tmp_path)
    code, out, err = finish(salusd_run(
        daemon[0], ["train.py", crash, str(STEPS), "out.pt"], cwd, "--name", crash,
        "--restart", "on-failure", stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    assert (code, out) == (0, "from 0\nfrom 10\ndone\n"), err
    assert_equal(dict(torch.load(cwd / "out.pt")), expected)
    info = _ended(daemon, crash)
    assert info["state"] == "finished"
    assert info["script"]["restarts"] == 1 and info["script"]["max_restarts"] == 3
    why = "died: exit status 1" if crash == "die-once" else "exited with status 3"
    assert why in info["script"]["last_failure"]


@pytest.mark.slow
def test_reruns_are_bounded_and_the_last_status_is_the_callers(
        daemon: tuple[str, Path], tmp_path: Path) -> None:
    cwd = _train_in(tmp_path)
    code, out, err = finish(salusd_run(
        daemon[0], ["train.py", "exit-always", str(STEPS), "out.pt"], cwd, "--name", "always",
        "--restart", "on-failure", "--max-restarts", "2", stdout=subprocess.PIPE,
        stderr=subprocess.PIPE))
    assert (code, out) == (3, "from 0\nfrom 10\nfrom 10\n"), err
    info = _ended(daemon, "always")
    assert info["state"] == "failed"
    assert info["reason"].startswith("its command exited with status 3")
    assert info["reason"].endswith("(after 2 of at most 2 restarts)")
    (tmp_path / "never").mkdir()
    code, out, _ = finish(salusd_run(
        daemon[0], ["train.py", "exit-once", str(STEPS), "out.pt"], _train_in(tmp_path / "never"),
        "--name", "never", stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    assert (code, out) == (3, "from 0\n")  # without --restart: no rerun
    assert _ended(daemon, "never")["script"]["restarts"] == 0


@pytest.mark.slow
def test_rest_restart_on_failure_reruns_with_the_output_in_the_jobs_log(
        daemon: tuple[str, Path], expected: dict[str, torch.Tensor], tmp_path: Path) -> None:
    cwd = _train_in(tmp_path)
    with connect(daemon[1]) as client:
        reply = client.post("/v1/jobs", json={
            "name": "rest", "command": [sys.executable, "train.py", "die-once", str(STEPS),
                                        "out.pt"],
            "cwd": str(cwd), "env": {"PATH": os.environ["PATH"], **_threads()},
            "restart": "on-failure", "max_restarts": 1})
        assert reply.status_code == 201, reply.text
        ident = reply.json()["id"]
        done = wait_for(lambda: (j := job(client, ident))["state"] in (
            "finished", "failed") and j, "the job's end")
        assert done["state"] == "finished", done["reason"]
        assert done["script"]["restarts"] == 1 and done["script"]["max_restarts"] == 1
        log = client.get(f"/v1/jobs/{ident}/log", params={"offset": 0}).text
    assert log == "from 0\nfrom 10\ndone\n"
    assert_equal(dict(torch.load(cwd / "out.pt")), expected)


# ---- suspend --swap ---------------------------------------------------------------------------
@pytest.mark.slow
def test_suspend_swap_reaches_the_stepped_optimizer_and_its_modules_and_the_script_ends_equal(
        daemon: tuple[str, Path], expected: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """At a boundary the swap reaches the optimizer the step hook saw, its parameters,
    gradients and momentum buffers, and the two Linear layers owning them; it leaves the
    frozen teacher. On the CPU it moves no byte (the state is in host memory already), and
    the script, resumed, ends bit-equal to its direct run."""
    cwd = _train_in(tmp_path)
    proc = salusd_run(daemon[0], ["train.py", "none", str(STEPS), "out.pt", "0.05"], cwd,
                      "--name", "swap", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with Control(daemon[0]) as ctl:
        ident = _job_named(ctl, "swap")
        wait_for(lambda: ctl.info(ident)["iterations_done"] >= 5, "five iterations")
        ctl.suspend(ident, swap=True)
        wait_for(lambda: (ctl.info(ident)["script"]["swap"] or {}).get("swapped_out"),
                 "the swap")
        info = ctl.info(ident)
        held = info["iterations_done"]
        assert info["state"] == "suspended" and info["memory"]["swapped_out"]
        floats = (8 * 16 + 16) + (16 * 1 + 1)  # the model's parameters
        assert info["script"]["swap"] == {
            "optimizers": 1, "modules": 2, "tensors": 3 * 4, "bytes": 3 * 4 * floats,
            "moved_bytes": 0, "left_modules": info["script"]["swap"]["left_modules"],
            "left_tensors": info["script"]["swap"]["left_tensors"],
            "left_bytes": info["script"]["swap"]["left_bytes"], "device_bytes_left": None,
            "note": info["script"]["swap"]["note"], "swapped_out": True}
        swap = info["script"]["swap"]
        assert swap["left_modules"] >= 1 and swap["left_tensors"] >= 2  # the teacher
        assert swap["left_bytes"] >= 4 * (8 + 1)
        time.sleep(0.3)  # not a wait: the window in which a suspended job must not run
        assert ctl.info(ident)["iterations_done"] == held
        ctl.resume(ident)
        wait_for(lambda: not ctl.info(ident)["script"]["swap"]["swapped_out"], "the swap in")
        assert ctl.info(ident)["script"]["swap"]["moved_back_bytes"] == 0
    code, out, err = finish(proc)
    assert (code, out) == (0, "from 0\ndone\n"), err
    assert_equal(dict(torch.load(cwd / "out.pt")), expected)


# ---- metrics, status and policy switches --------------------------------------------------------
REPORTING = """\
import os, time
import torch
from salus.adapters.torch import script as salus

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(10):
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    salus.report(i + 1, 10, 0.5 * (i + 1))  # as a framework callback does
    time.sleep(0.03)
while not os.path.exists("go"):  # no boundary: the job's figures stay as they are
    time.sleep(0.01)
"""


def _metric(text: str, name: str, job_id: str) -> float | None:
    """One sample of the exposition `text` (None: no such sample)."""
    for line in text.splitlines():
        if line.startswith(f'{name}{{job_id="{job_id}"}} '):
            return float(line.split()[-1])
    return None


@pytest.mark.slow
def test_a_script_jobs_iterations_step_and_loss_show_in_metrics_and_status(
        daemon: tuple[str, Path], tmp_path: Path) -> None:
    (tmp_path / "report.py").write_text(REPORTING)
    proc = salusd_run(daemon[0], ["report.py"], tmp_path, "--name", "metrics",
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with Control(daemon[0]) as ctl, connect(daemon[1]) as client:
        ident = _job_named(ctl, "metrics")
        wait_for(lambda: ctl.info(ident)["iterations_done"] >= 9, "nine iterations")
        wait_for(lambda: _metric(client.get("/metrics").text, "salusd_job_step",
                                 ident) == 10, "the tenth step's report")

        def accounted() -> tuple[str, dict] | None:
            """The metrics and the job's status once they show its last report's loss and
            the same iterations (what the executor sent is accounted)."""
            text = client.get("/metrics").text
            done = next(j for j in ctl.status()["jobs"] if str(j["job_id"]) == ident)
            same = _metric(text, "salusd_job_iterations_total", ident) == done["iterations_done"]
            loss = _metric(text, "salusd_job_loss", ident)
            return (text, done) if same and loss is not None else None

        text, done = wait_for(accounted, "the executor's reports accounted")
        # The last iteration under the lease is reported at the next boundary (the exit).
        assert done["iterations_done"] in (9, 10)
        assert _metric(text, "salusd_job_iterations_total", ident) == done["iterations_done"]
        assert _metric(text, "salusd_job_loss", ident) == 5.0
        assert _metric(text, "salusd_job_restarts_total", ident) == 0
        assert f'salusd_job_info{{job_id="{ident}",kind="script",name="metrics"' in text
        assert done["last_loss"] == 5.0 and done["iterations_planned"] == 10
        (tmp_path / "go").touch()
        assert finish(proc)[0] == 0
        assert ctl.info(ident)["iterations_done"] == 10


@pytest.mark.slow
def test_policy_switches_while_two_scripts_run_under_fair_leave_both_equal_to_direct_runs(
        daemon: tuple[str, Path], expected: dict[str, torch.Tensor], tmp_path: Path) -> None:
    runs = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        cwd = _train_in(tmp_path / name)
        runs[name] = (cwd, salusd_run(daemon[0], ["train.py", "none", str(STEPS), "out.pt",
                                                  "0.08"], cwd, "--name", f"policy-{name}",
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    with Control(daemon[0]) as ctl, connect(daemon[1]) as client:
        idents = [_job_named(ctl, f"policy-{name}") for name in runs]
        wait_for(lambda: all(ctl.info(i)["iterations_done"] >= 3 for i in idents),
                 "both scripts running")
        for policy in ("srtf", "pack", "fifo", "fair"):
            assert client.put("/v1/policy", json={"policy": policy}).status_code == 200
            wait_for(lambda p=policy: client.get("/v1/policy").json() == {  # type: ignore
                "policy": p, "pending": None}, f"the switch to {policy}")
        states = [ctl.info(i)["state"] for i in idents]
        assert all(s in ("admitted", "running") for s in states), states  # switched meanwhile
    for name, (cwd, proc) in runs.items():
        code, out, err = finish(proc)
        assert (code, out) == (0, "from 0\ndone\n"), f"{name}: {err}"
        assert_equal(dict(torch.load(cwd / "out.pt")), expected, name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_swap_moves_the_reached_state_to_the_host_and_back_in_place() -> None:
    from salus.daemon.executor.script_swap import ScriptSwap

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[0].weight
    swap = ScriptSwap()
    out = swap.out([opt])
    floats = 64 * 64 + 64 + 64 + 1
    assert out["moved_bytes"] == 4 * 4 * floats  # parameters, gradients, exp_avg, exp_avg_sq
    assert out["bytes"] == out["moved_bytes"] + 4 * 4  # and Adam's steps, kept on the host
    assert weight.device.type == "cpu" and opt.state[weight]["exp_avg"].device.type == "cpu"
    assert swap.back()["moved_back_bytes"] == out["moved_bytes"]
    assert model[0].weight is weight and weight.device.type == "cuda"
    assert_equal(model.state_dict(), before)


def _threads() -> dict[str, str]:
    return {"OMP_NUM_THREADS": ENV["OMP_NUM_THREADS"]}

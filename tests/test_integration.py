"""End to end: the real `salusd serve` process, clients in separate processes over the socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_proc import RunningDaemon, salusd, wait_until
from workloads import batches, mlp, train_direct

import salus.adapters.torch as salus
from salus.daemon.wire.errors import JobCancelled, SalusError

pytestmark = pytest.mark.slow


SERVE = ("--policy", "pack", "--http", "127.0.0.1:0", "--first-call", "estimate")


@pytest.fixture(scope="module")
def daemon_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """One daemon for the tests that leave it serving (each start imports torch again)."""
    with salusd(tmp_path_factory.mktemp("salusd"), *SERVE, memory="256M") as daemon:
        yield daemon


@pytest.fixture
def own_daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    """A daemon of the test's own, for a test that stops it."""
    with salusd(tmp_path, *SERVE, memory="256M") as daemon:
        yield daemon


CLIENT = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import salus.adapters.torch as salus

    class Net(nn.Module):  # defined in the script: travels by value with cloudpickle
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 32)
            self.b = nn.Linear(32, 4)
        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    seed = int(sys.argv[1])
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(15)]
    with salus.connect(name=f"client{seed}", iterations=len(data)) as job:
        step = job.train_step(model, opt, nn.CrossEntropyLoss())
        if seed % 2:  # each loss read before the next step
            losses = [step(x, y) for x, y in data]
        else:  # every step submitted at once, the losses read at the end
            losses = [f.result() for f in [step.submit(x, y) for x, y in data]]
        remote = job.state_dict()
    direct = []
    for x, y in data:  # the same loop directly, for comparison
        opt.zero_grad()
        loss = nn.CrossEntropyLoss()(model(x), y)
        loss.backward()
        opt.step()
        direct.append(float(loss))
    diff = max((remote[k] - v).abs().max().item() for k, v in model.state_dict().items())
    print(json.dumps({"seed": seed, "max_abs_diff": diff, "same_losses": losses == direct}))
""")


def test_clients_in_separate_processes_match_direct_training(daemon_proc, tmp_path):
    proc, address = daemon_proc
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    env = {**os.environ, "SALUS_ADDRESS": address, "OMP_NUM_THREADS": "1"}
    clients = [subprocess.Popen([sys.executable, str(script), str(seed)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for seed in (1, 2, 3)]
    try:
        for c in clients:
            out, err = c.communicate(timeout=240)
            assert c.returncode == 0, err
            result = json.loads(out.strip().splitlines()[-1])
            assert result["max_abs_diff"] <= 1e-6 and result["same_losses"], result
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
                c.wait()
    assert proc.poll() is None


def test_socket_mode_garbage_and_disconnects_leave_the_daemon_serving(daemon_proc):
    proc, address = daemon_proc
    path = address.removeprefix("unix://")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    with socket.socket(socket.AF_UNIX) as s:  # garbage, then hang up
        s.connect(path)
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" * 10)
    with socket.socket(socket.AF_UNIX) as s:  # a frame header promising more than it sends
        s.connect(path)
        s.sendall(b"\x00" * 7)
    model, opt, loss_fn = mlp("sgd")
    data = batches("mlp", 5)
    with salus.connect(name="after-garbage", iterations=5, address=address) as job:
        step = job.train_step(model, opt, loss_fn)
        for x, y in data:
            step(x, y)
        state = job.state_dict()
    ref = train_direct(lambda: mlp("sgd"), data).state_dict()
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, atol=1e-6, rtol=0)
    assert proc.poll() is None


def test_sigterm_finishes_running_iterations_and_exits_cleanly(own_daemon):
    proc, address = own_daemon
    model, opt, loss_fn = mlp("adam")
    job = salus.connect(name="long", iterations=1000, address=address)
    step = job.train_step(model, opt, loss_fn)
    x, y = batches("mlp", 1)[0]
    assert isinstance(step(x, y), float)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    out = own_daemon.log_text()
    assert "shutting down" in out and "stopped" in out
    assert not os.path.exists(address.removeprefix("unix://"))
    with pytest.raises((JobCancelled, ConnectionError)):
        for _ in range(3):
            step(x, y)
            time.sleep(0.1)
    job.close()


def _salusd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "salus.daemon.cli", *args], text=True,
                          capture_output=True, timeout=120)


def test_control_commands_show_and_steer_a_running_job(daemon_proc):
    """`salusd status|suspend|resume|priority|cancel` through the REST API, finding the daemon
    and its admin token through its state dir."""
    proc, address = daemon_proc
    state = ("--state-dir", str(daemon_proc.state_dir))
    model, opt, loss_fn = mlp("sgd")
    x, y = batches("mlp", 1)[0]
    with salus.connect(name="steered", iterations=100, address=address) as job:
        step = job.train_step(model, opt, loss_fn)
        step(x, y)
        status = json.loads(_salusd("status", *state, "--json").stdout)
        (mine,) = [j for j in status["jobs"] if j["name"] == "steered"]
        assert mine["iterations_done"] == 1 and mine["state"] == "admitted"
        assert status["devices"][0]["used_bytes"] >= mine["persistent_bytes"] > 0
        table = _salusd("status", *state)
        assert table.returncode == 0 and "steered" in table.stdout
        top = _salusd("top", *state, "--count", "2", "--interval", "0.2")
        assert top.returncode == 0 and "steered" in top.stdout

        assert _salusd("suspend", job.id, "--swap", *state).returncode == 0

        def steered() -> dict:
            status = json.loads(_salusd("status", *state, "--json").stdout)
            (job_status,) = [j for j in status["jobs"] if j["name"] == "steered"]
            return job_status

        # The swap happens at the job's next boundary.
        after = wait_until(lambda: (j := steered())["swapped"] and j, 10, "the job swapped out")
        assert after["state"] == "suspended" and after["swapped"] is True
        assert _salusd("resume", job.id, *state).returncode == 0
        assert isinstance(step(x, y), float)  # runs again after resume

        bad = _salusd("priority", job.id, "-1", *state)
        assert bad.returncode == 1 and "priority" in bad.stdout
        missing = _salusd("cancel", "999", *state)
        assert missing.returncode == 1 and "999" in missing.stdout
        unauthorized = _salusd("status", *state, "--token", "wrong")
        assert unauthorized.returncode == 1 and "401" in unauthorized.stdout
        assert _salusd("cancel", job.id, *state).returncode == 0
        with pytest.raises(SalusError):
            step(x, y)
    assert proc.poll() is None


def test_admission_estimates_the_first_call_on_fake_tensors_or_says_why_not(daemon_proc):
    _, address = daemon_proc
    model, opt, loss_fn = mlp("sgd")
    x, y = batches("mlp", 1)[0]
    with salus.connect(name="estimated", iterations=5, address=address) as job:
        job.train_step(model, opt, loss_fn)(x, y)
        memory = job.info()["memory"]
        assert memory["ephemeral_estimate_method"] == "fake-tensor"
        assert 0 < memory["ephemeral_estimate_bytes"] <= memory["lane_bytes"]
    with salus.connect(name="data-dependent", iterations=5, address=address) as job:
        remote = job.attach(model=torch.nn.Linear(4, 4))

        @remote.iteration
        def count_positive(s, x):
            return s.model(x).sum() + len(torch.nonzero(x))  # a shape that depends on data

        count_positive(torch.randn(8, 4))
        method = job.info()["memory"]["ephemeral_estimate_method"]
        assert method.startswith("first call measured") and "EstimationError" in method


def test_memory_the_estimate_cannot_see_is_measured_on_every_call(daemon_proc):
    """A call that touches 96 MiB outside torch (a bytearray, invisible to the fake-tensor
    estimate and to any tensor tracker) from its third call on: the executor's peak meter sees
    it in that call, and the job is given a lane that holds it."""
    _, address = daemon_proc
    mib = 1 << 20
    with salus.connect(name="hidden", iterations=10, address=address) as job:
        remote = job.attach(model=torch.nn.Linear(4, 4))

        @remote.iteration
        def step(s, x, big):
            if int(big):
                scratch = bytearray(96 * mib)  # zero-filled, so every page is resident
                del scratch
            return s.model(x).sum()

        x = torch.randn(8, 4)
        for _ in range(2):
            step(x, torch.tensor(0))
        small = job.info()["memory"]
        assert small["ephemeral_estimate_method"] == "fake-tensor"
        assert small["ephemeral_estimate_bytes"] < 8 * mib
        step(x, torch.tensor(1))
        deadline = time.monotonic() + 30
        # A call under the lease is reported within 20 ms.
        memory = wait_until(lambda: (m := job.info()["memory"])[
            "ephemeral_measured_bytes"] and m["ephemeral_measured_bytes"] >= 90 * mib and m,
            30, "the 96 MiB call measured")
        assert 90 * mib <= memory["ephemeral_measured_bytes"] <= 120 * mib, memory
        while memory["lane_bytes"] < 90 * mib and time.monotonic() < deadline:
            step(x, torch.tensor(0))  # the move happens at the job's next boundary
            memory = job.info()["memory"]
        assert memory["lane_bytes"] >= memory["ephemeral_measured_bytes"] - 16 * mib, memory
        step(x, torch.tensor(0))  # moved, not failed: it goes on
        assert job.info()["state"] not in ("failed", "cancelled"), job.info()


def test_on_cpu_devices_the_first_call_is_measured_by_default(tmp_path):
    """`--first-call auto` (the default) on CPU devices: no fake-tensor run; the job is admitted
    with its persistent size as the guess and its first call's measured peak sizes its lane."""
    model, opt, loss_fn = mlp("sgd")
    data = batches("mlp", 3)
    with salusd(tmp_path) as (_, address), salus.connect(
            name="measured", iterations=len(data), address=address) as job:
        step = job.train_step(model, opt, loss_fn)
        for x, y in data:
            step(x, y)
        memory = job.info()["memory"]
        params = job.state_dict()
    assert memory["ephemeral_estimate_method"].startswith("first call measured")
    assert "--first-call measure" in memory["ephemeral_estimate_method"]
    assert memory["ephemeral_estimate_bytes"] == memory["persistent_bytes"]  # the guess
    # A small MLP's peak: not the ~15 MiB of libtorch code its first step faults in (files).
    assert memory["ephemeral_measured_bytes"] is not None
    assert memory["ephemeral_measured_bytes"] < 4 * 2**20, memory
    assert memory["lane_bytes"] >= memory["ephemeral_measured_bytes"] - 16 * 2**20
    torch.set_num_threads(1)  # the daemon's executors run one intra-op thread
    direct = train_direct(lambda: mlp("sgd"), data).state_dict()
    assert all(torch.equal(params[k], v) for k, v in direct.items())


def test_a_model_that_fills_most_of_the_device_is_admitted_and_its_lane_is_its_peak(tmp_path):
    """`--cpu-memory 256M`: a 4000 x 4000 linear layer with momentum SGD holds 183 MiB of state
    (weights, gradients, momentum) and needs a few MiB per step. Its first call is measured, not
    guessed at its state's size (which asked for 366 MiB and refused the job), and its lane is
    then what the call measured (within the CPU's 16 MiB measurement noise), not the state's
    size."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4000, 4000)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = [(torch.randn(4, 4000), torch.randn(4, 4000)) for _ in range(3)]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with salusd(tmp_path, devices=1, memory="256M") as (_, address), salus.connect(
            name="big", iterations=len(data), address=address) as job:
        step = job.train_step(model, opt, torch.nn.functional.mse_loss)
        for x, y in data:
            step(x, y)
        info = job.info()
        params = job.state_dict()
    memory = info["memory"]
    assert memory["persistent_bytes"] >= 3 * 4000 * 4000 * 4, memory  # weights, grads, momentum
    assert memory["ephemeral_estimate_bytes"] <= 16 * 2**20, memory  # the guess, not the state
    measured = memory["ephemeral_measured_bytes"]
    assert measured is not None and memory["lane_bytes"] <= measured + 16 * 2**20, memory
    torch.set_num_threads(1)
    direct = torch.nn.Linear(4000, 4000)
    direct.load_state_dict(start)
    direct_opt = torch.optim.SGD(direct.parameters(), lr=0.01, momentum=0.9)
    for x, y in data:
        direct_opt.zero_grad()
        torch.nn.functional.mse_loss(direct(x), y).backward()
        direct_opt.step()
    assert all(torch.equal(params[k], v) for k, v in direct.state_dict().items())


def test_a_report_request_is_answered_after_the_calls_before_it(daemon_proc):
    """Calls run under a lease reach the daemon in the executor's periodic report; when the
    daemon's count lags, `info()` asks the executor on the direct line to report at once. That
    request, sent behind calls in flight, is answered after them, and info counts them all."""
    _, address = daemon_proc
    with salus.connect(name="report", iterations=20, address=address) as job:
        remote = job.attach(model=torch.nn.Linear(4, 4))

        @remote.iteration
        def step(s, x):
            return s.model(x).sum()

        for _ in range(5):
            step(torch.randn(2, 4))
        futures = [step.submit(torch.randn(2, 4)) for _ in range(3)]
        report = job._request({"op": "report"}, direct=True)
        assert report.result() is None
        assert all(f.done() for f in futures)
        assert [f.result().shape for f in futures] == [torch.Size([])] * 3
        assert job.info()["calls_done"] == 8
        job.close(pull=False)


def test_fifo_leases_the_lane_to_its_head_job_while_another_waits(tmp_path: Path) -> None:
    """Under fifo the head job keeps its lane until it ends, so it holds the lane's lease
    while a second job waits in the same lane: the lane stays busy with it between its
    calls (no call of it is running then), the waiting job's call runs only once the head
    job closed, and both compute what the same calls compute directly."""
    from salus.daemon.cli.control import Control

    x = torch.randn(2, 4)
    with salusd(tmp_path, "--policy", "fifo", devices=1) as (_, address):
        with salus.connect(name="head", iterations=10, address=address) as head:
            torch.manual_seed(0)
            model_a = torch.nn.Linear(4, 2)
            expected_a = model_a(x).detach()
            step_a = head.attach(model=model_a).iteration(lambda s, x: s.model(x))
            assert torch.equal(step_a(x), expected_a)  # started first: fifo's head from now
            second = salus.connect(name="waits", iterations=10, address=address)
            model_b = torch.nn.Linear(4, 3)
            expected_b = model_b(x).detach()
            waiting = second.attach(model=model_b).iteration(lambda s, x: s.model(x)).submit(x)
            for _ in range(5):
                assert torch.equal(step_a(x), expected_a)
            with Control(address) as ctl:
                status = ctl.status()
            (device,) = status["devices"]
            (lane,) = device["lanes"]
            assert sorted(lane["jobs"]) == sorted([int(head.id), int(second.id)])
            assert lane["busy_job"] == int(head.id)  # held between calls: the lease
            done = {j["job_id"]: j["iterations_done"] for j in status["jobs"]}
            assert done[int(second.id)] == 0  # its call still waits
            head.close(pull=False)
        assert torch.equal(waiting.result(), expected_b)
        second.close(pull=False)

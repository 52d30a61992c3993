"""Script jobs on two CPU devices under `fair`: a job waiting for its turn moves to a device
that stands idle (a real daemon, `salusd run`).

Scripts A and C train for many steps, B plans many (`--iterations 1000000`) and ends early,
once the test lets it. A goes to device 0, B to the empty device 1, C to device 0 (a device
with fewer jobs first, ties to the lower index), where it takes turns with A. When B ends,
device 1 stands empty: a job of device 0 that waits for its turn moves there. Every script
ends bit-equal to its direct run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from daemon_proc import salusd

from salus.daemon.cli.control import Control

ENV_THREADS = {"OMP_NUM_THREADS": "1"}
TIMEOUT_S = 180
SCRIPT = textwrap.dedent("""\
    import os, sys, time
    import torch
    from torch import nn
    seed, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    gate = sys.argv[4] if len(sys.argv) > 4 else None
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    for step in range(steps):
        while gate is not None and step == 5 and not os.path.exists(gate):
            time.sleep(0.01)  # held here until the test lets it end
        time.sleep(0.01)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.save(model.state_dict(), out)
""")
# name: (seed, steps, planned iterations)
JOBS = {"A": (1, 150, 5), "B": (2, 10, 1_000_000), "C": (3, 150, 5), "D": (4, 150, 5)}
# policy: where each of its scripts is placed at submission
PLACED = {"fair": {"A": 0, "B": 1, "C": 0}}


def _argv(path: Path, name: str, out: Path, gate: Path) -> list[str]:
    seed, steps, _ = JOBS[name]
    return [str(path), str(seed), str(steps), str(out), *([str(gate)] if name == "B" else [])]


def _device_of(ctl: Control, name: str) -> int | None:
    jobs = [j for j in ctl.status()["jobs"] if j["name"] == name]
    return jobs[-1]["device"] if jobs else None


def _wait_placed(ctl: Control, name: str) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        device = _device_of(ctl, name)
        if device is not None:
            return device
        time.sleep(0.02)
    raise AssertionError(f"job {name} was never placed: {ctl.status()}")


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(PLACED))
def test_a_waiting_script_moves_to_the_idle_device_and_ends_bit_equal(
        tmp_path: Path, policy: str) -> None:
    names = list(PLACED[policy])
    env = {**os.environ, **ENV_THREADS}
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    direct_gate = tmp_path / "open"
    direct_gate.touch()
    direct = {name: subprocess.Popen([sys.executable, *_argv(path, name, tmp_path /
                                                            f"direct-{name}.pt", direct_gate)],
                                     env=env) for name in names}
    assert all(proc.wait(timeout=TIMEOUT_S) == 0 for proc in direct.values())
    want = {name: torch.load(tmp_path / f"direct-{name}.pt", weights_only=True)
            for name in names}

    gate = tmp_path / "let-b-end"
    runs: dict[str, subprocess.Popen[str]] = {}
    seen: dict[str, set[int]] = {name: set() for name in names}
    with salusd(tmp_path, "--policy", policy, devices=2, memory="512M") as (_, address):
        sock = address.removeprefix("unix://")

        def run(name: str) -> None:
            runs[name] = subprocess.Popen(
                [sys.executable, "-m", "salus.daemon.cli", "run", "--socket", sock, "--name",
                 name, "--iterations", str(JOBS[name][2]), "--", sys.executable,
                 *_argv(path, name, tmp_path / f"salusd-{name}.pt", gate)],
                cwd=tmp_path, env=env, text=True, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE)

        with Control(address) as ctl:
            for name in names:  # one at a time: each is placed knowing the ones before
                run(name)
                seen[name].add(_wait_placed(ctl, name))
            assert seen == {name: {d} for name, d in PLACED[policy].items()}, seen
            gate.touch()
            while any(proc.poll() is None for proc in runs.values()):
                for name in names:
                    device = _device_of(ctl, name)
                    if device is not None:
                        seen[name].add(device)
                time.sleep(0.02)
        log = (tmp_path / "salusd.log").read_text()
    for name, proc in runs.items():
        assert proc.wait(timeout=TIMEOUT_S) == 0, f"{name}: {proc.stderr and proc.stderr.read()}"
    moved = [name for name in names if name != "B" and 1 in seen[name]]
    assert moved, f"device 1 stood idle while jobs waited for turns on device 0: {seen}"
    assert re.search(r"job \d+ moved from device 0 to device 1", log), log[-3000:]
    for name in names:
        got = torch.load(tmp_path / f"salusd-{name}.pt", weights_only=True)
        for key, tensor in want[name].items():
            assert torch.equal(got[key], tensor), f"{name}/{key}"

"""MPS control daemons (`salusd/devices/mps.py`): one per GPU with its own pipe and log directories,
the client environment an executor takes before CUDA starts, and what status says with and
without MPS. The control program is a stand-in here; the GPU kit runs the real one."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from salus.daemon.devices.discovery import DeviceSpec, cpu_devices
from salus.daemon.devices.mps import CONTROL, PID_FILE, Mps, client_environment, thread_percentage

GPUS = [DeviceSpec(i, "cuda", f"cuda:{i}", "H100", 70 << 30, uuid=f"GPU-{i}aa",
                   total_bytes=80 << 30) for i in range(2)]


class Control:
    """A stand-in for nvidia-cuda-mps-control: records each call; `fail_on` makes `-d` fail
    for that GPU."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[list[str], dict[str, str], str | None]] = []
        self.fail_on = fail_on

    def __call__(self, argv: list[str], *, env: dict[str, str], input: str | None = None,
                 **_: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, env, input))
        failed = argv[-1] == "-d" and env["CUDA_VISIBLE_DEVICES"] == self.fail_on
        return subprocess.CompletedProcess(argv, 1 if failed else 0, "",
                                           "no MPS on this GPU" if failed else "")


def test_one_control_daemon_per_gpu_with_its_own_directories(tmp_path: Path) -> None:
    control = Control()
    mps = Mps(tmp_path, [*cpu_devices(1, 1 << 30), *GPUS], run=control,
              which=lambda name: f"/usr/bin/{name}")
    mps.start()
    assert [argv for argv, _, _ in control.calls] == [[f"/usr/bin/{CONTROL}", "-d"]] * 2
    for (_, env, _), gpu in zip(control.calls, GPUS, strict=True):
        assert env["CUDA_VISIBLE_DEVICES"] == gpu.uuid
        pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
        assert pipe == tmp_path / "mps" / str(gpu.uuid) / "pipe" and pipe.is_dir()
        assert Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    assert mps.pipe_for("GPU-1aa") == str(tmp_path / "mps" / "GPU-1aa" / "pipe")
    assert mps.describe("GPU-0aa").startswith("MPS")
    mps.stop()
    quits = control.calls[2:]
    assert [(argv[-1], text) for argv, _, text in quits] == [(f"/usr/bin/{CONTROL}", "quit\n")] * 2
    assert mps.pipe_for("GPU-0aa") is None


def test_without_the_control_program_or_when_it_fails_the_gpus_are_time_shared(
        tmp_path: Path) -> None:
    missing = Mps(tmp_path, GPUS, run=Control(), which=lambda name: None)
    missing.start()
    assert missing.pipe_for("GPU-0aa") is None
    assert "time-shared" in missing.describe("GPU-0aa") and "not installed" in missing.problem
    control = Control(fail_on="GPU-1aa")
    failing = Mps(tmp_path, GPUS, run=control, which=lambda name: name)
    failing.start()
    assert failing.running == {} and "no MPS on this GPU" in str(failing.problem)
    assert [text for _, _, text in control.calls] == [None, None, "quit\n"]  # GPU 0's quit
    unasked = Mps(tmp_path, GPUS, run=Control(), which=lambda name: name)
    assert "--mps not given" in unasked.describe("GPU-0aa")
    assert "CPU" in unasked.describe(None)


def test_a_client_is_held_to_its_limit_on_its_one_visible_gpu() -> None:
    assert client_environment("/s/mps/GPU-0/pipe", 3 << 30) == {
        "CUDA_MPS_PIPE_DIRECTORY": "/s/mps/GPU-0/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3072M"}
    # Rounded up to a MiB (never under the cap), and a job's share of the GPU's threads.
    assert client_environment("/p", (3 << 30) + 1, threads=25) == {
        "CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3073M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}


def test_a_jobs_priority_is_its_share_of_the_gpus_threads() -> None:
    assert [thread_percentage(p) for p in (10.0, 1.0, 0.5, 0.01)] == [100, 100, 50, 10]


def test_a_control_daemon_a_killed_salusd_left_is_stopped_before_a_new_one(
        tmp_path: Path) -> None:
    """A previous salusd killed with -9 left GPU 1's control daemon (its pipe's `control`):
    the next start asks it to quit, then starts its own."""
    left = tmp_path / "mps" / "GPU-1aa" / "pipe"
    left.mkdir(parents=True)
    (left / "control").touch()
    control = Control()
    Mps(tmp_path, GPUS, run=control, which=lambda name: name).start()
    calls = [(env["CUDA_VISIBLE_DEVICES"], argv[-1], text) for argv, env, text in control.calls]
    assert calls == [("GPU-1aa", CONTROL, "quit\n"), ("GPU-0aa", "-d", None),
                     ("GPU-1aa", "-d", None)]


FAKE_CONTROL = """#!/bin/sh
# A stand-in for nvidia-cuda-mps-control: -d starts a background "control daemon" (this script,
# named like the real one) that runs until told to quit; without arguments it records what it
# was told, with the pipe directory it was told through, in $FAKE_MPS_TOLD.
pipe="$CUDA_MPS_PIPE_DIRECTORY"
case "$1" in
  -d) setsid "$0" serve </dev/null >/dev/null 2>&1 &
      while [ ! -e "$pipe/control" ]; do sleep 0.01; done ;;
  serve) touch "$pipe/control"
      while [ ! -e "$pipe/quit" ]; do sleep 0.05; done
      rm -f "$pipe/control" "$pipe/quit" ;;
  *) while read -r line; do
       echo "$pipe $line" >> "$FAKE_MPS_TOLD"
       [ "$line" = quit ] && touch "$pipe/quit"
     done ;;
esac
"""


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The stand-in on PATH; yields the file where it records what it was told. Every control
    daemon it started is killed at the end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / CONTROL
    program.write_text(FAKE_CONTROL)
    program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_TOLD", str(tmp_path / "told"))
    (tmp_path / "told").touch()
    yield tmp_path / "told"
    for pid_file in tmp_path.rglob(PID_FILE):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _daemons(root: Path) -> dict[str, int]:
    """GPU UUID -> the pid recorded for its control daemon under `root`."""
    return {p.parent.name: int(p.read_text()) for p in (root / "mps").glob(f"*/{PID_FILE}")}


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat[stat.rindex(")") + 2] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_the_control_daemons_of_a_killed_salusd_quit_at_the_next_start(
        tmp_path: Path, fake_control: Path) -> None:
    """salusd (state dir `root`) started a control daemon per GPU and was killed with -9 (no
    stop): the next salusd tells each one `quit` through its own pipe, they end, and its own
    start with their pids recorded; its stop ends those."""
    root = tmp_path / "state"
    Mps(root, GPUS).start()
    left = _daemons(root)
    assert sorted(left) == ["GPU-0aa", "GPU-1aa"]
    assert not any(_gone(pid, 0.0) for pid in left.values())
    again = Mps(root, GPUS)
    again.start()
    assert again.running and again.problem is None
    told = fake_control.read_text().splitlines()
    assert sorted(told) == [f"{root / 'mps' / uuid / 'pipe'} quit" for uuid in sorted(left)]
    assert all(_gone(pid) for pid in left.values())
    now = _daemons(root)
    assert sorted(now) == sorted(left) and not set(now.values()) & set(left.values())
    again.stop()
    assert all(_gone(pid) for pid in now.values())


def test_a_dead_salusds_temporary_root_is_found_and_a_daemon_without_its_pipe_is_killed(
        tmp_path: Path, fake_control: Path) -> None:
    """Without a state dir each salusd's root is `<tmp>/salusd-<pid>`: the next one finds the
    root of one that is gone, quits the daemon whose pipe is there, kills by its recorded pid
    the one whose pipe was removed, and removes what was left."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    old_root = tmp_path / f"salusd-{dead.pid}"
    Mps(old_root, GPUS).start()
    left = _daemons(old_root)
    shutil.rmtree(old_root / "mps" / "GPU-1aa" / "pipe")  # its pipe is gone, its pid is kept
    live_root = tmp_path / f"salusd-{os.getpid()}"
    mps = Mps(live_root, GPUS[:1])
    mps.start()
    assert fake_control.read_text().splitlines() == [
        f"{old_root / 'mps' / 'GPU-0aa' / 'pipe'} quit"]
    assert all(_gone(pid) for pid in left.values())
    assert not old_root.exists()
    (ours,) = _daemons(live_root).values()
    mps.stop()
    assert _gone(ours)


def test_another_live_salusds_root_is_left_alone(tmp_path: Path, fake_control: Path) -> None:
    other = Mps(tmp_path / f"salusd-{os.getppid()}", GPUS[:1])  # a live process's root
    other.start()
    (pid,) = _daemons(other.root).values()
    Mps(tmp_path / f"salusd-{os.getpid()}", GPUS[:1]).start()
    assert not _gone(pid, 0.0) and fake_control.read_text() == ""
    other.stop()
    assert _gone(pid)


class _Placed:
    """A job kind that records where it was placed (`turns.on_place` does the CUDA side)."""

    job = 7

    def __init__(self) -> None:
        self.at: str | None = None

    def place(self, device: str, message: Any) -> Any:
        self.at = device
        return None


def test_an_executor_placed_on_an_mps_gpu_joins_as_a_client_held_to_its_cap_and_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before CUDA starts, a process placed on an MPS GPU takes the client environment: its
    pipe, a pinned limit of its cap (this job's budget and the cuBLAS workspace) plus its
    context, not the device's whole budget, and its job's share of the GPU's threads."""
    from salus.daemon.executor.cap import ProcessCap
    from salus.daemon.executor.turns import on_place
    from salus.daemon.wire.executor_ops import Place

    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY",
                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        monkeypatch.setenv(name, "")  # restored afterwards
    cap = ProcessCap()
    kind = _Placed()
    on_place(kind, Place("cuda:1", 3 << 30, 1.0, "GPU-1aa", mps="/s/pipe",
                         mps_limit_bytes=500 << 20, workspace_bytes=32 << 20,
                         mps_threads=thread_percentage(0.25)), None, cap)  # type: ignore[arg-type]
    assert kind.at == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-1aa"
    assert cap.bytes_on("cuda:0") >= (3 << 30) + (32 << 20)
    limit_mib = -(-(cap.bytes_on("cuda:0") + (500 << 20)) >> 20)
    assert {k: os.environ[k] for k in ("CUDA_MPS_PIPE_DIRECTORY",
                                       "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                                       "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")} == {
        "CUDA_MPS_PIPE_DIRECTORY": "/s/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit_mib}M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    assert limit_mib < 70 << 10  # far under the device's 70 GiB budget

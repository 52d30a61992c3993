"""A damaged state dir against the real daemon: a registry that is not a database stops it with
what to do; a restored job whose every checkpoint is unreadable ends failed with the reason
instead of starting over; a full state disk answers a clear error, not an internal one."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_proc import job_root, salusd
from rest_client import connect, job, wait_for

from salus.daemon.cli.control import Control
from salus.daemon.executor import checkpoint
from salus.daemon.state import checkpoint_files
from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.errors import StateDiskFull


def test_a_registry_that_is_not_a_database_stops_salusd_with_what_to_do(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "salusd.db").write_bytes(b"this is not SQLite\n" * 512)
    done = subprocess.run(
        [sys.executable, "-m", "salus.daemon.cli", "serve", "--socket",
         str(tmp_path / "s.sock"), "--state-dir", str(state), "--cpu-devices", "1", "--http",
         "none"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if "ERROR" in ln]
    assert f"the registry {state / 'salusd.db'} is damaged" in line
    assert "move it aside" in line and str(state / "checkpoints") in line


def test_the_daemon_judges_checkpoints_complete_as_executors_do(tmp_path: Path) -> None:
    root = tmp_path / "job"
    for iteration in (5, 10):
        checkpoint.save(root, iteration, {"objects": {"w": torch.ones(3)}}, keep=2)
    assert checkpoint_files.complete_iterations(root) == [10, 5]
    assert checkpoint.latest_iteration(root) == 10
    (root / "ckpt-000000000010" / "objects.pkl").write_bytes(b"short")
    assert checkpoint_files.complete_iterations(root) == [5] and checkpoint.latest_iteration(
        root) == 5
    (root / "ckpt-000000000005" / "manifest.json").write_text("{")
    assert checkpoint_files.complete_iterations(root) == []
    assert checkpoint.latest_iteration(root) is None
    assert not checkpoint_files.job_has_checkpoint(root)


@pytest.mark.slow
def test_a_restored_job_with_every_checkpoint_unreadable_ends_failed_with_the_reason(
        tmp_path: Path) -> None:
    args = ("--http", "127.0.0.1:0", "--job-root", str(job_root(tmp_path, "shuffled.py")),
            "--checkpoint-every", "3")
    with salusd(tmp_path, *args, devices=1) as (proc, _):
        client = connect(tmp_path / "state")
        reply = client.post("/v1/jobs", json={"name": "shuffled", "iterations": 10**6,
                                              "entrypoint": "shuffled.py:make_job"})
        assert reply.status_code == 201, reply.text
        jid = int(reply.json()["id"])
        wait_for(lambda: (job(client, jid)["checkpoint"] or {}).get("iteration", 0) >= 3,
                 "a checkpoint")
        family = [proc.pid, *_descendants(proc.pid)]
        for pid in family:  # the whole service, as systemd kills its cgroup: no executor
            with contextlib.suppress(ProcessLookupError):  # finishes a checkpoint after this
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: not any(map(_running, family[1:])), "the executors to be gone")
    ckpts = tmp_path / "state" / "checkpoints" / str(jid)
    manifests = list(ckpts.glob("ckpt-*/manifest.json"))
    assert manifests
    for manifest in manifests:
        manifest.write_text("damaged")
    with salusd(tmp_path, *args, devices=1):
        client = connect(tmp_path / "state")
        view = job(client, jid)
        assert view["state"] == "failed"
        assert "unreadable" in view["reason"] and str(ckpts) in view["reason"]
        assert "not restarted from iteration 0" in view["reason"]
        listed = {j["id"]: j for j in client.get("/v1/jobs").json()}
        assert listed[jid]["state"] == "failed" and listed[jid]["reason"] == view["reason"]
        status = subprocess.run(
            [sys.executable, "-m", "salus.daemon.cli", "status", "--state-dir",
             str(tmp_path / "state"), "--json", "--all"], capture_output=True, text=True,
            timeout=60)
        (shown,) = [j for j in json.loads(status.stdout)["jobs"] if j["id"] == jid]
        assert shown["state"] == "failed" and "unreadable" in shown["reason"]
    assert manifests[0].read_text() == "damaged"  # left for inspection


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    """The pids of every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (unmounted afterwards)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path) -> Path:
    """Write zeros into `directory/filler` until its file system is full."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, bytes(size)):
                    pass
    finally:
        os.close(fd)
    return filler


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="a tiny file system for the state dir needs root to mount a tmpfs")
def test_a_full_state_disk_is_a_clear_error_on_rest_and_the_socket(tmp_path: Path) -> None:
    try:
        ctx = tiny_tmpfs(tmp_path / "state", "4m")
        state = ctx.__enter__()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc.stderr!r}")
    try:
        root = job_root(tmp_path, "shuffled.py")
        with salusd(tmp_path, "--http", "127.0.0.1:0", "--job-root", str(root),
                    devices=1) as (proc, address):
            client = connect(state)
            filler = fill(state)
            reply = client.post("/v1/jobs", json={"name": "full", "iterations": 5,
                                                  "entrypoint": "shuffled.py:make_job"})
            assert reply.status_code == 507, reply.text
            body = reply.json()
            assert body["code"] == "state_disk_full"
            assert body["detail"].startswith("salusd's state disk is full: ")
            with Control(address) as ctl, pytest.raises(StateDiskFull,
                                                        match="state disk is full"):
                ctl.call(ops.Open("full", 5))
            filler.unlink()
            reply = client.post("/v1/jobs", json={"name": "roomy", "iterations": 5,
                                                  "entrypoint": "shuffled.py:make_job"})
            assert reply.status_code == 201, reply.text
            jid = int(reply.json()["id"])
            wait_for(lambda: job(client, jid)["state"] == "finished", "the job to finish")
            assert proc.poll() is None
    finally:
        ctx.__exit__(None, None, None)


def test_a_gang_killed_while_checkpointing_goes_on_from_the_checkpoint_all_replicas_hold(
        tmp_path: Path) -> None:
    job = tmp_path / "job"
    for replica, iterations in ((0, (4, 8, 12)), (1, (4, 8))):  # replica 1 killed writing 12
        for iteration in iterations:
            checkpoint.save(job / f"replica{replica}", iteration,
                            {"objects": {"w": torch.full((2,), float(iteration))}}, keep=3)
    assert checkpoint_files.gang_iteration(job, 2) == 8
    loaded = checkpoint.load_latest(job / "replica0", at=8)
    assert loaded is not None and loaded.iteration == 8
    assert torch.equal(loaded.payload["objects"]["w"], torch.full((2,), 8.0))
    assert checkpoint.load_latest(job / "replica0", at=99) is None
    assert checkpoint_files.gang_iteration(tmp_path / "none", 2) is None

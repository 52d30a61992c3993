"""What NVIDIA MPS enforces, for salusd's pods (issue 35): four facts, each with a verdict.

salusd's plan for a pod's device memory is MPS: its control daemon sets each client's pinned
device-memory limit, so that a pod's process cannot take more than its grant. Whether that holds
depends on the driver, so the kit asks it, on a private control daemon (its own pipe and log
directories, `CUDA_VISIBLE_DEVICES` the kit's GPU), with clients as subprocesses:

- `client_cannot_raise_limit`: the control daemon's default limit is 1 GiB
  (`set_default_device_pinned_mem_limit`); a client that sets
  `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` to 4 GiB in its own environment tries to allocate 2 GiB.
  True when it could not: the limit is the server's, not the client's to raise.
- `limit_per_process`: two clients at once each allocate 768 MiB under that 1 GiB default.
  True when both could: the limit is per client process, not shared by the server's clients.
- `two_uids_serialise` (root only: a client as `nobody`): a client of another uid starts CUDA
  while a root client holds the server. True when it waited for the root client to end
  (legacy MPS serves one uid at a time), with how long.
- `stop_busy_client_s`: a client busy launching kernels is ended with the control daemon's
  `terminate_client <server> <client>`; the seconds until its process is gone, and whether a
  second client of the same server is still running.

Skipped without CUDA or without `nvidia-cuda-mps-control`. Each fact that fails to run says
why in its own `error`, and the others still run.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import kit

CONTROL = "nvidia-cuda-mps-control"
GIB = 1 << 30
CLIENT = """
import json, os, sys, time
import torch
mode, size = sys.argv[1], int(sys.argv[2])
started = time.monotonic()
torch.zeros(1, device="cuda")  # CUDA starts: the client connects to the MPS server
out = {"pid": os.getpid(), "cuda_start_s": time.monotonic() - started}
try:
    held = torch.empty(size, dtype=torch.uint8, device="cuda") if size else None
    out["allocated"] = True
except RuntimeError as exc:
    out["allocated"], out["error"] = False, str(exc)[:300]
print(json.dumps(out), flush=True)
if mode == "hold":  # until stdin closes
    sys.stdin.read()
elif mode == "busy":  # kernels until it is ended
    x = torch.randn(2048, 2048, device="cuda")
    while True:
        x = (x @ x).tanh()
        torch.cuda.synchronize()
"""


@contextmanager
def control_daemon(tmp: Path, uuid: str | None) -> Iterator[dict[str, str]]:
    """A private MPS control daemon; yields the environment its clients (and commands) use."""
    pipe, logs = tmp / "pipe", tmp / "log"
    for directory in (pipe, logs):
        directory.mkdir()
        os.chmod(directory, 0o777)  # a client of another uid reaches the pipe
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
           "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    if uuid:
        env["CUDA_VISIBLE_DEVICES"] = uuid
    subprocess.run([CONTROL, "-d"], env=env, check=True, timeout=30, capture_output=True)
    try:
        yield env
    finally:
        with suppress(OSError, subprocess.SubprocessError):
            command(env, "quit")
        time.sleep(1.0)


def command(env: dict[str, str], line: str) -> str:
    """One command to the control daemon; its answer."""
    done = subprocess.run([CONTROL], input=line + "\n", env=env, capture_output=True, text=True,
                          timeout=30)
    return (done.stdout + done.stderr).strip()


def client(env: dict[str, str], mode: str, size: int, *, user: str | None = None,
           extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    prefix: list[str] = []
    if user is not None:
        who = pwd.getpwnam(user)
        prefix = ["setpriv", f"--reuid={who.pw_uid}", f"--regid={who.pw_gid}",
                  "--clear-groups"]
    return subprocess.Popen([*prefix, sys.executable, "-c", CLIENT, mode, str(size)],
                            env={**env, **(extra or {})}, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")


def first_line(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> dict[str, Any]:
    """The client's report (its first line), or why there is none."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return dict(json.loads(line))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    _, err = proc.communicate(timeout=10)
    return {"error": f"no report from the client (exit {proc.returncode}): {err[-300:]}"}


def end(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with suppress(OSError):
                proc.communicate("", timeout=20)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def cannot_raise(env: dict[str, str]) -> dict[str, Any]:
    print(command(env, "set_default_device_pinned_mem_limit 0 1G"), file=sys.stderr)
    proc = client(env, "once", 2 * GIB,
                  extra={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G"})
    seen = first_line(proc)
    end(proc)
    if "allocated" not in seen:
        return seen
    return {"client_cannot_raise_limit": not seen["allocated"], "client": seen}


def per_process(env: dict[str, str]) -> dict[str, Any]:
    procs = [client(env, "hold", 768 << 20) for _ in range(2)]
    seen = [first_line(p) for p in procs]
    end(*procs)
    if not all("allocated" in s for s in seen):
        return {"error": "a client did not report", "clients": seen}
    return {"limit_per_process": all(s["allocated"] for s in seen), "clients": seen}


def two_uids(env: dict[str, str]) -> dict[str, Any]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return kit.skipped("needs root and setpriv (a client of another uid)")
    holder = client(env, "hold", 0)
    held = first_line(holder)
    other = client(env, "once", 0, user="nobody")
    time.sleep(5.0)  # long enough for a client that is not held back to start CUDA
    waiting = other.poll() is None and not _has_output(other)
    released = time.monotonic()
    end(holder)
    seen = first_line(other, timeout_s=60.0)
    end(other)
    return {"two_uids_serialise": waiting and "cuda_start_s" in seen,
            "other_uid_started_after_release_s": time.monotonic() - released
            if "cuda_start_s" in seen else None, "holder": held, "other": seen}


def _has_output(proc: subprocess.Popen[str]) -> bool:
    import select

    assert proc.stdout is not None
    return bool(select.select([proc.stdout], [], [], 0)[0])


def stop_busy(env: dict[str, str]) -> dict[str, Any]:
    busy, other = client(env, "busy", 0), client(env, "hold", 0)
    seen, kept = first_line(busy), first_line(other)
    try:
        servers = command(env, "get_server_list").split()
        if not servers or "pid" not in seen:
            return {"error": f"no server or no client: {servers} {seen}"}
        time.sleep(1.0)
        started = time.monotonic()
        answer = command(env, f"terminate_client {servers[0]} {seen['pid']}")
        try:
            busy.wait(timeout=30)
            stopped_s: float | None = time.monotonic() - started
        except subprocess.TimeoutExpired:
            stopped_s = None
        return {"stop_busy_client_s": stopped_s, "terminate_answer": answer[:300],
                "other_client_alive": other.poll() is None, "other_client": kept,
                "busy_exit": busy.returncode}
    finally:
        end(busy, other)


def measure(cuda: bool, small: bool) -> dict[str, Any]:
    if not cuda:
        return kit.skipped("needs CUDA")
    if shutil.which(CONTROL) is None:
        return kit.skipped(f"{CONTROL} is not on PATH")
    uuid = _gpu_uuid()
    out: dict[str, Any] = {}
    for name, fact in (("pinned_limit", cannot_raise), ("per_process", per_process),
                       ("two_uids", two_uids), ("terminate", stop_busy)):
        with tempfile.TemporaryDirectory(prefix="salusd-kit-mps-") as tmp:
            os.chmod(tmp, 0o755)
            try:
                with control_daemon(Path(tmp), uuid) as env:
                    out[name] = fact(env)
            except Exception as exc:  # noqa: BLE001 - one fact's failure, the others go on
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return out


def _gpu_uuid() -> str | None:
    """The kit's GPU by UUID: the first one `CUDA_VISIBLE_DEVICES` names, else NVML's device 0
    (None: leave the control daemon every GPU)."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if named.startswith(("GPU-", "MIG-")):
        return named
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(int(named or 0)))
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    except Exception:  # noqa: BLE001 - without NVML: every GPU the driver shows
        return None


if __name__ == "__main__":
    kit.step_main(measure, __doc__)

"""Start the real `salusd serve` process for a test and read where it listens."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def salusd(tmp: Path, *args: str, devices: int = 2, memory: str = "512M", gpus: bool = False
           ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A running daemon on `tmp/salusd.sock` with `devices` CPU devices (`gpus`: the
    machine's GPUs instead); yields (process, address). Its log is kept in `tmp/salusd.log`;
    it is killed afterwards if still alive."""
    sock = tmp / "salusd.sock"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp / "salusd.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "salus.daemon.cli", "serve", "--socket", str(sock),
         "--state-dir", str(tmp / "state"),
         *(() if gpus else ("--cpu-devices", str(devices), "--cpu-memory", memory)),
         "--cpu-threads", "1", *(() if "--http" in args else ("--http", "none")),
         *args],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and "salusd listening on" not in line:
            line = proc.stdout.readline()
        assert f"unix://{sock}" in line, (tmp / "salusd.log").read_text()
        yield proc, f"unix://{sock}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def rss(pid: int) -> int:
    """Resident set size of process `pid`, in bytes (from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no VmRSS")


JOBS = Path(__file__).parent / "jobs"


def job_root(tmp: Path, *names: str) -> Path:
    """`tmp/job-root` (made readable to every job owner) holding the job files `names` from
    tests/jobs, for a daemon's `--job-root`."""
    root = tmp / "job-root"
    root.mkdir(exist_ok=True)
    for name in names:
        shutil.copy(JOBS / name, root / name)
    os.chmod(root, 0o755)
    return root

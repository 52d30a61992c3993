"""The demo's unchanged training script (`train.py`) started as plain processes or with
`salusd run`: batches of jobs at once or one after another, and jobs held resident while their
memory is read.

Every time here is wall-clock seconds from when the batch was started (`time.monotonic`) to
when the process the user started (`python` or `salusd run`) was seen to exit, so a plain
process's start-up (importing torch) is part of its job completion time (JCT).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TRAIN = str(Path(__file__).with_name("train.py"))
POLL_S = 0.01
STAGGER_S = 0.25  # between the starts of a batch's jobs


@dataclass(frozen=True)
class ScriptJob:
    """`train.py NAME ITERATIONS`: a workload of `workloads.py` and its optimizer steps."""

    name: str
    iterations: int


@dataclass(frozen=True)
class Ended:
    """One job of a batch: its JCT (seconds from the batch's start) and its final loss."""

    name: str
    jct_s: float
    final_loss: float | None


def command(job: ScriptJob, socket: Path | None, *, hold: bool = False) -> list[str]:
    """The script's command line: plain (`socket` None) or under `salusd run` at `socket`."""
    script = [sys.executable, TRAIN, job.name, str(job.iterations)] + (["--hold"] if hold else [])
    if socket is None:
        return script
    return [sys.executable, "-m", "salus.daemon.cli", "run", "--socket", str(socket),
            "--name", job.name, "--iterations", str(job.iterations), "--", *script]


def plain_env(threads: int) -> dict[str, str]:
    """The environment of a plain process: torch's intra-op threads set to `threads`, the
    number each job gets in the daemon (which sets its executors' threads itself)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def _start(job: ScriptJob, socket: Path | None, threads: int, *,
           hold: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(command(job, socket, hold=hold), env=plain_env(threads), text=True,
                            stdin=subprocess.PIPE if hold else subprocess.DEVNULL,
                            stdout=subprocess.PIPE)


def _result(job: ScriptJob, proc: subprocess.Popen[str], jct_s: float) -> Ended:
    assert proc.stdout is not None
    lines = proc.stdout.read().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(command(job, None))} exited {proc.returncode}")
    return Ended(job.name, jct_s, json.loads(lines[-1])["final_loss"])


def at_once(jobs: list[ScriptJob], socket: Path | None, threads: int,
            stagger_s: float = STAGGER_S) -> list[Ended]:
    """Start every job, `stagger_s` apart in their order (so the daemon sees them arrive in
    that order); each one's JCT is when its process was seen to exit."""
    began = time.monotonic()
    procs = []
    for i, job in enumerate(jobs):
        if i:
            time.sleep(stagger_s)
        procs.append(_start(job, socket, threads))
    exits: dict[int, float] = {}
    while len(exits) < len(procs):
        for i, proc in enumerate(procs):
            if i not in exits and proc.poll() is not None:
                exits[i] = time.monotonic() - began
        time.sleep(POLL_S)
    return [_result(job, proc, exits[i]) for i, (job, proc) in enumerate(zip(jobs, procs,
                                                                           strict=True))]


def one_after_another(jobs: list[ScriptJob], threads: int) -> list[Ended]:
    """Plain processes, each started when the one before exited, all counted from the
    first one's start (the batch was there at once; they ran in turn)."""
    began = time.monotonic()
    out = []
    for job in jobs:
        proc = _start(job, None, threads)
        proc.wait()
        out.append(_result(job, proc, time.monotonic() - began))
    return out


class Resident:
    """`count` copies of `job` started at once with `--hold`: once `pids` is set every one has
    trained and keeps its model and optimizer alive until the context ends. `pids` are the
    processes that run the script (plain processes, or the executors salusd forked);
    `clients` the `salusd run` processes (none for plain ones)."""

    def __init__(self, job: ScriptJob, count: int, socket: Path | None, threads: int) -> None:
        self.procs = [_start(job, socket, threads, hold=True) for _ in range(count)]
        self.pids: list[int] = []
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            while line and not line.startswith("{"):  # the first step's progress line
                line = proc.stdout.readline()
            if not line:
                self.close()
                raise RuntimeError(f"a resident {job.name} job exited {proc.wait()}")
            self.pids.append(int(json.loads(line)["pid"]))
        self.clients = [p.pid for p in self.procs] if socket is not None else []

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.communicate("\n", timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def __enter__(self) -> Resident:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rollup(pid: int) -> dict[str, int]:
    """The fields of /proc/PID/smaps_rollup of process `pid` (Pss, Rss, Private_Dirty, ...),
    bytes."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def memory(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of process `pid`, bytes, from /proc/PID/smaps_rollup: PSS splits each page
    shared between processes among them, so a group's PSS sum is what the group costs."""
    fields = rollup(pid)
    return fields.get("Pss", 0), fields.get("Rss", 0)


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in os.listdir(f"/proc/{p}/task"):
            with open(f"/proc/{p}/task/{task}/children") as f:
                todo += [int(c) for c in f.read().split()]
    return out


def group_memory(pids: list[int]) -> tuple[int, int]:
    """Summed (PSS, RSS) of `pids`, bytes."""
    pss = rss = 0
    for pid in pids:
        p, r = memory(pid)
        pss, rss = pss + p, rss + r
    return pss, rss

"""Switch latency: from the end of job A's iteration to the start of job B's, in one lane.

An in-process daemon (the real engine, zygote and executor processes) serves one CPU device
under `fair`, so its single lane alternates between two training jobs whose clients always have
their next call queued: every boundary is a switch (both clients attach, then start their loops
together). The executors stamp when each job's function began and ended (`time.monotonic`, one
clock for every process of the machine), so a switch is `began(B) - ended(A)`: the daemon
hearing A is done, picking B and B's executor starting it. The baseline is the same gap between
back-to-back iterations of one job, picked again when the policy picks it twice in a row (that
gap also holds the client's round trip). Prints one JSON object (microseconds).

    .venv/bin/python bench/switch.py [--iterations 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.daemon import Daemon, DaemonConfig
from salus.daemon.devices.discovery import cpu_devices


def client(address: str, name: str, iterations: int) -> None:
    """One training job's loop (run in its own process, so that no client shares the
    daemon's interpreter)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    with salus.connect(name=name, iterations=iterations, address=address) as job:
        step = job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.01),
                              nn.CrossEntropyLoss())
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        print("ready", flush=True)
        sys.stdin.readline()  # every client starts its loop at once: the lane is shared
        for _ in range(iterations):
            step(x, y)


def _clients(address: str, names: list[str], iterations: int) -> None:
    procs = [subprocess.Popen([sys.executable, __file__, "--client", address, name,
                               str(iterations)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for name in names]
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a client failed to attach (exit {p.wait()})")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.close()
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise RuntimeError(f"a client failed (exit {p.returncode})")


def _gaps(daemon: Daemon, names: set[str]) -> tuple[list[float], list[float]]:
    """(switch gaps, same-job gaps) in seconds from the engine's events: consecutive calls
    the scheduler dispatched one by one (`end` events). A job alone in the lane runs under a
    lease and reports its calls in batches (`ran`), so a gap across such a batch is not a
    boundary the scheduler decided and is left out."""
    ids = {e.job_id for e in daemon.engine.events.recent
           if e.kind == "open" and e.detail.get("name") in names}
    switch: list[float] = []
    same: list[float] = []
    last: tuple[float, int] | None = None
    for e in daemon.engine.events.recent:
        if e.job_id not in ids:
            continue
        if e.kind == "ran":
            last = None
        elif e.kind == "end" and e.detail.get("began"):
            if last is not None:
                (switch if last[1] != e.job_id else same).append(e.detail["began"] - last[0])
            last = (e.detail["ended"], e.job_id)
    return switch, same


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1e6 if len(values) > 1 else float("nan")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--client":
        client(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="salusd-switch-") as tmp:
        config = DaemonConfig(str(Path(tmp) / "s.sock"), cpu_devices(1, 512 * 2**20), "fair")
        daemon = Daemon(config)
        daemon.start()
        loop = threading.Thread(target=daemon.run, daemon=True)
        loop.start()
        address = f"unix://{config.socket_path}"
        print("two jobs sharing one lane under fair ...", file=sys.stderr)
        _clients(address, ["a", "b"], args.iterations)
        daemon.request_stop()
        loop.join(timeout=60)
    switch, same = _gaps(daemon, {"a", "b"})
    print(json.dumps({
        "bench": "switch",
        "unit": "microseconds from one iteration's end to the next one's start in a lane",
        "switches": len(switch),
        "switch_p50_us": _pct(switch, 50),
        "switch_p99_us": _pct(switch, 99),
        "same_job_gaps": len(same),
        "same_job_p50_us": _pct(same, 50),
        "same_job_p99_us": _pct(same, 99),
        "goal_switch_p99_us": 1000,
        "cpu_count": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()

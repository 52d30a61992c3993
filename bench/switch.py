"""Switch latency: from job A's iteration boundary to job B's first iteration start.

Two training jobs share one lane of an in-process daemon (policy fifo: the oldest job holds the
lane until it is suspended). Both clients keep a step queued. A controller repeatedly resumes
the waiting job and suspends the running one; the daemon's event log gives, for every switch,
the gap between the end of the old job's last iteration (the boundary) and the start of the new
job's first iteration. The baseline is the gap between two back-to-back iterations of the same
job in the same run. Prints one JSON object (microseconds).

    .venv/bin/python bench/switch.py [--switches 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch
from torch import nn

from salus.daemon.core import Daemon
from salus.daemon.devices import cpu_devices
from salus.daemon.errors import SalusError


def _job(daemon: Daemon, name: str, stop: threading.Event) -> tuple[str, threading.Thread]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    jid = daemon.open_job("bench", name, 10**9, "training")
    daemon.setup_training(jid, "bench", model, opt, nn.CrossEntropyLoss())
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def loop() -> None:
        # Two steps in flight, so the job is always ready at a boundary.
        try:
            pending = [daemon.step(jid, "bench", x, y) for _ in range(2)]
            while not stop.is_set():
                pending.pop(0).result()
                pending.append(daemon.step(jid, "bench", x, y))
        except SalusError:
            return  # cancelled at shutdown

    return jid, threading.Thread(target=loop, daemon=True)


def _percentiles(values: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(values, n=100)
    return {"p50_us": qs[49] * 1e6, "p99_us": qs[98] * 1e6, "n": len(values)}


def _switch(daemon: Daemon, running: str, waiting: str, switches: int) -> str:
    """Alternate the lane between the two jobs; returns the job left suspended."""
    for i in range(switches):
        time.sleep(0.004)
        if i:
            daemon.resume(waiting, "bench")
        daemon.suspend(running, "bench")
        running, waiting = waiting, running
        if i % 50 == 0:
            print(f"switch {i}/{switches}", file=sys.stderr)
    time.sleep(0.02)
    return waiting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switches", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    daemon = Daemon(cpu_devices(1, 512 * 2**20), "fifo")
    stop = threading.Event()
    a, ta = _job(daemon, "A", stop)
    b, tb = _job(daemon, "B", stop)
    ta.start()
    tb.start()
    try:
        # Whichever job was admitted first holds the lane; the other waits behind it.
        while True:
            done = {j: daemon.job_info(j, "bench") for j in (a, b)}
            if all(i["state"] != "open" for i in done.values()) and max(
                    i["iterations_done"] for i in done.values()) >= 2:
                break
            time.sleep(0.01)
        running = max(done, key=lambda j: done[j]["iterations_done"])
        _switch(daemon, running, b if running == a else a, args.switches)
    finally:
        stop.set()
        events = [e for e in list(daemon.events) if e.kind in ("start", "end")]
        daemon.shutdown()

    switch, same = [], []
    for prev, nxt in zip(events, events[1:], strict=False):
        if prev.kind == "end" and nxt.kind == "start":
            (switch if nxt.job_id != prev.job_id else same).append(nxt.t - prev.t)
    iteration = [e2.t - e1.t for e1, e2 in zip(events, events[1:], strict=False)
                 if e1.kind == "start" and e2.kind == "end"]
    sw, base = _percentiles(switch), _percentiles(same)
    print(json.dumps({
        "bench": "switch",
        "policy": "fifo",
        "unit": "microseconds from the end of one iteration to the start of the next",
        "switch_gap": sw,
        "same_job_gap": base,
        "iteration_p50_us": statistics.median(iteration) * 1e6,
        "switch_p50_over_same_job_p50": sw["p50_us"] / base["p50_us"],
        "goal_switch_p99_us": 1000.0,
    }))


if __name__ == "__main__":
    main()

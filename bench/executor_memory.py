"""What one more executor costs the host: its private memory beside the zygote it forked from.

Starts a CPU daemon, trains a tiny job (Linear(8, 16), 5 steps) in it, and reads
/proc/PID/smaps_rollup of the job's executor and of the zygote while the job is resident. The
executor's private pages (Private_Clean + Private_Dirty) are what a new executor adds: the rest
of its resident pages are torch's and Python's, shared copy-on-write with the zygote and paid
once. `salusd/devices/context_cost.py` books this figure for a new executor on a CPU device.

Prints one JSON object.

    .venv/bin/python bench/executor_memory.py
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.cli.launch import running_daemon
from salus.demo.scripts import rollup


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def main() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.manual_seed(0)
    model = nn.Linear(8, 16)
    with (tempfile.TemporaryDirectory(prefix="salusd-bench-") as tmp,
          running_daemon(Path(tmp) / "salusd.sock", state_dir=Path(tmp)) as daemon,
          salus.connect(name="executor-memory", iterations=5, address=daemon.address) as job):
        step = job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
        for _ in range(5):
            step(torch.randn(4, 8), torch.randn(4, 16))
        executor = int(job.info()["executor_pid"])
        ex, zygote = rollup(executor), rollup(_parent(executor))
    print(json.dumps({
        "bench": "executor_memory",
        "executor_private_bytes": ex["Private_Clean"] + ex["Private_Dirty"],
        "executor_pss_bytes": ex["Pss"],
        "executor_rss_bytes": ex["Rss"],
        "zygote_pss_bytes": zygote["Pss"],
        "zygote_rss_bytes": zygote["Rss"],
    }))


if __name__ == "__main__":
    main()

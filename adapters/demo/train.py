"""A plain PyTorch training script, as a user already has one: nothing of salusd in it.

    python train.py NAME ITERATIONS [--hold]

Trains workload NAME (`workloads.py`) for ITERATIONS optimizer steps, seeded; prints a line
after the first step, then one JSON line: its name, final loss, process id and when it ended
(Unix seconds). With `--hold` it
then keeps its model and optimizer alive until a line arrives on stdin (the demo reads memory
meanwhile). The demo runs it unchanged both as `python train.py ...` and as
`salusd run -- python train.py ...`, where each optimizer step is an iteration boundary.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from salus.demo.workloads import WORKLOADS


def main() -> None:
    name, iterations = sys.argv[1], int(sys.argv[2])
    workload = WORKLOADS[name]
    torch.manual_seed(0)
    model, opt, loss_fn = workload.build()
    assert opt is not None, f"{name} is not a training workload"
    g = torch.Generator().manual_seed(1)
    loss = None
    for step in range(1, iterations + 1):
        x, y = workload.batch(g)
        opt.zero_grad()
        out = loss_fn(model(x), y)
        out.backward()
        opt.step()
        loss = float(out.detach())
        if step == 1:
            print(f"{name}: step 1, loss {loss:.4f}", flush=True)
    print(json.dumps({"name": name, "final_loss": loss, "pid": os.getpid(),
                      "end": time.time()}), flush=True)
    if "--hold" in sys.argv:
        sys.stdin.readline()


if __name__ == "__main__":
    main()

"""A script job under `salusd run` on the kit's device: placed, capped, synchronised, measured.

An unchanged training loop (an MLP, SGD, 30 optimizer steps, each one of the job's iterations)
runs as `salusd run -- python SCRIPT`. The script reports what it sees: `CUDA_VISIBLE_DEVICES`
(one GPU's UUID expected: the one salusd placed it on), how many GPUs torch sees, the
allocator's per-process memory fraction where torch exposes it (the cap salusd set as the
script started CUDA), and its reserved peak; the daemon's view of the job (its measured
iteration peak, iterations done) is read after it. On the CPU the same loop runs on a CPU
device: only `ran` and `peak_reported` apply. `here`: the same with `salusd run --here` (the
script in `salusd run`'s own child, as in a pod), which must be placed, capped and measured
the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import kit

from salus.daemon.cli.control import Control

SCRIPT = """
import json, os, time
import torch

cuda = os.environ.get("KIT_CUDA") == "1"
device = torch.device("cuda" if cuda else "cpu")
torch.manual_seed(0)
width = int(os.environ["KIT_WIDTH"])
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                            torch.nn.Linear(width, width)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, width, device=device)
start = time.monotonic()
for _ in range(30):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
out = {"job": os.environ.get("SALUS_JOB_ID"), "seconds": time.monotonic() - start,
       "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
if cuda:
    torch.cuda.synchronize()
    out["device_count"] = torch.cuda.device_count()
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    out["memory_fraction"] = fraction(0) if fraction is not None else None
    out["max_reserved_bytes"] = torch.cuda.max_memory_reserved(0)
    out["memory_stats"] = {k: v for k, v in torch.cuda.memory_stats(0).items()
                           if k.endswith((".all.current", ".all.peak")) or "num_" in k}
print(json.dumps(out), flush=True)
"""


def measure(cuda: bool, small: bool) -> dict[str, Any]:
    width = 256 if small else 4096
    with tempfile.TemporaryDirectory(prefix="salusd-kit-script-") as tmp:
        folder = Path(tmp)
        script = folder / "train.py"
        script.write_text(textwrap.dedent(SCRIPT))
        with kit.daemon(folder, cuda=cuda, name="script") as d:
            env = {**os.environ, "KIT_CUDA": "1" if cuda else "0", "KIT_WIDTH": str(width)}
            env.pop("CUDA_VISIBLE_DEVICES", None)  # salusd chooses the GPU
            out = _run(d, script, env, cuda, here=False)
            # The same script in `salusd run`'s own child (`--here`, as in a pod)
            out["here"] = _run(d, script, env, cuda, here=True)
    return out


def _run(d: Any, script: Path, env: dict[str, str], cuda: bool, here: bool) -> dict[str, Any]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
                           str(d.socket), "--name", "kit-script-here" if here else "kit-script",
                           *(("--here",) if here else ()), "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=240, env=env,
                          cwd=script.parent)
    wall = time.monotonic() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    seen: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    info: dict[str, Any] = {}
    if seen.get("job"):
        with Control(d.address) as ctl:
            info = ctl.info(str(seen["job"]))
    memory = info.get("memory") or {}
    visible = seen.get("visible") or ""
    out: dict[str, Any] = {
        "exit_status": done.returncode,
        "stderr_tail": done.stderr[-1000:],
        "ran": done.returncode == 0 and bool(seen),
        "wall_s": wall,
        "loop_s": seen.get("seconds"),
        "iterations_done": info.get("iterations_done"),
        "daemon_measured_peak_bytes": memory.get("ephemeral_measured_bytes"),
        "peak_reported": isinstance(peak := memory.get("ephemeral_measured_bytes"), int)
        and peak > 0,
        "visible_devices": visible,
    }
    if cuda:
        out.update({
            "one_gpu_visible": seen.get("device_count") == 1 and visible.startswith(("GPU-",
                                                                                      "MIG-"))
            and "," not in visible,
            "memory_fraction": seen.get("memory_fraction"),
            "capped": isinstance(seen.get("memory_fraction"), float)
            and seen["memory_fraction"] < 1.0,
            "script_max_reserved_bytes": seen.get("max_reserved_bytes"),
            "executor_memory_stats": seen.get("memory_stats"),
        })
    return out


if __name__ == "__main__":
    kit.step_main(measure, __doc__)

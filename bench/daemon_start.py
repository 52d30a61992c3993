"""How long salusd takes to start, to answer a new job's first call, and to stop.

Each round launches `salusd serve` on one CPU device (no REST API) and times, from the launch:

- `listen_s`: until it prints that it listens (its socket is up);
- `first_call_s`: until a job connected from this process (torch already imported here) has
  attached a tiny model and had its first training step answered: the wait a user sees for a
  job sent to a daemon that has just started (the daemon's executor zygote imports torch, the
  executor code and warms up before it forks the job's executor);

and then `stop_s`: from SIGTERM until the process has exited. The baseline, measured in the
same rounds: `torch_import_s`, a fresh interpreter running `import torch`, the floor of any
start that needs torch. Prints one JSON object (medians over the rounds, and the ratios
`*_over_torch_import`).

    .venv/bin/python bench/daemon_start.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import salus.adapters.torch as salus


def _torch_import_s() -> float:
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - began


def _round(tmp: Path) -> dict[str, float]:
    sock = tmp / "salusd.sock"
    began = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "salus.daemon.cli", "serve", "--socket", str(sock),
         "--state-dir", str(tmp / "state"), "--cpu-devices", "1", "--cpu-memory", "256M",
         "--cpu-threads", "1", "--http", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"salusd did not start: {line!r} (exit {proc.poll()})")
        listen = time.monotonic() - began
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with salus.connect(name="first", iterations=1, address=f"unix://{sock}") as job:
            step = job.train_step(model, opt, torch.nn.functional.mse_loss)
            step(torch.zeros(4, 8), torch.zeros(4, 1))
            first = time.monotonic() - began
            job.close(pull=False)
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        return {"listen_s": listen, "first_call_s": first,
                "stop_s": time.monotonic() - stopping}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            got = _round(Path(tmp))
        got["torch_import_s"] = _torch_import_s()
        rounds.append(got)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in got.items()), file=sys.stderr)
    out = {key: round(statistics.median(r[key] for r in rounds), 3) for key in rounds[0]}
    for key in ("listen_s", "first_call_s"):
        out[f"{key.removesuffix('_s')}_over_torch_import"] = round(
            out[key] / out["torch_import_s"], 2)
    out["rounds"] = args.rounds
    print(json.dumps(out))


if __name__ == "__main__":
    main()
